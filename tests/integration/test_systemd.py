"""systemd integration without systemd: a notify socket and a passed listening fd made
by the test, and the shipped unit files checked by systemd-analyze."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from towerd.client.systemd_units import UNITS, install_units, render_unit, towerd_executable
from towerd_testing import Daemon, wait_for


def test_ready_then_stopping_notifications(daemon):
    """READY=1 comes once serving (the fixture waited for it); SIGTERM sends STOPPING=1."""
    assert any("READY=1" in message for message in daemon.notify.messages)
    assert daemon.stop() == 0
    daemon.notify.wait_for("STOPPING=1", timeout=5)


def test_watchdog_pings_when_requested(make_daemon):
    daemon = make_daemon()
    daemon.start(env=daemon.env(WATCHDOG_USEC="200000"))
    daemon.notify.wait_for("WATCHDOG=1", timeout=5)
    assert daemon.stop() == 0


def test_socket_activation_serves_the_passed_fd(make_daemon, short_tmp):
    """With LISTEN_PID/LISTEN_FDS and a listening socket on fd 3, the daemon serves that
    socket (a client that connected before start-up is answered), and leaves the socket
    file to systemd when it stops."""
    daemon: Daemon = make_daemon()
    path = short_tmp / "activated.sock"
    listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listening.bind(str(path))
    listening.listen(16)
    early = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    early.connect(str(path))  # queued in the backlog before the daemon exists

    fd = listening.fileno()

    def put_on_fd3() -> None:
        os.dup2(fd, 3)

    command = daemon.command()
    daemon.proc = subprocess.Popen(
        ["sh", "-c", 'LISTEN_PID=$$ LISTEN_FDS=1 exec "$@"', "sh", *command],
        preexec_fn=put_on_fd3,
        pass_fds=(fd, 3),  # keep fd 3: put_on_fd3 runs before close_fds
        env=daemon.env(),
        stdout=open(daemon.log_path, "ab"),
        stderr=subprocess.STDOUT,
    )
    listening.close()
    proc = daemon.proc
    try:
        daemon.notify.wait_for("READY=1", timeout=20, alive=lambda: proc.poll() is None)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{daemon.log()}") from None

    from towerd.client import Client

    with Client(path) as client:
        status = client.status()
        assert status["pid"] == daemon.pid
        assert status["socket_path"] == str(path)
    early.close()
    assert not daemon.socket_path.exists(), "an activated daemon must not bind its own socket"
    assert daemon.stop() == 0
    assert path.exists(), "the activated socket belongs to systemd and stays"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_unit_files_verify_cleanly(short_tmp):
    """The units as installed (ExecStart pointing at this towerd) pass
    `systemd-analyze --user verify` with no warnings at all."""
    result = install_units(short_tmp / "units")
    paths = [str(short_tmp / "units" / name) for name in UNITS]
    assert result["installed"] == paths
    runtime = short_tmp / "runtime"
    runtime.mkdir(mode=0o700)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime)}
    verify = subprocess.run(
        ["systemd-analyze", "--user", "verify", *paths],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert verify.returncode == 0, verify.stderr
    assert verify.stderr.strip() == ""
    service = (short_tmp / "units" / "towerd.service").read_text()
    assert "@TOWERD@" not in service
    exec_start = next(line for line in service.splitlines() if line.startswith("ExecStart="))
    assert os.access(exec_start.split("=", 1)[1].split()[0], os.X_OK)


def test_sigterm_finishes_in_flight_requests(daemon):
    """SIGTERM while a client is connected: the daemon stops accepting, answers what it
    has, exits 0, and the client then sees the daemon unavailable."""
    from towerd.client import Unavailable

    client = daemon.client()
    assert client.ping()["pong"]
    daemon.proc.send_signal(15)
    wait_for(lambda: daemon.proc.poll() is not None, timeout=20, what="daemon exit")
    assert daemon.proc.returncode == 0
    with pytest.raises(Unavailable):
        client.ping()
    client.close()


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_a_towerd_path_with_a_space_is_one_word_of_execstart(short_tmp):
    """A venv under a directory with a space: ExecStart names the whole path (quoted), and
    systemd-analyze finds the program (unquoted it read "/.../a" and refused the unit)."""
    spaced = short_tmp / "my venvs" / "bin"
    spaced.mkdir(parents=True)
    (spaced / "towerd").symlink_to(towerd_executable())
    units = short_tmp / "units"
    units.mkdir()
    for name in UNITS:
        (units / name).write_text(render_unit(name, spaced / "towerd"))
    service = (units / "towerd.service").read_text()
    assert f'ExecStart="{spaced}/towerd" --socket' in service
    runtime = short_tmp / "runtime"
    runtime.mkdir(mode=0o700)
    verify = subprocess.run(
        ["systemd-analyze", "--user", "verify", *[str(units / name) for name in UNITS]],
        capture_output=True, text=True, env={**os.environ, "XDG_RUNTIME_DIR": str(runtime)},
        timeout=60,
    )  # fmt: skip
    assert verify.returncode == 0 and verify.stderr.strip() == "", verify.stderr


def test_the_units_name_the_exit_statuses_their_programs_declare():
    """systemd must not restart what restarting cannot mend: the statuses in each unit's
    RestartPreventExitStatus are the ones its program declares for that (a unit copied
    by hand would drift from them and loop)."""
    from towerd.client.cli.output import EXIT_ERROR, EXIT_USAGE
    from towerd.daemon.main import EXIT_ALREADY_RUNNING, EXIT_REFUSED

    root = Path(__file__).resolve().parents[2] / "systemd"

    def prevented(unit: str) -> set[int]:
        (line,) = [
            line for line in (root / unit).read_text().splitlines()
            if line.startswith("RestartPreventExitStatus=")
        ]  # fmt: skip
        return {int(word) for word in line.partition("=")[2].split()}

    assert prevented("towerd.service") == {EXIT_ALREADY_RUNNING, EXIT_REFUSED}
    assert prevented("towerd-notify.service") == {EXIT_ERROR, EXIT_USAGE}


def test_installed_units_keep_their_comments_readable(short_tmp):
    """The placeholder was named in a comment too, so the installed unit said it
    "replaces /home/.../towerd with the absolute path"."""
    for name in UNITS:
        text = (Path(__file__).resolve().parents[2] / "systemd" / name).read_text()
        comments = [line for line in text.splitlines() if line.startswith("#")]
        assert not [line for line in comments if "@" in line], (name, comments)
