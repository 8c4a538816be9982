"""Background upkeep: what dead processes held is settled (keys unknown or completed
from evidence, leases released, shared effects parked); silent effects are parked;
old completed keys expire; the WAL is truncated when it has grown.

A key's holder is a process (pid + start time), not a connection: a claim
whose connection closed while its holder lives stays ``in_progress``. The
sweep runs every ``interval`` seconds and also at once when a connection of a
known holder closes, so a killed claimant's key turns ``outcome_unknown``
within about a second.
"""

from __future__ import annotations

import anyio
import structlog

from towerd.daemon.processes import is_alive
from towerd.daemon.store import Store, idempotency, liveness, retention, upkeep
from towerd.daemon.store.idempotency import Holder

log = structlog.get_logger("towerd.maintenance")


class HolderSweep:
    def __init__(self, store: Store, interval: float) -> None:
        self.store = store
        self.interval = interval
        self._wakeup = anyio.Event()

    # A process that closes its socket and then exits is still alive at the first
    # sweep; one more sweep this soon after catches it without waiting a full interval.
    RECHECK_AFTER_DISCONNECT = 0.25

    def poke(self, _holder: Holder | None = None) -> None:
        """Sweep soon (a holder's connection closed)."""
        self._wakeup.set()

    async def run(self) -> None:
        recheck = False
        while True:
            wait = min(self.interval, self.RECHECK_AFTER_DISCONNECT) if recheck else self.interval
            with anyio.move_on_after(wait):
                await self._wakeup.wait()
            poked = self._wakeup.is_set()
            self._wakeup = anyio.Event()
            await self.sweep_once()
            recheck = poked

    async def sweep_once(self) -> int:
        ttl = self.store.config.worker_ttl_ms
        holders, silent = await self.store.read(liveness.to_check, ttl)
        dead = [holder for holder in holders if not is_alive(holder)]
        if not dead and not silent:
            return 0  # nothing to write: no commit, no fsync
        report = await self.store.write(liveness.settle, dead, ttl)
        for end in report.workers_ended:
            log.warning(
                "worker_ended",
                code="worker_crashed" if end.worker.status == "crashed" else "worker_exited",
                worker_id=end.worker.worker_id,
                pid=end.worker.pid,
                reason=end.worker.end_reason,
            )
        for dispatch_id in report.dispatches_canceled:
            log.warning("dispatch_canceled_worker_ended", dispatch_id=dispatch_id)
        for principal, operation, key in report.keys_unknown:
            log.warning(
                "holder_died",
                code="outcome_unknown",
                principal=principal,
                operation=operation,
                key=key,
            )
        for principal, operation, key in report.keys_completed:
            log.info("holder_died_after_effect", principal=principal, operation=operation, key=key)
        for resource in report.leases_released:
            log.info("lease_released_holder_died", resource=resource)
        for effect_key in report.effects_parked:
            log.warning("effect_parked", code="effect_uncertain", effect_key=effect_key)
        return (
            len(report.keys_unknown)
            + len(report.keys_completed)
            + len(report.leases_released)
            + len(report.effects_parked)
            + len(report.workers_ended)
        )


async def expire_periodically(store: Store, interval: float) -> None:
    """Expire old completed keys, and prune the audit log, settled dispatches and ended
    workers past the retention age (never a row that is still active)."""
    while True:
        await anyio.sleep(interval)
        expired = await store.write(idempotency.expire_completed, store.config.completed_ttl_ms)
        if expired:
            log.info("keys_expired", count=expired)
        config = store.config
        pruned = await store.write(
            retention.prune_history,
            config.retention_ms,
            config.event_retention_ms,
            config.events_per_session,
        )
        if any(pruned.values()):
            log.info("history_pruned", **pruned)


CHECKPOINT_MIN_WAL_BYTES = 4 * 1024 * 1024


async def checkpoint_periodically(store: Store, interval: float) -> None:
    """Keep the WAL from growing without bound: SQLite's automatic checkpoints cannot
    shrink the file, and cannot get past a long reader at all; a truncating checkpoint
    once the reader is gone returns the space."""
    while True:
        await anyio.sleep(interval)
        sizes = await store.on_own_connection(upkeep.checkpoint, CHECKPOINT_MIN_WAL_BYTES)
        if sizes is not None:
            log.info("wal_checkpoint", wal_bytes_before=sizes[0], wal_bytes_after=sizes[1])
