"""Counts for the ``status`` method, read in one snapshot."""

from __future__ import annotations

from towerd.daemon.store import fleet, idempotency
from towerd.daemon.store.tx import Tx
from towerd.protocol.methods import KeyCounts


def status_counts(tx: Tx) -> tuple[int, KeyCounts]:
    tx.conn.execute("BEGIN")
    try:
        return fleet.count_sessions(tx), idempotency.count_by_state(tx)
    finally:
        tx.conn.execute("COMMIT")
