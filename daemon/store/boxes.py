"""The boxes of a store: every daemon id that ever registered in it (its ``daemons`` row),
with what its presence says about it.

On a store several boxes share (PostgreSQL), each daemon heartbeats its row's
``presence_at`` and a live one declares a box silent past the presence TTL dead
(``dead_at``, daemon/store/presence.py). Between the two a box is ``lapsed``: silent
past the TTL, not yet declared dead. The embedded store has one box, this daemon (and
the rows of earlier daemon ids the file may hold); nothing heartbeats there, so its own
``presence_at`` may be 0. Whatever the row says, the daemon answering is present.
"""

from __future__ import annotations

from typing import Any

from towerd.daemon.store.tx import Caller, Tx, fitted
from towerd.protocol.methods import BoxListResult, BoxRecord, Empty

_SELECT_BOXES = """SELECT daemon_id, owner_epoch, host, pid, started_at, presence_at, dead_at
                   FROM daemons ORDER BY started_at, daemon_id"""
# meta: each box's own presence TTL (ms), under this and its daemon id. A box is judged
# by its own: judged by the judge's, a box heartbeating every 8 s (TTL 30) was declared
# dead by one whose TTL was 5, and its live holders' leases were granted again.
TTL_KEY = "presence_ttl_ms:"
INTERVAL_KEY = "presence_interval_ms:"  # and how often it heartbeats


def record_presence(conn: Any, daemon_id: str, ttl_ms: int, interval_ms: int) -> None:
    """At a box's start, in its transaction: the presence TTL it heartbeats for, and
    how often it heartbeats."""
    for key, value in ((TTL_KEY, ttl_ms), (INTERVAL_KEY, interval_ms)):
        conn.execute(
            """INSERT INTO meta (key, value) VALUES (?, ?)
               ON CONFLICT (key) DO UPDATE SET value = excluded.value""",
            (key + daemon_id, str(value)),
        )


def others_heartbeat_within_ms(conn: Any, daemon_id: str, default_ms: int) -> int:
    """The longest heartbeat interval of the boxes other than ``daemon_id`` not declared
    dead (0: there are none): a running one records the fleet's clock within that."""
    others = [
        box for (box,) in conn.execute(
            "SELECT daemon_id FROM daemons WHERE dead_at IS NULL AND daemon_id <> ?",
            (daemon_id,),
        ).fetchall()
    ]  # fmt: skip
    if not others:
        return 0
    rows = conn.execute(
        "SELECT key, value FROM meta WHERE substr(key, 1, ?) = ?",
        (len(INTERVAL_KEY), INTERVAL_KEY),
    ).fetchall()
    recorded = {key[len(INTERVAL_KEY) :]: int(value) for key, value in rows if value.isdigit()}
    return max(recorded.get(box, default_ms) for box in others)


def ttls(tx: Tx) -> dict[str, int]:
    """Every box's recorded presence TTL (a box from before they were recorded: none)."""
    rows = tx.conn.execute(
        "SELECT key, value FROM meta WHERE substr(key, 1, ?) = ?", (len(TTL_KEY), TTL_KEY)
    ).fetchall()
    return {key[len(TTL_KEY) :]: int(value) for key, value in rows if value.isdigit()}


def state(
    tx: Tx, daemon_id: str, presence_at: int, dead_at: int | None, ttl_ms: int | None = None
) -> str:
    """``present``, ``lapsed`` or ``dead`` (protocol/fields.py BOX_STATES) at ``tx.now``,
    judged by the box's own presence TTL ``ttl_ms`` (this daemon's if not recorded)."""
    if daemon_id == tx.daemon_id:
        return "present"  # it answers
    if dead_at is not None:
        return "dead"
    if presence_at + (ttl_ms or tx.config.presence_ttl_ms) > tx.now:
        return "present"
    return "lapsed"


def list_boxes(tx: Tx, caller: Caller, params: Empty) -> BoxListResult:
    """``boxes.list``: every box, by ``started_at``, cut to fit a frame."""
    recorded = ttls(tx)
    boxes = [
        BoxRecord(
            daemon_id=daemon_id,
            owner_epoch=owner_epoch,
            host=host,
            pid=pid,
            started_at=started_at,
            presence_at=presence_at,
            dead_at=dead_at,
            state=state(tx, daemon_id, presence_at, dead_at, recorded.get(daemon_id)),
            self=daemon_id == tx.daemon_id,
        )
        for daemon_id, owner_epoch, host, pid, started_at, presence_at, dead_at in (
            tx.conn.execute(_SELECT_BOXES).fetchall()
        )
    ]
    return fitted(BoxListResult(boxes=boxes), tx.config.page_bytes)
