"""Group commit: concurrent writes share transactions,
yet each one fails or succeeds alone.

Store functions that serve a request are called as their routes call them (daemon/
handlers.py), ``fn(tx, caller, params)``; the writer itself runs any ``fn(tx, *args)``.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
from anyio import wait_all_tasks_blocked

from store_helpers import (
    caller,
    db_path,
    new_id,
    opened,
    query,
    register,
    register_params,
    rows,
    store_dsn,
)
from towerd.daemon.store import Store, fleet, idempotency
from towerd.daemon.store.tx import Tx
from towerd.protocol.errors import Conflict, Internal, Unavailable
from towerd.protocol.methods import IdemClaimParams

pytestmark = pytest.mark.anyio


def noting_batch(seen: list[Tx], fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a store function so the test can see which transaction (Tx) it ran in."""

    def run(tx: Tx, *args: Any) -> Any:
        seen.append(tx)
        return fn(tx, *args)

    return run


async def submit(store: Store, fn: Any, *args: Any) -> Any:
    """Store.write returns a future; task groups want a coroutine function."""
    return await store.write(fn, *args)


class WriterGate:
    """Keeps the writer from committing until released, so the next writes queue up
    together: another connection holds the store's write lock (SQLite's, taken with
    BEGIN IMMEDIATE; on PostgreSQL the advisory lock every writer takes), and a first
    write is submitted. Once every task is blocked, the writer has taken that write and
    waits for the lock (SQLite: pausing on the loop; PostgreSQL: on its thread); what is
    submitted next queues for the batch after it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.holder: Any = None

    async def close_on(self, store: Store, tasks: anyio.abc.TaskGroup) -> None:
        await store.write(lambda tx: None)  # what the store queued itself is done (presence)
        dsn = store_dsn(self.root)
        if dsn is None:
            self.holder = sqlite3.connect(db_path(self.root), isolation_level=None)
            self.holder.execute("BEGIN IMMEDIATE")
        else:
            import psycopg

            from towerd.daemon.store.pg import WRITE_LOCK

            self.holder = psycopg.connect(dsn, autocommit=True)
            self.holder.execute("SELECT pg_advisory_lock(%s)", (WRITE_LOCK,))
        tasks.start_soon(submit, store, lambda tx: None)
        await wait_all_tasks_blocked()

    def open(self) -> None:
        if isinstance(self.holder, sqlite3.Connection):
            self.holder.execute("ROLLBACK")
        else:
            from towerd.daemon.store.pg import WRITE_LOCK

            self.holder.execute("SELECT pg_advisory_unlock(%s)", (WRITE_LOCK,))
        self.holder.close()


async def test_two_hundred_concurrent_writes_all_commit(short_tmp: Path) -> None:
    """200 concurrent registers in one task group
    all succeed; every row exists afterwards."""
    ids = [new_id() for _ in range(200)]
    answers: dict[str, str] = {}
    async with opened(short_tmp) as store:

        async def one(session_id: str) -> None:
            answers[session_id] = await register(store, session_id=session_id)

        async with anyio.create_task_group() as tasks:
            for session_id in ids:
                tasks.start_soon(one, session_id)
        assert answers == {sid: sid for sid in ids}
        assert {r.session_id for r in await rows(store)} == set(ids)
    # Durable: a plain sqlite3 reader of the closed file sees every row.
    assert {sid for (sid,) in query(short_tmp, "SELECT session_id FROM sessions")} == set(ids)


async def test_queued_writes_commit_as_one_batch(short_tmp: Path) -> None:
    """Writes that queue while the writer is busy
    run together in the next single transaction."""
    seen: list[Tx] = []
    gate = WriterGate(short_tmp)
    async with opened(short_tmp) as store:
        async with anyio.create_task_group() as tasks:
            await gate.close_on(store, tasks)
            for _ in range(100):
                tasks.start_soon(
                    submit,
                    store,
                    noting_batch(seen, fleet.insert_session),
                    register_params(),
                )
            await wait_all_tasks_blocked()
            gate.open()
        assert len(seen) == 100
        assert len({id(tx) for tx in seen}) == 1  # one Tx object = one transaction
        assert len(await rows(store)) == 100


async def test_batches_respect_max_batch(short_tmp: Path) -> None:
    """With max_batch=10, 25 queued writes run as
    transactions of 10, 10 and 5, in order."""
    seen: list[tuple[Tx, int]] = []

    def note(tx: Tx, n: int) -> int:
        seen.append((tx, n))
        return n

    gate = WriterGate(short_tmp)
    async with opened(short_tmp, max_batch=10) as store:
        async with anyio.create_task_group() as tasks:
            await gate.close_on(store, tasks)
            for n in range(25):
                tasks.start_soon(submit, store, note, n)
            await wait_all_tasks_blocked()
            gate.open()
    assert [n for _, n in seen] == list(range(25))
    sizes: list[int] = []
    for index, (tx, _) in enumerate(seen):
        if index == 0 or tx is not seen[index - 1][0]:
            sizes.append(0)
        sizes[-1] += 1
    assert sizes == [10, 10, 5]


async def test_failing_write_fails_alone_while_batch_mates_commit(
    short_tmp: Path,
) -> None:
    """In one batch, a register with a duplicate session id raises Conflict to its
    caller only; the writes before and after it in the same transaction commit."""
    taken = new_id()
    before_ids = [new_id() for _ in range(5)]
    after_ids = [new_id() for _ in range(5)]
    outcomes: dict[str, Any] = {}
    seen: list[Tx] = []

    async with opened(short_tmp) as store:
        await register(store, session_id=taken, name="original")

        async def attempt(label: str, session_id: str, name: str) -> None:
            try:
                outcomes[label] = await store.write(
                    noting_batch(seen, fleet.insert_session),
                    register_params(session_id=session_id, name=name),
                )
            except Conflict as exc:
                outcomes[label] = exc

        gate = WriterGate(short_tmp)
        async with anyio.create_task_group() as tasks:
            await gate.close_on(store, tasks)
            for n, sid in enumerate(before_ids):
                tasks.start_soon(attempt, f"before{n}", sid, "mate")
            tasks.start_soon(attempt, "dup", taken, "duplicate")
            for n, sid in enumerate(after_ids):
                tasks.start_soon(attempt, f"after{n}", sid, "mate")
            await wait_all_tasks_blocked()
            gate.open()

        assert len({id(tx) for tx in seen}) == 1, "the writes did not share one transaction"
        assert isinstance(outcomes["dup"], Conflict)
        assert {k: v for k, v in outcomes.items() if k != "dup"} == {
            **{f"before{n}": sid for n, sid in enumerate(before_ids)},
            **{f"after{n}": sid for n, sid in enumerate(after_ids)},
        }
        stored = {r.session_id: r.name for r in await rows(store)}
        assert stored == {
            taken: "original",
            **dict.fromkeys(before_ids + after_ids, "mate"),
        }


async def test_plain_exception_fails_only_its_job_and_its_partial_writes_roll_back(
    short_tmp: Path,
) -> None:
    """A write function that inserts a row and then raises ValueError: its caller
    gets that very ValueError, its row is rolled back, and its batch-mates commit."""
    seen: list[Tx] = []
    half_done = new_id()

    class Boom(ValueError):
        pass

    def insert_then_fail(tx: Tx) -> None:
        fleet.insert_session(tx, register_params(session_id=half_done))
        raise Boom("bug in a handler")

    outcomes: dict[str, Any] = {}
    mates = [new_id() for _ in range(4)]
    async with opened(short_tmp) as store:

        async def attempt(label: str, fn: Callable[..., Any], *args: Any) -> None:
            try:
                outcomes[label] = await store.write(noting_batch(seen, fn), *args)
            except Boom as exc:
                outcomes[label] = exc

        gate = WriterGate(short_tmp)
        async with anyio.create_task_group() as tasks:
            await gate.close_on(store, tasks)
            tasks.start_soon(
                attempt,
                "m0",
                fleet.insert_session,
                register_params(session_id=mates[0]),
            )
            tasks.start_soon(
                attempt,
                "m1",
                fleet.insert_session,
                register_params(session_id=mates[1]),
            )
            tasks.start_soon(attempt, "boom", insert_then_fail)
            tasks.start_soon(
                attempt,
                "m2",
                fleet.insert_session,
                register_params(session_id=mates[2]),
            )
            tasks.start_soon(
                attempt,
                "m3",
                fleet.insert_session,
                register_params(session_id=mates[3]),
            )
            await wait_all_tasks_blocked()
            gate.open()

        assert len({id(tx) for tx in seen}) == 1
        assert type(outcomes["boom"]) is Boom and str(outcomes["boom"]) == "bug in a handler"
        assert [outcomes[f"m{n}"] for n in range(4)] == mates
        assert [r.session_id for r in await rows(store)] == mates


async def test_sqlite_constraint_error_in_a_job_becomes_conflict(
    short_tmp: Path,
) -> None:
    """A raw IntegrityError from a store function
    reaches the caller as the wire error Conflict."""

    def raw_duplicate(tx: Tx) -> None:
        for _ in range(2):
            tx.conn.execute("INSERT INTO meta (key, value) VALUES ('test-key', 'v')")

    async with opened(short_tmp) as store:
        # SQLite says "UNIQUE constraint failed", PostgreSQL "violates unique constraint".
        with pytest.raises(Conflict, match="(?i)unique constraint"):
            await store.write(raw_duplicate)
    assert query(short_tmp, "SELECT count(*) FROM meta WHERE key = 'test-key'") == [(0,)]


async def test_write_results_come_back_to_their_own_callers(short_tmp: Path) -> None:
    """Each caller in a batch gets its own function's return value."""
    results: dict[int, Any] = {}
    async with opened(short_tmp) as store:

        async def one(n: int) -> None:
            results[n] = await store.write(lambda tx, value: value * 2, n)

        async with anyio.create_task_group() as tasks:
            for n in range(50):
                tasks.start_soon(one, n)
    assert results == {n: n * 2 for n in range(50)}


async def test_writes_after_close_are_unavailable(short_tmp: Path) -> None:
    """Once the store has closed, a write is
    refused with Unavailable instead of hanging."""
    async with opened(short_tmp) as store:
        await register(store)
    with pytest.raises(Unavailable):
        await register(store)


# --- savepoints only when needed ----------------------------------------------------------


async def gated_batch(
    root: Path, store: Store, calls: list[tuple[str, Callable[..., Any], tuple]]
) -> dict:
    """Run ``calls`` (label, fn, args) as one batch; each label's result or exception."""
    outcomes: dict[str, Any] = {}

    async def attempt(label: str, fn: Callable[..., Any], args: tuple) -> None:
        try:
            outcomes[label] = await store.write(fn, *args)
        except Exception as exc:  # noqa: BLE001 - the outcome under test
            outcomes[label] = exc

    gate = WriterGate(root)
    async with anyio.create_task_group() as tasks:
        await gate.close_on(store, tasks)
        for label, fn, args in calls:
            tasks.start_soon(attempt, label, fn, args)
        await wait_all_tasks_blocked()
        gate.open()
    return outcomes


async def test_a_write_refused_before_it_changed_anything_costs_its_mates_no_rerun(
    short_tmp: Path,
) -> None:
    """Refusals read, then raise: nothing to undo, so the batch runs once (no savepoints)
    and the mates' rows commit."""
    runs: dict[int, int] = {}
    ids = [new_id() for _ in range(4)]

    def mate(tx: Tx, n: int) -> int:
        runs[n] = runs.get(n, 0) + 1
        fleet.insert_session(tx, register_params(session_id=ids[n]))
        return n

    def refuse(tx: Tx) -> None:
        tx.conn.execute("SELECT count(*) FROM sessions").fetchone()
        raise Conflict("refused after a read")

    async with opened(short_tmp) as store:
        calls = [("m0", mate, (0,)), ("m1", mate, (1,)), ("no", refuse, ()),
                 ("m2", mate, (2,)), ("m3", mate, (3,))]  # fmt: skip
        outcomes = await gated_batch(short_tmp, store, calls)
        assert isinstance(outcomes.pop("no"), Conflict)
        assert outcomes == {"m0": 0, "m1": 1, "m2": 2, "m3": 3}
        assert runs == {0: 1, 1: 1, 2: 1, 3: 1}
        assert sorted(r.session_id for r in await rows(store)) == sorted(ids)


async def test_a_write_failing_after_changing_rows_reruns_the_batch_answered_from_the_commit(
    short_tmp: Path,
) -> None:
    """A job that changed rows and then raised needs a savepoint: the batch is rolled
    back and run again with one per job. Every answer comes from the run that committed
    (a claim's fresh effect_ref is the stored one), watchers hear each change once, and
    the failing job leaves nothing."""
    half_done = new_id()

    def insert_then_fail(tx: Tx) -> None:
        fleet.insert_session(tx, register_params(session_id=half_done))
        raise ValueError("bug after a write")

    def claim(key: str) -> tuple[str, Callable[..., Any], tuple]:
        params = IdemClaimParams(operation="op", key=key)
        return key, idempotency.claim, (caller(principal="p", holder=None), params)

    published: list[tuple[str, Any]] = []
    async with opened(short_tmp) as store:
        store.on_changes = published.extend
        calls = [claim("k0"), claim("k1"), ("boom", insert_then_fail, ()), claim("k2")]
        outcomes = await gated_batch(short_tmp, store, calls)
        assert isinstance(outcomes.pop("boom"), ValueError)
        stored = dict(query(short_tmp, "SELECT key, effect_ref FROM idempotency"))
        assert {key: result.effect_ref for key, result in outcomes.items()} == stored
        assert sorted(data.key for topic, data in published if topic == "idem") == [
            "k0",
            "k1",
            "k2",
        ]
        assert not [data for topic, data in published if topic == "fleet"]
        assert half_done not in {r.session_id for r in await rows(store)}


# --- the write lock held by another connection (SQLite: the writer runs on the loop) -----


@pytest.mark.sqlite_only
async def test_a_write_waiting_for_a_lock_held_elsewhere_leaves_the_loop_free(
    short_tmp: Path,
) -> None:
    """SQLite's write lock held by another process: the batch waits for it without
    blocking the event loop (a timer on the loop fires on time, a point read answers),
    and commits once the lock is released."""
    async with opened(short_tmp) as store:
        await register(store)  # start-up writes done
        holder = sqlite3.connect(db_path(short_tmp), isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")
        session_id = new_id()
        future = store.write(fleet.insert_session, register_params(session_id=session_id))
        started = time.monotonic()
        await anyio.sleep(0.2)  # the writer's turn comes: it finds the lock held
        assert time.monotonic() - started < 1, "the loop was blocked waiting for the lock"
        assert not future.done()
        assert store.read_now(fleet.count_sessions) == 1
        holder.execute("ROLLBACK")
        holder.close()
        with anyio.fail_after(5):
            assert await future == session_id
        assert session_id in {row.session_id for row in await rows(store)}


@pytest.mark.sqlite_only
async def test_a_write_lock_held_past_the_busy_timeout_refuses_the_batch_and_writes_nothing(
    short_tmp: Path,
) -> None:
    """Past ``busy_timeout_ms`` the batch's callers are told the database is locked
    (``internal``, as SQLite's own busy timeout said), nothing of it is written, and the
    next write, the lock gone, commits."""
    async with opened(short_tmp, busy_timeout_ms=300) as store:
        await register(store)
        holder = sqlite3.connect(db_path(short_tmp), isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")
        refused = new_id()
        started = time.monotonic()
        with pytest.raises(Internal, match="database is locked"):
            await store.write(fleet.insert_session, register_params(session_id=refused))
        assert 0.3 <= time.monotonic() - started < 2
        holder.execute("ROLLBACK")
        holder.close()
        assert await register(store) is not None
        assert refused not in {row.session_id for row in await rows(store)}


# --- the commit hold: writers in turn share one batch ------------------------------------

HELD_LONG_US = 10_000_000  # a hold that only the writers' return can end within a test


def claim_params(key: str) -> IdemClaimParams:
    return IdemClaimParams(operation="op", key=key)


async def answer_together(store: Store, *pids: int, claim: Any = idempotency.claim) -> None:
    """One batch of claims by these client processes, answered: the writers the next
    batch's hold waits for."""
    futures = [store.write(claim, caller(pid=pid), claim_params(f"k{pid}")) for pid in pids]
    for future in futures:
        await future


@pytest.mark.sqlite_only
async def test_the_next_batch_waits_for_the_writers_the_last_one_answered(
    short_tmp: Path,
) -> None:
    """Client processes 101 and 102 were answered by one batch; 103's write, queued
    right after, waits until both have written again, and the three share a batch."""
    seen: list[Tx] = []
    claim = noting_batch(seen, idempotency.claim)
    async with opened(short_tmp, commit_hold_us=HELD_LONG_US) as store:
        started = time.monotonic()
        await answer_together(store, 101, 102, claim=claim)
        third = store.write(claim, caller(pid=103), claim_params("k103"))
        await wait_all_tasks_blocked()
        assert not third.done()  # held: 101 and 102 have not written again
        again = [store.write(claim, caller(pid=101), claim_params("k101b"))]
        await wait_all_tasks_blocked()
        assert not third.done()  # 102 still out
        again.append(store.write(claim, caller(pid=102), claim_params("k102b")))
        for future in (third, *again):
            await future
        assert time.monotonic() - started < HELD_LONG_US / 1e6 / 2  # ended by 102, not the timer
    assert seen[0] is seen[1]  # the first batch
    assert seen[2] is seen[3] is seen[4] and seen[2] is not seen[0]  # 103, 101, 102 together


@pytest.mark.sqlite_only
async def test_one_writer_in_turn_never_waits(short_tmp: Path) -> None:
    """Its next write is the one it was answered for: no hold, however long it may be."""
    async with opened(short_tmp, commit_hold_us=HELD_LONG_US) as store:
        started = time.monotonic()
        for n in range(20):
            await store.write(idempotency.claim, caller(pid=101), claim_params(f"k{n}"))
        assert time.monotonic() - started < HELD_LONG_US / 1e6 / 2


@pytest.mark.sqlite_only
async def test_a_writer_that_does_not_come_back_holds_the_batch_no_longer_than_the_hold(
    short_tmp: Path,
) -> None:
    async with opened(short_tmp, commit_hold_us=50_000) as store:
        await answer_together(store, 101, 102)
        started = time.monotonic()
        await store.write(idempotency.claim, caller(pid=103), claim_params("k103"))
        waited = time.monotonic() - started
    assert 0.04 <= waited < 5  # the hold's timer ended it
    assert query(short_tmp, "SELECT count(*) FROM idempotency") == [(3,)]


@pytest.mark.sqlite_only
async def test_more_writers_than_the_hold_takes_are_not_held(short_tmp: Path) -> None:
    async with opened(short_tmp, commit_hold_us=HELD_LONG_US, commit_hold_max_writers=1) as store:
        await answer_together(store, 101, 102)
        started = time.monotonic()
        await store.write(idempotency.claim, caller(pid=103), claim_params("k103"))
        assert time.monotonic() - started < HELD_LONG_US / 1e6 / 2
