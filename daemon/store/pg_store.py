"""The store on PostgreSQL: the same store functions and the same group-commit writer
as on SQLite, on a database several boxes' daemons share.

What differs from daemon/store/store.py, and only that, is here:

* connections: one writer and one reader, each a psycopg connection used from one
  worker thread at a time (the store functions are synchronous SQL, one hop per
  transaction, exactly as on SQLite; an async driver would need a second copy of every
  store function). A connection that broke is replaced at the next use;
* the clock: a batch's ``tx.now`` is the fleet's clock (daemon/store/fleet_clock.py),
  read under the writer lock from the server's ``clock_timestamp()``, the record of it
  in ``meta`` and this box's elapsed time; this box's own clock is anchored to it at
  start-up;
* identity: the daemon id lives in the state dir's record (daemon/store/identity.py),
  the shared database only knows it as a row of ``daemons``; a state dir whose daemon
  the database does not know (the database was replaced or reset) is refused unless
  ``--new-store``;
* nothing here is a file: no WAL checkpoints, file backups or file checks.
"""

from __future__ import annotations

import asyncio
import os
import queue
import socket
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import anyio
import anyio.abc
import psycopg
import structlog

from towerd.daemon.clock import Anchor, DaemonClock, boot_id, boottime_ms
from towerd.daemon.private_paths import StartRefused, ensure_private_dir
from towerd.daemon.store import (
    boxes,
    fleet_clock,
    identity,
    pg_changes,
    pg_schema,
    presence,
    upkeep,
)
from towerd.daemon.store.config import StoreConfig
from towerd.daemon.store.ids import random_uuid
from towerd.daemon.store.pg import PgConnection, connect, redacted
from towerd.daemon.store.reconcile import start_daemon
from towerd.daemon.store.store import Store, _fail_all
from towerd.daemon.store.tx import (
    STORE_UNREACHABLE,
    Tx,
    now_ms,
    translate_pg_error,
    use_clock,
)
from towerd.protocol import fields
from towerd.protocol.errors import STORE_UNREACHABLE as REASON_STORE_UNREACHABLE
from towerd.protocol.errors import Unavailable, store_unreachable
from towerd.protocol.methods import DoctorResult, ReconcileReport

T = TypeVar("T")

log = structlog.get_logger("towerd.store")


class _PgThread:
    """One PostgreSQL connection and the one thread of its own that uses it, calls taken
    in order from a queue; reconnected at the next use after it broke (the writer
    re-checks its epoch in every batch).

    A thread of its own, not anyio's worker threads behind a CapacityLimiter: a call's
    hop there and back is a queue put and ``call_soon_threadsafe``, ~100 us less per
    call than anyio's (measured on the write path, bench/pg_boxes.py). A call whose
    caller went away (cancelled: a read past its deadline) is skipped if it has not
    started; one that has runs to its end and its result is dropped.

    A call still in its thread :data:`STUCK_AFTER_S` after it started has its socket shut
    down from the loop: libpq's own timeouts (daemon/store/pg.py) end a call only when
    the network drops packets; a path that still acknowledges them but never answers (a
    hung server or middlebox, a frozen proxy) would hold the thread until it heals, and
    the writer with it: every later write waits behind it, and the daemon cannot stop.
    Every caller of such a call was answered ``unavailable`` at its deadline already."""

    def __init__(self, dsn: str, name: str) -> None:
        self._dsn = dsn
        self._conn: PgConnection | None = None
        self._calls = 0
        self._busy: tuple[int, PgConnection, float] | None = None  # in the thread since
        self._queue: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=f"towerd-pg-{name}",
                                        daemon=True)  # fmt: skip
        self._thread.start()

    @classmethod
    async def open(cls, dsn: str, name: str) -> _PgThread:
        thread = cls(dsn, name)
        try:
            await thread.run(lambda conn: None)
        except BaseException:
            await thread.close()
            raise
        return thread

    def _connection(self) -> PgConnection:
        if self._conn is None or self._conn.broken:
            if self._conn is not None:
                self._conn.close()
            self._conn = None
            self._conn = connect(self._dsn)  # psycopg.Error: the caller's to answer
        return self._conn

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(connection, *args)`` in the thread. The watchdog stays armed until the
        call has ended, whether or not its caller still waits for it."""
        return await self.submit(fn, *args)

    def submit(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """On the loop: queue ``fn(connection, *args)`` for the thread; the future is
        resolved on the loop once it ended (cancel it to skip it if not yet started)."""
        self._calls += 1
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        item = _Call(self._calls, fn, args, future, loop)
        item.watchdog = loop.call_later(STUCK_AFTER_S, self._unstick, item)
        self._queue.put(item)
        return future

    def _serve(self) -> None:
        """The thread: each call in turn, its outcome handed back to its loop."""
        while (item := self._queue.get()) is not None:
            if item.future.cancelled():
                item.hand_back(None, None)  # its caller went away before it started
                continue
            try:
                conn = self._connection()
                self._busy = (item.call, conn, time.monotonic())
                result = item.fn(conn, *item.args)
            except BaseException as exc:  # noqa: BLE001 - the caller's to handle
                item.hand_back(exc, None)
            else:
                item.hand_back(None, result)
            finally:
                self._busy = None
        last, self._conn = self._conn, None
        if last is not None:
            last.close()

    def _unstick(self, item: _Call) -> None:
        """On the loop: the call ``item`` has not ended; if it has been in the thread for
        :data:`STUCK_AFTER_S`, break its connection (the thread's wait on the socket ends
        at once with a connection error), else look again when it will have been."""
        if item.ended:
            return
        busy = self._busy
        ran = 0.0 if busy is None or busy[0] != item.call else time.monotonic() - busy[2]
        if ran < STUCK_AFTER_S:  # it waits its turn, or waited first: count from its start
            item.watchdog = item.loop.call_later(STUCK_AFTER_S - ran, self._unstick, item)
            return
        assert busy is not None
        log.warning("store_connection_stuck", code="unavailable",
                    seconds=STUCK_AFTER_S)  # fmt: skip
        busy[1].interrupt()

    async def close(self) -> None:
        """Close the connection in its thread once the calls queued before are done,
        and end the thread; a call stuck on a silent path is cut off by its watchdog
        meanwhile, so this returns within :data:`STUCK_AFTER_S` (or the thread is left
        behind after that and a bit: it dies with the process)."""
        self._queue.put(None)
        await anyio.to_thread.run_sync(self._thread.join, STUCK_AFTER_S + 2)


@dataclass(slots=True, eq=False)
class _Call:
    call: int
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    future: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop
    watchdog: asyncio.TimerHandle | None = None  # _PgThread._unstick, while not ended
    ended: bool = False  # set on the loop

    def hand_back(self, error: BaseException | None, result: Any) -> None:
        """In the thread, once the call ended: disarm its watchdog and resolve the
        caller's future on its loop (unless it went away, or the loop is closed)."""
        try:
            self.loop.call_soon_threadsafe(self.resolve, error, result)
        except RuntimeError:
            pass  # the loop is closed: nobody waits any more

    def resolve(self, error: BaseException | None, result: Any) -> None:
        self.ended = True
        if self.watchdog is not None:
            self.watchdog.cancel()
        if self.future.done():
            return  # cancelled: its caller went away
        if error is not None:
            self.future.set_exception(error)
        else:
            self.future.set_result(result)


CALL_DEADLINE_S = fields.STORE_DEADLINE_S
STUCK_AFTER_S = 2 * CALL_DEADLINE_S  # a call still on its connection then is cut off
INLINE_BOUND_S = 2  # a read on the event loop's own connection (read_now) is cut off then


def _unreachable(why: str) -> Unavailable:
    return Unavailable(STORE_UNREACHABLE.format(why=f" ({why})"),
                       {"reason": REASON_STORE_UNREACHABLE, "retry": "same_key"})  # fmt: skip


class _NoFiles:
    """A database on a server is not a file this daemon can watch."""

    def lost(self) -> str | None:
        return None

    def lost_after_commit(self) -> str | None:
        return None


class PgStore(Store):
    """The store on a PostgreSQL database shared by several boxes."""

    DB_ERRORS = (sqlite3.Error, psycopg.Error)
    backend = "postgresql"
    inline_reads = False  # a read crosses the network: never on the event loop
    inline_writes = False  # nor a write: batches run on the writer's thread
    one_box = False  # several boxes' holders: this daemon checks its own box's pids only

    def __init__(self, config: StoreConfig, writer: Any, reader: Any, identity: Tx,
                 reconciliation: ReconcileReport, dsn: str,
                 fleet: fleet_clock.FleetClock | None = None) -> None:  # fmt: skip
        self.dsn = dsn
        self.clock = fleet or fleet_clock.FleetClock()  # this box's reading of the fleet's clock
        self._start_now, self._started_at = identity.now, now_ms()  # reads before a batch
        self._clock_apart = False  # the server's clock is apart from the fleet's
        self.sightings = presence.Sightings()  # other boxes' presence, on our own clock
        self.reachable = True  # the last transaction reached the server
        self.store_error: str | None = None  # why not, when it did not
        super().__init__(config, writer, reader, identity, reconciliation, Path(os.devnull))

    def _open_inline(self) -> Any:
        return connect(self.dsn)

    def _watch_files(self) -> Any:
        return _NoFiles()

    @property
    def location(self) -> str:
        return redacted(self.dsn)

    def read_now(self, fn: Callable[..., T], *args: Any) -> T:
        """A read on the event loop's own connection, for what must be read in one loop
        step (a ``watch`` snapshot). Handlers use ``read`` (the network is no place for
        the loop to wait); with the server known unreachable this answers at once."""
        if not self.reachable:
            raise _unreachable(self.store_error or "the last transaction failed")
        if self._inline.broken:
            self._inline.close()
            try:
                self._inline = connect(self.dsn, connect_timeout=INLINE_BOUND_S)
            except psycopg.Error as exc:
                self._mark(exc)
                raise _unreachable(str(exc).strip().splitlines()[0]) from exc
        # The loop waits on the network here, and nothing on the loop can end that wait:
        # a timer thread shuts the socket down once the bound passes (a silent path that
        # still acknowledges packets would otherwise freeze the whole daemon, ping too,
        # until it heals).
        inline, cut = self._inline, threading.Event()

        def cut_off() -> None:
            cut.set()
            inline.interrupt()

        timer = threading.Timer(INLINE_BOUND_S, cut_off)
        timer.daemon = True
        timer.start()
        try:
            return super().read_now(fn, *args)
        except Unavailable as exc:
            if not cut.is_set():
                raise
            why = f"did not answer a read within {INLINE_BOUND_S:g} s"
            self.reachable, self.store_error = False, why
            raise _unreachable(why) from exc
        finally:
            timer.cancel()

    async def doctor(self, full: bool) -> DoctorResult:
        """The database as the server reports it (PostgreSQL checks its own pages; use
        amcheck for more). A server it cannot reach is ``unavailable`` (reason
        ``store_unreachable``), as for every other call: a report made up without it
        (schema version 0, the error as an integrity failure) had doctor advise
        restoring a backup and running another towerd for a network fault."""

        def look(tx: Tx) -> DoctorResult:
            row = tx.conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
            version = 0 if row is None else int(row[0])
            (size,) = tx.conn.execute("SELECT pg_database_size(current_database())").fetchone()
            return upkeep.ledger_health(
                tx.conn, now=tx.now, check="postgresql", integrity=["ok"],
                schema_version=version, supported_schema_version=pg_schema.SCHEMA_VERSION,
                db_path=self.location, db_bytes=size, wal_bytes=0,
            )  # fmt: skip

        return await self.read(look)

    def _before_commit(self, conn: Any, tx: Tx) -> None:
        if tx.changes:  # other boxes' watchers hear of it if and only if it commits
            pg_changes.notify(conn, self.daemon_id, tx.changes)

    def _mark(self, error: BaseException | None) -> None:
        """Whether the server answered: ``status``, ``ping`` and ``doctor`` say so."""
        if error is None:
            self.reachable, self.store_error = True, None
            return
        translated = translate_pg_error(error)
        if translated is not None and store_unreachable(translated):
            self.reachable, self.store_error = False, str(error).strip() or type(error).__name__

    def _uncommitted(self, exc: BaseException) -> BaseException:
        self._mark(exc)
        return exc

    # --- every call that needs the store answers within CALL_DEADLINE_S ----------------

    def write(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """As on SQLite; and a write not committed within the deadline is answered
        ``unavailable`` (it may still commit: the answer says so, and a retry with the
        same key is safe), so a caller never waits on an unreachable server for long."""
        future = super().write(fn, *args)
        if not future.done():
            handle = self._loop.call_later(CALL_DEADLINE_S, self._give_up, future)
            future.add_done_callback(lambda _done: handle.cancel())
        return future

    def _give_up(self, future: asyncio.Future[Any]) -> None:
        """A write's deadline: it did not commit in time, so the store counts as
        unreachable (status, ping, the outbox) until a transaction gets through again."""
        if not future.done():
            why = f"the write did not commit within {CALL_DEADLINE_S:g} s"
            self.reachable, self.store_error = False, why
            future.set_exception(_unreachable(why))

    async def read(self, fn: Callable[..., T], *args: Any) -> T:
        with anyio.move_on_after(CALL_DEADLINE_S):
            try:
                result = await super().read(fn, *args)
            except Unavailable as exc:
                if store_unreachable(exc):
                    self.reachable, self.store_error = False, str(exc)
                raise
            self._mark(None)
            return result
        self.reachable, self.store_error = False, "a read timed out"
        raise _unreachable(f"did not answer a read within {CALL_DEADLINE_S:g} s")

    async def on_own_connection(self, fn: Callable[..., T], *args: Any) -> T:
        raise Unavailable(
            "this daemon's store is on PostgreSQL: file backups, WAL checkpoints and file "
            "checks are SQLite's; use PostgreSQL's own tools (pg_dump, amcheck)",
            {"reason": "store_is_postgresql"},
        )

    def _batch_now(self, conn: Any) -> int:
        """The fleet's clock (daemon/store/fleet_clock.py), read under the writers' lock
        from the server's clock and the record, and recorded when the record is old."""
        self._mark(None)  # the writer lock was granted: the server answers
        server_ms, record = conn.server_ms, conn.clock_record
        now = self.clock.reading(server_ms, record)
        fleet_clock.record_if_due(conn, now, server_ms, record)
        self._note_offset(server_ms - now)
        return now

    def _note_offset(self, offset_ms: int) -> None:
        """Say when the server's clock is apart from the fleet's (it was stepped: the
        fleet's follows elapsed time, and comes back to the server's at 1%), and when
        they agree again."""
        apart = abs(offset_ms) > fleet_clock.APART_MS
        self.clock_offset_ms = offset_ms if apart else 0  # what status reports
        if apart and not self._clock_apart:
            log.warning(
                "server_clock_stepped", code="unavailable", offset_ms=offset_ms,
                why="the PostgreSQL server's clock moved apart from elapsed time; the "
                "fleet's clock goes on with elapsed time and comes back to it at 1%",
            )  # fmt: skip
        elif self._clock_apart and not apart:
            log.info("server_clock_agrees", offset_ms=offset_ms)
        self._clock_apart = apart

    def _read_clock(self) -> int:
        """A read's clock is the fleet's too (what is due or expired is decided on it,
        issue 16), without a round trip: this box's reading at its last batch moved on
        by elapsed time (the presence heartbeat makes a batch every few seconds)."""
        return self.clock.read(fallback=self._start_now + max(0, now_ms() - self._started_at))

    def _broken(self, conn: Any) -> bool:
        return bool(conn.broken)

    def _begin(self, conn: Any, jobs: list[Any]) -> bool:
        """As on SQLite (the writer lock, then this daemon's epoch: else every job fails
        ``stale_epoch``), in one round trip (``PgConnection.begin_batch``: the epoch is
        read by a statement that starts once the lock is granted); and: a box another box
        declared dead while it was cut off serves again under a new epoch, committed
        before the batch runs; what its holders held stays released."""
        epoch, dead_at = conn.begin_batch(self.daemon_id)
        if epoch != self.owner_epoch:
            conn.execute("ROLLBACK")
            self._superseded = True
            _fail_all(jobs, self._stale_epoch_error(None if epoch is None else (epoch,)))
            return False
        if dead_at is None:
            return True
        now = self._batch_now(conn)
        (epoch,) = conn.execute(
            """UPDATE daemons SET owner_epoch = owner_epoch + 1, dead_at = NULL,
                   presence_at = ? WHERE daemon_id = ? RETURNING owner_epoch""",
            (now, self.daemon_id),
        ).fetchone()
        conn.execute(
            "UPDATE sessions SET owner_epoch = ? WHERE daemon_id = ?", (epoch, self.daemon_id)
        )
        conn.execute("COMMIT")
        log.warning(
            "box_revived", code="stale_epoch", daemon_id=self.daemon_id,
            declared_dead_at=dead_at, old_epoch=self.owner_epoch, owner_epoch=epoch,
        )  # fmt: skip
        self.owner_epoch = epoch
        return self._begin(conn, jobs)


def _start(
    conn: PgConnection, config: StoreConfig, recorded: str | None, fleet: fleet_clock.FleetClock
) -> tuple[Tx, ReconcileReport, DaemonClock] | float:
    """On the writer's connection: migrate, check the shape, then the start-up
    transaction (the next epoch, reconciliation of this box's keys) on the server's clock."""
    pg_schema.migrate(conn.raw)
    pg_schema.check_shape(conn.raw)
    daemon_id = config.daemon_id or recorded
    if daemon_id is not None and config.daemon_id is None:
        known = conn.execute("SELECT 1 FROM daemons WHERE daemon_id = ?", (daemon_id,))
        if known.fetchone() is None and not config.new_store:
            raise StartRefused(
                f"the PostgreSQL store {redacted(config.store or '')} does not know this "
                f"state dir's daemon {daemon_id}: the database was replaced or reset, and "
                "starting would forget every key this box acknowledged. Point --store at "
                f"the right database, or {identity.NEW_STORE_HINT}"
            )
    daemon_id = daemon_id or random_uuid()
    if fleet.anchor is None:
        server_ms, record = conn.clock_sources()
        if record is not None and fleet_clock.needs_fresh_record(server_ms, record):
            within_ms = boxes.others_heartbeat_within_ms(
                conn, daemon_id, record.fleet_ms, config.presence_interval_ms,
                StoreConfig.presence_ttl_ms,
            )  # fmt: skip
        else:
            within_ms = 0
        if within_ms:
            # the caller waits for a running box's record, never past START_WAIT_MAX_S
            return min(2 * within_ms / 1000 + 1, fleet_clock.START_WAIT_MAX_S)
        fleet.begin(server_ms, record)
    now = fleet.last
    conn.fleet_clock = fleet
    clock = DaemonClock(Anchor(boot_id(), boottime_ms(), now))
    use_clock(clock)
    started, report = start_daemon(
        conn,  # type: ignore[arg-type]  # PgConnection speaks the sqlite3 subset used
        daemon_id=daemon_id,
        pid=os.getpid(),
        host=socket.gethostname(),
        now=now,
        completed_ttl_ms=config.completed_ttl_ms,
        clock_anchor=None,  # the server's clock needs no anchor in the shared store
        one_box=False,
    )
    # Present from its first answer, and no longer dead: a box declared dead that starts
    # again comes back under this start's epoch (what it held stays released).
    conn.execute("BEGIN IMMEDIATE")
    conn.execute(
        "UPDATE daemons SET presence_at = ?, dead_at = NULL WHERE daemon_id = ?",
        (conn.server_now, started.daemon_id),
    )
    boxes.record_presence(
        conn, started.daemon_id, config.presence_ttl_ms, config.presence_interval_ms
    )
    conn.execute("COMMIT")
    return started, report, clock


async def _wait_for_a_fresh_record(
    writer: _PgThread, fleet: fleet_clock.FleetClock, wait_s: float
) -> None:
    """Before a box serves: wait up to ``wait_s`` for a running box to record the fleet's
    clock again, and begin from that record (or, none recording, from the old one moved
    on as the server's clock moved: no box runs). Each look is a call of its own on the
    writer's thread: one long call is cut off as stuck (an 11 s wait was, and the box
    never started)."""
    server_ms, record = await writer.run(PgConnection.clock_sources)
    log.info("fleet_clock_waiting", seconds=round(wait_s, 1),
             why="the fleet's clock was last recorded a while ago: waiting for a running "
             "box's next record, so a step of the server's clock is not taken as time")  # fmt: skip
    with anyio.move_on_after(wait_s):
        while True:
            await anyio.sleep(fleet_clock.LOOK_EVERY_S)
            server_ms, newer = await writer.run(PgConnection.clock_sources)
            if newer != record:
                record = newer
                break
    fleet.begin(server_ms, record)


async def _keep_present(
    store: PgStore, *, task_status: anyio.abc.TaskStatus[anyio.CancelScope]
) -> None:
    """Heartbeat this box's presence every presence interval, and declare dead (and
    settle) the boxes whose presence lapsed (daemon/store/presence.py)."""
    with anyio.CancelScope() as scope:
        task_status.started(scope)
        while True:
            try:
                report = await store.write(presence.beat, store.sightings)
            except Exception as exc:  # noqa: BLE001 - the store may be unreachable: retry
                log.warning("presence_beat_failed", code=getattr(exc, "code", "internal"),
                            error=str(exc))  # fmt: skip
            else:
                for box in report.declared_dead:
                    settled = report.settled[box]
                    log.warning(
                        "box_declared_dead", code="unavailable", box=box,
                        keys_unknown=len(settled.keys_unknown),
                        leases_released=len(settled.leases_released),
                        effects_parked=len(settled.effects_parked),
                        workers_ended=len(settled.workers_ended),
                    )  # fmt: skip
            await anyio.sleep(store.config.presence_interval_ms / 1000)


@asynccontextmanager
async def open_pg_store(config: StoreConfig) -> AsyncIterator[PgStore]:
    """Connect, migrate, start this box's next epoch, reconcile; like ``open_store``."""
    assert config.store is not None
    state_dir = ensure_private_dir(config.state_dir, "state dir")
    own_identity = config.daemon_id is None
    recorded = identity.read_record(state_dir) if own_identity else None
    try:
        writer = await _PgThread.open(config.store, "writer")
    except psycopg.Error as exc:
        raise StartRefused(
            f"cannot reach the PostgreSQL store {redacted(config.store)}: {exc}"
        ) from None
    try:
        fleet = fleet_clock.FleetClock()  # this box's reading, from its start on
        begun = await writer.run(_start, config, recorded, fleet)
        if isinstance(begun, float):  # other boxes may run: wait for one's next record
            await _wait_for_a_fresh_record(writer, fleet, begun)
            begun = await writer.run(_start, config, recorded, fleet)
        assert not isinstance(begun, float)
        started, report, _clock = begun
        if own_identity:
            await anyio.to_thread.run_sync(identity.keep_record, state_dir, started.daemon_id)
        log.info("store_opened", backend="postgresql", store=redacted(config.store),
                 daemon_id=started.daemon_id, owner_epoch=started.owner_epoch)  # fmt: skip
        reader = await _PgThread.open(config.store, "reader")
        try:
            store = PgStore(config, writer, reader, started, report, config.store, fleet)
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(store._write_batches)
                presence_scope = await tasks.start(_keep_present, store)
                try:
                    yield store
                finally:
                    presence_scope.cancel()
                    store._close_queue()
                    store._inline.close()
        finally:
            await reader.close()
    finally:
        await writer.close()
