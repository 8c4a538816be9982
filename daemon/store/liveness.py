"""What dies with a process: the keys it held turn unknown (or complete from evidence),
its leases are released at once, its shared in-flight effects are parked uncertain.
Effects that went silent past their timeout are parked the same way."""

from __future__ import annotations

from dataclasses import dataclass, field

from towerd.daemon.processes import Holder
from towerd.daemon.store import effects, idempotency, leases
from towerd.daemon.store.reconcile import settle_dead_holders
from towerd.daemon.store.tx import Tx


@dataclass
class LivenessReport:
    keys_unknown: list[tuple[str, str, str]] = field(default_factory=list)
    keys_completed: list[tuple[str, str, str]] = field(default_factory=list)
    leases_released: list[str] = field(default_factory=list)
    effects_parked: list[str] = field(default_factory=list)


def to_check(tx: Tx) -> tuple[list[Holder], bool]:
    """Every process holding something, and whether some in-flight effect went silent."""
    holders = {
        *idempotency.live_holders(tx),
        *leases.holders(tx),
        *effects.holders(tx),
    }
    silent = tx.conn.execute(
        """SELECT 1 FROM effects WHERE status = 'in_flight' AND heartbeat_at + timeout_ms <= ?
           AND action_kind NOT IN ('git-branch', 'git-commit') LIMIT 1""",
        (tx.now,),
    ).fetchone()
    return sorted(holders, key=lambda h: (h.pid, h.start)), silent is not None


def settle(tx: Tx, dead: list[Holder]) -> LivenessReport:
    keys = settle_dead_holders(tx, dead)
    return LivenessReport(
        keys_unknown=keys.unknown,
        keys_completed=keys.completed,
        leases_released=leases.release_dead_holders(tx, dead),
        effects_parked=effects.park_stale(tx, dead),
    )
