"""Where the daemon listens: one daemon per socket path, and never a live socket replaced.

Two daemons with different state dirs on one socket path split the fleet: clients
talk to whichever bound last, whose store has never heard of the keys the other
completed, so a retried step runs twice. So a daemon holds an exclusive flock on
``<socket>.lock`` beside the socket for its whole life (the kernel drops it when
the process dies, however it dies), recording its pid and state dir there so a
refused daemon can say who serves; and before replacing a socket file that is
already there it connects to it: if anything accepts, it refuses (that also
covers a listener that holds no lock, such as an older towerd).
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import stat
from pathlib import Path

import structlog

from towerd.daemon.instance import AlreadyRunning, read_holder, rewrite_record, take_lock_file
from towerd.daemon.private_paths import StartRefused, ensure_private_dir
from towerd.daemon.processes import PeerCredentials, peer_credentials

log = structlog.get_logger("towerd.listen")

MAX_SOCKET_PATH = 107  # sun_path is 108 bytes including the terminating NUL
BACKLOG = 4096  # the kernel caps it at net.core.somaxconn
LOCK_SUFFIX = ".lock"
PROBE_TIMEOUT = 1.0  # seconds a connect to an existing socket may take


def socket_lock_path(socket_path: Path) -> Path:
    return socket_path.with_name(socket_path.name + LOCK_SUFFIX)


class SocketLock:
    """An exclusive flock on ``<socket>.lock``: who holds it serves that socket path."""

    def __init__(self, fd: int, path: Path) -> None:
        self._fd = fd
        self.path = path

    @classmethod
    def acquire(
        cls, socket_path: Path, state_dir: Path, *, wait_seconds: float = 0.0
    ) -> SocketLock:
        """Take the lock, waiting up to ``wait_seconds``; else raise ``AlreadyRunning``
        naming the daemon that holds it."""
        check_socket_path_length(socket_path)
        ensure_private_dir(socket_path.parent, "socket dir")
        path = socket_lock_path(socket_path)

        def refusal(holder: dict[str, object]) -> AlreadyRunning:
            return AlreadyRunning(
                f"another towerd (pid {holder.get('pid', '?')}, state dir "
                f"{holder.get('state_dir', '?')}) serves the socket {socket_path}; "
                "stop it first, or give this daemon another --socket",
                holder,
            )

        fd = take_lock_file(path, "socket lock file", wait_seconds, refusal)
        record = {"pid": os.getpid(), "state_dir": str(state_dir), "socket": str(socket_path)}
        rewrite_record(fd, record)
        return cls(fd, path)

    def release(self) -> None:
        os.close(self._fd)


def current_holder(socket_path: Path) -> dict[str, object] | None:
    """The record of the daemon holding ``socket_path``'s lock now, or None if nobody
    holds it (a record left by a dead daemon is not a holder)."""
    path = socket_lock_path(socket_path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return read_holder(path)
    finally:
        os.close(fd)  # also drops the shared lock if we got it
    return None


def check_socket_path_length(path: Path) -> None:
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        raise StartRefused(
            f"socket path {path} is longer than {MAX_SOCKET_PATH} bytes; choose a shorter --socket"
        )


def live_listener(path: Path) -> PeerCredentials | None:
    """The process listening on the socket file ``path``, or None when nothing does
    (connection refused: a socket file left by a dead process). A connect that does
    not complete in time means a listener with a full backlog: live, pid unknown."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    probe.settimeout(PROBE_TIMEOUT)
    try:
        probe.connect(os.fspath(path))
        return peer_credentials(probe)
    except TimeoutError:
        return PeerCredentials(pid=0, uid=-1, gid=-1)
    except OSError as exc:
        if exc.errno in (errno.ECONNREFUSED, errno.ENOENT):
            return None
        raise StartRefused(f"cannot check the socket {path}: {exc.strerror}") from None
    finally:
        probe.close()


def refuse_live_socket(path: Path) -> None:
    """Refuse to start if ``path`` is a socket something still listens on; the caller
    holds the socket lock, so a listener there holds no lock (an older towerd, or any
    other program)."""
    try:
        info = path.lstat()
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        raise StartRefused(f"{path} exists and is not a socket; refusing to replace it")
    peer = live_listener(path)
    if peer is None:
        return
    who = f"pid {peer.pid}" if peer.pid else "a process whose pid is unknown (its backlog is full)"
    served = _state_dir_served(path)
    raise AlreadyRunning(
        f"the socket {path} is live: {who} listens on it"
        + (f" (a towerd with state dir {served})" if served else "")
        + "; stop it first, or give this daemon another --socket",
        {"pid": peer.pid, "state_dir": served, "socket": str(path)},
    )


def _state_dir_served(path: Path) -> str | None:
    """Ask a live towerd on ``path`` where its state is (best effort, one second)."""
    from towerd.client import Client, TowerdError

    try:
        with Client(path, timeout=PROBE_TIMEOUT, client_name="towerd (socket check)") as client:
            return os.path.dirname(str(client.status()["db_path"]))
    except (TowerdError, OSError, KeyError, TypeError):
        return None


class BoundSocket:
    """The listening socket this daemon created, and the file it created for it: only
    that very file is removed at exit (never one another process put there)."""

    def __init__(self, sock: socket.socket, path: Path) -> None:
        self.socket = sock
        self.path = path
        info = path.lstat()
        self._identity = (info.st_dev, info.st_ino)

    def unlink(self) -> None:
        try:
            info = self.path.lstat()
        except FileNotFoundError:
            return
        if (info.st_dev, info.st_ino) == self._identity:
            self.path.unlink(missing_ok=True)


def bind_private_socket(path: Path) -> BoundSocket:
    """Listen on ``path`` inside a private directory, mode 0600 from the first instant.

    The caller holds the socket lock and has checked with :func:`refuse_live_socket`
    that nothing listens there: a socket file still there was left by a dead process
    and is replaced.
    """
    check_socket_path_length(path)
    ensure_private_dir(path.parent, "socket dir")
    refuse_live_socket(path)
    try:
        path.unlink()
        log.info("stale_socket_replaced", socket=str(path))
    except FileNotFoundError:
        pass
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    previous = os.umask(0o177)  # the socket is born 0600: no window where it is wider
    try:
        sock.bind(os.fspath(path))
    except OSError as exc:
        sock.close()
        raise StartRefused(f"cannot listen on {path}: {exc.strerror}") from None
    finally:
        os.umask(previous)
    sock.listen(BACKLOG)
    return BoundSocket(sock, path)
