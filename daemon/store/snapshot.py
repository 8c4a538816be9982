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
from towerd.daemon.store.tx import DAEMON, Tx, fit
from towerd.protocol.methods import DispatchListParams, EventListParams, WorkerListParams

MAX_ITEMS = 500


def take(tx: Tx, topics: frozenset[str], byte_budget: int) -> dict[str, Any]:
    """Each topic gets an equal share of the frame; a list cut to fit says ``truncated``."""
    share = byte_budget // len(topics)
    return {topic: _BUILDERS[topic](tx, share) for topic in sorted(topics)}


def _fit(items: list[Any], budget: int) -> tuple[list[Any], bool]:
    kept, cut = fit(items[:MAX_ITEMS], budget)
    return kept, cut or len(items) > MAX_ITEMS


def _fleet(tx: Tx, budget: int) -> dict[str, Any]:
    # The rows a fleet read shows by default: this daemon's on the embedded store, every
    # box's on a shared one (whose changes reach watchers: daemon/store/pg_changes.py).
    shown = fleet.shown_box(tx, None)
    sessions, cut = _fit(fleet.list_shown(tx, None), budget * 3 // 4)
    activity = events.activity_of(tx, [row.session_id for row in sessions], shown).sessions
    return {"sessions": sessions, "activity": activity, "truncated": cut}


def _events(tx: Tx, budget: int) -> dict[str, Any]:
    return {"events": events.page(tx, EventListParams(limit=50), budget // 4).events}


def _idem(tx: Tx, budget: int) -> dict[str, Any]:
    names = (
        "principal", "operation", "key", "state", "effect_ref", "holder_pid", "updated_at",
        "probe", "probe_verdict", "probe_attempts",  # an evidence probe (daemon/probes.py)
    )  # fmt: skip
    rows = tx.conn.execute(
        f"SELECT {', '.join(names)} "
        "FROM idempotency WHERE state != 'completed' ORDER BY updated_at LIMIT ?",
        (MAX_ITEMS + 1,),
    ).fetchall()
    keys, cut = _fit([dict(zip(names, row, strict=True)) for row in rows], budget)
    return {"keys": keys, "counts": idempotency.count_by_state(tx), "truncated": cut}


def _leases(tx: Tx, budget: int) -> dict[str, Any]:
    live, cut = _fit(leases.list_live(tx), budget)
    return {"leases": live, "truncated": cut}


def _effects(tx: Tx, budget: int) -> dict[str, Any]:
    keys = tx.conn.execute(
        "SELECT effect_key FROM effects WHERE status IN ('in_flight', 'uncertain') "
        "ORDER BY claimed_at LIMIT ?",
        (MAX_ITEMS + 1,),
    ).fetchall()
    unsettled, cut = _fit([effects.record_of(tx, key) for (key,) in keys], budget)
    return {"effects": unsettled, "truncated": cut}


def _dispatch(tx: Tx, budget: int) -> dict[str, Any]:
    active = dispatches.list_dispatches(
        tx, DAEMON, DispatchListParams(status="claimed", limit=MAX_ITEMS)
    )
    running = dispatches.list_dispatches(
        tx, DAEMON, DispatchListParams(status="running", limit=MAX_ITEMS)
    )
    listed = sorted(active.dispatches + running.dispatches, key=lambda d: d.dispatch_id)
    shown, cut = _fit(listed, budget // 2)
    open_workers = [
        w
        for w in workers.list_workers(tx, DAEMON, WorkerListParams()).workers
        if w.ended_at is None
    ]
    alive, cut_workers = _fit(open_workers, budget // 2)
    return {"dispatches": shown, "workers": alive, "truncated": cut or cut_workers}


_BUILDERS = {
    "fleet": _fleet,
    "events": _events,
    "idem": _idem,
    "leases": _leases,
    "effects": _effects,
    "dispatch": _dispatch,
}
