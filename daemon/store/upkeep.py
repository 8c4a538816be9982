"""Whole-file operations that run on a short-lived connection of their own, in a worker
thread: WAL checkpoints, online backups, health checks. None of them holds up the
writer or the readers that serve requests.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

from towerd.daemon.store import schema
from towerd.protocol.errors import BadArgs, Conflict, StorageFull
from towerd.protocol.methods import (
    BackupResult,
    DoctorResult,
    KeyCounts,
    UncertainEffect,
    UnknownKey,
)

UNKNOWN_SAMPLE = 20


def wal_path(db_path: Path) -> Path:
    return db_path.with_name(db_path.name + "-wal")


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


@contextlib.contextmanager
def _connection(db_path: Path, *, busy_timeout_ms: int) -> Iterator[sqlite3.Connection]:
    conn = sqlite3.connect(db_path, isolation_level=None, timeout=busy_timeout_ms / 1000)
    try:
        conn.execute("PRAGMA synchronous = FULL")
        yield conn
    finally:
        conn.close()


def checkpoint(db_path: Path, min_wal_bytes: int) -> tuple[int, int] | None:
    """Truncate the WAL if it is over ``min_wal_bytes`` and no reader or writer is in
    the way (never waits for them: it simply tries again next time).

    Returns the WAL size before and after, or None when nothing was attempted.
    """
    before = _size(wal_path(db_path))
    if before < min_wal_bytes:
        return None
    with _connection(db_path, busy_timeout_ms=0) as conn:
        try:
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        except sqlite3.OperationalError:
            pass  # busy: a long reader or the writer holds it; next time
    return before, _size(wal_path(db_path))


def backup(db_path: Path, target: Path, overwrite: bool) -> BackupResult:
    """A consistent online copy through SQLite's backup API, checked, then renamed into
    place (a reader never sees a half-written backup)."""
    temporary = target.with_name(f".{target.name}.partial-{os.getpid()}")
    try:
        return _backup(db_path, target, temporary, overwrite)
    except OSError as exc:
        with contextlib.suppress(OSError):
            temporary.unlink(missing_ok=True)
        if exc.errno == errno.ENOSPC:
            raise StorageFull(f"no space left for the backup at {target}") from None
        raise BadArgs(f"cannot write the backup to {target}: {exc.strerror}") from None
    except sqlite3.Error as exc:
        with contextlib.suppress(OSError):
            temporary.unlink(missing_ok=True)
        if getattr(exc, "sqlite_errorcode", 0) & 0xFF == 13:
            raise StorageFull(f"no space left for the backup at {target}") from None
        if isinstance(exc, sqlite3.OperationalError):
            raise BadArgs(f"cannot write the backup to {target}: {exc}") from None
        raise


def _backup(db_path: Path, target: Path, temporary: Path, overwrite: bool) -> BackupResult:
    if not target.is_absolute():
        raise BadArgs(f"backup path {target} must be absolute")
    if not target.parent.is_dir():
        raise BadArgs(f"backup directory {target.parent} does not exist")
    if target.exists() and not overwrite:
        raise Conflict(f"{target} exists; pass overwrite to replace it", {"path": str(target)})
    started = time.monotonic()
    with _connection(db_path, busy_timeout_ms=5000) as source:
        copy = sqlite3.connect(temporary, isolation_level=None)
        try:
            source.backup(copy)  # one step: one read snapshot, writers keep going
            integrity = [row[0] for row in copy.execute("PRAGMA integrity_check")]
            pages = copy.execute("PRAGMA page_count").fetchone()[0]
            copy.execute("PRAGMA journal_mode = DELETE")  # one self-contained file
        finally:
            copy.close()
    os.chmod(temporary, 0o600)
    _fsync(temporary)
    os.replace(temporary, target)
    _fsync(target.parent)
    return BackupResult(
        path=str(target),
        bytes=target.stat().st_size,
        pages=pages,
        integrity=integrity,
        duration_ms=int((time.monotonic() - started) * 1000),
    )


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def health(db_path: Path, full: bool) -> DoctorResult:
    """What `towerctl doctor` needs to know about the database itself."""
    check = "integrity_check" if full else "quick_check"
    with _connection(db_path, busy_timeout_ms=5000) as conn:
        conn.execute("PRAGMA query_only = 1")
        integrity = [row[0] for row in conn.execute(f"PRAGMA {check}")]
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        counts = KeyCounts(
            **dict(conn.execute("SELECT state, count(*) FROM idempotency GROUP BY state"))
        )
        unknown = [
            UnknownKey(
                principal=principal, operation=operation, key=key, effect_ref=ref, updated_at=at
            )
            for principal, operation, key, ref, at in conn.execute(
                """SELECT principal, operation, key, effect_ref, updated_at FROM idempotency
                   WHERE state = 'outcome_unknown' ORDER BY updated_at LIMIT ?""",
                (UNKNOWN_SAMPLE,),
            )
        ]
        oldest_in_progress = conn.execute(
            "SELECT min(created_at) FROM idempotency WHERE state = 'in_progress'"
        ).fetchone()[0]
        uncertain = [
            UncertainEffect(*row)
            for row in conn.execute(
                """SELECT effect_key, run_id, action_kind, target_ref, attempt_id, heartbeat_at
                   FROM effects WHERE status = 'uncertain' ORDER BY heartbeat_at LIMIT ?""",
                (UNKNOWN_SAMPLE,),
            )
        ]
        live_leases = conn.execute(
            "SELECT count(*) FROM leases WHERE expires_at > ?", (int(time.time() * 1000),)
        ).fetchone()[0]
    return DoctorResult(
        check=check,
        integrity=integrity,
        schema_version=version,
        supported_schema_version=schema.SCHEMA_VERSION,
        db_path=str(db_path),
        db_bytes=_size(db_path),
        wal_bytes=_size(wal_path(db_path)),
        keys=counts,
        unknown_keys=unknown,
        oldest_in_progress_at=oldest_in_progress,
        uncertain_effects=uncertain,
        live_leases=live_leases,
    )
