"""The external-effects ledger in the store: keys, claims and their leases, heartbeats,
commits and their fence, abort/fail/resolve, parking, liveness and reconciliation.

The clock is moved by running a store function on a Tx whose ``now`` is shifted
(``at``), never by sleeping; a dead holder is this process's pid with a start
time that is not its own.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import msgspec
import pytest

from store_helpers import (
    DEAD,
    LIVE,
    OTHER_LIVE,
    at,
    caller,
    configured,
    counters,
    lease_rows,
    opened,
    query,
    sql,
)
from towerd.daemon.processes import Holder, holder_of
from towerd.daemon.store import Store, effects, leases, liveness
from towerd.daemon.store import idempotency as idem
from towerd.daemon.store.tx import Refused, Tx
from towerd.protocol import naming
from towerd.protocol.errors import (
    EffectAlreadyCommitted,
    EffectAttemptSuperseded,
    EffectInFlight,
    EffectLeaseHeld,
    EffectLeaseSuperseded,
    EffectNotFound,
    EffectUncertain,
    IdempotencyConflict,
    LeaseHeld,
)
from towerd.protocol.methods import (
    EffectAbortParams,
    EffectAttemptParams,
    EffectClaimParams,
    EffectClaimResult,
    EffectCommitParams,
    EffectFailParams,
    EffectKeyParams,
    EffectListParams,
    EffectRecord,
    EffectResolveParams,
    IdemClaimParams,
    IdemListParams,
    IdemListResult,
    LeaseAcquireParams,
    LeaseRecord,
    LeaseResourceParams,
    LeaseTokenParams,
)

pytestmark = pytest.mark.anyio

ME = "alice"
RUN = "run_7"
PR = "github.com/acme/app#pull/feature-x"
TTL = 60_000

_me = holder_of(os.getpid())
_parent = holder_of(os.getppid())
assert _me is not None and _parent is not None


def params(
    step: str = "open-pr",
    kind: str = "pr-create",
    target: str = PR,
    attempt: str = "a-1",
    run: str = RUN,
    **fields: Any,
) -> EffectClaimParams:
    fields.setdefault("lease_ttl_ms", TTL)
    return EffectClaimParams(
        run_id=run,
        step_id=step,
        attempt_id=attempt,
        action_kind=kind,
        target_ref=target,
        **fields,
    )


async def claim(
    store: Store,
    p: EffectClaimParams | None = None,
    principal: str = ME,
    holder: Holder | None = LIVE,
    shift: int = 0,
    prefix: str | None = None,
) -> EffectClaimResult:
    fn = at(shift, effects.claim)
    if prefix is not None:
        fn = configured(fn, branch_prefix=prefix)
    return await store.write(fn, caller(principal, holder), p or params())


def key_of(p: EffectClaimParams) -> str:
    return naming.effect_key(p.run_id, p.step_id, p.action_kind, p.target_ref)


async def get(store: Store, key: str) -> EffectRecord:
    return await store.read(effects.get, caller(ME), EffectKeyParams(key))


async def list_run(store: Store, run: str = RUN) -> list[EffectRecord]:
    """effect.list of ``run``: its effects in claim order."""
    return (await store.read(effects.list_run, caller(ME), EffectListParams(run))).effects


async def commit(
    store: Store, key: str, attempt: str = "a-1", receipt: Any = None, shift: int = 0
) -> EffectRecord:
    params = EffectCommitParams(key, attempt, receipt)
    return await store.write(at(shift, effects.commit), caller(ME), params)


async def fail(store: Store, key: str, attempt: str = "a-1", error: Any = None) -> EffectRecord:
    return await store.write(effects.fail, caller(ME), EffectFailParams(key, attempt, error))


async def abort(store: Store, key: str, attempt: str = "a-1", reason: Any = None) -> EffectRecord:
    return await store.write(effects.abort, caller(ME), EffectAbortParams(key, attempt, reason))


ENDINGS = {"fail": fail, "abort": abort}  # effect.fail / effect.abort by name


async def resolve(
    store: Store, key: str, outcome: str, receipt: Any, principal: str = "op"
) -> EffectRecord:
    params = EffectResolveParams(key, outcome, receipt)  # type: ignore[arg-type]
    return await store.write(effects.resolve, caller(principal), params)


async def heartbeat(
    store: Store,
    key: str,
    attempt: str = "a-1",
    ttl: int = TTL,
    shift: int = 0,
    holder: Holder | None = LIVE,
) -> EffectRecord:
    params = EffectAttemptParams(key, attempt, ttl)
    return await store.write(at(shift, effects.heartbeat), caller(ME, holder), params)


async def acquire(
    store: Store,
    resource: str = PR,
    principal: str = "bob",
    holder: Holder | None = LIVE,
    ttl: int = TTL,
    shift: int = 0,
) -> Any:
    params = LeaseAcquireParams(resource, ttl)
    return await store.write(at(shift, leases.acquire), caller(principal, holder), params)


async def lease_get(store: Store, resource: str = PR) -> LeaseRecord:
    return await store.read(leases.get, caller(ME), LeaseResourceParams(resource))


async def idem_claim(store: Store, params: IdemClaimParams, holder: Holder | None) -> Any:
    return await store.write(idem.claim, caller(ME, holder), params)


async def idem_keys(store: Store) -> IdemListResult:
    return await store.read(idem.list_keys, caller(ME), IdemListParams(limit=10))


async def effect_rows(store: Store) -> list[tuple[Any, ...]]:
    return await sql(store, "SELECT * FROM effects ORDER BY rowid")


def data_of(record: EffectRecord | LeaseRecord) -> dict[str, Any]:
    return {name: getattr(record, name) for name in record.__struct_fields__}


def parked(record: EffectRecord) -> dict[str, Any]:
    return {"effect": {**data_of(record), "status": "uncertain"}}


# --- keys and claims ---------------------------------------------------------------------


async def test_effect_key_is_eff_and_16_hex_of_sha256(short_tmp: Path) -> None:
    """The effect key is naming.effect_key: eff_ + sha256(run:step:kind:target)[:16]."""
    p = params()
    raw = f"{RUN}:open-pr:pr-create:{PR}".encode()
    expected = "eff_" + hashlib.sha256(raw).hexdigest()[:16]
    assert key_of(p) == expected
    async with opened(short_tmp) as store:
        result = await claim(store, p)
        assert result.effect_key == expected
        assert [row[0] for row in await effect_rows(store)] == [expected]
        other = await claim(store, params(step="open-pr-2"))
        assert other.effect_key != expected


SHARED = [
    ("pr-create", PR),
    ("tracker-issue", "JIRA-1"),
    ("webhook", "https://hooks.example/x"),
    ("git-push", "refs/heads/main"),
    ("git-push", "kxm/run-8"),  # another run's branch
    ("git-push", "kxm/run-77"),  # not run 7's, though it starts like it
]
UNFENCED = [
    ("git-branch", "kxm/run-7"),
    ("git-commit", "refs/heads/main"),  # local whatever the target
    ("git-push", "kxm/run-7"),  # the run's own branch, in each of its forms
    ("git-push", "refs/heads/kxm/run-7-fix-login"),
    ("git-push", "kxm/fix-login-run-7"),
]


@pytest.mark.parametrize(("kind", "target"), SHARED)
async def test_a_shared_claim_takes_the_targets_lease(
    short_tmp: Path, kind: str, target: str
) -> None:
    """A shared kind leases target_ref; the row records lease_resource and its token."""
    p = params(kind=kind, target=target, payload={"title": "x"}, timeout_ms=20_000)
    resource = naming.lease_resource(kind, target)
    async with opened(short_tmp) as store:
        result = await claim(store, p)
        record = await get(store, key_of(p))
        now = record.claimed_at
        assert result == EffectClaimResult(
            effect_key=key_of(p),
            status="in_flight",
            attempt_id="a-1",
            lease_resource=resource,
            fencing_token=1,
            lease_expires_at=now + TTL,
        )
        assert record == EffectRecord(
            effect_key=key_of(p),
            run_id=RUN,
            step_id="open-pr",
            attempt_id="a-1",
            action_kind=kind,
            target_ref=target,
            status="in_flight",
            payload_hash=idem.payload_hash({"title": "x"}).hex(),
            receipt=None,
            claimed_at=now,
            heartbeat_at=now,
            completed_at=None,
            timeout_ms=20_000,
            lease_resource=resource,
            fencing_token=1,
            holder_pid=LIVE.pid,
        )
        assert await lease_rows(store) == [
            (resource, 1, ME, LIVE.pid, LIVE.start, now, now, now + TTL, store.daemon_id)
        ]
        assert await counters(store) == {resource: 1}


@pytest.mark.parametrize(("kind", "target"), UNFENCED)
async def test_local_kinds_and_a_push_to_the_runs_own_branch_take_no_lease(
    short_tmp: Path, kind: str, target: str
) -> None:
    """git-branch, git-commit and a push to the run's own branch are claimed without a
    lease: no lease fields, no lease row, no token issued."""
    p = params(kind=kind, target=target)
    async with opened(short_tmp) as store:
        result = await claim(store, p)
        assert result == EffectClaimResult(key_of(p), "in_flight", "a-1", None, None, None)
        record = await get(store, key_of(p))
        assert (record.status, record.lease_resource, record.fencing_token) == (
            "in_flight",
            None,
            None,
        )
        assert await lease_rows(store) == []
        assert await counters(store) == {}


async def test_the_branch_prefix_decides_which_push_is_the_runs_own(short_tmp: Path) -> None:
    """With prefix team/: a push to team/run-7 takes no lease, one to kxm/run-7 does."""
    own = params(step="push-own", kind="git-push", target="team/run-7-x")
    default_own = params(step="push-kxm", kind="git-push", target="kxm/run-7")
    async with opened(short_tmp) as store:
        assert (await claim(store, own, prefix="team/")).lease_resource is None
        fenced = await claim(store, default_own, prefix="team/")
        assert (fenced.lease_resource, fenced.fencing_token) == ("refs/heads/kxm/run-7", 1)
        # Under the default prefix team/run-7-x is somebody else's branch.
        shared = await claim(store, params(step="p2", kind="git-push", target="team/run-7-x"))
        assert shared.lease_resource == "refs/heads/team/run-7-x"
        assert await counters(store) == {"refs/heads/kxm/run-7": 1, "refs/heads/team/run-7-x": 1}


async def test_a_committed_effect_is_refused_before_the_lease_is_looked_at(
    short_tmp: Path,
) -> None:
    """The ledger comes first: a committed effect is EffectAlreadyCommitted (with its
    receipt) even while another holder has the target's lease, and nothing changes."""
    async with opened(short_tmp) as store:
        first = await claim(store)
        done = await commit(store, first.effect_key, receipt={"url": "https://pr/1"})
        await acquire(store)  # bob now leases the target (token 2)
        before = (await effect_rows(store), await lease_rows(store), await counters(store))
        for principal, holder, attempt in [("bob", LIVE, "b-1"), (ME, LIVE, "a-1")]:
            with pytest.raises(EffectAlreadyCommitted) as caught:
                await claim(store, params(attempt=attempt), principal, holder)
            assert caught.value.data == {"effect": data_of(done)}
            assert caught.value.data["effect"]["receipt"] == {"url": "https://pr/1"}
        with pytest.raises(EffectAlreadyCommitted):  # a different payload, too
            await claim(store, params(attempt="a-2", payload="other"))
        assert (await effect_rows(store), await lease_rows(store), await counters(store)) == before


async def test_lease_held_leaves_no_effect_row_and_no_lease_change(short_tmp: Path) -> None:
    """Another holder's live lease on the target: EffectLeaseHeld with data.lease, no
    effect row, the lease and its counter untouched."""
    async with opened(short_tmp) as store:
        await acquire(store)
        lease = await lease_get(store)
        before = (await lease_rows(store), await counters(store))
        for principal, holder in [(ME, LIVE), (ME, OTHER_LIVE), ("bob", OTHER_LIVE)]:
            with pytest.raises(EffectLeaseHeld) as held:
                await claim(store, principal=principal, holder=holder)
            assert held.value.data == {"lease": data_of(lease)}
        assert await effect_rows(store) == []
        assert await list_run(store) == []
        with pytest.raises(EffectNotFound):
            await get(store, key_of(params()))
        assert (await lease_rows(store), await counters(store)) == before


@pytest.mark.parametrize("first_target", ["refs/heads/main", "main", "heads/main"])
async def test_every_spelling_of_one_branch_contends_for_one_lease(
    short_tmp: Path, first_target: str
) -> None:
    """A push to ``main``, one to ``heads/main`` and one to ``refs/heads/main`` (other
    runs) are one target, as git resolves them: each after the first is EffectLeaseHeld
    (each spelling once took its own lease, and two runs pushed the branch at the same
    time: a tester's reproducer; ``heads/main`` was leased as refs/heads/heads/main)."""
    async with opened(short_tmp) as store:
        first = await claim(store, params(step="push", kind="git-push", target=first_target))
        assert first.lease_resource == "refs/heads/main"
        for target in ("main", "heads/main", "refs/heads/main"):
            with pytest.raises(EffectLeaseHeld):
                await claim(store, params(step="push", kind="git-push", target=target,
                                          run="run_other", attempt="b-1"),
                            holder=OTHER_LIVE)  # fmt: skip
        tag = await claim(store, params(step="tag", kind="git-push", target="tags/v1"))
        assert tag.lease_resource == "refs/tags/v1"
        with pytest.raises(EffectLeaseHeld):
            await claim(store, params(step="tag", kind="git-push", target="refs/tags/v1",
                                      run="run_other", attempt="b-1"),
                        holder=OTHER_LIVE)  # fmt: skip


async def test_a_lease_on_the_bare_branch_name_from_before_the_upgrade_still_contends(
    short_tmp: Path,
) -> None:
    """An effect claimed before bare names were leased as refs/heads/... holds the
    lease ``release``; a claim on ``release`` now must still be refused while it lives."""
    async with opened(short_tmp) as store:
        await acquire(store, resource="release")  # as the old claim did, for another holder
        with pytest.raises(EffectLeaseHeld):
            await claim(store, params(step="push", kind="git-push", target="release"))


_GIT_MAY_MAKE = [
    ("heads/release", "refs/heads/heads/release"),
    ("heads/release", "refs/tags/heads/release"),
    ("tags/v1", "refs/heads/tags/v1"),
    ("tags/v1", "refs/tags/tags/v1"),
]


@pytest.mark.parametrize(("first", "second"), [*_GIT_MAY_MAKE, *((b, a) for a, b in _GIT_MAY_MAKE)])
async def test_a_short_ref_name_and_each_ref_git_may_make_of_it_contend(
    short_tmp: Path, first: str, second: str
) -> None:
    """A push to ``heads/release`` goes to refs/heads/release if the remote has it,
    else git makes refs/heads/heads/release (refs/tags/heads/release for a tag): so a
    claim on the short name and one on any of those (another run) contend, whichever
    comes first (a review found the full name granted after the short one)."""
    async with opened(short_tmp) as store:
        await claim(store, params(step="push", kind="git-push", target=first))
        with pytest.raises(EffectLeaseHeld):
            await claim(store, params(step="push", kind="git-push", target=second,
                                      run="run_other", attempt="b-1"),
                        holder=OTHER_LIVE)  # fmt: skip


@pytest.mark.parametrize(
    ("target", "held"),
    [("heads/main", "heads/main"), ("heads/main", "refs/heads/heads/main"),
     ("tags/v1", "refs/heads/tags/v1"), ("tags/v1", "refs/tags/tags/v1")],
)  # fmt: skip
async def test_a_short_ref_name_contends_with_every_lease_it_may_stand_for(
    short_tmp: Path, target: str, held: str
) -> None:
    """``heads/main`` was leased as refs/heads/heads/main before short names were folded
    (the ref git makes of it when the remote has no refs/heads/main), or by a hand-made
    lease as itself; ``tags/v1`` as refs/heads/tags/v1 (refs/tags/tags/v1 for a new tag):
    a claim on it is refused while another holder has any of them."""
    async with opened(short_tmp) as store:
        await acquire(store, resource=held)  # another holder's
        with pytest.raises(EffectLeaseHeld):
            await claim(store, params(step="push", kind="git-push", target=target))


async def test_lease_held_on_rearming_a_failed_effect_writes_nothing(short_tmp: Path) -> None:
    """Re-arming a failed shared effect while another holder leases the target is
    EffectLeaseHeld and leaves the failed row exactly as it was."""
    async with opened(short_tmp) as store:
        first = await claim(store)
        await fail(store, first.effect_key, "a-1", "boom")
        await acquire(store)
        before = (await effect_rows(store), await lease_rows(store), await counters(store))
        with pytest.raises(EffectLeaseHeld):
            await claim(store, params(attempt="a-2"))
        assert (await effect_rows(store), await lease_rows(store), await counters(store)) == before
        assert (await get(store, first.effect_key)).status == "failed"


async def test_a_different_payload_is_an_idempotency_conflict(short_tmp: Path) -> None:
    """A claim whose payload hash differs from the row's: IdempotencyConflict, for the
    same or another attempt, in flight or failed; nothing changes."""
    async with opened(short_tmp) as store:
        first = await claim(store, params(payload={"a": 1, "b": 2}))
        before = await effect_rows(store)
        for attempt in ("a-1", "a-2"):
            with pytest.raises(IdempotencyConflict) as caught:
                await claim(store, params(attempt=attempt, payload={"a": 1, "b": 3}))
            assert caught.value.data == {"effect_key": first.effect_key, "status": "in_flight"}
        assert await effect_rows(store) == before
        await fail(store, first.effect_key, "a-1", None)
        with pytest.raises(IdempotencyConflict) as caught:
            await claim(store, params(attempt="a-2"))  # payload None now
        assert caught.value.data == {"effect_key": first.effect_key, "status": "failed"}
        assert (await get(store, first.effect_key)).status == "failed"


async def test_the_same_claim_repeated_is_answered_again(short_tmp: Path) -> None:
    """The same attempt from the same holder (its answer was lost) gets the same answer:
    no second lease grant, the lease not extended, the row unchanged."""
    async with opened(short_tmp) as store:
        first = await claim(store, params(payload={"a": 1, "b": 2}))
        before = (await effect_rows(store), await lease_rows(store))
        again = await claim(store, params(payload={"b": 2, "a": 1}), shift=1_000)
        assert again == first
        assert (await effect_rows(store), await lease_rows(store)) == before
        assert await counters(store) == {PR: 1}


async def test_a_repeated_claim_does_not_report_a_newer_holders_lease(short_tmp: Path) -> None:
    """The answer repeated to an attempt whose lease lapsed and was taken over must not
    pair its old token with the new holder's deadline (it would look still fenced)."""
    async with opened(short_tmp) as store:
        first = await claim(store, params(lease_ttl_ms=5_000))
        bob = await acquire(store, shift=10_000)  # token 2, bob's until +10 s + TTL
        try:
            again = await claim(store, shift=10_000)
        except EffectLeaseSuperseded:
            return  # also acceptable: the lost fence is reported
        assert again.fencing_token == first.fencing_token == 1
        assert again.lease_expires_at != bob.expires_at, (
            "token 1 is answered with token 2's deadline"
        )


async def test_another_attempt_while_in_flight_is_refused(short_tmp: Path) -> None:
    """A fresh in-flight effect refuses another attempt, or the same attempt from
    another holder: EffectInFlight with data.effect; nothing changes."""
    async with opened(short_tmp) as store:
        first = await claim(store)
        record = await get(store, first.effect_key)
        before = (await effect_rows(store), await lease_rows(store), await counters(store))
        for principal, holder, attempt in [
            (ME, LIVE, "a-2"),
            ("bob", OTHER_LIVE, "b-1"),
            (ME, OTHER_LIVE, "a-1"),
            (ME, None, "a-1"),
        ]:
            with pytest.raises(EffectInFlight) as caught:
                await claim(store, params(attempt=attempt), principal, holder)
            assert caught.value.data == {"effect": data_of(record)}
        assert (await effect_rows(store), await lease_rows(store), await counters(store)) == before


@pytest.mark.parametrize("why", ["silent", "dead"])
async def test_a_stale_shared_effect_is_parked_uncertain_and_stays_parked(
    short_tmp: Path, why: str
) -> None:
    """A shared effect past its timeout without a heartbeat, or whose holder died, is
    parked uncertain by the next claim: Refused(EffectUncertain), and the park commits."""
    holder, shift = (LIVE, 1_000) if why == "silent" else (DEAD, 0)
    async with opened(short_tmp) as store:
        first = await claim(store, params(timeout_ms=1_000), holder=holder)
        record = await get(store, first.effect_key)
        with pytest.raises(EffectUncertain) as caught:
            await claim(store, params(attempt="a-2", timeout_ms=1_000), shift=shift)
        assert caught.value.data == parked(record)
        stored = await get(store, first.effect_key)
        assert data_of(stored) == {**data_of(record), "status": "uncertain"}  # attempt a-1
        assert await counters(store) == {PR: 1}  # no lease was taken for the new attempt
        with pytest.raises(EffectUncertain) as again:  # now settled: refused, no write
            await claim(store, params(attempt="a-3", timeout_ms=1_000), shift=shift)
        assert again.value.data == {"effect": data_of(stored)}
    assert query(short_tmp, "SELECT status, attempt_id FROM effects") == [("uncertain", "a-1")]


@pytest.mark.parametrize("why", ["silent", "dead"])
async def test_a_stale_local_effect_is_taken_over(short_tmp: Path, why: str) -> None:
    """A stale git-commit/git-branch is safe to redo: a new attempt takes the row over."""
    holder, shift = (LIVE, 1_000) if why == "silent" else (DEAD, 0)
    p = params(step="commit", kind="git-commit", target="kxm/run-7", timeout_ms=1_000)
    async with opened(short_tmp) as store:
        first = await claim(store, p, holder=holder)
        old = await get(store, first.effect_key)
        taken = await claim(
            store, msgspec.structs.replace(p, attempt_id="a-2"), "bob", OTHER_LIVE, shift=shift
        )
        assert taken == EffectClaimResult(first.effect_key, "in_flight", "a-2", None, None, None)
        new = await get(store, first.effect_key)
        assert (new.status, new.attempt_id, new.holder_pid) == ("in_flight", "a-2", OTHER_LIVE.pid)
        assert new.claimed_at == new.heartbeat_at >= old.claimed_at + shift
        [row] = await sql(store, "SELECT principal, holder_start FROM effects")
        assert row == ("bob", OTHER_LIVE.start)
        assert len(await list_run(store)) == 1


@pytest.mark.parametrize("ending", ["fail", "abort"])
async def test_failed_and_aborted_effects_are_rearmed_in_place(
    short_tmp: Path, ending: str
) -> None:
    """A new attempt re-arms a failed or aborted effect: in flight under a new token,
    receipt cleared, and the row keeps its place in effect.list order."""
    async with opened(short_tmp) as store:
        first = await claim(store)
        second = await claim(store, params(step="branch", kind="git-branch", target="kxm/run-7"))
        await ENDINGS[ending](store, first.effect_key, "a-1", "why")
        rearmed = await claim(store, params(attempt="a-2"), "bob", OTHER_LIVE)
        assert (rearmed.attempt_id, rearmed.lease_resource, rearmed.fencing_token) == (
            "a-2",
            PR,
            2,
        )
        listed = await list_run(store)
        assert [e.effect_key for e in listed] == [first.effect_key, second.effect_key]
        record = listed[0]
        assert (record.status, record.attempt_id, record.receipt, record.completed_at) == (
            "in_flight",
            "a-2",
            None,
            None,
        )
        assert (record.fencing_token, record.holder_pid) == (2, OTHER_LIVE.pid)
        [lease] = await lease_rows(store)
        assert lease[:4] == (PR, 2, "bob", OTHER_LIVE.pid)


# --- heartbeat ---------------------------------------------------------------------------


async def test_heartbeat_refreshes_the_effect_and_extends_its_lease(short_tmp: Path) -> None:
    """heartbeat sets heartbeat_at to now and extends the lease under the same token."""
    async with opened(short_tmp) as store:
        first = await claim(store, params(lease_ttl_ms=5_000))
        claimed = await get(store, first.effect_key)
        beat = await heartbeat(store, first.effect_key, ttl=30_000, shift=3_000)
        stored = await get(store, first.effect_key)
        assert beat == stored
        assert stored.heartbeat_at >= claimed.claimed_at + 3_000
        assert {**data_of(stored), "heartbeat_at": claimed.heartbeat_at} == data_of(claimed)
        lease = await lease_get(store)
        assert (lease.fencing_token, lease.renewed_at, lease.expires_at) == (
            1,
            stored.heartbeat_at,
            stored.heartbeat_at + 30_000,
        )
        assert await counters(store) == {PR: 1}


async def test_heartbeat_keeps_a_lapsed_or_released_lease_nobody_took(short_tmp: Path) -> None:
    """While the effect's token is still the newest, a heartbeat extends a lapsed lease,
    or writes a released one again, under that same token."""
    async with opened(short_tmp) as store:
        first = await claim(store, params(lease_ttl_ms=5_000))
        await heartbeat(store, first.effect_key, shift=10_000)  # lapsed at +5 s
        lease = await lease_get(store)
        assert (lease.fencing_token, lease.live) == (1, True)
        await store.write(leases.release, caller(ME, LIVE), LeaseTokenParams(PR, 1))
        beat = await heartbeat(store, first.effect_key)
        [row] = await lease_rows(store)
        assert row[:5] == (PR, 1, ME, LIVE.pid, LIVE.start)
        assert row[7] == beat.heartbeat_at + TTL
        assert await counters(store) == {PR: 1}


async def test_heartbeat_from_another_attempt_is_superseded(short_tmp: Path) -> None:
    """A heartbeat naming another attempt is EffectAttemptSuperseded and changes nothing;
    on a committed effect it is EffectAlreadyCommitted; an unknown key EffectNotFound."""
    async with opened(short_tmp) as store:
        first = await claim(store)
        record = await get(store, first.effect_key)
        before = (await effect_rows(store), await lease_rows(store))
        with pytest.raises(EffectAttemptSuperseded) as caught:
            await heartbeat(store, first.effect_key, attempt="a-2", shift=1_000)
        assert caught.value.data == {"effect": data_of(record)}
        assert (await effect_rows(store), await lease_rows(store)) == before
        await commit(store, first.effect_key)
        with pytest.raises(EffectAlreadyCommitted):
            await heartbeat(store, first.effect_key)
        with pytest.raises(EffectNotFound):
            await heartbeat(store, "eff_0000000000000000")


async def test_heartbeat_after_a_newer_token_parks_the_effect(short_tmp: Path) -> None:
    """Once another holder got a newer token for the target, heartbeat is
    Refused(EffectLeaseSuperseded): the effect is parked uncertain (committed) and the
    new holder's lease is left alone."""
    async with opened(short_tmp) as store:
        first = await claim(store, params(lease_ttl_ms=5_000))
        record = await get(store, first.effect_key)
        await acquire(store, shift=10_000)
        bobs = await lease_rows(store)
        with pytest.raises(EffectLeaseSuperseded) as caught:
            await heartbeat(store, first.effect_key, shift=10_000)
        assert caught.value.data == parked(record)
        assert await get(store, first.effect_key) == EffectRecord(
            **{**data_of(record), "status": "uncertain"}
        )
        assert await lease_rows(store) == bobs
        assert await counters(store) == {PR: 2}
    assert query(short_tmp, "SELECT status FROM effects") == [("uncertain",)]


# --- commit ------------------------------------------------------------------------------


async def test_commit_is_accepted_after_a_lapse_nobody_took_over(short_tmp: Path) -> None:
    """A token that is still the newest commits even past the lease deadline; the
    receipt and completed_at are stored and the lease row goes, its counter stays."""
    async with opened(short_tmp) as store:
        first = await claim(store, params(lease_ttl_ms=5_000))
        claimed = await get(store, first.effect_key)
        done = await commit(store, first.effect_key, receipt={"url": "u"}, shift=10_000)
        assert done == await get(store, first.effect_key)
        assert (done.status, done.receipt, done.fencing_token) == ("committed", {"url": "u"}, 1)
        assert done.completed_at is not None and done.completed_at >= claimed.claimed_at + 10_000
        assert await lease_rows(store) == []
        assert await counters(store) == {PR: 1}


async def test_commit_after_a_newer_token_is_refused_and_parks(short_tmp: Path) -> None:
    """Another holder has a newer token: a wrong attempt is still only superseded (and
    parks nothing); the owner's commit is Refused(EffectLeaseSuperseded) and the effect
    is parked uncertain (committed), without its receipt, the new lease untouched."""
    async with opened(short_tmp) as store:
        first = await claim(store, params(lease_ttl_ms=5_000))
        record = await get(store, first.effect_key)
        await acquire(store, shift=10_000)
        bobs = await lease_rows(store)
        with pytest.raises(EffectAttemptSuperseded):
            await commit(store, first.effect_key, attempt="a-9", shift=10_000)
        assert (await get(store, first.effect_key)).status == "in_flight"
        with pytest.raises(EffectLeaseSuperseded) as caught:
            await commit(store, first.effect_key, receipt={"url": "u"}, shift=10_000)
        assert caught.value.data == parked(record)
        stored = await get(store, first.effect_key)
        assert (stored.status, stored.receipt, stored.completed_at) == ("uncertain", None, None)
        assert await lease_rows(store) == bobs
        with pytest.raises(EffectUncertain):  # the same commit again: now settled
            await commit(store, first.effect_key, receipt={"url": "u"}, shift=10_000)
        resolved = await resolve(store, first.effect_key, "aborted", None)
        assert resolved.status == "aborted"
        assert await lease_rows(store) == bobs  # the old token gives back nothing of bob's
    assert query(short_tmp, "SELECT status FROM effects") == [("aborted",)]


async def test_a_repeated_commit_is_answered_again(short_tmp: Path) -> None:
    """The same attempt committing again gets the stored record; nothing changes."""
    async with opened(short_tmp) as store:
        first = await claim(store)
        done = await commit(store, first.effect_key, receipt={"sha": "abc"})
        rows = await effect_rows(store)
        assert await commit(store, first.effect_key, receipt={"sha": "abc"}, shift=5_000) == done
        assert await effect_rows(store) == rows


async def test_commit_from_another_attempt_changes_nothing(short_tmp: Path) -> None:
    """A commit naming another attempt: EffectAttemptSuperseded, row and lease unchanged;
    once committed, another attempt's commit is EffectAlreadyCommitted."""
    async with opened(short_tmp) as store:
        first = await claim(store)
        record = await get(store, first.effect_key)
        before = (await effect_rows(store), await lease_rows(store), await counters(store))
        with pytest.raises(EffectAttemptSuperseded) as caught:
            await commit(store, first.effect_key, attempt="a-2", receipt="mine")
        assert caught.value.data == {"effect": data_of(record)}
        assert (await effect_rows(store), await lease_rows(store), await counters(store)) == before
        await commit(store, first.effect_key)
        with pytest.raises(EffectAlreadyCommitted):
            await commit(store, first.effect_key, attempt="a-2")
        with pytest.raises(EffectNotFound):
            await commit(store, "eff_0000000000000000")


async def test_ending_one_effect_keeps_the_lease_another_in_flight_effect_shares(
    short_tmp: Path,
) -> None:
    """Two effects of one holder on one target share its lease (the second claim extends
    it, same token): committing the first must not free the target while the second is
    still in flight, or another holder could act on it meanwhile."""
    async with opened(short_tmp) as store:
        first = await claim(store, params(step="comment-1"))
        second = await claim(store, params(step="comment-2"))
        assert first.fencing_token == second.fencing_token == 1
        await commit(store, first.effect_key, receipt="done")
        assert (await get(store, second.effect_key)).status == "in_flight"
        try:
            bobs = await acquire(store)  # bob, while comment-2 is still being executed
        except LeaseHeld:
            bobs = None
        assert bobs is None, f"bob was granted token {bobs.fencing_token} mid-effect"
        assert await counters(store) == {PR: 1}


@pytest.mark.parametrize(
    ("ending", "argument", "status", "receipt"),
    [
        ("commit", {"sha": "1"}, "committed", {"sha": "1"}),
        ("abort", "not needed", "aborted", {"reason": "not needed"}),
        ("fail", {"code": 500}, "failed", {"error": {"code": 500}}),
    ],
)
async def test_commit_abort_and_fail_give_the_lease_back(
    short_tmp: Path, ending: str, argument: Any, status: str, receipt: Any
) -> None:
    """Ending an effect deletes its lease row but keeps the counter: the next grant on
    the target is the effect's token + 1."""
    async with opened(short_tmp) as store:
        first = await claim(store)
        if ending == "commit":
            ended = await commit(store, first.effect_key, receipt=argument)
        else:
            ended = await ENDINGS[ending](store, first.effect_key, "a-1", argument)
        assert (ended.status, ended.receipt) == (status, receipt)
        assert ended == await get(store, first.effect_key)
        assert await lease_rows(store) == []
        assert await counters(store) == {PR: 1}
        assert (await acquire(store)).fencing_token == 2


@pytest.mark.parametrize("ending", ["abort", "fail"])
async def test_abort_and_fail_are_guarded_by_status_and_attempt(
    short_tmp: Path, ending: str
) -> None:
    """abort/fail need the attempt that owns the in-flight effect: another attempt, or an
    effect already ended, is EffectAttemptSuperseded; committed and uncertain effects
    answer as such; none of these changes anything."""

    async def end(key: str, attempt: str) -> EffectRecord:
        return await ENDINGS[ending](store, key, attempt, "x")

    async with opened(short_tmp) as store:
        live = await claim(store)
        before = await effect_rows(store)
        with pytest.raises(EffectAttemptSuperseded):
            await end(live.effect_key, "a-2")
        assert await effect_rows(store) == before
        await abort(store, live.effect_key, "a-1", "first")
        ended = await effect_rows(store)
        for attempt in ("a-1", "a-2"):
            with pytest.raises(EffectAttemptSuperseded):
                await end(live.effect_key, attempt)
        assert await effect_rows(store) == ended

        done = await claim(store, params(step="s2"))
        await commit(store, done.effect_key)
        with pytest.raises(EffectAlreadyCommitted):
            await end(done.effect_key, "a-1")

        stale = await claim(store, params(step="s3"), holder=DEAD)
        with pytest.raises(EffectUncertain):
            await claim(store, params(step="s3", attempt="a-2"))  # parks it
        with pytest.raises(EffectUncertain):
            await end(stale.effect_key, "a-1")
        assert (await get(store, stale.effect_key)).status == "uncertain"
        with pytest.raises(EffectNotFound):
            await end("eff_0000000000000000", "a-1")


# --- resolve -----------------------------------------------------------------------------


async def test_resolve_only_settles_an_uncertain_effect(short_tmp: Path) -> None:
    """resolve of an in-flight, committed, failed or aborted effect is
    EffectAttemptSuperseded, changes nothing and logs nothing."""
    async with opened(short_tmp) as store:
        flying = await claim(store, params(step="s1"))
        done = await claim(store, params(step="s2"))
        await commit(store, done.effect_key)
        failed = await claim(store, params(step="s3"))
        await fail(store, failed.effect_key, "a-1", None)
        aborted = await claim(store, params(step="s4"))
        await abort(store, aborted.effect_key, "a-1", None)
        before = await effect_rows(store)
        for key in (flying, done, failed, aborted):
            record = await get(store, key.effect_key)
            for outcome in ("committed", "aborted"):
                with pytest.raises(EffectAttemptSuperseded) as caught:
                    await resolve(store, key.effect_key, outcome, None)
                assert caught.value.data == {"effect": data_of(record)}
        with pytest.raises(EffectNotFound):
            await resolve(store, "eff_0000000000000000", "committed", None)
        assert await effect_rows(store) == before
        assert await sql(store, "SELECT * FROM operator_log") == []


@pytest.mark.parametrize("outcome", ["committed", "aborted"])
async def test_resolve_settles_an_uncertain_effect_and_logs_it(
    short_tmp: Path, outcome: str
) -> None:
    """The operator's decision is stored (status, receipt, completed_at), its lease given
    back, and written to the operator log; committed is then never claimed again, while
    aborted can be re-armed."""
    async with opened(short_tmp) as store:
        first = await claim(store, params(timeout_ms=1_000))
        parked_keys = await store.write(at(1_000, effects.park_stale), [])
        assert parked_keys == [first.effect_key]
        assert [row[1] for row in await lease_rows(store)] == [1]  # parking keeps the lease
        resolved = await resolve(
            store, first.effect_key, outcome, {"checked": "by hand"}, principal="operator"
        )
        assert resolved == await get(store, first.effect_key)
        assert (resolved.status, resolved.receipt, resolved.attempt_id) == (
            outcome,
            {"checked": "by hand"},
            "a-1",
        )
        assert resolved.completed_at is not None
        assert await lease_rows(store) == []
        [(daemon_id, principal, action, detail)] = await sql(
            store, "SELECT daemon_id, principal, action, detail FROM operator_log"
        )
        assert (daemon_id, principal, action) == (store.daemon_id, "operator", "effect.resolve")
        assert json.loads(detail) == {"effect_key": first.effect_key, "outcome": outcome}
        if outcome == "committed":
            with pytest.raises(EffectAlreadyCommitted):
                await claim(store, params(attempt="a-2", timeout_ms=1_000))
        else:
            again = await claim(store, params(attempt="a-2", timeout_ms=1_000))
            assert (again.status, again.fencing_token) == ("in_flight", 2)


# --- parking, liveness, reconciliation ---------------------------------------------------


async def test_park_stale_parks_silent_and_dead_shared_effects_only(short_tmp: Path) -> None:
    """park_stale makes silent shared effects and those of the given dead holders
    uncertain and returns them; local ones, fresh ones and settled ones stay."""
    async with opened(short_tmp) as store:
        keys = {}
        for name, kind, target, holder, timeout in [
            ("shared-silent", "webhook", "https://h/1", LIVE, 1_000),
            ("shared-dead", "tracker-issue", "JIRA-1", DEAD, 60_000),
            ("shared-fresh", "pr-create", PR, LIVE, 60_000),
            ("shared-dead-unlisted", "webhook", "https://h/2", Holder(1, 1), 60_000),
            ("local-silent", "git-commit", "kxm/run-7", LIVE, 1_000),
            ("local-dead", "git-branch", "kxm/run-7", DEAD, 60_000),
            ("push-own-silent", "git-push", "kxm/run-7", LIVE, 1_000),
        ]:
            p = params(step=name, kind=kind, target=target, timeout_ms=timeout)
            keys[name] = (await claim(store, p, holder=holder)).effect_key
        done = await claim(store, params(step="done", timeout_ms=1_000))
        await commit(store, done.effect_key)

        assert set(await store.read(effects.holders)) == {LIVE, DEAD, Holder(1, 1)}
        parked_keys = await store.write(at(1_000, effects.park_stale), [DEAD])
        assert sorted(parked_keys) == sorted(
            [keys["shared-silent"], keys["shared-dead"], keys["push-own-silent"]]
        )
        statuses = {name: (await get(store, key)).status for name, key in keys.items()}
        assert statuses == {
            "shared-silent": "uncertain",
            "shared-dead": "uncertain",
            "shared-fresh": "in_flight",
            "shared-dead-unlisted": "in_flight",
            "local-silent": "in_flight",
            "local-dead": "in_flight",
            "push-own-silent": "uncertain",
        }
        assert (await get(store, done.effect_key)).status == "committed"
        assert await store.write(at(1_000, effects.park_stale), [DEAD]) == []


async def test_liveness_settles_keys_leases_and_effects_of_dead_holders_together(
    short_tmp: Path,
) -> None:
    """liveness.settle for a dead holder: its keys turn unknown (or complete from a
    committed effect), its leases go, its shared in-flight effects park; a live
    holder's keys, leases and effects are untouched."""
    async with opened(short_tmp) as store:
        evidence = await claim(store, params(step="pushed", kind="git-push", target="main"))
        await commit(store, evidence.effect_key, receipt={"sha": "f00"})
        for key, holder, ref in [
            ("dead-plain", DEAD, None),
            ("dead-evidence", DEAD, evidence.effect_key),
            ("live", LIVE, None),
        ]:
            await idem_claim(
                store, IdemClaimParams(operation="deploy", key=key, effect_ref=ref), holder
            )
        await acquire(store, "res/dead", ME, DEAD)
        await acquire(store, "res/live", ME, LIVE)
        shared = await claim(
            store, params(step="issue", kind="tracker-issue", target="J-1"), holder=DEAD
        )
        local = await claim(
            store, params(step="br", kind="git-branch", target="kxm/run-7"), holder=DEAD
        )
        mine = await claim(store, params(step="pr"), holder=LIVE)

        holders, silent = await store.read(liveness.to_check)
        assert set(holders) == {LIVE, DEAD} and silent is False
        report = await store.write(liveness.settle, [DEAD])
        assert report.keys_unknown == [(ME, "deploy", "dead-plain")]
        assert report.keys_completed == [(ME, "deploy", "dead-evidence")]
        assert sorted(report.leases_released) == ["J-1", "res/dead"]
        assert report.effects_parked == [shared.effect_key]

        states = {r.key: (r.state, r.result) for r in (await idem_keys(store)).keys}
        assert states == {
            "dead-plain": ("outcome_unknown", None),
            "dead-evidence": (
                "completed",
                {"effect_key": evidence.effect_key, "receipt": {"sha": "f00"}},
            ),
            "live": ("in_progress", None),
        }
        assert [row[0] for row in await lease_rows(store)] == [PR, "res/live"]
        assert (await get(store, shared.effect_key)).status == "uncertain"
        assert (await get(store, local.effect_key)).status == "in_flight"
        assert (await get(store, mine.effect_key)).status == "in_flight"


async def test_to_check_reports_a_silent_shared_effect(short_tmp: Path) -> None:
    """to_check flags a shared in-flight effect past its timeout, never a local one."""
    async with opened(short_tmp) as store:
        await claim(store, params(step="c", kind="git-commit", target="x", timeout_ms=1_000))
        assert (await store.read(at(1_000, liveness.to_check)))[1] is False
        await claim(store, params(timeout_ms=1_000))
        assert (await store.read(liveness.to_check))[1] is False
        assert (await store.read(at(1_000, liveness.to_check)))[1] is True


async def test_a_key_fronting_an_effect_completes_at_restart_once_it_is_committed(
    short_tmp: Path,
) -> None:
    """At start-up an unknown key whose effect_ref is an effect key completes with
    {effect_key, receipt} if that effect is committed; otherwise it stays unknown
    (in flight, uncertain, or no such effect) until a later start finds it committed."""
    async with opened(short_tmp) as store:
        committed = await claim(store, params(step="s1", target="pr/1"))
        await commit(store, committed.effect_key, receipt={"url": "https://pr/1"})
        flying = await claim(store, params(step="s2", target="pr/2"))
        unsure = await claim(store, params(step="s3", target="pr/3"), holder=DEAD)
        with pytest.raises(EffectUncertain):
            await claim(store, params(step="s3", target="pr/3", attempt="a-2"))
        refs = {
            "k-committed": committed.effect_key,
            "k-flying": flying.effect_key,
            "k-unsure": unsure.effect_key,
            "k-missing": "eff_0000000000000000",
        }
        for key, ref in refs.items():
            idem_params = IdemClaimParams(operation="deploy", key=key, effect_ref=ref)
            await idem_claim(store, idem_params, LIVE)

    async def states(store: Store) -> dict[str, tuple[str, Any]]:
        page = await idem_keys(store)
        return {r.key: (r.state, r.result) for r in page.keys}

    async with opened(short_tmp) as store:
        report = store.reconciliation
        assert (report.marked_unknown, report.completed_from_evidence, report.still_unknown) == (
            4,
            1,
            3,
        )
        assert await states(store) == {
            "k-committed": (
                "completed",
                {"effect_key": committed.effect_key, "receipt": {"url": "https://pr/1"}},
            ),
            "k-flying": ("outcome_unknown", None),
            "k-unsure": ("outcome_unknown", None),
            "k-missing": ("outcome_unknown", None),
        }
        await commit(store, flying.effect_key, receipt="pushed")
        await resolve(store, unsure.effect_key, "committed", {"r": 3})

    async with opened(short_tmp) as store:
        report = store.reconciliation
        assert (report.marked_unknown, report.completed_from_evidence, report.still_unknown) == (
            0,
            2,
            1,
        )
        settled = await states(store)
        assert settled["k-flying"] == (
            "completed",
            {"effect_key": flying.effect_key, "receipt": "pushed"},
        )
        assert settled["k-unsure"] == (
            "completed",
            {"effect_key": unsure.effect_key, "receipt": {"r": 3}},
        )
        assert settled["k-missing"] == ("outcome_unknown", None)


# --- Refused versus raised ---------------------------------------------------------------


async def test_in_one_batch_a_refused_write_commits_and_a_raised_one_rolls_back(
    short_tmp: Path,
) -> None:
    """Three writes in one batch: a claim that parks a stale effect (Refused: its caller
    gets EffectUncertain, the park commits), a write that raises after writing (all its
    writes rolled back), and a plain grant (committed)."""

    def claim_then_raise(tx: Tx) -> None:
        doomed = params(step="doomed", kind="webhook", target="https://h")
        effects.claim(tx, caller(ME, LIVE), doomed)
        leases.acquire(tx, caller(ME, LIVE), LeaseAcquireParams("doomed/lease", TTL))
        raise RuntimeError("after writing")

    async with opened(short_tmp) as store:
        stale = await claim(store, holder=DEAD)
        other = params(step="other", target="pr/other")
        await claim(store, other, holder=DEAD)
        [returned] = await store.write(
            lambda tx: (
                effects.claim(
                    tx, caller(ME, LIVE), msgspec.structs.replace(other, attempt_id="a-2")
                ),
            )
        )  # the store function returns its refusal; only Store.write turns it into an error
        assert isinstance(returned, Refused) and isinstance(returned.error, EffectUncertain)
        futures = [
            store.write(effects.claim, caller(ME, LIVE), params(attempt="a-2")),
            store.write(claim_then_raise),
            store.write(leases.acquire, caller(ME, LIVE), LeaseAcquireParams("kept", TTL)),
        ]  # queued before the writer runs: one batch, one transaction
        refused, raised, granted = await asyncio.gather(*futures, return_exceptions=True)
        assert isinstance(refused, EffectUncertain)
        assert refused.data["effect"]["status"] == "uncertain"
        assert isinstance(raised, RuntimeError)
        assert granted.fencing_token == 1

        assert (await get(store, stale.effect_key)).status == "uncertain"
        with pytest.raises(EffectNotFound):
            await get(store, key_of(params(step="doomed", kind="webhook", target="https://h")))
        assert [row[0] for row in await lease_rows(store)] == [PR, "kept", "pr/other"]
        assert await counters(store) == {PR: 1, "pr/other": 1, "kept": 1}
    assert query(short_tmp, "SELECT effect_key, status FROM effects ORDER BY rowid") == [
        (stale.effect_key, "uncertain"),
        (key_of(other), "uncertain"),
    ]
