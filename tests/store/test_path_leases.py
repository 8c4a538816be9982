"""The agent's loop in the store (daemon/store/agents.py): sessions from hooks, the agent
process as liveness, and the path-lease rules, on a real SQLite file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from store_helpers import DEAD, LIVE, OTHER_LIVE, at, caller, opened, query, register
from towerd.daemon.processes import Holder
from towerd.daemon.store import Store, agents, fleet, liveness
from towerd.protocol.errors import Conflict, LeaseHeld, NotFound
from towerd.protocol.methods import (
    DEFAULT_PATH_LEASE_TTL_MS,
    HookEventParams,
    HookEventResult,
    PathClaimParams,
    PathReleaseParams,
)

pytestmark = pytest.mark.anyio


async def hook(
    store: Store,
    kind: str,
    agent_session_id: str,
    holder: Holder | None = LIVE,
    shift_ms: int = 0,
    **fields: Any,
) -> HookEventResult:
    fields.setdefault("cwd", "/w")
    params = HookEventParams(
        kind=kind,
        agent="claude",
        agent_session_id=agent_session_id,
        agent_pid=holder.pid if holder else None,
        **fields,
    )
    return await store.write(at(shift_ms, agents.hook_event), caller(holder=holder), params)


async def edit(store: Store, agent_session_id: str, *paths: str, **kwargs: Any) -> HookEventResult:
    """A PreToolUse of an edit of ``paths``, and (when it was not denied) the PostToolUse
    that follows the edit done."""
    before = await hook(store, "PreToolUse", agent_session_id, paths=list(paths), **kwargs)
    if before.decision != "deny":
        await hook(store, "PostToolUse", agent_session_id, paths=list(paths), **kwargs)
    return before


async def row(store: Store, session_id: str) -> Any:
    return await store.read(lambda tx: fleet.get_session(tx, session_id))


async def test_session_start_registers_once_and_binds_the_agent(short_tmp: Path) -> None:
    async with opened(short_tmp) as store:
        first = await hook(store, "SessionStart", "as-1", model="opus", transcript_path="/t")
        again = await hook(store, "SessionStart", "as-1")
        assert first.registered and not again.registered
        assert first.session_id == again.session_id
        stored = await row(store, first.session_id)
        assert (stored.agent, stored.cwd, stored.model, stored.transcript_path) == (
            "claude", "/w", "opus", "/t",
        )  # fmt: skip
        assert (stored.agent_pid, stored.live) == (LIVE.pid, True)
        assert await store.read(lambda tx: fleet.count_sessions(tx)) == 1


async def test_session_end_is_not_registered_and_ends_a_known_session(short_tmp: Path) -> None:
    async with opened(short_tmp) as store:
        unknown = await hook(store, "SessionEnd", "as-never")
        assert unknown.session_id is None and not unknown.registered
        started = await hook(store, "SessionStart", "as-1")
        await edit(store, "as-1", "/w/a.py")
        await hook(store, "SessionEnd", "as-1")
        assert (await row(store, started.session_id)).exited is True
        # Its lease went with it: another session (another process) takes the file.
        assert (await edit(store, "as-2", "/w/a.py", holder=OTHER_LIVE)).decision == "allow"


async def test_in_the_way_above_and_below_but_not_beside(short_tmp: Path) -> None:
    async with opened(short_tmp) as store:
        await hook(store, "SessionStart", "as-a")
        await hook(store, "SessionStart", "as-b", holder=OTHER_LIVE)
        claimed = await store.write(
            agents.claim, caller(holder=LIVE), PathClaimParams(["/w/src"], agent_pid=LIVE.pid)
        )
        assert [lease.path for lease in claimed.leases] == ["/w/src"]
        for path in ("/w/src", "/w/src/deep/x.py"):  # the directory, and below it
            denied = await edit(store, "as-b", path, holder=OTHER_LIVE)
            assert denied.decision == "deny" and denied.conflicts[0].path == "/w/src", path
        for path in ("/w/srcx.py", "/w/sr", "/w/other/src"):  # beside it
            assert (await edit(store, "as-b", path, holder=OTHER_LIVE)).decision == "allow", path
        # A directory above a held file is in the way of a directory claim.
        with pytest.raises(LeaseHeld) as caught:
            await store.write(
                agents.claim, caller(holder=OTHER_LIVE),
                PathClaimParams(["/w"], agent_pid=OTHER_LIVE.pid),
            )  # fmt: skip
        assert {c["path"] for c in caught.value.data["conflicts"]} == {"/w/src"}


async def test_deny_leases_nothing_warn_leases_the_free_paths(short_tmp: Path) -> None:
    async with opened(short_tmp) as store:
        await edit(store, "as-a", "/w/a.py")
        denied = await edit(store, "as-b", "/w/a.py", "/w/b.py", holder=OTHER_LIVE)
        assert denied.decision == "deny" and denied.leased == []
        assert "towerctl release /w/a.py" in (denied.reason or "")
        assert (await edit(store, "as-c", "/w/b.py", holder=None)).decision == "allow"
        warned = await edit(store, "as-d", "/w/a.py", "/w/c.py", holder=None, guard="warn")
        assert (warned.decision, warned.leased) == ("warn", ["/w/c.py"])
        off = await edit(store, "as-e", "/w/a.py", holder=None, guard="off")
        assert (off.decision, off.leased) == ("allow", [])


async def test_a_dead_agent_is_in_nobodys_way_and_the_sweep_ends_its_liveness(
    short_tmp: Path,
) -> None:
    async with opened(short_tmp) as store:
        gone = await hook(store, "SessionStart", "as-dead", holder=DEAD)
        await edit(store, "as-dead", "/w/a.py", holder=DEAD)
        # Even before a sweep, a lease whose holder died stands in nobody's way.
        assert (await edit(store, "as-b", "/w/a.py", holder=OTHER_LIVE)).decision == "allow"
        report = await store.write(liveness.settle, [DEAD])
        assert report.sessions_gone == [gone.session_id]
        stored = await row(store, gone.session_id)
        assert (stored.live, stored.exited) == (False, False)


async def test_a_path_lease_lapses_its_ttl_after_the_last_edit(short_tmp: Path) -> None:
    ttl = DEFAULT_PATH_LEASE_TTL_MS
    async with opened(short_tmp) as store:
        await edit(store, "as-a", "/w/a.py")
        await edit(store, "as-a", "/w/a.py", shift_ms=ttl - 1000)  # renewed by an edit
        held = await edit(store, "as-b", "/w/a.py", holder=OTHER_LIVE, shift_ms=ttl + 1000)
        assert held.decision == "deny"
        lapsed = await edit(store, "as-b", "/w/a.py", holder=OTHER_LIVE, shift_ms=2 * ttl)
        assert lapsed.decision == "allow"


async def test_one_agent_process_after_clear_is_one_holder(short_tmp: Path) -> None:
    async with opened(short_tmp) as store:
        first = await hook(store, "SessionStart", "as-1")
        await edit(store, "as-1", "/w/a.py")
        second = await hook(store, "SessionStart", "as-2", shift_ms=10)
        moved = await edit(store, "as-2", "/w/a.py", shift_ms=20)
        assert moved.decision == "allow" and moved.session_id == second.session_id
        released = await store.write(
            agents.release, caller(holder=LIVE), PathReleaseParams(["/w"], agent_pid=LIVE.pid)
        )
        assert (released.session_id, released.released) == (second.session_id, ["/w/a.py"])
        assert first.session_id != second.session_id


async def test_a_claim_needs_a_session(short_tmp: Path) -> None:
    async with opened(short_tmp) as store:
        with pytest.raises(NotFound):
            await store.write(
                agents.claim, caller(holder=LIVE), PathClaimParams(["/w"], agent_pid=LIVE.pid)
            )
        registered = await register(store)
        claimed = await store.write(
            agents.claim, caller(), PathClaimParams(["/w"], session_id=registered)
        )
        assert claimed.session_id == registered


async def test_an_edit_that_never_ran_holds_its_path_two_minutes(short_tmp: Path) -> None:
    """PreToolUse leases the path pending; without the PostToolUse of a done edit (the
    tool failed, the user said no) it lapses after PENDING_TTL_MS, not the idle TTL."""
    async with opened(short_tmp) as store:
        await hook(store, "PreToolUse", "as-a", paths=["/w/a.py"])
        other = {"holder": OTHER_LIVE}
        held = await hook(store, "PreToolUse", "as-b", paths=["/w/a.py"], shift_ms=60_000, **other)
        assert held.decision == "deny"
        later = agents.PENDING_TTL_MS + 1000
        free = await hook(store, "PreToolUse", "as-b", paths=["/w/a.py"], shift_ms=later, **other)
        assert free.decision == "allow"
        # A PreToolUse after a done edit does not shorten the lease the edit's PostToolUse set.
        await hook(store, "PostToolUse", "as-b", paths=["/w/a.py"], shift_ms=later, **other)
        await hook(store, "PreToolUse", "as-b", paths=["/w/a.py"], shift_ms=later + 10, **other)
        still = await edit(store, "as-a", "/w/a.py", shift_ms=later + 10 * 60_000)
        assert still.decision == "deny"


async def test_claiming_the_root_sees_every_lease_below_it(short_tmp: Path) -> None:
    async with opened(short_tmp) as store:
        await edit(store, "as-a", "/w/d/sub/f.txt")
        await hook(store, "SessionStart", "as-b", holder=OTHER_LIVE)
        with pytest.raises(LeaseHeld) as caught:
            await store.write(
                agents.claim, caller(holder=OTHER_LIVE),
                PathClaimParams(["/"], agent_pid=OTHER_LIVE.pid),
            )  # fmt: skip
        assert [c["path"] for c in caught.value.data["conflicts"]] == ["/w/d/sub/f.txt"]


async def test_two_processes_sharing_one_session_are_two_agents(short_tmp: Path) -> None:
    """An inherited TOWERD_SESSION_ID: the same session from another live agent process is
    in the first one's way (and is named by its process in the reason)."""
    async with opened(short_tmp) as store:
        shared = await register(store)
        mine = await edit(store, "as-a", "/w/a.py", session_id=shared)
        assert mine.session_id == shared
        twin = await edit(store, "as-a", "/w/a.py", session_id=shared, holder=OTHER_LIVE)
        assert twin.decision == "deny" and f"process {LIVE.pid}" in (twin.reason or "")


async def test_inside_an_agent_session_a_claim_acts_for_that_session_only(short_tmp: Path):
    """An agent denied a path cannot free it by naming the holder's session, nor through
    a wrapper process between its shell and towerctl: the daemon finds the agent among
    the caller's ancestors."""
    async with opened(short_tmp) as store:
        holder = await edit(store, "as-a", "/w/a.py")
        await hook(store, "SessionStart", "as-b", holder=OTHER_LIVE)
        wrapped = caller(holder=DEAD)  # some wrapper below agent B, which is its ancestor
        wrapped.lineage = (DEAD, OTHER_LIVE)
        with pytest.raises(Conflict):
            await store.write(
                agents.release, wrapped,
                PathReleaseParams(["/w/a.py"], session_id=holder.session_id),
            )  # fmt: skip
        released = await store.write(agents.release, wrapped, PathReleaseParams(["/w/a.py"]))
        assert released.released == []  # B's own leases only: it has none
        # A person (no agent among its ancestors) frees whoever's.
        person = caller(holder=DEAD)
        person.lineage = (DEAD,)
        freed = await store.write(agents.release, person, PathReleaseParams(["/w/a.py"]))
        assert (freed.released, freed.session_id) == (["/w/a.py"], None)


async def test_a_session_start_under_towerd_session_id_adopts_a_new_agent_session_id(
    short_tmp: Path,
) -> None:
    """A restored (or forked) agent reports a new agent session id under its towerd
    session: the row takes it, unless another row of the fleet already has it."""
    async with opened(short_tmp) as store:
        session = await register(store, agent_session_id="old")
        other = await register(store, agent_session_id="taken")
        await hook(store, "SessionStart", "new", session_id=session)
        assert (await row(store, session)).agent_session_id == "new"
        await hook(store, "SessionStart", "taken", session_id=session)
        assert (await row(store, session)).agent_session_id == "new"
        assert (await row(store, other)).agent_session_id == "taken"
        await hook(store, "PreToolUse", "another", session_id=session)  # not a SessionStart
        assert (await row(store, session)).agent_session_id == "new"


# --- a hook event written again under its filing key (the shared store's outbox) --------


async def test_a_hook_event_written_again_under_its_filing_key_is_filed_once(
    short_tmp: Path,
) -> None:
    """The second write under one filing key answers the first event and changes
    nothing: no second event, no lease taken again."""
    params = HookEventParams(
        kind="PreToolUse", agent="claude", agent_session_id="as-f", cwd="/w", paths=["/w/a"]
    )
    async with opened(short_tmp) as store:
        first = await store.write(agents.hook_event, caller(holder=LIVE), params, "key-1")
        again = await store.write(agents.hook_event, caller(holder=LIVE), params, "key-1")
        other = await store.write(agents.hook_event, caller(holder=LIVE), params, "key-2")
    assert first.event_id > 0 and first.leased == ["/w/a"]
    assert (again.event_id, again.at, again.session_id) == (
        first.event_id,
        first.at,
        first.session_id,
    )
    assert again.leased == [] and not again.registered
    assert other.event_id > first.event_id  # another key is another event
    rows = query(short_tmp, "SELECT filing_key FROM events WHERE agent_session_id = 'as-f'")
    assert sorted(row[0] for row in rows) == ["key-1", "key-2"]


async def test_an_outbox_forward_whose_answer_was_lost_files_the_event_once(
    short_tmp: Path,
) -> None:
    """The fault the filing key is for: a forward commits, its answer is lost (the store
    looked unreachable), the event stays first in the outbox and is sent again."""
    from towerd.daemon.outbox import Outbox
    from towerd.protocol.errors import Unavailable

    outbox = Outbox(short_tmp)
    for n in range(2):
        params = HookEventParams(
            kind="PostToolUse", agent="claude", agent_session_id="as-o", payload={"n": n}
        )
        outbox.put("alice", params, f"filing-{n}")
    answers_lost = 1
    async with opened(short_tmp) as store:

        async def write(principal: str, params: HookEventParams, filing_key: str | None) -> Any:
            nonlocal answers_lost
            result = await store.write(agents.hook_event, caller(), params, filing_key)
            if answers_lost:  # committed, but the answer never came back
                answers_lost -= 1
                raise Unavailable("the store is unreachable", {"reason": "store_unreachable"})
            return result

        assert await outbox.forward(write) == 0  # the first stays first
        assert await outbox.forward(write) == 2
    assert outbox.dropped == 0  # the second send was answered, not refused
    rows = query(short_tmp, "SELECT payload FROM events WHERE agent_session_id = 'as-o'")
    assert sorted(msgspec.msgpack.decode(row[0])["n"] for row in rows) == [0, 1]  # once each
