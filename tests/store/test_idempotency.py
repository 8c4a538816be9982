"""Idempotency keys: the claim order, every
transition and refusal, isolation and concurrency."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from store_helpers import caller, new_id, opened, query, register_params, rows
from towerd.daemon.store import Store, fleet
from towerd.daemon.store import idempotency as idem
from towerd.daemon.store.idempotency import Holder
from towerd.daemon.store.tx import Tx
from towerd.protocol.errors import (
    Conflict,
    IdempotencyConflict,
    IdempotencyInProgress,
    IdempotencyKeyUnknown,
    NotFound,
    OutcomeUnknown,
)
from towerd.protocol.methods import (
    IdemClaimParams,
    IdemClaimResult,
    IdemCompleteParams,
    IdemKeyParams,
    IdemListParams,
    IdemListResult,
    IdemRecord,
    IdemReleaseParams,
    IdemReleaseResult,
    IdemReopenParams,
    IdemReopenResult,
    IdemResolveParams,
    IdemResolveResult,
    SessionRegisterParams,
    SessionRegisterResult,
)

pytestmark = pytest.mark.anyio

ME = "alice"
OP = "tool.run"
HOLDER = Holder(pid=4242, start=1000)
OTHER_HOLDER = Holder(pid=4343, start=1000)


def claim_params(key: str = "k1", **fields: Any) -> IdemClaimParams:
    fields.setdefault("operation", OP)
    return IdemClaimParams(key=key, **fields)


async def claim(
    store: Store,
    key: str = "k1",
    holder: Holder | None = HOLDER,
    principal: str = ME,
    **fields: Any,
) -> IdemClaimResult:
    return await store.write(idem.claim, caller(principal, holder), claim_params(key, **fields))


async def complete(
    store: Store, key: str, result: Any, principal: str = ME, effect_ref: str | None = None
) -> IdemRecord:
    params = IdemCompleteParams(operation=OP, key=key, result=result, effect_ref=effect_ref)
    return await store.write(idem.complete, caller(principal), params)


async def mark_unknown(store: Store, key: str, principal: str = ME) -> IdemRecord:
    return await store.write(idem.mark_unknown, caller(principal), IdemKeyParams(OP, key))


async def release(
    store: Store, key: str, principal: str = ME, effect_ref: str | None = None
) -> IdemReleaseResult:
    params = IdemReleaseParams(OP, key, effect_ref=effect_ref)
    return await store.write(idem.release, caller(principal), params)


async def resolve(
    store: Store, key: str, outcome: str, result: Any, effect_ref: str | None = None
) -> IdemResolveResult:
    params = IdemResolveParams(
        operation=OP, key=key, outcome=outcome, result=result, effect_ref=effect_ref
    )
    return await store.write(idem.resolve, caller(ME), params)


async def reopen(
    store: Store, key: str, result: Any, reason: str | None, effect_ref: str | None = None
) -> IdemReopenResult:
    params = IdemReopenParams(
        operation=OP, key=key, result=result, reason=reason, effect_ref=effect_ref
    )
    return await store.write(idem.reopen, caller(ME), params)


async def get(store: Store, key: str, principal: str = ME, operation: str = OP) -> IdemRecord:
    return await store.read(idem.get, caller(principal), IdemKeyParams(operation, key))


async def list_keys(
    store: Store,
    principal: str = ME,
    state: str | None = None,
    operation: str | None = None,
    limit: int = 5000,
    cursor: int | None = None,
) -> IdemListResult:
    params = IdemListParams(state=state, operation=operation, limit=limit, cursor=cursor)
    return await store.read(idem.list_keys, caller(principal), params)


async def key_count(store: Store) -> int:
    return len((await list_keys(store)).keys)


async def register(
    store: Store, principal: str, params: SessionRegisterParams, holder: Holder | None
) -> SessionRegisterResult:
    return await store.write(fleet.register_session, caller(principal, holder), params)


def _backdate(tx: Tx, key: str, age_ms: int) -> None:
    tx.conn.execute("UPDATE idempotency SET updated_at = ? WHERE key = ?", (tx.now - age_ms, key))


# --- claim
# ---------------------------------------------------------------------------------


async def test_first_claim_mints_an_effect_ref_and_records_in_progress(
    short_tmp: Path,
) -> None:
    """No row: 'claimed' with a fresh effect_ref;
    the row is in_progress under the holder."""
    async with opened(short_tmp) as store:
        result = await claim(store, payload={"a": 1})
        assert result.state == "claimed"
        assert result.effect_ref and result.result is None
        record = await get(store, "k1")
        assert (record.state, record.effect_ref, record.holder_pid) == (
            "in_progress",
            result.effect_ref,
            4242,
        )
        other = await claim(store, key="k2")
        assert other.effect_ref != result.effect_ref


class _CountingConnection:
    """The store's connection, noting the verb of each statement run through it."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.verbs: list[str] = []

    def execute(self, sql: str, args: Any = ()) -> Any:
        self.verbs.append(sql.split(None, 1)[0].upper())
        return self.conn.execute(sql, args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.conn, name)


def counted(fn: Any, verbs: list[str]) -> Any:
    """``fn`` run on a Tx whose connection notes each statement's verb in ``verbs``."""

    def run(tx: Tx, *args: Any) -> Any:
        counting = _CountingConnection(tx.conn)
        try:
            return fn(msgspec.structs.replace(tx, conn=counting), *args)
        finally:
            verbs.extend(counting.verbs)

    return run


async def test_a_new_claim_and_its_complete_do_not_read_the_key_first(short_tmp: Path) -> None:
    """The usual writes, in the statements they cost (bench/writes.py: the statements are
    most of a write's time on the writer): a new key's claim is its quota lookup and one
    INSERT, the complete of a claimed key one UPDATE that returns the row; neither
    SELECTs the key first. The answers and the stored rows are as before."""
    async with opened(short_tmp) as store:
        claim_verbs: list[str] = []
        claimed = await store.write(
            counted(idem.claim, claim_verbs), caller(ME, HOLDER), claim_params("k1", payload=1)
        )
        assert claim_verbs == ["SELECT", "INSERT"]  # quota_usage, then the key
        assert claimed.state == "claimed"

        complete_verbs: list[str] = []
        params = IdemCompleteParams(operation=OP, key="k1", result={"out": 1})
        record = await store.write(counted(idem.complete, complete_verbs), caller(ME), params)
        assert complete_verbs == ["UPDATE"]
        assert (record.state, record.result, record.effect_ref, record.holder_pid) == (
            "completed",
            {"out": 1},
            claimed.effect_ref,
            HOLDER.pid,
        )
        assert await get(store, "k1") == record

        # A key that exists is answered from its row (the INSERT wrote nothing).
        again: list[str] = []
        replay = await store.write(
            counted(idem.claim, again), caller(ME, HOLDER), claim_params("k1", payload=1)
        )
        assert replay == IdemClaimResult("completed", claimed.effect_ref, {"out": 1})
        assert again == ["SELECT", "INSERT", "SELECT"]
        assert await key_count(store) == 1


async def test_claim_keeps_a_given_effect_ref(short_tmp: Path) -> None:
    """A caller-chosen effect_ref is recorded and returned."""
    async with opened(short_tmp) as store:
        result = await claim(store, effect_ref="spawn-7")
        assert (result.state, result.effect_ref) == ("claimed", "spawn-7")
        assert (await get(store, "k1")).effect_ref == "spawn-7"


async def test_in_progress_key_refuses_with_effect_ref_and_held_by_caller(
    short_tmp: Path,
) -> None:
    """A second claim of an in-progress key: IdempotencyInProgress with data.effect_ref;
    held_by_caller is True only for the very same Holder (pid and start)."""
    async with opened(short_tmp) as store:
        first = await claim(store, payload=[1])
        for caller, expected in [
            (HOLDER, True),
            (OTHER_HOLDER, False),
            (Holder(pid=HOLDER.pid, start=HOLDER.start + 1), False),  # pid reused
            (None, False),
        ]:
            with pytest.raises(IdempotencyInProgress) as caught:
                await claim(store, payload=[1], holder=caller)
            assert caught.value.data["effect_ref"] == first.effect_ref
            assert caught.value.data["held_by_caller"] is expected
            assert caught.value.data["holder_pid"] == HOLDER.pid
        assert await key_count(store) == 1


async def test_claim_without_holder_is_never_held_by_caller(short_tmp: Path) -> None:
    """A key claimed without a holder is not 'held by' a later holder-less caller."""
    async with opened(short_tmp) as store:
        await claim(store, holder=None)
        with pytest.raises(IdempotencyInProgress) as caught:
            await claim(store, holder=None)
        assert caught.value.data["held_by_caller"] is False


async def test_completed_key_replays_its_result(short_tmp: Path) -> None:
    """A completed key answers {state: completed,
    result, effect_ref} and runs nothing."""
    async with opened(short_tmp) as store:
        first = await claim(store, payload={"x": 1})
        await complete(store, "k1", {"pid": 99, "ok": True})
        replay = await claim(store, payload={"x": 1}, holder=OTHER_HOLDER)
        assert replay == IdemClaimResult("completed", first.effect_ref, {"pid": 99, "ok": True})
        assert (await get(store, "k1")).state == "completed"


async def test_outcome_unknown_key_refuses_with_effect_ref(short_tmp: Path) -> None:
    """An outcome_unknown key answers OutcomeUnknown
    with data.effect_ref, for any caller."""
    async with opened(short_tmp) as store:
        first = await claim(store)
        await mark_unknown(store, "k1")
        for caller in (HOLDER, OTHER_HOLDER, None):
            with pytest.raises(OutcomeUnknown) as caught:
                await claim(store, holder=caller)
            assert caught.value.data == {"effect_ref": first.effect_ref}
        assert (await get(store, "k1")).state == "outcome_unknown"


@pytest.mark.parametrize("state", ["in_progress", "completed", "outcome_unknown"])
async def test_different_payload_is_a_conflict_in_every_state(short_tmp: Path, state: str) -> None:
    """Payload mismatch is checked first:
    IdempotencyConflict whatever the key's state."""
    async with opened(short_tmp) as store:
        await claim(store, payload={"v": 1})
        if state == "completed":
            await complete(store, "k1", "r")
        elif state == "outcome_unknown":
            await mark_unknown(store, "k1")
        before = await get(store, "k1")
        for other in ({"v": 2}, None, [{"v": 1}]):
            with pytest.raises(IdempotencyConflict) as caught:
                await claim(store, payload=other, holder=HOLDER)
            assert caught.value.data == {"operation": OP, "key": "k1", "state": state}
        assert await get(store, "k1") == before


async def test_payload_conflict_wins_over_replay_only(short_tmp: Path) -> None:
    """replay_only does not skip the payload check."""
    async with opened(short_tmp) as store:
        await claim(store, payload=1)
        with pytest.raises(IdempotencyConflict):
            await claim(store, payload=2, replay_only=True)


async def test_absent_payload_equals_null_payload(short_tmp: Path) -> None:
    """No payload hashes as null: a retry with
    payload=None matches a claim without one."""
    async with opened(short_tmp) as store:
        await claim(store)
        await complete(store, "k1", "done")
        assert (await claim(store, payload=None)).state == "completed"
        assert idem.payload_hash(None) == idem.payload_hash(
            IdemClaimParams(operation=OP, key="k").payload
        )


async def test_payload_map_key_order_does_not_matter(short_tmp: Path) -> None:
    """The payload hash is canonical: maps equal
    up to key order (at any depth) match."""
    async with opened(short_tmp) as store:
        await claim(store, payload={"a": 1, "b": {"y": [1, {"p": 1, "q": 2}], "x": 2}})
        await complete(store, "k1", "ok")
        replay = await claim(store, payload={"b": {"x": 2, "y": [1, {"q": 2, "p": 1}]}, "a": 1})
        assert (replay.state, replay.result) == ("completed", "ok")


async def test_payload_with_non_string_map_keys_can_be_claimed(short_tmp: Path) -> None:
    """payload is any msgpack value, and msgpack maps may have integer keys: such a
    claim is recorded, and the canonical hash still ignores key order on retry."""
    async with opened(short_tmp) as store:
        first = await claim(store, payload={1: "a", 2: {3: "b"}})
        assert first.state == "claimed"
        await complete(store, "k1", "ok")
        replay = await claim(store, payload={2: {3: "b"}, 1: "a"})
        assert (replay.state, replay.result) == ("completed", "ok")


async def test_replay_only_with_no_row_is_key_unknown_and_records_nothing(
    short_tmp: Path,
) -> None:
    """replay_only on an unknown key raises
    IdempotencyKeyUnknown and leaves no row behind."""
    async with opened(short_tmp) as store:
        with pytest.raises(IdempotencyKeyUnknown):
            await claim(store, replay_only=True)
        assert await key_count(store) == 0
        with pytest.raises(IdempotencyKeyUnknown):
            await get(store, "k1")


async def test_replay_only_replays_a_completed_key(short_tmp: Path) -> None:
    """replay_only on a completed key answers it like any claim."""
    async with opened(short_tmp) as store:
        await claim(store)
        await complete(store, "k1", [1, 2])
        assert (await claim(store, replay_only=True)).result == [1, 2]


async def test_principals_are_isolated(short_tmp: Path) -> None:
    """The same operation and key under two principals are two independent keys."""
    async with opened(short_tmp) as store:
        alice = await claim(store, principal="alice", payload=1)
        bob = await claim(store, principal="bob", payload=2)
        assert (alice.state, bob.state) == ("claimed", "claimed")
        assert alice.effect_ref != bob.effect_ref
        await complete(store, "k1", "alice's", principal="alice")
        assert (await get(store, "k1", principal="bob")).state == "in_progress"
        with pytest.raises(IdempotencyKeyUnknown):
            await get(store, "k1", principal="carol")
        listed = await list_keys(store, "bob", limit=100)
        assert [(r.key, r.state) for r in listed.keys] == [("k1", "in_progress")]


async def test_operations_are_isolated(short_tmp: Path) -> None:
    """The same key under two operations are two keys."""
    async with opened(short_tmp) as store:
        await claim(store, operation="a.op")
        assert (await claim(store, operation="b.op")).state == "claimed"


# --- complete / release / mark_unknown / resolve
# --------------------------------------------------


async def test_complete_from_in_progress(short_tmp: Path) -> None:
    """complete moves in_progress -> completed and stores the result."""
    async with opened(short_tmp) as store:
        first = await claim(store)
        record = await complete(store, "k1", {"out": "x"})
        assert (record.state, record.result, record.effect_ref) == (
            "completed",
            {"out": "x"},
            first.effect_ref,
        )


async def test_complete_from_outcome_unknown(short_tmp: Path) -> None:
    """The claimant who knows may complete an outcome_unknown key."""
    async with opened(short_tmp) as store:
        await claim(store)
        await mark_unknown(store, "k1")
        record = await complete(store, "k1", 7)
        assert (record.state, record.result) == ("completed", 7)


async def test_repeat_complete_same_result_ok_different_result_conflict(
    short_tmp: Path,
) -> None:
    """A repeated complete with an equal result (key order aside) is a
    no-op; another result is Conflict and the stored result stays."""
    async with opened(short_tmp) as store:
        await claim(store)
        first = await complete(store, "k1", {"a": 1, "b": 2})
        assert await complete(store, "k1", {"b": 2, "a": 1}) == first
        with pytest.raises(Conflict):
            await complete(store, "k1", {"a": 1, "b": 3})
        assert (await get(store, "k1")).result == {"a": 1, "b": 2}


async def test_complete_unknown_key_is_key_unknown(short_tmp: Path) -> None:
    """complete on a key never claimed is IdempotencyKeyUnknown and creates nothing."""
    async with opened(short_tmp) as store:
        with pytest.raises(IdempotencyKeyUnknown):
            await complete(store, "nope", 1)
        assert await key_count(store) == 0


async def test_release_only_from_in_progress(short_tmp: Path) -> None:
    """release deletes an in_progress key (a retry claims
    afresh); completed is Conflict; outcome_unknown is
    OutcomeUnknown; an unknown key is IdempotencyKeyUnknown."""
    async with opened(short_tmp) as store:
        first = await claim(store, key="ip")
        result = await release(store, "ip")
        assert (result.key, result.released) == ("ip", True)
        again = await claim(store, key="ip")
        assert again.state == "claimed" and again.effect_ref != first.effect_ref

        await claim(store, key="done")
        await complete(store, "done", 1)
        with pytest.raises(Conflict):
            await release(store, "done")

        unknown = await claim(store, key="unk")
        await mark_unknown(store, "unk")
        with pytest.raises(OutcomeUnknown) as caught:
            await release(store, "unk")
        assert caught.value.data == {"effect_ref": unknown.effect_ref}

        with pytest.raises(IdempotencyKeyUnknown):
            await release(store, "never")
        states = {r.key: r.state for r in (await list_keys(store, limit=10)).keys}
        assert states == {
            "ip": "in_progress",
            "done": "completed",
            "unk": "outcome_unknown",
        }


async def test_mark_unknown_transitions(short_tmp: Path) -> None:
    """in_progress -> outcome_unknown; outcome_unknown stays; completed is Conflict."""
    async with opened(short_tmp) as store:
        await claim(store)
        assert (await mark_unknown(store, "k1")).state == "outcome_unknown"
        assert (await mark_unknown(store, "k1")).state == "outcome_unknown"
        await claim(store, key="k2")
        await complete(store, "k2", None)
        with pytest.raises(Conflict):
            await mark_unknown(store, "k2")
        assert (await get(store, "k2")).state == "completed"


async def test_resolve_completed_from_outcome_unknown_is_logged(
    short_tmp: Path,
) -> None:
    """The operator resolves an unknown key as
    completed: record stored, operator_log written."""
    async with opened(short_tmp) as store:
        first = await claim(store)
        await mark_unknown(store, "k1")
        result = await resolve(store, "k1", "completed", {"checked": True})
        assert result.outcome == "completed"
        assert result.record is not None
        assert (result.record.state, result.record.result) == (
            "completed",
            {"checked": True},
        )
        assert (await claim(store)).state == "completed"
        daemon_id = store.daemon_id
    [(log_daemon, principal, action, detail)] = query(
        short_tmp, "SELECT daemon_id, principal, action, detail FROM operator_log"
    )
    assert (log_daemon, principal, action) == (daemon_id, ME, "idem.resolve")
    assert json.loads(detail) == {
        "operation": OP,
        "key": "k1",
        "outcome": "completed",
        "effect_ref": first.effect_ref,
    }


async def test_resolve_abandoned_deletes_the_key_and_is_logged(short_tmp: Path) -> None:
    """Abandoned: the key is forgotten (a retry
    claims anew) and the decision is logged."""
    async with opened(short_tmp) as store:
        await claim(store)
        await mark_unknown(store, "k1")
        result = await resolve(store, "k1", "abandoned", None)
        assert (result.outcome, result.record) == ("abandoned", None)
        assert (await claim(store)).state == "claimed"
    assert [
        json.loads(d)["outcome"] for (d,) in query(short_tmp, "SELECT detail FROM operator_log")
    ] == ["abandoned"]


async def test_resolve_with_an_effect_ref_settles_only_that_claim(short_tmp: Path) -> None:
    """Two restore runs settling one unknown key: the first abandoned it, claimed it
    again, and its claim turned unknown too; the second, still deciding about the claim
    it had read, abandoned the first's new claim, and both launched (a review's
    reproducer). Given the effect_ref read, a claim made since is not resolved."""
    async with opened(short_tmp) as store:
        old = await claim(store)
        await mark_unknown(store, "k1")
        await resolve(store, "k1", "abandoned", None, effect_ref=old.effect_ref)
        new = await claim(store, attempt="second")
        await mark_unknown(store, "k1")
        before = await get(store, "k1")
        for outcome in ("completed", "abandoned"):
            with pytest.raises(Conflict) as caught:
                await resolve(store, "k1", outcome, None, effect_ref=old.effect_ref)
            assert caught.value.data["effect_ref"] == new.effect_ref
        assert await get(store, "k1") == before
        assert (await resolve(store, "k1", "abandoned", None, new.effect_ref)).outcome


async def test_complete_with_an_effect_ref_completes_only_that_claim(short_tmp: Path) -> None:
    """A restore window records its launch under the claim it checked: a key abandoned
    and claimed again meanwhile (another run's launch) is refused, unchanged, whatever
    its state; the claim given is completed from in_progress or outcome_unknown."""
    async with opened(short_tmp) as store:
        old = await claim(store)
        await mark_unknown(store, "k1")
        await resolve(store, "k1", "abandoned", None, effect_ref=old.effect_ref)
        new = await claim(store, attempt="second")
        for step in ("in_progress", "outcome_unknown"):
            before = await get(store, "k1")
            assert before.state == step
            with pytest.raises(Conflict) as caught:
                await complete(store, "k1", "window", effect_ref=old.effect_ref)
            assert caught.value.data["effect_ref"] == new.effect_ref
            assert await get(store, "k1") == before
            if step == "in_progress":
                await mark_unknown(store, "k1")
        done = await complete(store, "k1", "window", effect_ref=new.effect_ref)
        assert (done.state, done.result, done.effect_ref) == ("completed", "window", new.effect_ref)
        with pytest.raises(IdempotencyKeyUnknown):
            await complete(store, "missing", 1, effect_ref=new.effect_ref)
        assert (await complete(store, "k1", "window", effect_ref=new.effect_ref)) == done


async def test_release_with_an_effect_ref_releases_only_that_claim(short_tmp: Path) -> None:
    """A restore run giving up on its own launch, whose claim another run abandoned and
    claimed again meanwhile: that claim is refused, unchanged; its own is released."""
    async with opened(short_tmp) as store:
        old = await claim(store)
        await mark_unknown(store, "k1")
        await resolve(store, "k1", "abandoned", None, effect_ref=old.effect_ref)
        new = await claim(store, attempt="second")
        before = await get(store, "k1")
        with pytest.raises(Conflict) as caught:
            await release(store, "k1", effect_ref=old.effect_ref)
        assert caught.value.data["effect_ref"] == new.effect_ref
        assert await get(store, "k1") == before
        assert (await release(store, "k1", effect_ref=new.effect_ref)).released
        with pytest.raises(IdempotencyKeyUnknown):
            await get(store, "k1")


@pytest.mark.parametrize("state", ["in_progress", "completed"])
async def test_resolve_refused_unless_outcome_unknown(short_tmp: Path, state: str) -> None:
    """resolve on an in_progress or completed key
    is Conflict, changes nothing, logs nothing."""
    async with opened(short_tmp) as store:
        await claim(store)
        if state == "completed":
            await complete(store, "k1", 1)
        before = await get(store, "k1")
        for outcome in ("completed", "abandoned"):
            with pytest.raises(Conflict) as caught:
                await resolve(store, "k1", outcome, 2)
            assert caught.value.data["state"] == state
        assert await get(store, "k1") == before
        with pytest.raises(IdempotencyKeyUnknown):
            await resolve(store, "missing", "completed", 2)
    assert query(short_tmp, "SELECT count(*) FROM operator_log") == [(0,)]


# --- concurrency
# ---------------------------------------------------------------------------------


async def test_fifty_concurrent_claims_of_one_key_claim_exactly_once(
    short_tmp: Path,
) -> None:
    """50 concurrent claims with different holders: exactly one 'claimed', 49 InProgress
    (all naming the winner's effect_ref, none held by the caller), and one row."""
    outcomes: list[Any] = []

    async with opened(short_tmp) as store:

        async def attempt(n: int) -> None:
            try:
                outcomes.append(
                    await claim(store, holder=Holder(pid=1000 + n, start=n), payload="same")
                )
            except IdempotencyInProgress as exc:
                outcomes.append(exc)

        async with anyio.create_task_group() as tasks:
            for n in range(50):
                tasks.start_soon(attempt, n)

        claimed = [o for o in outcomes if isinstance(o, IdemClaimResult)]
        refused = [o for o in outcomes if isinstance(o, IdempotencyInProgress)]
        assert len(outcomes) == 50
        assert [c.state for c in claimed] == ["claimed"]
        assert len(refused) == 49
        assert {r.data["effect_ref"] for r in refused} == {claimed[0].effect_ref}
        assert not any(r.data["held_by_caller"] for r in refused)
        assert await key_count(store) == 1


# --- maintenance
# ---------------------------------------------------------------------------------


async def test_expire_completed_removes_only_old_completed_keys(
    short_tmp: Path,
) -> None:
    """Only completed keys older than the TTL go;
    in_progress and outcome_unknown never expire."""
    async with opened(short_tmp) as store:
        for key in ("old-done", "new-done", "old-ip", "old-unk"):
            await claim(store, key=key)
        await complete(store, "old-done", 1)
        await complete(store, "new-done", 2)
        await mark_unknown(store, "old-unk")
        for key in ("old-done", "old-ip", "old-unk"):
            await store.write(_backdate, key, 60_000)
        expired = await store.write(idem.expire_completed, 10_000)
        assert expired == 1
        states = {r.key: r.state for r in (await list_keys(store, limit=10)).keys}
        assert states == {
            "new-done": "completed",
            "old-ip": "in_progress",
            "old-unk": "outcome_unknown",
        }


async def test_mark_holders_dead_moves_only_that_holders_in_progress_keys(
    short_tmp: Path,
) -> None:
    """A dead holder's in_progress keys become outcome_unknown; another holder's keys, a
    reused pid with a different start, and its already completed keys are untouched."""
    async with opened(short_tmp) as store:
        await claim(store, key="dead-1", holder=HOLDER)
        await claim(store, key="dead-2", holder=HOLDER, principal="bob")
        await claim(store, key="dead-done", holder=HOLDER)
        await complete(store, "dead-done", 1)
        await claim(store, key="alive", holder=OTHER_HOLDER)
        await claim(store, key="reused-pid", holder=Holder(HOLDER.pid, HOLDER.start + 5))
        await claim(store, key="no-holder", holder=None)
        assert set(await store.read(idem.live_holders)) == {
            HOLDER,
            OTHER_HOLDER,
            Holder(HOLDER.pid, HOLDER.start + 5),
        }

        moved = await store.write(idem.mark_holders_dead, [HOLDER])
        # (rowid, principal, operation, key, effect_ref) of each key moved
        assert sorted(m[1:4] for m in moved) == [
            ("alice", OP, "dead-1"),
            ("bob", OP, "dead-2"),
        ]
        states = {
            r.key: r.state
            for principal in ("alice", "bob")
            for r in (await list_keys(store, principal, limit=10)).keys
        }
        assert states == {
            "dead-1": "outcome_unknown",
            "dead-2": "outcome_unknown",
            "dead-done": "completed",
            "alive": "in_progress",
            "reused-pid": "in_progress",
            "no-holder": "in_progress",
        }


async def test_list_keys_filters_and_pages(short_tmp: Path) -> None:
    """idem.list filters by state and operation and pages in claim order."""
    async with opened(short_tmp) as store:
        for n in range(5):
            await claim(store, key=f"k{n}")
        await complete(store, "k1", None)
        await claim(store, key="other", operation="x.op")
        page1 = await list_keys(store, ME, "in_progress", OP, 2, None)
        page2 = await list_keys(store, ME, "in_progress", OP, 2, page1.next_cursor)
        assert [r.key for r in page1.keys] == ["k0", "k2"]
        assert [r.key for r in page2.keys] == ["k3", "k4"]
        assert page2.next_cursor is None
        counts = await store.read(idem.count_by_state)
        assert (counts.in_progress, counts.completed, counts.outcome_unknown) == (
            5,
            1,
            0,
        )


# --- session.register with an idempotency key
# -----------------------------------------------------


async def test_register_retry_returns_the_same_session_and_inserts_once(
    short_tmp: Path,
) -> None:
    """A retried register under one key answers the
    first session id and inserts no second row."""
    async with opened(short_tmp) as store:
        params = register_params(idempotency_key="reg-1", name="w", agent_session_id="as-1")
        first = await register(store, ME, params, HOLDER)
        second = await register(store, ME, params, OTHER_HOLDER)
        assert second.session_id == first.session_id
        assert [r.session_id for r in await rows(store)] == [first.session_id]
        record = await get(store, "reg-1", operation=fleet.REGISTER_OPERATION)
        assert (record.state, record.effect_ref, record.result) == (
            "completed",
            first.session_id,
            {"session_id": first.session_id},
        )


async def test_concurrent_register_retries_insert_once(short_tmp: Path) -> None:
    """Ten concurrent retries of one keyed register: one row, one session id for all."""
    answers: list[str] = []
    async with opened(short_tmp) as store:
        params = register_params(idempotency_key="reg-c")

        async def attempt() -> None:
            answers.append((await register(store, ME, params, None)).session_id)

        async with anyio.create_task_group() as tasks:
            for _ in range(10):
                tasks.start_soon(attempt)
        assert len(answers) == 10 and len(set(answers)) == 1
        assert [r.session_id for r in await rows(store)] == answers[:1]


async def test_register_with_different_params_under_the_same_key_conflicts(
    short_tmp: Path,
) -> None:
    """Other params under a used key: IdempotencyConflict and no second row."""
    async with opened(short_tmp) as store:
        await register(store, ME, register_params(idempotency_key="k", name="a"), None)
        with pytest.raises(IdempotencyConflict):
            await register(store, ME, register_params(idempotency_key="k", name="b"), None)
        assert [r.name for r in await rows(store)] == ["a"]


async def test_register_key_is_per_principal(short_tmp: Path) -> None:
    """The same register key under another principal registers another session."""
    async with opened(short_tmp) as store:
        params = register_params(idempotency_key="k")
        a = await register(store, "alice", params, None)
        b = await register(store, "bob", params, None)
        assert a.session_id != b.session_id
        assert len(await rows(store)) == 2


async def test_failed_keyed_register_records_no_key(short_tmp: Path) -> None:
    """A keyed register that fails (missing parent)
    leaves no key, so a fixed retry can succeed."""
    async with opened(short_tmp) as store:
        params = register_params(idempotency_key="k", parent=new_id())
        with pytest.raises(NotFound):
            await register(store, ME, params, None)
        with pytest.raises(IdempotencyKeyUnknown):
            await get(store, "k", operation=fleet.REGISTER_OPERATION)
        assert await rows(store) == []


async def test_register_key_in_progress_from_a_claim_is_refused(
    short_tmp: Path,
) -> None:
    """A register key that a client claimed by hand
    (in progress) is refused, not run twice."""
    async with opened(short_tmp) as store:
        params = register_params(idempotency_key="k")
        digest_payload = msgspec.structs.asdict(params)
        del digest_payload["idempotency_key"]
        await store.write(
            idem.claim,
            caller(ME, HOLDER),
            IdemClaimParams(operation=fleet.REGISTER_OPERATION, key="k", payload=digest_payload),
        )
        with pytest.raises(IdempotencyInProgress) as caught:
            await register(store, ME, params, HOLDER)
        assert caught.value.data["held_by_caller"] is True
        assert await rows(store) == []


async def test_claim_retried_with_its_attempt_token_is_claimed_again(short_tmp: Path) -> None:
    """A claim whose answer was lost, repeated with the same attempt token, is answered
    `claimed` with the same effect_ref; another token (or none) is refused in progress;
    once the key is outcome_unknown even the same token is refused."""
    async with opened(short_tmp) as store:
        first = IdemClaimParams(operation="op", key="k", attempt="token-1")
        claimed = await store.write(idem.claim, caller("p"), first)
        again = await store.write(idem.claim, caller("p"), first)
        assert (again.state, again.effect_ref) == ("claimed", claimed.effect_ref)
        for other in ("token-2", None):
            with pytest.raises(IdempotencyInProgress):
                params = IdemClaimParams(operation="op", key="k", attempt=other)
                await store.write(idem.claim, caller("p"), params)
        await store.write(idem.mark_unknown, caller("p"), IdemKeyParams("op", "k"))
        with pytest.raises(OutcomeUnknown):
            await store.write(idem.claim, caller("p"), first)


@pytest.mark.parametrize("odd_result", [None, {"ok": 1}, {"session_id": 5}])
async def test_register_key_completed_by_hand_with_another_result_is_conflict(
    short_tmp: Path, odd_result: Any
) -> None:
    """A session.register key claimed and completed through idem.claim/complete with a
    result that is not a registration: a later session.register with it is Conflict,
    never a second insert or an internal error."""
    params = register_params(idempotency_key="shared")
    request = msgspec.structs.asdict(params)
    del request["idempotency_key"]
    async with opened(short_tmp) as store:
        claim = IdemClaimParams(operation="session.register", key="shared", payload=request)
        await store.write(idem.claim, caller("p"), claim)
        done = IdemCompleteParams(operation="session.register", key="shared", result=odd_result)
        await store.write(idem.complete, caller("p"), done)
        with pytest.raises(Conflict, match="not a registration"):
            await register(store, "p", params, None)
        assert await rows(store) == []


# --- reopen: retrying a step that completed with a failure
# ---------------------------------------------------------------------------------


async def test_reopen_forgets_a_completed_outcome_once_and_logs_it(short_tmp: Path) -> None:
    """A completed key whose result the operator names is forgotten (the next claim runs
    the step again) and the operator log records who, why and the old outcome; a second
    reopen of the same outcome finds nothing to reopen."""
    failed = {"exit_status": 1, "output_sha256": "ab"}
    async with opened(short_tmp) as store:
        await claim(store, "push")
        await complete(store, "push", failed)
        reopened = await reopen(store, "push", failed, "remote was down")
        assert reopened.reopened and reopened.previous.result == failed
        assert (await claim(store, "push")).state == "claimed"
        with pytest.raises(Conflict):  # in progress again: nothing to reopen
            await reopen(store, "push", failed, None)
    (detail,) = [
        json.loads(d)
        for (action, d) in query(short_tmp, "SELECT action, detail FROM operator_log")
        if action == "idem.reopen"
    ]
    assert detail["result"] == failed and detail["reason"] == "remote was down"


@pytest.mark.parametrize("state", ["in_progress", "outcome_unknown"])
async def test_reopen_refuses_an_unsettled_key(short_tmp: Path, state: str) -> None:
    async with opened(short_tmp) as store:
        await claim(store, "k")
        if state == "outcome_unknown":
            await mark_unknown(store, "k")
        with pytest.raises(Conflict) as refused:
            await reopen(store, "k", None, None)
        assert refused.value.data["state"] == state
        assert (await get(store, "k")).state == state


async def test_reopen_refuses_a_key_that_ran_again_to_the_same_result(short_tmp: Path) -> None:
    """Two `run --retry-failed` race: both read failure #1; one reopens it and its rerun
    fails the same way. The other's reopen named only the result, so it matched the new
    failure and the command ran a third time; named by its effect_ref, the outcome it
    read is gone, and the new one is kept."""
    failed = {"exit_status": 1, "output_sha256": "ab"}
    async with opened(short_tmp) as store:
        first = (await claim(store, "push")).effect_ref
        await complete(store, "push", failed)
        await reopen(store, "push", failed, "racer a", effect_ref=first)
        second = (await claim(store, "push")).effect_ref
        await complete(store, "push", failed)
        assert second != first
        with pytest.raises(Conflict) as refused:
            await reopen(store, "push", failed, "racer b", effect_ref=first)
        assert refused.value.data["effect_ref"] == second
        assert (await get(store, "push")).result == failed
        assert (await claim(store, "push")).state == "completed"


async def test_reopen_refuses_an_outcome_other_than_the_one_named(short_tmp: Path) -> None:
    """The operator reopens the outcome they looked at: a different stored result (it
    changed since, or they named another run) is refused and kept."""
    async with opened(short_tmp) as store:
        await claim(store, "k")
        await complete(store, "k", {"exit_status": 0})
        with pytest.raises(Conflict):
            await reopen(store, "k", {"exit_status": 1}, None)
        assert (await get(store, "k")).result == {"exit_status": 0}
        with pytest.raises(IdempotencyKeyUnknown):
            await reopen(store, "nothing", None, None)
