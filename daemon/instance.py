"""One daemon per state dir: an exclusive flock on ``towerd.lock``.

The lock is taken before the database is opened and held for the process's
life; the kernel drops it when the process dies, however it dies, so there is
no stale lock to clean up. The file records the holder's pid and socket so a
second ``towerd`` can say who is running.
"""

from __future__ import annotations

import fcntl
import json
import os
import select
import time
from collections.abc import Callable
from pathlib import Path

from towerd.daemon.private_paths import StartRefused, check_private

LOCK_FILE = "towerd.lock"


class AlreadyRunning(StartRefused):
    """Another towerd holds the state dir."""

    def __init__(self, message: str, holder: dict[str, object]) -> None:
        super().__init__(message)
        self.holder = holder


class InstanceLock:
    def __init__(self, fd: int, path: Path) -> None:
        self._fd = fd
        self.path = path
        self._record: dict[str, object] = {}

    @classmethod
    def acquire(
        cls, state_dir: Path, socket_path: Path, *, wait_seconds: float = 0.0
    ) -> InstanceLock:
        """Take the lock, waiting up to ``wait_seconds``; else raise ``AlreadyRunning``."""
        path = state_dir / LOCK_FILE

        def refusal(holder: dict[str, object]) -> AlreadyRunning:
            return AlreadyRunning(
                f"towerd is already running on state dir {state_dir} "
                f"(pid {holder.get('pid', '?')}, socket {holder.get('socket', '?')}); "
                "stop it first, or start with --takeover",
                holder,
            )

        fd = take_lock_file(path, "lock file", wait_seconds, refusal)
        lock = cls(fd, path)
        # The previous daemon's id is kept: it tells a later start that a store lived
        # here (daemon/store/identity.py).
        lock._write(socket=str(socket_path), daemon_id=read_holder(path).get("daemon_id"))
        return lock

    def _write(self, **fields: object) -> None:
        record = {"pid": os.getpid(), **{k: v for k, v in fields.items() if v is not None}}
        rewrite_record(self._fd, record)
        self._record = record

    def record_daemon(self, daemon_id: str) -> None:
        """Note which store this daemon opened."""
        self._write(socket=self._record.get("socket"), daemon_id=daemon_id)

    def release(self) -> None:
        os.close(self._fd)


def take_lock_file(
    path: Path,
    what: str,
    wait_seconds: float,
    refusal: Callable[[dict[str, object]], AlreadyRunning],
) -> int:
    """Open the private file ``path`` and take an exclusive flock on it, waiting up to
    ``wait_seconds``; else raise ``refusal(the holder's record)``. Returns the fd, which
    holds the lock until it is closed (or the process dies)."""
    check_private(path, what, want_dir=False)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    deadline = time.monotonic() + wait_seconds
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() >= deadline:
                holder = read_holder(path)
                os.close(fd)
                raise refusal(holder) from None
            # select, not time.sleep: the latter fails under libfaketime (clock tests).
            select.select([], [], [], 0.05)


def rewrite_record(fd: int, record: dict[str, object]) -> None:
    """Replace a lock file's record in place. Written over the old bytes, then cut to
    length, so it needs no new block when it is no longer than before (a full disk); if
    it cannot be written at all, the lock still holds: the record only informs."""
    data = json.dumps(record).encode()
    try:
        os.pwrite(fd, data, 0)
        os.ftruncate(fd, len(data))
    except OSError:
        pass


def read_holder(path: Path) -> dict[str, object]:
    try:
        holder = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}
