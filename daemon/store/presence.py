"""Boxes' presence on a shared store: each daemon heartbeats its row; a box silent past
the presence TTL is dead for everyone, and any live daemon settles what it held.

Presence is on the fleet's clock (every box's ``tx.now`` is, daemon/store/fleet_clock.py),
so boxes whose clocks differ agree on who lapsed, each box judged by its own presence
TTL (recorded at its start, daemon/store/boxes.py); and a box is declared dead only once the
declaring box has also seen its presence unchanged for the TTL on its own monotonic
clock (:class:`Sightings`), so a step in the server's clock declares no live box dead.
Only a box's own daemon checks its pids (tx.own_box); for another box, its presence is
the only evidence: once it lapses, every holder of that box is dead, and the box's rows
are settled exactly as its own sweep would settle them with every holder dead: its keys
turn ``outcome_unknown`` (or complete from evidence), its leases are freed, its shared
in-flight effects parked ``uncertain``, its workers ``crashed``. A box that comes back
finds itself declared dead and serves again under a new epoch (pg_store.PgStore); what
its holders held stays released, and fencing refuses their late commits.

The declaring box logs ``box_declared_dead`` once its transaction committed, from the
commit itself: the heartbeat sends the declaration with the batch's change notes
(a topic no watcher can subscribe to), which PostgreSQL delivers, to this box's own
change listener too (daemon/store/pg_changes.py), if and only if the batch commits.
Not from the heartbeat's answer: a heartbeat answered ``unavailable`` at its deadline
may still commit, and its declaration went unlogged.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
import structlog

from towerd.daemon.store import boxes, idempotency, leases, liveness, reconcile
from towerd.daemon.store.tx import Tx, note

log = structlog.get_logger("towerd.store")


# The change notes' topic of a declaration: not a watch topic (protocol/fields.py), so
# no watcher is ever pushed one; only the declaring box's change listener reads it.
DECLARED_DEAD = "box_declared_dead"


@dataclass
class BeatReport:
    """The heartbeat's answer. It names no box declared dead: those are logged from the
    committed declaration (:func:`log_declared`), whether or not the heartbeat's caller
    still waited for this answer when it came."""

    declared_dead: list[str] = field(default_factory=list)
    settled: dict[str, liveness.LivenessReport] = field(default_factory=dict)


class Sightings:
    """When this box last saw each other box's presence change, on this box's own
    monotonic clock. A box is declared dead only once it is both lapsed on the server's
    clock and seen unchanged here for the TTL: the server's clock alone is not enough,
    because a step in it (NTP, a VM resumed) made a box that heartbeats every interval
    look lapsed to the other boxes at their first heartbeat after it, and a live box
    was declared dead and its live holders' leases granted again (a hostile tester's
    reproducer, libfaketime on the server; tests/integration/test_pg_clock_steps.py).
    The price: after its own start a box declares no one dead for a TTL."""

    def __init__(self) -> None:
        self._seen: dict[str, tuple[int, float]] = {}  # box -> (presence_at, seen since)

    def unchanged_ms(self, presence: list[tuple[str, int]], now_s: float) -> dict[str, float]:
        """For each box's ``presence_at`` read now: how long it has read the same here."""
        seen, self._seen = self._seen, {}
        quiet = {}
        for box, presence_at in presence:
            last = seen.get(box)
            since = last[1] if last is not None and last[0] == presence_at else now_s
            self._seen[box] = (presence_at, since)
            quiet[box] = (now_s - since) * 1000
        return quiet


def beat(tx: Tx, sightings: Sightings) -> BeatReport:
    """A store function (a write): this box is present now; every other box silent for
    the presence TTL is declared dead and its rows settled, in this transaction, and the
    declaration goes out with the batch's change notes (logged once committed).

    The presence changes at every beat, also when the fleet's clock reads no later than
    the last beat (daemon/store/fleet_clock.py: a floor, a box's first batch): a
    millisecond on then. Written as the clock read, every beat of a clock standing still
    wrote one value, every box looked unchanged for the TTL, and when it moved again the
    first box to beat declared the others dead and their live holders' leases were
    granted again (a hostile tester's reproducer)."""
    tx.conn.execute(
        """UPDATE daemons SET presence_at = CASE WHEN presence_at < ? THEN ?
               ELSE presence_at + 1 END WHERE daemon_id = ?""",
        (tx.now, tx.now, tx.daemon_id),
    )
    presence = tx.conn.execute(
        """SELECT daemon_id, presence_at FROM daemons
           WHERE dead_at IS NULL AND daemon_id <> ? ORDER BY daemon_id""",
        (tx.daemon_id,),
    ).fetchall()
    recorded = boxes.ttls(tx)  # each box judged by its own TTL
    quiet = sightings.unchanged_ms(presence, time.monotonic())
    lapsed = []
    for box, presence_at in presence:
        ttl = boxes.ttl_of(tx, recorded, box)
        if presence_at <= tx.now - ttl and quiet[box] >= ttl:
            lapsed.append((box,))
    for (box,) in lapsed:
        tx.conn.execute("UPDATE daemons SET dead_at = ? WHERE daemon_id = ?", (tx.now, box))
        settled = settle_box(tx, box)
        note(tx, DECLARED_DEAD, {
            "box": box,
            "declared_at": tx.now,
            "keys_unknown": len(settled.keys_unknown),
            "leases_released": len(settled.leases_released),
            "effects_parked": len(settled.effects_parked),
            "workers_ended": len(settled.workers_ended),
        })  # fmt: skip
    return BeatReport()


def log_declared(changes: list[tuple[str, Any]]) -> None:
    """This box's own committed change notes (the change listener hears them after the
    commit): log each box it declared dead, and what that box held."""
    for topic, declared in changes:
        if topic == DECLARED_DEAD and isinstance(declared, dict):
            log.warning("box_declared_dead", code="unavailable", **declared)


def settle_box(tx: Tx, box: str) -> liveness.LivenessReport:
    """Everything ``box`` held, settled as that box with every holder dead."""
    as_box = msgspec.structs.replace(tx, daemon_id=box, one_box=False, as_dead_box=True)
    holders, _silent = liveness.to_check(as_box, tx.config.worker_ttl_ms)
    report = liveness.settle(as_box, holders, tx.config.worker_ttl_ms)
    # Keys held by no process (a claim without a holder) were held across a daemon that
    # is gone: unknown too, as at a restart; so are leases granted to nobody in particular.
    report.keys_unknown += _unknown_unheld_keys(as_box)
    report.leases_released += leases.release_box(as_box, "box-dead")
    return report


def _unknown_unheld_keys(tx: Tx) -> list[tuple[str, str, str]]:
    moved = idempotency.mark_box_unknown(tx)
    completed = reconcile.settle(tx, [(rowid, op, ref) for rowid, _, op, _, ref in moved])
    return [(p, op, key) for rowid, p, op, key, _ in moved if rowid not in completed]
