"""Shared helpers for the store tests: a real
Store on a real SQLite file in a temp dir."""

from __future__ import annotations

import dataclasses
import os
import sqlite3
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, closing
from pathlib import Path
from typing import Any

from towerd.daemon.processes import Holder, holder_of
from towerd.daemon.store import DB_FILE, Store, StoreConfig, fleet, open_store
from towerd.daemon.store.tx import Caller, Tx
from towerd.protocol.methods import (
    FleetListParams,
    SessionEntry,
    SessionRegisterParams,
    SessionRow,
)


def new_id() -> str:
    return str(uuid.uuid4())


def state_dir(root: Path) -> Path:
    return root / "state"


def db_path(root: Path) -> Path:
    return state_dir(root) / DB_FILE


@asynccontextmanager
async def opened(root: Path, **config: Any) -> AsyncIterator[Store]:
    """open_store on ``root/state``: each use is one daemon start."""
    async with open_store(StoreConfig(state_dir(root), **config)) as store:
        yield store


def query(root: Path, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Read the file directly with plain sqlite3
    (the store must be closed or committed)."""
    with closing(sqlite3.connect(db_path(root))) as conn:
        return conn.execute(sql, args).fetchall()


def execute(root: Path, sql: str, args: tuple[Any, ...] = ()) -> None:
    """Write the file directly with plain sqlite3, committed."""
    with closing(sqlite3.connect(db_path(root), isolation_level=None)) as conn:
        conn.execute(sql, args)


def register_params(**fields: Any) -> SessionRegisterParams:
    fields.setdefault("cwd", "/work")
    fields.setdefault("agent", "claude")
    return SessionRegisterParams(**fields)


async def register(store: Store, **fields: Any) -> str:
    """Insert one fleet row through the store; returns its session id."""
    return await store.write(fleet.insert_session, register_params(**fields))


async def register_old_row(store: Store, **fields: Any) -> str:
    """Insert one fleet row with the first schema's columns only, in SQL: what the code
    of an older schema version wrote (today's code selects columns it did not have)."""
    session_id = str(uuid.uuid4())
    fields = {"cwd": "/work", "agent": "claude", **fields}

    def insert(tx: Tx) -> None:
        names = ", ".join(fields)
        tx.conn.execute(
            f"INSERT INTO sessions (session_id, {names}, daemon_id, owner_epoch, updated_at) "
            f"VALUES (?, {', '.join('?' * len(fields))}, ?, ?, ?)",
            (session_id, *fields.values(), tx.daemon_id, tx.owner_epoch, tx.now),
        )

    await store.write(insert)
    return session_id


def entry(session_id: str, **fields: Any) -> SessionEntry:
    fields.setdefault("cwd", "/work")
    fields.setdefault("agent", "claude")
    return SessionEntry(session_id=session_id, **fields)


def _all_rows(tx: Tx) -> list[SessionRow]:
    rows: list[SessionRow] = []
    cursor = None
    while True:
        page = fleet.list_sessions(tx, caller(), FleetListParams(limit=5000, cursor=cursor))
        rows += page.sessions
        if page.next_cursor is None:
            return rows
        cursor = page.next_cursor


async def rows(store: Store) -> list[SessionRow]:
    """This daemon's fleet rows in stored order."""
    return await store.read(_all_rows)


async def parents(store: Store) -> dict[str, str | None]:
    """session id -> parent for this daemon's rows."""
    return {row.session_id: row.parent for row in await rows(store)}


def all_session_rows(root: Path) -> list[tuple[Any, ...]]:
    """Every row of the sessions table (any daemon), via plain sqlite3."""
    return query(
        root,
        "SELECT session_id, agent_session_id, parent, daemon_id, owner_epoch "
        "FROM sessions ORDER BY rowid",
    )


def caller(principal: str = "default", holder: Holder | None = None, pid: int = 0) -> Caller:
    """Who asks, as a store function sees it (``fn(tx, caller, params)``): the principal
    whose keys these are, the holder process of what it claims (None: held by nobody),
    and the pid audit events name."""
    return Caller(principal=principal, pid=pid or (holder.pid if holder else 0), holder=holder)


# --- the clock and the settings a store function sees, moved per call ----------------


def at(shift_ms: int, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run on a Tx whose clock reads ``shift_ms`` later than the writer's."""

    def run(tx: Tx, *args: Any) -> Any:
        return fn(dataclasses.replace(tx, now=tx.now + shift_ms), *args)

    return run


def clock(now: int, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run on a Tx whose clock reads exactly ``now``."""

    def run(tx: Tx, *args: Any) -> Any:
        return fn(dataclasses.replace(tx, now=now), *args)

    return run


def configured(fn: Callable[..., Any], **settings: Any) -> Callable[..., Any]:
    """``fn`` run on a Tx whose store settings (``tx.config``) have ``settings`` changed."""

    def run(tx: Tx, *args: Any) -> Any:
        return fn(dataclasses.replace(tx, config=dataclasses.replace(tx.config, **settings)), *args)

    return run


# --- holders ---------------------------------------------------------------------------

_me = holder_of(os.getpid())
_parent = holder_of(os.getppid())
assert _me is not None and _parent is not None
LIVE: Holder = _me  # this test process: alive
OTHER_LIVE: Holder = _parent  # another live process (pytest's parent)
DEAD = Holder(LIVE.pid, LIVE.start + 1)  # the same pid, another start time: not alive


# --- reading committed rows ------------------------------------------------------------


async def sql(store: Store, statement: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Committed rows, read on the store's read connection."""
    return await store.read(lambda tx: tx.conn.execute(statement, args).fetchall())


async def lease_rows(store: Store) -> list[tuple[Any, ...]]:
    """The lease rows as the lease tests compare them (the columns every schema had)."""
    return await sql(
        store,
        "SELECT resource, fencing_token, principal, holder_pid, holder_start, acquired_at, "
        "renewed_at, expires_at, daemon_id FROM leases ORDER BY resource",
    )


async def counters(store: Store) -> dict[str, int]:
    """The last token issued per resource."""
    return dict(await sql(store, "SELECT resource, last_token FROM lease_tokens"))
