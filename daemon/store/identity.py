"""The store's identity outside the store: a lost database is never silently replaced.

The daemon id lives in the database, so a database deleted under a running
daemon (``rm towerd.db*``) used to come back at the next start as a fresh store
with a new daemon id, every acknowledged key forgotten, every retried step run
again. The state dir therefore keeps a second record of the id, ``daemon_id``,
written once the store has it. A start that finds no database but signs that
one existed (that record, migration backups, a WAL left behind, the previous
daemon's id in the lock file) refuses to mint a new identity unless told
``--new-store``; a database whose id differs from the record (a file swapped in
from elsewhere) is refused the same way.
"""

from __future__ import annotations

import os
from pathlib import Path

import structlog

from towerd.daemon.instance import LOCK_FILE, read_holder
from towerd.daemon.private_paths import StartRefused, check_private

log = structlog.get_logger("towerd.store")

RECORD_FILE = "daemon_id"
NEW_STORE_HINT = "start towerd once with --new-store to begin an empty store on purpose"


def record_path(state_dir: Path) -> Path:
    return state_dir / RECORD_FILE


def read_record(state_dir: Path) -> str | None:
    path = record_path(state_dir)
    check_private(path, "daemon id record", want_dir=False)
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    return text or None


def write_record(state_dir: Path, daemon_id: str) -> None:
    """Atomically (temporary file, fsync, rename, fsync of the directory)."""
    path = record_path(state_dir)
    temporary = path.with_name(f".{RECORD_FILE}.{os.getpid()}")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, f"{daemon_id}\n".encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(temporary, path)
    directory = os.open(state_dir, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def signs_of_a_previous_store(state_dir: Path, db_path: Path, backup_dir: Path) -> list[str]:
    """What in ``state_dir`` says a store lived here (empty for a first start)."""
    signs = []
    recorded = read_record(state_dir)
    if recorded is not None:
        signs.append(f"its daemon id record {record_path(state_dir)} ({recorded})")
    try:
        backups = sorted(backup_dir.glob("*.db"))
    except OSError:
        backups = []
    if backups:
        signs.append(f"{len(backups)} backup(s) in {backup_dir} (newest {backups[-1].name})")
    for leftover in ("-wal", "-shm"):
        side = db_path.with_name(db_path.name + leftover)
        if side.exists():
            signs.append(f"a leftover {side.name}")
    previous = read_holder(state_dir / LOCK_FILE).get("daemon_id")
    if previous is not None and recorded is None:
        signs.append(f"the lock file names daemon {previous}")
    return signs


def refuse_lost_store(state_dir: Path, db_path: Path, backup_dir: Path, new_store: bool) -> None:
    """Before a missing database is created afresh: refuse if one existed here."""
    if db_path.exists():
        return
    signs = signs_of_a_previous_store(state_dir, db_path, backup_dir)
    if not signs:
        return
    if new_store:
        log.warning("new_store", code="refused", db_path=str(db_path), signs=signs)
        return
    raise StartRefused(
        f"the state database {db_path} is missing, but this state dir held a store "
        f"({'; '.join(signs)}): starting afresh would forget every acknowledged key and "
        f"run retried steps again. Restore the database from a backup, or {NEW_STORE_HINT}"
    )


def refuse_foreign_store(state_dir: Path, stored_id: str | None, new_store: bool) -> None:
    """Before anything is written: refuse a database whose daemon id is not the one this
    state dir recorded (a file swapped in from elsewhere)."""
    recorded = read_record(state_dir)
    if stored_id is None or recorded is None or recorded == stored_id:
        return
    if new_store:
        log.warning("new_store", code="refused", recorded=recorded, database=stored_id)
        return
    raise StartRefused(
        f"the state database in {state_dir} belongs to daemon {stored_id}, but this state "
        f"dir is daemon {recorded}'s: the database was replaced. Put daemon {recorded}'s "
        f"database back, or {NEW_STORE_HINT} (adopting this database)"
    )


def keep_record(state_dir: Path, daemon_id: str) -> None:
    """Once the store is open: the state dir's record names its daemon id."""
    if read_record(state_dir) != daemon_id:
        write_record(state_dir, daemon_id)
