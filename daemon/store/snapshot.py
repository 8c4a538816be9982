"""What a ``watch`` subscription sees first: the current state of each chosen topic.

Each topic's snapshot is what needs attention or is in motion, not history:
the fleet with each session's attention, the newest trail events, unsettled
idempotency keys, live leases, unsettled effects, open workers and active
dispatches. Bounded so a snapshot always fits in a frame; ``truncated`` says
when a list was cut.
"""

from __future__ import annotations

from typing import Any

from towerd.daemon.store import dispatches, effects, events, fleet, idempotency, leases, workers
from towerd.daemon.store.tx import Tx

MAX_ITEMS = 500


def take(tx: Tx, topics: frozenset[str], byte_budget: int) -> dict[str, Any]:
    return {topic: _BUILDERS[topic](tx, byte_budget) for topic in sorted(topics)}


def _fleet(tx: Tx, _budget: int) -> dict[str, Any]:
    sessions = fleet.list_all(tx)
    activity = events.activity(tx, None).sessions
    return {
        "sessions": sessions[:MAX_ITEMS],
        "activity": activity[:MAX_ITEMS],
        "truncated": len(sessions) > MAX_ITEMS,
    }


def _events(tx: Tx, budget: int) -> dict[str, Any]:
    return {"events": events.list_events(tx, None, None, None, None, 50, budget // 4).events}


def _idem(tx: Tx, _budget: int) -> dict[str, Any]:
    rows = tx.conn.execute(
        "SELECT principal, operation, key, state, effect_ref, holder_pid, updated_at "
        "FROM idempotency WHERE state != 'completed' ORDER BY updated_at LIMIT ?",
        (MAX_ITEMS + 1,),
    ).fetchall()
    names = ("principal", "operation", "key", "state", "effect_ref", "holder_pid", "updated_at")
    keys = [dict(zip(names, row, strict=True)) for row in rows[:MAX_ITEMS]]
    return {
        "keys": keys,
        "counts": idempotency.count_by_state(tx),
        "truncated": len(rows) > MAX_ITEMS,
    }


def _leases(tx: Tx, _budget: int) -> dict[str, Any]:
    return {"leases": leases.list_live(tx)[:MAX_ITEMS]}


def _effects(tx: Tx, _budget: int) -> dict[str, Any]:
    keys = tx.conn.execute(
        "SELECT effect_key FROM effects WHERE status IN ('in_flight', 'uncertain') "
        "ORDER BY claimed_at LIMIT ?",
        (MAX_ITEMS,),
    ).fetchall()
    return {"effects": [effects.get(tx, key) for (key,) in keys]}


def _dispatch(tx: Tx, _budget: int) -> dict[str, Any]:
    active = dispatches.list_dispatches(tx, None, None, None, "claimed", None, MAX_ITEMS)
    running = dispatches.list_dispatches(tx, None, None, None, "running", None, MAX_ITEMS)
    open_workers = [w for w in workers.list_workers(tx, None, None).workers if w.ended_at is None]
    return {
        "dispatches": sorted(active.dispatches + running.dispatches, key=lambda d: d.dispatch_id),
        "workers": open_workers[:MAX_ITEMS],
    }


_BUILDERS = {
    "fleet": _fleet,
    "events": _events,
    "idem": _idem,
    "leases": _leases,
    "effects": _effects,
    "dispatch": _dispatch,
}
