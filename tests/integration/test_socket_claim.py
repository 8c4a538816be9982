"""One daemon per socket path: a second daemon, whatever its state dir, never takes over a
live daemon's socket (that would split the fleet and run completed steps again)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from towerd_testing import TOWERD, Daemon, wait_for

EXIT_ALREADY_RUNNING = 75
LISTENER = """
import pathlib, socket, sys, time
s = socket.socket(socket.AF_UNIX)
s.bind(sys.argv[1])
s.listen(8)
pathlib.Path(sys.argv[2]).touch()
time.sleep(60)
"""


def _complete_a_key(daemon: Daemon) -> None:
    with daemon.client() as client:
        assert client.idem_claim("push", "k1")["state"] == "claimed"
        client.idem_complete("push", "k1", {"ok": True})


def _assert_first_still_serves_its_store(daemon: Daemon) -> None:
    """The first daemon answers on its socket, from its own store: the key it completed
    replays instead of being claimed again."""
    assert daemon.socket_path.exists()
    with daemon.client() as client:
        status = client.status()
        assert status["pid"] == daemon.pid
        again = client.idem_claim("push", "k1")
    assert again["state"] == "completed" and again["result"] == {"ok": True}


def test_second_daemon_with_another_state_dir_is_refused(daemon, make_daemon):
    """Same --socket, other --state-dir: exit 75 naming the live daemon's pid and state
    dir, before the second store is even created; the first keeps serving its store."""
    _complete_a_key(daemon)
    intruder = make_daemon("intruder")
    intruder.socket_path = daemon.socket_path
    proc = intruder.spawn()
    assert proc.wait(20) == EXIT_ALREADY_RUNNING, intruder.log()
    log = intruder.log()
    assert f"pid {daemon.pid}" in log and str(daemon.state_dir) in log, log
    assert "stale_socket_replaced" not in log
    assert not (intruder.state_dir / "towerd.db").exists()
    _assert_first_still_serves_its_store(daemon)


def test_a_hung_daemon_keeps_its_socket(daemon, make_daemon):
    """A stopped (SIGSTOP) daemon answers nothing, but it still holds the socket's lock:
    the newcomer is refused, and the first serves again once it continues."""
    _complete_a_key(daemon)
    intruder = make_daemon("intruder")
    intruder.socket_path = daemon.socket_path
    os.kill(daemon.pid, signal.SIGSTOP)
    try:
        proc = intruder.spawn()
        assert proc.wait(20) == EXIT_ALREADY_RUNNING, intruder.log()
        assert f"pid {daemon.pid}" in intruder.log()
    finally:
        os.kill(daemon.pid, signal.SIGCONT)
    _assert_first_still_serves_its_store(daemon)


def _start_with_defaults(daemon: Daemon, runtime: Path, state_home: Path) -> subprocess.Popen:
    """towerd with no --socket and no --state-dir: both from the XDG environment."""
    env = daemon.env(XDG_RUNTIME_DIR=str(runtime), XDG_STATE_HOME=str(state_home))
    log = open(daemon.log_path, "ab")  # noqa: SIM115 - the process's lifetime
    return subprocess.Popen([TOWERD, "--log-format", "json"], env=env, stdout=log, stderr=log)


def test_default_socket_shared_by_two_environments(make_daemon, short_tmp):
    """The systemd-unit-and-shell case: one XDG_RUNTIME_DIR (so one default socket), two
    XDG_STATE_HOMEs (so two state dirs). The second start is refused."""
    runtime = short_tmp / "rt"
    runtime.mkdir(mode=0o700)
    unit, shell = make_daemon("unit"), make_daemon("shell")
    unit.proc = _start_with_defaults(unit, runtime, short_tmp / "unit-state")
    unit.notify.wait_for("READY=1", 20, alive=lambda: unit.proc.poll() is None)
    unit.socket_path = runtime / "towerd" / "towerd.sock"
    _complete_a_key(unit)
    proc = _start_with_defaults(shell, runtime, short_tmp / "shell-state")
    assert proc.wait(20) == EXIT_ALREADY_RUNNING, shell.log()
    assert f"pid {unit.pid}" in shell.log() and "unit-state" in shell.log()
    _assert_first_still_serves_its_store(unit)


def test_listener_without_a_lock_is_not_replaced(make_daemon, short_tmp):
    """A live socket whose owner holds no lock (an older towerd, any program) is not
    deleted: the daemon exits 75 naming the listening pid, and the listener keeps its
    socket."""
    newcomer = make_daemon("newcomer")
    newcomer.socket_path.parent.mkdir(mode=0o700)
    ready = short_tmp / "listening"
    listener = subprocess.Popen(
        [
            sys.executable,
            "-c",
            LISTENER,
            str(newcomer.socket_path),
            str(ready),
        ]
    )
    try:
        wait_for(ready.exists, what="the listener")
        proc = newcomer.spawn()
        assert proc.wait(20) == EXIT_ALREADY_RUNNING, newcomer.log()
        assert f"pid {listener.pid}" in newcomer.log()
        probe = socket.socket(socket.AF_UNIX)
        probe.connect(str(newcomer.socket_path))  # still the listener's socket
        probe.close()
    finally:
        listener.kill()
        listener.wait()


def test_takeover_of_another_state_dirs_daemon_is_refused(daemon, make_daemon):
    """--takeover replaces a daemon of the same state dir; aimed at another state dir's
    daemon it is refused (exit 75) and does not stop it."""
    _complete_a_key(daemon)
    intruder = make_daemon("intruder")
    intruder.socket_path = daemon.socket_path
    proc = intruder.spawn("--takeover", "--takeover-timeout", "2")
    assert proc.wait(20) == EXIT_ALREADY_RUNNING, intruder.log()
    assert "another state dir" in intruder.log()
    assert daemon.proc.poll() is None
    _assert_first_still_serves_its_store(daemon)


def test_killed_daemons_socket_is_taken_by_the_next(daemon, make_daemon):
    """kill -9 leaves a dead socket file and a lock nobody holds: a daemon of another
    state dir may then serve that path (nothing is live there to be split from)."""
    daemon.kill9()
    successor = make_daemon("successor")
    successor.socket_path = daemon.socket_path
    successor.start()
    with successor.client() as client:
        assert client.status()["pid"] == successor.pid
    assert "stale_socket_replaced" in successor.log()
    assert successor.stop() == 0


def test_exit_removes_only_its_own_socket(daemon):
    """A daemon removes its socket at exit only if the file is still the one it bound."""
    replacement = daemon.socket_path.with_name("other.sock")
    placeholder = socket.socket(socket.AF_UNIX)
    placeholder.bind(str(replacement))
    os.replace(replacement, daemon.socket_path)  # somebody else's socket file now
    try:
        assert daemon.stop() == 0
        assert daemon.socket_path.exists()
    finally:
        placeholder.close()
