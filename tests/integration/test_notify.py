"""``towerctl notify`` for real: a real daemon, the real CLI as a subprocess, a real shell
command that appends what it was given (stdin JSON, TOWERD_* variables) to a file.

Nothing sleeps to synchronise. That notify is subscribed is its own "watching" line on
stderr; that nothing was run for an event is shown by a later event that is run: events
are pushed in order and commands run one at a time in order, so a command due for the
first would have appended its line before the second's.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from towerd_testing import TOWERCTL, Daemon, wait_for

pytestmark = pytest.mark.both_backends

RECORDER = textwrap.dedent(
    """
    import json, os, sys
    fields = json.loads(sys.stdin.read())
    env = {k: v for k, v in os.environ.items() if k.startswith("TOWERD_")}
    record = {"fields": fields, "env": env, "caller": os.environ.get("NOTIFY_TEST_CALLER")}
    with open(sys.argv[1], "a") as out:
        out.write(json.dumps(record) + "\\n")
    """
)
# A shell command line, as a user writes one: the caller's variables, redirection, a case.
COMMAND = (
    'case "$TOWERD_MESSAGE" in '
    "fail) exit 1;; "
    'hang) sleep 300 & echo "$$ $!" >> "$HANG_PIDS"; wait; exit 0;; '
    "esac; "
    'exec "$PYTHON" "$RECORDER" "$OUT" 2>> "$OUT.err"'
)
NEEDS = "Claude needs your permission to use Bash"


class Notify:
    """A ``towerctl notify`` subprocess; its stderr goes to a file the test reads."""

    def __init__(self, root: Path, socket_path: Path, *args: str, env: dict[str, str]) -> None:
        self.root = root
        self.out = root / "notified.jsonl"
        self.err_path = root / "notify.err"
        self.out_path = root / "notify.out"
        self.env = env
        self.proc = subprocess.Popen(
            [TOWERCTL, "--socket", str(socket_path), "notify", *args],
            stdin=subprocess.DEVNULL,
            stdout=open(self.out_path, "wb"),  # noqa: SIM115 - the process's lifetime
            stderr=open(self.err_path, "wb"),  # noqa: SIM115
            env=env,
        )

    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def wait_stderr(self, needle: str, count: int = 1, timeout: float = 20.0) -> str:
        def seen() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"notify exited {self.proc.returncode}:\n{self.stderr()}")
            return self.stderr().count(needle) >= count

        try:
            wait_for(seen, timeout=timeout, what=f"{needle!r} x{count} on notify's stderr")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n--- notify's stderr ---\n{self.stderr()}") from None
        return self.stderr()

    def watching(self, count: int = 1) -> str:
        return self.wait_stderr("watching towerd", count)

    def records(self) -> list[dict[str, Any]]:
        if not self.out.exists():
            return []
        # Whole lines only: a recorder may be writing the last one while it is read.
        *whole, _partial = self.out.read_text().split("\n")
        return [json.loads(line) for line in whole]

    def wait_records(self, count: int, timeout: float = 20.0) -> list[dict[str, Any]]:
        try:
            wait_for(lambda: len(self.records()) >= count, timeout=timeout,
                     what=f"{count} notified line(s)")  # fmt: skip
        except AssertionError as exc:
            raise AssertionError(
                f"{exc}: {self.records()}\n--- notify's stderr ---\n{self.stderr()}"
            ) from None
        return self.records()

    def sessions_notified(self) -> list[str]:
        return [r["fields"]["session_id"] for r in self.records()]

    def terminate(self, sig: int = signal.SIGTERM) -> int:
        self.proc.send_signal(sig)
        return self.proc.wait(15)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def start_notify(short_tmp):
    started: list[Notify] = []

    def start(daemon: Daemon, *args: str, **env: str) -> Notify:
        recorder = short_tmp / "recorder.py"
        recorder.write_text(RECORDER)
        environ = {k: v for k, v in os.environ.items() if not k.startswith("TOWERD_")}
        environ.update(
            PYTHON=sys.executable,
            RECORDER=str(recorder),
            OUT=str(short_tmp / "notified.jsonl"),
            HANG_PIDS=str(short_tmp / "hang.pids"),
            NOTIFY_TEST_CALLER="kept",
        )
        environ.update(env)
        if not args:
            args = ("--exec", COMMAND)
        notify = Notify(short_tmp, daemon.socket_path, *args, env=environ)
        started.append(notify)
        return notify

    yield start
    for notify in started:
        notify.kill()


def register(client, name: str | None, agent_session_id: str) -> str:
    return client.session_register(
        cwd=f"/srv/{name or 'anon'}", agent="claude", name=name, agent_session_id=agent_session_id
    )["session_id"]


def notification(client, session_id: str, message: str = NEEDS) -> None:
    client.event_record("Notification", session_id=session_id, payload={"message": message})


def test_each_move_into_needs_you_runs_the_command_once(daemon, start_notify):
    client = daemon.client()
    alpha = register(client, "alpha", "as-alpha")
    beta = register(client, "beta", "as-beta")
    before = register(client, "before", "as-before")
    notification(client, before)  # needs you before notify starts: never notified
    notify = start_notify(daemon)
    assert "3 session(s), 1 needing you already" in notify.watching()

    notification(client, alpha)
    (record,) = notify.wait_records(1)
    fields, env = record["fields"], record["env"]
    assert fields["session_id"] == alpha and fields["name"] == "alpha"
    assert fields["agent"] == "claude" and fields["cwd"] == "/srv/alpha"
    assert fields["agent_session_id"] == "as-alpha"
    assert fields["attention"] == "needs_you" and fields["last_kind"] == "Notification"
    assert isinstance(fields["last_activity_at"], int) and fields["message"] == NEEDS
    assert fields["event"]["kind"] == "Notification"
    assert fields["event"]["payload"] == {"message": NEEDS}
    assert env == {
        "TOWERD_SESSION_ID": alpha,
        "TOWERD_SESSION_NAME": "alpha",
        "TOWERD_AGENT": "claude",
        "TOWERD_CWD": "/srv/alpha",
        "TOWERD_AGENT_SESSION_ID": "as-alpha",
        "TOWERD_ATTENTION": "needs_you",
        "TOWERD_MESSAGE": NEEDS,
        "TOWERD_SOCKET": str(daemon.socket_path),
    }
    assert record["caller"] == "kept"  # the caller's environment, plus TOWERD_*

    # Still needing you: a second Notification, and a heartbeat, run nothing (beta's
    # line, run after them in order, shows it).
    notification(client, alpha, "again")
    client.event_record("heartbeat", session_id=alpha)
    notification(client, before, "still")
    notification(client, beta)
    notify.wait_records(2)
    assert notify.sessions_notified() == [alpha, beta]

    # Moved on (the user answered), then asked again: once more. So for an idle prompt
    # after a Stop, and an event under the agent session id alone.
    client.event_record("UserPromptSubmit", session_id=alpha, payload={"prompt": "yes"})
    notification(client, alpha, "second")
    client.event_record("Stop", session_id=beta)
    client.event_record("Notification", agent_session_id="as-beta", payload={"message": "idle"})
    records = notify.wait_records(4)
    assert notify.sessions_notified() == [alpha, beta, alpha, beta]
    assert [r["fields"]["message"] for r in records] == [NEEDS, NEEDS, "second", "idle"]
    # A name change shows in the next notification's fields.
    client.session_update(beta, name="beta-2")
    client.event_record("PostToolUse", session_id=beta)
    notification(client, beta, "renamed")
    records = notify.wait_records(5)
    assert records[4]["env"]["TOWERD_SESSION_NAME"] == "beta-2"

    assert notify.terminate() == 0
    assert len(notify.records()) == 5
    stderr = notify.stderr()
    assert "Traceback" not in stderr, stderr
    assert stderr.count("needs you: notified") == 5
    assert notify.out_path.read_text() == ""  # notify prints nothing on stdout


def test_a_daemon_restart_is_a_new_baseline(make_daemon, start_notify):
    daemon = make_daemon().start()
    client = daemon.client()
    told = register(client, "told", "as-told")
    quiet = register(client, "quiet", "as-quiet")
    gap = register(client, "gap", "as-gap")
    before = register(client, "before", "as-before")
    notification(client, before)
    client.close()
    notify = start_notify(daemon)
    notify.watching()
    with daemon.client() as client:
        notification(client, told)
    notify.wait_records(1)

    assert daemon.stop() == 0
    notify.wait_stderr("trying again")
    daemon.start()
    with daemon.client() as client:
        # Asked for while notify may still be reconnecting: a move all the same, whether
        # notify sees it pushed or in its fresh snapshot.
        notification(client, gap, "during the gap")
    assert " again: 4 session(s), " in notify.watching(2)
    with daemon.client() as client:
        notification(client, quiet)  # the barrier: nothing else is due before it
        records = notify.wait_records(3)
        assert notify.sessions_notified() == [told, gap, quiet], records
        assert records[1]["fields"]["message"] == "during the gap"
        # told still needs you: moving on and asking again after the restart notifies.
        client.event_record("PostToolUse", session_id=told)
        notification(client, told)
        notify.wait_records(4)
    assert notify.sessions_notified() == [told, gap, quiet, told]
    assert notify.terminate() == 0
    assert "Traceback" not in notify.stderr()


def test_notify_started_before_the_daemon_waits_for_it(make_daemon, start_notify):
    daemon = make_daemon()
    notify = start_notify(daemon)
    assert "unavailable" in notify.wait_stderr("trying again")
    daemon.start()
    notify.watching()
    with daemon.client() as client:
        session = register(client, None, "as-1")
        notification(client, session)
    (record,) = notify.wait_records(1)
    assert record["env"]["TOWERD_SESSION_NAME"] == ""  # null is empty
    assert record["fields"]["name"] is None
    assert notify.terminate(signal.SIGINT) == 0


def test_a_failing_or_hanging_command_does_not_stop_notify(daemon, start_notify):
    client = daemon.client()
    failing, hanging, fine = (register(client, n, f"as-{n}") for n in ("failing", "hang", "ok"))
    notify = start_notify(daemon, "--exec", COMMAND, "--exec-timeout", "1")
    notify.watching()

    notification(client, failing, "fail")
    notify.wait_stderr(f"failing ({failing}) needs you: the command exited with status 1")
    notification(client, hanging, "hang")
    notification(client, fine, "queued behind the hung one")
    stderr = notify.wait_stderr("did not finish within 1 s and was killed")
    assert f"hang ({hanging}) needs you: the command did not finish" in stderr
    (record,) = notify.wait_records(1)
    assert record["fields"]["session_id"] == fine
    # The hung command and what it started are gone (killed as one process group).
    pids = hang_pids(notify)
    assert len(pids) == 2
    wait_for(lambda: all(gone(pid) for pid in pids), timeout=10, what="the hung processes gone")
    # And notify goes on.
    client.event_record("UserPromptSubmit", session_id=failing)
    notification(client, failing, "fine now")
    notify.wait_records(2)
    assert notify.sessions_notified() == [fine, failing]
    # SIGTERM while a command runs: notify exits 0, and the command goes with it.
    client.event_record("UserPromptSubmit", session_id=hanging)
    notification(client, hanging, "hang")
    wait_for(lambda: len(hang_pids(notify)) == 4, timeout=10, what="the second hung command")
    assert notify.terminate() == 0
    assert all(gone(pid) for pid in hang_pids(notify))
    assert "Traceback" not in notify.stderr()


def hang_pids(notify: Notify) -> list[int]:
    path = notify.root / "hang.pids"
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def gone(pid: int) -> bool:
    """Exited: no such process, or a zombie nobody reaped yet (a container's pid 1)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def test_a_watch_dropped_as_too_slow_is_watched_again(make_daemon, start_notify):
    """notify stopped (SIGSTOP) falls behind; the daemon drops its watch. After SIGCONT it
    watches again; a session that came to need you meanwhile is notified from the fresh
    snapshot, once."""
    daemon = make_daemon().start("--watch-max-queue", "65536")
    client = daemon.client()
    asked = register(client, "asked", "as-asked")
    filler = register(client, "filler", "as-filler")
    notify = start_notify(daemon)
    notify.watching()
    notify.proc.send_signal(signal.SIGSTOP)
    try:
        blob = {"output": "x" * 4096}
        for _ in range(5000):
            if '"watcher_too_slow"' in daemon.log():
                break
            client.event_record("PostToolUse", session_id=filler, payload=blob)
        else:
            raise AssertionError("the stopped notify was never dropped")
        notification(client, asked, "while dropped")
    finally:
        notify.proc.send_signal(signal.SIGCONT)
    stderr = notify.watching(2)
    # Told too_slow; or, had the daemon given up on the stopped reader first, cut off.
    assert "falling behind" in stderr or "trying again" in stderr, stderr
    (record,) = notify.wait_records(1)
    assert record["fields"]["session_id"] == asked
    assert record["fields"]["message"] == "while dropped"
    client.event_record("Stop", session_id=filler)
    notification(client, filler)
    notify.wait_records(2)
    assert notify.sessions_notified() == [asked, filler]
    assert notify.terminate() == 0


def test_desktop_runs_notify_send(daemon, start_notify, short_tmp):
    fake_bin = short_tmp / "bin"
    fake_bin.mkdir()
    calls = short_tmp / "notify-send.calls"
    fake = fake_bin / "notify-send"
    fake.write_text(
        f"#!{sys.executable}\n"
        "import json, sys\n"
        f"open({str(calls)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n"
    )
    fake.chmod(0o755)
    client = daemon.client()
    named = register(client, "alpha", "as-a")
    anonymous = register(client, None, "as-b")
    notify = start_notify(daemon, "--desktop", PATH=f"{fake_bin}{os.pathsep}{os.environ['PATH']}")
    notify.watching()
    notification(client, named)
    client.event_record("Notification", session_id=anonymous)  # no message
    wait_for(lambda: calls.exists() and calls.read_text().count("\n") >= 2, timeout=20,
             what="two whole notify-send calls")  # fmt: skip
    assert [json.loads(line) for line in calls.read_text().splitlines()] == [
        ["towerd: alpha needs you", NEEDS],
        [f"towerd: {anonymous} needs you", ""],
    ]
    assert notify.terminate() == 0


def test_desktop_without_notify_send_fails_at_start(short_tmp):
    empty = short_tmp / "empty-bin"
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOWERD_")}
    env["PATH"] = str(empty)
    socket_path = str(short_tmp / "none.sock")
    command = [TOWERCTL, "--socket", socket_path, "notify", "--desktop"]
    r = subprocess.run(command, capture_output=True, text=True, env=env, timeout=30, check=False)
    assert (r.returncode, r.stdout) == (1, ""), r
    (line,) = r.stderr.splitlines()
    assert line.startswith("towerctl: notify_send_missing: --desktop runs notify-send"), line
    r = subprocess.run([*command, "--json"], capture_output=True, text=True, env=env, timeout=30,
                       check=False)  # fmt: skip
    assert r.returncode == 1 and r.stderr == "", r
    assert json.loads(r.stdout)["error"]["code"] == "notify_send_missing"


@pytest.mark.parametrize(
    "args",
    [
        (),
        ("--exec", "true", "--desktop"),
        ("--exec", " "),
    ],  # fmt: skip
)
def test_notify_usage_errors(short_tmp, args):
    r = subprocess.run(
        [TOWERCTL, "--socket", str(short_tmp / "none.sock"), "notify", *args],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert r.returncode == 2 and r.stdout == "", r
    assert r.stderr.startswith("towerctl: "), r.stderr


@pytest.mark.parametrize("value", ["0", "nan", "inf", "-1"])
def test_notify_refuses_an_exec_timeout_out_of_range(short_tmp, value):
    """Its type's range (client/cli/seconds.py), refused by argparse before anything runs."""
    r = subprocess.run(
        [TOWERCTL, "--socket", str(short_tmp / "none.sock"), "notify", "--exec", "true",
         f"--exec-timeout={value}"],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert r.returncode == 2 and r.stdout == "", r
    assert f"argument --exec-timeout: '{value}' is out of range" in r.stderr, r.stderr


# --- install-systemd --notify -----------------------------------------------------------


def install(short_tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOWERD_")}
    return subprocess.run(
        [TOWERCTL, "--socket", str(short_tmp / "none.sock"), "install-systemd", *args],
        capture_output=True, text=True, env=env, timeout=60, check=False,
    )  # fmt: skip


def exec_start(unit: str) -> str:
    (line,) = [line for line in unit.splitlines() if line.startswith("ExecStart=")]
    return line.removeprefix("ExecStart=")


def test_install_systemd_notify_writes_the_notify_unit(short_tmp):
    units = short_tmp / "units"
    command = """notify-me "$HOME" 100% \\ 'quoted'"""
    r = install(short_tmp, "--dir", str(units), "--notify", "--notify-exec", command, "--json")
    assert r.returncode == 0 and r.stderr == "", r
    result = json.loads(r.stdout)
    names = ["towerd.socket", "towerd.service", "towerd-notify.service"]
    assert result["installed"] == [str(units / name) for name in names]
    assert sorted(p.name for p in units.iterdir()) == sorted(names)
    assert "systemctl --user enable --now towerd-notify.service" in result["next"]
    unit = (units / "towerd-notify.service").read_text()
    assert "@" not in unit.split("[Unit]", 1)[1]  # every placeholder replaced
    executable = Path(exec_start(unit).split()[0])
    assert executable.is_absolute() and executable.name == "towerctl"
    assert executable.is_file() and os.access(executable, os.X_OK)
    assert str(executable) == result["towerctl"]
    assert exec_start(unit) == (
        f"{executable} notify --socket %t/towerd/towerd.sock "
        '--exec "notify-me \\"$$HOME\\" 100%% \\\\ \'quoted\'"'
    )
    lines = set(unit.splitlines())
    assert {"After=towerd.socket", "Wants=towerd.socket", "Restart=on-failure",
            "WantedBy=default.target"} <= lines  # fmt: skip
    # towerd's own units are as without --notify.
    service = (units / "towerd.service").read_text()
    assert Path(exec_start(service).split()[0]).name == "towerd"

    desktop = short_tmp / "desktop-units"
    r = install(short_tmp, "--dir", str(desktop), "--notify")
    assert r.returncode == 0 and r.stderr == "", r
    unit = (desktop / "towerd-notify.service").read_text()
    assert exec_start(unit).endswith(" notify --socket %t/towerd/towerd.sock --desktop")
    r = install(short_tmp, "--dir", str(short_tmp / "d2"), "--notify-desktop")
    assert r.returncode == 0, r
    assert exec_start((short_tmp / "d2" / "towerd-notify.service").read_text()) == exec_start(unit)

    r = install(short_tmp, "--dir", str(short_tmp / "bad"), "--notify-exec", "x",
                "--notify-desktop")  # fmt: skip
    assert r.returncode == 2 and "not both" in r.stderr, r
    assert not (short_tmp / "bad").exists()


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_the_notify_unit_verifies_cleanly(short_tmp):
    """As installed, with a command full of what systemd would expand, the three units pass
    `systemd-analyze --user verify` without a warning."""
    from towerd.client.systemd_units import NOTIFY_UNIT, UNITS, install_units

    units = short_tmp / "units"
    install_units(units, notify_args=["--exec", 'echo "%h $HOME ${X}" \\; \'x\'\n|tee -a "$F"'])
    runtime = short_tmp / "runtime"
    runtime.mkdir(mode=0o700)
    verify = subprocess.run(
        ["systemd-analyze", "--user", "verify", *[str(units / n) for n in (*UNITS, NOTIFY_UNIT)]],
        capture_output=True, text=True, env={**os.environ, "XDG_RUNTIME_DIR": str(runtime)},
        timeout=60,
    )  # fmt: skip
    assert verify.returncode == 0, verify.stderr
    assert verify.stderr.strip() == ""


def test_the_runner_thread_leaves_stop_signals_to_the_main_thread_not_to_commands(short_tmp):
    """SIGTERM delivered to the command runner's thread left notify's main thread asleep
    in its watch until the daemon's next push: notify did not stop (a flaky test). The
    runner blocks SIGTERM and SIGINT; the commands it starts get them unblocked."""
    import threading

    from towerd.client.notify import STOP_SIGNALS, Job, Runner

    runner = Runner(lambda notice: Job([], None, {}), timeout=10)
    seen: dict[str, object] = {}
    mask_file = short_tmp / "mask"

    def as_the_runner_thread() -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # as Runner.run does
        seen["thread"] = signal.pthread_sigmask(signal.SIG_BLOCK, set())
        argv = ["sh", "-c", f"grep SigBlk /proc/self/status > {mask_file}"]
        seen["failure"] = runner.execute(Job(argv, None, {}))

    thread = threading.Thread(target=as_the_runner_thread)
    thread.start()
    thread.join(30)
    assert STOP_SIGNALS <= set(seen["thread"])  # type: ignore[arg-type]
    assert seen["failure"] is None
    blocked = int(mask_file.read_text().split()[-1], 16)
    assert not blocked & (1 << (signal.SIGTERM - 1)) and not blocked & (1 << (signal.SIGINT - 1))
