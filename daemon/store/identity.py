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
    return _read_private(state_dir, RECORD_FILE, "daemon id record").strip() or None


def _read_private(state_dir: Path, name: str, what: str) -> str:
    """A record of the state dir ('' if there is none), refused if others could write it."""
    path = state_dir / name
    check_private(path, what, want_dir=False)
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""


def write_record(state_dir: Path, daemon_id: str) -> None:
    _write_atomically(state_dir, RECORD_FILE, f"{daemon_id}\n")


def _write_atomically(state_dir: Path, name: str, text: str) -> None:
    """Temporary file, fsync, rename, fsync of the directory."""
    path = state_dir / name
    # Unique per writer: two threads of one daemon may write the same record at once.
    temporary = path.with_name(f".{name}.{os.getpid()}.{os.urandom(4).hex()}")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        try:
            os.write(fd, text.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temporary, path)
    except OSError:
        temporary.unlink(missing_ok=True)  # a full disk leaves no stray file behind
        raise
    directory = os.open(state_dir, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


# --- generations: a database rolled back (restored from a backup) is noticed ---------------
#
# The daemon id says whose database a file is, not how recent it is: a backup restored
# over towerd.db has the right id and forgets every key completed after it was taken, so
# those steps would run again. So the database and the state dir also share a
# *generation*, a random token replaced at every start (in the start-up transaction)
# and after every backup (store.py: the record accepts the old and the new token, the
# database takes the new one, then the record accepts only it). A database whose
# generation the state dir does not accept is older than the one the daemon last ran:
# refused unless ``--new-store``. A crash in the middle of a rotation refuses nothing.

GENERATION_FILE = "generation"
NO_GENERATION = "none"  # accepted while the database has none yet (first rotation)


def read_generations(state_dir: Path) -> list[str] | None:
    """The generations the state dir accepts, or None (no record: nothing is checked)."""
    return _read_private(state_dir, GENERATION_FILE, "generation record").split() or None


def refuse_rolled_back_store(
    state_dir: Path, db_path: Path, stored: str | None, new_store: bool
) -> None:
    """Before anything is written: refuse a database older than the one this state dir
    last ran (its generation is not one the record accepts)."""
    accepted = read_generations(state_dir)
    if accepted is None or (stored or NO_GENERATION) in accepted:
        return
    if new_store:
        log.warning("new_store", code="refused", reason="rolled_back", db_path=str(db_path))
        return
    raise StartRefused(
        f"the state database {db_path} is older than the one this daemon last ran (its "
        f"generation {stored or NO_GENERATION} is not the recorded {accepted[-1]}): it was "
        "restored from a backup or copied back. Keys completed since that copy are not "
        "in it, so their steps would run again, and fencing tokens issued since may be "
        "issued again. Put the newer database back, or, once every step that ran since "
        "is accounted for and no lease holder runs, "
        f"{NEW_STORE_HINT.replace('to begin an empty store', 'to run on this database')}"
    )


def record_text(tokens: list[str]) -> str:
    return " ".join(tokens) + "\n"


def rotation(token: str, current: str | None) -> tuple[str, str]:
    """The two records of a rotation to ``token``: the one written before the database
    takes it (both accepted) and the one after."""
    return record_text([current or NO_GENERATION, token]), record_text([token])


def write_generations(state_dir: Path, text: str) -> None:
    _write_atomically(state_dir, GENERATION_FILE, text)


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
