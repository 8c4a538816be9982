"""Whole-file operations that run on a short-lived connection of their own, in a worker
thread: WAL checkpoints, online backups, health checks. None of them holds up the
writer or the readers that serve requests.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import shutil
import sqlite3
import stat
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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


BACKUP_DIR_PREFIX = ".towerd-backup-"  # the private directory a backup is made in
STATE_BACKUP_DIR = "backups"  # in the state dir: migration backups (store.BACKUP_DIR), allowed


def backup(db_path: Path, target: Path, overwrite: bool) -> BackupResult:
    """A consistent online copy through SQLite's backup API, checked, then renamed into
    place (a reader never sees a half-written backup).

    The copy and SQLite's side files (``-journal``; ``-wal`` and ``-shm`` too, since the
    copy of a WAL database is itself WAL until switched) are made in a private directory
    (``mkdtemp``: 0700, ours) inside the target's directory: no name another user can
    guess and pre-create there is ever opened. The directory must not let others swap
    what we create (writable by others only if sticky), and a target that exists must be
    a regular file of ours: a symlink is never followed.
    """
    private: str | None = None
    try:
        directory = _target_directory(target)
        _refuse_state_directory(directory, db_path, target)
        final = directory / target.name
        _refuse_existing_target(final, target, overwrite)
        private = tempfile.mkdtemp(prefix=BACKUP_DIR_PREFIX, dir=directory)
        return _copy_into_place(db_path, Path(private) / "backup.db", final, target)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise StorageFull(f"no space left for the backup at {target}") from None
        raise BadArgs(f"cannot write the backup to {target}: {exc.strerror}") from None
    except sqlite3.Error as exc:
        if getattr(exc, "sqlite_errorcode", 0) & 0xFF == 13:
            raise StorageFull(f"no space left for the backup at {target}") from None
        if isinstance(exc, sqlite3.OperationalError):
            raise BadArgs(f"cannot write the backup to {target}: {exc}") from None
        raise
    finally:
        if private is not None:
            shutil.rmtree(private, ignore_errors=True)


def _target_directory(target: Path) -> Path:
    """The target's directory, resolved, once it is known that only we (or root) can
    replace what we create in it."""
    if not target.is_absolute():
        raise BadArgs(f"backup path {target} must be absolute")
    if not target.parent.is_dir():
        raise BadArgs(f"backup directory {target.parent} does not exist")
    directory = Path(os.path.realpath(target.parent))
    steps = [*reversed(directory.parents), directory]  # "/", ..., directory
    for holder, entry in itertools.pairwise(steps):
        _refuse_swappable(holder, entry, os.lstat(entry).st_uid)
    # ...and what we create in it (the private directory, then the backup), ours:
    _refuse_swappable(directory, directory / BACKUP_DIR_PREFIX, os.geteuid())
    return directory


def _refuse_state_directory(directory: Path, db_path: Path, target: Path) -> None:
    """Refuse a backup into the database's own directory, by whatever path it is reached
    (a symlinked parent, a bind mount): its rename could replace the live database or
    its ``-wal``, and the daemon then stops on a store that is no longer its own."""
    state_dir = Path(os.path.realpath(db_path.parent))
    here, state = os.stat(directory), os.stat(state_dir)
    if (here.st_dev, here.st_ino) == (state.st_dev, state.st_ino):
        raise BadArgs(
            f"backup refused: {target.parent} is towerd's state directory, and a backup "
            f"there could replace the live database; choose another directory, e.g. "
            f"{state_dir / STATE_BACKUP_DIR}"
        )


def _refuse_swappable(holder: Path, entry: Path, entry_uid: int) -> None:
    """Refuse ``holder`` if a user other than us or root could rename ``entry`` (owned by
    ``entry_uid``) out of it or put something else in its place: they own ``holder``, or
    may write in it and it is not sticky, or it is sticky and ``entry`` is theirs."""
    trusted = (0, os.geteuid())
    info = os.lstat(holder)
    fix = "back up into a directory only you (or root) can write, e.g. under your home"
    if info.st_uid not in trusted:
        raise BadArgs(
            f"backup refused: {holder} belongs to uid {info.st_uid}, who could swap the "
            f"backup for a file of theirs; {fix}"
        )
    if not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return
    if not info.st_mode & stat.S_ISVTX:
        raise BadArgs(
            f"backup refused: {holder} is writable by other users and not sticky, so they "
            f"could swap or read the backup; {fix}, or `chmod go-w {holder}`"
        )
    if entry_uid not in trusted:
        raise BadArgs(
            f"backup refused: {entry} belongs to uid {entry_uid} in the shared directory "
            f"{holder}, who could swap it; {fix}"
        )


def _refuse_existing_target(final: Path, target: Path, overwrite: bool) -> None:
    """Only a regular file of ours is ever replaced, and only with ``overwrite``."""
    try:
        info = os.lstat(final)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(info.st_mode):
        raise BadArgs(
            f"{target} is a symbolic link: a backup never follows one; "
            "remove it or choose another name"
        )
    if not stat.S_ISREG(info.st_mode):
        raise BadArgs(f"{target} exists and is not a regular file; choose another name")
    if info.st_uid != os.geteuid():
        raise BadArgs(
            f"{target} belongs to uid {info.st_uid}, not to towerd's uid {os.geteuid()}: "
            "it is not replaced; remove it or choose another name"
        )
    if not overwrite:
        raise Conflict(
            f"{target} exists; pass overwrite to replace it (towerctl backup --overwrite)",
            {"path": str(target)},
        )


def _copy_into_place(db_path: Path, copy_path: Path, final: Path, target: Path) -> BackupResult:
    """Copy into ``copy_path`` (created exclusively, 0600), check it, make it one
    self-contained file, fsync it, rename it to ``final`` and fsync the directory."""
    started = time.monotonic()
    os.close(os.open(copy_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
    with _connection(db_path, busy_timeout_ms=5000) as source:
        copy = sqlite3.connect(copy_path, isolation_level=None)
        try:
            source.backup(copy)  # one step: one read snapshot, writers keep going
            copy.execute("PRAGMA journal_mode = DELETE")  # no -wal/-shm beside it
            integrity = [row[0] for row in copy.execute("PRAGMA integrity_check")]
            pages = copy.execute("PRAGMA page_count").fetchone()[0]
        finally:
            copy.close()
    _fsync(copy_path)
    os.replace(copy_path, final)
    _fsync(final.parent)
    return BackupResult(
        path=str(target),
        bytes=final.stat().st_size,
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
        return ledger_health(
            conn,
            check=check,
            integrity=integrity,
            schema_version=version,
            supported_schema_version=schema.SCHEMA_VERSION,
            db_path=str(db_path),
            db_bytes=_size(db_path),
            wal_bytes=_size(wal_path(db_path)),
            now=int(time.time() * 1000),
        )


def ledger_health(conn: Any, *, now: int, **database: Any) -> DoctorResult:
    """The ledger's part of `doctor` (keys, unknown keys, uncertain effects, leases), in
    SQL both backends run; ``database`` is what the backend says of the database itself."""
    counts = KeyCounts(
        **dict(conn.execute("SELECT state, count(*) FROM idempotency GROUP BY state").fetchall())
    )
    unknown = [
        UnknownKey(principal=principal, operation=operation, key=key, effect_ref=ref, updated_at=at)
        for principal, operation, key, ref, at in conn.execute(
            """SELECT principal, operation, key, effect_ref, updated_at FROM idempotency
               WHERE state = 'outcome_unknown' ORDER BY updated_at LIMIT ?""",
            (UNKNOWN_SAMPLE,),
        ).fetchall()
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
        ).fetchall()
    ]
    live_leases = conn.execute(
        "SELECT count(*) FROM leases WHERE expires_at > ?", (now,)
    ).fetchone()[0]
    return DoctorResult(
        keys=counts,
        unknown_keys=unknown,
        oldest_in_progress_at=oldest_in_progress,
        uncertain_effects=uncertain,
        live_leases=live_leases,
        **database,
    )
