"""Plain-sqlite3 stand-ins for towerd's durable writes (used by bench/writes.py).

* :func:`create_db`: a fresh file holding towerd's own ``idempotency`` table and
  index (the statements are taken from towerd's schema, so the shape is the
  same), in WAL mode.
* :class:`DirectKeys`: what a tool that skips the daemon would do from every
  process: open the same file (WAL, ``synchronous=FULL``, ``busy_timeout``)
  and run claim and complete as one ``BEGIN IMMEDIATE`` transaction each,
  with the same statements towerd's store runs, retrying on ``SQLITE_BUSY``.
* :func:`insert_batch`: the ceiling, the same completed rows inserted with
  ``executemany`` in one transaction per batch.
"""

from __future__ import annotations

import hashlib
import os
import sqlite3
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import msgspec

from towerd.daemon.store.schema import MIGRATIONS

T = TypeVar("T")

SQLITE_BUSY = 5
SQLITE_LOCKED = 6
BUSY_TIMEOUT_MS = 5000

PRINCIPAL = f"uid:{os.geteuid()}:default"
DAEMON_ID = "00000000-0000-4000-8000-000000000000"
NULL_PAYLOAD_HASH = hashlib.sha256(msgspec.msgpack.encode(None)).digest()

_INSERT = """INSERT INTO idempotency (principal, operation, key, payload_hash, state, effect_ref,
    result, holder_pid, holder_start, attempt, daemon_id, created_at, updated_at)
    VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"""
_SELECT = """SELECT operation, key, state, effect_ref, result, created_at, updated_at, holder_pid,
    payload_hash, holder_start, attempt FROM idempotency
    WHERE principal = ? AND operation = ? AND key = ?"""
_COMPLETE = """UPDATE idempotency SET state = 'completed', result = ?, updated_at = ?
    WHERE principal = ? AND operation = ? AND key = ?"""


def idempotency_ddl() -> list[str]:
    """towerd's own CREATE statements for the idempotency table, its indexes and its
    quota counter (the table and triggers): the same schema, so the same work per row."""
    return [
        statement
        for migration in MIGRATIONS
        for statement in migration.statements
        if statement.lstrip().upper().startswith("CREATE")
        and (
            "TABLE idempotency" in statement
            or " ON idempotency" in statement
            or statement.lstrip().startswith("CREATE TABLE quota_usage")
        )
    ]


def connect(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None, timeout=BUSY_TIMEOUT_MS / 1000)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA synchronous = FULL")
    conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
    return conn


def create_db(path: Path) -> None:
    conn = connect(path)
    try:
        for statement in idempotency_ddl():
            conn.execute(statement)
    finally:
        conn.close()


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def _is_busy(exc: sqlite3.OperationalError) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return code & 0xFF in (SQLITE_BUSY, SQLITE_LOCKED)
    return "locked" in str(exc) or "busy" in str(exc)


class DirectKeys:
    """Claim and complete straight on the file, one IMMEDIATE transaction each."""

    def __init__(self, path: Path, operation: str) -> None:
        self.conn = connect(path)
        self.operation = operation
        self.retries = 0  # transactions retried after SQLITE_BUSY (busy_timeout ran out)

    def _transaction(self, body: Callable[[sqlite3.Connection], T]) -> T:
        conn = self.conn
        while True:
            try:
                conn.execute("BEGIN IMMEDIATE")
                try:
                    value = body(conn)
                    conn.execute("COMMIT")
                    return value
                except BaseException:
                    if conn.in_transaction:
                        conn.execute("ROLLBACK")
                    raise
            except sqlite3.OperationalError as exc:
                if not _is_busy(exc):
                    raise
                self.retries += 1

    def claim(self, key: str) -> str:
        """towerd's claim: look the key up, insert it ``in_progress`` if new."""
        return self._transaction(lambda conn: claim_statements(conn, self.operation, key))

    def complete(self, key: str, result: object) -> None:
        """towerd's complete: read the key, set it ``completed``, read it back."""
        self._transaction(lambda conn: complete_statements(conn, self.operation, key, result))

    def close(self) -> None:
        self.conn.close()


def claim_statements(conn: sqlite3.Connection, operation: str, key: str) -> str:
    """The statements of a claim (inside the caller's transaction)."""
    row = conn.execute(_SELECT, (PRINCIPAL, operation, key)).fetchone()
    if row is not None:
        raise RuntimeError(f"key {key!r} exists already (keys must be distinct)")
    now = now_ms()
    effect_ref = str(uuid.uuid4())
    conn.execute(
        _INSERT,
        (PRINCIPAL, operation, key, NULL_PAYLOAD_HASH, "in_progress", effect_ref, None,
         os.getpid(), 0, None, DAEMON_ID, now, now),
    )  # fmt: skip
    return effect_ref


def complete_statements(conn: sqlite3.Connection, operation: str, key: str, result: object) -> None:
    """The statements of a complete (inside the caller's transaction)."""
    args = (PRINCIPAL, operation, key)
    row = conn.execute(_SELECT, args).fetchone()
    if row is None or row[2] != "in_progress":
        raise RuntimeError(f"key {key!r} is not in progress: {row!r}")
    conn.execute(_COMPLETE, (msgspec.msgpack.encode(result), now_ms(), *args))
    conn.execute(_SELECT, args).fetchone()


_MINIMAL_COMPLETE = """UPDATE idempotency SET state = 'completed', result = ?, updated_at = ?
    WHERE principal = ? AND operation = ? AND key = ? AND state = 'in_progress'"""


def minimal_claim(conn: sqlite3.Connection, operation: str, key: str) -> None:
    """The least a claim can be: one INSERT (a duplicate key fails on the primary key)."""
    now = now_ms()
    conn.execute(
        _INSERT,
        (PRINCIPAL, operation, key, NULL_PAYLOAD_HASH, "in_progress", str(uuid.uuid4()), None,
         os.getpid(), 0, None, DAEMON_ID, now, now),
    )  # fmt: skip


def minimal_complete(conn: sqlite3.Connection, operation: str, key: str, result: object) -> None:
    """The least a complete can be: one UPDATE guarded by the state."""
    args = (msgspec.msgpack.encode(result), now_ms(), PRINCIPAL, operation, key)
    if conn.execute(_MINIMAL_COMPLETE, args).rowcount != 1:
        raise RuntimeError(f"key {key!r} is not in progress")


def completed_row(operation: str, key: str, result: object, pid: int) -> tuple[object, ...]:
    """The row a claim + complete of ``key`` leaves behind."""
    now = now_ms()
    return (
        PRINCIPAL,
        operation,
        key,
        NULL_PAYLOAD_HASH,
        "completed",
        str(uuid.uuid4()),
        msgspec.msgpack.encode(result),
        pid,
        0,
        None,
        DAEMON_ID,
        now,
        now,
    )


def insert_batch(conn: sqlite3.Connection, rows: list[tuple[object, ...]]) -> None:
    """The ceiling: one transaction, one ``executemany`` for the whole batch."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        conn.executemany(_INSERT, rows)
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise


def count_completed(path: Path) -> int:
    conn = sqlite3.connect(path)
    try:
        query = "SELECT count(*) FROM idempotency WHERE state = 'completed'"
        return conn.execute(query).fetchone()[0]
    finally:
        conn.close()
