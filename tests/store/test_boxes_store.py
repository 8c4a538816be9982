"""boxes.list, and the fleet reads of one fleet across boxes (daemon_id filters).

Rows of several boxes appear in one store when the same state dir is opened as another
daemon id (``opened(root, daemon_id=...)``). Whether the store is shared is ``tx.one_box``
(True on the embedded store, False on PostgreSQL): each read here runs on a Tx with
``one_box`` set both ways, so both defaults are checked on every backend."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from store_helpers import backend, caller, clock, configured, opened, register
from towerd.daemon.store import Store, boxes, events, fleet, presence
from towerd.daemon.store.tx import Tx
from towerd.protocol.errors import NotFound, StaleEpoch
from towerd.protocol.methods import (
    BoxRecord,
    Empty,
    FleetGetParams,
    FleetListParams,
    RestorePlanParams,
    SessionActivityParams,
    SessionUpdateParams,
)

pytestmark = pytest.mark.anyio

OTHER = "box-b"  # another box's daemon id
TTL = 10_000  # presence TTL (ms) the boxes.list reads run with
NO_BEAT = 10**9  # presence interval (ms): a PostgreSQL box beats once, at its start


def on(one_box: bool, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run on a Tx of the embedded store (``one_box``) or of a shared one."""

    def run(tx: Tx, *args: Any) -> Any:
        return fn(msgspec.structs.replace(tx, one_box=one_box), *args)

    return run


async def boxes_at(store: Store, now: int, ttl: int = TTL) -> list[BoxRecord]:
    """boxes.list as read at towerd time ``now`` with presence TTL ``ttl``."""
    listing = clock(now, configured(boxes.list_boxes, presence_ttl_ms=ttl))
    result = await store.read(listing, caller(), Empty())
    assert not result.truncated
    return result.boxes


async def plant_box(store: Store, daemon_id: str, ttl_ms: int = TTL, **row: Any) -> None:
    """A ``daemons`` row of a box that is not running here, and its presence TTL
    recorded as its start records it."""
    values = {"owner_epoch": 1, "pid": 4242, "host": "elsewhere", "started_at": 1,
              "presence_at": 0, "dead_at": None, **row}  # fmt: skip
    columns = ", ".join(values)

    def plant(tx: Tx) -> None:
        tx.conn.execute(
            f"INSERT INTO daemons (daemon_id, {columns}) "
            f"VALUES (?, {', '.join('?' * len(values))})",
            (daemon_id, *values.values()),
        )
        boxes.record_presence(tx.conn, daemon_id, ttl_ms, ttl_ms // 2)

    await store.write(plant)


async def daemon_row(store: Store, daemon_id: str) -> tuple[Any, ...]:
    return await store.read(
        lambda tx: tx.conn.execute(
            "SELECT owner_epoch, host, pid, started_at, presence_at, dead_at FROM daemons "
            "WHERE daemon_id = ?",
            (daemon_id,),
        ).fetchone()
    )


async def now_of(store: Store) -> int:
    return await store.read(lambda tx: tx.now)


async def past_the_start_beat(store: Store) -> None:
    """Once a write of ours committed, so has the presence beat a PostgreSQL store queues
    as it opens (before any of ours): its daemons row no longer moves (NO_BEAT)."""
    await store.write(lambda tx: None)


# --- boxes.list ----------------------------------------------------------------------


async def test_boxes_list_this_box_present_and_self_whatever_its_presence(
    short_tmp: Path,
) -> None:
    """The one box of a fresh store is this daemon: its daemons row as stored, ``self``,
    and present however old its presence_at is (0 on the embedded store): it answers."""
    async with opened(short_tmp, presence_interval_ms=NO_BEAT) as store:
        await past_the_start_beat(store)
        now = await now_of(store)
        epoch, host, pid, started_at, presence_at, dead_at = await daemon_row(
            store, store.daemon_id
        )
        expected = BoxRecord(
            daemon_id=store.daemon_id, owner_epoch=epoch, host=host, pid=pid,
            started_at=started_at, presence_at=presence_at, dead_at=dead_at,
            state="present", self=True,
        )  # fmt: skip
        assert epoch == store.owner_epoch and dead_at is None
        assert await boxes_at(store, now) == [expected]
        # Long past any TTL: this daemon answers, so it is present.
        assert await boxes_at(store, now + 100 * TTL) == [expected]
        await store.write(
            lambda tx: tx.conn.execute(
                "UPDATE daemons SET presence_at = 0 WHERE daemon_id = ?", (tx.daemon_id,)
            )
        )
        assert [(b.state, b.self, b.presence_at) for b in await boxes_at(store, now + TTL)] == [
            ("present", True, 0)
        ]


async def test_boxes_list_another_daemon_id_lapses_after_the_ttl(short_tmp: Path) -> None:
    """A daemon id that registered in the store and is not this daemon: listed with its
    row, ``self`` false; present while its presence is younger than the TTL, lapsed
    from then on (not declared dead: dead_at null)."""
    async with opened(
        short_tmp, daemon_id=OTHER, presence_interval_ms=NO_BEAT, presence_ttl_ms=TTL
    ) as theirs:
        their_epoch = theirs.owner_epoch
        await past_the_start_beat(theirs)
    async with opened(short_tmp, presence_interval_ms=NO_BEAT) as store:
        await past_the_start_beat(store)
        _epoch, host, pid, started_at, presence_at, dead_at = await daemon_row(store, OTHER)
        assert dead_at is None
        listed = {b.daemon_id: b for b in await boxes_at(store, presence_at + TTL - 1)}
        assert set(listed) == {store.daemon_id, OTHER}
        assert listed[OTHER] == BoxRecord(
            daemon_id=OTHER, owner_epoch=their_epoch, host=host, pid=pid,
            started_at=started_at, presence_at=presence_at, dead_at=None,
            state="present", self=False,
        )  # fmt: skip
        assert listed[store.daemon_id].self and listed[store.daemon_id].state == "present"
        for now in (presence_at + TTL, presence_at + 50 * TTL):
            states = {b.daemon_id: (b.state, b.self) for b in await boxes_at(store, now)}
            assert states == {store.daemon_id: ("present", True), OTHER: ("lapsed", False)}
        # Judged by its own TTL, recorded at its start on a shared store (the reader's
        # shorter one declared a box heartbeating slower than that dead); the embedded
        # store records none: the reader's TTL.
        late = presence_at + TTL - 1
        shorter = {b.daemon_id: b.state for b in await boxes_at(store, late, ttl=TTL // 2)}
        assert shorter[OTHER] == ("present" if backend() == "postgresql" else "lapsed")


async def test_boxes_list_states_and_order(short_tmp: Path) -> None:
    """present, lapsed, dead (dead_at set, whatever its presence says), in started_at order
    (this daemon, started last, comes last)."""
    async with opened(short_tmp, presence_interval_ms=NO_BEAT) as store:
        now = await now_of(store) + 100 * TTL  # later than any presence planted below
        await plant_box(store, "box-dead", started_at=3, presence_at=now, dead_at=now - 5)
        await plant_box(store, "box-present", started_at=1, presence_at=now - TTL + 1)
        await plant_box(store, "box-lapsed", started_at=2, presence_at=now - TTL, host="h2")
        listed = await boxes_at(store, now)
        assert [(b.daemon_id, b.state, b.self) for b in listed] == [
            ("box-present", "present", False),
            ("box-lapsed", "lapsed", False),
            ("box-dead", "dead", False),
            (store.daemon_id, "present", True),
        ]
        lapsed = listed[1]
        assert (lapsed.host, lapsed.pid, lapsed.owner_epoch, lapsed.started_at) == (
            "h2", 4242, 1, 2
        )  # fmt: skip
        assert (listed[2].dead_at, listed[0].dead_at) == (now - 5, None)


async def test_boxes_list_is_cut_to_fit_a_frame(short_tmp: Path) -> None:
    """More boxes than fit in the byte budget: the first ones, and ``truncated``."""
    async with opened(short_tmp, presence_interval_ms=NO_BEAT) as store:
        for n in range(5):
            await plant_box(store, f"box-{n}", started_at=n + 1, host="h" * 100)
        tiny = configured(boxes.list_boxes, max_frame=400)  # a page budget of 200 bytes
        result = await store.read(tiny, caller(), Empty())
        assert result.truncated
        assert [b.daemon_id for b in result.boxes] == ["box-0"]
        whole = await store.read(boxes.list_boxes, caller(), Empty())
        assert not whole.truncated and len(whole.boxes) == 6


# --- one fleet: the daemon_id filter of the fleet reads ------------------------------


async def two_fleets(root: Path) -> tuple[str, str]:
    """This daemon's row and another box's (registered in that order)."""
    async with opened(root, presence_interval_ms=NO_BEAT) as store:
        mine = await register(store, agent_session_id="as-mine", name="mine")
    async with opened(root, daemon_id=OTHER, presence_interval_ms=NO_BEAT) as store:
        theirs = await register(store, agent_session_id="as-theirs", name="theirs")
    return mine, theirs


async def listed(store: Store, one_box: bool, **params: Any) -> list[tuple[str, str]]:
    """(session id, daemon id) of every row fleet.list shows, page after page."""
    rows: list[tuple[str, str]] = []
    cursor = None
    while True:
        page = await store.read(
            on(one_box, fleet.list_sessions), caller(), FleetListParams(cursor=cursor, **params)
        )
        rows += [(row.session_id, row.daemon_id) for row in page.sessions]
        if page.next_cursor is None:
            return rows
        cursor = page.next_cursor


async def test_fleet_list_default_own_rows_on_one_box_every_box_on_a_shared_store(
    short_tmp: Path,
) -> None:
    """No daemon_id: the embedded store shows this daemon's rows only (protocol §8); a
    shared store every box's, in stored order, paged across boxes; the store's own
    default is its backend's."""
    mine, theirs = await two_fleets(short_tmp)
    async with opened(short_tmp, presence_interval_ms=NO_BEAT) as store:
        me = store.daemon_id
        assert await listed(store, True) == [(mine, me)]
        assert await listed(store, False) == [(mine, me), (theirs, OTHER)]
        assert await listed(store, False, limit=1) == [(mine, me), (theirs, OTHER)]
        native = await store.read(fleet.list_sessions, caller(), FleetListParams())
        assert [row.session_id for row in native.sessions] == (
            [mine] if store.one_box else [mine, theirs]
        )


async def test_fleet_list_daemon_id_filters_to_that_box_on_both_kinds_of_store(
    short_tmp: Path,
) -> None:
    mine, theirs = await two_fleets(short_tmp)
    async with opened(short_tmp, presence_interval_ms=NO_BEAT) as store:
        me = store.daemon_id
        for one_box in (True, False):
            assert await listed(store, one_box, daemon_id=OTHER) == [(theirs, OTHER)]
            assert await listed(store, one_box, daemon_id=me) == [(mine, me)]
            assert await listed(store, one_box, daemon_id="no-such-box") == []


async def test_fleet_get_of_another_boxs_session(short_tmp: Path) -> None:
    """On a shared store fleet.get answers a row whatever its box; on the embedded store
    another daemon id's row is not_found, as before; a daemon_id names the one box to
    look in on both."""
    mine, theirs = await two_fleets(short_tmp)
    async with opened(short_tmp, presence_interval_ms=NO_BEAT) as store:
        me = store.daemon_id

        async def get(one_box: bool, session_id: str, daemon_id: str | None = None) -> Any:
            params = FleetGetParams(session_id, daemon_id)
            return await store.read(on(one_box, fleet.get), caller(), params)

        row = await get(False, theirs)
        assert (row.session_id, row.daemon_id, row.name) == (theirs, OTHER, "theirs")
        assert (await get(False, mine)).daemon_id == me
        with pytest.raises(NotFound, match="this daemon's fleet") as caught:
            await get(True, theirs)
        assert caught.value.data == {"session_id": theirs}
        for one_box in (True, False):
            assert (await get(one_box, theirs, OTHER)).session_id == theirs
            assert (await get(one_box, mine, me)).session_id == mine
            with pytest.raises(NotFound, match=f"daemon {OTHER}'s fleet"):
                await get(one_box, mine, OTHER)
            with pytest.raises(NotFound, match="this daemon's fleet"):
                await get(one_box, theirs, me)
        with pytest.raises(NotFound, match="any box's fleet"):
            await get(False, "00000000-0000-4000-8000-000000000000")


async def test_a_shared_store_shows_another_boxs_rows_but_writes_stay_the_owners(
    short_tmp: Path,
) -> None:
    """Reading another box's row is not owning it: a write to it is stale_epoch."""
    _mine, theirs = await two_fleets(short_tmp)
    async with opened(short_tmp, presence_interval_ms=NO_BEAT) as store:
        update = on(False, fleet.update_session)
        with pytest.raises(StaleEpoch):
            await store.write(update, caller(), SessionUpdateParams(theirs, name="taken"))
        params = FleetGetParams(theirs, OTHER)
        assert (await store.read(fleet.get, caller(), params)).name == "theirs"


async def test_session_activity_default_and_daemon_id(short_tmp: Path) -> None:
    """session.activity shows the same rows as fleet.list, each naming its box."""
    mine, theirs = await two_fleets(short_tmp)
    async with opened(short_tmp, presence_interval_ms=NO_BEAT) as store:
        me = store.daemon_id

        async def shown(one_box: bool, **params: Any) -> list[tuple[str, str]]:
            result = await store.read(
                on(one_box, events.activity), caller(), SessionActivityParams(**params)
            )
            return [(a.session_id, a.daemon_id) for a in result.sessions]

        assert await shown(True) == [(mine, me)]
        assert await shown(False) == [(mine, me), (theirs, OTHER)]
        assert await shown(True, session_ids=[theirs]) == []
        assert await shown(False, session_ids=[theirs]) == [(theirs, OTHER)]
        for one_box in (True, False):
            assert await shown(one_box, daemon_id=OTHER) == [(theirs, OTHER)]
            assert await shown(one_box, daemon_id=me) == [(mine, me)]
            assert await shown(one_box, session_ids=[mine], daemon_id=OTHER) == []


async def test_restore_plan_default_and_daemon_id(short_tmp: Path) -> None:
    """fleet.restore_plan plans the same rows, each entry naming its box (a box restoring
    its own sessions names itself: client/restore.py)."""
    mine, theirs = await two_fleets(short_tmp)
    async with opened(short_tmp, presence_interval_ms=NO_BEAT) as store:
        me = store.daemon_id

        async def planned(one_box: bool, daemon_id: str | None = None) -> set[tuple[str, str]]:
            result = await store.read(
                on(one_box, events.restore_plan), caller(), RestorePlanParams(daemon_id)
            )
            return {(e.session_id, e.daemon_id) for e in result.sessions}

        assert await planned(True) == {(mine, me)}
        assert await planned(False) == {(mine, me), (theirs, OTHER)}
        for one_box in (True, False):
            assert await planned(one_box, OTHER) == {(theirs, OTHER)}
            assert await planned(one_box, me) == {(mine, me)}


# --- presence: who is declared dead ----------------------------------------------------------


async def test_a_box_is_declared_dead_only_once_seen_silent_for_the_ttl_on_our_own_clock(
    short_tmp: Path,
) -> None:
    """Lapsed on the server's clock is not enough: a step in that clock made a box that
    heartbeats every interval read as lapsed to a box whose clock reading is held at its
    highest, and the live box was declared dead and its live holders' leases granted
    again (a hostile tester's reproducer, libfaketime on the server). Its presence must
    also read unchanged here for the TTL, on this box's monotonic clock."""
    ttl = 300
    async with opened(short_tmp, presence_interval_ms=NO_BEAT, presence_ttl_ms=ttl) as store:
        await past_the_start_beat(store)
        now = await now_of(store)
        await plant_box(store, OTHER, ttl_ms=ttl, presence_at=now - 10 * ttl)  # lapsed
        sightings = presence.Sightings()
        started = time.monotonic()
        await store.write(presence.beat, sightings)
        assert (await daemon_row(store, OTHER))[-1] is None  # first seen now: not dead
        # It heartbeats (under a server clock stepped forward, its presence still reads
        # as long ago): changed, so seen silent for no time at all.
        await store.write(lambda tx: tx.conn.execute(
            "UPDATE daemons SET presence_at = ? WHERE daemon_id = ?", (now - 10 * ttl + 1, OTHER)
        ))  # fmt: skip
        await store.write(presence.beat, sightings)
        assert (await daemon_row(store, OTHER))[-1] is None
        changed = time.monotonic()

        async def dead() -> bool:
            await store.write(presence.beat, sightings)
            return (await daemon_row(store, OTHER))[-1] is not None

        deadline = changed + 30
        while not await dead():
            assert time.monotonic() < deadline, "never declared dead"
            await anyio.sleep(0.02)  # the next beat (a heartbeat's pace, not a sync)
        assert time.monotonic() - changed >= ttl / 1000
        assert time.monotonic() - started >= ttl / 1000
