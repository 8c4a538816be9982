"""Shared helpers for the store tests: a real Store in a temp dir, on the backend the
test runs on (tests/store/conftest.py): a real SQLite file in the state dir, or a real
PostgreSQL database of the session's private cluster (tests/pg_cluster.py)."""

from __future__ import annotations

import dataclasses
import os
import sqlite3
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

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


# --- the backend: which store ``opened``, ``query`` and ``execute`` reach -------------


@dataclass
class Backend:
    """The store backend of the running test, set by tests/store/conftest.py."""

    name: str = "sqlite"  # or "postgresql"
    new_database: Callable[[], str] | None = None  # postgresql: a fresh database's DSN
    drop_database: Callable[[str], None] | None = None  # postgresql: drop one of those
    dsns: dict[Path, str] = field(default_factory=dict)  # state dir -> its database


_backend = Backend()


def use_backend(backend: Backend) -> None:
    global _backend
    _backend = backend


def backend() -> str:
    """``"sqlite"`` or ``"postgresql"``: what the store of this test runs on."""
    return _backend.name


def store_dsn(root: Path) -> str | None:
    """The PostgreSQL DSN of ``root``'s store, None on SQLite. One database per state
    dir, created at its first use: every open of the same state dir in a test (a
    restart of that daemon) reaches the same database, another state dir another one,
    as each state dir has its own SQLite file."""
    if _backend.new_database is None:
        return None
    directory = Path(os.path.abspath(state_dir(root)))
    if directory not in _backend.dsns:
        _backend.dsns[directory] = _backend.new_database()
    return _backend.dsns[directory]


def forget_store(root: Path) -> None:
    """PostgreSQL: drop ``root``'s database now (its stores closed), not at the end of
    the test (a test that goes through many state dirs); nothing on SQLite."""
    directory = Path(os.path.abspath(state_dir(root)))
    dsn = _backend.dsns.pop(directory, None)
    if dsn is not None and _backend.drop_database is not None:
        _backend.drop_database(dsn)


def store_config(root: Path, **config: Any) -> StoreConfig:
    """The StoreConfig of a daemon on ``root/state``, on this test's backend."""
    dsn = store_dsn(root)
    if dsn is not None:
        config.setdefault("store", dsn)
    return StoreConfig(state_dir(root), **config)


@asynccontextmanager
async def opened(root: Path, **config: Any) -> AsyncIterator[Store]:
    """open_store on ``root/state``: each use is one daemon start."""
    async with open_store(store_config(root, **config)) as store:
        yield store


def pg_sql(statement: str) -> str:
    """A statement written for sqlite3, for psycopg: ``?`` placeholders become ``%s``
    and a literal ``%`` is doubled. Simple on purpose: no ``?`` inside a literal."""
    return statement.replace("%", "%%").replace("?", "%s")


def query(root: Path, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Read the store directly: the file with plain sqlite3, or the database with
    psycopg (the store must be closed or committed)."""
    dsn = store_dsn(root)
    if dsn is not None:
        import psycopg

        with psycopg.connect(dsn, autocommit=True) as pg:
            return pg.execute(pg_sql(sql), args).fetchall()
    with closing(sqlite3.connect(db_path(root))) as conn:
        return conn.execute(sql, args).fetchall()


def execute(root: Path, sql: str, args: tuple[Any, ...] = ()) -> None:
    """Write the store directly (plain sqlite3 or psycopg), committed."""
    dsn = store_dsn(root)
    if dsn is not None:
        import psycopg

        with psycopg.connect(dsn, autocommit=True) as pg:
            pg.execute(pg_sql(sql), args)
        return
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
        page = fleet.list_sessions(
            tx,
            caller(),
            FleetListParams(
                limit=5000, cursor=cursor, daemon_id=None if tx.one_box else tx.daemon_id
            ),
        )
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
    """Every row of the sessions table (any daemon), read directly (``query``)."""
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
        return fn(msgspec.structs.replace(tx, now=tx.now + shift_ms), *args)

    return run


def clock(now: int, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run on a Tx whose clock reads exactly ``now``."""

    def run(tx: Tx, *args: Any) -> Any:
        return fn(msgspec.structs.replace(tx, now=now), *args)

    return run


def configured(fn: Callable[..., Any], **settings: Any) -> Callable[..., Any]:
    """``fn`` run on a Tx whose store settings (``tx.config``) have ``settings`` changed."""

    def run(tx: Tx, *args: Any) -> Any:
        config = dataclasses.replace(tx.config, **settings)
        return fn(msgspec.structs.replace(tx, config=config), *args)

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
