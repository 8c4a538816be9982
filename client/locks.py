"""``towerctl lock worktree -- CMD ...``: a repository-wide lock with no lockfile to go stale.

The lock is a towerd lease on ``worktree:<the repository's git common directory>``
(its real path), so the main worktree and every linked worktree of one repository
contend for the same lease. Its holder is this towerctl process: the daemon releases
it when towerctl releases it after CMD, or at once when towerctl dies (killed, OOM),
not at a deadline. Nothing is left on disk either way. While it is held, a background
thread renews it every third of its TTL; if towerctl dies, CMD gets SIGTERM (Linux),
so it never runs on without the lock (git removes its own ``index.lock`` on SIGTERM).
"""

from __future__ import annotations

import os
import signal
import time
from typing import TYPE_CHECKING, Any

from towerd.client.cli.output import UsageError, say  # say sanitises: names hold paths
from towerd.protocol.errors import (
    LeaseExpired,
    LeaseHeld,
    LeaseNotFound,
    LeaseSuperseded,
    TowerdError,
)

if TYPE_CHECKING:
    import argparse

    from towerd.client.results import LeaseAcquireResult
    from towerd.client.sync import Client

_POLL_FIRST, _POLL_MAX = 0.05, 0.5


def worktree_resource(repo: str | os.PathLike[str]) -> str:
    """The lease name for the repository containing ``repo`` (any worktree of it). A
    lease name is text: bytes of the path that are not UTF-8 are named ``\\xNN``."""
    from towerd.client.git_tools import git_common_dir

    common_dir = os.fsencode(git_common_dir(repo)).decode("utf-8", "backslashreplace")
    return f"worktree:{common_dir}"


SHOWN_CMDLINE = 200  # characters of a lock holder's command line shown in a refusal


def describe(lease: dict[str, Any]) -> str:
    """Who holds ``lease``, with the holder's command line when this host can read it."""
    text = str(lease.get("holder", "another holder"))
    pid = lease.get("holder_pid")
    if isinstance(pid, int):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                words = cmdline.read().rstrip(b"\0").split(b"\0")
            shown = " ".join(w.decode(errors="replace") for w in words)
            if len(shown) > SHOWN_CMDLINE:  # its start (the program) and its end (what
                # it runs), whatever the length of the paths between them
                head = SHOWN_CMDLINE // 3
                shown = f"{shown[:head]}...{shown[-(SHOWN_CMDLINE - head - 3) :]}"
            if shown:
                text += f" ({shown})"
        except OSError:
            pass
    return text


def acquire_waiting(
    client: Client,
    resource: str,
    ttl_ms: int,
    timeout: float,
    waiting: Any = None,
) -> LeaseAcquireResult:
    """``lease.acquire``, repeated while another holder has it, for up to ``timeout``
    seconds; ``waiting(error)`` is called once, at the first refusal. Raises the last
    ``LeaseHeld`` at the deadline."""
    deadline = time.monotonic() + timeout
    delay = _POLL_FIRST
    told = False
    while True:
        try:
            return client.lease_acquire(resource, ttl_ms=ttl_ms)
        except LeaseHeld as exc:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise
            if not told and waiting is not None:
                waiting(exc)
                told = True
            # Waiting for another process to finish: poll, backing off to half a second.
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, _POLL_MAX)


class LeaseBeat:
    """Renews a lease on a connection of its own; records the error once it is lost."""

    LOST = (LeaseExpired, LeaseSuperseded, LeaseNotFound)

    def __init__(self, connect: Any, resource: str, token: int, ttl_ms: int) -> None:
        self._connect = connect
        self._client: Client | None = None
        self.resource, self.token, self.ttl_ms = resource, token, ttl_ms
        self.lost: TowerdError | None = None

    def __call__(self) -> bool:
        from towerd.protocol.errors import Unavailable

        try:
            if self._client is None:
                self._client = self._connect()
            self._client.lease_renew(self.resource, self.token, ttl_ms=self.ttl_ms)
        except Unavailable:
            self.close()
            return True
        except self.LOST as exc:
            self.lost = exc
            say(
                f"towerctl: lost the lock on {self.resource} while the command runs: {exc.message}",
                to_stderr=True,
            )
            return False
        except TowerdError:
            return True
        return True

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


def lock_worktree(args: argparse.Namespace) -> int:
    """``towerctl lock worktree [--timeout S] [--repo PATH] -- CMD ...``."""
    from towerd.client.effect import Heartbeat
    from towerd.client.exactly_once import (
        EXIT_BUSY,
        EXIT_UNKNOWN,
        Child,
        RetryingConnection,
        command_argv,
        error_out,
        not_started,
        note,
    )
    from towerd.client.git_tools import GitError

    argv = command_argv(args, "lock worktree")
    if args.wait_timeout < 0:
        raise UsageError("lock worktree: --timeout must not be negative")
    try:
        resource = worktree_resource(args.repo)
    except GitError as exc:
        raise UsageError(f"lock worktree: {exc}") from None
    ttl_ms = args.lease_ttl
    conn = RetryingConnection(args)

    def waiting(exc: LeaseHeld) -> None:
        lease = (exc.data or {}).get("lease", {})
        shown = f"{resource} is locked by {describe(lease)}"
        note(args, f"{shown}; waiting up to {args.wait_timeout:g}s")

    try:
        lease = acquire_waiting(conn.open(), resource, ttl_ms, args.wait_timeout, waiting)
    except KeyboardInterrupt:
        note(args, "interrupted while waiting for the lock; CMD was not run")
        return 130
    except LeaseHeld as exc:
        lease_data = (exc.data or {}).get("lease", {})
        timed_out = LeaseHeld(
            f"gave up after {args.wait_timeout:g}s: {resource} is locked by {describe(lease_data)}",
            exc.data,
        )
        return error_out(args, timed_out, EXIT_BUSY, "CMD was not run")
    token = lease["fencing_token"]
    try:
        child = Child(argv, die_with_parent=signal.SIGTERM)
    except OSError as exc:
        _release(conn, resource, token)
        return not_started(args, argv, exc, "the lock is released")
    beat = LeaseBeat(lambda: conn.new_client("/renew"), resource, token, ttl_ms)
    renewal = Heartbeat(beat, ttl_ms / 3000, name="towerd-lease-renewal", on_stop=beat.close)
    renewal.start()
    try:
        outcome = child.wait()
    finally:
        renewal.stop()
        if beat.lost is None:
            _release(conn, resource, token)
    if beat.lost is not None:
        return error_out(
            args,
            beat.lost,
            EXIT_UNKNOWN,
            f"the command exited {outcome.exit_status}, but the lock was lost while it ran: "
            "another holder may have worked in the repository at the same time",
        )
    return outcome.exit_status


def _release(conn: Any, resource: str, token: int) -> None:
    """Give the lease back. Failing that, it goes when this process exits anyway."""
    try:
        conn.call("lease_release", resource, token)
    except TowerdError:
        pass
