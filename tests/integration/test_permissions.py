"""Only the daemon's own user gets in: private modes, unsafe directories refused,
peers of another uid closed before any frame is read."""

from __future__ import annotations

import os
import stat
import struct
import subprocess
import textwrap

import msgspec
import pytest

EXIT_REFUSED = 78


def mode(path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def test_socket_state_dir_and_db_are_private(daemon):
    assert mode(daemon.socket_path) == 0o600
    assert mode(daemon.socket_path.parent) == 0o700
    assert mode(daemon.state_dir) == 0o700
    assert mode(daemon.state_dir / "towerd.db") == 0o600
    assert mode(daemon.state_dir / "towerd.lock") == 0o600


@pytest.mark.parametrize("which", ["socket dir", "state dir"])
def test_directory_open_to_others_is_refused(make_daemon, which):
    """A socket dir or state dir with mode 0755 is refused at start (exit 78), naming it."""
    daemon = make_daemon()
    target = daemon.socket_path.parent if which == "socket dir" else daemon.state_dir
    target.mkdir(mode=0o755)
    target.chmod(0o755)
    assert daemon.spawn().wait(20) == EXIT_REFUSED
    assert str(target) in daemon.log() and "0755" in daemon.log()


def test_symlinked_state_dir_is_refused(make_daemon, short_tmp):
    daemon = make_daemon()
    real = short_tmp / "elsewhere"
    real.mkdir(mode=0o700)
    daemon.state_dir.symlink_to(real)
    assert daemon.spawn().wait(20) == EXIT_REFUSED
    assert "symlink" in daemon.log()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to chown to another uid")
def test_socket_dir_owned_by_another_uid_is_refused(make_daemon):
    daemon = make_daemon()
    daemon.socket_path.parent.mkdir(mode=0o700)
    os.chown(daemon.socket_path.parent, 65534, 65534)
    assert daemon.spawn().wait(20) == EXIT_REFUSED
    assert "uid 65534" in daemon.log()


NOBODY_CLIENT = textwrap.dedent(
    """
    import socket, struct, sys
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(sys.argv[1])
    hello = (b"\\x83\\xa2id\\x01\\xa6method\\xa5hello\\xa6params\\x82"
             b"\\xa8protocol\\x01\\xa6client\\xa6nobody")
    try:
        sock.sendall(struct.pack(">I", len(hello)) + hello)
    except OSError:
        pass
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:  # closed with our hello unread: same as EOF here
            break
        if not chunk:
            break
        data += chunk
    sys.stdout.write(data.hex())
    """
)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another uid")
def test_peer_of_another_uid_is_refused_even_on_a_world_writable_socket(daemon, short_tmp):
    """A client running as nobody gets one `unauthorized` error frame and EOF, even though
    the test made the socket and its directories world-accessible."""
    for path in (short_tmp, daemon.socket_path.parent):
        path.chmod(0o755)
    daemon.socket_path.chmod(0o777)
    result = subprocess.run(
        ["/usr/bin/python3", "-I", "-c", NOBODY_CLIENT, str(daemon.socket_path)],
        user=65534,
        group=65534,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    data = bytes.fromhex(result.stdout)
    (length,) = struct.unpack(">I", data[:4])
    assert len(data) == 4 + length, "exactly one frame, then the connection closed"
    answer = msgspec.msgpack.decode(data[4:])
    assert answer["id"] == 0
    assert answer["error"]["code"] == "unauthorized"
    daemon.socket_path.parent.chmod(0o700)  # clients rightly refuse a socket dir open to others
    with daemon.client() as client:  # the daemon's own user is still served
        assert client.ping()["pong"]
