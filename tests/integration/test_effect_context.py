"""``with client.effect(...)`` and ``async with client.effect(...)`` against a real daemon."""

from __future__ import annotations

import threading

import anyio
import pytest

from towerd.client import (
    AsyncClient,
    EffectAttemptSuperseded,
    EffectLeaseSuperseded,
    EffectNotStarted,
    EffectUncertain,
)
from towerd.client.effect import Heartbeat
from towerd_testing import wait_for

PR = "github.com/acme/app#pull/feature-x"  # pr-create: a shared kind, takes a lease


class Boom(Exception):
    pass


def test_effect_commits_the_receipt_and_gives_the_lease_back(daemon):
    with daemon.client() as client:
        with client.effect("run_1", "open-pr", "pr-create", PR, payload={"title": "x"}) as fx:
            assert fx.effect_key.startswith("eff_") and fx.attempt_id
            assert fx.lease_resource == PR and fx.fencing_token >= 1
            assert client.lease_get(PR)["fencing_token"] == fx.fencing_token
            fx.receipt = {"url": "https://pr/1"}
        assert fx.record["status"] == "committed"
        record = client.effect_get(fx.effect_key)
        assert record["status"] == "committed" and record["receipt"] == {"url": "https://pr/1"}
        assert record["attempt_id"] == fx.attempt_id
        assert client.lease_list()["leases"] == []


def test_effect_not_started_aborts_and_propagates(daemon):
    with daemon.client() as client:
        with pytest.raises(EffectNotStarted):
            with client.effect("run_2", "open-pr", "pr-create", PR, attempt_id="a-1") as fx:
                raise EffectNotStarted("the branch has no commits")
        record = client.effect_get(fx.effect_key)
        assert record["status"] == "aborted" and record["attempt_id"] == "a-1"
        assert record["receipt"] == {"reason": "the branch has no commits"}
        assert client.lease_list()["leases"] == []
        # Aborted: the next attempt runs it afresh.
        with client.effect("run_2", "open-pr", "pr-create", PR) as again:
            again.receipt = {"url": "https://pr/2"}
        assert client.effect_get(fx.effect_key)["status"] == "committed"


def test_any_other_exception_leaves_the_effect_in_flight_for_recovery(daemon):
    with daemon.client() as client:
        with pytest.raises(Boom):
            with client.effect("run_3", "open-pr", "pr-create", PR, heartbeat_interval=0.02) as fx:
                fx.receipt = {"url": "half-done"}
                raise Boom
        record = client.effect_get(fx.effect_key)
        assert record["status"] == "in_flight" and record["receipt"] is None
        assert client.lease_get(PR)["live"]  # the lease stays with the effect
        # Heartbeats stopped: the thread is gone.
        assert not [t for t in threading.enumerate() if t.name.endswith(fx.effect_key)]
        assert fx.lost is None


def test_heartbeats_run_in_the_background_on_their_own_connection(daemon):
    """The body keeps using the client while heartbeats go every 20 ms: they would corrupt
    each other's frames on a shared blocking connection."""
    with daemon.client() as client:
        with client.effect("run_4", "open-pr", "pr-create", PR, heartbeat_interval=0.02) as fx:
            claimed_at = client.effect_get(fx.effect_key)["claimed_at"]
            wait_for(
                lambda: (
                    client.effect_get(fx.effect_key)["heartbeat_at"] > claimed_at
                    and fx.heartbeats >= 3
                ),
                what="heartbeats",
            )
            lease = client.lease_get(PR)
            wait_for(lambda: client.lease_get(PR)["expires_at"] > lease["expires_at"],
                     what="a heartbeat to extend the lease")  # fmt: skip
            fx.receipt = {"url": "https://pr/4"}
        assert fx.heartbeat_at >= claimed_at
        assert client.effect_get(fx.effect_key)["status"] == "committed"


def test_a_superseded_lease_makes_the_exit_raise_instead_of_committing(daemon):
    with daemon.client(principal="box-a") as a, daemon.client(principal="box-b") as b:
        with pytest.raises(EffectLeaseSuperseded):
            with a.effect("run_5", "open-pr", "pr-create", PR,
                          lease_ttl_ms=5000, heartbeat_interval=3600) as fx:  # fmt: skip
                wait_for(lambda: not b.lease_get(PR)["live"], timeout=15, what="the lapse")
                taken = b.lease_acquire(PR)
                assert taken["fencing_token"] > fx.fencing_token
                fx.receipt = {"url": "https://pr/5"}
        record = a.effect_get(fx.effect_key)
        assert record["status"] == "uncertain" and record["receipt"] is None
        with pytest.raises(EffectUncertain):
            a.effect_claim("run_5", "open-pr", "new", "pr-create", PR)


def test_a_heartbeat_refusal_is_recorded_and_raised_at_exit(daemon):
    """Someone else settles the attempt (here an abort) while the body runs: the next
    heartbeat is refused, ``fx.lost`` says so, and leaving does not commit."""
    with daemon.client() as client, daemon.client() as operator:
        with pytest.raises(EffectAttemptSuperseded):
            with client.effect("run_6", "open-pr", "pr-create", PR, heartbeat_interval=0.02) as fx:
                operator.effect_abort(fx.effect_key, fx.attempt_id, "taken back")
                wait_for(lambda: fx.lost is not None, what="a refused heartbeat")
                fx.receipt = {"url": "never"}
        assert isinstance(fx.lost, EffectAttemptSuperseded)
        record = client.effect_get(fx.effect_key)
        assert record["status"] == "aborted" and record["receipt"] == {"reason": "taken back"}


def test_a_local_effect_takes_no_lease(daemon):
    with daemon.client() as client:
        with client.effect("run_7", "branch", "git-branch", "kxm/run-7") as fx:
            assert fx.lease_resource is None and fx.fencing_token is None
            fx.receipt = {"sha": "abc"}
        assert client.effect_get(fx.effect_key)["receipt"] == {"sha": "abc"}


def test_heartbeat_helper_stops_at_once_and_reports_errors():
    calls = []
    beat = Heartbeat(lambda: calls.append(1) or len(calls) < 3, 0.001).start()
    wait_for(lambda: len(calls) == 3, what="three beats")
    beat.stop()
    assert len(calls) == 3  # the third returned False: no fourth

    def broken() -> bool:
        raise RuntimeError("no")

    closed = threading.Event()
    failing = Heartbeat(broken, 0.001, on_stop=closed.set).start()
    wait_for(closed.is_set, what="the failing heartbeat to end")
    assert isinstance(failing.error, RuntimeError)
    with Heartbeat(lambda: True, 3600) as idle:  # stop() does not wait out the interval
        pass
    assert idle.error is None
    with pytest.raises(ValueError):
        Heartbeat(lambda: True, 0)


# --- async ----------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_async_effect_commit_abort_and_in_flight(daemon):
    async with AsyncClient.open(daemon.socket_path) as client:
        async with client.effect("run_a", "open-pr", "pr-create", PR) as fx:
            assert fx.lease_resource == PR
            fx.receipt = {"url": "https://pr/a"}
        record = await client.effect_get(fx.effect_key)
        assert record["status"] == "committed" and record["receipt"] == {"url": "https://pr/a"}

        with pytest.raises(EffectNotStarted):
            async with client.effect("run_b", "open-pr", "pr-create", PR) as fx:
                raise EffectNotStarted("nothing to do")
        assert (await client.effect_get(fx.effect_key))["status"] == "aborted"

        with pytest.raises(Boom):
            async with client.effect("run_c", "open-pr", "pr-create", PR) as fx:
                raise Boom
        assert (await client.effect_get(fx.effect_key))["status"] == "in_flight"


@pytest.mark.anyio
async def test_async_effect_heartbeats_as_a_task(daemon):
    async with AsyncClient.open(daemon.socket_path) as client:
        async with client.effect("run_d", "open-pr", "pr-create", PR,
                                 heartbeat_interval=0.02) as fx:  # fmt: skip
            claimed_at = (await client.effect_get(fx.effect_key))["claimed_at"]
            with anyio.fail_after(10):
                while fx.heartbeats < 3:
                    await anyio.sleep(0.02)  # waiting for the heartbeat task's progress
            assert (await client.effect_get(fx.effect_key))["heartbeat_at"] > claimed_at
            fx.receipt = {"url": "https://pr/d"}
        assert (await client.effect_get(fx.effect_key))["status"] == "committed"


@pytest.mark.anyio
async def test_async_heartbeat_refusal_is_raised_at_exit(daemon):
    async with AsyncClient.open(daemon.socket_path) as client:
        with pytest.raises(EffectAttemptSuperseded):
            async with client.effect("run_e", "open-pr", "pr-create", PR,
                                     heartbeat_interval=0.02) as fx:  # fmt: skip
                await client.effect_abort(fx.effect_key, fx.attempt_id, "taken back")
                with anyio.fail_after(10):
                    while fx.lost is None:
                        await anyio.sleep(0.02)  # waiting for the heartbeat task's refusal
        assert (await client.effect_get(fx.effect_key))["status"] == "aborted"


# --- the outcome outlives a lost connection ---------------------------------------------------


def restart(daemon) -> None:
    """The daemon goes away under the open connections and comes back on the same socket
    and state dir (an in-flight effect stays in flight: its silence clock restarts)."""
    assert daemon.stop() == 0, daemon.log()
    daemon.start()


def test_a_commit_after_a_daemon_restart_reconnects_and_commits(daemon):
    with daemon.client() as client:
        with client.effect("run_r", "open-pr", "pr-create", PR, heartbeat_interval=None) as fx:
            restart(daemon)
            fx.receipt = {"url": "https://pr/r"}
        assert fx.record["status"] == "committed"
        record = client.effect_get(fx.effect_key)
    assert record["status"] == "committed" and record["receipt"] == {"url": "https://pr/r"}
    assert record["attempt_id"] == fx.attempt_id


@pytest.mark.anyio
async def test_an_async_commit_after_a_daemon_restart_reconnects_and_commits(daemon):
    """The drift this test pins down: the blocking client's commit was sent again on a new
    connection, the async one's raised ``Unavailable`` and left the effect in flight."""
    async with AsyncClient.open(daemon.socket_path) as client:
        async with client.effect("run_ar", "open-pr", "pr-create", PR,
                                 heartbeat_interval=None) as fx:  # fmt: skip
            restart(daemon)
            fx.receipt = {"url": "https://pr/ar"}
        assert fx.record["status"] == "committed"
    with daemon.client() as check:
        record = check.effect_get(fx.effect_key)
        assert check.lease_list()["leases"] == []  # the commit gave the lease back
    assert record["status"] == "committed" and record["receipt"] == {"url": "https://pr/ar"}
    assert record["attempt_id"] == fx.attempt_id


@pytest.mark.anyio
async def test_an_async_abort_after_a_daemon_restart_reconnects_and_aborts(daemon):
    async with AsyncClient.open(daemon.socket_path) as client:
        with pytest.raises(EffectNotStarted):
            async with client.effect("run_aa", "open-pr", "pr-create", PR,
                                     heartbeat_interval=None) as fx:  # fmt: skip
                restart(daemon)
                raise EffectNotStarted("nothing pushed")
        assert fx.record["status"] == "aborted"
    with daemon.client() as check:
        record = check.effect_get(fx.effect_key)
    assert record["status"] == "aborted" and record["receipt"] == {"reason": "nothing pushed"}
