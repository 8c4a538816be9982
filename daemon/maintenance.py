"""Background upkeep: what dead processes held is settled (keys unknown or completed
from evidence, leases released, shared effects parked); silent effects are parked;
old completed keys expire; the WAL is truncated when it has grown; the database
files and the wall clock are watched.

No failure of a background task stops the daemon: a full disk, a locked database,
running out of file descriptors are logged with their code, counted (``status``,
``doctor``), and the task retries with backoff (:class:`Upkeep`).

A key's holder is a process (pid + start time), not a connection: a claim
whose connection closed while its holder lives stays ``in_progress``. The
sweep runs every ``interval`` seconds and also at once when a connection of a
known holder closes, so a killed claimant's key turns ``outcome_unknown``
within about a second.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import structlog

from towerd.daemon.clock import StepDetector
from towerd.daemon.processes import Holder, is_alive
from towerd.daemon.store import Store, idempotency, liveness, retention
from towerd.daemon.store import clock as clock_record
from towerd.daemon.store import upkeep as db_files
from towerd.daemon.store.tx import now_ms
from towerd.protocol.errors import TowerdError
from towerd.protocol.methods import UpkeepTask

log = structlog.get_logger("towerd.maintenance")

MAX_BACKOFF = 60.0  # seconds between retries of a task that keeps failing


class Upkeep:
    """Runs each step of a background task so that its failure is an incident, not the
    end of the daemon; remembers how each task is doing."""

    def __init__(self) -> None:
        self.tasks: dict[str, UpkeepTask] = {}

    def task(self, name: str) -> UpkeepTask:
        if name not in self.tasks:
            self.tasks[name] = UpkeepTask(name=name, runs=0, failures=0)
        return self.tasks[name]

    async def attempt(self, name: str, step: Callable[[], Awaitable[Any]]) -> bool:
        """Run ``step``; on failure log it with its code and return False."""
        task = self.task(name)
        try:
            await step()
        except Exception as exc:  # noqa: BLE001 - a failing task retries, the daemon serves on
            code = exc.code if isinstance(exc, TowerdError) else "internal"
            task.failures += 1
            task.last_error_code = code
            task.last_error = str(exc)[:500]
            task.last_failed_at = now_ms()
            log.error(
                "upkeep_failed",
                code=code,
                task=name,
                failures=task.failures,
                retry_in_s=self.delay(name, 1.0),
                reason=task.last_error,
                exc_info=exc if code == "internal" else None,
            )
            return False
        if task.failures:
            log.info("upkeep_recovered", task=name, after_failures=task.failures)
        task.failures = 0
        task.runs += 1
        return True

    def delay(self, name: str, interval: float) -> float:
        """``interval``, or a growing backoff while the task keeps failing."""
        failures = self.task(name).failures
        if not failures:
            return interval
        return min(max(interval, 1.0) * 2 ** (failures - 1), max(MAX_BACKOFF, interval))


class LivenessSweep:
    """What dies with a process is settled here: its keys turn unknown (or complete from
    evidence), its leases are released, its shared effects parked, a worker it ran is
    reaped with its dispatches; silent effects and workers likewise. Runs every
    ``interval`` seconds, and at once when a holder's connection closes."""

    NAME = "holder_sweep"  # its name in status.upkeep

    def __init__(self, store: Store, interval: float, upkeep: Upkeep | None = None) -> None:
        self.store = store
        self.interval = interval
        self.upkeep = upkeep or Upkeep()
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
            wait = self.upkeep.delay(self.NAME, wait)
            with anyio.move_on_after(wait):
                await self._wakeup.wait()
            poked = self._wakeup.is_set()
            self._wakeup = anyio.Event()
            await self.upkeep.attempt(self.NAME, self.sweep_once)
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
        for session_id in report.sessions_gone:
            log.info("agent_process_gone", session_id=session_id)
        return (
            len(report.keys_unknown)
            + len(report.keys_completed)
            + len(report.leases_released)
            + len(report.effects_parked)
            + len(report.workers_ended)
            + len(report.sessions_gone)
        )


async def expire_periodically(store: Store, interval: float, upkeep: Upkeep) -> None:
    """Expire old completed keys, and prune the audit log, settled dispatches and ended
    workers past the retention age (never a row that is still active)."""
    while True:
        await anyio.sleep(upkeep.delay("expiry", interval))
        await upkeep.attempt("expiry", lambda: expire_once(store))


async def expire_once(store: Store) -> None:
    """Expire, prune, then give the freed pages back to the file system. Client rows are
    pruned and pages returned in writer jobs of bounded size, so requests get in between."""
    expired = await store.write(idempotency.expire_completed, store.config.completed_ttl_ms)
    if expired:
        log.info("keys_expired", count=expired)
    config = store.config
    pruned = await store.write(
        retention.prune_history,
        config.retention_ms,
        config.event_retention_ms,
        config.events_per_session,
        config.events_per_principal,
    )
    while True:
        batch = await store.write(
            retention.prune_client_rows, config.message_retention_ms, config.effect_retention_ms
        )
        for name, count in batch.items():
            pruned[name] = pruned.get(name, 0) + count
        if not retention.more_to_prune(batch):
            break
    if any(pruned.values()):
        log.info("history_pruned", **pruned)
    if store.backend != "sqlite":
        return  # PostgreSQL's autovacuum returns the space
    returned = 0
    while step := await store.write(retention.vacuum_step):
        returned += step
    if returned:
        # In WAL mode the file itself shrinks only when a checkpoint copies the
        # truncation into it: do one now, however small the WAL (the periodic one
        # waits for 4 MiB). Busy (a reader in the way): the periodic one gets it later.
        sizes = await store.on_own_connection(db_files.checkpoint, 0)
        log.info("pages_returned", pages=returned, wal_bytes_after=sizes and sizes[1])


CHECKPOINT_MIN_WAL_BYTES = 4 * 1024 * 1024


async def checkpoint_periodically(store: Store, interval: float, upkeep: Upkeep) -> None:
    """Keep the WAL from growing without bound: SQLite's automatic checkpoints cannot
    shrink the file, and cannot get past a long reader at all; a truncating checkpoint
    once the reader is gone returns the space."""

    async def checkpoint_once() -> None:
        sizes = await store.on_own_connection(db_files.checkpoint, CHECKPOINT_MIN_WAL_BYTES)
        if sizes is not None:
            log.info("wal_checkpoint", wal_bytes_before=sizes[0], wal_bytes_after=sizes[1])

    while True:
        await anyio.sleep(upkeep.delay("checkpoint", interval))
        await upkeep.attempt("checkpoint", checkpoint_once)


HIGH_WATER_EVERY = 60.0  # seconds between records of how far towerd's clock got


async def guard_periodically(
    store: Store, steps: StepDetector, upkeep: Upkeep, interval: float = 1.0
) -> None:
    """Every ``interval`` seconds: are the database files still the ones opened (the
    store stops answering if not: see ``Store.check_files``); was the wall clock
    stepped (logged, nothing else: towerd's clock is not the wall clock); and now
    and then, record how far towerd's clock got (daemon/clock.py)."""
    last_recorded = anyio.current_time()

    async def guard_once() -> None:
        nonlocal last_recorded
        if not store.check_files():
            return
        step = steps.check()
        if step is not None:
            log.warning(
                "wall_clock_step",
                code="wall_clock_step",
                step_ms=step,
                offset_ms=steps.last_offset_ms,
                note="towerd's clock is unaffected: nothing is reaped, expired or parked",
            )
        if store.backend == "sqlite" and anyio.current_time() - last_recorded >= HIGH_WATER_EVERY:
            # (On PostgreSQL every write is on the server's clock: nothing to record.)
            await store.write(clock_record.save_high_water)
            last_recorded = anyio.current_time()

    while True:
        await anyio.sleep(upkeep.delay("guard", interval))
        await upkeep.attempt("guard", guard_once)
