"""The work-dispatch ledger: every unit of work a worker runs, fenced by its lease.

A claim is one transaction: the worker's lease must be current under the token
it presents, at most one dispatch per unit is active (a partial unique index
makes SQLite itself refuse a second), the attempt number is counted inside the
transaction, ``max_attempts`` and a failure's ``next_run_at`` are enforced, and
an active dispatch whose own lease no longer holds is canceled first. Every
transition is fenced the same way, moves only from the states it allows, and
never reopens a settled row: a retry is a new row.

Fixes over the reference ledger: the attempt number and the retry budget are
computed and enforced here rather than left to callers; transitions are fenced
by worker and token, not by dispatch id alone; one unit key (``type/id``) is used
everywhere, so stuck-rule suppression sees the units it is about.
"""

from __future__ import annotations

from typing import Any

from msgspec.structs import asdict

from towerd.daemon.processes import is_alive
from towerd.daemon.store import audit, leases, stuck, workers
from towerd.daemon.store.tx import Caller, Refused, Tx, fitted, where
from towerd.protocol.errors import (
    AlreadyActive,
    AttemptsExhausted,
    Conflict,
    NotBefore,
    NotFound,
    StaleLease,
)
from towerd.protocol.methods import (
    DispatchClaimParams,
    DispatchClaimResult,
    DispatchCompleteParams,
    DispatchFailParams,
    DispatchFenceParams,
    DispatchIdParams,
    DispatchListParams,
    DispatchListResult,
    DispatchReasonParams,
    DispatchRecentParams,
    DispatchRecentResult,
    DispatchRecord,
    DispatchStuckReportParams,
    DispatchStuckReportResult,
    StuckVerdict,
    WorkerRecord,
)

ACTIVE = ("claimed", "running")
TAKEOVER_REASON = "stale-dispatch-lease-takeover"
WORKER_CRASHED_REASON = "worker-crashed"

_COLUMNS = (
    "dispatch_id, unit_type, unit_id, milestone_id, slice_id, task_id, trace_id, turn_id, "
    "worker_id, lease_resource, fencing_token, status, attempt_n, max_attempts, claimed_at, "
    "started_at, ended_at, exit_reason, error_code, error_summary, retry_after_ms, next_run_at"
)


def _record(row: tuple[Any, ...]) -> DispatchRecord:
    (dispatch_id, unit_type, unit_id, *rest) = row
    return DispatchRecord(
        dispatch_id, stuck.unit_key(unit_type, unit_id), unit_type, unit_id, *rest
    )


def load(tx: Tx, dispatch_id: int) -> DispatchRecord | None:
    row = tx.conn.execute(
        f"SELECT {_COLUMNS} FROM dispatches WHERE dispatch_id = ?", (dispatch_id,)
    ).fetchone()
    return None if row is None else _record(row)


def get(tx: Tx, caller: Caller, params: DispatchIdParams) -> DispatchRecord:
    return require(tx, params.dispatch_id)


def require(tx: Tx, dispatch_id: int) -> DispatchRecord:
    record = load(tx, dispatch_id)
    if record is None:
        raise NotFound(f"no dispatch {dispatch_id}", {"dispatch_id": dispatch_id})
    return record


def _active_of_unit(tx: Tx, unit_type: str, unit_id: str) -> DispatchRecord | None:
    row = tx.conn.execute(
        f"SELECT {_COLUMNS} FROM dispatches WHERE unit_type = ? AND unit_id = ? "
        "AND status IN ('claimed', 'running')",
        (unit_type, unit_id),
    ).fetchone()
    return None if row is None else _record(row)


# --- the fence -------------------------------------------------------------------------------


def _fence_holds(tx: Tx, worker: WorkerRecord | None, resource: str, token: int) -> bool:
    """The worker's process holds a live lease on ``resource`` under exactly ``token``."""
    if worker is None or worker.ended_at is not None or worker.status == "crashed":
        return False
    lease = leases.load(tx, resource)
    return (
        lease is not None
        and lease.token == token
        and lease.holder == workers.holder(worker)
        and lease.principal == worker.principal
        and lease.expires_at > tx.now
        and is_alive(workers.holder(worker))
    )


def _require_fence(tx: Tx, worker_id: str, resource: str, token: int) -> WorkerRecord:
    worker = workers.load(tx, worker_id)
    if _fence_holds(tx, worker, resource, token):
        assert worker is not None
        return worker
    lease = leases.load(tx, resource)
    current = (
        f"the lease is token {lease.token} held by "
        f"{leases.describe_holder(lease.principal, lease.holder)}, expiring at {lease.expires_at}"
        if lease is not None
        else "nobody holds it"
    )
    state = "not registered" if worker is None else worker.status
    raise StaleLease(
        f"worker {worker_id} ({state}) does not hold {resource} under token {token}: {current}",
        {
            "worker_id": worker_id,
            "lease_resource": resource,
            "fencing_token": token,
            "lease": None if lease is None else asdict(lease.record(tx.now)),
        },
    )


# --- claim -----------------------------------------------------------------------------------


def claim(tx: Tx, caller: Caller, params: DispatchClaimParams) -> DispatchClaimResult | Refused:
    actor = caller.actor
    worker = _require_fence(tx, params.worker_id, params.lease_resource, params.fencing_token)
    if worker.status != "active":
        raise Conflict(
            f"worker {worker.worker_id} is {worker.status}: it claims nothing new",
            {"worker": asdict(worker)},
        )
    unit_key = stuck.unit_key(params.unit_type, params.unit_id)
    existing = _active_of_unit(tx, params.unit_type, params.unit_id)
    if existing is not None:
        if _fence_holds(
            tx, workers.load(tx, existing.worker_id), existing.lease_resource,
            existing.fencing_token,
        ):  # fmt: skip
            raise AlreadyActive(
                f"{unit_key} is already {existing.status} as dispatch {existing.dispatch_id} "
                f"of worker {existing.worker_id}",
                {"dispatch": asdict(existing)},
            )
        _settle(tx, existing, "canceled", actor, caused_by=None, exit_reason=TAKEOVER_REASON,
                taken_over_by=params.worker_id)  # fmt: skip
    try:
        return _claim_unit(tx, actor, params, unit_key)
    except (AttemptsExhausted, NotBefore) as refused:
        if existing is None:
            raise
        return Refused(refused)  # the stale dispatch stays canceled: commit that, refuse this


def _claim_unit(
    tx: Tx, actor: str, params: DispatchClaimParams, unit_key: str
) -> DispatchClaimResult:
    """The retry budget, the pause, then the row itself."""
    attempts, latest = _history(tx, params.unit_type, params.unit_id)
    if attempts >= params.max_attempts:
        raise AttemptsExhausted(
            f"{unit_key} has had {attempts} attempts; max_attempts is {params.max_attempts}",
            {"unit_key": unit_key, "attempts": attempts, "max_attempts": params.max_attempts},
        )
    if latest is not None and latest.next_run_at is not None and latest.next_run_at > tx.now:
        raise NotBefore(
            f"{unit_key} may run again at {latest.next_run_at} (its last failure, dispatch "
            f"{latest.dispatch_id}, asked for {latest.retry_after_ms} ms)",
            {"unit_key": unit_key, "next_run_at": latest.next_run_at,
             "dispatch_id": latest.dispatch_id},
        )  # fmt: skip
    attempt_n = attempts + 1
    # The partial unique index has the last word on "one active": a conflict inserts
    # nothing (no error, which on PostgreSQL would abort the whole batch's transaction).
    inserted = tx.conn.execute(
        """INSERT INTO dispatches (unit_type, unit_id, milestone_id, slice_id, task_id,
               trace_id, turn_id, worker_id, lease_resource, fencing_token, status,
               attempt_n, max_attempts, claimed_at)
           VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 'claimed', ?, ?, ?)
           ON CONFLICT DO NOTHING RETURNING dispatch_id""",
        (params.unit_type, params.unit_id, params.milestone_id, params.slice_id,
         params.task_id, params.trace_id, params.turn_id, params.worker_id,
         params.lease_resource, params.fencing_token, attempt_n, params.max_attempts,
         tx.now),
    ).fetchone()  # fmt: skip
    if inserted is None:
        active = _active_of_unit(tx, params.unit_type, params.unit_id)
        raise AlreadyActive(
            f"{unit_key} is already active",
            {"dispatch": None if active is None else asdict(active)},
        )
    (dispatch_id,) = inserted
    audit.record(
        tx, "dispatch", "dispatch-claimed",
        {"dispatch_id": dispatch_id, "unit_key": unit_key, "worker_id": params.worker_id,
         "lease_resource": params.lease_resource, "fencing_token": params.fencing_token,
         "attempt_n": attempt_n, "max_attempts": params.max_attempts},
        actor=actor, trace_id=params.trace_id, turn_id=params.turn_id,
    )  # fmt: skip
    return DispatchClaimResult(dispatch_id=dispatch_id, attempt_n=attempt_n)


def _history(tx: Tx, unit_type: str, unit_id: str) -> tuple[int, DispatchRecord | None]:
    """How many rows the unit has (every claim counts), and its latest one."""
    (count,) = tx.conn.execute(
        "SELECT count(*) FROM dispatches WHERE unit_type = ? AND unit_id = ?",
        (unit_type, unit_id),
    ).fetchone()
    row = tx.conn.execute(
        f"SELECT {_COLUMNS} FROM dispatches WHERE unit_type = ? AND unit_id = ? "
        "ORDER BY dispatch_id DESC LIMIT 1",
        (unit_type, unit_id),
    ).fetchone()
    return count, None if row is None else _record(row)


# --- transitions -----------------------------------------------------------------------------


def _settle(
    tx: Tx,
    record: DispatchRecord,
    status: str,
    actor: str,
    caused_by: str | None,
    **columns: Any,
) -> None:
    """Move an active row to ``status`` (terminal unless ``running``), with its event."""
    details = {key: value for key, value in columns.items() if key not in _SETTABLE}
    columns = {key: value for key, value in columns.items() if key in _SETTABLE}
    if status == "running":
        columns["started_at"] = tx.now
    else:
        columns["ended_at"] = tx.now
    assignments = ", ".join(f"{name} = ?" for name in ("status", *columns))
    tx.conn.execute(
        f"UPDATE dispatches SET {assignments} WHERE dispatch_id = ?",
        (status, *columns.values(), record.dispatch_id),
    )
    audit.record(
        tx, "dispatch", f"dispatch-{status}",
        {"dispatch_id": record.dispatch_id, "unit_key": record.unit_key,
         "worker_id": record.worker_id, "from": record.status,
         **{k: v for k, v in columns.items() if k not in ("started_at", "ended_at")}, **details},
        actor=actor, trace_id=record.trace_id, turn_id=record.turn_id, caused_by=caused_by,
    )  # fmt: skip


_SETTABLE = frozenset(
    {"exit_reason", "error_code", "error_summary", "retry_after_ms", "next_run_at"}
)


def transition(
    tx: Tx,
    actor: str,
    dispatch_id: int,
    worker_id: str,
    token: int,
    status: str,
    **columns: Any,
) -> DispatchRecord:
    """start (claimed -> running) or settle (claimed/running -> ``status``), fenced.

    Repeating the transition that already happened (a reply lost on the way) answers
    the row as it is; any other move out of a settled row is ``conflict``.
    """
    record = require(tx, dispatch_id)
    if record.worker_id != worker_id or record.fencing_token != token:
        raise StaleLease(
            f"dispatch {dispatch_id} belongs to worker {record.worker_id} under token "
            f"{record.fencing_token}, not worker {worker_id} under token {token}",
            {"dispatch": asdict(record), "worker_id": worker_id, "fencing_token": token},
        )
    if record.status == status:
        return record
    allowed = ("claimed",) if status == "running" else ACTIVE
    if record.status not in allowed:
        raise Conflict(
            f"dispatch {dispatch_id} is {record.status}; it cannot become {status} "
            f"(only from {' or '.join(allowed)}; a retry is a new claim)",
            {"dispatch": asdict(record)},
        )
    _require_fence(tx, worker_id, record.lease_resource, token)
    if status == "failed" and columns.get("retry_after_ms") is not None:
        columns["next_run_at"] = tx.now + columns["retry_after_ms"]
    _settle(tx, record, status, actor, caused_by=None, **columns)
    return require(tx, dispatch_id)


def _fenced(tx: Tx, caller: Caller, params: Any, status: str, **columns: Any) -> DispatchRecord:
    return transition(tx, caller.actor, params.dispatch_id, params.worker_id,
                      params.fencing_token, status, **columns)  # fmt: skip


def start(tx: Tx, caller: Caller, params: DispatchFenceParams) -> DispatchRecord:
    return _fenced(tx, caller, params, "running")


def complete(tx: Tx, caller: Caller, params: DispatchCompleteParams) -> DispatchRecord:
    return _fenced(tx, caller, params, "completed", exit_reason=params.exit_reason)


def fail(tx: Tx, caller: Caller, params: DispatchFailParams) -> DispatchRecord:
    return _fenced(tx, caller, params, "failed", error_code=params.error_code,
                   error_summary=params.error_summary,
                   retry_after_ms=params.retry_after_ms)  # fmt: skip


def mark_stuck(tx: Tx, caller: Caller, params: DispatchReasonParams) -> DispatchRecord:
    return _fenced(tx, caller, params, "stuck", exit_reason=params.reason)


def pause(tx: Tx, caller: Caller, params: DispatchFenceParams) -> DispatchRecord:
    return _fenced(tx, caller, params, "paused")


def cancel(tx: Tx, caller: Caller, params: DispatchReasonParams) -> DispatchRecord:
    return _fenced(tx, caller, params, "canceled", exit_reason=params.reason)


def cancel_for_worker(tx: Tx, worker_id: str, reason: str, caused_by: str) -> list[int]:
    """Settle a dead worker's active dispatches: ``canceled`` with ``reason``."""
    rows = tx.conn.execute(
        f"SELECT {_COLUMNS} FROM dispatches WHERE worker_id = ? "
        "AND status IN ('claimed', 'running') ORDER BY dispatch_id",
        (worker_id,),
    ).fetchall()
    for record in map(_record, rows):
        _settle(tx, record, "canceled", audit.DAEMON_ACTOR, caused_by, exit_reason=reason)
    return [row[0] for row in rows]


# --- queries ---------------------------------------------------------------------------------


def list_dispatches(tx: Tx, caller: Caller, params: DispatchListParams) -> DispatchListResult:
    """The most recent ``limit`` matching rows, oldest first; cut to fit a frame keeping
    the most recent (flagged ``truncated``)."""
    clause, args = where(
        unit_type=params.unit_type,
        unit_id=params.unit_id,
        milestone_id=params.milestone_id,
        status=params.status,
        worker_id=params.worker_id,
    )
    rows = tx.conn.execute(
        f"SELECT {_COLUMNS} FROM dispatches {clause} ORDER BY dispatch_id DESC LIMIT ?",
        (*args, params.limit),
    ).fetchall()
    listed = DispatchListResult(dispatches=[_record(row) for row in reversed(rows)])
    return fitted(listed, tx.config.page_bytes, keep="last")


def _recent_rows(
    tx: Tx, worker_id: str | None, project_root: str | None, limit: int
) -> list[tuple[Any, ...]]:
    """The most recent dispatches of a worker or a project, oldest first (in claim
    order, as ``dispatch.list``: row ids never step back as a wall clock can); crashed
    workers' rows are left out (a crash is not the loop's choice of work)."""
    import os

    if worker_id is not None:
        condition, arg = "w.worker_id = ?", worker_id
    else:
        condition, arg = "w.project_root = ?", os.path.realpath(project_root or "/")
    rows = tx.conn.execute(
        f"""SELECT d.unit_type, d.unit_id, d.status, d.error_code, d.error_summary
            FROM dispatches d JOIN workers w ON w.worker_id = d.worker_id
            WHERE {condition} AND w.status != 'crashed'
            ORDER BY d.dispatch_id DESC LIMIT ?""",
        (arg, limit),
    ).fetchall()
    rows.reverse()
    return rows


def recent_unit_keys(tx: Tx, caller: Caller, params: DispatchRecentParams) -> DispatchRecentResult:
    rows = _recent_rows(tx, params.worker_id, params.project_root, params.limit)
    return DispatchRecentResult(unit_keys=[stuck.unit_key(row[0], row[1]) for row in rows])


def stuck_report(
    tx: Tx, caller: Caller, params: DispatchStuckReportParams
) -> DispatchStuckReportResult:
    rows = _recent_rows(tx, None, params.project_root, params.window)
    attempts = [
        stuck.Attempt(stuck.unit_key(unit_type, unit_id), status, error_code, error_summary)
        for unit_type, unit_id, status, error_code, error_summary in rows
    ]
    budgets = {}
    for unit_type, unit_id in {(row[0], row[1]) for row in rows}:
        count, latest = _history(tx, unit_type, unit_id)
        assert latest is not None
        budgets[latest.unit_key] = stuck.UnitBudget(count, latest.max_attempts, latest.next_run_at)
    report = stuck.evaluate(attempts, budgets, tx.now)

    def verdict(found: stuck.Verdict) -> StuckVerdict:
        return StuckVerdict(found.rule, found.unit_key, found.reason)

    return DispatchStuckReportResult(
        stuck=report.verdict is not None,
        verdict=None if report.verdict is None else verdict(report.verdict),
        suppressed=[verdict(found) for found in report.suppressed],
        window=[attempt.unit_key for attempt in attempts],
    )


def prune(tx: Tx, cutoff: int) -> int:
    """Settled rows that ended before ``cutoff``; active rows, and failed rows whose
    ``next_run_at`` is still ahead (they enforce ``not_before``), are never touched."""
    return tx.conn.execute(
        "DELETE FROM dispatches WHERE ended_at IS NOT NULL AND ended_at < ? "
        "AND status NOT IN ('claimed', 'running') "
        "AND (next_run_at IS NULL OR next_run_at <= ?)",  # a pause still running stays
        (cutoff, tx.now),
    ).rowcount
