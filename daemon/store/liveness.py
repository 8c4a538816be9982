"""What dies with a process: the keys it held turn unknown (or complete from evidence),
its leases are released at once (an agent's path leases too, and its sessions are no
longer live), its shared in-flight effects are parked uncertain,
and a worker it ran is ended with its active dispatches canceled. Effects that went
silent past their timeout are parked the same way, and workers whose heartbeat is
older than the worker TTL are reaped as crashed though their process may live."""

from __future__ import annotations

from dataclasses import dataclass, field

from towerd.daemon.processes import Holder
from towerd.daemon.store import dispatches, effects, fleet, idempotency, leases, workers
from towerd.daemon.store.reconcile import settle_dead_holders
from towerd.daemon.store.tx import Tx, own_box
from towerd.protocol.methods import DEFAULT_WORKER_TTL_MS


@dataclass
class LivenessReport:
    keys_unknown: list[tuple[str, str, str]] = field(default_factory=list)
    keys_completed: list[tuple[str, str, str]] = field(default_factory=list)
    leases_released: list[str] = field(default_factory=list)
    effects_parked: list[str] = field(default_factory=list)
    workers_ended: list[workers.Ended] = field(default_factory=list)
    dispatches_canceled: list[int] = field(default_factory=list)
    sessions_gone: list[str] = field(default_factory=list)  # their agent process died


def to_check(tx: Tx, worker_ttl_ms: int = DEFAULT_WORKER_TTL_MS) -> tuple[list[Holder], bool]:
    """Every process holding something, and whether some in-flight effect or some
    worker went silent."""
    holders = {
        *idempotency.live_holders(tx),
        *leases.holders(tx),
        *effects.holders(tx),
        *workers.open_holders(tx),
        *fleet.agent_holders(tx),
    }
    box, args = own_box(tx)
    silent = tx.conn.execute(
        f"""SELECT 1 FROM effects WHERE status = 'in_flight' AND heartbeat_at + timeout_ms <= ?
           AND action_kind NOT IN ('git-branch', 'git-commit'){box} LIMIT 1""",
        (tx.now, *args),
    ).fetchone()
    silent_worker = workers.any_silent(tx, worker_ttl_ms)
    return sorted(holders, key=lambda h: (h.pid, h.start)), silent is not None or silent_worker


def settle(
    tx: Tx, dead: list[Holder], worker_ttl_ms: int = DEFAULT_WORKER_TTL_MS
) -> LivenessReport:
    # Workers first, so the leases they lose are logged as caused by their end.
    ended = workers.end_dead(tx, dead, worker_ttl_ms)
    leases_released: list[str] = []
    canceled: list[int] = []
    for end in ended:
        leases_released += leases.release_held_by(
            tx, workers.holder(end.worker), "worker-ended", caused_by=end.event_id
        )
        canceled += dispatches.cancel_for_worker(
            tx, end.worker.worker_id, dispatches.WORKER_CRASHED_REASON
            if end.worker.status == "crashed" else "worker-exited", end.event_id,
        )  # fmt: skip
    keys = settle_dead_holders(tx, dead)
    return LivenessReport(
        workers_ended=ended,
        dispatches_canceled=canceled,
        keys_unknown=keys.unknown,
        keys_completed=keys.completed,
        leases_released=leases_released + leases.release_dead_holders(tx, dead),
        effects_parked=effects.park_stale(tx, dead),
        sessions_gone=fleet.agents_gone(tx, dead),
    )
