"""What ``watch`` pushes: every change note is one of these Structs, tagged by ``op``
where a topic has more than one kind of change.

The store writes them in the same transaction as the change (daemon/store/tx.py
``note``); the read cache drops what they name (daemon/read_cache.py) and the
watch hub pushes them (daemon/watch.py). docs/protocol.md §16 lists them, and a
test checks that list against these Structs (tests/protocol/test_changes.py).
"""

from __future__ import annotations

from msgspec import Struct

from towerd.protocol.methods import EffectRecord, IdemRecord, IdemState, SessionRow, TrailEvent

# --- fleet ---------------------------------------------------------------------------


class FleetUpserted(Struct, tag="upsert", tag_field="op"):
    """A row as written (inserted, updated, re-stamped)."""

    session: SessionRow


class FleetRemoved(Struct, tag="remove", tag_field="op"):
    session_id: str


class FleetAdopted(Struct, tag="adopt", tag_field="op"):
    """Every row of ``daemon_id`` moved to this daemon: the topic's rows all changed."""

    daemon_id: str
    sessions: int


FleetChange = FleetUpserted | FleetRemoved | FleetAdopted

# --- idempotency keys ------------------------------------------------------------------


class IdemChanged(Struct, tag="key", tag_field="op", omit_defaults=True):
    """One key of ``principal`` changed: created, moved to another state, or (``state``
    null) gone: released, abandoned, reopened. ``record`` is the key as now stored,
    when the change wrote the whole of it."""

    principal: str
    operation: str
    key: str
    state: IdemState | None
    effect_ref: str | None = None
    record: IdemRecord | None = None


class IdemExpired(Struct, tag="expired", tag_field="op"):
    """The expiry pass forgot ``count`` completed keys, of any principal."""

    count: int


IdemChange = IdemChanged | IdemExpired

# --- effects ---------------------------------------------------------------------------


class EffectGone(Struct):
    """The effect's row is no longer there."""

    effect_key: str


EffectChange = EffectRecord | EffectGone  # the record as it now stands, or its absence

# Each topic's notes. ``leases`` and ``dispatch`` push their audit events (§12):
# ``{type, at, ...payload}``, whose payload depends on the event type.
NOTES_BY_TOPIC: dict[str, tuple[type, ...]] = {
    "fleet": (FleetUpserted, FleetRemoved, FleetAdopted),
    "idem": (IdemChanged, IdemExpired),
    "events": (TrailEvent,),
    "effects": (EffectRecord, EffectGone),
}


def idem_changed(principal: str, record: IdemRecord) -> IdemChanged:
    """The note of a key whose whole record the change wrote."""
    return IdemChanged(
        principal=principal,
        operation=record.operation,
        key=record.key,
        state=record.state,
        effect_ref=record.effect_ref,
        record=record,
    )
