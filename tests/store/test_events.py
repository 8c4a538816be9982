"""The hook event trail, session messages and the restore plan, on a real store.

Every test runs store functions in the real writer (``store.write``) or reader
(``store.read``) on a real SQLite file. The clock is moved by running a store
function on a Tx whose ``now`` is shifted or set (``at``, ``clock``), never by
sleeping. Another daemon's rows are written by opening the same file under
another daemon id; a restart is closing the store and opening it again.
"""

from __future__ import annotations

import dataclasses
import sqlite3
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import Any

import msgspec
import pytest

from store_helpers import (
    caller,
    clock,
    configured,
    db_path,
    entry,
    new_id,
    opened,
    query,
    register,
    register_old_row,
    register_params,
    sql,
    state_dir,
)
from towerd.daemon.processes import Holder
from towerd.daemon.store import (
    Store,
    events,
    fleet,
    idempotency,
    messages,
    reconcile,
    retention,
    schema,
)
from towerd.daemon.store.tx import PAGE_BYTES, Caller, Tx, now_ms, pack
from towerd.protocol.changes import IdemChanged
from towerd.protocol.errors import BadArgs, Conflict, IdempotencyConflict, NotFound
from towerd.protocol.methods import (
    DEFAULT_EVENT_MAX_PAYLOAD,
    EventListParams,
    EventListResult,
    EventRecordParams,
    EventRecordResult,
    FleetWriteParams,
    IdemClaimParams,
    IdemClaimResult,
    IdemKeyParams,
    IdemRecord,
    MessageAckParams,
    MessageListParams,
    MessageListResult,
    MessageRecord,
    RestorePlanEntry,
    RestorePlanParams,
    SessionActivity,
    SessionActivityParams,
    SessionIdParams,
    SessionMessageParams,
    SessionMessageResult,
    SessionRemoveResult,
    SessionUpdateParams,
    TrailEvent,
)

pytestmark = pytest.mark.anyio

ME = "alice"
OTHER_DAEMON = "d-other"
HOLDER = Holder(pid=777, start=1)  # a claimant; no liveness sweep runs at store level
T0 = 1_800_000_000_000  # a fixed clock reading the tests build on
DAY = 86_400_000
NO_SESSION = "00000000-0000-4000-8000-000000000000"  # a valid session id no row has
# Who records the events here: no principal, so no quota counts them and their rows
# hold no principal (the handler passes the connection's principal).
NO_PRINCIPAL = Caller(principal=None, pid=0, holder=None)  # type: ignore[arg-type]


# --- clock ---------------------------------------------------------------------------------


# --- store helpers -------------------------------------------------------------------------


async def record(
    store: Store,
    kind: str,
    session_id: str | None = None,
    agent_session_id: str | None = None,
    payload: Any = None,
    *,
    now: int | None = None,
    max_payload: int = DEFAULT_EVENT_MAX_PAYLOAD,
) -> EventRecordResult:
    """event.record as its handler runs it (by ``NO_PRINCIPAL``), at ``now`` when given."""
    fn = configured(events.record, event_max_payload=max_payload)
    if now is not None:
        fn = clock(now, fn)
    params = EventRecordParams(kind, session_id, agent_session_id, payload)
    return await store.write(fn, NO_PRINCIPAL, params)


async def listed(
    store: Store,
    session_ids: list[str] | None = None,
    agent_session_ids: list[str] | None = None,
    kinds: list[str] | None = None,
    before: int | None = None,
    limit: int = 50,
    budget: int = PAGE_BYTES,
) -> tuple[list[int], int | None]:
    """event.list as its handler runs it -> (event ids of the page, next_before)."""
    params = EventListParams(session_ids, agent_session_ids, kinds, before, limit)
    page = await event_page(store, params, budget)
    return [event.event_id for event in page.events], page.next_before


async def event_page(
    store: Store, params: EventListParams, budget: int = PAGE_BYTES
) -> EventListResult:
    """event.list of a daemon whose pages hold ``budget`` bytes (half its max frame)."""
    fn = configured(events.list_events, max_frame=2 * budget)
    return await store.read(fn, caller(ME), params)


def own_box(store: Store) -> str | None:
    """The daemon_id filter that shows this daemon's sessions only: none on the embedded
    store (its default), this daemon's id on a shared one (whose default is every box's:
    tests/store/test_boxes_store.py)."""
    return None if store.one_box else store.daemon_id


async def activity(store: Store, session_ids: list[str] | None = None) -> list[SessionActivity]:
    params = SessionActivityParams(session_ids, daemon_id=own_box(store))
    return (await store.read(events.activity, caller(ME), params)).sessions


async def plan(store: Store) -> list[RestorePlanEntry]:
    params = RestorePlanParams(daemon_id=own_box(store))
    return (await store.read(events.restore_plan, caller(ME), params)).sessions


async def insert_at(store: Store, now: int, **fields: Any) -> str:
    """Register one fleet row whose updated_at is ``now``."""
    return await store.write(clock(now, fleet.insert_session), register_params(**fields))


def watching(store: Store) -> list[tuple[str, Any]]:
    """Collect the change notes of every committed batch, as the watch hub gets them."""
    notes: list[tuple[str, Any]] = []
    store.on_changes = notes.extend
    return notes


def message_params(session_id: str, text: str = "hello", key: str | None = None) -> Any:
    return SessionMessageParams(session_id=session_id, text=text, idempotency_key=key)


async def send(
    store: Store, session_id: str, text: str = "hello", key: str | None = None, **kw: Any
) -> SessionMessageResult:
    principal = kw.pop("principal", ME)
    fn = messages.send if "now" not in kw else clock(kw.pop("now"), messages.send)
    return await store.write(fn, caller(principal, HOLDER), message_params(session_id, text, key))


async def ack(store: Store, message_id: str, status: str, now: int | None = None) -> MessageRecord:
    fn = messages.ack if now is None else clock(now, messages.ack)
    params = MessageAckParams(message_id, status)  # type: ignore[arg-type]
    return await store.write(fn, caller(ME), params)


async def message_list(
    store: Store, session_id: str, status: str | None = None, limit: int = 100
) -> MessageListResult:
    params = MessageListParams(session_id, status, limit)  # type: ignore[arg-type]
    return await store.read(messages.list_messages, caller(ME), params)


async def remove(store: Store, session_id: str) -> SessionRemoveResult:
    return await store.write(fleet.remove_session, caller(ME), SessionIdParams(session_id))


async def idem_claim(store: Store, params: IdemClaimParams) -> IdemClaimResult:
    return await store.write(idempotency.claim, caller(ME, HOLDER), params)


async def idem_get(store: Store, operation: str, key: str) -> IdemRecord:
    return await store.read(idempotency.get, caller(ME), IdemKeyParams(operation, key))


async def message_rows(store: Store) -> list[tuple[Any, ...]]:
    return await sql(
        store, "SELECT message_id, session_id, text, status FROM messages ORDER BY rowid"
    )


async def other_daemon_session(root: Path, **fields: Any) -> str:
    """A live row of another daemon sharing this store file (opened under its own id)."""
    async with opened(root, daemon_id=OTHER_DAEMON) as other:
        return await register(other, **fields)


# --- event.record ------------------------------------------------------------------------


def batch_clock(tx: Tx) -> int:
    return tx.now


async def test_record_files_the_event_under_the_session_and_its_agent_session(
    short_tmp: Path,
) -> None:
    """With a session id, the agent session id comes from the fleet row; the row holds
    the daemon's clock, the msgpack payload and this daemon's id; the TrailEvent is
    noted for the events topic. A session without an agent session id files none."""
    async with opened(short_tmp) as store:
        session = await register(store, agent_session_id="as-1")
        bare = await register(store)  # no agent session id
        notes = watching(store)
        # The batches' clock (towerd's own on SQLite, the server's on PostgreSQL; the
        # test process's now_ms() is towerd's clock, some ms off the server's under load).
        before = await store.write(batch_clock)
        result = await record(store, "Notification", session, payload={"message": "hi"})
        assert result.session_id == session
        assert before <= result.at <= await store.write(batch_clock)
        [row] = await sql(store, "SELECT * FROM events")
        assert row == (
            result.event_id,
            session,
            "as-1",
            "Notification",
            result.at,
            pack({"message": "hi"}),
            store.daemon_id,
            None,
            None,
        )  # fmt: skip (principal, filing_key: an event.record has none)
        assert notes == [
            (
                "events",
                TrailEvent(
                    result.event_id, session, "as-1", "Notification", result.at, {"message": "hi"}
                ),
            )
        ]
        plain = await record(store, "Stop", bare)
        filed = "SELECT session_id, agent_session_id, payload FROM events WHERE event_id = ?"
        assert await sql(store, filed, (plain.event_id,)) == [(bare, None, pack(None))]
        assert plain.event_id > result.event_id


async def test_an_agent_session_id_alone_is_matched_to_this_daemons_session(
    short_tmp: Path,
) -> None:
    """Only an agent session id: the event is filed under this daemon's session holding
    it; an agent session id of another daemon's row, or of no row, is recorded under
    the agent session id alone (session_id null)."""
    theirs = await other_daemon_session(short_tmp, agent_session_id="as-theirs")
    async with opened(short_tmp) as store:
        mine = await register(store, agent_session_id="as-mine")
        matched = await record(store, "PreToolUse", agent_session_id="as-mine")
        foreign = await record(store, "PreToolUse", agent_session_id="as-theirs")
        unknown = await record(store, "PreToolUse", agent_session_id="as-nobody")
        assert [matched.session_id, foreign.session_id, unknown.session_id] == [mine, None, None]
        assert await sql(
            store, "SELECT session_id, agent_session_id FROM events ORDER BY event_id"
        ) == [(mine, "as-mine"), (None, "as-theirs"), (None, "as-nobody")]
        # Another daemon's session id is not this daemon's to file under.
        with pytest.raises(NotFound) as foreign_session:
            await record(store, "Stop", theirs)
        assert foreign_session.value.data == {"session_id": theirs}


async def test_record_refusals_write_nothing(short_tmp: Path) -> None:
    """Neither id: BadArgs. An unknown session id: NotFound naming it. A payload over the
    limit as msgpack: BadArgs with both sizes; exactly at the limit is accepted. A refusal
    writes no row and tells no watcher."""
    async with opened(short_tmp) as store:
        session = await register(store, agent_session_id="as-1")
        notes = watching(store)
        with pytest.raises(BadArgs) as neither:
            await record(store, "Stop")
        assert "session_id or an agent_session_id" in neither.value.message
        missing = NO_SESSION
        with pytest.raises(NotFound) as unknown:
            await record(store, "Stop", missing)
        assert unknown.value.data == {"session_id": missing}

        payload = {"text": "x" * 100}
        size = len(pack(payload))
        with pytest.raises(BadArgs) as too_big:
            await record(store, "Stop", session, payload=payload, max_payload=size - 1)
        assert too_big.value.data == {"bytes": size, "max_bytes": size - 1}
        assert f"{size} bytes" in too_big.value.message
        assert await sql(store, "SELECT count(*) FROM events") == [(0,)]
        assert notes == []

        exact = await record(store, "Stop", session, payload=payload, max_payload=size)
        assert await sql(store, "SELECT event_id FROM events") == [(exact.event_id,)]
        assert [topic for topic, _ in notes] == ["events"]


# --- event.list ----------------------------------------------------------------------------


@dataclasses.dataclass
class Trail:
    """Three sessions and an agent-only session with one event each, oldest first:
    a (as-a) SessionStart, b (as-b) Notification, c (as-c) Stop, z (as-z, no row)
    PreToolUse; plus a heartbeat of a (newest)."""

    a: str
    b: str
    c: str
    ids: dict[str, int]  # a, b, c, z, beat -> event id


async def trail(store: Store) -> Trail:
    a, b, c = [await register(store, agent_session_id=f"as-{name}") for name in "abc"]
    ids = {
        "a": (await record(store, "SessionStart", a)).event_id,
        "b": (await record(store, "Notification", b)).event_id,
        "c": (await record(store, "Stop", c)).event_id,
        "z": (await record(store, "PreToolUse", agent_session_id="as-z")).event_id,
        "beat": (await record(store, events.HEARTBEAT, a)).event_id,
    }
    return Trail(a, b, c, ids)


SCOPES: list[tuple[str, Callable[[Trail], dict[str, Any]], list[str]]] = [
    ("no lists: no filter", lambda t: {}, ["z", "c", "b", "a"]),
    ("session ids only", lambda t: {"session_ids": [t.a, t.c]}, ["c", "a"]),
    ("agent ids only", lambda t: {"agent_session_ids": ["as-b", "as-z"]}, ["z", "b"]),
    (
        "both lists: OR",
        lambda t: {"session_ids": [t.a], "agent_session_ids": ["as-z"]},
        ["z", "a"],
    ),
    (
        "both lists naming the same session",
        lambda t: {"session_ids": [t.b], "agent_session_ids": ["as-b"]},
        ["b"],
    ),
    ("empty session list", lambda t: {"session_ids": []}, []),
    ("empty agent list", lambda t: {"agent_session_ids": []}, []),
    ("both lists empty", lambda t: {"session_ids": [], "agent_session_ids": []}, []),
    (
        "empty list OR a given one",
        lambda t: {"session_ids": [], "agent_session_ids": ["as-b"]},
        ["b"],
    ),
    (
        "given list OR an empty one",
        lambda t: {"session_ids": [t.c], "agent_session_ids": []},
        ["c"],
    ),
    ("unknown ids", lambda t: {"session_ids": [NO_SESSION], "agent_session_ids": ["x"]}, []),
]


@pytest.mark.parametrize(
    ("scope", "expected"),
    [pytest.param(scope, expected, id=name) for name, scope, expected in SCOPES],
)
async def test_event_list_scope(
    short_tmp: Path, scope: Callable[[Trail], dict[str, Any]], expected: list[str]
) -> None:
    """An absent id list does not filter, an empty one matches nothing, the given ones
    combine with OR; newest first; the heartbeat stays out of every trail."""
    async with opened(short_tmp) as store:
        t = await trail(store)
        assert await listed(store, **scope(t)) == ([t.ids[name] for name in expected], None)


async def test_event_list_kinds_and_heartbeats(short_tmp: Path) -> None:
    """kinds filters by kind; heartbeats are shown only when listed in kinds; an empty
    kinds list matches nothing; kinds combine with the id scope by AND."""
    async with opened(short_tmp) as store:
        t = await trail(store)
        ids = t.ids
        assert await listed(store, kinds=["Stop"]) == ([ids["c"]], None)
        assert await listed(store, kinds=["Stop", "SessionStart"]) == ([ids["c"], ids["a"]], None)
        assert await listed(store, kinds=[events.HEARTBEAT]) == ([ids["beat"]], None)
        assert await listed(store, kinds=[events.HEARTBEAT, "SessionStart"]) == (
            [ids["beat"], ids["a"]], None,
        )  # fmt: skip
        assert await listed(store, kinds=[]) == ([], None)
        assert await listed(store, session_ids=[t.a]) == ([ids["a"]], None)
        assert await listed(store, session_ids=[t.b], kinds=["Stop"]) == ([], None)
        assert await listed(store, session_ids=[t.a, t.c], kinds=["Stop", events.HEARTBEAT]) == (
            [ids["beat"], ids["c"]], None,
        )  # fmt: skip
        assert await listed(store, kinds=["stop"]) == ([], None)  # kinds are verbatim


async def test_a_restored_session_keeps_its_trail_through_its_agent_session_id(
    short_tmp: Path,
) -> None:
    """A session restored under a new towerd id (the old row removed, a new one holding
    the same agent session id): asked by agent session id, the trail spans both rows;
    asked by the new session id, only what was filed under it."""
    async with opened(short_tmp) as store:
        old = await register(store, agent_session_id="as-r")
        first = (await record(store, "SessionStart", old)).event_id
        second = (await record(store, "Stop", agent_session_id="as-r")).event_id
        await remove(store, old)
        new = await register(store, agent_session_id="as-r")
        third = await record(store, "UserPromptSubmit", agent_session_id="as-r")
        assert third.session_id == new
        assert await listed(store, agent_session_ids=["as-r"]) == (
            [third.event_id, second, first], None,
        )  # fmt: skip
        assert await listed(store, session_ids=[new]) == ([third.event_id], None)
        assert await listed(store, session_ids=[old]) == ([second, first], None)
        assert await listed(store, session_ids=[new], agent_session_ids=["as-r"]) == (
            [third.event_id, second, first], None,
        )  # fmt: skip


async def test_event_list_pages_newest_first_with_next_before(short_tmp: Path) -> None:
    """Pages of ``limit`` follow next_before to the oldest event; heartbeats in between
    do not take places in a page; the last page has no next_before (also when it is
    exactly full)."""
    async with opened(short_tmp) as store:
        session = await register(store)
        ids = []
        for n in range(7):
            ids.append((await record(store, "PreToolUse", session, payload={"n": n})).event_id)
            await record(store, events.HEARTBEAT, session)
        newest_first = ids[::-1]
        assert await listed(store, limit=3) == (newest_first[:3], newest_first[2])
        assert await listed(store, limit=3, before=newest_first[2]) == (
            newest_first[3:6], newest_first[5],
        )  # fmt: skip
        assert await listed(store, limit=3, before=newest_first[5]) == ([ids[0]], None)
        assert await listed(store, limit=7) == (newest_first, None)
        assert await listed(store, limit=6) == (newest_first[:6], newest_first[5])
        assert await listed(store, before=ids[0]) == ([], None)
        page = await event_page(store, EventListParams(limit=2))
        assert [e.payload for e in page.events] == [{"n": 6}, {"n": 5}]


async def test_event_list_pages_stop_at_the_byte_budget(short_tmp: Path) -> None:
    """A page stops before the budget would be passed (at least one event always);
    the pages, followed, hold every event once, newest first."""
    async with opened(short_tmp) as store:
        session = await register(store)
        big = {"text": "x" * 1000}
        ids = [(await record(store, "Stop", session, payload=big)).event_id for _ in range(5)]
        one = len(msgspec.msgpack.encode(TrailEvent(ids[0], session, None, "Stop", T0, big)))
        budget = 2 * one + one // 2  # room for two events, not three
        pages = []
        before = None
        while True:
            page, before = await listed(store, before=before, budget=budget)
            pages.append(page)
            if before is None:
                break
        assert pages == [[ids[4], ids[3]], [ids[2], ids[1]], [ids[0]]]
        assert await listed(store, budget=1) == ([ids[4]], ids[4])  # one even over budget


# --- session.activity --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kinds", "attention"),
    [
        (["SessionStart", "Notification"], "needs_you"),
        (["Notification", "Stop"], "done"),
        (["Stop", "SessionEnd"], "exited"),
        (["Notification", "UserPromptSubmit"], "running"),
        (["Stop", "PreToolUse"], "running"),
        (["Notification", "SubagentStop"], "running"),
        ([], "running"),
    ],
    ids=[
        "needs_you",
        "done",
        "exited",
        "prompt-running",
        "tool-running",
        "other-running",
        "no-events",
    ],
)
async def test_attention_follows_the_newest_event(
    short_tmp: Path, kinds: list[str], attention: str
) -> None:
    """Notification needs you, Stop is done, SessionEnd exited, any other kind running;
    no events: running with no activity."""
    async with opened(short_tmp) as store:
        session = await register(store, agent_session_id="as-1")
        for n, kind in enumerate(kinds):
            await record(store, kind, session, now=T0 + n)
        newest = (T0 + len(kinds) - 1, kinds[-1]) if kinds else (None, None)
        assert await activity(store) == [
            SessionActivity(session, *newest, attention, store.daemon_id)  # type: ignore[arg-type]
        ]


async def test_activity_of_exited_rows_heartbeats_and_agent_only_events(
    short_tmp: Path,
) -> None:
    """A row marked exited is exited whatever its events say; a heartbeat moves
    last_activity_at but not last_kind (so not attention); events filed under the
    agent session id alone count; session_ids picks rows; other daemons' rows are
    not listed."""
    await other_daemon_session(short_tmp, agent_session_id="as-theirs")
    async with opened(short_tmp) as store:
        gone = await register(store, exited=True)
        await record(store, "Notification", gone, now=T0)
        beating = await register(store, agent_session_id="as-b")
        await record(store, "Stop", beating, now=T0 + 10)
        await record(store, events.HEARTBEAT, beating, now=T0 + 20)
        # Recorded before its row existed: filed under the agent session id only.
        await record(store, "Notification", agent_session_id="as-late", now=T0 + 30)
        late = await register(store, agent_session_id="as-late")
        only_beats = await register(store)
        await record(store, events.HEARTBEAT, only_beats, now=T0 + 40)
        await record(store, "Notification", agent_session_id="as-theirs", now=T0 + 50)
        me = store.daemon_id
        assert await activity(store) == [
            SessionActivity(gone, T0, "Notification", "exited", me),
            SessionActivity(beating, T0 + 20, "Stop", "done", me),
            SessionActivity(late, T0 + 30, "Notification", "needs_you", me),
            SessionActivity(only_beats, T0 + 40, None, "running", me),
        ]
        assert await activity(store, [late, gone]) == [
            SessionActivity(gone, T0, "Notification", "exited", me),
            SessionActivity(late, T0 + 30, "Notification", "needs_you", me),
        ]
        assert await activity(store, []) == []


# --- fleet.restore_plan ------------------------------------------------------------------


async def test_restore_plan_newest_activity_first_parents_before_children(
    short_tmp: Path,
) -> None:
    """Newest activity first (the newest event, else last_attached_at, else updated_at);
    each top-level session immediately followed by its children, newest first; exited
    sessions left out; the child of an exited parent, or of a parent whose row is gone,
    is top-level; other daemons' rows are invisible."""
    await other_daemon_session(short_tmp, agent_session_id="as-theirs")
    async with opened(short_tmp) as store:
        p1 = await insert_at(store, T0, agent_session_id="as-p1", name="p1", model="opus",
                             effort="high", target="t", target_identity="ti",
                             transcript_path="/t/p1.jsonl", cwd="/src/one")  # fmt: skip
        c1 = await insert_at(store, T0, parent=p1, name="c1")
        c2 = await insert_at(store, T0, parent=p1, name="c2")
        p2 = await insert_at(store, T0, name="p2", last_attached_at=T0 + 4000)
        p3 = await insert_at(store, T0 + 2000, name="p3")
        ex = await insert_at(store, T0, name="exited", exited=True)
        orphan = await insert_at(store, T0, parent=ex, name="orphan")
        c_exited = await insert_at(store, T0, parent=p2, name="c-exited", exited=True)
        lost_parent = await insert_at(store, T0, name="lost-parent")
        stray = await insert_at(store, T0, parent=lost_parent, name="stray")
        await record(store, "Stop", p1, now=T0 + 5000)
        await record(store, events.HEARTBEAT, c1, now=T0 + 1000)
        await record(store, "Notification", c2, now=T0 + 3000)
        await record(store, "Stop", ex, now=T0 + 9000)
        await record(store, "Stop", c_exited, now=T0 + 9000)
        await record(store, "PreToolUse", orphan, now=T0 + 4500)
        await record(store, "PreToolUse", stray, now=T0 + 100)
        await record(store, "Notification", agent_session_id="as-theirs", now=T0 + 9500)
        # The parent row goes behind the daemon's back (its children are not relinked).
        gone_row = "DELETE FROM sessions WHERE session_id = ?"
        await store.write(lambda tx: tx.conn.execute(gone_row, (lost_parent,)))

        entries = await plan(store)
        assert [(e.name, e.parent, e.last_activity_at) for e in entries] == [
            ("p1", None, T0 + 5000),
            ("c2", p1, T0 + 3000),
            ("c1", p1, T0 + 1000),
            ("orphan", None, T0 + 4500),
            ("p2", None, T0 + 4000),
            ("p3", None, T0 + 2000),
            ("stray", None, T0 + 100),
        ]
        assert entries[0] == RestorePlanEntry(
            session_id=p1, daemon_id=store.daemon_id, parent=None, agent="claude",
            agent_session_id="as-p1", cwd="/src/one", name="p1", model="opus", effort="high",
            target="t", target_identity="ti", transcript_path="/t/p1.jsonl",
            last_activity_at=T0 + 5000,
        )  # fmt: skip
        assert [e.session_id for e in entries] == [p1, c2, c1, orphan, p2, p3, stray]
        assert {e.session_id for e in entries}.isdisjoint({ex, c_exited})


async def test_session_end_marks_the_fleet_row_exited_and_session_start_undoes_it(
    short_tmp: Path,
) -> None:
    """SessionEnd ends the session in its fleet row, not only in its attention, so the
    restore plan leaves it out; a SessionStart (the agent resumed it) brings it back.
    Fleet watchers hear the row change; a repeated SessionEnd writes nothing more."""
    async with opened(short_tmp) as store:
        ended = await register(store, agent_session_id="as-ended", name="ended")
        kept = await register(store, name="kept")
        notes = watching(store)
        await record(store, "SessionEnd", agent_session_id="as-ended")
        assert (await store.read(fleet.get_session, ended)).exited
        assert [e.session_id for e in await plan(store)] == [kept]
        assert [n for n in notes if n[0] == "fleet"][-1][1].session.exited
        updated = (await store.read(fleet.get_session, ended)).updated_at
        await record(store, "SessionEnd", ended, now=now_ms() + 5000)
        assert (await store.read(fleet.get_session, ended)).updated_at == updated
        await record(store, "SessionStart", ended)
        assert not (await store.read(fleet.get_session, ended)).exited
        assert ended in [e.session_id for e in await plan(store)]


async def test_restore_plan_orders_sessions_without_events_by_attach_then_update(
    short_tmp: Path,
) -> None:
    """No events: last_attached_at, else updated_at; an empty fleet has an empty plan."""
    async with opened(short_tmp) as store:
        assert await plan(store) == []
        attached = await insert_at(store, T0, last_attached_at=T0 + 300)
        updated = await insert_at(store, T0 + 200)
        never = await insert_at(store, T0 + 100)
        assert [(e.session_id, e.last_activity_at) for e in await plan(store)] == [
            (attached, T0 + 300), (updated, T0 + 200), (never, T0 + 100),
        ]  # fmt: skip


async def test_restore_plan_ranks_by_events_even_after_a_later_row_write(
    short_tmp: Path,
) -> None:
    """Activity is the newest event when there is one: the wrapper's fleet.write of both
    rows after their events does not reorder them, and each keeps its event time."""
    async with opened(short_tmp) as store:
        a = await insert_at(store, T0, agent_session_id="as-a")
        b = await insert_at(store, T0, agent_session_id="as-b")
        await record(store, "Stop", a, now=T0 + 1000)
        await record(store, "Stop", b, now=T0 + 2000)
        rewritten = [
            entry(a, agent_session_id="as-a", name="a"),
            entry(b, agent_session_id="as-b", name="b"),
        ]
        await store.write(
            clock(T0 + 5000, fleet.write_fleet), caller(ME), FleetWriteParams(rewritten, [])
        )
        await store.write(
            clock(T0 + 6000, fleet.update_session),
            caller(ME),
            SessionUpdateParams(a, name="renamed"),
        )
        assert [(e.session_id, e.last_activity_at) for e in await plan(store)] == [
            (b, T0 + 2000), (a, T0 + 1000),
        ]  # fmt: skip


# --- retention -----------------------------------------------------------------------------


async def event_ids(store: Store) -> list[int]:
    return [row[0] for row in await sql(store, "SELECT event_id FROM events ORDER BY event_id")]


async def test_prune_by_age(short_tmp: Path) -> None:
    """Events older than the cutoff go, heartbeats included; the rest stay."""
    async with opened(short_tmp) as store:
        session = await register(store)
        old = [(await record(store, kind, session, now=T0 - 2 * DAY)).event_id
               for kind in ("Stop", events.HEARTBEAT)]  # fmt: skip
        edge = (await record(store, "Stop", agent_session_id="as-z", now=T0)).event_id
        new = (await record(store, "Stop", session, now=T0 + 1)).event_id
        pruned = await store.write(events.prune, T0, 1000)
        assert pruned == len(old)
        assert await event_ids(store) == [edge, new]


async def test_prune_keeps_the_newest_per_session_and_per_agent_session(
    short_tmp: Path,
) -> None:
    """Beyond ``per_session``, a session's oldest events go, and so do an agent session's
    (events filed under the agent session id alone count there); smaller groups stay."""
    async with opened(short_tmp) as store:
        busy = await register(store, agent_session_id="as-busy")
        quiet = await register(store, agent_session_id="as-quiet")
        busy_ids = [(await record(store, "PreToolUse", busy)).event_id for _ in range(5)]
        quiet_ids = [(await record(store, "PreToolUse", quiet)).event_id for _ in range(2)]
        agent_only = [
            (await record(store, "PreToolUse", agent_session_id="as-z")).event_id for _ in range(4)
        ]
        pruned = await store.write(events.prune, 0, 2)
        assert pruned == 3 + 2
        assert await event_ids(store) == sorted(busy_ids[-2:] + quiet_ids + agent_only[-2:])


async def test_prune_counts_a_restored_sessions_rows_together_by_agent_session(
    short_tmp: Path,
) -> None:
    """Two rows sharing an agent session id (before and after a restore) are one agent
    session for the count: the newest ``per_session`` across both are kept."""
    async with opened(short_tmp) as store:
        old = await register(store, agent_session_id="as-r")
        older = [(await record(store, "Stop", old)).event_id for _ in range(2)]
        await remove(store, old)
        new = await register(store, agent_session_id="as-r")
        newer = [(await record(store, "Stop", new)).event_id for _ in range(2)]
        assert await store.write(events.prune, 0, 3) == 1
        assert await event_ids(store) == [older[1], *newer]


async def test_periodic_retention_prunes_hook_events(short_tmp: Path) -> None:
    """prune_history (the periodic expiry) reports and prunes hook events by age and
    count with its own retention settings."""
    async with opened(short_tmp) as store:
        session = await register(store)
        stale = (await record(store, "Stop", session, now=now_ms() - 3 * DAY)).event_id
        fresh = [(await record(store, "Stop", session)).event_id for _ in range(3)]
        report = await store.write(retention.prune_history, 30 * DAY, 2 * DAY, 2)
        assert report["hook_events"] == 2
        assert stale not in await event_ids(store)
        assert await event_ids(store) == fresh[-2:]


# --- messages ------------------------------------------------------------------------------


async def test_send_without_a_key_queues_a_new_message_each_time(short_tmp: Path) -> None:
    """Each send is a new queued message carrying the session's agent session id."""
    async with opened(short_tmp) as store:
        session = await register(store, agent_session_id="as-1")
        first = await send(store, session, "one", now=T0)
        second = await send(store, session, "one", now=T0 + 1)
        assert first.status == second.status == "queued"
        assert first.message_id != second.message_id
        listed_messages = (await message_list(store, session)).messages
        assert listed_messages == [
            MessageRecord(first.message_id, session, "as-1", "one", "queued", T0, T0),
            MessageRecord(second.message_id, session, "as-1", "one", "queued", T0 + 1, T0 + 1),
        ]
        assert await sql(store, "SELECT count(*) FROM idempotency") == [(0,)]


async def test_send_with_a_key_answers_the_same_message_on_retry(short_tmp: Path) -> None:
    """Under a key, a retry answers the same message id (one row) with its current status;
    the key is completed at once under operation session.message with effect_ref = the
    message id; another principal's same key is another message."""
    async with opened(short_tmp) as store:
        session = await register(store)
        sent = await send(store, session, "hi", key="k1")
        assert sent.status == "queued"
        assert await send(store, session, "hi", key="k1") == sent
        assert len(await message_rows(store)) == 1
        record_ = await idem_get(store, "session.message", "k1")
        assert (record_.state, record_.effect_ref, record_.result) == (
            "completed", sent.message_id, {"message_id": sent.message_id, "status": "queued"},
        )  # fmt: skip
        await ack(store, sent.message_id, "delivered")
        assert await send(store, session, "hi", key="k1") == SessionMessageResult(
            sent.message_id, "delivered"
        )
        theirs = await send(store, session, "hi", key="k1", principal="bob")
        assert theirs.message_id != sent.message_id
        assert len(await message_rows(store)) == 2


async def test_send_refusals_store_nothing(short_tmp: Path) -> None:
    """The same key with other text (or another session) is idempotency_conflict; an
    unknown session is NotFound naming it, and no key is left behind."""
    async with opened(short_tmp) as store:
        session = await register(store)
        other = await register(store)
        sent = await send(store, session, "hi", key="k1")
        for target, text in ((session, "hi!"), (other, "hi")):
            with pytest.raises(IdempotencyConflict) as conflict:
                await send(store, target, text, key="k1")
            assert conflict.value.data == {
                "operation": "session.message", "key": "k1", "state": "completed",
            }  # fmt: skip
        missing = NO_SESSION
        for key in (None, "k2"):
            with pytest.raises(NotFound) as unknown:
                await send(store, missing, "hi", key=key)
            assert unknown.value.data == {"session_id": missing}
        theirs = await other_daemon_session(short_tmp)
        with pytest.raises(NotFound):
            await send(store, theirs, "hi")
        assert await message_rows(store) == [(sent.message_id, session, "hi", "queued")]
        assert await sql(store, "SELECT key FROM idempotency") == [("k1",)]


async def test_ack_moves_forward_only(short_tmp: Path) -> None:
    """queued -> delivered -> read; the same status again is a no-op (updated_at kept);
    backwards is Conflict naming the current status; queued -> read skips a step; an
    unknown message is NotFound."""
    async with opened(short_tmp) as store:
        session = await register(store, agent_session_id="as-1")
        sent = await send(store, session, "m", now=T0)
        delivered = await ack(store, sent.message_id, "delivered", now=T0 + 10)
        assert delivered == MessageRecord(
            sent.message_id, session, "as-1", "m", "delivered", T0, T0 + 10
        )
        assert await ack(store, sent.message_id, "delivered", now=T0 + 20) == delivered
        read = await ack(store, sent.message_id, "read", now=T0 + 30)
        assert (read.status, read.updated_at) == ("read", T0 + 30)
        assert await ack(store, sent.message_id, "read", now=T0 + 40) == read
        with pytest.raises(Conflict) as backwards:
            await ack(store, sent.message_id, "delivered")
        assert backwards.value.data == {"message_id": sent.message_id, "status": "read"}
        assert await message_rows(store) == [(sent.message_id, session, "m", "read")]

        skipped = await send(store, session, "n")
        assert (await ack(store, skipped.message_id, "read")).status == "read"
        with pytest.raises(NotFound) as unknown:
            await ack(store, "no-such-message", "read")
        assert unknown.value.data == {"message_id": "no-such-message"}


async def test_message_list_oldest_first_by_status_with_a_limit(short_tmp: Path) -> None:
    """A session's messages, oldest first (by created_at, then insertion); status filters;
    limit takes the oldest; other sessions' messages and unknown sessions list nothing."""
    async with opened(short_tmp) as store:
        session = await register(store)
        other = await register(store)
        late = await send(store, session, "late", now=T0 + 50)
        early = await send(store, session, "early", now=T0)
        same_time = await send(store, session, "same-time", now=T0 + 50)
        await send(store, other, "elsewhere", now=T0 - 1)
        await ack(store, late.message_id, "read")

        async def ids(status: str | None = None, limit: int = 100) -> list[str]:
            page = await message_list(store, session, status, limit)
            return [m.message_id for m in page.messages]

        assert await ids() == [early.message_id, late.message_id, same_time.message_id]
        assert await ids(limit=2) == [early.message_id, late.message_id]
        assert await ids("queued") == [early.message_id, same_time.message_id]
        assert await ids("read") == [late.message_id]
        assert await ids("delivered") == []
        missing = await message_list(store, NO_SESSION)
        assert missing.messages == []


# --- reconciliation of session.message keys ----------------------------------------------


async def test_an_interrupted_message_key_completes_from_its_message_row(
    short_tmp: Path,
) -> None:
    """A session.message key left in_progress (its claimant's daemon stopped) whose
    effect_ref is a message id completes at the next start with {message_id, status};
    one naming no message stays outcome_unknown; a session.message retry under the
    completed key (same params) then answers that message, storing nothing new."""
    async with opened(short_tmp) as store:
        session = await register(store)
        sent = await send(store, session, "deploy done")
        await ack(store, sent.message_id, "delivered")
        payload = {"session_id": session, "text": "deploy done"}  # the send's own params
        for key, effect_ref in (("k-evidence", sent.message_id), ("k-none", "msg-never-sent")):
            params = IdemClaimParams(
                operation=messages.MESSAGE_OPERATION, key=key, payload=payload,
                effect_ref=effect_ref,
            )  # fmt: skip
            assert (await idem_claim(store, params)).state == "claimed"
    async with opened(short_tmp) as store:
        report = store.reconciliation
        assert (report.marked_unknown, report.completed_from_evidence, report.still_unknown) == (
            2, 1, 1,
        )  # fmt: skip
        done = await idem_get(store, "session.message", "k-evidence")
        assert (done.state, done.result) == (
            "completed", {"message_id": sent.message_id, "status": "delivered"},
        )  # fmt: skip
        unknown = await idem_get(store, "session.message", "k-none")
        assert unknown.state == "outcome_unknown"
        assert await send(store, session, "deploy done", key="k-evidence") == SessionMessageResult(
            sent.message_id, "delivered"
        )
        assert len(await message_rows(store)) == 1


async def test_a_dead_claimants_message_key_settles_without_a_restart(short_tmp: Path) -> None:
    """The same probe settles the key of a claimant that died while the daemon runs."""
    async with opened(short_tmp) as store:
        session = await register(store)
        sent = await send(store, session, "x")
        params = IdemClaimParams(operation="session.message", key="k", effect_ref=sent.message_id)
        await idem_claim(store, params)
        report = await store.write(reconcile.settle_dead_holders, [HOLDER])
        assert (report.completed, report.unknown) == ([(ME, "session.message", "k")], [])
        done = await idem_get(store, "session.message", "k")
        assert done.result == {"message_id": sent.message_id, "status": "queued"}


def idem_state(data: IdemChanged) -> str | None:
    """The key state an ``idem`` change note announces."""
    return data.state


async def test_idem_watchers_hear_a_dead_claimants_message_key_complete(
    short_tmp: Path,
) -> None:
    """Every committed change reaches watchers: the last idem note about the settled key
    announces what was committed (completed), not the intermediate outcome_unknown."""
    async with opened(short_tmp) as store:
        session = await register(store)
        sent = await send(store, session, "x")
        params = IdemClaimParams(operation="session.message", key="k", effect_ref=sent.message_id)
        await idem_claim(store, params)
        notes = watching(store)
        await store.write(reconcile.settle_dead_holders, [HOLDER])
        assert (await idem_get(store, "session.message", "k")).state == "completed"
        about_key = [data for topic, data in notes if topic == "idem"]
        assert about_key, "the settled key was not announced at all"
        assert idem_state(about_key[-1]) == "completed"


# --- schema --------------------------------------------------------------------------------


@pytest.mark.sqlite_only
async def test_a_version_4_database_migrates_to_version_5(
    short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file made by the version-4 code gains the events and messages tables (and their
    indexes), keeps its rows, is backed up as v4, and takes events and messages."""
    monkeypatch.setattr(schema, "MIGRATIONS", schema.MIGRATIONS[:4])
    monkeypatch.setattr(schema, "SCHEMA_VERSION", 4)
    async with opened(short_tmp) as store:
        kept = await register_old_row(store, agent_session_id="as-old")
    monkeypatch.undo()
    assert query(short_tmp, "PRAGMA user_version") == [(4,)]
    tables = {row[0] for row in query(short_tmp, "SELECT name FROM sqlite_master")}
    assert {"events", "messages"}.isdisjoint(tables)

    async with opened(short_tmp) as store:
        assert [row.session_id for row in await store.read(fleet.list_all)] == [kept]
        event = await record(store, "Stop", agent_session_id="as-old")
        assert event.session_id == kept
        sent = await send(store, kept, "after the upgrade")
        assert (await message_list(store, kept, None, 10)).messages[0].message_id == sent.message_id
    assert query(short_tmp, "PRAGMA user_version") == [(schema.SCHEMA_VERSION,)]
    with closing(sqlite3.connect(db_path(short_tmp))) as conn:
        assert schema.shape_of(conn) == schema.expected_shape()
    indexes = {row[0] for row in query(short_tmp, "SELECT name FROM sqlite_master "
                                                  "WHERE type = 'index'")}  # fmt: skip
    assert {
        "events_by_session", "events_by_agent_session", "events_by_at", "messages_by_session",
    } <= indexes  # fmt: skip
    (backup,) = (state_dir(short_tmp) / "backups").iterdir()
    assert backup.name.startswith("towerd-v4-")
    with closing(sqlite3.connect(backup)) as old:
        assert old.execute("PRAGMA user_version").fetchone() == (4,)
        assert old.execute("SELECT count(*) FROM sessions").fetchone() == (1,)


async def test_a_stale_session_id_beside_a_known_agent_session_id_files_under_the_agent(
    short_tmp: Path,
) -> None:
    """A wrapper's old towerd id (TOWERD_SESSION_ID of a session since replaced) does not
    lose the event when the agent's own id is known: it is filed under that session."""
    async with opened(short_tmp) as store:
        current = await register(store, agent_session_id="as-live")
        stale = new_id()
        filed = await record(store, "Stop", stale, "as-live")
        assert filed.session_id == current
        orphan = await record(store, "Stop", new_id(), "as-nobody")
        assert orphan.session_id is None
        with pytest.raises(NotFound):
            await record(store, "Stop", stale)
