"""Start-up reconciliation: reopening the store is a daemon restart."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from store_helpers import caller, execute, new_id, opened, query, register
from towerd.daemon.store import Store
from towerd.daemon.store import idempotency as idem
from towerd.daemon.store.idempotency import Holder
from towerd.daemon.store.reconcile import settle_dead_holders
from towerd.protocol.methods import (
    IdemClaimParams,
    IdemCompleteParams,
    IdemKeyParams,
    IdemListParams,
    IdemRecord,
    ReconcileReport,
    WorkerRegisterParams,
)

pytestmark = pytest.mark.anyio

ME = "alice"
HOLDER = Holder(pid=777, start=1)


async def claim(
    store: Store,
    operation: str,
    key: str,
    effect_ref: str | None = None,
    holder: Holder | None = HOLDER,
) -> str:
    result = await store.write(
        idem.claim,
        caller(ME, holder),
        IdemClaimParams(operation=operation, key=key, effect_ref=effect_ref),
    )
    return result.effect_ref


async def complete(store: Store, operation: str, key: str, result: Any) -> IdemRecord:
    params = IdemCompleteParams(operation=operation, key=key, result=result)
    return await store.write(idem.complete, caller(ME), params)


async def mark_unknown(store: Store, operation: str, key: str) -> IdemRecord:
    return await store.write(idem.mark_unknown, caller(ME), IdemKeyParams(operation, key))


async def record(store: Store, operation: str, key: str) -> IdemRecord:
    return await store.read(idem.get, caller(ME), IdemKeyParams(operation, key))


def counts(report: ReconcileReport) -> dict[str, int]:
    return {
        "rows_taken": report.rows_taken,
        "marked_unknown": report.marked_unknown,
        "completed_from_evidence": report.completed_from_evidence,
        "still_unknown": report.still_unknown,
        "expired": report.expired,
    }


async def test_each_open_is_the_next_epoch_of_the_same_daemon(short_tmp: Path) -> None:
    """The daemon id is minted once and kept; the
    owner epoch goes up by exactly one per start."""
    seen: list[tuple[str, int]] = []
    for _ in range(3):
        async with opened(short_tmp) as store:
            seen.append((store.daemon_id, store.owner_epoch))
            assert store.reconciliation.owner_epoch == store.owner_epoch
    assert [epoch for _, epoch in seen] == [1, 2, 3]
    assert len({daemon_id for daemon_id, _ in seen}) == 1
    assert query(short_tmp, "SELECT daemon_id, owner_epoch FROM daemons") == [seen[-1]]


async def test_fresh_store_reports_nothing_to_do(short_tmp: Path) -> None:
    """A first start reconciles nothing."""
    async with opened(short_tmp) as store:
        assert counts(store.reconciliation) == dict.fromkeys(counts(store.reconciliation), 0)


async def test_restart_takes_own_rows_to_the_new_epoch(short_tmp: Path) -> None:
    """rows_taken counts this daemon's rows, which
    now carry the new epoch; others' rows do not."""
    async with opened(short_tmp) as store:
        for _ in range(3):
            await register(store)
    other = new_id()
    async with opened(short_tmp, daemon_id=other) as store:
        await register(store)
    async with opened(short_tmp) as store:
        assert store.reconciliation.rows_taken == 3
        own = query(
            short_tmp,
            "SELECT DISTINCT owner_epoch FROM sessions WHERE daemon_id = ?",
            (store.daemon_id,),
        )
        assert own == [(store.owner_epoch,)] == [(2,)]
    assert query(short_tmp, "SELECT owner_epoch FROM sessions WHERE daemon_id = ?", (other,)) == [
        (1,)
    ]


async def test_in_progress_keys_become_outcome_unknown(short_tmp: Path) -> None:
    """A key in progress across a restart has an
    unknown outcome; a completed key is untouched."""
    async with opened(short_tmp) as store:
        ref = await claim(store, "tool.run", "k1")
        await claim(store, "tool.run", "k2")
        await complete(store, "tool.run", "k2", "ok")
    async with opened(short_tmp) as store:
        assert counts(store.reconciliation) == {
            "rows_taken": 0,
            "marked_unknown": 1,
            "completed_from_evidence": 0,
            "still_unknown": 1,
            "expired": 0,
        }
        unknown = await record(store, "tool.run", "k1")
        assert (unknown.state, unknown.effect_ref) == ("outcome_unknown", ref)
        assert (await record(store, "tool.run", "k2")).state == "completed"


@pytest.mark.parametrize("operation", ["session.spawn", "session.register"])
async def test_key_with_fleet_row_evidence_completes_with_its_session_id(
    short_tmp: Path, operation: str
) -> None:
    """A spawn/register key whose effect_ref is an existing fleet row completes
    on restart, with a result naming that session id (never an empty result)."""
    session_id = new_id()
    async with opened(short_tmp) as store:
        await claim(store, operation, "k", effect_ref=session_id)
        await register(
            store,
            session_id=session_id,
            agent_session_id="as-1",
            target="t",
            target_identity="ti",
        )
    async with opened(short_tmp) as store:
        assert counts(store.reconciliation) == {
            "rows_taken": 1,
            "marked_unknown": 1,
            "completed_from_evidence": 1,
            "still_unknown": 0,
            "expired": 0,
        }
        settled = await record(store, operation, "k")
        assert settled.state == "completed"
        assert settled.result["session_id"] == session_id
        if operation == "session.spawn":
            assert settled.result == {
                "session_id": session_id,
                "agent_session_id": "as-1",
                "target": "t",
                "target_identity": "ti",
            }
        replay = await store.write(
            idem.claim, caller(ME), IdemClaimParams(operation=operation, key="k")
        )
        assert (replay.state, replay.effect_ref, replay.result) == (
            "completed",
            session_id,
            settled.result,
        )


async def test_keys_without_evidence_stay_unknown(short_tmp: Path) -> None:
    """No fleet row for the effect_ref, or an
    operation with no probe: still outcome_unknown."""
    async with opened(short_tmp) as store:
        await claim(store, "session.spawn", "no-row", effect_ref=new_id())
        other_row = await register(store)
        await claim(store, "tool.run", "no-probe", effect_ref=other_row)  # a row, but no probe
    async with opened(short_tmp) as store:
        report = store.reconciliation
        assert (
            report.marked_unknown,
            report.completed_from_evidence,
            report.still_unknown,
        ) == (2, 0, 2)
        assert (await record(store, "session.spawn", "no-row")).state == "outcome_unknown"
        assert (await record(store, "tool.run", "no-probe")).state == "outcome_unknown"


async def test_report_counts_are_exact_in_a_mixed_restart(short_tmp: Path) -> None:
    """Every counter of the report at once: 2 rows, 4 marked, 2 from
    evidence, 3 unknown (two new, one older), 2 expired completed keys."""
    async with opened(short_tmp) as store:
        spawned, registered = new_id(), new_id()
        await claim(store, "session.spawn", "ev-1", effect_ref=spawned)
        await claim(store, "session.register", "ev-2", effect_ref=registered)
        await claim(store, "session.spawn", "none-1", effect_ref=new_id())
        await claim(store, "tool.run", "none-2")
        await claim(store, "tool.run", "older")
        await mark_unknown(store, "tool.run", "older")
        for key in ("old-done-1", "old-done-2", "new-done"):
            await claim(store, "tool.run", key)
            await complete(store, "tool.run", key, key)
        await register(store, session_id=spawned)
        await register(store, session_id=registered)
    # Age two completed keys past the TTL while no daemon runs.
    execute(
        short_tmp,
        "UPDATE idempotency SET updated_at = 0 WHERE key IN ('old-done-1', 'old-done-2')",
    )
    async with opened(short_tmp) as store:
        assert counts(store.reconciliation) == {
            "rows_taken": 2,
            "marked_unknown": 4,
            "completed_from_evidence": 2,
            "still_unknown": 3,
            "expired": 2,
        }
        keys = {
            r.key: r.state
            for r in (await store.read(idem.list_keys, caller(ME), IdemListParams(limit=50))).keys
        }
        assert keys == {
            "ev-1": "completed",
            "ev-2": "completed",
            "none-1": "outcome_unknown",
            "none-2": "outcome_unknown",
            "older": "outcome_unknown",
            "new-done": "completed",
        }


async def test_unknown_key_is_settled_at_a_later_start_once_evidence_appears(
    short_tmp: Path,
) -> None:
    """A key left outcome_unknown by one start, whose row appears afterwards, completes
    at the next start (marked_unknown 0 then, since it was already unknown)."""
    session_id = new_id()
    async with opened(short_tmp) as store:
        await claim(store, "session.spawn", "late", effect_ref=session_id)
    async with opened(short_tmp) as store:
        assert (
            store.reconciliation.marked_unknown,
            store.reconciliation.still_unknown,
        ) == (1, 1)
        await register(store, session_id=session_id)
        assert (await record(store, "session.spawn", "late")).state == "outcome_unknown"
    async with opened(short_tmp) as store:
        report = store.reconciliation
        assert (
            report.marked_unknown,
            report.completed_from_evidence,
            report.still_unknown,
        ) == (0, 1, 0)
        settled = await record(store, "session.spawn", "late")
        assert (settled.state, settled.result["session_id"]) == (
            "completed",
            session_id,
        )


async def test_restart_does_not_touch_another_daemons_keys(short_tmp: Path) -> None:
    """Reconciliation of daemon A leaves daemon B's in-progress keys alone."""
    other = new_id()
    async with opened(short_tmp, daemon_id=other) as store:
        await claim(store, "tool.run", "theirs")
    async with opened(short_tmp) as store:
        assert store.reconciliation.marked_unknown == 0
    assert query(short_tmp, "SELECT state FROM idempotency WHERE key = 'theirs'") == [
        ("in_progress",)
    ]


async def test_dead_holder_keys_settle_from_evidence_without_a_restart(
    short_tmp: Path,
) -> None:
    """The liveness sweep: a dead holder's key whose row exists completes at once; one
    without evidence becomes outcome_unknown; a live holder's key is untouched."""
    async with opened(short_tmp) as store:
        with_row = new_id()
        await claim(store, "session.spawn", "ev", effect_ref=with_row)
        await claim(store, "session.spawn", "no-ev", effect_ref=new_id())
        await claim(store, "session.spawn", "alive", effect_ref=new_id(), holder=Holder(888, 1))
        await register(store, session_id=with_row)
        report = await store.write(settle_dead_holders, [HOLDER])
        assert report.completed == [(ME, "session.spawn", "ev")]
        assert report.unknown == [(ME, "session.spawn", "no-ev")]
        states: dict[str, Any] = {
            key: (await record(store, "session.spawn", key)).state
            for key in ("ev", "no-ev", "alive")
        }
        assert states == {
            "ev": "completed",
            "no-ev": "outcome_unknown",
            "alive": "in_progress",
        }
        assert (await record(store, "session.spawn", "ev")).result["session_id"] == with_row


@pytest.mark.anyio
async def test_a_live_workers_silence_clock_restarts_with_the_daemon(short_tmp: Path) -> None:
    """A worker cannot heartbeat while no daemon runs: after a long outage its TTL
    counts from the restart, so a live worker is not reaped as silent; a dead one
    still goes at the first sweep."""
    import os

    from towerd.daemon.processes import holder_of
    from towerd.daemon.store import liveness, workers

    me = holder_of(os.getpid())
    async with opened(short_tmp, host="host", worker_ttl_ms=60_000) as store:
        params = WorkerRegisterParams(project_root=str(short_tmp), version=None)
        result = await store.write(workers.register, caller("p", me), params)
    worker_id = result.worker_id
    execute(short_tmp, "UPDATE workers SET heartbeat_at = 1000 WHERE worker_id = ?", (worker_id,))
    async with opened(short_tmp) as store:
        (beat,) = query(short_tmp, "SELECT heartbeat_at FROM workers")[0]
        assert beat > 1000
        report = await store.write(liveness.settle, [], 60_000)
        assert report.workers_ended == []
        report = await store.write(liveness.settle, [me], 60_000)  # its process died
        assert [end.worker.worker_id for end in report.workers_ended] == [worker_id]
        assert report.workers_ended[0].worker.end_reason == "process-gone"
