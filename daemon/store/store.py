"""The state store's async face: where each store function runs, and when it answers.

Each store function is plain synchronous SQL on a ``Tx``; this module decides
where and how it runs, on four kinds of connection:

* the **writer**: writes queue up for a single writer task, which takes every
  pending write, runs the whole batch in one transaction, commits once
  (``synchronous=FULL``) and only then answers each caller. On SQLite the batch runs
  on the event loop itself (``_run_inline``: no thread hop, measured faster at any
  concurrency); the connection was opened, and the schema migrated, on its own
  aiosqlite thread. A write that fails after changing rows is undone alone (the
  batch runs again with savepoints); if SQLite abandons the whole transaction (disk
  full), every write of the batch fails and none is acknowledged;
* the **reader** (another aiosqlite thread): slower reads and listings, never
  waiting behind the writer;
* the **inline reader** on the event loop itself: point reads that cost less than a
  thread hop (``read_now``);
* short-lived **upkeep** connections in a worker thread, one at a time: WAL
  checkpoints, backups, health checks (``on_own_connection``).
"""

from __future__ import annotations

import asyncio
import errno
import functools
import os
import socket
import sqlite3
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar, cast

import aiosqlite
import anyio
import structlog

from towerd.daemon import stages
from towerd.daemon.clock import DaemonClock
from towerd.daemon.crashpoints import crash_point
from towerd.daemon.private_paths import StartRefused, check_private, ensure_private_dir
from towerd.daemon.store import clock as clock_record
from towerd.daemon.store import identity, schema, upkeep
from towerd.daemon.store.config import DEFAULT_BUSY_TIMEOUT_MS, StoreConfig
from towerd.daemon.store.reconcile import set_generation, start_daemon
from towerd.daemon.store.tx import (
    SQLITE_BUSY,
    SQLITE_FULL,
    Caller,
    Refused,
    Tx,
    now_ms,
    translate_pg_error,
    translate_sqlite_error,
    use_clock,
)
from towerd.protocol.errors import StaleEpoch, TowerdError, Unavailable
from towerd.protocol.methods import DoctorResult, ReconcileReport

T = TypeVar("T")

log = structlog.get_logger("towerd.store")

DB_FILE = "towerd.db"
BACKUP_DIR = upkeep.STATE_BACKUP_DIR  # migration backups; a user backup may go there too
BUSY_TIMEOUT_MS = DEFAULT_BUSY_TIMEOUT_MS  # what a connection waits for a lock (start-up, reads)
SHARED_READ_S = 0.001  # the loop's point reads share one read transaction this long at most


class _SubmittingThread(Protocol):
    """A writer whose batches run on its own thread (PostgreSQL's, ``inline_writes`` off)."""

    def submit(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]: ...


class _DbThread:
    """One SQLite connection living on one aiosqlite worker thread.

    aiosqlite has no public call for "run this function on your thread", and
    one hop per transaction instead of one per statement is what makes
    reads and start-up work cheap (a hop costs ~35-120 us, a small statement 1-2 us;
    bench/writes.py), so this wrapper is
    the single place that uses its ``_execute``; ``aiosqlite`` is pinned to
    a minor version in pyproject.toml for that reason. The writer's connection is
    opened here too (migrations run off the loop), then used on the loop
    (``connection``: hence ``check_same_thread=False``; never two at once).
    """

    def __init__(self, connection: aiosqlite.Connection) -> None:
        self._connection = connection

    @classmethod
    async def open(cls, db_path: Path) -> _DbThread:
        connection = await aiosqlite.connect(db_path, isolation_level=None, check_same_thread=False)
        return cls(connection)

    @property
    def connection(self) -> sqlite3.Connection:
        """The connection itself, for the loop's own use while this thread is idle."""
        return self._connection._conn

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        connection = self._connection
        return await connection._execute(lambda: fn(connection._conn, *args))

    async def close(self) -> None:
        await self._connection.close()


@dataclass(slots=True, eq=False)
class _Job:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    future: asyncio.Future[Any]
    result: Any = None
    error: BaseException | None = None
    stamps: list[int] | None = None  # daemon/stages.py, when tracing
    writer: int | None = None  # the client process that asked (Caller.pid), for Store._hold


class Store:
    """Where handlers send reads and writes. Obtain one with :func:`open_store`.

    This class runs the embedded SQLite store; daemon/store/pg_store.py's subclass runs
    the same store functions on PostgreSQL, replacing only what differs (the clock a
    batch reads, the connections, what a lost store is)."""

    DB_ERRORS: tuple[type[BaseException], ...] = (sqlite3.Error,)
    backend = "sqlite"
    inline_reads = True  # read_now runs on the event loop (a SQLite point read: microseconds)
    inline_writes = True  # write batches run on the event loop too (see _run_inline)
    one_box = True  # every holder runs on this machine (see tx.own_box)
    reachable = True  # the database answered its last transaction (a file always does)
    store_error: str | None = None
    clock_offset_ms = 0  # PostgreSQL: the server's clock minus the fleet's, when apart

    def __init__(
        self,
        config: StoreConfig,
        writer: _DbThread,
        reader: _DbThread,
        identity: Tx,
        reconciliation: ReconcileReport,
        db_path: Path,
    ) -> None:
        self.config = config
        # The loop that serves this store. Kept, not looked up per write: on Python 3.11
        # asyncio.get_running_loop() makes a getpid system call every time (strace: one
        # per request at 64 clients).
        self._loop = asyncio.get_running_loop()
        self.daemon_id = identity.daemon_id
        self.owner_epoch = identity.owner_epoch
        self.reconciliation = reconciliation
        self.db_path = db_path
        self.superseded = anyio.Event()
        self._writer = writer
        self._reader = reader
        self._queue: list[_Job] = []
        self._closing = False
        self._drain_scheduled = False  # _drain is due on the loop
        # The commit hold (see _hold): the client processes the last batch answered, and
        # the hold's end and timer while one is on.
        self._answered_writers: set[int] = set()
        self._hold_until: float | None = None
        self._answered_at = 0.0  # time.perf_counter() when the last batch was answered
        self._hold_timer: asyncio.TimerHandle | None = None
        self._locked: list[_Job] | None = None  # SQLite: a batch waits for the write lock
        self._drained = anyio.Event()  # closing, and nothing is left to write
        self._crashed: BaseException | None = None  # what the batch loop raised (a bug)
        self._superseded = False  # set on the database thread, published after the hop
        self._upkeep_limiter = anyio.CapacityLimiter(1)
        self._inline = self._open_inline()
        self._reading = False  # a read transaction is open on _inline (see read_now)
        if self.inline_writes:  # never wait for SQLite's write lock on the loop: see _run_inline
            writer.connection.execute("PRAGMA busy_timeout = 0")
        # Called on the loop with each committed batch's change notes (the watch hub).
        self.on_changes: Callable[[list[tuple[str, Any]]], None] | None = None
        self._changes: list[tuple[str, Any]] = []
        self._batch_in_flight = False
        self._batch_stamps = [0] * len(stages.STAMPS)  # the batch in flight's (when tracing)
        self._at_rest: list[Callable[[], None]] = []
        # The files as opened: a database deleted or replaced under the daemon is
        # noticed after each commit and by check_files(), and nothing more is answered.
        self._files = self._watch_files()
        self.lost = anyio.Event()
        self.lost_reason: str | None = None
        # This database's generation (daemon/store/identity.py); None: not tracked here
        # (PostgreSQL, or a test opening the store as another daemon).
        self.generation: str | None = None
        self._maybe: list[str] = []  # generations whose write had an unknown outcome
        self._rotating_to: str | None = None  # a generation being written (new_generation)
        self._rotating = anyio.Lock()
        self._generations_ended = False

    def _open_inline(self) -> Any:
        return _open_inline_reader(self.db_path)

    def _watch_files(self) -> DatabaseFiles:
        return DatabaseFiles(self.db_path)

    @property
    def location(self) -> str:
        """Where the store lives, as ``status`` shows it."""
        return str(self.db_path)

    # --- the API handlers use ------------------------------------------------------

    def write(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """Run ``fn(tx, *args)`` in the next committed batch.

        Returns a future resolved once that batch has committed (so a reply sent
        from it confirms a durable write); no task is needed to wait for it.
        """
        future: asyncio.Future[T] = self._loop.create_future()
        if self.lost_reason is not None:
            future.set_exception(self._lost_error())
            return future
        if self._closing or self.superseded.is_set():
            future.set_exception(
                Unavailable("towerd is shutting down; retry against the next daemon")
            )
            return future
        job = _Job(fn, args, future)
        if stages.TRACE is not None:
            job.stamps = stages.TRACE.new_stamps()
        if args and isinstance(args[0], Caller):
            job.writer = args[0].pid
        self._queue.append(job)
        if not self._drain_scheduled:
            self._drain_scheduled = True
            self._loop.call_soon(self._drain)
        return future

    def read_now(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(tx, *args)`` right here on the event loop's own read connection.

        For point lookups only (a primary-key read takes microseconds): a hop to
        the reader thread costs more than the read itself. The loop's reads share one
        read transaction (on SQLite): starting and ending one costs more than a point
        read inside it (~24 us against ~9 on this machine). It ends before any write
        batch runs (every commit on SQLite is one of this loop's batches, so a read
        sees every commit before it) and at most ``SHARED_READ_S`` after it began: a
        read transaction left open keeps a mark in the WAL, and while one is there
        SQLite can neither finish a checkpoint nor start the WAL over (left open
        across batches, it let the WAL grow by ~4 KiB per write under steady writes;
        tests/integration/test_wal_bounded.py). Sharing it for a millisecond rather
        than one loop step: cold point reads at 50 clients +20% (bench/README.md).
        """
        if self.lost_reason is not None:
            raise self._lost_error()
        conn = self._inline
        try:
            if not self._reading:
                conn.execute("BEGIN")
                self._reading = True
                if self.inline_reads:  # shared for a millisecond or until a write batch
                    self._loop.call_later(SHARED_READ_S, self._end_read)
            try:
                tx = Tx(conn, self.daemon_id, self.owner_epoch, self._read_clock(),
                        config=self.config, one_box=self.one_box)  # fmt: skip
                return fn(tx, *args)
            finally:
                if not self.inline_reads:
                    self._end_read()
        except self.DB_ERRORS as exc:
            self._end_read()
            raise _as_wire_error(exc) from exc

    def _end_read(self) -> None:
        """End the shared read transaction, if one is open."""
        if self._reading:
            self._reading = False
            try:
                self._inline.execute("COMMIT")
            except self.DB_ERRORS:  # the connection is gone; the next read says why
                log.warning("read_transaction_end_failed", code="internal", exc_info=True)

    def at_rest(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` on the loop at a point where no batch is in flight: now if
        none is, else right after the in-flight batch is published and answered, before
        the next one starts. A ``watch`` snapshot taken there holds every change
        published before it and none published after it."""
        if self._batch_in_flight:
            self._at_rest.append(callback)
        else:
            callback()

    async def read(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(tx, *args)`` on the read connection (sees committed data only)."""

        def run(conn: sqlite3.Connection) -> T:
            return fn(
                Tx(conn, self.daemon_id, self.owner_epoch, self._read_clock(), config=self.config,
                   one_box=self.one_box), *args,
            )  # fmt: skip

        if self.lost_reason is not None:
            raise self._lost_error()
        try:
            return await self._reader.run(run)
        except self.DB_ERRORS as exc:
            raise _as_wire_error(exc) from exc

    async def new_generation(self) -> None:
        """After a backup: a new generation, so that backup, put back over the database
        later, is known to be older than the store it was taken from. The record always
        accepts every generation the database may hold: ``generation`` for sure, and any
        whose write failed with its outcome unknown (``_maybe``). A failure is logged,
        not raised: the backup itself is good, only that check is lost for it."""
        async with self._rotating:  # one at a time: each starts from the last
            if self.generation is None or self._generations_ended:
                return
            state_dir, token = self.config.state_dir, os.urandom(16).hex()
            possible = [self.generation, *self._maybe]
            try:
                await anyio.to_thread.run_sync(
                    identity.write_generations, state_dir, identity.record_text([*possible, token])
                )
                self._rotating_to = token
                try:
                    await self.write(lambda tx: set_generation(tx.conn, token))
                except BaseException:
                    # Committed or not (a queued write runs even once its caller went
                    # away, cancelled): the record accepts both, and so must the store.
                    self._maybe.append(token)
                    raise
                finally:
                    self._rotating_to = None
            except Exception as exc:  # a full disk, stopping, a database error
                if not isinstance(exc, (OSError, TowerdError, *self.DB_ERRORS)):
                    raise
                log.error("generation_not_rotated", code="internal", error=str(exc),
                          state_dir=str(state_dir))  # fmt: skip
                return
            self.generation, self._maybe = token, []
            await _record_only(state_dir, identity.record_text([token]))

    async def end_generations(self) -> None:
        """Before the store closes: wait for a rotation under way, start no other (a
        daemon taking over must find the record as this one left it)."""
        with anyio.move_on_after(30, shield=True):
            async with self._rotating:
                self._generations_ended = True

    async def doctor(self, full: bool) -> DoctorResult:
        """`towerctl doctor`'s look at the database: the file, checked on its own connection."""
        return await self.on_own_connection(upkeep.health, full)

    async def on_own_connection(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(db_path, *args)`` (see ``upkeep``) in a worker thread, one at a time."""
        try:
            return await anyio.to_thread.run_sync(
                fn, self.db_path, *args, limiter=self._upkeep_limiter
            )
        except sqlite3.Error as exc:
            raise _as_wire_error(exc) from exc

    # --- the writer ------------------------------------------------------------------

    async def _write_batches(self) -> None:
        """The writer's task lives as long as the store and only waits for its close:
        batches run from ``_drain``, which ``write`` schedules. It returns once closing
        and every write queued before has been run and answered; a bug in the batch
        loop is raised here, stopping the daemon."""
        await self._drained.wait()
        if self._crashed is not None:
            raise self._crashed

    def _drain(self) -> None:
        """Run the queued writes, batch after batch; called soon after the first write
        of a loop step is queued (``call_soon``), so every write that step read joins the
        batch, and again when a batch is done.

        SQLite: each batch runs right here on the event loop, its COMMIT included.
        Measured (bench/writes.py --stages): a hop to a database thread and back costs two
        thread wake-ups (~100 us on this machine, more than the statements of a claim), and
        the two threads then fight over the GIL; on the loop, writes at 1, 8 and 64 clients
        all went faster, and a task woken by an event to run them cost another ~10-20 us
        per batch at 1 client. Batching is unchanged: whatever the loop read while a batch
        ran is the next batch. PostgreSQL: each batch goes to the writer's thread (the
        network is no place for the loop to wait), one at a time."""
        self._drain_scheduled = False
        while self._queue and self._locked is None and not self._batch_in_flight:
            if self.inline_writes and self._hold():
                return
            batch = self._queue[: self.config.max_batch]
            del self._queue[: self.config.max_batch]
            if not self.inline_writes:
                self._start_on_thread(batch)
                continue
            try:
                self._run_inline(batch, BUSY_FIRST_PAUSE_S, 0.0)
            except Exception as exc:  # a bug: its callers are answered, then the daemon stops
                self._crash(batch, exc)
                return
        idle = self._locked is None and not self._batch_in_flight
        if self._closing and not self._queue and idle:
            self._drained.set()

    def _hold(self) -> bool:
        """Whether to wait a little before the next batch (a commit delay, as PostgreSQL's
        ``commit_delay``): while a client process the last batch answered has not sent
        its next write, for at most ``config.commit_hold_us``, and only if the first
        write came right after that answer (writers in turn, not hooks firing now and
        then) and the last batch answered at most ``commit_hold_max_writers`` processes.

        Why: a batch runs on the loop, so the clients it answers send their next writes
        while the next batch runs; several clients writing in turn split into two groups
        whose batches alternate, each fsync shared by half of them. Measured at 8 client
        processes (bench/writes.py, bench/README.md round two): 4.6-4.9 writes a batch
        without the hold, 6.9-7.0 with it, and 8-40% more ops/s in a noisy hour. One
        client never waits (its next write is the one it was answered for), nor does a
        backlog (a full batch); many writers (64) gained nothing and are left alone.
        The hold ends as soon as the last of them writes; its timer is the fallback."""
        waiting_for = self._answered_writers
        hold_s = self.config.commit_hold_us / 1e6
        if (
            not waiting_for
            or len(waiting_for) > self.config.commit_hold_max_writers
            or len(self._queue) >= self.config.max_batch
            or self._closing
            or hold_s <= 0
            or waiting_for.issubset(job.writer for job in self._queue)
        ):
            return self._end_hold()
        now = time.perf_counter()  # loops' clocks and timers tick in milliseconds
        if self._hold_until is None:
            if now - self._answered_at > hold_s:
                return False  # not writers in turn: the answered ones took their time
            self._hold_until = now + hold_s
            self._arm_hold_timer()
            return True
        return now < self._hold_until or self._end_hold()

    def _arm_hold_timer(self) -> None:
        """The hold's fallback, should a writer not come back: loops run timers by the
        millisecond (uvloop runs one due in 300 us at once, asyncio after ~1 ms), so the
        timer looks again every millisecond until the hold is over."""
        self._hold_timer = self._loop.call_later(0.001, self._hold_over)

    def _hold_over(self) -> None:
        self._hold_timer = None
        if self._hold_until is not None and time.perf_counter() < self._hold_until:
            self._arm_hold_timer()
            return
        self._drain()

    def _end_hold(self) -> bool:
        if self._hold_timer is not None:
            self._hold_timer.cancel()
        self._hold_until = self._hold_timer = None
        return False

    def _run_inline(self, batch: list[_Job], pause: float, waited: float) -> None:
        """One batch on the loop. A write lock held elsewhere (a truncating checkpoint, a
        process outside towerd) is not waited for on the loop: the batch is tried again
        after ``pause`` (doubling), the loop serving meanwhile and later writes queued
        behind it, for up to the busy timeout; then its callers are refused."""
        self._end_read()  # reads after this batch must see it
        self._stamp_batch(stages.TAKEN)
        self._batch_in_flight = True
        try:
            outcome = self._run_batch(self._writer.connection, batch)
        finally:
            self._batch_in_flight = False
        if outcome is _BUSY:
            if waited < self.config.busy_timeout_ms / 1000:
                self._locked = batch
                retry = functools.partial(self._retry_locked, batch, pause, waited + pause)
                self._loop.call_later(pause, retry)
                return
            _fail_all(batch, _write_lock_held(waited))
        self._stamp_batch(stages.BACK)
        self._publish(batch)

    def _retry_locked(self, batch: list[_Job], pause: float, waited: float) -> None:
        self._locked = None
        self._run_inline(batch, min(pause * 2, BUSY_MAX_PAUSE_S), waited)
        self._drain()

    def _start_on_thread(self, batch: list[_Job]) -> None:
        """PostgreSQL: hand the batch to the writer's thread; answered from its future."""
        self._stamp_batch(stages.TAKEN)
        self._batch_in_flight = True
        writer = cast(_SubmittingThread, self._writer)  # only a thread-run writer gets here
        ran = writer.submit(self._run_batch, batch)
        ran.add_done_callback(functools.partial(self._thread_batch_done, batch))

    def _thread_batch_done(self, batch: list[_Job], ran: asyncio.Future[Any]) -> None:
        self._batch_in_flight = False
        error = None if ran.cancelled() else ran.exception()
        if isinstance(error, self.DB_ERRORS):  # no connection to run it on (PostgreSQL away)
            _fail_all(batch, self._uncommitted(error))
        elif error is not None:
            self._crash(batch, error)
            return
        self._stamp_batch(stages.BACK)
        self._publish(batch)
        self._drain()

    def _crash(self, batch: list[_Job], error: BaseException) -> None:
        """A bug in the batch loop: its callers are answered with it, and the writer's
        task raises it, which stops the daemon (nothing more is written)."""
        log.error("write_batch_crashed", code="internal", exc_info=error)
        self._batch_in_flight = False
        _fail_all(batch, error)
        self._publish(batch)
        self._crashed = error
        self._closing = True
        self._drained.set()

    def _stamp_batch(self, stamp: int) -> None:
        if stages.TRACE is not None:
            self._batch_stamps[stamp] = stages.now_ns()

    def _publish(self, batch: list[_Job]) -> None:
        """On the loop after a batch: change notes first, then every caller's answer."""
        self._answered_writers = {job.writer for job in batch if job.writer is not None}
        self._answered_at = time.perf_counter()
        changes, self._changes = self._changes, []
        if changes and self.on_changes is not None:
            self.on_changes(changes)  # watchers hear no later than the writers
        for job in batch:
            if job.future.done():
                continue  # its caller went away; the write stands
            if job.error is not None:
                job.future.set_exception(_as_wire_error(job.error))
            elif isinstance(job.result, Refused):
                job.future.set_exception(job.result.error)  # its writes committed
            else:
                job.future.set_result(job.result)
            if job.stamps is not None:
                self._stamp_resolved(job, len(batch))
        self._run_at_rest()
        if self._superseded:
            self.superseded.set()
        if self.lost_reason is not None:
            self.lost.set()

    def _stamp_resolved(self, job: _Job, batch_size: int) -> None:
        """Copy the batch's stamps into the job's; the server stamps its reply."""
        assert job.stamps is not None and stages.TRACE is not None
        for stamp in (stages.TAKEN, stages.ON_THREAD, stages.STATEMENTS, stages.COMMITTED,
                      stages.BACK):  # fmt: skip
            job.stamps[stamp] = self._batch_stamps[stamp]
        job.stamps[stages.RESOLVED] = stages.now_ns()
        job.stamps[stages.BATCH_SIZE] = batch_size
        stages.TRACE.answering[id(job.future)] = job.stamps

    def _run_at_rest(self) -> None:
        callbacks, self._at_rest = self._at_rest, []
        for callback in callbacks:
            try:
                callback()
            except Exception:  # noqa: BLE001 - one caller's bug must not stop the writer
                log.exception("at_rest_callback_failed", code="internal")

    def _run_batch(self, conn: sqlite3.Connection, jobs: list[_Job]) -> str:
        """One transaction, one commit, each job's failure its own; ``_BUSY`` (nothing
        done) when another connection holds SQLite's write lock at the first BEGIN.

        Jobs run without savepoints: a job that fails before it changed a row needs
        none, and that is how refusals fail (they read, then raise). Only a job that
        raises after changing rows needs its own writes undone; then the whole
        transaction is rolled back and the batch runs again with a savepoint per job.
        A savepoint per job costs ~20% of the batch's SQLite time (bench/writes.py,
        the two floors)."""
        self._stamp_batch(stages.ON_THREAD)
        try:
            try:
                if not self._begin(conn, jobs):
                    return _DONE
            except sqlite3.OperationalError as exc:
                if _is_busy(exc):
                    return _BUSY
                raise
            tx = Tx(conn, self.daemon_id, self.owner_epoch, self._batch_now(conn), changes=[],
                    config=self.config, one_box=self.one_box)  # fmt: skip
            outcome = self._run_jobs(conn, tx, jobs, savepoints=False)
            if outcome == _REDO:
                conn.execute("ROLLBACK")
                if not self._begin(conn, jobs):
                    return _DONE
                outcome = self._run_jobs(conn, tx, jobs, savepoints=True)
            if outcome == _ABANDONED:
                return _DONE
            self._before_commit(conn, tx)
            crash_point("batch.before_commit")
            self._stamp_batch(stages.STATEMENTS)
            conn.execute("COMMIT")
            self._stamp_batch(stages.COMMITTED)
            crash_point("batch.after_commit")
            lost = self._files.lost_after_commit()
            if lost is not None:
                # Committed into a file nobody will open again: not acknowledged.
                self.lost_reason = lost
                _fail_all(jobs, self._lost_error())
                return _DONE
            self._changes = tx.changes or []
        except self.DB_ERRORS as exc:
            if conn.in_transaction and not self._broken(conn):
                conn.execute("ROLLBACK")
            _fail_all(jobs, self._uncommitted(exc))
        return _DONE

    def _before_commit(self, conn: Any, tx: Tx) -> None:
        """The batch's last statements, in its transaction (none on SQLite)."""

    def _batch_now(self, conn: Any) -> int:
        """The clock reading of a batch (after BEGIN): towerd's own clock on SQLite."""
        return now_ms()

    def _read_clock(self) -> int:
        """The clock reading of a read: towerd's own clock on SQLite."""
        return now_ms()

    def _broken(self, conn: Any) -> bool:
        return False

    def _uncommitted(self, exc: BaseException) -> BaseException:
        """What a batch's callers are told when its transaction failed."""
        return exc

    def _begin(self, conn: sqlite3.Connection, jobs: list[_Job]) -> bool:
        """BEGIN IMMEDIATE, then check this daemon still owns the store (else fail all)
        and that the file is still the database it opened: a backup copied over it in
        place (same inode, so ``DatabaseFiles`` cannot see it) holds an older generation,
        and writing on would hand out again what its newer rows had settled."""
        conn.execute("BEGIN IMMEDIATE")
        current = conn.execute(
            "SELECT owner_epoch, (SELECT value FROM meta WHERE key = 'generation') "
            "FROM daemons WHERE daemon_id = ?",
            (self.daemon_id,),
        ).fetchone()
        if current is None or current[0] != self.owner_epoch:
            conn.execute("ROLLBACK")
            self._superseded = True
            _fail_all(jobs, self._stale_epoch_error(None if current is None else current[:1]))
            return False
        if (overwritten := self._overwritten(current[1])) is not None:
            conn.execute("ROLLBACK")
            self.lost_reason = overwritten
            _fail_all(jobs, self._lost_error())
            return False
        return True

    def _overwritten(self, stored: str | None) -> str | None:
        """Why the database holding generation ``stored`` is not the one this daemon
        runs (or None: it is, or generations are not tracked here)."""
        if self.generation is None:
            return None
        if stored in (self.generation, self._rotating_to) or stored in self._maybe:
            return None
        return (
            f"{self.db_path} now holds generation {stored}, not this daemon's "
            f"{self.generation}: an older copy (a backup?) was written over it"
        )

    def _run_jobs(
        self, conn: sqlite3.Connection, tx: Tx, jobs: list[_Job], *, savepoints: bool
    ) -> str:
        """Run every job in the open transaction: ``_DONE``; ``_REDO`` when the batch
        must run again with savepoints (a job failed after changing rows); ``_ABANDONED``
        when SQLite rolled the transaction back itself (every job then failed)."""
        assert tx.changes is not None
        tx.changes.clear()
        for job in jobs:
            job.result, job.error = None, None
            if savepoints:
                conn.execute("SAVEPOINT request")
            noted = len(tx.changes)
            changed_before = conn.total_changes
            try:
                job.result = job.fn(tx, *job.args)
            except BaseException as exc:  # noqa: BLE001 - delivered to the caller
                job.error = exc
                del tx.changes[noted:]  # rolled back: nothing to tell
                if not conn.in_transaction:
                    # SQLite rolled the whole transaction back (disk full, I/O error).
                    _fail_all(jobs, exc)
                    return _ABANDONED
                if savepoints:
                    conn.execute("ROLLBACK TO request")
                elif conn.total_changes != changed_before or getattr(conn, "failed", False):
                    # Its partial writes can only be undone with savepoints; so can an
                    # error PostgreSQL aborted the whole transaction for (``failed``).
                    return _REDO
            if savepoints:
                conn.execute("RELEASE request")
        return _DONE

    def _stale_epoch_error(self, current: tuple[int] | None) -> StaleEpoch:
        newer = "gone" if current is None else f"at epoch {current[0]}"
        return StaleEpoch(
            f"daemon {self.daemon_id} at epoch {self.owner_epoch} has been superseded "
            f"(its record is {newer}); this process stops serving writes and exits",
            {"daemon_id": self.daemon_id, "epoch": self.owner_epoch},
        )

    def check_files(self) -> bool:
        """Whether the database files are still the ones opened; if not, stop answering
        (``lost`` is set). Called periodically, so an idle daemon notices too."""
        if self.lost_reason is None:
            self.lost_reason = self._files.lost() or self._overwritten_idle()
        if self.lost_reason is not None:
            self.lost.set()
            return False
        return True

    def _overwritten_idle(self) -> str | None:
        """The generation check of ``_begin`` for an idle daemon (no batch runs), on the
        loop's read connection; a read it cannot make is the next batch's to report."""
        if self.generation is None or self._batch_in_flight or self._locked is not None:
            return None
        try:
            row = self._inline.execute("SELECT value FROM meta WHERE key = 'generation'")
            stored = row.fetchone()
        except self.DB_ERRORS:
            return None
        return self._overwritten(None if stored is None else stored[0])

    def _lost_error(self) -> Unavailable:
        return Unavailable(
            f"towerd's database was deleted or replaced while the daemon ran "
            f"({self.lost_reason}); nothing more is written or answered from it, and the "
            "daemon is stopping. Restore the database from a backup before starting towerd "
            "again (`towerctl doctor` says what it finds)",
            {"reason": "store_lost", "db_path": str(self.db_path)},
        )

    def _close_queue(self) -> None:
        self._closing = True
        self._drain()  # what is queued runs now (a batch in flight or waiting: after it)


_DONE, _REDO, _ABANDONED = "done", "redo", "abandoned"  # how a pass over a batch ended
_BUSY = "busy"  # another connection held the write lock: nothing was done
BUSY_FIRST_PAUSE_S = 0.002  # the inline writer's first pause when the write lock is held
BUSY_MAX_PAUSE_S = 0.05  # then doubling up to this, for config.busy_timeout_ms in all


def _is_busy(exc: sqlite3.OperationalError) -> bool:
    return getattr(exc, "sqlite_errorcode", 0) & 0xFF == SQLITE_BUSY


def _write_lock_held(waited: float) -> sqlite3.OperationalError:
    """What a batch's callers are told after the write lock stayed taken (as the
    thread's own busy timeout said before: ``database is locked``)."""
    return sqlite3.OperationalError(
        f"database is locked: another connection held the write lock for {waited:.1f} s"
    )


def _fail_all(jobs: list[_Job], cause: BaseException) -> None:
    for job in jobs:
        job.result = None
        job.error = cause


def _as_wire_error(exc: BaseException) -> BaseException:
    """SQLite errors become the wire error they mean; anything else passes as is."""
    if isinstance(exc, sqlite3.Error):
        translated = translate_sqlite_error(exc)
        if translated is not None:
            return translated
    elif hasattr(exc, "sqlstate"):  # psycopg's errors (the PostgreSQL backend)
        translated = translate_pg_error(exc)
        if translated is not None:
            return translated
    return exc


class DatabaseFiles:
    """The (device, inode) of the database and its WAL and shared-memory files as the
    daemon opened them. SQLite keeps writing to an unlinked file, so ``rm towerd.db*``
    under a running daemon would otherwise go unnoticed until the next start found no
    store at all.

    After each commit (:meth:`lost_after_commit`) the database and ``-shm`` files are
    checked by identity and the WAL only for being there: a ``stat`` of the WAL between
    two commits made the next commit ~80 us slower on this machine (p50 172 -> 255 us;
    an ``access`` cost nothing measurable: bench/README.md), as if the write after a
    query of its timestamps cost the fsync more. The periodic :meth:`lost` (every
    second, daemon/maintenance.py) checks all three by identity, so a WAL replaced on
    its own is noticed within a second."""

    SUFFIXES = ("", "-wal", "-shm")

    def __init__(self, db_path: Path) -> None:
        # Each file's path and its (device, inode) when opened (None: it was not there).
        paths = [str(db_path) + suffix for suffix in self.SUFFIXES]
        self.files = [(path, self._identity(path)) for path in paths]
        self._wal, self._wal_opened = self.files[self.SUFFIXES.index("-wal")]
        self._beside_wal = [file for file in self.files if file[0] != self._wal]

    @staticmethod
    def _identity(path: str) -> tuple[int, int] | None:
        try:
            info = os.stat(path)
        except FileNotFoundError:
            return None
        return (info.st_dev, info.st_ino)

    def lost(self) -> str | None:
        """What happened to a file since it was opened, or None if all are as opened."""
        return self._changed(self.files)

    def lost_after_commit(self) -> str | None:
        """:meth:`lost`, with the WAL checked for being there but not stat'ed (above)."""
        changed = self._changed(self._beside_wal)
        if changed is None and self._wal_opened is not None and not os.access(self._wal, os.F_OK):
            return f"{self._wal} was removed"
        return changed

    def _changed(self, files: Iterable[tuple[str, tuple[int, int] | None]]) -> str | None:
        for path, opened in files:
            if opened is None:
                continue
            now = self._identity(path)
            if now is None:
                return f"{path} was removed"
            if now != opened:
                return f"{path} was replaced by another file"
        return None


# --- opening ---------------------------------------------------------------------------


def _create_private_file(path: Path) -> None:
    """Create the DB file 0600 ourselves, so SQLite (and its -wal/-shm) inherit the mode."""
    try:
        fd = os.open(
            path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
    except FileExistsError:
        return
    os.close(fd)


def preflight(db_path: Path) -> tuple[int, str | None, str | None]:
    """The checks before anything is written, on a read-only connection: header (not
    ours, newer), integrity, shape. Returns the schema version, and the daemon id and
    generation (daemon/store/identity.py) stored in the file. A refused file stays byte
    for byte as it was, its WAL included: a read-write connection would checkpoint the
    WAL into it when closed."""
    conn = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, isolation_level=None)
    try:
        version = schema.check_header(conn, db_path)
        if version == 0:
            return 0, None, None
        schema.check_integrity(conn, db_path)
        schema.check_shape(conn, db_path, version)
        stored = dict(conn.execute(
            "SELECT key, value FROM meta WHERE key IN ('daemon_id', 'generation')"
        ).fetchall())  # fmt: skip
        return version, stored.get("daemon_id"), stored.get("generation")
    except sqlite3.Error as exc:
        raise StartRefused(f"{db_path}: cannot read the database to check it: {exc}") from None
    finally:
        conn.close()


async def _record_only(state_dir: Path, record: str) -> None:
    """The record's last step of a start's rotation: the database already has the new
    generation and the record accepts both, so a failure here (a full disk) is logged
    and the daemon serves; the old generation stays accepted until the next one."""
    try:
        await anyio.to_thread.run_sync(identity.write_generations, state_dir, record)
    except OSError as exc:
        log.warning("generation_record_kept_both", code="storage_full" if exc.errno ==
                    errno.ENOSPC else "internal", error=str(exc))  # fmt: skip


def _open_writer(
    conn: sqlite3.Connection,
    config: StoreConfig,
    db_path: Path,
    version: int,
    generation: str | None,
) -> tuple[Tx, ReconcileReport]:
    """Pragmas, migrations from ``version`` (checked by :func:`preflight`), the shape
    again, and the start-up transaction."""
    mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
    if mode != "wal":
        raise schema.StartRefused(f"{db_path}: cannot switch to WAL journaling (got {mode!r})")
    conn.execute("PRAGMA synchronous = FULL")
    conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
    schema.migrate(conn, version, db_path, config.state_dir / BACKUP_DIR)
    schema.check_shape(conn, db_path)
    previous_anchor, high_water = clock_record.load(conn)
    clock = DaemonClock.resume(previous_anchor, high_water)
    use_clock(clock)
    return start_daemon(
        conn,
        daemon_id=config.daemon_id,
        pid=os.getpid(),
        host=socket.gethostname(),
        now=clock.now_ms(),
        completed_ttl_ms=config.completed_ttl_ms,
        clock_anchor=clock.anchor,
        generation=generation,
    )


@contextmanager
def _full_disk_refused(state_dir: Path) -> Iterator[None]:
    """Start-up on a full disk is a refusal with a message, not a traceback (and not a
    restart loop: the exit code says restarting will not help until space is freed).
    A full disk shows up as SQLITE_FULL, ENOSPC, or as whatever SQLite could not create
    (its -shm file, say), so any failure while the disk is full counts as one."""
    try:
        yield
    except (sqlite3.Error, OSError, StartRefused) as exc:
        # (A read that fails for lack of space reads as a damaged file: StartRefused.)
        full = getattr(exc, "sqlite_errorcode", 0) & 0xFF == SQLITE_FULL or getattr(
            exc, "errno", None
        ) in (errno.ENOSPC, errno.EDQUOT)
        if not (full or disk_is_full(state_dir)):
            raise
        raise StartRefused(
            f"the disk holding the state dir {state_dir} is full ({exc}); nothing was "
            "changed. Free some space, then start towerd again"
        ) from None


DISK_FULL_BYTES = 64 * 1024  # free space below this is a full disk to SQLite


def disk_is_full(path: Path) -> bool:
    try:
        info = os.statvfs(path)
    except OSError:
        return False
    return info.f_bavail * info.f_frsize < DISK_FULL_BYTES or info.f_favail == 0


def _open_inline_reader(db_path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(db_path, isolation_level=None)
    _open_reader(conn)
    return conn


def _open_reader(conn: sqlite3.Connection) -> None:
    conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
    conn.execute("PRAGMA query_only = 1")


@asynccontextmanager
async def open_store(config: StoreConfig) -> AsyncIterator[Store]:
    """Open (creating or migrating) the store, start this daemon's epoch, reconcile.

    Raises ``StartRefused`` for a database that must not be touched, a state dir whose
    store was lost (daemon/store/identity.py), or a full disk. On exit, pending writes
    are committed and the connections closed. A PostgreSQL DSN in ``config.store``
    opens the same store on PostgreSQL (daemon/store/pg_store.py).
    """
    if config.store is not None:
        from towerd.daemon.store.pg_store import open_pg_store  # psycopg: only when used

        async with open_pg_store(config) as pg_store:
            yield pg_store
        return
    state_dir = ensure_private_dir(config.state_dir, "state dir")
    db_path = state_dir / DB_FILE
    check_private(db_path, "state database", want_dir=False)
    own_identity = config.daemon_id is None  # not a test opening the store as another daemon
    if own_identity:
        identity.refuse_lost_store(state_dir, db_path, state_dir / BACKUP_DIR, config.new_store)
    with _full_disk_refused(state_dir):
        _create_private_file(db_path)
        version, stored_id, generation = await anyio.to_thread.run_sync(preflight, db_path)
    if own_identity:
        identity.refuse_foreign_store(state_dir, stored_id, config.new_store)
        identity.refuse_rolled_back_store(state_dir, db_path, generation, config.new_store)
    # This start's generation (daemon/store/identity.py): recorded beside the database's
    # before the start-up transaction gives it to the database, alone after.
    token = os.urandom(16).hex() if own_identity else None
    writer = await _DbThread.open(db_path)
    try:
        with _full_disk_refused(state_dir):
            if token is not None:
                both, only_new = identity.rotation(token, generation)
                await anyio.to_thread.run_sync(identity.write_generations, state_dir, both)
                crash_point("generation.both_accepted")
            started, report = await writer.run(_open_writer, config, db_path, version, token)
            if own_identity:
                await anyio.to_thread.run_sync(identity.keep_record, state_dir, started.daemon_id)
        if token is not None:
            crash_point("generation.in_database")
            await _record_only(state_dir, only_new)
        reader = await _DbThread.open(db_path)
        try:
            await reader.run(_open_reader)
            store = Store(config, writer, reader, started, report, db_path)
            store.generation = token
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(store._write_batches)
                try:
                    yield store
                finally:
                    await store.end_generations()
                    store._close_queue()
                    store._inline.close()
        finally:
            await reader.close()
    finally:
        await writer.close()
