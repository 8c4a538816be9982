"""Fleet store functions through a real Store on a real SQLite file."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

import msgspec
import pytest

from store_helpers import (
    DEAD,
    all_session_rows,
    caller,
    entry,
    execute,
    new_id,
    opened,
    parents,
    query,
    register,
    register_params,
    rows,
)
from towerd.daemon.store import Store, fleet, idempotency, liveness
from towerd.daemon.store.tx import Tx
from towerd.protocol.errors import BadArgs, Conflict, NotFound, StaleEpoch, Unavailable
from towerd.protocol.methods import (
    UUID_PATTERN,
    FleetAdoptParams,
    FleetAdoptResult,
    FleetListParams,
    FleetListResult,
    FleetWriteParams,
    FleetWriteResult,
    IdemClaimParams,
    IdemKeyParams,
    SessionEntry,
    SessionIdParams,
    SessionRegisterParams,
    SessionRemoveResult,
    SessionRow,
    SessionUpdateParams,
)

pytestmark = pytest.mark.anyio


async def update(store: Store, params: SessionUpdateParams) -> SessionRow:
    return await store.write(fleet.update_session, caller(), params)


async def remove(store: Store, session_id: str) -> SessionRemoveResult:
    return await store.write(fleet.remove_session, caller(), SessionIdParams(session_id))


async def write_fleet(
    store: Store, entries: list[SessionEntry], removed: list[str]
) -> FleetWriteResult:
    return await store.write(fleet.write_fleet, caller(), FleetWriteParams(entries, removed))


async def list_page(store: Store, limit: int, cursor: int | None) -> FleetListResult:
    return await store.read(fleet.list_sessions, caller(), FleetListParams(limit, cursor))


async def adopt(store: Store, principal: str, daemon_id: str) -> FleetAdoptResult:
    """fleet.adopt of ``daemon_id``, declared dead first (as a live box does once its
    presence lapsed): on a shared store only a dead box is adopted."""
    await store.write(
        lambda tx: tx.conn.execute(
            "UPDATE daemons SET dead_at = ? WHERE daemon_id = ?", (tx.now, daemon_id)
        )
    )
    return await store.write(fleet.adopt_fleet, caller(principal), FleetAdoptParams(daemon_id))


# --- register
# ----------------------------------------------------------------------------


async def test_register_mints_a_uuid_and_stores_every_field(short_tmp: Path) -> None:
    """Without a session id one is minted; every
    given field is stored under this daemon/epoch."""
    async with opened(short_tmp) as store:
        session_id = await register(
            store,
            agent_session_id="as-1",
            name="n",
            cwd="/repo",
            agent="codex",
            pinned=True,
            last_attached_at=1234,
            exited=True,
            prompt="p",
            result="r",
            transcript_path="/t",
            model="m",
            effort="high",
            target="tg",
            target_identity="ti",
        )
        assert re.fullmatch(UUID_PATTERN, session_id)
        [row] = await rows(store)
        assert row.session_id == session_id
        assert (row.agent_session_id, row.name, row.cwd, row.agent) == (
            "as-1",
            "n",
            "/repo",
            "codex",
        )
        assert (row.pinned, row.exited, row.last_attached_at) == (True, True, 1234)
        assert (row.prompt, row.result, row.transcript_path) == ("p", "r", "/t")
        assert (row.model, row.effort, row.target, row.target_identity) == (
            "m",
            "high",
            "tg",
            "ti",
        )
        assert row.parent is None
        assert (row.daemon_id, row.owner_epoch) == (store.daemon_id, store.owner_epoch)


async def test_register_keeps_a_given_session_id(short_tmp: Path) -> None:
    """A caller-chosen session id is the row's id."""
    wanted = new_id()
    async with opened(short_tmp) as store:
        assert await register(store, session_id=wanted) == wanted
        assert [r.session_id for r in await rows(store)] == [wanted]


async def test_register_duplicate_session_id_is_a_conflict(short_tmp: Path) -> None:
    """A second register of the same id is refused
    with Conflict; the first row is unchanged."""
    sid = new_id()
    async with opened(short_tmp) as store:
        await register(store, session_id=sid, name="first")
        with pytest.raises(Conflict) as caught:
            await register(store, session_id=sid, name="second")
        assert caught.value.data == {"session_id": sid}
        assert [(r.session_id, r.name) for r in await rows(store)] == [(sid, "first")]


async def test_register_duplicate_agent_session_id_is_a_conflict(
    short_tmp: Path,
) -> None:
    """Two rows of one daemon never share an agent session id."""
    async with opened(short_tmp) as store:
        first = await register(store, agent_session_id="agent-x")
        with pytest.raises(Conflict) as caught:
            await register(store, agent_session_id="agent-x")
        assert caught.value.data == {"agent_session_id": "agent-x", "session_id": first}
        assert [r.session_id for r in await rows(store)] == [first]


async def test_register_under_a_sub_session_links_to_its_top_level_row(
    short_tmp: Path,
) -> None:
    """Naming a sub-session as parent stores its
    top-level row instead (one level deep)."""
    async with opened(short_tmp) as store:
        top = await register(store)
        child = await register(store, parent=top)
        grandchild = await register(store, parent=child)
        assert await parents(store) == {top: None, child: top, grandchild: top}


async def test_register_with_missing_parent_is_not_found(short_tmp: Path) -> None:
    """A parent that is not in this daemon's
    fleet is NotFound and nothing is inserted."""
    missing = new_id()
    async with opened(short_tmp) as store:
        with pytest.raises(NotFound) as caught:
            await register(store, parent=missing)
        assert caught.value.data == {"session_id": missing}
        assert await rows(store) == []


async def test_register_as_its_own_parent_is_bad_args(short_tmp: Path) -> None:
    """A row cannot be its own parent."""
    sid = new_id()
    async with opened(short_tmp) as store:
        with pytest.raises(BadArgs):
            await register(store, session_id=sid, parent=sid)
        assert await rows(store) == []


# --- update
# --------------------------------------------------------------------------------


async def test_update_rewrites_only_given_fields_and_null_clears(
    short_tmp: Path,
) -> None:
    """Absent fields are untouched; null clears
    a nullable field; the rest are rewritten."""
    async with opened(short_tmp) as store:
        sid = await register(store, name="n", prompt="p", model="m", pinned=True, cwd="/a")
        row = await update(
            store, SessionUpdateParams(session_id=sid, name=None, cwd="/b", exited=True)
        )
        assert (row.name, row.cwd, row.exited) == (None, "/b", True)
        assert (row.prompt, row.model, row.pinned) == ("p", "m", True)
        assert (await rows(store)) == [row]


async def test_update_with_no_fields_changes_nothing_but_the_stamp(
    short_tmp: Path,
) -> None:
    """An update naming only the session keeps every field."""
    async with opened(short_tmp) as store:
        sid = await register(store, name="n", agent_session_id="as")
        [before] = await rows(store)
        after = await update(store, SessionUpdateParams(session_id=sid))
        assert (after.name, after.agent_session_id, after.cwd) == (
            before.name,
            "as",
            before.cwd,
        )


async def test_update_parent_moves_the_rows_own_children_along(short_tmp: Path) -> None:
    """Making B a sub-session of A moves B's children
    under A (the hierarchy stays one level)."""
    async with opened(short_tmp) as store:
        a = await register(store)
        b = await register(store)
        c1 = await register(store, parent=b)
        c2 = await register(store, parent=b)
        row = await update(store, SessionUpdateParams(session_id=b, parent=a))
        assert row.parent == a
        assert await parents(store) == {a: None, b: a, c1: a, c2: a}


async def test_update_parent_to_a_sub_session_links_to_its_top_level_row(
    short_tmp: Path,
) -> None:
    """A new parent that is a sub-session resolves to its top-level row."""
    async with opened(short_tmp) as store:
        a = await register(store)
        b = await register(store, parent=a)
        c = await register(store)
        await update(store, SessionUpdateParams(session_id=c, parent=b))
        assert await parents(store) == {a: None, b: a, c: a}


async def test_update_that_would_create_a_cycle_is_refused(short_tmp: Path) -> None:
    """A under its own child is Conflict (a cycle), A under itself is BadArgs (as in
    session.register); nothing changes either way."""
    async with opened(short_tmp) as store:
        a = await register(store)
        b = await register(store, parent=a)
        before = await parents(store)
        with pytest.raises(Conflict, match="cycle"):
            await update(store, SessionUpdateParams(session_id=a, parent=b))
        with pytest.raises(BadArgs, match="own parent"):
            await update(store, SessionUpdateParams(session_id=a, parent=a))
        assert await parents(store) == before


async def test_update_clearing_parent_makes_the_row_top_level(short_tmp: Path) -> None:
    """parent=null detaches a sub-session."""
    async with opened(short_tmp) as store:
        a = await register(store)
        b = await register(store, parent=a)
        await update(store, SessionUpdateParams(session_id=b, parent=None))
        assert await parents(store) == {a: None, b: None}


async def test_update_missing_session_or_parent_is_not_found(short_tmp: Path) -> None:
    """Updating an unknown row, or linking to an unknown parent, is NotFound."""
    async with opened(short_tmp) as store:
        sid = await register(store)
        with pytest.raises(NotFound):
            await update(store, SessionUpdateParams(session_id=new_id(), name="x"))
        with pytest.raises(NotFound):
            await update(store, SessionUpdateParams(session_id=sid, parent=new_id()))
        assert (await parents(store)) == {sid: None}


async def test_update_to_a_taken_agent_session_id_is_a_conflict(
    short_tmp: Path,
) -> None:
    """Re-pointing a row at another row's agent
    session id is refused; both rows unchanged."""
    async with opened(short_tmp) as store:
        await register(store, agent_session_id="one")
        two = await register(store, agent_session_id="two")
        with pytest.raises(Conflict):
            await update(store, SessionUpdateParams(session_id=two, agent_session_id="one"))
        assert sorted(r.agent_session_id for r in await rows(store)) == ["one", "two"]


# --- remove
# ----------------------------------------------------------------------------------


async def test_remove_makes_children_top_level(short_tmp: Path) -> None:
    """Deleting a parent leaves its sub-sessions in the fleet as top-level rows."""
    async with opened(short_tmp) as store:
        a = await register(store)
        b = await register(store, parent=a)
        c = await register(store, parent=a)
        other = await register(store)
        d = await register(store, parent=other)
        result = await remove(store, a)
        assert (result.session_id, result.removed) == (a, True)
        assert await parents(store) == {b: None, c: None, other: None, d: other}


async def test_remove_unknown_session_is_not_found(short_tmp: Path) -> None:
    """Removing a row that is not there is NotFound."""
    async with opened(short_tmp) as store:
        with pytest.raises(NotFound):
            await remove(store, new_id())


# --- list
# ------------------------------------------------------------------------------------


async def test_list_is_in_stored_order_and_pages_with_a_cursor(short_tmp: Path) -> None:
    """Pages of `limit` rows in insertion order;
    next_cursor is None exactly on the last page."""
    async with opened(short_tmp) as store:
        ids = [await register(store, name=str(i)) for i in range(7)]
        seen: list[str] = []
        cursors = []
        cursor = None
        while True:
            page = await list_page(store, 3, cursor)
            assert len(page.sessions) <= 3
            seen += [r.session_id for r in page.sessions]
            cursors.append(page.next_cursor)
            if page.next_cursor is None:
                break
            cursor = page.next_cursor
        assert seen == ids
        assert len(cursors) == 3 and cursors[-1] is None
        exact = await list_page(store, 7, None)
        assert [r.session_id for r in exact.sessions] == ids
        assert exact.next_cursor is None


# --- write_fleet
# -----------------------------------------------------------------------------


async def test_write_fleet_never_drops_rows_it_was_not_given(short_tmp: Path) -> None:
    """A fleet write with only new rows keeps every stored row."""
    async with opened(short_tmp) as store:
        a = await register(store, name="a")
        b = await register(store, name="b", parent=a)
        c = new_id()
        result = await write_fleet(store, [entry(c, name="c")], [])
        assert (result.written, result.removed, result.dropped) == (1, 0, [])
        assert [(r.session_id, r.name, r.parent) for r in await rows(store)] == [
            (a, "a", None),
            (b, "b", a),
            (c, "c", None),
        ]


async def test_write_fleet_replaces_given_rows_wholesale(short_tmp: Path) -> None:
    """A given row is replaced: fields left out are cleared, stored position is kept."""
    async with opened(short_tmp) as store:
        a = await register(store, name="a", prompt="keep?", pinned=True)
        b = await register(store, name="b")
        await write_fleet(store, [entry(a, name="A2")], [])
        [row_a, row_b] = await rows(store)
        assert (row_a.session_id, row_a.name, row_a.prompt, row_a.pinned) == (
            a,
            "A2",
            None,
            False,
        )
        assert (row_b.session_id, row_b.name) == (b, "b")


async def test_write_fleet_dedup_keeps_the_last_written(short_tmp: Path) -> None:
    """Among given entries sharing an agent session id only the last written is kept."""
    first, second, third = new_id(), new_id(), new_id()
    async with opened(short_tmp) as store:
        result = await write_fleet(
            store,
            [
                entry(first, agent_session_id="X", name="1"),
                entry(second, agent_session_id="X", name="2"),
                entry(third, agent_session_id="Y", name="3"),
            ],
            [],
        )
        assert result.written == 2
        assert result.dropped == sorted([first])
        assert [(r.session_id, r.agent_session_id, r.name) for r in await rows(store)] == [
            (second, "X", "2"),
            (third, "Y", "3"),
        ]


async def test_write_fleet_same_session_given_twice_keeps_the_last(
    short_tmp: Path,
) -> None:
    """A session id repeated in one write is written once, with its last fields."""
    sid = new_id()
    async with opened(short_tmp) as store:
        result = await write_fleet(store, [entry(sid, name="old"), entry(sid, name="new")], [])
        assert (result.written, result.dropped) == (1, [])
        assert [(r.session_id, r.name) for r in await rows(store)] == [(sid, "new")]


async def test_write_fleet_dedup_drops_a_stored_row_and_relinks_its_children(
    short_tmp: Path,
) -> None:
    """A stored row replaced by a newer one sharing its agent session id is
    deleted, and its stored (unmentioned) children follow to the survivor."""
    async with opened(short_tmp) as store:
        old = await register(store, agent_session_id="X")
        child = await register(store, parent=old)
        new = new_id()
        result = await write_fleet(
            store,
            [entry(old, agent_session_id="X"), entry(new, agent_session_id="X")],
            [],
        )
        assert result.dropped == [old]
        assert result.relinked == 1
        assert await parents(store) == {child: new, new: None}
        assert [r.agent_session_id for r in await rows(store) if r.session_id == new] == ["X"]


async def test_write_fleet_row_that_replaced_its_parent_takes_that_parents_link(
    short_tmp: Path,
) -> None:
    """Seed rule 1: C resumes P's agent session and
    named P as parent: C goes under P's parent G."""
    g, p, c = new_id(), new_id(), new_id()
    async with opened(short_tmp) as store:
        result = await write_fleet(
            store,
            [
                entry(g),
                entry(p, agent_session_id="X", parent=g),
                entry(c, agent_session_id="X", parent=p),
            ],
            [],
        )
        assert result.dropped == [p]
        assert await parents(store) == {g: None, c: g}


async def test_write_fleet_unmentioned_stored_holder_of_agent_session_conflicts(
    short_tmp: Path,
) -> None:
    """A kept entry may not silently take the agent session of a stored row the
    write does not mention: Conflict, and nothing of the write is applied."""
    async with opened(short_tmp) as store:
        holder = await register(store, agent_session_id="X", name="holder")
        before = all_session_rows(short_tmp)
        innocent, taker = new_id(), new_id()
        with pytest.raises(Conflict) as caught:
            await write_fleet(
                store,
                [entry(innocent, name="innocent"), entry(taker, agent_session_id="X")],
                [],
            )
        assert caught.value.data == {"agent_session_id": "X", "session_id": holder}
        assert all_session_rows(short_tmp) == before


async def test_write_fleet_listing_the_holder_in_removed_replaces_it(
    short_tmp: Path,
) -> None:
    """The documented way out of that conflict: list the stored holder in `removed`."""
    async with opened(short_tmp) as store:
        holder = await register(store, agent_session_id="X")
        taker = new_id()
        result = await write_fleet(store, [entry(taker, agent_session_id="X")], [holder])
        assert (result.written, result.removed) == (1, 1)
        assert [(r.session_id, r.agent_session_id) for r in await rows(store)] == [(taker, "X")]


async def test_write_fleet_can_move_agent_sessions_between_given_rows(
    short_tmp: Path,
) -> None:
    """Swapping agent session ids between two rewritten
    stored rows does not trip the unique index."""
    async with opened(short_tmp) as store:
        a = await register(store, agent_session_id="X")
        b = await register(store, agent_session_id="Y")
        await write_fleet(
            store,
            [entry(a, agent_session_id="Y"), entry(b, agent_session_id="X")],
            [],
        )
        assert [(r.session_id, r.agent_session_id) for r in await rows(store)] == [
            (a, "Y"),
            (b, "X"),
        ]


async def test_write_fleet_removed_deletes_and_children_become_top_level(
    short_tmp: Path,
) -> None:
    """`removed` deletes rows; a stored child of a removed row becomes top-level."""
    async with opened(short_tmp) as store:
        a = await register(store)
        b = await register(store, parent=a)
        c = await register(store)
        result = await write_fleet(store, [], [a, new_id()])
        assert result.removed == 1
        assert result.relinked == 1
        assert await parents(store) == {b: None, c: None}


async def test_write_fleet_refuses_a_row_both_written_and_removed(
    short_tmp: Path,
) -> None:
    """Writing and removing one session in one call is BadArgs; nothing changes."""
    async with opened(short_tmp) as store:
        a = await register(store, name="a")
        with pytest.raises(BadArgs):
            await write_fleet(store, [entry(a, name="b")], [a])
        assert [r.name for r in await rows(store)] == ["a"]


async def test_write_fleet_breaks_cycles_and_flattens(short_tmp: Path) -> None:
    """Given links a->b->c->a and d->c: a (first
    written) is top-level, everything under it."""
    a, b, c, d = (new_id() for _ in range(4))
    async with opened(short_tmp) as store:
        result = await write_fleet(
            store,
            [
                entry(a, parent=b),
                entry(b, parent=c),
                entry(c, parent=a),
                entry(d, parent=c),
            ],
            [],
        )
        assert await parents(store) == {a: None, b: a, c: a, d: a}
        # a lost its link b; b moved from c to a; d moved from c to a; c kept a.
        assert result.relinked == 3


async def test_write_fleet_cycle_with_stored_rows_breaks_at_first_stored(
    short_tmp: Path,
) -> None:
    """A new entry closing a cycle with stored
    rows breaks it at the row stored first."""
    async with opened(short_tmp) as store:
        a = await register(store)
        b = await register(store, parent=a)
        # Rewrite a under b: a <-> b; a was stored first, so a stays top-level.
        await write_fleet(store, [entry(a, parent=b)], [])
        assert await parents(store) == {a: None, b: a}


async def test_write_fleet_link_to_an_unknown_row_becomes_top_level(
    short_tmp: Path,
) -> None:
    """A given parent the fleet does not hold is cleared rather than stored dangling."""
    a = new_id()
    async with opened(short_tmp) as store:
        result = await write_fleet(store, [entry(a, parent=new_id())], [])
        assert result.relinked == 1
        assert await parents(store) == {a: None}


async def test_write_fleet_link_to_a_dropped_row_follows_to_its_survivor(
    short_tmp: Path,
) -> None:
    """A given child of an entry dropped by de-dup
    goes under the entry that replaced it."""
    old, new, child = new_id(), new_id(), new_id()
    async with opened(short_tmp) as store:
        result = await write_fleet(
            store,
            [
                entry(old, agent_session_id="X"),
                entry(child, parent=old),
                entry(new, agent_session_id="X"),
            ],
            [],
        )
        assert result.dropped == [old]
        assert await parents(store) == {child: new, new: None}


# --- ownership between daemons
# ------------------------------------------------------------------


async def _fleet_of_daemon_a(root: Path) -> tuple[str, int, str, str]:
    """Daemon A (the state dir's own id) started twice, owning a top row and a child."""
    async with opened(root):
        pass
    async with opened(root) as store:
        top = await register(store, agent_session_id="shared-agent")
        child = await register(store, parent=top)
        return store.daemon_id, store.owner_epoch, top, child


async def test_other_daemons_rows_are_invisible_and_refuse_writes(
    short_tmp: Path,
) -> None:
    """A second daemon on the same file sees only its rows; every write that touches A's
    rows raises StaleEpoch naming both daemons and both epochs, and changes nothing."""
    daemon_a, epoch_a, top, child = await _fleet_of_daemon_a(short_tmp)
    daemon_b = new_id()
    before = all_session_rows(short_tmp)
    async with opened(short_tmp, daemon_id=daemon_b) as store:
        assert (store.daemon_id, store.owner_epoch) == (daemon_b, 1)
        assert epoch_a == 2
        own = await register(store, agent_session_id="shared-agent")  # per-daemon uniqueness
        assert [r.session_id for r in await rows(store)] == [own]
        with pytest.raises(NotFound):
            await store.read(fleet.get_session, top)

        attempts = [
            (fleet.update_session, (caller(), SessionUpdateParams(session_id=top, name="mine"))),
            (fleet.remove_session, (caller(), SessionIdParams(child))),
            (fleet.write_fleet, (caller(), FleetWriteParams([entry(top)], []))),
            (fleet.write_fleet, (caller(), FleetWriteParams([], [child]))),
            (fleet.insert_session, (register_params(session_id=top),)),
        ]
        for fn, args in attempts:
            with pytest.raises(StaleEpoch) as caught:
                await store.write(fn, *args)
            message = caught.value.message
            assert daemon_a in message and f"epoch {epoch_a}" in message, message
            assert daemon_b in message and "epoch 1" in message, message
            assert caught.value.data["owner_daemon_id"] == daemon_a
            assert caught.value.data["owner_epoch"] == epoch_a
            assert (caught.value.data["daemon_id"], caught.value.data["epoch"]) == (
                daemon_b,
                1,
            )
        assert not store.superseded.is_set()
    after = [row for row in all_session_rows(short_tmp) if row[0] != own]
    assert after == before


async def test_adopt_moves_the_other_daemons_rows_and_logs_it(short_tmp: Path) -> None:
    """fleet.adopt moves every row of A to B at B's
    epoch (links kept) and writes operator_log."""
    daemon_a, _, top, child = await _fleet_of_daemon_a(short_tmp)
    daemon_b = new_id()
    async with opened(short_tmp, daemon_id=daemon_b) as store:
        result = await adopt(store, "ops", daemon_a)
        assert (result.adopted, result.from_daemon_id) == (2, daemon_a)
        assert (result.daemon_id, result.owner_epoch) == (daemon_b, store.owner_epoch)
        assert await parents(store) == {top: None, child: top}
        assert {(r.daemon_id, r.owner_epoch) for r in await rows(store)} == {(daemon_b, 1)}
        # Adopted rows are now writable by B.
        row = await update(store, SessionUpdateParams(session_id=top, name="b"))
        assert row.name == "b"
    log = query(short_tmp, "SELECT daemon_id, principal, action, detail FROM operator_log")
    assert [(d, p, a, json.loads(detail)) for d, p, a, detail in log] == [
        (
            daemon_b,
            "ops",
            "fleet.adopt",
            {"from_daemon_id": daemon_a, "adopted": 2, "keys_adopted": 0},
        )
    ]
    # And A, restarted, no longer owns anything.
    async with opened(short_tmp) as store:
        assert store.daemon_id == daemon_a
        assert await rows(store) == []


@pytest.mark.parametrize("state", ["present", "lapsed"])
async def test_a_shared_store_adopts_no_box_that_is_not_dead(short_tmp: Path, state: str) -> None:
    """On a store several boxes share, a box still present, or silent past the TTL but
    not yet declared dead, runs agents only it may check: adopting it is refused
    (conflict, naming its state) and moves nothing. The embedded store has no presence:
    there the same adoption goes through."""
    daemon_a, _, top, child = await _fleet_of_daemon_a(short_tmp)
    async with opened(short_tmp, daemon_id=new_id()) as store:
        await store.write(  # its last heartbeat: now, or long ago (no one declared it dead)
            lambda tx: tx.conn.execute(
                "UPDATE daemons SET presence_at = ? WHERE daemon_id = ?",
                (tx.now if state == "present" else 0, daemon_a),
            )
        )

        def adopt_as(one_box: bool) -> Any:
            def run(tx: Tx, *args: Any) -> Any:
                return fleet.adopt_fleet(msgspec.structs.replace(tx, one_box=one_box), *args)

            return store.write(run, caller("ops"), FleetAdoptParams(daemon_a))

        with pytest.raises(Conflict) as refused:
            await adopt_as(one_box=False)
        assert refused.value.data == {"daemon_id": daemon_a, "state": state}
        assert "towerctl boxes" in refused.value.message
        assert await rows(store) == []
        assert (await adopt_as(one_box=True)).adopted == 2


@pytest.mark.parametrize("one_box", [False, True])
async def test_an_adopted_box_s_unsettled_keys_are_not_probed_by_its_adopter(
    short_tmp: Path, one_box: bool
) -> None:
    """On a store several boxes share, an adopted box's outcome_unknown keys lose their
    probe (kept in the operator log): their holders' pids were taken for the adopting
    box's own, and a box declared dead while only cut off still ran the command when the
    adopter's probe said it had not happened and released the key, and a retry ran it a
    second time (a hostile tester's reproducer, two boxes in two pid namespaces). On the
    embedded store every pid is this machine's: the probe stays."""
    daemon_a, *_ = await _fleet_of_daemon_a(short_tmp)
    async with opened(short_tmp) as store:  # box a: a key whose claimant is gone
        params = IdemClaimParams("shell", "deploy", payload=["cmd"], probe="test -f marker",
                                 probe_cwd="/")  # fmt: skip
        await store.write(idempotency.claim, caller("ops", DEAD), params)
        await store.write(liveness.settle, [DEAD])
    async with opened(short_tmp, daemon_id=new_id()) as store:
        await store.write(
            lambda tx: tx.conn.execute(
                "UPDATE daemons SET dead_at = ? WHERE daemon_id = ?", (tx.now, daemon_a)
            )
        )

        def run(tx: Tx, *args: Any) -> Any:
            return fleet.adopt_fleet(msgspec.structs.replace(tx, one_box=one_box), *args)

        assert (await store.write(run, caller("ops"), FleetAdoptParams(daemon_a))).keys_adopted
        to_probe = [k.key for k in await store.read(idempotency.keys_to_probe, False)]
        key = await store.read(idempotency.get, caller("ops"), IdemKeyParams("shell", "deploy"))
    assert key.state == "outcome_unknown"
    assert to_probe == ([] if not one_box else ["deploy"])
    [detail] = [json.loads(d) for (d,) in query(short_tmp, "SELECT detail FROM operator_log")]
    if not one_box:
        assert detail["keys_not_probed"] == 1
        assert detail["probes"] == [{"principal": "ops", "operation": "shell", "key": "deploy",
                                     "probe": "test -f marker", "cwd": "/"}]  # fmt: skip
    else:
        assert "probes" not in detail


async def test_adopt_refuses_unknown_daemon_self_and_agent_session_clash(
    short_tmp: Path,
) -> None:
    """Adopting an unrecorded daemon is NotFound,
    oneself BadArgs, a shared agent session Conflict."""
    daemon_a, _, _, _ = await _fleet_of_daemon_a(short_tmp)
    async with opened(short_tmp, daemon_id=new_id()) as store:
        with pytest.raises(NotFound):
            await adopt(store, "ops", new_id())
        with pytest.raises(BadArgs):
            await adopt(store, "ops", store.daemon_id)
        await register(store, agent_session_id="shared-agent")
        with pytest.raises(Conflict):
            await adopt(store, "ops", daemon_a)
        assert len(await rows(store)) == 1
    assert query(short_tmp, "SELECT count(*) FROM operator_log") == [(0,)]


# --- a superseded epoch
# -----------------------------------------------------------------------------


async def test_bumped_epoch_refuses_the_next_write_and_sets_superseded(
    short_tmp: Path,
) -> None:
    """Once the daemons row moves to a later epoch, the next write
    raises StaleEpoch (both epochs named), nothing is written,
    store.superseded is set and later writes are Unavailable."""
    async with opened(short_tmp) as store:
        await register(store)
        execute(
            short_tmp,
            "UPDATE daemons SET owner_epoch = owner_epoch + 1 WHERE daemon_id = ?",
            (store.daemon_id,),
        )
        with pytest.raises(StaleEpoch) as caught:
            await register(store, name="late")
        message = caught.value.message
        assert store.daemon_id in message
        assert f"at epoch {store.owner_epoch}" in message
        assert f"at epoch {store.owner_epoch + 1}" in message
        assert caught.value.data == {
            "daemon_id": store.daemon_id,
            "epoch": store.owner_epoch,
        }
        assert store.superseded.is_set()
        with pytest.raises(Unavailable):
            await register(store, name="later")
    assert [r[0] for r in query(short_tmp, "SELECT name FROM sessions")] == [None]


async def test_deleted_daemon_record_also_supersedes_the_store(short_tmp: Path) -> None:
    """If the daemon's record is gone the write is StaleEpoch ("gone") and the
    store must count as superseded too, so the process stops serving writes."""
    async with opened(short_tmp) as store:
        execute(short_tmp, "DELETE FROM daemons WHERE daemon_id = ?", (store.daemon_id,))
        with pytest.raises(StaleEpoch, match="gone"):
            await register(store)
        assert store.superseded.is_set()
        with pytest.raises(Unavailable):
            await register(store)
    assert query(short_tmp, "SELECT count(*) FROM sessions") == [(0,)]


async def test_write_fleet_moves_unmentioned_children_of_a_new_sub_session(
    short_tmp: Path,
) -> None:
    """A stored row rewritten under a new parent takes its stored children
    (not mentioned in the write) along, so the fleet stays one level deep."""
    async with opened(short_tmp) as store:
        a = await register(store)
        child = await register(store, parent=a)
        top = new_id()
        result = await write_fleet(store, [entry(top), entry(a, parent=top)], [])
        assert result.relinked == 1
        assert await parents(store) == {a: top, child: top, top: None}


def _snapshot(rows_: list[SessionRow]) -> dict[str, tuple[object, ...]]:
    return {r.session_id: (r.agent_session_id, r.name, r.parent) for r in rows_}


async def test_random_fleet_writes_keep_every_invariant(short_tmp: Path) -> None:
    """Property over 150 random fleet writes on one store: after
    each, the fleet is a one-level forest of its own rows with unique
    agent sessions; rows the write did not name are still there; kept
    entries hold their fields; a refused write changes nothing."""
    rng = random.Random(20240611)
    pool = [new_id() for _ in range(14)]
    agents = [None, None, "A", "B", "C", "D"]
    async with opened(short_tmp) as store:
        for step in range(150):
            before = _snapshot(await rows(store))
            entries = [
                entry(
                    rng.choice(pool),
                    agent_session_id=rng.choice(agents),
                    name=f"s{step}",
                    parent=rng.choice([None, None, *pool]),
                )
                for _ in range(rng.randint(0, 5))
            ]
            given = {e.session_id for e in entries}
            removed = [sid for sid in rng.sample(pool, 2) if sid not in given]
            try:
                result = await write_fleet(store, entries, removed)
            except Conflict:
                assert _snapshot(await rows(store)) == before, step
                continue
            after = _snapshot(await rows(store))
            for sid, (_agent, _name, parent) in after.items():
                assert parent is None or after[parent][2] is None, (step, sid)
            held = [agent for agent, _, _ in after.values() if agent is not None]
            assert len(held) == len(set(held)), step
            gone = set(removed) | set(result.dropped)
            for sid, (agent, name, _parent) in before.items():
                if sid not in given and sid not in gone:
                    assert after[sid][:2] == (agent, name), (step, sid)
            last = {e.session_id: e for e in entries}
            for sid, e in last.items():
                if sid not in result.dropped:
                    assert after[sid][:2] == (e.agent_session_id, e.name), (step, sid)
            assert not (gone & after.keys()), step


@pytest.mark.anyio
async def test_adopt_takes_the_gone_daemons_keys_and_reconciles_them(short_tmp: Path) -> None:
    """fleet.adopt also takes the other daemon's idempotency keys: its in-progress keys
    become outcome_unknown unless their evidence exists (then completed); this daemon's
    own in-progress keys are untouched."""
    gone = "00000000-0000-4000-8000-0000000000aa"
    async with opened(short_tmp, daemon_id=gone) as theirs:
        with_row = await theirs.write(
            idempotency.claim, caller("p"), IdemClaimParams(operation="session.spawn", key="a")
        )
        await theirs.write(
            fleet.register_session,
            caller("p"),
            SessionRegisterParams(cwd="/r", agent="x", session_id=with_row.effect_ref),
        )
        await theirs.write(
            idempotency.claim, caller("p"), IdemClaimParams(operation="session.spawn", key="b")
        )
    async with opened(short_tmp) as ours:
        await ours.write(idempotency.claim, caller("p"), IdemClaimParams(operation="mine", key="c"))
        result = await adopt(ours, "operator", gone)
        assert (result.adopted, result.keys_adopted) == (1, 2)
        assert (result.keys_marked_unknown, result.keys_completed_from_evidence) == (1, 1)
        assert (
            await ours.read(idempotency.get, caller("p"), IdemKeyParams("session.spawn", "a"))
        ).state == "completed"
        assert (
            await ours.read(idempotency.get, caller("p"), IdemKeyParams("session.spawn", "b"))
        ).state == "outcome_unknown"
        assert (
            await ours.read(idempotency.get, caller("p"), IdemKeyParams("mine", "c"))
        ).state == "in_progress"
