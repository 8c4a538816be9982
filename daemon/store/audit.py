"""The audit log: one event per state change of a worker, a lease or a dispatch,
written by the store function that makes the change, in the same transaction.

So the log and the rows can never disagree: a change that rolls back takes its
event with it, and a committed change always has one. Lease renewals and worker
heartbeats are not logged: they only move a deadline, and a fleet heartbeating
every few seconds would bury the changes that matter.
"""

from __future__ import annotations

from typing import Any

from towerd.daemon.store.ids import random_uuid
from towerd.daemon.store.tx import Caller, Tx, note, pack, take_page, unpack, where
from towerd.protocol.fields import AUDIT_CATEGORIES
from towerd.protocol.fields import WATCH_TOPICS as ALL_TOPICS
from towerd.protocol.methods import AuditEvent, AuditListParams, AuditListResult

DAEMON_ACTOR = "daemon"  # the daemon's own upkeep: reaping, retention


def record(
    tx: Tx,
    category: str,
    type: str,
    payload: dict[str, Any],
    *,
    actor: str = DAEMON_ACTOR,
    trace_id: str | None = None,
    turn_id: str | None = None,
    caused_by: str | None = None,
    event_id: str | None = None,
) -> str:
    """Append one event (idempotent by ``event_id``); returns its id, for ``caused_by``."""
    event_id = event_id or random_uuid()
    tx.conn.execute(
        """INSERT INTO audit_events
               (event_id, trace_id, turn_id, caused_by, category, type, ts, actor, payload)
           VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)
           ON CONFLICT (event_id) DO NOTHING""",
        (event_id, trace_id, turn_id, caused_by, category, type, tx.now, actor, pack(payload)),
    )
    note(tx, WATCH_TOPICS[category], {"type": type, "at": tx.now, **payload})
    return event_id


WATCH_TOPICS = {"lease": "leases", "worker": "dispatch", "dispatch": "dispatch"}
assert WATCH_TOPICS.keys() == set(AUDIT_CATEGORIES) and set(WATCH_TOPICS.values()) <= set(
    ALL_TOPICS
)


_COLUMNS = "seq, event_id, trace_id, turn_id, caused_by, category, type, ts, actor, payload"


def list_events(tx: Tx, caller: Caller, params: AuditListParams) -> AuditListResult:
    """Newest first, paged by ``seq``: ``next_before`` continues where a page ended."""
    before, limit, byte_budget = params.before, params.limit, tx.config.page_bytes
    clause, args = where(
        ("seq < ?", before if before is not None else 2**63 - 1),
        category=params.category,
        type=params.type,
        trace_id=params.trace_id,
    )
    rows = tx.conn.execute(
        f"SELECT {_COLUMNS} FROM audit_events {clause} ORDER BY seq DESC LIMIT ?",
        (*args, limit + 1),
    ).fetchall()
    events = [(row[0], AuditEvent(*row[:9], payload=unpack(row[9]))) for row in rows]  # type: ignore[misc]
    page, next_before = take_page(events, limit, byte_budget)
    return AuditListResult(events=page, next_before=next_before)


def prune(tx: Tx, cutoff: int) -> int:
    return tx.conn.execute("DELETE FROM audit_events WHERE ts < ?", (cutoff,)).rowcount
