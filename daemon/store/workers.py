"""The worker registry: which processes run an autonomous loop, and are they alive.

A worker is the process that registered it (pid plus start time, so a reused
pid is not it); every lease that process holds, over any of its connections,
is the worker's. A worker is dead when its heartbeat is older than the TTL or
its process is gone; ``liveness.settle`` then ends it here, releases its leases
and settles its active dispatches, in one transaction.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

from msgspec.structs import asdict

from towerd.daemon.processes import Holder
from towerd.daemon.store import audit
from towerd.daemon.store.leases import describe_holder
from towerd.daemon.store.tx import Caller, Tx, fitted, own_box, where
from towerd.protocol.errors import BadArgs, Conflict, NotFound
from towerd.protocol.methods import (
    WorkerIdParams,
    WorkerListParams,
    WorkerListResult,
    WorkerRecord,
    WorkerRegisterParams,
    WorkerRegisterResult,
)

_COLUMNS = (
    "worker_id, principal, host, pid, process_start, version, project_root, status, "
    "registered_at, heartbeat_at, ended_at, end_reason"
)


def _record(row: tuple[object, ...]) -> WorkerRecord:
    return WorkerRecord(*row)  # type: ignore[arg-type]  # the columns are its fields, in order


def load(tx: Tx, worker_id: str) -> WorkerRecord | None:
    row = tx.conn.execute(
        f"SELECT {_COLUMNS} FROM workers WHERE worker_id = ?", (worker_id,)
    ).fetchone()
    return None if row is None else _record(row)


def require(tx: Tx, worker_id: str) -> WorkerRecord:
    worker = load(tx, worker_id)
    if worker is None:
        raise NotFound(
            f"no worker {worker_id}; register with worker.register", {"worker_id": worker_id}
        )
    return worker


def holder(worker: WorkerRecord) -> Holder:
    return Holder(worker.pid, worker.process_start)


def register(tx: Tx, caller: Caller, params: WorkerRegisterParams) -> WorkerRegisterResult:
    """The calling process becomes a worker; a retried register answers the same one."""
    principal, process, project_root, version = (
        caller.principal, caller.holder, params.project_root, params.version
    )  # fmt: skip
    host, ttl_ms = tx.config.host, tx.config.worker_ttl_ms
    if process is None:
        raise BadArgs("the daemon could not identify your process; a worker needs one")
    root = os.path.realpath(project_root)
    row = tx.conn.execute(
        "SELECT worker_id FROM workers WHERE pid = ? AND process_start = ? AND ended_at IS NULL",
        (process.pid, process.start),
    ).fetchone()
    if row is not None:
        existing = require(tx, row[0])
        if existing.status != "active" or existing.project_root != root:
            raise Conflict(
                f"this process is already worker {existing.worker_id} ({existing.status}, "
                f"project {existing.project_root}); one worker per process",
                {"worker": asdict(existing)},
            )
        tx.conn.execute(
            "UPDATE workers SET heartbeat_at = ? WHERE worker_id = ?", (tx.now, existing.worker_id)
        )
        return WorkerRegisterResult(existing.worker_id, ttl_ms, existing=True)
    worker_id = "wrk_" + os.urandom(8).hex()
    tx.conn.execute(
        f"""INSERT INTO workers ({_COLUMNS}, daemon_id)
            VALUES (?, ?, ?, ?, ?, ?, ?, 'active', ?, ?, NULL, NULL, ?)""",
        (worker_id, principal, host, process.pid, process.start, version, root, tx.now, tx.now,
         tx.daemon_id),
    )  # fmt: skip
    audit.record(
        tx, "worker", "worker-registered",
        {"worker_id": worker_id, "pid": process.pid, "project_root": root, "version": version,
         "host": host},
        actor=describe_holder(principal, process), trace_id=worker_id,
    )  # fmt: skip
    return WorkerRegisterResult(worker_id, ttl_ms)


def _require_open(worker: WorkerRecord, *allowed: str) -> None:
    if worker.status not in allowed or worker.ended_at is not None:
        raise Conflict(
            f"worker {worker.worker_id} is {worker.status}"
            + (f" ({worker.end_reason})" if worker.end_reason else "")
            + "; register again for a new worker",
            {"worker": asdict(worker)},
        )


def heartbeat(tx: Tx, caller: Caller, params: WorkerIdParams) -> WorkerRecord:
    worker_id = params.worker_id
    worker = require(tx, worker_id)
    _require_open(worker, "active", "stopping")
    tx.conn.execute("UPDATE workers SET heartbeat_at = ? WHERE worker_id = ?", (tx.now, worker_id))
    return require(tx, worker_id)


def stopping(tx: Tx, caller: Caller, params: WorkerIdParams) -> WorkerRecord:
    """The worker winds down: it settles what it has and claims nothing new."""
    principal, process, worker_id = caller.principal, caller.holder, params.worker_id
    worker = require(tx, worker_id)
    if worker.status == "stopping" and worker.ended_at is None:
        return worker
    _require_open(worker, "active")
    tx.conn.execute(
        "UPDATE workers SET status = 'stopping', heartbeat_at = ? WHERE worker_id = ?",
        (tx.now, worker_id),
    )
    audit.record(
        tx, "worker", "worker-stopping", {"worker_id": worker_id},
        actor=describe_holder(principal, process), trace_id=worker_id,
    )  # fmt: skip
    return require(tx, worker_id)


def list_workers(tx: Tx, caller: Caller, params: WorkerListParams) -> WorkerListResult:
    """Workers by status or project, cut to fit a frame (flagged ``truncated``)."""
    project_root = params.project_root
    clause, args = where(
        status=params.status,
        project_root=None if project_root is None else os.path.realpath(project_root),
    )
    rows = tx.conn.execute(
        f"SELECT {_COLUMNS} FROM workers {clause} ORDER BY registered_at, worker_id",
        args,
    ).fetchall()
    listed = WorkerListResult(workers=[_record(row) for row in rows])
    return fitted(listed, tx.config.page_bytes)


# --- liveness ----------------------------------------------------------------------------


def open_holders(tx: Tx) -> list[Holder]:
    """The processes of workers not yet ended: the liveness sweep checks them."""
    box, args = own_box(tx)
    return [
        Holder(pid, start)
        for pid, start in tx.conn.execute(
            f"SELECT pid, process_start FROM workers WHERE ended_at IS NULL{box}", args
        )
    ]


def any_silent(tx: Tx, ttl_ms: int) -> bool:
    box, args = own_box(tx)
    return (
        tx.conn.execute(
            f"SELECT 1 FROM workers WHERE ended_at IS NULL AND heartbeat_at + ? <= ?{box} LIMIT 1",
            (ttl_ms, tx.now, *args),
        ).fetchone()
        is not None
    )


@dataclass(frozen=True, slots=True)
class Ended:
    worker: WorkerRecord
    event_id: str  # the worker-crashed / worker-exited event: what caused the cleanup


def end_dead(tx: Tx, dead: Iterable[Holder], ttl_ms: int) -> list[Ended]:
    """End every worker whose process is gone or whose heartbeat is older than the TTL.

    A worker becomes ``crashed``, except one that said ``worker.stopping`` and whose
    process then exited: it keeps that status and is ended with ``process-exited``.
    The caller releases their leases and settles their dispatches in the same
    transaction.
    """
    gone = set(dead)
    box, args = own_box(tx)
    rows = tx.conn.execute(
        f"SELECT {_COLUMNS} FROM workers WHERE ended_at IS NULL{box} ORDER BY registered_at",
        args,
    ).fetchall()
    ended: list[Ended] = []
    for worker in map(_record, rows):
        if holder(worker) in gone:
            reason = "process-exited" if worker.status == "stopping" else "process-gone"
        elif worker.heartbeat_at + ttl_ms <= tx.now:
            reason = "heartbeat-timeout"  # alive but silent: hung, even while stopping
        else:
            continue
        status = "stopping" if reason == "process-exited" else "crashed"
        tx.conn.execute(
            "UPDATE workers SET status = ?, ended_at = ?, end_reason = ? WHERE worker_id = ?",
            (status, tx.now, reason, worker.worker_id),
        )
        event_id = audit.record(
            tx, "worker", "worker-crashed" if status == "crashed" else "worker-exited",
            {"worker_id": worker.worker_id, "pid": worker.pid, "reason": reason,
             "heartbeat_at": worker.heartbeat_at},
            trace_id=worker.worker_id,
        )  # fmt: skip
        ended.append(Ended(require(tx, worker.worker_id), event_id))
    return ended


def prune(tx: Tx, cutoff: int) -> int:
    """Ended workers older than ``cutoff`` that no dispatch row names any more."""
    return tx.conn.execute(
        """DELETE FROM workers WHERE ended_at IS NOT NULL AND ended_at < ?
           AND NOT EXISTS (SELECT 1 FROM dispatches d WHERE d.worker_id = workers.worker_id)""",
        (cutoff,),
    ).rowcount
