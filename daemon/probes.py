"""Evidence probes: settle what the world can tell without a person.

An ``uncertain`` git-push effect (or one still ``in_flight`` whose holder died) that
recorded its target at claim time (repository, remote URL, commit, ref) is settled by
asking the remote: ``git ls-remote`` shows the ref at the commit, or at a commit that
has it as an ancestor (decided in the recorded repository, fetching the tip if it is
not there) -> ``committed``; the ref absent, or at a commit that does not contain it
-> ``aborted`` (a retry runs it afresh); the remote unreachable, or any error -> it
stays uncertain, probed again later with backoff. An ``outcome_unknown`` key claimed
with a probe command (``towerctl run --probe CMD``) is settled by running it: exit 0
completes the key, exit 1 releases it (the next run runs the command), anything else
leaves it unknown.

"Did not happen" is only ever concluded from positive evidence of absence (a remote
that answered without the ref, a probe that said 1), never from an error or a
timeout. Nothing whose holder still runs is probed, nor a key while the command
``towerctl run`` started for it (or anything that command started) still runs.

The probes run at start-up (once the daemon is serving: the network never holds up
READY), every ``--probe-interval`` seconds for what is due, and on ``effect.settle``
(``towerctl effects settle``; a probe already running is waited for, never run twice
at once). The external commands run in worker threads, each in
a session of its own, killed with it at ``--probe-timeout``; git gets none of the
daemon's ``GIT_*`` environment and no terminal to prompt on. Each verdict is written
through one store function that checks again that the effect (or key) is still the
one probed and unsettled, so a person's resolve or a new attempt in the meantime wins.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Any

import anyio
import structlog

from towerd.daemon import processes
from towerd.daemon.maintenance import Upkeep
from towerd.daemon.store import Store, effects, idempotency, reconcile
from towerd.daemon.store.tx import DAEMON
from towerd.protocol.methods import EffectSettleParams, GitPushTarget, ProbeOutcome
from towerd.protocol.naming import RUN_ATTEMPT_VARIABLE, effect_attempt_mark

log = structlog.get_logger("towerd.probes")

DEFAULT_PROBE_TIMEOUT = 30.0
MAX_SHOWN = 2000  # characters of a command's output kept as evidence
CONCURRENT_PROBES = 4
MIN_INTERVAL = 0.1  # seconds between passes at least, whatever --probe-interval says
OUTPUT_GRACE = 0.5  # seconds the output is still read for once the command itself exited
POLL_SLICE = 0.1  # seconds between looks at whether the command itself has exited
KEPT_BYTES = 4 * MAX_SHOWN  # of each output stream (MAX_SHOWN characters of UTF-8 at most)
READ_CHUNK = 65536
REAP_TIMEOUT = 5.0  # seconds a command killed at the timeout is waited for, at most

# Left out of a probe's environment: towerd's own supervisor plumbing, and a run's
# attempt token (a daemon started from a `towerctl run --probe` command would otherwise
# pass it to its probes, and their leftovers would hold that key's probe back).
NO_CARRIERS = processes.Carriers({}, [])  # nothing to wait for: no /proc scan needed
_SUPERVISOR_VARIABLES = (RUN_ATTEMPT_VARIABLE, "NOTIFY_SOCKET", "LISTEN_FDS", "LISTEN_PID",
                         "LISTEN_FDNAMES", "WATCHDOG_USEC", "WATCHDOG_PID")  # fmt: skip


@dataclass(frozen=True)
class Ran:
    """How an external command ended: its exit status (None: it could not be started or
    was killed at the timeout, ``error`` says which) and what it wrote."""

    status: int | None
    stdout: str
    stderr: str
    error: str | None = None


def run_command(argv: list[str], cwd: str | None, env: dict[str, str], timeout: float) -> Ran:
    """Run ``argv`` in a session of its own (so the whole group dies at the timeout),
    stdin closed, output captured: the first ``KEPT_BYTES`` of each stream, the rest read
    and dropped (``cat /dev/zero`` as a probe once grew the daemon by gigabytes).

    The command's own process decides: once it has exited, the output is read for at
    most ``OUTPUT_GRACE`` more seconds, so a descendant that left the group still holding
    the pipes (``setsid CMD &``, an ssh ControlPersist master) cannot hold a probe slot.
    Returns within about ``timeout + OUTPUT_GRACE + REAP_TIMEOUT`` whatever happens."""
    try:
        proc = subprocess.Popen(
            argv,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
    except OSError as exc:
        return Ran(None, "", "", f"cannot run {argv[0]}: {exc.strerror or exc}")
    assert proc.stdout is not None and proc.stderr is not None
    out, err = bytearray(), bytearray()
    kept = {proc.stdout.fileno(): out, proc.stderr.fileno(): err}
    deadline = time.monotonic() + timeout
    read_until: float | None = None  # set once the command's own process has exited
    try:
        with selectors.DefaultSelector() as selector:
            for fd in kept:
                selector.register(fd, selectors.EVENT_READ)
            while selector.get_map():
                now = time.monotonic()
                if read_until is None and proc.poll() is not None:
                    read_until = now + OUTPUT_GRACE
                limit = deadline if read_until is None else read_until
                if now >= limit:
                    if read_until is not None:  # what it left in its group holds the pipes
                        _kill_group(proc, reap=False)
                    break  # the deadline, or a descendant holds the pipes past the grace
                for ready, _events in selector.select(min(POLL_SLICE, limit - now)):
                    chunk = os.read(ready.fd, READ_CHUNK)
                    if not chunk:
                        selector.unregister(ready.fd)
                    elif len(stream := kept[ready.fd]) < KEPT_BYTES:
                        stream += chunk[: KEPT_BYTES - len(stream)]
        if proc.poll() is None:  # both pipes closed or the deadline: it must end by then
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                return Ran(None, "", "", f"timed out after {timeout:g} s")
    finally:
        _close_pipes(proc)
    return Ran(
        proc.returncode,
        out.decode("utf-8", "replace")[:MAX_SHOWN],
        err.decode("utf-8", "replace")[:MAX_SHOWN],
    )


def _kill_group(proc: subprocess.Popen[bytes], reap: bool = True) -> None:
    """SIGKILL the command's process group and reap the command, waiting a bounded time."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if not reap:
        return
    try:
        proc.wait(timeout=REAP_TIMEOUT)
    except subprocess.TimeoutExpired:
        log.warning("probe_not_reaped", pid=proc.pid, after_s=REAP_TIMEOUT)


def _close_pipes(proc: subprocess.Popen[bytes]) -> None:
    """Close our ends of the pipes without waiting for EOF: whoever still holds the other
    end gets EPIPE, not a reader."""
    for pipe in (proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()


def git_env() -> dict[str, str]:
    """The daemon's environment without any ``GIT_*`` (a stray GIT_DIR would point git
    elsewhere) and without a way to prompt: no terminal, ssh in batch mode."""
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith("GIT_") and name not in _SUPERVISOR_VARIABLES
    }
    env.update(GIT_TERMINAL_PROMPT="0", GIT_SSH_COMMAND="ssh -o BatchMode=yes", LC_ALL="C")
    return env


def _failure(ran: Ran) -> str:
    return ran.error or f"exit {ran.status}: {ran.stderr.strip()[-500:]}"


def probe_git_push(target: GitPushTarget, timeout: float) -> tuple[str, dict[str, Any]]:
    """(verdict, evidence) for a push of ``target.commit`` to ``target.ref`` of
    ``target.remote_url``: committed, aborted or unknown."""
    env = git_env()
    evidence: dict[str, Any] = {"probe": "git ls-remote", "remote_url": target.remote_url,
                                "ref": target.ref, "commit": target.commit}  # fmt: skip
    repo = target.repo if os.path.isdir(target.repo) else None
    listed = run_command(
        ["git", "ls-remote", target.remote_url, target.ref], repo or "/", env, timeout
    )
    if listed.status != 0:
        return "unknown", {**evidence, "error": f"git ls-remote: {_failure(listed)}"}
    tips = [
        line.split("\t", 1)[0]
        for line in listed.stdout.splitlines()
        if line.split("\t", 1)[-1] == target.ref
    ]
    if not tips:
        return "aborted", {**evidence, "remote_tip": None, "seen": "the remote has no such ref"}
    tip = tips[0]
    evidence["remote_tip"] = tip
    if tip == target.commit:
        return "committed", {**evidence, "seen": "the remote ref is at the commit"}
    if repo is None:
        return "unknown", {**evidence, "error": f"the repository {target.repo} is gone: "
                           "cannot tell whether the remote tip contains the commit"}  # fmt: skip
    git = ["git", "-C", repo]
    if run_command([*git, "cat-file", "-e", f"{tip}^{{commit}}"], repo, env, timeout).status:
        fetched = run_command(
            [*git, "fetch", "--no-tags", "--no-write-fetch-head", "--quiet",
             target.remote_url, target.ref],
            repo, env, timeout,
        )  # fmt: skip
        if fetched.status != 0:
            return "unknown", {**evidence, "error": f"git fetch: {_failure(fetched)}"}
        evidence["fetched"] = True
    decided = run_command(
        [*git, "merge-base", "--is-ancestor", target.commit, tip], repo, env, timeout
    )
    if decided.status == 0:
        return "committed", {**evidence, "seen": "the remote ref is at a descendant of the commit"}
    if decided.status == 1:
        return "aborted", {
            **evidence,
            "seen": "the remote ref is at a commit that does not contain the commit",
        }
    return "unknown", {**evidence, "error": f"git merge-base: {_failure(decided)}"}


def probe_command(command: str, cwd: str | None, timeout: float) -> tuple[str, dict[str, Any]]:
    """(verdict, evidence) of a key's probe command: exit 0 committed (it happened),
    1 aborted (it did not), anything else unknown."""
    evidence: dict[str, Any] = {"probe": command, "cwd": cwd}
    if cwd is not None and not os.path.isdir(cwd):
        return "unknown", {**evidence, "error": f"the directory {cwd} is gone"}
    env = {k: v for k, v in os.environ.items() if k not in _SUPERVISOR_VARIABLES}
    env["GIT_TERMINAL_PROMPT"] = "0"
    ran = run_command(["/bin/sh", "-c", command], cwd or "/", env, timeout)
    evidence.update(exit_status=ran.status, stdout=ran.stdout, stderr=ran.stderr)
    if ran.error is not None:
        evidence["error"] = ran.error
    if ran.error is not None or ran.status not in (0, 1):
        return "unknown", evidence
    return ("committed" if ran.status == 0 else "aborted"), evidence


class Prober:
    """Runs the probes: periodically (:meth:`run`) and on request (:meth:`settle`)."""

    NAME = "probes"  # its name in status.upkeep

    def __init__(
        self,
        store: Store,
        interval: float,
        upkeep: Upkeep | None = None,
        timeout: float = DEFAULT_PROBE_TIMEOUT,
    ) -> None:
        self.store = store
        self.interval = interval
        self.timeout = timeout
        self.upkeep = upkeep or Upkeep()
        self._limiter = anyio.CapacityLimiter(CONCURRENT_PROBES)
        # What is being probed now (an effect key, or a key's identity) -> its outcome to
        # come: a second pass that meets it waits for that probe instead of running it
        # again, and a long periodic pass does not hold up `effects settle` for the rest.
        self._running: dict[Any, tuple[anyio.Event, list[ProbeOutcome]]] = {}
        # Which attempt tokens a live process carries, or may (one not readable).
        self._running_commands = NO_CARRIERS

    @property
    def base_ms(self) -> int:
        return max(int(self.interval * 1000), 1000)

    async def run(self) -> None:
        """A pass at once (start-up reconciliation's probes), then every ``interval``
        seconds over what is due; a failing pass backs off like any upkeep task."""
        while True:
            await self.upkeep.attempt(self.NAME, lambda: self.settle(None, due_only=True))
            await anyio.sleep(self.upkeep.delay(self.NAME, max(self.interval, MIN_INTERVAL)))

    async def settle(
        self, params: EffectSettleParams | None, *, due_only: bool = False
    ) -> list[ProbeOutcome]:
        """Probe the effects ``params`` names, or every unsettled effect and every
        unknown key with a probe (``due_only``: those whose next probe is due)."""
        params = params or EffectSettleParams()
        found = await self.store.read(effects.to_probe, DAEMON, params, due_only)
        keys = [] if params.effect_keys or params.run_id else await self.store.read(
            idempotency.keys_to_probe, due_only
        )  # fmt: skip
        outcomes: list[ProbeOutcome | None] = [None] * (len(found) + len(keys))
        # One look at every process per pass: which run attempts still have a command
        # running (their keys wait; see _key).
        self._running_commands = await anyio.to_thread.run_sync(
            processes.carried_values, RUN_ATTEMPT_VARIABLE
        ) if any(key.attempt for key in keys) or any(
            item.verdict is None for item in found
        ) else NO_CARRIERS  # fmt: skip
        async with anyio.create_task_group() as tasks:
            for i, item in enumerate(found):
                if item.verdict is not None:
                    outcomes[i] = ProbeOutcome(item.verdict, item.status,
                                               effect_key=item.effect_key)  # fmt: skip
                else:
                    tasks.start_soon(self._once, item.effect_key, self._effect, item, outcomes, i)
            for j, key in enumerate(keys):
                ident = (key.principal, key.operation, key.key)
                tasks.start_soon(self._once, ident, self._key, key, outcomes, len(found) + j)
        if not (params.effect_keys or params.run_id):
            await self._reconcile_evidence()
        return [outcome for outcome in outcomes if outcome is not None]

    async def _reconcile_evidence(self) -> None:
        """Start-up reconciliation's own evidence (a fleet row, a message, a committed
        effect, a live agent process), looked for again for this daemon's unknown keys:
        evidence that appeared since settles them without a restart."""
        if not await self.store.read(reconcile.any_unknown):
            return  # nothing to write: no commit, no fsync
        completed, _still = await self.store.write(reconcile.settle_from_evidence)
        if completed:
            log.info("keys_completed_from_evidence", count=completed)

    async def _once(
        self, ident: Any, probe: Any, item: Any, outcomes: list[ProbeOutcome | None], slot: int
    ) -> None:
        """Run ``probe(item)`` unless a probe of the same thing is running: then its
        outcome is this one too."""
        running = self._running.get(ident)
        if running is not None:
            await running[0].wait()
            outcomes[slot] = running[1][0] if running[1] else None
            return
        done: list[ProbeOutcome] = []
        self._running[ident] = (anyio.Event(), done)
        try:
            done.append(await probe(item))
            outcomes[slot] = done[0]
        finally:
            self._running.pop(ident)[0].set()

    async def _effect(self, item: effects.ToProbe) -> ProbeOutcome:
        assert item.git is not None
        # towerctl effect run is gone, but its command, or one it started (the git push a
        # script runs), may still be pushing: "not there yet" would let a retry run it
        # beside them. Probed once none carries the attempt (as keys, _key).
        mark = effect_attempt_mark(item.attempt_id)
        running = self._running_commands.may_carry(mark, item.holder_start)
        if running is not None:
            return ProbeOutcome("holder_alive", item.status, {running[0]: running[1]},
                                effect_key=item.effect_key)  # fmt: skip
        verdict, evidence = await anyio.to_thread.run_sync(
            probe_git_push, item.git, self.timeout, limiter=self._limiter
        )
        outcome = await self.store.write(effects.record_probe, item, verdict, evidence,
                                         self.base_ms)  # fmt: skip
        self._log(outcome, effect_key=item.effect_key)
        return outcome

    async def _key(self, key: idempotency.KeyToProbe) -> ProbeOutcome:
        if key.attempt is not None:
            # towerctl (the holder) is gone, but the command it ran, or one that command
            # started, may still be doing the effect: a probe now could say "not done"
            # and let a retry run it beside them. Probed once none carries the attempt.
            running = self._running_commands.may_carry(key.attempt, key.holder_start)
            if running is not None:
                return ProbeOutcome("holder_alive", "outcome_unknown",
                                    {running[0]: running[1]}, principal=key.principal,
                                    operation=key.operation, key=key.key)  # fmt: skip
        verdict, evidence = await anyio.to_thread.run_sync(
            probe_command, key.probe, key.cwd, self.timeout, limiter=self._limiter
        )
        outcome = await self.store.write(idempotency.record_key_probe, key, verdict, evidence,
                                         self.base_ms)  # fmt: skip
        self._log(outcome, principal=key.principal, operation=key.operation, key=key.key)
        return outcome

    @staticmethod
    def _log(outcome: ProbeOutcome, **names: Any) -> None:
        if outcome.verdict == "unknown":
            log.warning("probe_inconclusive", code="probe_inconclusive", **names,
                        reason=(outcome.evidence or {}).get("error"))  # fmt: skip
        elif outcome.verdict in ("committed", "aborted"):
            log.info("settled_by_probe", verdict=outcome.verdict, status=outcome.status,
                     evidence=outcome.evidence, **names)  # fmt: skip
