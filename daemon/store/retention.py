"""Retention: history older than the retention age goes; what is still active stays.

Audit events, settled dispatches and ended workers are pruned by age (default
30 days); hook events by age (default 30 days) and by count, keeping the newest
``events_per_session`` (default 5000) of each session. An active dispatch, a
live worker, or a worker some remaining dispatch row still names, is never
pruned. Pruning a unit's old rows gives it a fresh attempt budget:
``max_attempts`` counts the rows that remain.
"""

from __future__ import annotations

from towerd.daemon.store import audit, dispatches, events, workers
from towerd.daemon.store.tx import Tx

DEFAULT_RETENTION_MS = 30 * 24 * 60 * 60 * 1000


def prune_history(
    tx: Tx,
    retention_ms: int,
    event_retention_ms: int = DEFAULT_RETENTION_MS,
    events_per_session: int = 5000,
) -> dict[str, int]:
    cutoff = tx.now - retention_ms
    return {
        "audit_events": audit.prune(tx, cutoff),
        "dispatches": dispatches.prune(tx, cutoff),
        "workers": workers.prune(tx, cutoff),
        "hook_events": events.prune(tx, tx.now - event_retention_ms, events_per_session),
    }
