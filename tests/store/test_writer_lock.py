"""A batch's checks are read once it holds the writer lock, never from before its wait.

On PostgreSQL a batch's first message to the server is BEGIN, the writer lock, then the
server's clock and this daemon's epoch (daemon/store/pg.py, ``begin_batch``), sent
together: the checks must still see every commit made while the batch waited for the
lock (another box that bumped this box's epoch, or declared it dead), and the batch's
clock must not be read before that wait either. On SQLite the lock is the file's write
lock (BEGIN IMMEDIATE), taken here by another connection to the same file.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

from store_helpers import backend, db_path, opened, register, register_params, store_dsn
from towerd.daemon.store import Store, fleet
from towerd.daemon.store.tx import Tx
from towerd.protocol.errors import Internal, StaleEpoch

pytestmark = pytest.mark.anyio

WAIT_S = 10.0  # deadline for the batch to be seen waiting for the lock


@contextmanager
def writer_lock_held(root: Path) -> Iterator[Any]:
    """Another box's writer (another connection) holds the writer lock in an open
    transaction; yields that connection (``execute(sql, args)``), committed on exit."""
    dsn = store_dsn(root)
    if dsn is None:
        conn = sqlite3.connect(db_path(root), isolation_level=None)
        try:
            conn.execute("BEGIN IMMEDIATE")
            yield conn
            conn.execute("COMMIT")
        finally:
            conn.close()
        return
    import psycopg

    from towerd.daemon.store.pg import WRITE_LOCK

    with psycopg.connect(dsn, autocommit=True) as pg:
        pg.execute("BEGIN")
        pg.execute("SELECT pg_advisory_xact_lock(%s)", (WRITE_LOCK,))
        yield _Pg(pg)
        pg.execute("COMMIT")


class _Pg:
    def __init__(self, conn: Any) -> None:
        self.conn = conn

    def execute(self, sql: str, args: tuple[Any, ...] = ()) -> Any:
        return self.conn.execute(sql.replace("?", "%s"), args)


async def waiting_for_the_lock(root: Path, store: Store) -> None:
    """Return once a batch of ``store`` waits for the writer lock: on PostgreSQL, once
    the server shows an advisory lock requested and not granted; on SQLite (where the
    wait cannot be seen from outside), once the writer found the lock held and holds
    the batch for its next try (it waits off the loop, daemon/store/store.py _drain)."""
    dsn = store_dsn(root)
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if dsn is None:
            if store._locked is not None:
                return
        else:
            import psycopg

            with psycopg.connect(dsn, autocommit=True) as pg:
                (waiting,) = pg.execute(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
                ).fetchone()  # type: ignore[misc]
            if waiting:
                return
        await anyio.sleep(0.01)
    raise AssertionError(f"no batch waited for the writer lock within {WAIT_S:g} s")


async def test_an_epoch_bumped_while_a_batch_waits_for_the_lock_refuses_that_batch(
    short_tmp: Path,
) -> None:
    """Another box bumps this daemon's epoch and commits while our batch waits for the
    writer lock: the batch's epoch check sees it (stale_epoch), and nothing is written."""
    async with opened(short_tmp) as store:
        await register(store)
        with writer_lock_held(short_tmp) as other:
            pending = store.write(fleet.insert_session, register_params(name="waiting"))
            await waiting_for_the_lock(short_tmp, store)
            other.execute(
                "UPDATE daemons SET owner_epoch = owner_epoch + 1 WHERE daemon_id = ?",
                (store.daemon_id,),
            )
        with pytest.raises(StaleEpoch):
            await pending
        assert store.superseded.is_set()
        names = await store.read(lambda tx: tx.conn.execute("SELECT name FROM sessions").fetchall())
        assert ("waiting",) not in names


async def test_a_box_declared_dead_while_its_batch_waits_comes_back_before_the_batch(
    short_tmp: Path,
) -> None:
    """PostgreSQL: another box declares this one dead (``dead_at``) and commits while our
    batch waits for the writer lock: the batch sees it, and the box serves again under
    a new epoch before the batch runs (``box_revived``); the batch then commits."""
    if backend() != "postgresql":
        pytest.skip("dead_at is the shared store's: no other box declares an embedded one dead")
    async with opened(short_tmp) as store:
        await register(store)
        epoch = store.owner_epoch
        with writer_lock_held(short_tmp) as other:
            pending = store.write(fleet.insert_session, register_params(name="waiting"))
            await waiting_for_the_lock(short_tmp, store)
            other.execute("UPDATE daemons SET dead_at = 1 WHERE daemon_id = ?", (store.daemon_id,))
        await pending
        assert store.owner_epoch == epoch + 1
        dead_at = await store.read(
            lambda tx: tx.conn.execute(
                "SELECT dead_at FROM daemons WHERE daemon_id = ?", (tx.daemon_id,)
            ).fetchone()
        )
        assert dead_at == (None,)


async def test_a_batch_that_waited_for_the_lock_reads_the_clock_after_its_wait(
    short_tmp: Path,
) -> None:
    """PostgreSQL: the batch's ``tx.now`` (the server's clock) is read once the lock is
    granted: not before the commit of the lock's previous holder, whose clock it passes."""
    if backend() != "postgresql":
        pytest.skip("the embedded store's clock is towerd's own, not a server's")

    def now_of(tx: Tx) -> int:
        return tx.now

    async with opened(short_tmp) as store:
        await store.write(now_of)
        with writer_lock_held(short_tmp) as other:
            pending = store.write(now_of)
            await waiting_for_the_lock(short_tmp, store)
            await anyio.sleep(0.05)  # the clock moves on while the batch waits
            (held_until,) = other.execute(  # floored in ms, as the store reads it
                "SELECT floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint"
            ).fetchone()
        assert await pending >= held_until


async def test_a_batch_reads_the_fleet_clock_never_below_another_box_s_recorded_reading(
    short_tmp: Path,
) -> None:
    """PostgreSQL: a batch's clock is the fleet's (daemon/store/fleet_clock.py): recorded
    in meta with the server's reading, and never read below the record; another box's
    reading above this box's (it ran ahead) is the floor this box goes on from."""
    if backend() != "postgresql":
        pytest.skip("the embedded store's clock is towerd's own, not a server's")
    import psycopg

    from towerd.daemon.store.fleet_clock import KEY, RECORD_EVERY_MS, Record

    def now_of(tx: Tx) -> int:
        return tx.now

    async with opened(short_tmp) as store:
        first = await store.write(now_of)
        with psycopg.connect(store_dsn(short_tmp), autocommit=True) as other:
            (value,) = other.execute("SELECT value FROM meta WHERE key = %s", (KEY,)).fetchone()
            recorded = Record.parse(value)
            assert recorded is not None
            assert first - RECORD_EVERY_MS <= recorded.fleet_ms <= first
            ahead = first + 3_600_000  # another box's reading, an hour ahead of this one's
            other.execute(
                "UPDATE meta SET value = %s WHERE key = %s",
                (f"{ahead} {recorded.server_ms}", KEY),
            )
        assert ahead <= await store.write(now_of) < ahead + 1000  # from there, on
        assert ahead <= await store.write(now_of) < ahead + 1000


async def test_a_fleet_clock_record_edited_into_nonsense_is_read_as_none(short_tmp: Path) -> None:
    """PostgreSQL: a fleet clock record that is not one (edited by hand) failed every
    write with an untyped cast error, heartbeats included, while doctor said all was
    well (a hostile tester's finding); it now counts as none and is written over."""
    if backend() != "postgresql":
        pytest.skip("the embedded store's clock is towerd's own, not a server's")
    import psycopg

    from towerd.daemon.store.fleet_clock import KEY, Record

    def now_of(tx: Tx) -> int:
        return tx.now

    async with opened(short_tmp) as store:
        first = await store.write(now_of)
        with psycopg.connect(store_dsn(short_tmp), autocommit=True) as other:
            other.execute("UPDATE meta SET value = 'oops' WHERE key = %s", (KEY,))
            assert await store.write(now_of) >= first
            (value,) = other.execute("SELECT value FROM meta WHERE key = %s", (KEY,)).fetchone()
        recorded = Record.parse(value)
        assert recorded is not None and recorded.fleet_ms >= first


@pytest.mark.sqlite_only
async def test_a_write_lock_held_past_the_busy_timeout_refuses_the_batch_and_keeps_serving(
    short_tmp: Path,
) -> None:
    """Another process keeps SQLite's write lock past ``busy_timeout_ms`` (an operator's
    ``sqlite3`` left in a transaction): the waiting write is answered ``internal`` with
    a message naming the lock, writes nothing, and the store writes again once the lock
    is let go (docs/protocol.md section 5: a database locked by another process)."""
    async with opened(short_tmp, busy_timeout_ms=200) as store:
        await register(store)
        with writer_lock_held(short_tmp):
            pending = store.write(fleet.insert_session, register_params(name="locked out"))
            with pytest.raises(Internal) as refused:
                await pending
        assert refused.value.code == "internal"
        assert "locked by another process" in refused.value.message
        assert "held the write lock" in refused.value.message
        after = await store.write(fleet.insert_session, register_params(name="after"))
        assert after is not None
        names = await store.read(lambda tx: tx.conn.execute("SELECT name FROM sessions").fetchall())
        assert ("locked out",) not in names
        assert ("after",) in names
