"""Fenced leases in the store: grants, tokens, refusals, expiry and dead holders.

Every request is ``fn(tx, caller, params)`` as its route in daemon/handlers.py runs it:
the caller (principal and holder process) asks, the params say what. The clock is
moved by running a store function on a Tx whose ``now`` is shifted (``at``), never by
sleeping; a dead holder is this process's pid with a start time that is not its own.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from store_helpers import DEAD, LIVE, OTHER_LIVE, at, caller, counters, lease_rows, opened
from towerd.daemon.processes import Holder, holder_of
from towerd.daemon.store import Store, leases
from towerd.protocol.errors import LeaseExpired, LeaseHeld, LeaseNotFound, LeaseSuperseded
from towerd.protocol.methods import (
    Empty,
    LeaseAcquireParams,
    LeaseAcquireResult,
    LeaseRecord,
    LeaseReleaseResult,
    LeaseRenewParams,
    LeaseResourceParams,
    LeaseTokenParams,
)

pytestmark = pytest.mark.anyio

ME = "alice"
RES = "repo/main"
TTL = 60_000

_me = holder_of(os.getpid())
_parent = holder_of(os.getppid())
assert _me is not None and _parent is not None


async def acquire(
    store: Store,
    resource: str = RES,
    principal: str = ME,
    holder: Holder | None = LIVE,
    ttl_ms: int = TTL,
    shift: int = 0,
) -> LeaseAcquireResult:
    params = LeaseAcquireParams(resource=resource, ttl_ms=ttl_ms)
    return await store.write(at(shift, leases.acquire), caller(principal, holder), params)


async def renew(
    store: Store, principal: str, holder: Holder | None, resource: str, token: int,
    ttl_ms: int, shift: int = 0,
) -> LeaseAcquireResult:  # fmt: skip
    params = LeaseRenewParams(resource=resource, fencing_token=token, ttl_ms=ttl_ms)
    return await store.write(at(shift, leases.renew), caller(principal, holder), params)


async def release(
    store: Store, principal: str, holder: Holder | None, resource: str, token: int,
    shift: int = 0,
) -> LeaseReleaseResult:  # fmt: skip
    params = LeaseTokenParams(resource=resource, fencing_token=token)
    return await store.write(at(shift, leases.release), caller(principal, holder), params)


async def get(store: Store, resource: str, shift: int = 0) -> LeaseRecord:
    """lease.get as anyone sees it (it names no caller)."""
    return await store.read(at(shift, leases.get), caller(), LeaseResourceParams(resource))


async def list_live(store: Store) -> list[LeaseRecord]:
    """lease.list's leases, as anyone sees them."""
    return (await store.read(leases.list_leases, caller(), Empty())).leases


def as_dict(record: LeaseRecord) -> dict[str, Any]:
    return {name: getattr(record, name) for name in record.__struct_fields__}


# --- acquire ------------------------------------------------------------------------------


async def test_first_grant_is_token_1_and_is_stored_with_its_counter(short_tmp: Path) -> None:
    """The first grant on a resource is token 1, renewed=False, stored with its holder."""
    async with opened(short_tmp) as store:
        granted = await acquire(store)
        [row] = await lease_rows(store)
        acquired_at = row[5]
        assert granted == LeaseAcquireResult(
            RES, 1, acquired_at + TTL, f"{ME} pid {LIVE.pid}", False
        )
        assert row == (
            RES, 1, ME, LIVE.pid, LIVE.start, acquired_at, acquired_at, acquired_at + TTL,
            store.daemon_id,
        )  # fmt: skip
        assert await counters(store) == {RES: 1}
        assert await get(store, RES) == LeaseRecord(
            resource=RES,
            fencing_token=1,
            expires_at=acquired_at + TTL,
            holder=f"{ME} pid {LIVE.pid}",
            holder_pid=LIVE.pid,
            acquired_at=acquired_at,
            renewed_at=acquired_at,
            live=True,
        )


async def test_reacquire_by_the_same_holder_keeps_the_token_and_extends(short_tmp: Path) -> None:
    """The holder acquiring its live lease again keeps the token, extends it, renewed=True."""
    async with opened(short_tmp) as store:
        first = await acquire(store)
        [before] = await lease_rows(store)
        again = await acquire(store, ttl_ms=2 * TTL, shift=1_000)
        [after] = await lease_rows(store)
        renewed_at = after[6]
        assert renewed_at >= before[5] + 1_000
        assert again == LeaseAcquireResult(
            RES, first.fencing_token, renewed_at + 2 * TTL, f"{ME} pid {LIVE.pid}", True
        )
        assert again.expires_at > first.expires_at
        assert after[:6] == before[:6]  # same token, holder, acquired_at
        assert after[7] == again.expires_at
        assert await counters(store) == {RES: 1}


async def test_holderless_lease_is_reacquired_by_its_principal(short_tmp: Path) -> None:
    """A lease without a holder process is the same principal's, holder None, to extend."""
    async with opened(short_tmp) as store:
        first = await acquire(store, holder=None)
        assert first.holder == ME
        again = await acquire(store, holder=None, shift=1_000)
        assert (again.fencing_token, again.renewed) == (1, True)


@pytest.mark.parametrize(
    ("principal", "holder"),
    [("bob", LIVE), (ME, OTHER_LIVE), (ME, None)],
    ids=["other-principal", "other-process", "no-process"],
)
async def test_a_live_lease_refuses_anyone_else_with_the_lease(
    short_tmp: Path, principal: str, holder: Holder | None
) -> None:
    """Another principal or another process: LeaseHeld with data.lease; nothing changes."""
    async with opened(short_tmp) as store:
        await acquire(store)
        before = await lease_rows(store)
        record = await get(store, RES)
        with pytest.raises(LeaseHeld) as held:
            await acquire(store, principal=principal, holder=holder)
        assert held.value.data == {"lease": as_dict(record)}
        assert held.value.data["lease"]["fencing_token"] == 1
        assert held.value.data["lease"]["holder"] == f"{ME} pid {LIVE.pid}"
        assert held.value.data["lease"]["live"] is True
        assert await lease_rows(store) == before
        assert await counters(store) == {RES: 1}


async def test_tokens_strictly_increase_across_release_expiry_takeover_and_death(
    short_tmp: Path,
) -> None:
    """Each new grant takes the next token: after a release, the holder's own expiry,
    another principal's takeover of an expired lease, and a dead holder's lease."""
    async with opened(short_tmp) as store:
        tokens = [(await acquire(store)).fencing_token]
        await release(store, ME, LIVE, RES, tokens[-1])
        tokens.append((await acquire(store)).fencing_token)  # after a release
        expired_again = await acquire(store, shift=TTL)  # its own, expired at the deadline
        assert expired_again.renewed is False
        tokens.append(expired_again.fencing_token)
        tokens.append((await acquire(store, principal="bob", shift=3 * TTL)).fencing_token)
        tokens.append((await acquire(store, holder=DEAD, shift=5 * TTL)).fencing_token)
        taken = await acquire(store, shift=5 * TTL)  # the dead holder's lease, at once
        tokens.append(taken.fencing_token)
        assert tokens == [1, 2, 3, 4, 5, 6]
        assert await counters(store) == {RES: 6}
        [row] = await lease_rows(store)
        assert row[1:5] == (6, ME, LIVE.pid, LIVE.start)


async def test_a_dead_holders_lease_is_taken_over_before_its_deadline(short_tmp: Path) -> None:
    """A lease whose holder process is gone is not live, and acquire takes it at once
    with the next token, long before its deadline."""
    async with opened(short_tmp) as store:
        dead = await acquire(store, holder=DEAD, ttl_ms=600_000)
        record = await get(store, RES)
        assert (record.fencing_token, record.live) == (1, False)
        assert record.expires_at == dead.expires_at
        taken = await acquire(store, principal="bob")
        assert (taken.fencing_token, taken.renewed, taken.holder) == (
            2,
            False,
            f"bob pid {LIVE.pid}",
        )
        with pytest.raises(LeaseHeld):  # now bob's, and bob lives
            await acquire(store)
        assert taken.expires_at < dead.expires_at
        [row] = await lease_rows(store)
        assert row[1:5] == (2, "bob", LIVE.pid, LIVE.start)


async def test_the_dead_holder_itself_gets_a_new_token(short_tmp: Path) -> None:
    """A holder identity that is dead never renews its old grant: each acquire is new."""
    async with opened(short_tmp) as store:
        first = await acquire(store, holder=DEAD)
        second = await acquire(store, holder=DEAD)
        assert (first.fencing_token, second.fencing_token, second.renewed) == (1, 2, False)


# --- renew and release -------------------------------------------------------------------


async def test_renew_extends_under_the_same_token(short_tmp: Path) -> None:
    """renew by the holder with its token: same token, new deadline, renewed_at moved."""
    async with opened(short_tmp) as store:
        first = await acquire(store)
        renewed = await renew(store, ME, LIVE, RES, 1, 2 * TTL, shift=1_000)
        [row] = await lease_rows(store)
        assert renewed == LeaseAcquireResult(RES, 1, row[6] + 2 * TTL, f"{ME} pid {LIVE.pid}", True)
        assert renewed.expires_at > first.expires_at
        assert (row[1], row[7]) == (1, renewed.expires_at)
        assert await counters(store) == {RES: 1}


@pytest.mark.parametrize("operation", ["renew", "release"])
async def test_renew_and_release_refusals_in_order(short_tmp: Path, operation: str) -> None:
    """Not found, then superseded (token, then holder), then expired: the first that
    applies is the answer, and a refusal changes nothing."""

    async def call(
        principal: str = ME, holder: Holder | None = LIVE, token: int = 1, shift: int = 0
    ) -> Any:
        if operation == "renew":
            return await renew(store, principal, holder, RES, token, TTL, shift=shift)
        return await release(store, principal, holder, RES, token, shift=shift)

    async with opened(short_tmp) as store:
        with pytest.raises(LeaseNotFound) as missing:
            await call()
        assert missing.value.data == {"resource": RES}

        granted = await acquire(store)
        before = await lease_rows(store)
        record = as_dict(await get(store, RES))
        for principal, holder, token in [
            (ME, LIVE, 2),  # a token that was never this lease's
            ("bob", LIVE, 1),  # another principal
            (ME, OTHER_LIVE, 1),  # another process of the principal
            (ME, None, 1),
        ]:
            with pytest.raises(LeaseSuperseded) as superseded:
                await call(principal, holder, token)
            assert superseded.value.data == {"lease": record, "fencing_token": token}

        # Past the deadline: a wrong token or holder is still "superseded", not "expired".
        with pytest.raises(LeaseSuperseded):
            await call(token=2, shift=TTL)
        with pytest.raises(LeaseSuperseded):
            await call(principal="bob", shift=TTL)
        with pytest.raises(LeaseExpired) as expired:
            await call(shift=TTL)  # expires_at <= now: expired exactly at the deadline
        assert expired.value.data == {
            "resource": RES,
            "fencing_token": 1,
            "expired_at": granted.expires_at,
        }
        assert await lease_rows(store) == before
        assert await counters(store) == {RES: 1}


async def test_an_expired_lease_is_never_renewed_under_its_old_token(short_tmp: Path) -> None:
    """After its deadline, renew is LeaseExpired and leaves the row as it was; the
    holder's next acquire is a new grant with the next token."""
    async with opened(short_tmp) as store:
        granted = await acquire(store)
        before = await lease_rows(store)
        for shift in (TTL, TTL + 1, 10 * TTL):
            with pytest.raises(LeaseExpired):
                await renew(store, ME, LIVE, RES, 1, TTL, shift=shift)
        assert await lease_rows(store) == before
        record = await get(store, RES, shift=TTL)
        assert (record.fencing_token, record.live, record.expires_at) == (
            1,
            False,
            granted.expires_at,
        )
        again = await acquire(store, shift=TTL)
        assert (again.fencing_token, again.renewed) == (2, False)
        with pytest.raises(LeaseSuperseded):
            await renew(store, ME, LIVE, RES, 1, TTL, shift=TTL)


async def test_release_deletes_the_lease_but_not_the_token_counter(short_tmp: Path) -> None:
    """release removes the row (get is LeaseNotFound, a second release too) and keeps
    lease_tokens, so the next grant is the released token + 1."""
    async with opened(short_tmp) as store:
        await acquire(store)
        released = await release(store, ME, LIVE, RES, 1)
        assert released == LeaseReleaseResult(resource=RES, fencing_token=1, released=True)
        assert await lease_rows(store) == []
        assert await counters(store) == {RES: 1}
        with pytest.raises(LeaseNotFound):
            await get(store, RES)
        with pytest.raises(LeaseNotFound):
            await release(store, ME, LIVE, RES, 1)
        assert (await acquire(store, principal="bob")).fencing_token == 2
        assert await counters(store) == {RES: 2}


async def test_tokens_are_counted_per_resource(short_tmp: Path) -> None:
    """Each resource has its own counter."""
    async with opened(short_tmp) as store:
        await acquire(store, "a")
        await release(store, ME, LIVE, "a", 1)
        await acquire(store, "a")
        assert (await acquire(store, "b")).fencing_token == 1
        assert await counters(store) == {"a": 2, "b": 1}


# --- listing and dead holders ------------------------------------------------------------


async def test_list_live_excludes_expired_and_dead_holder_leases(short_tmp: Path) -> None:
    """lease.list shows only leases before their deadline whose holder (if any) lives,
    in resource order; get still shows the others, live=False."""
    async with opened(short_tmp) as store:
        await acquire(store, "d-live")
        await acquire(store, "b-dead", holder=DEAD)
        await acquire(store, "c-expired", shift=-2 * TTL)
        await acquire(store, "a-no-holder", principal="bob", holder=None)
        listed = await list_live(store)
        assert [(r.resource, r.live) for r in listed] == [("a-no-holder", True), ("d-live", True)]
        assert listed[0].holder_pid is None and listed[0].holder == "bob"
        for resource in ("b-dead", "c-expired"):
            assert (await get(store, resource)).live is False
        assert len(await lease_rows(store)) == 4


async def test_release_dead_holders_frees_only_their_leases(short_tmp: Path) -> None:
    """release_dead_holders deletes exactly the given holders' leases, returns their
    resources, and keeps their token counters."""
    other_dead = Holder(LIVE.pid, LIVE.start + 2)
    async with opened(short_tmp) as store:
        await acquire(store, "live")
        await acquire(store, "dead-1", holder=DEAD)
        await acquire(store, "dead-2", principal="bob", holder=DEAD)
        await acquire(store, "other-dead", holder=other_dead)
        await acquire(store, "no-holder", holder=None)
        assert set(await store.read(leases.holders)) == {LIVE, DEAD, other_dead}
        released = await store.write(leases.release_dead_holders, [DEAD])
        assert sorted(released) == ["dead-1", "dead-2"]
        assert [row[0] for row in await lease_rows(store)] == ["live", "no-holder", "other-dead"]
        assert await counters(store) == {
            "live": 1,
            "dead-1": 1,
            "dead-2": 1,
            "other-dead": 1,
            "no-holder": 1,
        }
        assert await store.write(leases.release_dead_holders, [DEAD]) == []
        assert (await acquire(store, "dead-1")).fencing_token == 2
