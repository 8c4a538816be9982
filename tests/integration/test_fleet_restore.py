"""``towerctl fleet restore`` end to end: a real daemon, towerd's hooks installed into a
temporary $HOME, a fake ``claude`` first on PATH (it records its argv and environment,
runs the installed SessionStart hook as Claude Code would, and stays alive), and a
real tmux server on a private socket (``tmux -L``)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from towerd_testing import TOWERCTL, Daemon, wait_for

pytestmark = [
    pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux"),
    pytest.mark.both_backends,
]

FAKE_CLAUDE = """\
#!{python}
# A stand-in for Claude Code: record how it was started, then run the installed
# SessionStart hook through sh -c with Claude's JSON on stdin, then stay alive.
import json, os, subprocess, sys, time
argv = sys.argv[1:]
with open(os.environ["FAKE_AGENT_LOG"], "a") as log:
    log.write(json.dumps({{"argv": argv, "pid": os.getpid(), "cwd": os.getcwd(),
                          "session": os.environ.get("TOWERD_SESSION_ID")}}) + "\\n")
if os.path.exists(os.environ.get("FAKE_AGENT_EXIT_IF", "/nonexistent")):
    sys.exit(1)  # an agent that dies before its SessionStart
gate = os.environ.get("FAKE_AGENT_GATE")
while gate and not os.path.exists(gate):
    time.sleep(0.05)
resumed = argv[argv.index("--resume") + 1] if "--resume" in argv else "fresh"
settings = json.load(open(os.path.expanduser("~/.claude/settings.json")))
command = settings["hooks"]["SessionStart"][-1]["hooks"][-1]["command"]
payload = {{"session_id": resumed, "cwd": os.getcwd(), "hook_event_name": "SessionStart",
           "source": "resume", "transcript_path": "/t/" + resumed + ".jsonl"}}
subprocess.run(["sh", "-c", command], input=json.dumps(payload).encode(), check=True)
while True:
    time.sleep(3600)
"""


class Fleet:
    """The daemon, the environment agents and restores run in, and the fake agent's log."""

    def __init__(self, root: Path, daemon: Daemon) -> None:
        self.daemon = daemon
        self.home = root / "home"
        self.bin = root / "bin"
        self.log = root / "agents.log"
        self.tmux_socket = f"towerd-test-{uuid.uuid4().hex[:8]}"
        self.home.mkdir()
        self.bin.mkdir()
        claude = self.bin / "claude"
        claude.write_text(FAKE_CLAUDE.format(python=sys.executable))
        claude.chmod(0o755)
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith(("TOWERD_", "TMUX"))},
            "HOME": str(self.home),
            "PATH": f"{self.bin}:/usr/local/bin:/usr/bin:/bin",
            "TOWERD_SOCKET": str(daemon.socket_path),
            "FAKE_AGENT_LOG": str(self.log),
        }
        done = subprocess.run(
            [TOWERCTL, "hooks", "install", "--agent", "claude"], env=self.env, capture_output=True
        )
        assert done.returncode == 0, done
        self.work = root / "work"
        self.work.mkdir()
        self.cleanups: list[Callable[[], None]] = []

    def launches(self) -> list[dict]:
        if not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines()]

    def restore(self, *args: str, **popen) -> subprocess.Popen:
        return subprocess.Popen(
            [TOWERCTL, "--json", "fleet", "restore", "--tmux-socket", self.tmux_socket,
             "--timeout", "20", *args],
            env=self.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen,
        )  # fmt: skip

    def restored(self, *args: str) -> tuple[int, dict]:
        proc = self.restore(*args)
        out, err = proc.communicate(timeout=120)
        return proc.returncode, json.loads(out) if out.strip() else {"stderr": err}

    def dead_sessions(self, count: int = 3) -> list[str]:
        """``count`` sessions (the last a sub-session of the first) that ran under a fake
        agent, reported their SessionStart, and whose agent then died (kill -9)."""
        ids = []
        with self.daemon.client() as client:
            for n in range(count):
                parent = ids[0] if n == count - 1 and ids else None
                ids.append(
                    client.session_register(
                        cwd=str(self.work), agent="claude", name=f"s{n}",
                        agent_session_id=f"agent-{n}-{uuid.uuid4().hex[:6]}", parent=parent,
                    )["session_id"]
                )  # fmt: skip
            rows = {row["session_id"]: row for row in client.fleet_list()["sessions"]}
        for session_id in ids:
            agent = subprocess.Popen(
                [str(self.bin / "claude"), "--resume", rows[session_id]["agent_session_id"]],
                env={**self.env, "TOWERD_SESSION_ID": session_id, "FAKE_AGENT_LOG": os.devnull},
                cwd=self.work,
            )
            with self.daemon.client() as client:
                wait_for(lambda s=session_id: client.fleet_get(s)["live"] is True, what="live")
            agent.send_signal(signal.SIGKILL)
            agent.wait(10)
        with self.daemon.client() as client:
            for session_id in ids:
                wait_for(lambda s=session_id: client.fleet_get(s)["live"] is False, what="gone")
        return ids

    def close(self) -> None:
        for cleanup in self.cleanups:
            cleanup()
        subprocess.run(["tmux", "-L", self.tmux_socket, "kill-server"], capture_output=True)


@pytest.fixture
def fleet(tmp_path: Path, daemon: Daemon):
    made = Fleet(tmp_path, daemon)
    yield made
    made.close()


def started(fleet: Fleet) -> dict[str, int]:
    counts: dict[str, int] = {}
    for launch in fleet.launches():
        counts[launch["session"]] = counts.get(launch["session"], 0) + 1
    return counts


def test_two_runs_at_once_start_each_session_once_parents_first(fleet: Fleet):
    parent, other, child = fleet.dead_sessions()
    runs = [fleet.restore(), fleet.restore()]
    outputs = [run.communicate(timeout=120) for run in runs]
    assert [run.returncode for run in runs] == [0, 0], outputs
    assert started(fleet) == {parent: 1, other: 1, child: 1}
    order = [launch["session"] for launch in fleet.launches()]
    assert order.index(parent) < order.index(child)
    (first,) = [launch for launch in fleet.launches() if launch["session"] == parent]
    with fleet.daemon.client() as client:
        row = client.fleet_get(parent)
        assert first["argv"] == ["--resume", row["agent_session_id"]]
        assert first["cwd"] == str(fleet.work)
        assert all(client.fleet_get(s)["live"] is True for s in (parent, other, child))
    reports = [json.loads(out) for out, _err in outputs]
    results = sorted(entry["result"] for report in reports for entry in report["sessions"])
    assert results.count("started") == 3 and results.count("already_live") == 3

    # A third run starts nothing: every session is live.
    code, report = fleet.restored()
    assert code == 0 and {e["result"] for e in report["sessions"]} == {"already_live"}
    assert started(fleet) == {parent: 1, other: 1, child: 1}


def test_a_run_killed_mid_launch_and_rerun_still_starts_each_once(fleet: Fleet, tmp_path: Path):
    sessions = fleet.dead_sessions()
    gate = tmp_path / "gate"
    fleet.env["FAKE_AGENT_GATE"] = str(gate)  # agents wait before their SessionStart
    run = fleet.restore()
    wait_for(lambda: len(fleet.launches()) == 1, timeout=20, what="the first launch")
    run.send_signal(signal.SIGKILL)  # mid-launch: its key is held by a dead process
    run.communicate(timeout=30)
    gate.touch()
    code, report = fleet.restored()
    assert code == 0, report
    assert started(fleet) == dict.fromkeys(sessions, 1)


def test_dry_run_and_unknown_agent_kinds(fleet: Fleet):
    with fleet.daemon.client() as client:
        odd = client.session_register(cwd=str(fleet.work), agent="aider", agent_session_id="a-1")[
            "session_id"
        ]
        plain = client.session_register(
            cwd=str(fleet.work), agent="claude", agent_session_id="c-1"
        )["session_id"]
    code, report = fleet.restored("--dry-run")
    assert code == 0
    by_id = {entry["session_id"]: entry for entry in report["sessions"]}
    assert by_id[plain]["reason"].startswith("dry run") and by_id[plain]["argv"][1:] == [
        "--resume", "c-1",
    ]  # fmt: skip
    assert fleet.launches() == []
    code, report = fleet.restored("--session", odd)
    assert code == 1  # an unknown agent kind is not restored
    (entry,) = report["sessions"]
    assert entry["result"] == "skipped" and "aider" in entry["reason"]


def test_the_launch_table_is_configurable(fleet: Fleet, tmp_path: Path):
    config = tmp_path / "restore.toml"
    config.write_text(
        textwrap.dedent("""\
            [agents.claude]
            command = ["claude", "--resume", "{agent_session_id}", "--from-config"]
            model = ["--model", "{model}"]
        """)
    )
    with fleet.daemon.client() as client:
        session = client.session_register(
            cwd=str(fleet.work), agent="claude", agent_session_id="c-2", model="opus"
        )["session_id"]
    code, report = fleet.restored("--config", str(config), "--session", session)
    assert code == 0, report
    (launch,) = fleet.launches()
    assert launch["argv"] == ["--resume", "c-2", "--from-config", "--model", "opus"]


SLOW_TMUX = """\
#!/bin/sh
# tmux, slow to make a window (a loaded box): each such call is a line in a file when
# it starts and another when it is done.
case " $* " in
*" new-window "*|*" new-session "*)
    echo start >> "$SLOW_TMUX_MARK"; sleep 3; {tmux} "$@"; status=$?
    echo done >> "$SLOW_TMUX_MARK"; exit $status;;
esac
exec {tmux} "$@"
"""


def test_a_rerun_with_a_short_timeout_waits_out_the_dead_run_s_slow_tmux(
    fleet: Fleet, tmp_path: Path
):
    """A run killed while its tmux call was still making the window leaves that call
    running; a rerun with `--timeout 1` gave up on evidence after its own second,
    launched the session, and the orphaned call launched it too: two agents (a hostile
    tester's reproducer). The rerun now waits as long as a tmux call may take."""
    (session,) = fleet.dead_sessions(count=1)
    mark = tmp_path / "tmux-called"
    tmux = fleet.bin / "tmux"
    tmux.write_text(SLOW_TMUX.format(tmux=shutil.which("tmux")))
    tmux.chmod(0o755)
    fleet.env["SLOW_TMUX_MARK"] = str(mark)
    run = fleet.restore("--session", session)
    wait_for(mark.exists, timeout=20, what="the run's tmux call")
    run.send_signal(signal.SIGKILL)  # its claim stays; its tmux call goes on
    run.communicate(timeout=30)
    from towerd.client.restore import OPERATION, boot_id

    with fleet.daemon.client() as client:  # a rerun finding it in progress waits 1 s only
        wait_for(lambda: client.idem_get(OPERATION, f"{boot_id()}:{session}")["state"]
                 == "outcome_unknown", what="the dead run's claim unknown")  # fmt: skip
    rerun = fleet.restore("--session", session, "--timeout", "1")
    out, err = rerun.communicate(timeout=60)
    calls = mark.read_text().split()
    wait_for(lambda: (c := mark.read_text().split()).count("start") == c.count("done"),
             timeout=20, what="every tmux call done")  # fmt: skip
    windows = subprocess.run(
        ["tmux", "-L", fleet.tmux_socket, "list-windows", "-a", "-F", "#{window_id}"],
        capture_output=True, text=True,
    ).stdout.split()  # fmt: skip
    wait_for(lambda: len(fleet.launches()) == len(windows), what="an agent in every window")
    assert started(fleet) == {session: 1}, (calls, out, err)
    assert json.loads(out)["sessions"][0]["result"] == "already_live", out


CLAIM_AND_EXIT = """
import sys
from towerd.client import Client
with Client(sys.argv[1]) as client:
    client.idem_claim("fleet.restore", sys.argv[2], payload={"session_id": sys.argv[3],
                      "boot_id": sys.argv[4]})
"""


def test_a_run_that_loses_the_race_to_settle_a_key_goes_on_with_its_plan(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch
):
    """Two runs settling one dead run's key at once: the loser's `idem resolve` was
    refused (the winner had settled and claimed it again) and the whole run exited 1,
    the rest of its plan never launched (a hostile tester's reproducer). Now it claims
    again, finds the other run launching it, and goes on."""
    from towerd.client import Client
    from towerd.client.restore import OPERATION, Options, Restorer, boot_id

    parent, raced, child = fleet.dead_sessions()
    key, boot = f"{boot_id()}:{raced}", boot_id()
    subprocess.run([sys.executable, "-c", CLAIM_AND_EXIT, str(fleet.daemon.socket_path), key,
                    raced, boot], check=True)  # fmt: skip
    with fleet.daemon.client() as client:
        wait_for(lambda: client.idem_get(OPERATION, key)["state"] == "outcome_unknown",
                 what="the dead run's key unknown")  # fmt: skip
    for name, value in fleet.env.items():
        monkeypatch.setenv(name, value)
    with Client(fleet.daemon.socket_path) as client, fleet.daemon.client() as other:
        restorer = Restorer(client, Options(tmux_socket=fleet.tmux_socket, timeout=8))
        real_wait = restorer.wait

        def wait(condition, timeout):  # the other run settles the key first
            if other.idem_get(OPERATION, key)["state"] == "outcome_unknown":
                other.idem_resolve(OPERATION, key, "abandoned")
                other.idem_claim(OPERATION, key, payload={"session_id": raced, "boot_id": boot})
                return False
            return real_wait(condition, timeout)

        restorer.wait = wait  # type: ignore[method-assign]
        outcomes = {outcome.session_id: outcome for outcome in restorer.run()}
    assert outcomes[parent].result == "started" and outcomes[child].result == "started"
    assert outcomes[raced].result == "failed"
    assert "another restore run is launching it" in outcomes[raced].reason
    assert started(fleet) == {parent: 1, child: 1}


GATED_TMUX = """\
#!/bin/sh
# tmux whose first window-making call waits for a gate file (a tmux server stalled for
# as long as the test likes); a line in a file when that call starts, another when done.
case " $* " in
*" new-window "*|*" new-session "*)
    if mkdir "$GATED_TMUX_FIRST" 2>/dev/null; then
        echo start >> "$GATED_TMUX_MARK"
        while [ ! -e "$GATED_TMUX_GATE" ]; do sleep 0.05; done
        {tmux} "$@"; status=$?
        echo done >> "$GATED_TMUX_MARK"; exit $status
    fi;;
esac
exec {tmux} "$@"
"""


class OrphanedLaunch:
    """A run killed while its tmux call (gated) was making the session's window: the
    call goes on and makes the window once ``release()`` opens the gate."""

    def __init__(self, fleet: Fleet, root: Path, session: str) -> None:
        self.fleet, self.session = fleet, session
        self.mark, self.gate = root / "tmux-called", root / "tmux-gate"
        subprocess.run(
            ["tmux", "-L", fleet.tmux_socket, "new-session", "-d", "-s", "towerd", "-n",
             "placeholder", "sleep 100000"], env=fleet.env, check=True,
        )  # fmt: skip
        tmux = fleet.bin / "tmux"
        tmux.write_text(GATED_TMUX.format(tmux=shutil.which("tmux")))
        tmux.chmod(0o755)
        fleet.env.update(GATED_TMUX_MARK=str(self.mark), GATED_TMUX_GATE=str(self.gate),
                         GATED_TMUX_FIRST=str(root / "tmux-first"))  # fmt: skip
        fleet.cleanups.append(self.gate.touch)  # a failed test leaves no call waiting
        run = fleet.restore("--session", session)
        wait_for(self.mark.exists, timeout=20, what="the run's tmux call")
        run.send_signal(signal.SIGKILL)  # its claim stays; its tmux call goes on
        run.communicate(timeout=30)
        from towerd.client.restore import OPERATION, boot_id

        self.operation, self.key = OPERATION, f"{boot_id()}:{session}"
        with fleet.daemon.client() as client:
            wait_for(lambda: client.idem_get(OPERATION, self.key)["state"] == "outcome_unknown",
                     what="the dead run's claim unknown")  # fmt: skip
            self.ref = client.idem_get(OPERATION, self.key)["effect_ref"]

    def windows(self) -> list[str]:
        return subprocess.run(
            ["tmux", "-L", self.fleet.tmux_socket, "list-windows", "-a", "-F", "#{window_id}"],
            capture_output=True, text=True,
        ).stdout.split()  # fmt: skip

    def release(self) -> None:
        """Open the gate; return once the orphan's window exists and its command either
        started an agent or exited (every window but the placeholder runs an agent)."""
        self.gate.touch()
        wait_for(lambda: "done" in self.mark.read_text().split(), timeout=20,
                 what="the orphaned tmux call")  # fmt: skip
        wait_for(lambda: len(self.windows()) - 1 == len(self.fleet.launches()),
                 timeout=20, what="an agent in every window, or the window gone")  # fmt: skip


def test_a_window_made_after_a_rerun_launched_the_session_does_not_start_it_again(
    fleet: Fleet, tmp_path: Path
):
    """A tmux call that outlives its dead run by more than a rerun waits (a stalled tmux
    server): the rerun settled the dead claim abandoned and launched the session; the
    orphaned call then made its window, which launched the agent a second time. The
    window's command now checks its claim at the daemon first (client/restore_guard.py).
    The rerun's 30 s wait for evidence is taken as over: the test settles the dead
    claim as it does after it (``idem resolve`` abandoned, under the claim's ref)."""
    (session,) = fleet.dead_sessions(count=1)
    orphan = OrphanedLaunch(fleet, tmp_path, session)
    with fleet.daemon.client() as client:
        client.idem_resolve(orphan.operation, orphan.key, "abandoned", effect_ref=orphan.ref)
    code, report = fleet.restored("--session", session)
    assert code == 0 and report["sessions"][0]["result"] == "started", report
    orphan.release()
    assert started(fleet) == {session: 1}
    assert len(orphan.windows()) == 2  # the placeholder and the rerun's


def test_a_window_made_after_its_run_died_settles_the_launch_and_a_rerun_finds_it(
    fleet: Fleet, tmp_path: Path
):
    """The orphaned call's window comes first: it settles the dead run's claim completed
    (the daemon picks between it and a rerun) and starts the agent; a rerun finds the
    session launched and live."""
    (session,) = fleet.dead_sessions(count=1)
    orphan = OrphanedLaunch(fleet, tmp_path, session)
    orphan.release()
    assert started(fleet) == {session: 1}
    with fleet.daemon.client() as client:
        record = client.idem_get(orphan.operation, orphan.key)
    assert record["state"] == "completed" and record["result"]["settled"] == "window"
    assert record["result"]["pane"].startswith("%")  # the window's tmux pane
    code, report = fleet.restored("--session", session)
    assert code == 0 and report["sessions"][0]["result"] == "already_live", report
    assert started(fleet) == {session: 1}


def test_a_launch_found_elsewhere_but_not_live_gets_advice_for_its_key_s_state(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch
):
    """A session another run launched (or is launching) that is not live by the timeout:
    the advice follows the launch's key as it stands (it said `idem reopen` for a key
    another run had released, and reopen then failed), and the one for a completed key
    works: after `towerctl idem reopen` the next restore starts the session."""
    from towerd.client import Client
    from towerd.client.restore import OPERATION, Options, Outcome, Restorer, boot_id

    (session,) = fleet.dead_sessions(count=1)
    key, boot = f"{boot_id()}:{session}", boot_id()
    for name, value in fleet.env.items():
        monkeypatch.setenv(name, value)
    with Client(fleet.daemon.socket_path) as client, fleet.daemon.client() as other:
        restorer = Restorer(client, Options(tmux_socket=fleet.tmux_socket, timeout=0.3))

        def advice() -> str:
            outcome = Outcome(session, None, "claude", "skipped")
            return restorer.started_elsewhere(outcome, "seen elsewhere").reason

        assert "that run released it: towerctl fleet restore again launches it" in advice()
        subprocess.run([sys.executable, "-c", CLAIM_AND_EXIT, str(fleet.daemon.socket_path),
                        key, session, boot], check=True)  # fmt: skip
        wait_for(lambda: other.idem_get(OPERATION, key)["state"] == "outcome_unknown",
                 what="the dead claimant's key unknown")  # fmt: skip
        assert "its launch is outcome_unknown; towerctl fleet restore again settles" in advice()
        other.idem_resolve(OPERATION, key, "abandoned")
        other.idem_claim(OPERATION, key, payload={"session_id": session, "boot_id": boot})
        assert "another run is launching it" in advice()
        other.idem_complete(OPERATION, key, result={"window": "gone"})
        said = advice()
    assert f"towerctl idem reopen {OPERATION} {key}" in said
    reopened = subprocess.run([TOWERCTL, "idem", "reopen", OPERATION, key], env=fleet.env,
                              capture_output=True, text=True)  # fmt: skip
    assert reopened.returncode == 0, reopened
    code, report = fleet.restored("--session", session)
    assert code == 0 and report["sessions"][0]["result"] == "started", report
    assert started(fleet) == {session: 1}


SLOW_SHELL = """\
#!/bin/sh
# a shell slow to start (a login shell's nvm, conda...): tmux runs each window's command
# through its default-shell
sleep {delay}
exec /bin/sh "$@"
"""


def slow_window_shell(fleet: Fleet, root: Path, delay: float) -> None:
    """The fleet's tmux server (started here) runs every window's command through a
    shell that takes ``delay`` seconds to start."""
    shell = root / "slow-sh"
    shell.write_text(SLOW_SHELL.format(delay=delay))
    shell.chmod(0o755)
    tmux = ["tmux", "-L", fleet.tmux_socket]
    subprocess.run([*tmux, "new-session", "-d", "-s", "towerd", "-n", "placeholder",
                    "sleep 100000"], env=fleet.env, check=True)  # fmt: skip
    subprocess.run([*tmux, "set-option", "-g", "default-shell", str(shell)], env=fleet.env,
                   check=True)  # fmt: skip


def test_a_window_slower_than_the_run_s_timeout_still_starts_its_agent_once(
    fleet: Fleet, tmp_path: Path
):
    """The run's `--timeout` runs out while its window's check of the claim is still
    starting: the run marked the launch completed, the check read that as another run's
    and never started the agent, and every rerun refused to (a hostile tester's
    reproducer). The run now waits for the check, and the agent starts, once."""
    (session,) = fleet.dead_sessions(count=1)
    slow_window_shell(fleet, tmp_path, 4)
    code, report = fleet.restored("--session", session, "--timeout", "1")
    assert code == 0 and report["sessions"][0]["result"] == "started", report
    assert started(fleet) == {session: 1}
    code, report = fleet.restored("--session", session)
    assert code == 0 and report["sessions"][0]["result"] == "already_live", report
    assert started(fleet) == {session: 1}


def test_a_window_starts_only_for_its_own_claim(fleet: Fleet, monkeypatch: pytest.MonkeyPatch):
    """The window's check, on each state its claim may be in: in progress (it records the
    launch first) or completed by its own run for its pane: start; completed by its run
    for another pane (one claim with two windows: both started the agent, a hostile
    tester's reproducer), from evidence, another claim, released: do not."""
    from towerd.client import Client
    from towerd.client.restore_guard import OPERATION, RUN_MARK, may_start, settled_by_window

    monkeypatch.setenv("TMUX_PANE", "%7")
    with Client(fleet.daemon.socket_path) as client:
        claim = client.idem_claim(OPERATION, "boot:s", payload={"n": 1})
        ref = client.idem_get(OPERATION, "boot:s")["effect_ref"]
        assert claim["state"] == "claimed"
        assert "claimed again" in (may_start(client, "boot:s", "another-ref") or "")
        assert client.idem_get(OPERATION, "boot:s")["state"] == "in_progress"
        assert may_start(client, "boot:s", ref) is None
        record = client.idem_get(OPERATION, "boot:s")
        assert (record["state"], record["result"]) == ("completed", settled_by_window())
        client.idem_claim(OPERATION, "boot:m", payload={"n": 0})
        run_ref = client.idem_get(OPERATION, "boot:m")["effect_ref"]
        client.idem_complete(OPERATION, "boot:m", result={RUN_MARK: "%7", "window": "w"})
        assert may_start(client, "boot:m", run_ref) is None  # its run completed it
        monkeypatch.setenv("TMUX_PANE", "%8")  # the claim's other window
        assert "completed" in (may_start(client, "boot:m", run_ref) or "")
        assert "completed" in (may_start(client, "boot:s", ref) or "")
        client.idem_claim(OPERATION, "boot:e", payload={"n": 2})
        evidence_ref = client.idem_get(OPERATION, "boot:e")["effect_ref"]
        client.idem_complete(OPERATION, "boot:e", result={"settled": "evidence"})
        assert "completed" in (may_start(client, "boot:e", evidence_ref) or "")
        client.idem_claim(OPERATION, "boot:r", payload={"n": 3})
        released_ref = client.idem_get(OPERATION, "boot:r")["effect_ref"]
        client.idem_release(OPERATION, "boot:r")
        assert "released" in (may_start(client, "boot:r", released_ref) or "")


def test_an_agent_that_dies_before_its_session_start_is_relaunched_only_when_reopened(
    fleet: Fleet, tmp_path: Path
):
    """Its window recorded the launch before the agent ran, so the run cannot release the
    claim for a retry: it fails saying how to launch again, a rerun starts nothing, and
    after `towerctl idem reopen` the next run starts the session."""
    from towerd.client.restore import OPERATION, boot_id

    (session,) = fleet.dead_sessions(count=1)
    dies = tmp_path / "agent-dies"
    dies.touch()
    fleet.env["FAKE_AGENT_EXIT_IF"] = str(dies)
    key = f"{boot_id()}:{session}"
    code, report = fleet.restored("--session", session, "--timeout", "5")
    (outcome,) = report["sessions"]
    assert code != 0 and outcome["result"] == "failed", report
    assert f"towerctl idem reopen {OPERATION} {key}" in outcome["reason"], report
    code, report = fleet.restored("--session", session, "--timeout", "1")
    assert code != 0 and "launched earlier this boot" in report["sessions"][0]["reason"], report
    assert started(fleet) == {session: 1}
    dies.unlink()
    reopened = subprocess.run([TOWERCTL, "idem", "reopen", OPERATION, key], env=fleet.env,
                              capture_output=True, text=True)  # fmt: skip
    assert reopened.returncode == 0, reopened
    code, report = fleet.restored("--session", session)
    assert code == 0 and report["sessions"][0]["result"] == "started", report
    assert started(fleet) == {session: 2}


STALL_BEFORE_EXEC = """\
# sitecustomize for the test's tmux windows: the first window's check of its claim,
# once decided, stalls before it starts its agent (a stopped process), until a gate.
import os, sys, time

_execv = os.execv


def execv(path, args):
    if sys.argv and sys.argv[0].endswith("restore_guard.py"):
        try:
            token = os.environ["STALL_GUARD_TOKEN"]
            os.close(os.open(token, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except (KeyError, FileExistsError):
            pass
        else:
            open(os.environ["STALL_GUARD_MARK"], "w").close()
            while not os.path.exists(os.environ["STALL_GUARD_GATE"]):
                time.sleep(0.05)
    return _execv(path, args)


os.execv = execv
"""


def test_a_window_stalled_after_deciding_to_start_is_not_launched_beside(
    fleet: Fleet, tmp_path: Path
):
    """A window whose check found its run's claim in progress, then stalled before it
    started the agent, past everything a rerun waits for (its run was killed meanwhile):
    the rerun settled the dead claim abandoned and launched the session, and the stalled
    window then started it a second time. The window now records the launch (completes
    the claim, under its ref) before it starts the agent: the rerun finds it launched."""
    from towerd.client.restore import OPERATION, boot_id

    (session,) = fleet.dead_sessions(count=1)
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(STALL_BEFORE_EXEC)
    gate, decided = tmp_path / "guard-gate", tmp_path / "guard-decided"
    fleet.env.update(PYTHONPATH=str(site), STALL_GUARD_TOKEN=str(tmp_path / "guard-token"),
                     STALL_GUARD_MARK=str(decided), STALL_GUARD_GATE=str(gate))  # fmt: skip
    fleet.cleanups.append(gate.touch)  # a failed test leaves no window waiting
    run = fleet.restore("--session", session)
    wait_for(decided.exists, timeout=30, what="the window's check decided to start")
    run.send_signal(signal.SIGKILL)
    run.communicate(timeout=30)
    key = f"{boot_id()}:{session}"
    with fleet.daemon.client() as client:
        wait_for(lambda: client.idem_get(OPERATION, key)["state"] != "in_progress",
                 what="the killed run's claim settled or unknown")  # fmt: skip
    _code, report = fleet.restored("--session", session, "--timeout", "2")
    assert report["sessions"][0]["result"] != "started", report
    assert fleet.launches() == []
    gate.touch()  # the stalled window goes on
    with fleet.daemon.client() as client:
        wait_for(lambda: client.fleet_get(session)["live"] is True, timeout=20,
                 what="the stalled window's agent")  # fmt: skip
    code, report = fleet.restored("--session", session)
    assert code == 0 and report["sessions"][0]["result"] == "already_live", report
    assert started(fleet) == {session: 1}


LOG_WINDOW_CONNECTS = """
from towerd.client.sync import Client

_connect = Client.connect


def connect(self):  # each failed connection of a window's check, logged
    try:
        return _connect(self)
    except Exception as exc:
        if sys.argv and sys.argv[0].endswith("restore_guard.py"):
            with open(os.environ["GUARD_CALLS"], "a") as log:
                log.write("connect:" + type(exc).__name__ + "\\n")
        raise


Client.connect = connect
"""


STALL_BEFORE_COMPLETE = """\
# sitecustomize for the test's tmux windows: a window's check writes each call it makes,
# and each that failed, to a log, and holds its first idem.complete until a gate; once
# that write failed, the window's clock jumps 1000 s (past any deadline it keeps).
import os, sys, time

_monotonic = time.monotonic
_jumped = []
time.monotonic = lambda: _monotonic() + (1000.0 if _jumped else 0.0)

from towerd.client.sync import Client

_call = Client.call


def call(self, method, params=None):
    if sys.argv and sys.argv[0].endswith("restore_guard.py"):
        with open(os.environ["GUARD_CALLS"], "a") as log:
            log.write(method + "\\n")
        if method == "idem.complete" and not os.path.exists(os.environ["COMPLETE_GATE"]):
            open(os.environ["COMPLETE_MARK"], "w").close()
            while not os.path.exists(os.environ["COMPLETE_GATE"]):
                time.sleep(0.05)
    try:
        return _call(self, method, params)
    except Exception as exc:
        with open(os.environ["GUARD_CALLS"], "a") as log:
            log.write(method + ":" + type(exc).__name__ + "\\n")
        if method == "idem.complete":
            _jumped.append(True)
        raise


Client.call = call
"""


def test_a_window_whose_launch_record_is_answered_late_still_starts_its_agent(
    fleet: Fleet, tmp_path: Path
):
    """The window's write of its launch lost its answer (the daemon stalled) and was
    applied later: the window, having read the claim once (before 9cdb063), or having
    asked for 60 s (before this test's last change), exited without starting the agent,
    and the launch stayed on the record with nothing launched (two hostile testers'
    reproducers). Once it sent a write, the window now asks until the daemon answers,
    however long: it finds its own write, and starts the agent, once."""
    from towerd.client.restore import GUARD_ENV, OPERATION, boot_id, processes_with

    (session,) = fleet.dead_sessions(count=1)
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(STALL_BEFORE_COMPLETE + LOG_WINDOW_CONNECTS)
    calls, mark, gate = tmp_path / "guard-calls", tmp_path / "mark", tmp_path / "gate"
    fleet.env.update(PYTHONPATH=str(site), GUARD_CALLS=str(calls), COMPLETE_MARK=str(mark),
                     COMPLETE_GATE=str(gate))  # fmt: skip
    daemon_pid = fleet.daemon.proc.pid
    fleet.cleanups.extend([gate.touch, lambda: os.kill(daemon_pid, signal.SIGCONT)])
    run = fleet.restore("--session", session)
    wait_for(mark.exists, timeout=30, what="the window about to record its launch")
    run.send_signal(signal.SIGKILL)  # its run gone: nothing else settles the claim
    run.communicate(timeout=30)
    key = f"{boot_id()}:{session}"
    with fleet.daemon.client() as client:
        wait_for(lambda: client.idem_get(OPERATION, key)["state"] == "outcome_unknown",
                 what="the killed run's claim unknown")  # fmt: skip
    os.kill(daemon_pid, signal.SIGSTOP)
    gate.touch()  # the window's write goes to a daemon that does not answer
    # Its write unanswered, its clock then past any deadline: the daemon stays stalled
    # until the window either gave up or asked again on a new connection.
    wait_for(lambda: "idem.complete:Unavailable" in calls.read_text().split(), timeout=60,
             what="the window's write without an answer")  # fmt: skip

    def gave_up_or_asks_again() -> bool:  # past its deadline (its clock jumped)
        again = any(line.startswith("connect:") for line in calls.read_text().split())
        return again or not processes_with(GUARD_ENV, session)

    wait_for(gave_up_or_asks_again, timeout=60, what="the window past its deadline")
    os.kill(daemon_pid, signal.SIGCONT)
    with fleet.daemon.client() as client:
        wait_for(lambda: client.fleet_get(session)["live"] is True, timeout=60,
                 what="the window's agent")  # fmt: skip
        record = client.idem_get(OPERATION, key)
    assert record["state"] == "completed" and record["result"]["settled"] == "window"
    assert record["result"]["pane"].startswith("%")  # the window's tmux pane
    code, report = fleet.restored("--session", session)
    assert code == 0 and report["sessions"][0]["result"] == "already_live", report
    assert started(fleet) == {session: 1}


def test_an_agent_that_cannot_be_executed_is_launched_once_mended(fleet: Fleet):
    """Its file is executable but exec fails (its #! interpreter is gone): the window had
    recorded the launch, and a rerun, once the agent was mended, said it was launched
    earlier (a hostile tester's reproducer). The window forgets its launch when exec
    fails, so the rerun starts the session."""
    (session,) = fleet.dead_sessions(count=1)
    claude = fleet.bin / "claude"
    good = claude.read_text()
    claude.write_text("#!/nonexistent/python\n" + good.split("\n", 1)[1])
    code, report = fleet.restored("--session", session, "--timeout", "3")
    assert code != 0 and report["sessions"][0]["result"] == "failed", report
    assert fleet.launches() == []
    claude.write_text(good)
    code, report = fleet.restored("--session", session, "--timeout", "10")
    assert code == 0 and report["sessions"][0]["result"] == "started", report
    assert started(fleet) == {session: 1}


STOP_DAEMON_ON_EXEC_FAILURE = """\
# sitecustomize for the test's tmux windows: when a window's exec of its agent fails, the
# daemon is stopped (SIGSTOP) first.
import os, signal, sys

_execv = os.execv


def execv(path, args):
    try:
        return _execv(path, args)
    except OSError:
        if sys.argv and sys.argv[0].endswith("restore_guard.py"):
            os.kill(int(os.environ["STOP_DAEMON_PID"]), signal.SIGSTOP)
        raise


os.execv = execv
"""


def test_a_launch_whose_agent_cannot_be_executed_is_forgotten_past_a_stalled_daemon(
    fleet: Fleet, tmp_path: Path
):
    """The window's exec failed after it recorded the launch, and its one attempt to
    forget the record met a stalled daemon: the launch stayed on the record, and a rerun
    with the agent mended started nothing (a hostile tester's reproducer). The window
    now asks again until the daemon answers, up to 60 s."""
    (session,) = fleet.dead_sessions(count=1)
    claude = fleet.bin / "claude"
    good = claude.read_text()
    claude.write_text("#!/nonexistent/python\n" + good.split("\n", 1)[1])
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(STOP_DAEMON_ON_EXEC_FAILURE + LOG_WINDOW_CONNECTS)
    calls = tmp_path / "guard-calls"
    daemon_pid = fleet.daemon.proc.pid
    fleet.env.update(PYTHONPATH=str(site), STOP_DAEMON_PID=str(daemon_pid),
                     GUARD_CALLS=str(calls))  # fmt: skip
    fleet.cleanups.append(lambda: os.kill(daemon_pid, signal.SIGCONT))
    run = fleet.restore("--session", session, "--timeout", "3")
    wait_for(lambda: calls.exists() and "connect:" in calls.read_text(), timeout=60,
             what="the window's undo unanswered")  # fmt: skip
    os.kill(daemon_pid, signal.SIGCONT)
    run.communicate(timeout=120)
    from towerd.client.restore import GUARD_ENV, processes_with

    wait_for(lambda: not processes_with(GUARD_ENV, session), timeout=90, what="the window done")
    claude.write_text(good)
    code, report = fleet.restored("--session", session, "--timeout", "10")
    assert code == 0 and report["sessions"][0]["result"] == "started", report
    assert started(fleet) == {session: 1}


STALL_WINDOW_PAST_ITS_RUN = """\
# sitecustomize: the run waits 0.5 s (not GUARD_WAIT_S) for a window still checking its
# claim (as for a window stopped longer than that); the window's check stalls before its
# first call to the daemon until a gate.
import os, sys, time

from towerd.client.sync import Client

_connect = Client.connect


def connect(self):
    if sys.argv and sys.argv[0].endswith("towerctl"):
        import towerd.client.restore as restore

        restore.GUARD_WAIT_S = 0.5
    if sys.argv and sys.argv[0].endswith("restore_guard.py"):
        while not os.path.exists(os.environ["WINDOW_GATE"]):
            time.sleep(0.05)
    return _connect(self)


Client.connect = connect
"""


def test_a_window_started_on_its_run_s_mark_forgets_the_launch_when_exec_fails(
    fleet: Fleet, tmp_path: Path
):
    """The run completed the claim for its window's pane while the window's check was
    stopped; the window then went on, and its exec failed: its undo forgot only a record
    of its own, so the run's stayed, and a rerun with the agent mended started nothing (a
    third hostile round's reproducer). The undo now forgets either."""
    from towerd.client.restore import GUARD_ENV, OPERATION, RUN_MARK, boot_id, processes_with

    (session,) = fleet.dead_sessions(count=1)
    claude = fleet.bin / "claude"
    good = claude.read_text()
    claude.write_text("#!/nonexistent/python\n" + good.split("\n", 1)[1])  # exec fails
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(STALL_WINDOW_PAST_ITS_RUN)
    gate = tmp_path / "window-gate"
    fleet.env.update(PYTHONPATH=str(site), WINDOW_GATE=str(gate))
    fleet.cleanups.append(gate.touch)
    code, report = fleet.restored("--session", session, "--timeout", "1")
    assert report["sessions"][0]["result"] == "failed", report
    key = f"{boot_id()}:{session}"
    with fleet.daemon.client() as client:
        record = client.idem_get(OPERATION, key)
    assert record["state"] == "completed" and record["result"][RUN_MARK], record
    gate.touch()  # the window goes on: the run's mark names its pane; its exec fails
    wait_for(lambda: not processes_with(GUARD_ENV, session), timeout=60, what="window done")
    claude.write_text(good)
    fleet.env.pop("PYTHONPATH")
    code, report = fleet.restored("--session", session, "--timeout", "10")
    assert code == 0 and report["sessions"][0]["result"] == "started", report
    assert started(fleet) == {session: 1}


def test_a_session_whose_cwd_has_a_module_named_like_python_s_own_starts(fleet: Fleet):
    """The window starts in the session's cwd; the check ran `python -m` there, and a
    project's `select.py` stood in for Python's: it crashed, and the session never came
    back."""
    (session,) = fleet.dead_sessions(count=1)
    (fleet.work / "select.py").write_text("raise SystemExit('a project module named select')\n")
    code, report = fleet.restored("--session", session)
    assert code == 0 and report["sessions"][0]["result"] == "started", report
    assert started(fleet) == {session: 1}


def test_a_relative_socket_reaches_the_daemon_from_the_window(fleet: Fleet):
    """`towerctl --socket NAME` run from the socket's dir: the window (in the session's
    cwd) looked for NAME there, found no daemon, and did not start the agent."""
    (session,) = fleet.dead_sessions(count=1)
    socket_path = fleet.daemon.socket_path
    done = subprocess.run(
        [TOWERCTL, "--json", "--socket", socket_path.name, "fleet", "restore",
         "--tmux-socket", fleet.tmux_socket, "--session", session, "--timeout", "20"],
        env=fleet.env, cwd=socket_path.parent, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done
    assert started(fleet) == {session: 1}


def test_a_live_run_whose_claim_turned_unknown_goes_on_with_its_plan(fleet: Fleet, tmp_path: Path):
    """The live run's claim turned outcome_unknown (an operator's mark-unknown; on
    PostgreSQL, its box declared dead) before its window's check ran: the window settled
    it completed and started the agent, and the run's own complete was refused
    `conflict`: the run crashed, the rest of its plan never started. It now finds the
    launch completed under its own claim and goes on."""
    parent, child = fleet.dead_sessions(count=2)
    slow_window_shell(fleet, tmp_path, 2)
    run = fleet.restore()
    from towerd.client import IdempotencyKeyUnknown
    from towerd.client.restore import OPERATION, boot_id

    key = f"{boot_id()}:{parent}"
    with fleet.daemon.client() as client:

        def claimed() -> bool:
            try:
                return client.idem_get(OPERATION, key)["state"] == "in_progress"
            except IdempotencyKeyUnknown:
                return False

        wait_for(claimed, timeout=20, what="the run's claim")
        client.idem_mark_unknown(OPERATION, key)
    out, err = run.communicate(timeout=120)
    assert run.returncode == 0, (out, err)
    results = {entry["session_id"]: entry["result"] for entry in json.loads(out)["sessions"]}
    assert results == {parent: "started", child: "started"}, out
    assert started(fleet) == {parent: 1, child: 1}


def test_a_live_run_whose_unknown_claim_it_cannot_release_goes_on_with_its_plan(
    fleet: Fleet, tmp_path: Path
):
    """The live run's claim turned outcome_unknown and its window did not start the agent
    (the agent's file no longer executable): the run's release of its claim was refused
    `outcome_unknown`, uncaught, and the run crashed before the rest of its plan (a
    hostile tester's finding). It now reports the launch's state and goes on."""
    from towerd.client import IdempotencyKeyUnknown
    from towerd.client.restore import OPERATION, boot_id

    first, second = fleet.dead_sessions(count=2)
    slow_window_shell(fleet, tmp_path, 2)
    run = fleet.restore("--timeout", "3")
    key = f"{boot_id()}:{first}"
    with fleet.daemon.client() as client:

        def claimed() -> bool:
            try:
                return client.idem_get(OPERATION, key)["state"] == "in_progress"
            except IdempotencyKeyUnknown:
                return False

        wait_for(claimed, timeout=20, what="the run's claim")
        client.idem_mark_unknown(OPERATION, key)
        (fleet.bin / "claude").chmod(0o644)  # before the window's slow shell runs its check
    out, err = run.communicate(timeout=120)
    reasons = {entry["session_id"]: entry["reason"] for entry in json.loads(out)["sessions"]}
    assert "its launch is outcome_unknown" in reasons[first], (out, err)
    assert set(reasons) == {first, second}
    assert fleet.launches() == []


FAILING_TMUX = """\
#!/bin/sh
# tmux whose window-making calls make the window, wait for the agent to start (in it or
# in an earlier one), then fail: an error after the window was made
case " $* " in
*" new-window "*|*" new-session "*)
    {tmux} "$@" || exit $?
    echo made >> "$FAILING_TMUX_CALLS"
    while [ ! -s "$FAKE_AGENT_LOG" ]; do sleep 0.05; done
    echo "{error}" >&2; exit 1;;
esac
exec {tmux} "$@"
"""


@pytest.mark.parametrize("error", ["tmux: lost server", "duplicate session: towerd"])
def test_a_launch_whose_tmux_call_failed_after_making_the_window_is_the_run_s(
    fleet: Fleet, error: str
):
    """tmux failed after making the window, whose check recorded the launch and started
    the agent: the run reported "could not launch" for a session it had started (a
    hostile tester's finding). It now goes on with the launch its window recorded. A
    failed new-session is followed by a new-window only when it says "duplicate
    session" (another run made the session); when that was a lie, the second window of
    the claim does not start the agent again (the record names the first one's pane)."""
    (session,) = fleet.dead_sessions(count=1)
    tmux = fleet.bin / "tmux"
    tmux.write_text(FAILING_TMUX.format(tmux=shutil.which("tmux"), error=error))
    tmux.chmod(0o755)
    calls = fleet.home / "tmux-windows-made"
    fleet.env["FAILING_TMUX_CALLS"] = str(calls)
    code, report = fleet.restored("--session", session)
    assert code == 0 and report["sessions"][0]["result"] == "started", report
    made = 2 if error.startswith("duplicate session") else 1
    assert calls.read_text().split() == ["made"] * made

    def windows() -> list[str]:
        listed = subprocess.run(["tmux", "-L", fleet.tmux_socket, "list-windows", "-a"],
                                capture_output=True, text=True)  # fmt: skip
        return listed.stdout.splitlines()

    wait_for(lambda: len(windows()) == 1, timeout=30, what="a second window gone")
    assert started(fleet) == {session: 1}


def test_a_row_that_cannot_be_resumed_fails_the_run_only_when_named(fleet: Fleet):
    """A row registered by hand without an agent session id (the README's own `session
    register` example) made every whole-plan restore exit 1 although everything that
    could be brought back was live; it is reported skipped, not resumable, and fails
    the run only when named with --session."""
    (dead,) = fleet.dead_sessions(count=1)
    with fleet.daemon.client() as client:
        bare = client.session_register(cwd=str(fleet.work), agent="claude")["session_id"]
    code, report = fleet.restored()
    by_id = {entry["session_id"]: entry for entry in report["sessions"]}
    assert code == 0, report
    assert by_id[dead]["result"] == "started"
    assert (by_id[bare]["result"], by_id[bare]["resumable"]) == ("skipped", False)
    code, report = fleet.restored("--session", bare)
    assert code == 1, report
