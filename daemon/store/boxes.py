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

from towerd.daemon.store.tx import Caller, Tx, fitted
from towerd.protocol.methods import BoxListResult, BoxRecord, Empty

_SELECT_BOXES = """SELECT daemon_id, owner_epoch, host, pid, started_at, presence_at, dead_at
                   FROM daemons ORDER BY started_at, daemon_id"""


def state(tx: Tx, daemon_id: str, presence_at: int, dead_at: int | None) -> str:
    """``present``, ``lapsed`` or ``dead`` (protocol/fields.py BOX_STATES) at ``tx.now``."""
    if daemon_id == tx.daemon_id:
        return "present"  # it answers
    if dead_at is not None:
        return "dead"
    if presence_at + tx.config.presence_ttl_ms > tx.now:
        return "present"
    return "lapsed"


def list_boxes(tx: Tx, caller: Caller, params: Empty) -> BoxListResult:
    """``boxes.list``: every box, by ``started_at``, cut to fit a frame."""
    boxes = [
        BoxRecord(
            daemon_id=daemon_id,
            owner_epoch=owner_epoch,
            host=host,
            pid=pid,
            started_at=started_at,
            presence_at=presence_at,
            dead_at=dead_at,
            state=state(tx, daemon_id, presence_at, dead_at),
            self=daemon_id == tx.daemon_id,
        )
        for daemon_id, owner_epoch, host, pid, started_at, presence_at, dead_at in (
            tx.conn.execute(_SELECT_BOXES).fetchall()
        )
    ]
    return fitted(BoxListResult(boxes=boxes), tx.config.page_bytes)
