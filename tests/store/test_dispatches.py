"""Workers, the work-dispatch ledger, the audit log and retention, on a real store.

Every test runs store functions in the real writer (``store.write``) on a real
SQLite file, each request as its route in daemon/handlers.py runs it: ``fn(tx,
caller, params)``, the caller (principal, process) asking, the params saying what.
The clock is moved by running a store function on a Tx whose ``now`` is shifted or
set (``at``, ``clock``), never by sleeping; a setting (host, worker TTL, a page's
byte budget) by running it on a Tx whose config carries it (``configured``). A live
worker process is this test process; another live one is a ``sleep`` child; a dead
one is a child that was started, killed and reaped; a reused pid is this pid with
another start time.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sqlite3
import subprocess
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import msgspec
import pytest

from store_helpers import (
    DEAD,
    LIVE,
    at,
    caller,
    clock,
    configured,
    db_path,
    execute,
    opened,
    query,
    register_old_row,
    sql,
    state_dir,
)
from towerd.daemon.processes import Holder, holder_of
from towerd.daemon.store import (
    Store,
    audit,
    dispatches,
    leases,
    liveness,
    reconcile,
    retention,
    schema,
    workers,
)
from towerd.daemon.store.tx import Caller, Tx, unpack
from towerd.protocol.errors import (
    AlreadyActive,
    AttemptsExhausted,
    BadArgs,
    Conflict,
    NotBefore,
    NotFound,
    StaleLease,
)
from towerd.protocol.methods import (
    AuditEvent,
    AuditListParams,
    AuditListResult,
    DispatchClaimParams,
    DispatchClaimResult,
    DispatchCompleteParams,
    DispatchFailParams,
    DispatchFenceParams,
    DispatchIdParams,
    DispatchListParams,
    DispatchReasonParams,
    DispatchRecentParams,
    DispatchRecord,
    DispatchStuckReportParams,
    DispatchStuckReportResult,
    LeaseAcquireParams,
    LeaseRecord,
    LeaseRenewParams,
    LeaseResourceParams,
    LeaseTokenParams,
    StuckVerdict,
    WorkerIdParams,
    WorkerRecord,
    WorkerRegisterParams,
    WorkerRegisterResult,
)

pytestmark = pytest.mark.anyio

ME = "alice"
HOST = "host-1"
RES = "repo/main"
LEASE_TTL = 600_000
WORKER_TTL = 60_000
DAY = 86_400_000
TASK = "execute-task"

REUSED = DEAD  # this pid with another start time: not alive
ACTOR = f"{ME} pid {LIVE.pid}"
WHO: Caller = caller(ME, holder=LIVE)  # who sends the dispatch requests: audited as ACTOR
assert WHO.actor == ACTOR


# --- clock and processes -------------------------------------------------------------------


@pytest.fixture
def spawn() -> Iterator[Callable[[], tuple[subprocess.Popen[bytes], Holder]]]:
    """Start a live ``sleep`` child; every child is killed and reaped at teardown."""
    started: list[subprocess.Popen[bytes]] = []

    def start() -> tuple[subprocess.Popen[bytes], Holder]:
        proc = subprocess.Popen(["sleep", "300"])
        started.append(proc)
        holder = holder_of(proc.pid)
        assert holder is not None
        return proc, holder

    yield start
    for proc in started:
        proc.kill()
        proc.wait()


def kill(proc: subprocess.Popen[bytes]) -> None:
    """kill -9 and reap: the process (and its /proc entry) is gone."""
    proc.kill()
    proc.wait()
    assert holder_of(proc.pid) is None


# --- store helpers -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class W:
    """A registered worker and the lease it claims under."""

    worker_id: str
    holder: Holder
    resource: str
    token: int


def project(root: Path, name: str = "project") -> Path:
    path = root / name
    path.mkdir(exist_ok=True)
    return path


async def worker_register(
    store: Store,
    root: Path | str,
    holder: Holder | None = LIVE,
    version: str | None = "1.2.3",
    shift: int = 0,
) -> WorkerRegisterResult:
    """worker.register by ``holder`` (a process of ME), on a daemon of host HOST whose
    workers are reaped after WORKER_TTL."""
    fn = configured(at(shift, workers.register), host=HOST, worker_ttl_ms=WORKER_TTL)
    params = WorkerRegisterParams(project_root=str(root), version=version)
    return await store.write(fn, caller(ME, holder), params)


async def register_worker(
    store: Store, root: Path | str, holder: Holder | None = LIVE, version: str | None = "1.2.3"
) -> str:
    return (await worker_register(store, root, holder, version)).worker_id


async def worker_heartbeat(store: Store, worker_id: str, shift: int = 0) -> WorkerRecord:
    params = WorkerIdParams(worker_id=worker_id)
    return await store.write(at(shift, workers.heartbeat), WHO, params)


async def worker_stopping(store: Store, holder: Holder, worker_id: str) -> WorkerRecord:
    params = WorkerIdParams(worker_id=worker_id)
    return await store.write(workers.stopping, caller(ME, holder), params)


async def acquire(
    store: Store, holder: Holder | None, resource: str = RES, shift: int = 0, ttl: int = LEASE_TTL
) -> int:
    params = LeaseAcquireParams(resource=resource, ttl_ms=ttl)
    return (await store.write(at(shift, leases.acquire), caller(ME, holder), params)).fencing_token


async def renew(store: Store, holder: Holder, resource: str, token: int, ttl: int) -> Any:
    params = LeaseRenewParams(resource=resource, fencing_token=token, ttl_ms=ttl)
    return await store.write(leases.renew, caller(ME, holder), params)


async def release(store: Store, holder: Holder, resource: str, token: int) -> Any:
    params = LeaseTokenParams(resource=resource, fencing_token=token)
    return await store.write(leases.release, caller(ME, holder), params)


async def lease_record(store: Store, resource: str, shift: int = 0) -> LeaseRecord:
    return await store.read(at(shift, leases.get), WHO, LeaseResourceParams(resource=resource))


async def new_worker(
    store: Store, root: Path | str, holder: Holder = LIVE, resource: str = RES
) -> W:
    worker_id = await register_worker(store, root, holder)
    return W(worker_id, holder, resource, await acquire(store, holder, resource))


def params(w: W, unit_id: str = "T01", **fields: Any) -> DispatchClaimParams:
    fields.setdefault("unit_type", TASK)
    fields.setdefault("milestone_id", "M001")
    fields.setdefault("trace_id", f"trace-{unit_id}")
    fields.setdefault("worker_id", w.worker_id)
    fields.setdefault("lease_resource", w.resource)
    fields.setdefault("fencing_token", w.token)
    return DispatchClaimParams(unit_id=unit_id, **fields)


async def claim(
    store: Store, w: W, unit_id: str = "T01", shift: int = 0, now: int | None = None, **fields: Any
) -> DispatchClaimResult:
    fn = at(shift, dispatches.claim) if now is None else clock(now, dispatches.claim)
    return await store.write(fn, WHO, params(w, unit_id, **fields))


# op -> (status it moves to, the columns its request sets)
OPS: dict[str, tuple[str, dict[str, Any]]] = {
    "start": ("running", {}),
    "complete": ("completed", {"exit_reason": "done"}),
    "fail": (
        "failed",
        {"error_code": "E_TEST", "error_summary": "tests fail", "retry_after_ms": None},
    ),
    "stuck": ("stuck", {"exit_reason": "no progress"}),
    "pause": ("paused", {}),
    "cancel": ("canceled", {"exit_reason": "operator"}),
}

# op -> (its store function, its params Struct, the params field that carries each column)
REQUESTS: dict[str, tuple[Callable[..., Any], type, dict[str, str]]] = {
    "start": (dispatches.start, DispatchFenceParams, {}),
    "complete": (dispatches.complete, DispatchCompleteParams, {"exit_reason": "exit_reason"}),
    "fail": (
        dispatches.fail,
        DispatchFailParams,
        {c: c for c in ("error_code", "error_summary", "retry_after_ms")},
    ),
    "stuck": (dispatches.mark_stuck, DispatchReasonParams, {"exit_reason": "reason"}),
    "pause": (dispatches.pause, DispatchFenceParams, {}),
    "cancel": (dispatches.cancel, DispatchReasonParams, {"exit_reason": "reason"}),
}
assert REQUESTS.keys() == OPS.keys()


async def move(
    store: Store,
    w: W,
    dispatch_id: int,
    op: str,
    *,
    worker_id: str | None = None,
    token: int | None = None,
    shift: int = 0,
    now: int | None = None,
    **columns: Any,
) -> DispatchRecord:
    """Run one transition the way its route does, as WHO. A column the op's params have
    no field for (a repeat's other details) is not sent: the request cannot carry it."""
    _status, defaults = OPS[op]
    fn, params_type, fields = REQUESTS[op]
    carried = {fields[c]: value for c, value in {**defaults, **columns}.items() if c in fields}
    request = params_type(
        dispatch_id=dispatch_id,
        worker_id=w.worker_id if worker_id is None else worker_id,
        fencing_token=w.token if token is None else token,
        **carried,
    )
    timed = at(shift, fn) if now is None else clock(now, fn)
    return await store.write(timed, WHO, request)


async def get(store: Store, dispatch_id: int) -> DispatchRecord:
    return await store.read(dispatches.get, WHO, DispatchIdParams(dispatch_id=dispatch_id))


async def worker_row(store: Store, worker_id: str) -> WorkerRecord:
    return await store.read(workers.require, worker_id)


async def events(store: Store) -> list[AuditEvent]:
    """Every audit event, oldest first."""
    rows = await sql(
        store,
        "SELECT seq, event_id, trace_id, turn_id, caused_by, category, type, ts, actor, payload "
        "FROM audit_events ORDER BY seq",
    )
    return [AuditEvent(*row[:9], payload=unpack(row[9])) for row in rows]


async def event_count(store: Store) -> int:
    return (await sql(store, "SELECT count(*) FROM audit_events"))[0][0]


async def dispatch_count(store: Store) -> int:
    return (await sql(store, "SELECT count(*) FROM dispatches"))[0][0]


async def audit_page(
    store: Store, category: str | None, type: str | None, trace_id: str | None,
    before: int | None, limit: int, budget: int,
) -> AuditListResult:  # fmt: skip
    """One ``audit.list`` page under a byte budget of ``budget`` (a frame twice that size)."""
    params = AuditListParams(
        category=category, type=type, trace_id=trace_id, before=before, limit=limit
    )
    return await store.read(configured(audit.list_events, max_frame=2 * budget), WHO, params)


async def stuck_report(
    store: Store, root: Path, window: int, now: int | None = None
) -> DispatchStuckReportResult:
    fn = dispatches.stuck_report if now is None else clock(now, dispatches.stuck_report)
    params = DispatchStuckReportParams(project_root=str(root), window=window)
    return await store.read(fn, WHO, params)


def as_dict(record: msgspec.Struct) -> dict[str, Any]:
    return {name: getattr(record, name) for name in record.__struct_fields__}


def key(unit_id: str, unit_type: str = TASK) -> str:
    return f"{unit_type}/{unit_id}"


# --- workers -------------------------------------------------------------------------------


async def test_register_stores_the_process_and_the_real_project_root(short_tmp: Path) -> None:
    """A worker is the registering process (pid + start time) with the real path of its
    project root (a symlinked dir resolves), audited worker-registered."""
    real = project(short_tmp)
    link = short_tmp / "link"
    link.symlink_to(real)
    async with opened(short_tmp) as store:
        result = await worker_register(store, link)
        assert (result.heartbeat_ttl_ms, result.existing) == (WORKER_TTL, False)
        assert result.worker_id.startswith("wrk_")
        [row] = await sql(store, "SELECT * FROM workers")
        registered_at = row[8]
        assert row == (
            result.worker_id, ME, HOST, LIVE.pid, LIVE.start, "1.2.3", os.path.realpath(real),
            "active", registered_at, registered_at, None, None, store.daemon_id,
        )  # fmt: skip
        [event] = await events(store)
        assert (event.category, event.type, event.trace_id, event.actor, event.ts) == (
            "worker", "worker-registered", result.worker_id, ACTOR, registered_at,
        )  # fmt: skip
        assert event.payload == {
            "worker_id": result.worker_id,
            "pid": LIVE.pid,
            "project_root": os.path.realpath(real),
            "version": "1.2.3",
            "host": HOST,
        }


async def test_a_retried_register_answers_the_same_worker(short_tmp: Path) -> None:
    """The same process with the same root (by any path to it) gets its worker back,
    existing=True, heartbeat moved; no second row or event."""
    real = project(short_tmp)
    (short_tmp / "link").symlink_to(real)
    async with opened(short_tmp) as store:
        first = await worker_register(store, real, version=None)
        before = await worker_row(store, first.worker_id)
        again = await worker_register(store, short_tmp / "link", version=None, shift=5_000)
        assert (again.worker_id, again.existing) == (first.worker_id, True)
        after = await worker_row(store, first.worker_id)
        assert after.heartbeat_at >= before.heartbeat_at + 5_000
        assert msgspec.structs.replace(after, heartbeat_at=before.heartbeat_at) == before
        assert await sql(store, "SELECT count(*) FROM workers") == [(1,)]
        assert [e.type for e in await events(store)] == ["worker-registered"]


async def test_register_refuses_another_root_a_stopping_worker_and_no_process(
    short_tmp: Path,
) -> None:
    """One worker per process: another root is Conflict naming the worker, so is
    registering again once stopping; no identifiable process is BadArgs."""
    async with opened(short_tmp) as store:
        worker_id = await register_worker(store, project(short_tmp, "a"))
        with pytest.raises(Conflict) as other_root:
            await register_worker(store, project(short_tmp, "b"))
        assert other_root.value.data == {"worker": as_dict(await worker_row(store, worker_id))}

        await worker_stopping(store, LIVE, worker_id)
        with pytest.raises(Conflict) as stopping:
            await register_worker(store, short_tmp / "a")
        assert stopping.value.data["worker"]["status"] == "stopping"

        with pytest.raises(BadArgs):
            await register_worker(store, short_tmp / "a", holder=None)
        assert await sql(store, "SELECT worker_id, status FROM workers") == [
            (worker_id, "stopping")
        ]
        assert [e.type for e in await events(store)] == ["worker-registered", "worker-stopping"]


async def test_heartbeat_and_stopping(short_tmp: Path) -> None:
    """heartbeat moves heartbeat_at unaudited; stopping is audited once and repeats
    answer the row; a stopping worker still heartbeats; an unknown worker is
    NotFound; an ended one is Conflict."""
    async with opened(short_tmp) as store:
        worker_id = await register_worker(store, project(short_tmp))
        before = await worker_row(store, worker_id)
        beat = await worker_heartbeat(store, worker_id, shift=7_000)
        assert beat.heartbeat_at >= before.heartbeat_at + 7_000
        assert msgspec.structs.replace(beat, heartbeat_at=before.heartbeat_at) == before

        stopped = await worker_stopping(store, LIVE, worker_id)
        assert (stopped.status, stopped.ended_at, stopped.end_reason) == ("stopping", None, None)
        assert await worker_stopping(store, LIVE, worker_id) == stopped
        assert (await worker_heartbeat(store, worker_id)).status == "stopping"
        assert [e.type for e in await events(store)] == ["worker-registered", "worker-stopping"]
        stopping_event = (await events(store))[-1]
        assert (stopping_event.trace_id, stopping_event.actor, stopping_event.payload) == (
            worker_id, ACTOR, {"worker_id": worker_id},
        )  # fmt: skip

        with pytest.raises(NotFound) as missing:
            await worker_heartbeat(store, "wrk_nobody")
        assert missing.value.data == {"worker_id": "wrk_nobody"}

        await store.write(liveness.settle, [LIVE], WORKER_TTL)  # as if this process had exited
        with pytest.raises(Conflict):
            await worker_heartbeat(store, worker_id)
        with pytest.raises(Conflict):
            await worker_stopping(store, LIVE, worker_id)


# --- claim ---------------------------------------------------------------------------------


async def test_claim_inserts_a_claimed_row_with_its_event(short_tmp: Path) -> None:
    """A fenced claim writes one claimed row, attempt 1, and one dispatch-claimed event."""
    async with opened(short_tmp) as store:
        w = await new_worker(store, project(short_tmp))
        result = await claim(
            store, w, "M001/S01/T01", slice_id="S01", task_id="T01", turn_id="turn-9",
            max_attempts=4,
        )  # fmt: skip
        assert (result.attempt_n, result.status) == (1, "claimed")
        row = await get(store, result.dispatch_id)
        assert row == DispatchRecord(
            dispatch_id=result.dispatch_id, unit_key=key("M001/S01/T01"), unit_type=TASK,
            unit_id="M001/S01/T01", milestone_id="M001", slice_id="S01", task_id="T01",
            trace_id="trace-M001/S01/T01", turn_id="turn-9", worker_id=w.worker_id,
            lease_resource=RES, fencing_token=w.token, status="claimed", attempt_n=1,
            max_attempts=4, claimed_at=row.claimed_at, started_at=None, ended_at=None,
            exit_reason=None, error_code=None, error_summary=None, retry_after_ms=None,
            next_run_at=None,
        )  # fmt: skip
        event = (await events(store))[-1]
        assert (event.category, event.type, event.trace_id, event.turn_id, event.actor) == (
            "dispatch", "dispatch-claimed", "trace-M001/S01/T01", "turn-9", ACTOR,
        )  # fmt: skip
        assert (event.ts, event.caused_by) == (row.claimed_at, None)
        assert event.payload == {
            "dispatch_id": result.dispatch_id, "unit_key": key("M001/S01/T01"),
            "worker_id": w.worker_id, "lease_resource": RES, "fencing_token": w.token,
            "attempt_n": 1, "max_attempts": 4,
        }  # fmt: skip
        with pytest.raises(NotFound) as missing:
            await get(store, result.dispatch_id + 1)
        assert missing.value.data == {"dispatch_id": result.dispatch_id + 1}


@pytest.mark.parametrize(
    "case",
    ["no-lease", "another-process", "wrong-token", "expired", "unregistered", "reused-pid"],
)
async def test_claim_without_a_current_lease_is_stale_lease(
    short_tmp: Path, case: str, spawn: Callable[[], tuple[subprocess.Popen[bytes], Holder]]
) -> None:
    """The fence is checked first: the worker's own process must hold a live lease on
    the resource under exactly the token; otherwise StaleLease and nothing is written."""
    async with opened(short_tmp) as store:
        root = project(short_tmp)
        holder = REUSED if case == "reused-pid" else LIVE
        worker_id = await register_worker(store, root, holder)
        token, shift = 1, 0
        if case == "another-process":
            await acquire(store, spawn()[1])
        elif case == "reused-pid":
            await acquire(store, REUSED)  # the lease is the worker's, but its process is gone
        elif case != "no-lease":
            await acquire(store, LIVE)
        if case == "wrong-token":
            token = 2
        elif case == "expired":
            shift = LEASE_TTL  # expired exactly at the deadline
        elif case == "unregistered":
            worker_id = "wrk_nobody"
        w = W(worker_id, holder, RES, token)
        events_before = await event_count(store)
        with pytest.raises(StaleLease) as stale:
            await claim(store, w, shift=shift)
        lease = None if case == "no-lease" else as_dict(await lease_record(store, RES, shift))
        assert stale.value.data == {
            "worker_id": worker_id,
            "lease_resource": RES,
            "fencing_token": token,
            "lease": lease,
        }
        assert await dispatch_count(store) == 0
        assert await event_count(store) == events_before


async def test_a_stopping_worker_claims_nothing_new(short_tmp: Path) -> None:
    """A stopping worker with a current lease is Conflict; without one, the fence
    answers first (StaleLease)."""
    async with opened(short_tmp) as store:
        w = await new_worker(store, project(short_tmp))
        await worker_stopping(store, LIVE, w.worker_id)
        with pytest.raises(Conflict) as conflict:
            await claim(store, w)
        assert conflict.value.data == {"worker": as_dict(await worker_row(store, w.worker_id))}
        await release(store, LIVE, RES, w.token)
        with pytest.raises(StaleLease):
            await claim(store, w)
        assert await dispatch_count(store) == 0


async def test_a_unit_with_a_fenced_active_dispatch_is_already_active(
    short_tmp: Path, spawn: Callable[[], tuple[subprocess.Popen[bytes], Holder]]
) -> None:
    """While the active dispatch's own fence holds, a second claim of the unit, by its
    worker or another, is AlreadyActive with data.dispatch; checked before the
    attempt budget. Another unit, or the same id of another type, is free."""
    async with opened(short_tmp) as store:
        root = project(short_tmp)
        w = await new_worker(store, root)
        other = await new_worker(store, root, spawn()[1], "repo/other")
        first = await claim(store, w, max_attempts=1)
        await move(store, w, first.dispatch_id, "start")
        running = as_dict(await get(store, first.dispatch_id))
        events_before = await event_count(store)
        for claimer in (w, other):
            with pytest.raises(AlreadyActive) as active:
                await claim(store, claimer, max_attempts=1)
            assert active.value.code == "already_active"
            assert active.value.data == {"dispatch": running}
        assert await event_count(store) == events_before
        assert as_dict(await get(store, first.dispatch_id)) == running
        assert (await claim(store, other, "T02")).attempt_n == 1
        assert (await claim(store, other, "T01", unit_type="plan-slice")).attempt_n == 1


@pytest.mark.parametrize("how", ["superseded", "released", "expired", "process-gone"])
async def test_an_active_dispatch_whose_fence_broke_is_taken_over(
    short_tmp: Path, how: str, spawn: Callable[[], tuple[subprocess.Popen[bytes], Holder]]
) -> None:
    """If the existing active dispatch's lease was superseded, released or expired, or
    its process died, a claim cancels it (stale-dispatch-lease-takeover) and proceeds;
    the canceled row counts as an attempt."""
    async with opened(short_tmp) as store:
        root = project(short_tmp)
        proc, child = spawn()
        old = await new_worker(store, root, child, "repo/old")
        new = await new_worker(store, root, LIVE, "repo/new")
        first = await claim(store, old, "M001/S01/T01")
        await move(store, old, first.dispatch_id, "start")
        shift = 0
        if how == "superseded":  # released, then granted to the new worker: token 2
            await release(store, child, "repo/old", old.token)
            new = W(new.worker_id, LIVE, "repo/old", await acquire(store, LIVE, "repo/old"))
            assert new.token == old.token + 1
        elif how == "released":
            await release(store, child, "repo/old", old.token)
        elif how == "expired":
            shift = LEASE_TTL
            token = await acquire(store, LIVE, "repo/new", shift=shift)  # its own lease, renewed
            new = dataclasses.replace(new, token=token)
        else:
            kill(proc)
        events_before = await event_count(store)
        second = await claim(store, new, "M001/S01/T01", shift=shift)
        assert second.attempt_n == 2
        canceled = await get(store, first.dispatch_id)
        assert (canceled.status, canceled.exit_reason) == (
            "canceled",
            "stale-dispatch-lease-takeover",
        )
        claimed = await get(store, second.dispatch_id)
        assert canceled.ended_at == claimed.claimed_at
        assert (claimed.status, claimed.worker_id, claimed.attempt_n) == (
            "claimed",
            new.worker_id,
            2,
        )
        cancel_event, claim_event = (await events(store))[events_before:]
        assert (cancel_event.type, cancel_event.actor, cancel_event.caused_by) == (
            "dispatch-canceled", ACTOR, None,
        )  # fmt: skip
        assert cancel_event.payload == {
            "dispatch_id": first.dispatch_id, "unit_key": key("M001/S01/T01"),
            "worker_id": old.worker_id, "from": "running",
            "exit_reason": "stale-dispatch-lease-takeover", "taken_over_by": new.worker_id,
        }  # fmt: skip
        assert (claim_event.type, claim_event.payload["attempt_n"]) == ("dispatch-claimed", 2)


async def test_a_refused_claim_still_cancels_the_stale_dispatch_it_found(
    short_tmp: Path, spawn: Callable[[], tuple[subprocess.Popen[bytes], Holder]]
) -> None:
    """Spec: an active dispatch whose fence no longer holds is canceled first
    (stale-dispatch-lease-takeover), then the budget is checked. When the budget
    refuses the claim, the stale row must not stay active with a broken fence."""
    async with opened(short_tmp) as store:
        root = project(short_tmp)
        _proc, child = spawn()
        old = await new_worker(store, root, child, "repo/old")
        new = await new_worker(store, root, LIVE, "repo/new")
        first = await claim(store, old, max_attempts=1)
        await release(store, child, "repo/old", old.token)
        with pytest.raises(AttemptsExhausted):
            await claim(store, new, max_attempts=1)
        stale = await get(store, first.dispatch_id)
        assert (stale.status, stale.exit_reason) == ("canceled", "stale-dispatch-lease-takeover")


async def test_attempts_are_counted_and_the_budget_enforced(short_tmp: Path) -> None:
    """attempt_n counts every row of the unit (completed, failed, canceled alike); once
    the count reaches max_attempts the claim is AttemptsExhausted, checked before
    not_before. Each claim brings its own max_attempts."""
    async with opened(short_tmp) as store:
        w = await new_worker(store, project(short_tmp))
        outcomes = ["complete", "cancel", "fail"]
        for n, op in enumerate(outcomes, start=1):
            claimed = await claim(store, w)
            assert claimed.attempt_n == n
            await move(store, w, claimed.dispatch_id, op)
        latest = await claim(store, w, "T02")
        await move(store, w, latest.dispatch_id, "fail", retry_after_ms=60_000)
        events_before = await event_count(store)
        with pytest.raises(AttemptsExhausted) as exhausted:
            await claim(store, w)
        assert exhausted.value.code == "attempts_exhausted"
        assert exhausted.value.data == {"unit_key": key("T01"), "attempts": 3, "max_attempts": 3}
        with pytest.raises(AttemptsExhausted) as exhausted_first:  # not not_before
            await claim(store, w, "T02", max_attempts=1)
        assert exhausted_first.value.data == {
            "unit_key": key("T02"), "attempts": 1, "max_attempts": 1,
        }  # fmt: skip
        assert await event_count(store) == events_before
        assert (await claim(store, w, max_attempts=4)).attempt_n == 4
        assert await sql(
            store, "SELECT attempt_n, status FROM dispatches WHERE unit_id = 'T01' "
            "ORDER BY dispatch_id"
        ) == [(1, "completed"), (2, "canceled"), (3, "failed"), (4, "claimed")]  # fmt: skip


async def test_a_failure_with_retry_after_holds_the_unit_until_next_run_at(
    short_tmp: Path,
) -> None:
    """fail's next_run_at is its time plus retry_after_ms; a claim before it is NotBefore
    with data.next_run_at, and at it the claim proceeds."""
    async with opened(short_tmp) as store:
        w = await new_worker(store, project(short_tmp))
        first = await claim(store, w)
        failed = await move(store, w, first.dispatch_id, "fail", retry_after_ms=30_000)
        assert failed.ended_at is not None
        assert (failed.retry_after_ms, failed.next_run_at) == (30_000, failed.ended_at + 30_000)
        for now in (failed.ended_at, failed.next_run_at - 1):
            with pytest.raises(NotBefore) as early:
                await claim(store, w, now=now)
            assert early.value.code == "not_before"
            assert early.value.data == {
                "unit_key": key("T01"), "next_run_at": failed.next_run_at,
                "dispatch_id": first.dispatch_id,
            }  # fmt: skip
        assert await dispatch_count(store) == 1
        second = await claim(store, w, now=failed.next_run_at)
        assert second.attempt_n == 2


async def test_fail_without_retry_after_sets_no_next_run_at(short_tmp: Path) -> None:
    """A failure without retry_after_ms leaves next_run_at NULL: the next claim is free."""
    async with opened(short_tmp) as store:
        w = await new_worker(store, project(short_tmp))
        first = await claim(store, w)
        failed = await move(store, w, first.dispatch_id, "fail", retry_after_ms=None)
        assert (failed.error_code, failed.error_summary) == ("E_TEST", "tests fail")
        assert (failed.retry_after_ms, failed.next_run_at) == (None, None)
        assert (await claim(store, w)).attempt_n == 2


# --- transitions ---------------------------------------------------------------------------

STATES = ["claimed", "running", "completed", "failed", "stuck", "paused", "canceled"]
TO_STATE = {"running": "start", "completed": "complete", "failed": "fail", "stuck": "stuck",
            "paused": "pause", "canceled": "cancel"}  # fmt: skip
ALLOWED = {("claimed", op) for op in OPS} | {("running", op) for op in OPS if op != "start"}
EXPECTED_COLUMNS = {
    "start": {},
    "complete": {"exit_reason": "done"},
    "fail": {"error_code": "E_TEST", "error_summary": "tests fail"},
    "stuck": {"exit_reason": "no progress"},
    "pause": {},
    "cancel": {"exit_reason": "operator"},
}


@pytest.mark.parametrize("state", STATES)
async def test_every_transition_from_every_state(short_tmp: Path, state: str) -> None:
    """From ``state``, each op: allowed ones move the row and log one event with
    ``from``; repeating the transition that made the row answers it unchanged (no
    event); any other is Conflict with data.dispatch and changes nothing."""
    async with opened(short_tmp) as store:
        w = await new_worker(store, project(short_tmp))
        for op, (target, _columns) in OPS.items():
            unit = f"{state}-{op}"
            dispatch_id = (await claim(store, w, unit)).dispatch_id
            if state != "claimed":
                await move(store, w, dispatch_id, TO_STATE[state])
            before = await get(store, dispatch_id)
            assert before.status == state
            events_before = await event_count(store)
            if (state, op) in ALLOWED:
                after = await move(store, w, dispatch_id, op)
                [event] = (await events(store))[events_before:]
                changed: dict[str, Any] = {"status": target, **EXPECTED_COLUMNS[op]}
                if target == "running":
                    changed["started_at"] = event.ts
                else:
                    changed["ended_at"] = event.ts
                if op == "fail":
                    changed.update(retry_after_ms=None, next_run_at=None)
                assert after == msgspec.structs.replace(before, **changed), (state, op)
                assert await get(store, dispatch_id) == after
                assert (event.type, event.trace_id, event.actor) == (
                    f"dispatch-{target}", f"trace-{unit}", ACTOR,
                )  # fmt: skip
                assert event.payload == {
                    "dispatch_id": dispatch_id, "unit_key": key(unit),
                    "worker_id": w.worker_id, "from": state, **EXPECTED_COLUMNS[op],
                    **({"retry_after_ms": None} if op == "fail" else {}),
                }  # fmt: skip
            elif state == target:
                again = await move(store, w, dispatch_id, op, exit_reason="other", error_code="E2")
                assert again == before, (state, op)
                assert await get(store, dispatch_id) == before
                assert await event_count(store) == events_before
            else:
                with pytest.raises(Conflict) as conflict:
                    await move(store, w, dispatch_id, op)
                assert conflict.value.data == {"dispatch": as_dict(before)}, (state, op)
                assert await get(store, dispatch_id) == before
                assert await event_count(store) == events_before


@pytest.mark.parametrize("state", ["claimed", "running", "completed"])
async def test_a_transition_by_the_wrong_worker_or_token_is_stale_lease(
    short_tmp: Path, state: str, spawn: Callable[[], tuple[subprocess.Popen[bytes], Holder]]
) -> None:
    """The row's worker and token must be the caller's, before anything else (even on a
    settled row): otherwise StaleLease naming the row, and nothing changes."""
    async with opened(short_tmp) as store:
        root = project(short_tmp)
        w = await new_worker(store, root)
        other = await new_worker(store, root, spawn()[1], "repo/other")
        dispatch_id = (await claim(store, w)).dispatch_id
        if state != "claimed":
            await move(store, w, dispatch_id, TO_STATE[state])
        before = await get(store, dispatch_id)
        events_before = await event_count(store)
        for worker_id, token in [(other.worker_id, w.token), (w.worker_id, w.token + 1),
                                 (other.worker_id, other.token)]:  # fmt: skip
            for op in OPS:
                with pytest.raises(StaleLease) as stale:
                    await move(store, w, dispatch_id, op, worker_id=worker_id, token=token)
                assert stale.value.data == {
                    "dispatch": as_dict(before), "worker_id": worker_id, "fencing_token": token,
                }  # fmt: skip
        assert await get(store, dispatch_id) == before
        assert await event_count(store) == events_before


@pytest.mark.parametrize("how", ["released", "superseded", "expired", "process-gone"])
async def test_a_transition_after_the_lease_is_gone_is_stale_lease(
    short_tmp: Path, how: str, spawn: Callable[[], tuple[subprocess.Popen[bytes], Holder]]
) -> None:
    """With the row's worker and token but the lease no longer current (released,
    superseded by a new grant, expired, or the process gone), every allowed
    transition is StaleLease and the row stays active."""
    async with opened(short_tmp) as store:
        proc, child = spawn()
        w = await new_worker(store, project(short_tmp), child)
        dispatch_id = (await claim(store, w)).dispatch_id
        await move(store, w, dispatch_id, "start")
        shift = 0
        if how in ("released", "superseded"):
            await release(store, child, RES, w.token)
            if how == "superseded":
                assert await acquire(store, child) == w.token + 1
        elif how == "expired":
            shift = LEASE_TTL
        else:
            kill(proc)
        before = await get(store, dispatch_id)
        events_before = await event_count(store)
        for op in OPS:
            if op == "start":
                continue  # running already: a repeat, answered below
            with pytest.raises(StaleLease) as stale:
                await move(store, w, dispatch_id, op, shift=shift)
            assert stale.value.data["lease_resource"] == RES
            assert stale.value.data["fencing_token"] == w.token
        assert await get(store, dispatch_id) == before
        assert await event_count(store) == events_before
        # A repeat of the transition that already happened is a lost reply: the row as is.
        assert await move(store, w, dispatch_id, "start", shift=shift) == before


async def test_a_stopping_worker_still_settles_its_dispatches(short_tmp: Path) -> None:
    """worker.stopping stops new claims, not the settling of what the worker has."""
    async with opened(short_tmp) as store:
        w = await new_worker(store, project(short_tmp))
        dispatch_id = (await claim(store, w)).dispatch_id
        await worker_stopping(store, LIVE, w.worker_id)
        await move(store, w, dispatch_id, "start")
        assert (await move(store, w, dispatch_id, "complete")).status == "completed"


# --- what SQLite itself enforces -----------------------------------------------------------

_INSERT = """INSERT INTO dispatches (unit_type, unit_id, milestone_id, trace_id, worker_id,
    lease_resource, fencing_token, status, attempt_n, max_attempts, claimed_at, ended_at)
    VALUES ('execute-task', ?, 'M001', 't', 'wrk_x', 'r', 1, ?, 1, 3, 1000, ?)"""


@pytest.mark.sqlite_only
async def test_the_partial_unique_index_and_checks_refuse_bad_rows(short_tmp: Path) -> None:
    """Raw inserts on the closed file: a second active row of a unit violates the
    partial unique index; settled rows of the unit do not; a bogus status and an
    active row with ended_at (or a settled one without) violate CHECKs."""
    async with opened(short_tmp) as store:
        w = await new_worker(store, project(short_tmp))
        await claim(store, w)
    execute(short_tmp, _INSERT, ("T01", "completed", 2000))
    execute(short_tmp, _INSERT, ("T01", "failed", 2000))
    for status in ("claimed", "running"):
        with pytest.raises(sqlite3.IntegrityError, match="UNIQUE constraint failed"):
            execute(short_tmp, _INSERT, ("T01", status, None))
    execute(short_tmp, _INSERT, ("T02", "running", None))  # another unit: fine
    for unit, status, ended_at in [
        ("T03", "bogus", 2000),
        ("T03", "claimed", 2000),
        ("T03", "running", 2000),
        ("T03", "completed", None),
    ]:
        with pytest.raises(sqlite3.IntegrityError, match="CHECK constraint failed"):
            execute(short_tmp, _INSERT, (unit, status, ended_at))
    assert query(short_tmp, "SELECT unit_id, status FROM dispatches ORDER BY dispatch_id") == [
        ("T01", "claimed"),
        ("T01", "completed"),
        ("T01", "failed"),
        ("T02", "running"),
    ]


# --- liveness ------------------------------------------------------------------------------


async def test_a_dead_workers_process_crashes_it_in_one_write(
    short_tmp: Path, spawn: Callable[[], tuple[subprocess.Popen[bytes], Holder]]
) -> None:
    """One liveness.settle for a gone process: the worker is crashed (process-gone),
    every lease its process holds is released, its active dispatches are canceled
    worker-crashed, its settled ones untouched, and the events name the
    worker-crashed event as their cause. Other workers are not touched."""
    async with opened(short_tmp) as store:
        root = project(short_tmp)
        proc, child = spawn()
        w = await new_worker(store, root, child)
        second_token = await acquire(store, child, "repo/second")
        done = (await claim(store, w, "T00")).dispatch_id
        await move(store, w, done, "complete")
        claimed = (await claim(store, w, "T01")).dispatch_id
        running = (await claim(store, w, "T02")).dispatch_id
        await move(store, w, running, "start")
        bystander = await new_worker(store, root, LIVE, "repo/live")
        theirs = (await claim(store, bystander, "T09")).dispatch_id
        done_before = await get(store, done)
        kill(proc)
        holders, _silent = await store.read(liveness.to_check, WORKER_TTL)
        assert child in holders and LIVE in holders
        events_before = await event_count(store)

        report = await store.write(liveness.settle, [child], WORKER_TTL)

        ended = await worker_row(store, w.worker_id)
        assert (ended.status, ended.end_reason) == ("crashed", "process-gone")
        assert ended.ended_at is not None
        [end] = report.workers_ended
        assert end.worker == ended
        assert report.dispatches_canceled == [claimed, running]
        assert sorted(report.leases_released) == sorted([RES, "repo/second"])
        assert [r[0] for r in await sql(store, "SELECT resource FROM leases")] == ["repo/live"]
        for dispatch_id in (claimed, running):
            row = await get(store, dispatch_id)
            assert (row.status, row.exit_reason, row.ended_at) == (
                "canceled", "worker-crashed", ended.ended_at,
            )  # fmt: skip
        assert await get(store, done) == done_before
        assert (await get(store, theirs)).status == "claimed"
        assert (await worker_row(store, bystander.worker_id)).status == "active"

        new = (await events(store))[events_before:]
        crashed = new[0]
        assert (crashed.type, crashed.event_id, crashed.trace_id, crashed.actor) == (
            "worker-crashed", end.event_id, w.worker_id, "daemon",
        )  # fmt: skip
        assert crashed.payload == {
            "worker_id": w.worker_id, "pid": child.pid, "reason": "process-gone",
            "heartbeat_at": ended.heartbeat_at,
        }  # fmt: skip
        assert Counter(e.type for e in new[1:]) == {"lease-released": 2, "dispatch-canceled": 2}
        assert {e.caused_by for e in new[1:]} == {end.event_id}
        assert {e.ts for e in new} == {ended.ended_at}  # one transaction, one clock
        released = {e.trace_id: e.payload for e in new if e.type == "lease-released"}
        assert released == {
            RES: {"resource": RES, "fencing_token": w.token, "holder": f"{ME} pid {child.pid}",
                  "reason": "worker-ended"},
            "repo/second": {"resource": "repo/second", "fencing_token": second_token,
                            "holder": f"{ME} pid {child.pid}", "reason": "worker-ended"},
        }  # fmt: skip
        canceled = {e.payload["dispatch_id"]: e for e in new if e.type == "dispatch-canceled"}
        assert (canceled[claimed].payload["from"], canceled[running].payload["from"]) == (
            "claimed", "running",
        )  # fmt: skip
        assert canceled[claimed].trace_id == "trace-T01"
        assert canceled[claimed].payload["exit_reason"] == "worker-crashed"

        # Settled now: a second sweep finds nothing more to do.
        again = await store.write(liveness.settle, [child], WORKER_TTL)
        assert (again.workers_ended, again.dispatches_canceled, again.leases_released) == (
            [], [], [],
        )  # fmt: skip


async def test_a_silent_worker_is_crashed_at_the_ttl_though_its_process_lives(
    short_tmp: Path,
) -> None:
    """Heartbeat older than the TTL: crashed with heartbeat-timeout, its leases
    released and dispatches canceled; one millisecond earlier nothing happens. The
    process may then register again, as a new worker."""
    async with opened(short_tmp) as store:
        root = project(short_tmp)
        w = await new_worker(store, root)
        dispatch_id = (await claim(store, w)).dispatch_id
        heartbeat_at = (await worker_row(store, w.worker_id)).heartbeat_at
        deadline = heartbeat_at + WORKER_TTL

        holders, silent = await store.read(clock(deadline - 1, liveness.to_check), WORKER_TTL)
        assert (LIVE in holders, silent) == (True, False)
        early = await store.write(clock(deadline - 1, liveness.settle), [], WORKER_TTL)
        assert early.workers_ended == []
        assert (await worker_row(store, w.worker_id)).status == "active"

        assert (await store.read(clock(deadline, liveness.to_check), WORKER_TTL))[1] is True
        report = await store.write(clock(deadline, liveness.settle), [], WORKER_TTL)
        ended = await worker_row(store, w.worker_id)
        assert (ended.status, ended.end_reason, ended.ended_at) == (
            "crashed", "heartbeat-timeout", deadline,
        )  # fmt: skip
        assert (report.leases_released, report.dispatches_canceled) == ([RES], [dispatch_id])
        row = await get(store, dispatch_id)
        assert (row.status, row.exit_reason) == ("canceled", "worker-crashed")
        [crashed] = [e for e in await events(store) if e.type == "worker-crashed"]
        assert crashed.payload["reason"] == "heartbeat-timeout"

        again = await worker_register(store, root, version=None)
        assert (again.existing, again.worker_id != w.worker_id) == (False, True)


async def test_a_silent_stopping_worker_is_ended_at_the_ttl(short_tmp: Path) -> None:
    """Spec: a worker is dead when its heartbeat is older than the TTL or its process
    is gone. A stopping worker (it may still heartbeat) that falls silent is dead too:
    the sweep must notice it and end it, releasing its leases and settling its
    dispatches, or they stay active for as long as the process hangs."""
    async with opened(short_tmp) as store:
        w = await new_worker(store, project(short_tmp))
        dispatch_id = (await claim(store, w)).dispatch_id
        await worker_stopping(store, LIVE, w.worker_id)
        deadline = (await worker_row(store, w.worker_id)).heartbeat_at + WORKER_TTL
        assert (await store.read(clock(deadline, liveness.to_check), WORKER_TTL))[1] is True
        report = await store.write(clock(deadline, liveness.settle), [], WORKER_TTL)
        ended = await worker_row(store, w.worker_id)
        assert (ended.ended_at, ended.end_reason) == (deadline, "heartbeat-timeout")
        assert ended.status == "crashed"  # alive but silent: hung, not a clean stop
        assert (report.leases_released, report.dispatches_canceled) == ([RES], [dispatch_id])
        assert (await get(store, dispatch_id)).status == "canceled"


async def test_a_stopping_workers_exit_ends_it_as_stopping(
    short_tmp: Path, spawn: Callable[[], tuple[subprocess.Popen[bytes], Holder]]
) -> None:
    """A worker that said stopping and whose process then exits keeps status stopping,
    end_reason process-exited, event worker-exited; its dispatches are canceled
    worker-exited, caused by that event."""
    async with opened(short_tmp) as store:
        proc, child = spawn()
        w = await new_worker(store, project(short_tmp), child)
        dispatch_id = (await claim(store, w)).dispatch_id
        await worker_stopping(store, child, w.worker_id)
        kill(proc)
        events_before = await event_count(store)
        report = await store.write(liveness.settle, [child], WORKER_TTL)
        ended = await worker_row(store, w.worker_id)
        assert (ended.status, ended.end_reason) == ("stopping", "process-exited")
        assert ended.ended_at is not None
        row = await get(store, dispatch_id)
        assert (row.status, row.exit_reason) == ("canceled", "worker-exited")
        assert report.dispatches_canceled == [dispatch_id]
        exited, *caused = (await events(store))[events_before:]
        assert (exited.type, exited.payload["reason"]) == ("worker-exited", "process-exited")
        assert [(e.type, e.caused_by) for e in caused] == [
            ("lease-released", exited.event_id),
            ("dispatch-canceled", exited.event_id),
        ]


async def test_a_reused_pid_is_not_the_worker(short_tmp: Path) -> None:
    """A dead holder with the worker's pid but another start time is another process:
    settling it leaves the live worker, its lease and dispatch alone."""
    async with opened(short_tmp) as store:
        w = await new_worker(store, project(short_tmp))
        dispatch_id = (await claim(store, w)).dispatch_id
        report = await store.write(liveness.settle, [REUSED], WORKER_TTL)
        assert (report.workers_ended, report.leases_released) == ([], [])
        assert (await worker_row(store, w.worker_id)).status == "active"
        assert (await get(store, dispatch_id)).status == "claimed"


# --- audit ---------------------------------------------------------------------------------


async def test_every_state_change_has_exactly_one_event(
    short_tmp: Path, spawn: Callable[[], tuple[subprocess.Popen[bytes], Holder]]
) -> None:
    """A mixed history: each committed change of a worker, lease or dispatch has one
    event of its type, with the trace id its category prescribes; renewals,
    heartbeats, repeats and refused requests have none."""
    async with opened(short_tmp) as store:
        root = project(short_tmp)
        w = await new_worker(store, root)  # worker-registered, lease-granted
        await renew(store, LIVE, RES, w.token, LEASE_TTL)
        await worker_heartbeat(store, w.worker_id)
        await register_worker(store, root)  # a retried register
        history: dict[int, list[str]] = {}

        async def run(unit: str, *ops: str) -> int:
            dispatch_id = (await claim(store, w, unit)).dispatch_id
            history[dispatch_id] = ["dispatch-claimed"]
            for op in ops:
                await move(store, w, dispatch_id, op)
                history[dispatch_id].append(f"dispatch-{OPS[op][0]}")
            return dispatch_id

        done = await run("U1", "start", "complete")
        await move(store, w, done, "complete")  # a repeat
        await run("U2", "fail")
        await run("U2", "start", "stuck")
        await run("U3", "pause")
        await run("U4", "start", "cancel")
        last = await run("U5", "start")
        with pytest.raises(AlreadyActive):
            await claim(store, w, "U5")
        with pytest.raises(Conflict):
            await move(store, w, done, "fail")
        token = await acquire(store, LIVE, "repo/tmp")  # lease-granted
        await release(store, LIVE, "repo/tmp", token)  # lease-released

        proc, child = spawn()
        c = await new_worker(store, root, child, "repo/child")  # worker-registered, lease-granted
        theirs = (await claim(store, c, "U6")).dispatch_id
        await move(store, c, theirs, "start")
        history[theirs] = ["dispatch-claimed", "dispatch-running", "dispatch-canceled"]
        kill(proc)
        await store.write(liveness.settle, [child], WORKER_TTL)  # crashed, released, canceled

        await worker_stopping(store, LIVE, w.worker_id)  # worker-stopping
        await move(store, w, last, "complete")
        history[last].append("dispatch-completed")

        logged = await events(store)
        assert Counter(e.type for e in logged) == {
            "worker-registered": 2, "worker-stopping": 1, "worker-crashed": 1,
            "lease-granted": 3, "lease-released": 2, "dispatch-claimed": 7,
            "dispatch-running": 5, "dispatch-completed": 2, "dispatch-failed": 1,
            "dispatch-stuck": 1, "dispatch-paused": 1, "dispatch-canceled": 2,
        }  # fmt: skip
        assert len({e.event_id for e in logged}) == len(logged)
        assert [e.seq for e in logged] == sorted(e.seq for e in logged)
        listed = await store.read(dispatches.list_dispatches, WHO, DispatchListParams(limit=100))
        rows = {row.dispatch_id: row for row in listed.dispatches}
        for dispatch_id, expected in history.items():
            mine = [e for e in logged if e.category == "dispatch"
                    and e.payload["dispatch_id"] == dispatch_id]  # fmt: skip
            assert [e.type for e in mine] == expected, dispatch_id
            assert {e.trace_id for e in mine} == {rows[dispatch_id].trace_id}
            froms = [e.payload["from"] for e in mine[1:]]
            assert froms == [t.removeprefix("dispatch-") for t in expected[:-1]]
            assert mine[-1].type == f"dispatch-{rows[dispatch_id].status}"
        assert set(history) == set(rows)
        for e in logged:
            if e.category == "worker":
                assert e.trace_id == e.payload["worker_id"]
            elif e.category == "lease":
                assert e.trace_id == e.payload["resource"]


async def test_audit_list_pages_newest_first_and_filters(short_tmp: Path) -> None:
    """audit.list: newest first, next_before continues a page, the byte budget cuts a
    page short (never below one event); category, type and trace_id filter (AND)."""
    async with opened(short_tmp) as store:
        w = await new_worker(store, project(short_tmp))
        for unit in ("A", "B", "C"):
            dispatch_id = (await claim(store, w, unit)).dispatch_id
            await move(store, w, dispatch_id, "complete")
        everything = await events(store)
        assert len(everything) == 8
        newest_first = list(reversed(everything))

        pages, before = [], None
        while True:
            page = await audit_page(store, None, None, None, before, 3, 1 << 20)
            pages.append(page.events)
            if page.next_before is None:
                break
            assert page.next_before == page.events[-1].seq
            before = page.next_before
        assert [len(p) for p in pages] == [3, 3, 2]
        assert [e for p in pages for e in p] == newest_first

        tiny = await audit_page(store, None, None, None, None, 50, 1)
        assert (tiny.events, tiny.next_before) == ([newest_first[0]], newest_first[0].seq)
        whole = await audit_page(store, None, None, None, None, 8, 1 << 20)
        assert (whole.events, whole.next_before) == (newest_first, None)

        def listed(category: str | None, type: str | None, trace: str | None) -> Any:
            return audit_page(store, category, type, trace, None, 50, 1 << 20)

        assert [e.type for e in (await listed("worker", None, None)).events] == [
            "worker-registered"
        ]
        assert [e.trace_id for e in (await listed(None, "dispatch-completed", None)).events] == [
            "trace-C", "trace-B", "trace-A",
        ]  # fmt: skip
        assert [e.type for e in (await listed("dispatch", None, "trace-B")).events] == [
            "dispatch-completed", "dispatch-claimed",
        ]  # fmt: skip
        assert (await listed("lease", None, RES)).events == [
            e for e in newest_first if e.type == "lease-granted"
        ]
        assert (await listed("lease", "dispatch-claimed", None)).events == []


async def test_audit_record_is_idempotent_by_event_id(short_tmp: Path) -> None:
    """Recording the same event_id twice keeps one row, the first one."""
    async with opened(short_tmp) as store:
        record = functools.partial(audit.record, event_id="evt-1")
        first = await store.write(record, "worker", "worker-registered", {"n": 1})
        second = await store.write(
            functools.partial(record, trace_id="x"), "lease", "lease-granted", {"n": 2}
        )
        assert first == second == "evt-1"
        [event] = await events(store)
        assert (event.event_id, event.category, event.type, event.payload, event.trace_id) == (
            "evt-1", "worker", "worker-registered", {"n": 1}, None,
        )  # fmt: skip


# --- listing, recent, stuck ----------------------------------------------------------------


async def test_list_dispatches_is_the_most_recent_oldest_first(short_tmp: Path) -> None:
    """dispatch.list: the most recent ``limit`` matches, oldest first; filters AND."""
    async with opened(short_tmp) as store:
        w = await new_worker(store, project(short_tmp))
        ids = []
        for unit, milestone in [("A", "M1"), ("B", "M1"), ("C", "M2"), ("D", "M1")]:
            dispatch_id = (await claim(store, w, unit, milestone_id=milestone)).dispatch_id
            ids.append(dispatch_id)
            if unit != "D":
                await move(store, w, dispatch_id, "complete")

        async def listed(limit: int = 50, **filters: Any) -> list[int]:
            request = DispatchListParams(limit=limit, **filters)
            result = await store.read(dispatches.list_dispatches, WHO, request)
            return [row.dispatch_id for row in result.dispatches]

        assert await listed() == ids
        assert await listed(limit=2) == ids[2:]
        assert await listed(milestone_id="M1") == [ids[0], ids[1], ids[3]]
        assert await listed(milestone_id="M1", status="completed") == ids[:2]
        assert await listed(milestone_id="M1", status="completed", limit=1) == [ids[1]]
        assert await listed(unit_type=TASK, unit_id="C") == [ids[2]]
        assert await listed(worker_id=w.worker_id, status="claimed") == [ids[3]]
        assert await listed(worker_id="wrk_nobody") == []


async def test_recent_unit_keys_oldest_first_without_crashed_workers(
    short_tmp: Path, spawn: Callable[[], tuple[subprocess.Popen[bytes], Holder]]
) -> None:
    """dispatch.recent by worker or by project (real path): unit keys "type/id", oldest
    first, the most recent ``limit``; a crashed worker's rows are left out."""
    real = project(short_tmp)
    (short_tmp / "link").symlink_to(real)
    async with opened(short_tmp) as store:
        w = await new_worker(store, real)
        proc, child = spawn()
        crashed = await new_worker(store, real, child, "repo/child")
        elsewhere = await new_worker(store, project(short_tmp, "other"), spawn()[1], "repo/x")
        for worker, unit, unit_type in [(w, "M001/S01/T01", TASK), (crashed, "X", TASK),
                                        (w, "M001/S01", "plan-slice"), (elsewhere, "Y", TASK),
                                        (w, "M001/S01/T02", TASK)]:  # fmt: skip
            dispatch_id = (await claim(store, worker, unit, unit_type=unit_type)).dispatch_id
            await move(store, worker, dispatch_id, "complete")
        mine = [key("M001/S01/T01"), key("M001/S01", "plan-slice"), key("M001/S01/T02")]

        async def recent(worker_id: str | None, root: Path | None, limit: int = 20) -> list[str]:
            request = DispatchRecentParams(
                worker_id=worker_id, project_root=None if root is None else str(root), limit=limit
            )
            result = await store.read(dispatches.recent_unit_keys, WHO, request)
            return result.unit_keys

        assert await recent(w.worker_id, None) == mine
        assert await recent(None, short_tmp / "link") == mine[:1] + [key("X")] + mine[1:]
        kill(proc)
        await store.write(liveness.settle, [child], WORKER_TTL)
        assert await recent(None, short_tmp / "link") == mine
        assert await recent(crashed.worker_id, None) == []
        assert await recent(None, real, limit=2) == mine[1:]
        assert await recent(elsewhere.worker_id, None) == [key("Y")]


async def test_stuck_report_same_unit_three_times(short_tmp: Path) -> None:
    """One unit dispatched three times in a row: same-unit-consecutive, named by its
    full key (type/id with the id's slashes)."""
    async with opened(short_tmp) as store:
        root = project(short_tmp)
        w = await new_worker(store, root)
        for _ in range(3):
            dispatch_id = (await claim(store, w, "M001/S01/T01")).dispatch_id
            await move(store, w, dispatch_id, "complete")
        unit = key("M001/S01/T01")
        report = await stuck_report(store, root, 20)
        assert report.stuck is True
        assert report.verdict == StuckVerdict(
            "same-unit-consecutive", unit, f"{unit} dispatched 3 consecutive times without progress"
        )
        assert (report.suppressed, report.window) == ([], [unit] * 3)
        short = await stuck_report(store, root, 2)
        assert (short.stuck, short.window) == (False, [unit] * 2)


async def test_stuck_report_oscillation_tells_types_apart(short_tmp: Path) -> None:
    """A, B, A, B where A and B share an id but not a type: oscillation on B."""
    async with opened(short_tmp) as store:
        root = project(short_tmp)
        w = await new_worker(store, root)
        for unit_type in (TASK, "plan-slice", TASK, "plan-slice"):
            dispatch_id = (await claim(store, w, "S01", unit_type=unit_type)).dispatch_id
            await move(store, w, dispatch_id, "complete")
        a, b = key("S01"), key("S01", "plan-slice")
        report = await stuck_report(store, root, 20)
        assert report.verdict == StuckVerdict(
            "oscillation", b,
            f"Oscillation detected: {a} <-> {b}, alternating over the last 4 attempts",
        )  # fmt: skip
        assert (report.stuck, report.suppressed, report.window) == (True, [], [a, b, a, b])


async def test_stuck_report_suppresses_a_unit_waiting_on_its_retry(short_tmp: Path) -> None:
    """Two failures with the same code: same-error is suppressed while the unit has
    attempts left and its next_run_at is in the future; not at next_run_at, and not
    once the budget is spent."""
    async with opened(short_tmp) as store:
        root = project(short_tmp)
        w = await new_worker(store, root)
        unit = key("M001/S01/T01")
        first = await claim(store, w, "M001/S01/T01")
        failed = await move(store, w, first.dispatch_id, "fail", retry_after_ms=1_000)
        second = await claim(store, w, "M001/S01/T01", now=failed.next_run_at)
        failed = await move(
            store, w, second.dispatch_id, "fail", retry_after_ms=60_000, now=failed.next_run_at
        )
        assert failed.next_run_at is not None
        same_error = StuckVerdict(
            "same-error",
            unit,
            f"Same error repeated on the last 2 attempts, last on {unit}: E_TEST",
        )

        async def report_at(now: int) -> Any:
            return await stuck_report(store, root, 20, now)

        waiting = await report_at(failed.next_run_at - 1)
        assert (waiting.stuck, waiting.verdict, waiting.suppressed) == (False, None, [same_error])
        assert waiting.window == [unit, unit]
        due = await report_at(failed.next_run_at)
        assert (due.stuck, due.verdict, due.suppressed) == (True, same_error, [])

        third = await claim(store, w, "M001/S01/T01", now=failed.next_run_at)
        spent = await move(
            store, w, third.dispatch_id, "fail", retry_after_ms=60_000, now=failed.next_run_at
        )
        assert spent.next_run_at is not None
        exhausted = await report_at(spent.next_run_at - 1)
        assert (exhausted.stuck, exhausted.verdict, exhausted.suppressed) == (
            True, same_error, [],
        )  # fmt: skip


# --- retention -----------------------------------------------------------------------------


async def test_prune_history_removes_old_settled_rows_and_keeps_active_ones(
    short_tmp: Path, spawn: Callable[[], tuple[subprocess.Popen[bytes], Holder]]
) -> None:
    """Pruned at a clock ten days on with a one-day retention: old events, old settled
    dispatches and old ended workers go; an old active dispatch, an active worker and
    an ended worker a remaining dispatch names stay; young rows stay; the pruned
    unit gets a fresh attempt budget."""
    later = 10 * DAY
    async with opened(short_tmp) as store:
        root = project(short_tmp)
        w = await new_worker(store, root)
        done = []
        for _ in range(3):
            dispatch_id = (await claim(store, w, "OLD")).dispatch_id
            await move(store, w, dispatch_id, "complete")
            done.append(dispatch_id)
        active = (await claim(store, w, "ACTIVE")).dispatch_id

        proc_gone, gone_holder = spawn()
        gone = await new_worker(store, root, gone_holder, "repo/gone")
        gone_dispatch = (await claim(store, gone, "GONE")).dispatch_id
        proc_named, named_holder = spawn()
        named = await new_worker(store, root, named_holder, "repo/named")
        named_dispatch = (await claim(store, named, "NAMED")).dispatch_id
        kill(proc_gone)
        kill(proc_named)
        await store.write(liveness.settle, [gone_holder, named_holder], WORKER_TTL)
        # The clock stepped: the named worker's canceled dispatch ended "late".
        await store.write(
            lambda tx: tx.conn.execute(
                "UPDATE dispatches SET ended_at = ended_at + ? WHERE dispatch_id = ?",
                (later - 1_000, named_dispatch),
            )
        )
        old_events = await event_count(store)

        young_token = await acquire(store, LIVE, "repo/young", shift=later - 1_000)
        young_w = W(w.worker_id, LIVE, "repo/young", young_token)
        young = (await claim(store, young_w, "YOUNG", shift=later - 1_000)).dispatch_id
        await move(store, young_w, young, "complete", shift=later - 1_000)
        young_events = await event_count(store) - old_events

        pruned = await store.write(at(later, retention.prune_history), DAY)
        assert pruned == {
            "audit_events": old_events,
            "dispatches": 4,
            "workers": 1,
            "hook_events": 0,
        }
        remaining = await sql(store, "SELECT dispatch_id, status FROM dispatches ORDER BY 1")
        assert remaining == [
            (active, "claimed"),
            (named_dispatch, "canceled"),
            (young, "completed"),
        ]
        assert {r[0] for r in await sql(store, "SELECT worker_id FROM workers")} == {
            w.worker_id, named.worker_id,
        }  # fmt: skip
        assert gone_dispatch not in {r[0] for r in remaining}
        assert await event_count(store) == young_events
        assert await store.write(at(later, retention.prune_history), DAY) == {
            "audit_events": 0, "dispatches": 0, "workers": 0, "hook_events": 0,
        }  # fmt: skip
        # Three old attempts of OLD are gone: its budget is fresh.
        fresh = await claim(store, young_w, "OLD", shift=later)
        assert fresh.attempt_n == 1


async def test_retention_keeps_a_failed_dispatch_whose_retry_time_is_still_ahead(
    short_tmp: Path,
) -> None:
    """A failed dispatch whose retry is 8 days away survives a prune with a one-day
    retention, two days on: its unit is still refused not_before, never claimed early
    with a fresh budget (found by review)."""
    later = 2 * DAY
    async with opened(short_tmp) as store:
        w = await new_worker(store, project(short_tmp))
        claimed = await claim(store, w)
        failure = DispatchFailParams(
            dispatch_id=claimed.dispatch_id, worker_id=w.worker_id, fencing_token=w.token,
            error_code="E_RATE", error_summary="rate limited", retry_after_ms=10 * DAY,
        )  # fmt: skip
        failed = await store.write(dispatches.fail, WHO, failure)
        assert failed.next_run_at is not None

        await store.write(at(later, retention.prune_history), DAY)
        await worker_heartbeat(store, w.worker_id, shift=later)
        again = dataclasses.replace(w, token=await acquire(store, LIVE, shift=later))
        with pytest.raises(NotBefore) as refused:
            await claim(store, again, shift=later)
    assert refused.value.data["next_run_at"] == failed.next_run_at


# --- schema --------------------------------------------------------------------------------


@pytest.mark.sqlite_only
async def test_a_version_3_database_migrates_to_4_keeping_its_rows(
    short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file made by the v3 code (fleet rows, a lease) opens as v4: a v3 backup is
    taken, the new tables are there and empty, the old rows intact, and the old
    lease fences a claim in the new ledger."""
    monkeypatch.setattr(schema, "MIGRATIONS", schema.MIGRATIONS[:3])
    monkeypatch.setattr(schema, "SCHEMA_VERSION", 3)
    # The version-3 code had no workers whose clocks to restart.
    monkeypatch.setattr(reconcile, "restart_silence_clocks", lambda tx: None)
    async with opened(short_tmp) as store:
        await register_old_row(store, name="kept")

        def old_lease(tx: Tx) -> None:  # leases.acquire would audit: no such table in v3
            tx.conn.execute("INSERT INTO lease_tokens VALUES (?, 1)", (RES,))
            tx.conn.execute(
                "INSERT INTO leases VALUES (?, 1, ?, ?, ?, ?, ?, ?, ?)",
                (RES, ME, LIVE.pid, LIVE.start, tx.now, tx.now, tx.now + LEASE_TTL,
                 tx.daemon_id),
            )  # fmt: skip

        await store.write(old_lease)
    monkeypatch.undo()
    assert query(short_tmp, "PRAGMA user_version") == [(3,)]
    old_leases = query(short_tmp, "SELECT * FROM leases")

    async with opened(short_tmp) as store:
        for table in ("workers", "dispatches", "audit_events", "kv"):
            assert await sql(store, f"SELECT count(*) FROM {table}") == [(0,)], table
        assert await sql(store, "SELECT name FROM sessions") == [("kept",)]
        # Kept as they were (a later step added the session column, NULL for them).
        assert [row[:9] for row in await sql(store, "SELECT * FROM leases")] == old_leases
        w = W(await register_worker(store, project(short_tmp)), LIVE, RES, 1)
        assert (await claim(store, w)).attempt_n == 1
    assert query(short_tmp, "PRAGMA user_version") == [(schema.SCHEMA_VERSION,)]
    with closing(sqlite3.connect(db_path(short_tmp))) as conn:
        assert schema.shape_of(conn) == schema.expected_shape()
    (backup,) = (state_dir(short_tmp) / "backups").iterdir()
    assert backup.name.startswith("towerd-v3-")
    with closing(sqlite3.connect(backup)) as old:
        assert old.execute("PRAGMA user_version").fetchone() == (3,)
        assert old.execute("SELECT count(*) FROM leases").fetchone() == (1,)
