"""The default socket path, the socket-directory check and the frame ceiling, on real
files and sockets of this user (the other-uid cases are in
tests/integration/test_client_trust.py)."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from towerd.client import Client, Unauthorized, Unavailable
from towerd.client.sync import MAX_RESPONSE_FRAME, request_limit, response_limit
from towerd.client.trust import check_socket_dir
from towerd.protocol import DEFAULT_MAX_FRAME, RESPONSE_SLACK
from towerd.protocol.paths import default_socket_path, default_state_dir


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    for name in ("TOWERD_SOCKET", "TOWERD_STATE_DIR", "XDG_RUNTIME_DIR", "XDG_STATE_HOME"):
        monkeypatch.delenv(name, raising=False)
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    return home


def test_without_xdg_runtime_dir_the_socket_is_in_the_state_home(clean_env, monkeypatch):
    home = clean_env
    assert default_socket_path() == str(home / ".local" / "state" / "towerd" / "towerd.sock")
    monkeypatch.setenv("XDG_STATE_HOME", "/somewhere/state")
    assert default_socket_path() == "/somewhere/state/towerd/towerd.sock"
    assert default_state_dir() == "/somewhere/state/towerd"
    monkeypatch.setenv("TOWERD_STATE_DIR", "/other/state")  # the socket does not follow it
    assert default_socket_path() == "/somewhere/state/towerd/towerd.sock"
    monkeypatch.setenv("XDG_STATE_HOME", "")  # empty counts as unset
    assert default_socket_path() == str(home / ".local" / "state" / "towerd" / "towerd.sock")
    assert not default_socket_path().startswith("/tmp/towerd-")


def test_towerd_socket_then_xdg_runtime_dir_still_come_first(clean_env, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", "/somewhere/state")
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/1000")
    assert default_socket_path() == "/run/user/1000/towerd/towerd.sock"
    monkeypatch.setenv("TOWERD_SOCKET", "/x/y.sock")
    assert default_socket_path() == "/x/y.sock"


def test_a_private_directory_of_ours_passes(short_tmp):
    check_socket_dir(str(short_tmp / "towerd.sock"))  # mkdtemp: 0700, ours


def test_our_directory_open_to_others_is_refused_with_the_fix(short_tmp):
    directory = short_tmp / "run"
    directory.mkdir(mode=0o700)
    directory.chmod(0o750)
    with pytest.raises(Unauthorized) as raised:
        check_socket_dir(str(directory / "towerd.sock"))
    assert raised.value.data["mode"] == "0750"
    assert f"chmod 700 {directory}" in raised.value.message
    assert f"owner uid {os.geteuid()}" in raised.value.message


def test_a_symlinked_directory_is_refused(short_tmp):
    real = short_tmp / "real"
    real.mkdir(mode=0o700)
    (short_tmp / "link").symlink_to(real)
    with pytest.raises(Unauthorized) as raised:
        check_socket_dir(str(short_tmp / "link" / "towerd.sock"))
    assert "is a symlink" in raised.value.message


def test_a_missing_directory_is_left_to_connect(short_tmp):
    with pytest.raises(FileNotFoundError):
        check_socket_dir(str(short_tmp / "absent" / "towerd.sock"))


def test_client_sends_nothing_through_a_directory_open_to_others(short_tmp):
    """A real listener of ours, in a directory others may enter: the client never
    connects (the listener accepts nothing)."""
    directory = short_tmp / "open"
    directory.mkdir(mode=0o700)
    path = directory / "towerd.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)
    directory.chmod(0o755)
    try:
        with pytest.raises(Unauthorized) as raised:
            Client(path, timeout=2)
        assert raised.value.data["reason"] == "socket_dir"
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing ever connected
    finally:
        listener.close()


def test_a_missing_socket_dir_is_still_unavailable_connect(short_tmp):
    path = short_tmp / "absent" / "towerd.sock"
    with pytest.raises(Unavailable) as raised:
        Client(path, timeout=2)
    assert raised.value.data == {"socket": str(path), "reason": "connect"}


@pytest.mark.parametrize(
    ("announced", "accepted"),
    [
        (2**40, MAX_RESPONSE_FRAME),
        (MAX_RESPONSE_FRAME, MAX_RESPONSE_FRAME),
        (DEFAULT_MAX_FRAME, DEFAULT_MAX_FRAME + RESPONSE_SLACK),
        (10, DEFAULT_MAX_FRAME + RESPONSE_SLACK),
        ("1e12", DEFAULT_MAX_FRAME + RESPONSE_SLACK),
        (None, DEFAULT_MAX_FRAME + RESPONSE_SLACK),
    ],
)
def test_the_response_limit_never_exceeds_the_ceiling(announced, accepted):
    hello = {"max_frame": announced}
    assert response_limit(hello) == accepted
    assert request_limit(hello) + RESPONSE_SLACK <= MAX_RESPONSE_FRAME
    assert MAX_RESPONSE_FRAME == 64 * 1024 * 1024  # the figure in docs/protocol.md §2


@pytest.mark.anyio
async def test_a_full_backlog_is_unavailable_not_unauthorized(short_tmp):
    """asyncio takes a unix connect refused with EAGAIN (full backlog) for a connection;
    the peer check finds no credentials there: a failure to connect, not an impostor."""
    from towerd.client.aio import AsyncClient

    path = short_tmp / "full.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(0)
    queued = []
    try:
        while True:
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            probe.setblocking(False)
            queued.append(probe)
            try:
                probe.connect(str(path))
            except BlockingIOError:
                break
        with pytest.raises(Unavailable) as raised:
            async with AsyncClient.open(path, timeout=2):
                pass
        assert raised.value.data == {"socket": str(path), "reason": "connect"}
        with pytest.raises(Unavailable) as raised:
            Client(path, timeout=2)
        assert raised.value.data == {"socket": str(path), "reason": "connect"}
    finally:
        for probe in queued:
            probe.close()
        listener.close()
