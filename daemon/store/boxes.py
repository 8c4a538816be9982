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

from towerd.daemon.store.config import StoreConfig
from towerd.daemon.store.tx import Caller, Tx, fitted
from towerd.protocol.methods import BoxListResult, BoxRecord, Empty

_SELECT_BOXES = """SELECT daemon_id, owner_epoch, host, pid, started_at, presence_at, dead_at
                   FROM daemons ORDER BY started_at, daemon_id"""
# meta: each box's own presence TTL (ms), under this and its daemon id. A box is judged
# by its own: judged by the judge's, a box heartbeating every 8 s (TTL 30) was declared
# dead by one whose TTL was 5, and its live holders' leases were granted again.
TTL_KEY = "presence_ttl_ms:"
INTERVAL_KEY = "presence_interval_ms:"  # and how often it heartbeats
PRESENCE_KEYS = "presence_"  # what both keys begin with


def record_presence(conn: Any, daemon_id: str, ttl_ms: int, interval_ms: int) -> None:
    """At a box's start, in its transaction: the presence TTL it heartbeats for, and
    how often it heartbeats."""
    for key, value in ((TTL_KEY, ttl_ms), (INTERVAL_KEY, interval_ms)):
        conn.execute(
            """INSERT INTO meta (key, value) VALUES (?, ?)
               ON CONFLICT (key) DO UPDATE SET value = excluded.value""",
            (key + daemon_id, str(value)),
        )


def others_heartbeat_within_ms(
    conn: Any, daemon_id: str, as_of_ms: int, default_interval_ms: int, default_ttl_ms: int
) -> int:
    """The longest heartbeat interval of the boxes other than ``daemon_id`` that were
    present at fleet time ``as_of_ms`` (0: none was): a running one records the fleet's
    clock within that. A box silent then (crashed long before, planted silent) is not
    waited for."""
    rows = conn.execute(
        "SELECT daemon_id, presence_at FROM daemons WHERE dead_at IS NULL AND daemon_id <> ?",
        (daemon_id,),
    ).fetchall()
    if not rows:
        return 0
    settings = conn.execute(
        "SELECT key, value FROM meta WHERE substr(key, 1, ?) = ?",
        (len(PRESENCE_KEYS), PRESENCE_KEYS),
    ).fetchall()
    recorded = {key: int(value) for key, value in settings if value.isdigit()}
    present = [
        box for box, presence_at in rows
        if presence_at + recorded.get(TTL_KEY + box, default_ttl_ms) >= as_of_ms
    ]  # fmt: skip
    return max(
        (recorded.get(INTERVAL_KEY + box, default_interval_ms) for box in present), default=0
    )


def ttl_of(tx: Tx, recorded: dict[str, int], box: str) -> int:
    """The presence TTL ``box`` is judged by: its recorded one; without a record on a
    shared store (its record deleted, or a box from before they were recorded, as in a
    rolling upgrade), never shorter than the default TTL (judged by a judge's shorter
    TTL, such a box heartbeating at the default pace was declared dead: a hostile
    tester's finding); on the embedded store, whose other daemon ids are earlier
    daemons of this box, this daemon's."""
    own = tx.config.presence_ttl_ms
    return recorded.get(box, own if tx.one_box else max(own, StoreConfig.presence_ttl_ms))


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
            state=state(
                tx,
                daemon_id,
                presence_at,
                dead_at,
                ttl_of(tx, recorded, daemon_id),
            ),  # fmt: skip
            self=daemon_id == tx.daemon_id,
        )
        for daemon_id, owner_epoch, host, pid, started_at, presence_at, dead_at in (
            tx.conn.execute(_SELECT_BOXES).fetchall()
        )
    ]
    return fitted(BoxListResult(boxes=boxes), tx.config.page_bytes)
