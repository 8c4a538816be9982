"""``towerctl fleet restore``: bring the fleet's sessions back after a crash or a reboot,
each exactly once per boot.

For each entry of the daemon's restore plan (parents first) whose agent is gone and
that did not end, the agent is launched in its cwd, resuming its agent session, with
``TOWERD_SESSION_ID`` in its environment, in a window of one tmux session; then the
run waits for that session's SessionStart (the installed hook reports it, matched by
``TOWERD_SESSION_ID``) before the next. A sub-session never starts before its parent's
SessionStart arrived, whichever run launched the parent.

Exactly once: each launch runs under the idempotency key ``fleet.restore`` /
``<boot id>:<session id>`` held by this process. A repeated, retried or concurrent run
finds the key completed (launched earlier this boot) or in progress (another run is
launching it: it waits for that launch's SessionStart). A key whose run died mid-launch
is ``outcome_unknown``: it is settled from evidence, the session's SessionStart after
the claim or a live process of this user whose environment carries the session's
``TOWERD_SESSION_ID``; without either it is relaunched only once the launch timeout
has passed since the claim (until then the evidence may still come). The window's
command checks its claim at the daemon before it starts the agent
(client/restore_guard.py): a window made late, after its run died, starts nothing
another launch already started.

The launch command per agent kind is a table (``DEFAULT_LAUNCHERS``, overridden by the
TOML file ``$XDG_CONFIG_HOME/towerd/restore.toml``); an agent kind without one is
skipped and reported.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from towerd.client.restore_guard import DECIDE_S, GUARD_ENV, OPERATION, RUN_MARK
from towerd.protocol import fields
from towerd.protocol.errors import (
    Conflict,
    IdempotencyInProgress,
    IdempotencyKeyUnknown,
    OutcomeUnknown,
)

BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
DEFAULT_TMUX_SESSION = "towerd"
DEFAULT_TIMEOUT = 60.0  # seconds a launch may take to report its SessionStart
POLL = 0.2  # seconds between looks at the daemon while waiting
TMUX_CALL_TIMEOUT = 30.0  # seconds one tmux command may take (a launch's new-window)
# A rerun waits at most this long for a window still checking its claim: the window asks
# for DECIDE_S, and its last call may take a call timeout more.
GUARD_WAIT_S = DECIDE_S + 2 * fields.CALL_TIMEOUT_S

# Per agent kind: the command that resumes a session, then the arguments added when
# the session has a model or an effort. ``{agent_session_id}``, ``{model}``,
# ``{effort}``, ``{cwd}``, ``{session_id}`` are filled in.
DEFAULT_LAUNCHERS: dict[str, dict[str, list[str]]] = {
    "claude": {
        "command": ["claude", "--resume", "{agent_session_id}"],
        "model": ["--model", "{model}"],
        "effort": [],  # Claude Code takes no effort flag
    },
    "codex": {
        "command": ["codex", "resume", "{agent_session_id}"],
        "model": ["--model", "{model}"],
        "effort": ["-c", "model_reasoning_effort={effort}"],
    },
}


class RestoreError(Exception):
    """The restore cannot run at all (no tmux, a bad launcher table)."""


@dataclass
class Outcome:
    """What became of one session."""

    session_id: str
    name: str | None
    agent: str
    result: str  # started, already_live, skipped, failed
    reason: str = ""
    window: str | None = None
    argv: list[str] = field(default_factory=list)
    # False: it cannot be resumed at all (registered without an agent session id), and
    # unless named with --session it does not make the run fail
    resumable: bool = True


@dataclass
class Options:
    sessions: list[str] | None = None  # only these (default: the whole plan)
    dry_run: bool = False
    tmux_session: str = DEFAULT_TMUX_SESSION
    tmux_socket: str | None = None  # tmux -L
    timeout: float = DEFAULT_TIMEOUT
    config: str | None = None  # the launcher table's file


def boot_id() -> str:
    with open(BOOT_ID_PATH) as handle:
        return handle.read().strip()


def config_path() -> str:
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return os.path.join(base, "towerd", "restore.toml")


def launchers(path: str | None = None) -> dict[str, dict[str, list[str]]]:
    """The defaults, with the agent kinds of the TOML file (if any) replacing theirs:
    ``[agents.NAME]`` with ``command``, ``model``, ``effort`` (lists of strings)."""
    import tomllib

    table = {kind: dict(spec) for kind, spec in DEFAULT_LAUNCHERS.items()}
    path = path or config_path()
    try:
        with open(path, "rb") as handle:
            loaded = tomllib.load(handle)
    except FileNotFoundError:
        return table
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise RestoreError(f"{path}: {exc}") from None
    agents = loaded.get("agents", {})
    if not isinstance(agents, dict):
        raise RestoreError(f"{path}: [agents] must be a table")
    for kind, spec in agents.items():
        if not isinstance(spec, dict) or not _strings(spec.get("command")) or not spec["command"]:
            raise RestoreError(f"{path}: agents.{kind}.command must be a list of strings")
        for extra in ("model", "effort"):
            if extra in spec and not _strings(spec[extra]):
                raise RestoreError(f"{path}: agents.{kind}.{extra} must be a list of strings")
        table[kind] = {
            "command": spec["command"],
            **{k: spec.get(k, []) for k in ("model", "effort")},
        }
    return table


def _strings(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(item, str) for item in value)


def launch_argv(entry: dict[str, Any], spec: dict[str, list[str]]) -> list[str]:
    """The agent's command line for a plan entry; argv[0] resolved on PATH."""
    fields = {
        name: entry.get(name) or ""
        for name in ("agent_session_id", "model", "effort", "cwd", "session_id")
    }
    argv = [part.format(**fields) for part in spec["command"]]
    for extra in ("model", "effort"):
        if entry.get(extra):
            argv += [part.format(**fields) for part in spec.get(extra, [])]
    program = shutil.which(argv[0])
    if program is None:
        raise FileNotFoundError(f"{argv[0]} is not on PATH")
    return [os.path.abspath(program), *argv[1:]]


# --- tmux ---------------------------------------------------------------------------------


def _tmux(options: Options, *args: str) -> subprocess.CompletedProcess[str]:
    base = ["tmux"] + (["-L", options.tmux_socket] if options.tmux_socket else [])
    return subprocess.run([*base, *args], capture_output=True, text=True, timeout=TMUX_CALL_TIMEOUT)


def launch_in_tmux(
    options: Options, window: str, cwd: str, session_id: str, guarded: list[str]
) -> str:
    """Start ``guarded`` (``guarded_argv``) in a new window of the fleet's tmux session
    (made if missing); returns its pane's id. The window carries no TOWERD_SESSION_ID
    (a tmux server started inside an agent session inherited one) until its check sets
    it for the agent, and GUARD_ENV while that check decides."""
    command = "exec " + shlex.join(guarded)
    common = ["-P", "-F", "#{pane_id}", "-n", window, "-c", cwd,
              "-e", "TOWERD_SESSION_ID=", "-e", f"{GUARD_ENV}={session_id}"]  # fmt: skip
    target = options.tmux_session
    if _tmux(options, "has-session", "-t", f"={target}").returncode != 0:
        made = _tmux(options, "new-session", "-d", "-s", target, *common, command)
        if made.returncode == 0:
            return made.stdout.strip()
        if "duplicate session" not in made.stderr:  # it may have made the window: no other
            raise OSError(f"tmux new-session failed: {made.stderr.strip()}")
        # Another run made it meanwhile: a window in it, then.
    done = _tmux(options, "new-window", "-d", "-t", f"={target}:", *common, command)
    if done.returncode != 0:
        raise OSError(f"tmux new-window failed: {done.stderr.strip()}")
    return done.stdout.strip()


def guarded_argv(client: Any, key: str, ref: str, session_id: str, argv: list[str]) -> list[str]:
    """``argv`` behind the window's check of its claim (client/restore_guard.py), which
    also sets TOWERD_SESSION_ID for the agent. ``-P``: the window starts in the session's
    cwd, whose own modules (a project's ``select.py``) must not stand in for Python's or
    towerd's; the socket absolute, for the same reason."""
    return [
        sys.executable, "-P", "-m", "towerd.client.restore_guard",
        os.path.abspath(client.socket_path), client.principal or "", key, ref, session_id,
        "--", *argv,
    ]  # fmt: skip


def pane_alive(options: Options, pane_id: str) -> bool:
    """Whether the window's pane still runs; a window whose id is not known (tmux failed
    after making it) is taken as running: its agent was started."""
    if not pane_id:
        return True
    done = _tmux(options, "list-panes", "-t", pane_id, "-F", "#{pane_dead}")
    return done.returncode == 0 and "0" in done.stdout.split()


# --- evidence -----------------------------------------------------------------------------


def processes_with_session(session_id: str) -> list[int]:
    """Live processes of this user whose environment carries TOWERD_SESSION_ID=session_id."""
    return processes_with("TOWERD_SESSION_ID", session_id)


def processes_with(name: str, value: str) -> list[int]:
    """Live processes of this user whose environment carries ``name=value``."""
    needle = f"{name}={value}".encode()
    uid, found = os.geteuid(), []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if os.stat(f"/proc/{name}").st_uid != uid:
                continue
            with open(f"/proc/{name}/environ", "rb") as handle:
                environ = handle.read()
            with open(f"/proc/{name}/stat", "rb") as handle:
                state = handle.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if state not in (b"Z", b"X") and needle in environ.split(b"\0"):
            found.append(int(name))
    return found


class Restorer:
    """One run over the plan, against one client."""

    def __init__(self, client: Any, options: Options) -> None:
        self.client = client
        self.options = options
        self.boot = boot_id()
        self.table = launchers(options.config)

    # --- what the daemon says -------------------------------------------------------

    def row(self, session_id: str) -> dict[str, Any]:
        return dict(self.client.fleet_get(session_id))

    def is_live(self, session_id: str) -> bool:
        return self.row(session_id).get("live") is True or bool(processes_with_session(session_id))

    def session_started_since(self, session_id: str, since: int) -> bool:
        events = self.client.event_list(session_ids=[session_id], kinds=["SessionStart"], limit=1)
        return any(event["at"] >= since for event in events["events"])

    def wait(self, condition: Any, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while True:
            if condition():
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(POLL)

    # --- the run --------------------------------------------------------------------

    def run(self) -> list[Outcome]:
        # This box's sessions: on a store several boxes share, the plan's default is
        # every box's, and another box's agents are that box's to bring back.
        own = self.client.hello.get("daemon_id")
        plan = self.client.fleet_restore_plan(daemon_id=own)["sessions"]
        wanted = set(self.options.sessions) if self.options.sessions is not None else None
        outcomes = []
        for entry in plan:
            if wanted is not None and entry["session_id"] not in wanted:
                continue
            outcomes.append(self.restore(entry))
        if wanted is not None:
            known = {entry["session_id"] for entry in plan}
            for missing in sorted(wanted - known):
                outcomes.append(
                    Outcome(
                        missing,
                        None,
                        "?",
                        "skipped",
                        "not in the restore plan (ended, or not in this fleet)",
                    )
                )
        return outcomes

    def restore(self, entry: dict[str, Any]) -> Outcome:
        session_id, agent = entry["session_id"], entry["agent"]
        outcome = Outcome(session_id, entry.get("name"), agent, "skipped")
        if self.is_live(session_id):
            outcome.result, outcome.reason = "already_live", "its agent runs"
            return outcome
        spec = self.table.get(agent)
        if spec is None:
            outcome.reason = (
                f"no launch command for agent kind {agent!r} "
                f"(add [agents.{agent}] to {self.options.config or config_path()})"
            )
            return outcome
        if "{agent_session_id}" in " ".join(spec["command"]) and not entry.get("agent_session_id"):
            outcome.reason = "no agent session id to resume"
            outcome.resumable = False
            return outcome
        try:
            outcome.argv = launch_argv(entry, spec)
        except FileNotFoundError as exc:
            outcome.result, outcome.reason = "failed", str(exc)
            return outcome
        if self.options.dry_run:
            outcome.result, outcome.reason = "skipped", "dry run: would start"
            return outcome
        parent = entry.get("parent")
        # Its parent's SessionStart must have arrived (its row shows its agent live): a
        # process that carries its TOWERD_SESSION_ID but has not reported is not enough.
        if parent and not self.wait(
            lambda: self.row(parent).get("live") is True, self.options.timeout
        ):
            outcome.result = "failed"
            outcome.reason = f"its parent {parent} did not start within {self.options.timeout:g} s"
            return outcome
        return self.launch_once(entry, outcome)

    def launch_once(self, entry: dict[str, Any], outcome: Outcome) -> Outcome:
        session_id = entry["session_id"]
        key = f"{self.boot}:{session_id}"
        payload = {"session_id": session_id, "boot_id": self.boot}
        while True:
            try:
                claimed = self.client.idem_claim(OPERATION, key, payload=payload)
            except IdempotencyInProgress:
                return self.started_elsewhere(outcome, "another restore run is launching it")
            except OutcomeUnknown:
                if self.settle_unknown(key, session_id):
                    return self.started_elsewhere(
                        outcome, "launched by a run that died; it came up"
                    )
                continue  # abandoned (here or by another run): claim again
            if claimed["state"] == "completed":
                return self.started_elsewhere(outcome, "launched earlier this boot")
            break
        record = self.client.idem_get(OPERATION, key)
        ref = record["effect_ref"]
        window = self.options.tmux_session + ":" + (entry.get("name") or session_id[:8])
        try:
            pane_id = launch_in_tmux(
                self.options,
                entry.get("name") or session_id[:8],
                entry["cwd"],
                session_id,
                guarded_argv(self.client, key, ref, session_id, outcome.argv),
            )
        except (OSError, subprocess.SubprocessError) as exc:
            if self.settle_own(key, ref, None) != "completed":  # nothing started: retry
                outcome.result, outcome.reason = "failed", f"could not launch: {exc}"
                return outcome
            # tmux failed or timed out after making the window, which recorded the launch
            # before it started the agent: the launch is this run's, go on with it.
            pane_id = ""
        outcome.window = window
        started = self.wait(
            lambda: self.session_started_since(session_id, record["created_at"]),
            self.options.timeout,
        )
        if not started and processes_with(GUARD_ENV, session_id):
            # Its window is still checking the claim (a slow shell, a stalled daemon):
            # completed now, a check that then gave up would leave a launch marked done
            # that never started (a hostile tester's reproducer). Wait for it to decide.
            self.wait(lambda: not processes_with(GUARD_ENV, session_id), GUARD_WAIT_S)
            if pane_alive(self.options, pane_id):  # its agent starts only now
                started = self.wait(
                    lambda: self.session_started_since(session_id, record["created_at"]),
                    self.options.timeout,
                )
        if not started and not pane_alive(self.options, pane_id):
            now = self.settle_own(key, ref, None)  # the agent is gone: a retry may launch
            outcome.result = "failed"
            outcome.reason = (
                f"the agent exited before its SessionStart, or its window's check of the "
                f"claim did not start it (tmux {window}; the daemon unreachable from there?)"
            )
            if now == "completed":  # its window recorded the launch before the agent ran
                outcome.reason += (
                    f"; its launch is recorded (to launch it again this boot: towerctl idem "
                    f"reopen {OPERATION} {key})"
                )
            elif now is not None:
                outcome.reason += f"; its launch is {now}"
            return outcome
        # The result names the pane (RUN_MARK): a window whose check of the claim was
        # still starting then starts its agent (client/restore_guard.py).
        result = {"window": window, RUN_MARK: pane_id, "argv": outcome.argv}
        now = self.settle_own(key, ref, result)
        if now not in (None, "completed"):  # settled by another run meanwhile
            outcome.result = "failed"
            outcome.reason = f"its launch was settled {now} by another run (tmux {window})"
            return outcome
        if not started:
            outcome.result = "failed"
            outcome.reason = (
                f"no SessionStart within {self.options.timeout:g} s (it runs in tmux {window}; "
                "are towerd's hooks installed? towerctl hooks status)"
            )
            return outcome
        outcome.result, outcome.reason = "started", f"in tmux {window}"
        return outcome

    def settle_own(self, key: str, ref: str, result: dict[str, Any] | None) -> str | None:
        """Complete (with ``result``) or release (None) this run's claim ``ref``; None if
        done, else the launch's state now: its window may have settled it ``completed``
        (the claim was turned outcome_unknown under a live run: a PostgreSQL box declared
        dead, an operator's mark-unknown), or another run, after that, something else."""
        try:
            if result is None:
                self.client.idem_release(OPERATION, key, effect_ref=ref)
            else:
                self.client.idem_complete(OPERATION, key, result=result, effect_ref=ref)
            return None
        except (Conflict, IdempotencyKeyUnknown, OutcomeUnknown):
            try:
                record = self.client.idem_get(OPERATION, key)
            except IdempotencyKeyUnknown:
                return "released"
            return str(record["state"]) if record["effect_ref"] == ref else "claimed again"

    def settle_unknown(self, key: str, session_id: str) -> bool:
        """A launch whose run died: True if it happened (settled completed), False once
        it is known not to have (settled abandoned) or another run settled it first (the
        caller claims again and finds what that run did). Waits while evidence may come.

        The wait counts from the claim and lasts at least as long as the dead run's tmux
        call could still make the window (its own timeout, which a killed run no longer
        enforces, bounds the orphaned call): this run's ``--timeout`` alone was shorter
        than a slow tmux, and a rerun launched the session beside the orphan's window (a
        hostile tester's reproducer)."""
        try:
            record = self.client.idem_get(OPERATION, key)
        except IdempotencyKeyUnknown:
            return False  # another run abandoned it meanwhile: claim again
        since, ref = record["created_at"], record["effect_ref"]

        def evidence() -> bool:
            return self.session_started_since(session_id, since) or bool(
                processes_with_session(session_id)
            )

        waited_ms = max(0, self.client.ping()["now"] - since)
        left = max(0.0, max(self.options.timeout, TMUX_CALL_TIMEOUT) - waited_ms / 1000)
        happened = self.wait(evidence, left)
        if not happened and processes_with(GUARD_ENV, session_id):
            # A window still checking the claim may yet start the agent: wait for it to
            # decide (its calls are bounded; one stopped, past GUARD_WAIT_S, is not).
            self.wait(lambda: evidence() or not processes_with(GUARD_ENV, session_id),
                      GUARD_WAIT_S)  # fmt: skip
            happened = evidence()
        try:
            # Only the claim read above: one claimed again since (by a run that settled
            # it first) is another launch, not this one's to decide.
            if happened:
                self.client.idem_resolve(
                    OPERATION, key, "completed", result={"settled": "evidence"}, effect_ref=ref
                )
            else:
                self.client.idem_resolve(OPERATION, key, "abandoned", effect_ref=ref)
        except (Conflict, IdempotencyKeyUnknown):
            # Another run settled it meanwhile (and may have claimed it again): not an
            # error of this run's, whose other sessions must still be restored. Seen
            # launched, it is that run's; else claim again and find what it did.
            return happened
        return happened

    def started_elsewhere(self, outcome: Outcome, why: str) -> Outcome:
        """Launched by another run (or an earlier one): live within the timeout?"""
        if self.wait(lambda: self.is_live(outcome.session_id), self.options.timeout):
            outcome.result, outcome.reason = "already_live", why
            return outcome
        outcome.result = "failed"
        key = f"{self.boot}:{outcome.session_id}"
        try:
            state = self.client.idem_get(OPERATION, key)["state"]
        except IdempotencyKeyUnknown:
            state = None
        if state == "completed":
            again = f"to launch it again this boot: towerctl idem reopen {OPERATION} {key}"
        elif state is None:
            again = "that run released it: towerctl fleet restore again launches it"
        elif state == "in_progress":
            again = "another run is launching it: wait for it, or look at its tmux window"
        else:
            again = f"its launch is {state}; towerctl fleet restore again settles it"
        outcome.reason = f"{why}, but it is not live ({again})"
        return outcome


def restore(client: Any, options: Options) -> dict[str, Any]:
    """Run the restore; the report ``towerctl fleet restore`` prints."""
    if shutil.which("tmux") is None and not options.dry_run:
        raise RestoreError("tmux is not installed: fleet restore starts agents in tmux windows")
    outcomes = Restorer(client, options).run()
    named = set(options.sessions or ())
    return {
        "ok": all(
            o.result in ("started", "already_live")
            or (not o.resumable and o.session_id not in named)
            for o in outcomes
            if not options.dry_run
        ),
        "sessions": [vars(o) for o in outcomes],
    }
