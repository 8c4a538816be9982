"""Retention: history older than the retention age goes; what is still active stays.

Audit events, settled dispatches and ended workers are pruned by age (default
30 days); hook events by age (default 30 days) and by count, keeping the newest
``events_per_session`` (default 5000) of each session and the newest
``events_per_principal`` (default 100,000) of each principal. An active dispatch, a
live worker, or a worker some remaining dispatch row still names, is never
pruned. Pruning a unit's old rows gives it a fresh attempt budget:
``max_attempts`` counts the rows that remain.

The rows clients create go too (:func:`prune_client_rows`, in bounded batches):
messages older than ``--message-retention-days``, effects settled (committed,
failed, aborted) longer than ``--effect-retention-days`` (never an in-flight or
uncertain one), lease rows that lapsed over an hour ago, and the token records of
resources nothing uses any more (under the token floor: daemon/store/leases.py).

What is deleted only becomes free pages inside the file; :func:`vacuum_step` hands
them back to the file system a bounded number at a time (the file is in
``auto_vacuum = INCREMENTAL``: daemon/store/schema.py), so no step holds the writer
long.
"""

from __future__ import annotations

from towerd.daemon.store import (
    audit,
    dispatches,
    effects,
    events,
    leases,
    messages,
    schema,
    workers,
)
from towerd.daemon.store.tx import Tx

DEFAULT_RETENTION_MS = 30 * 24 * 60 * 60 * 1000
LAPSED_LEASE_GRACE_MS = 60 * 60 * 1000  # a late renew hears lease_expired this long
PRUNE_BATCH = 5000  # rows per table per prune_client_rows call
VACUUM_STEP_PAGES = 2048  # pages returned per vacuum_step (8 MiB at 4 KiB pages, ~20 ms)


def prune_history(
    tx: Tx,
    retention_ms: int,
    event_retention_ms: int = DEFAULT_RETENTION_MS,
    events_per_session: int = 5000,
    events_per_principal: int | None = None,
) -> dict[str, int]:
    cutoff = tx.now - retention_ms
    return {
        "audit_events": audit.prune(tx, cutoff),
        "dispatches": dispatches.prune(tx, cutoff),
        "workers": workers.prune(tx, cutoff),
        "hook_events": events.prune(
            tx, tx.now - event_retention_ms, events_per_session, events_per_principal
        ),
    }


def prune_client_rows(
    tx: Tx,
    message_retention_ms: int,
    effect_retention_ms: int,
    lease_grace_ms: int = LAPSED_LEASE_GRACE_MS,
    batch: int = PRUNE_BATCH,
) -> dict[str, int]:
    """One batch (at most ``batch`` rows of each table); call again while
    :func:`more_to_prune` says a table filled its batch."""
    return {
        "messages": messages.prune(tx, tx.now - message_retention_ms, batch),
        "effects": effects.prune_settled(tx, tx.now - effect_retention_ms, batch),
        # Lapsed leases before tokens: a resource whose lease goes now frees its token too.
        "leases": leases.prune_lapsed(tx, tx.now - lease_grace_ms, batch),
        "lease_tokens": leases.prune_tokens(tx, batch),
    }


def more_to_prune(pruned: dict[str, int], batch: int = PRUNE_BATCH) -> bool:
    return any(count >= batch for count in pruned.values())


def vacuum_step(tx: Tx, max_pages: int = VACUUM_STEP_PAGES) -> int:
    """Return up to ``max_pages`` free pages to the file system; how many were returned
    (0 when none are free, or the file is not in incremental mode). The file shrinks on
    disk at the next checkpoint of the WAL."""
    if tx.conn.execute("PRAGMA auto_vacuum").fetchone()[0] != schema.AUTO_VACUUM_INCREMENTAL:
        return 0  # its switch was deferred for lack of space (schema.use_incremental_vacuum)
    free = tx.conn.execute("PRAGMA freelist_count").fetchone()[0]
    if free == 0:
        return 0
    for _ in range(min(free, max_pages)):
        # One page per statement: Python's sqlite3 steps a PRAGMA without result columns
        # only once, and each step of incremental_vacuum frees one page.
        tx.conn.execute("PRAGMA incremental_vacuum(1)")
    return free - tx.conn.execute("PRAGMA freelist_count").fetchone()[0]
