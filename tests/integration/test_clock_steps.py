"""Wall-clock steps are not elapsed time: with only the daemon's wall clock stepped (by
libfaketime; CLOCK_MONOTONIC and CLOCK_BOOTTIME untouched, as an NTP step leaves them),
nothing is reaped, expired or parked, and a completed key still replays, also across a
restart in the same boot."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from towerd_testing import Daemon, wait_for

FAKETIME = next(iter(sorted(Path("/usr/lib").glob("*/faketime/libfaketimeMT.so.1"))), Path("-"))

pytestmark = pytest.mark.skipif(
    not FAKETIME.exists(), reason="needs libfaketime (Debian package faketime)"
)


class SteppedWallClock:
    """The offset libfaketime applies to the daemon's wall clock, read on every call."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.set(0)

    def set(self, seconds: int) -> None:
        staging = self.path.with_suffix(".new")
        staging.write_text(f"{seconds:+d}s\n")
        os.replace(staging, self.path)

    def env(self, daemon: Daemon) -> dict[str, str]:
        return daemon.env(
            LD_PRELOAD=str(FAKETIME),
            FAKETIME_TIMESTAMP_FILE=str(self.path),
            FAKETIME_NO_CACHE="1",
            DONT_FAKE_MONOTONIC="1",  # CLOCK_MONOTONIC and CLOCK_BOOTTIME stay real
        )


@pytest.fixture
def wall(short_tmp: Path) -> SteppedWallClock:
    return SteppedWallClock(short_tmp / "faketime")


def _status(daemon: Daemon) -> dict:
    with daemon.client() as client:
        return client.status()


def _runs(daemon: Daemon, task: str) -> int:
    tasks = {entry["name"]: entry for entry in _status(daemon)["upkeep"]}
    return tasks[task]["runs"] if task in tasks else 0


def _after_the_step_is_seen(daemon: Daemon, steps: int, *tasks: str) -> None:
    """Wait until the daemon noticed the step, then until each task ran twice more (so
    each has looked at the world on the stepped clock)."""
    wait_for(lambda: _status(daemon)["clock"]["steps_detected"] >= steps, what="the step noticed")
    for task in tasks:
        start = _runs(daemon, task)
        wait_for(lambda task=task, start=start: _runs(daemon, task) >= start + 2, what=task)


def test_a_forward_step_of_90_s_reaps_and_parks_nothing(make_daemon, wall, short_tmp):
    """A live worker (heartbeat TTL 60 s), its lease (60 s), its dispatch and an in-flight
    effect (timeout 60 s) all survive a +90 s step of the daemon's wall clock."""
    daemon = make_daemon()
    daemon.start("--holder-check-interval", "0.1", env=wall.env(daemon))
    with daemon.client() as client:
        worker = client.worker_register(str(short_tmp))["worker_id"]
        lease = client.lease_acquire("milestone:M1", ttl_ms=60_000)
        dispatch = client.dispatch_claim(
            worker, "milestone:M1", lease["fencing_token"], "execute-task", "T1", "M1", "trace"
        )["dispatch_id"]
        effect = client.effect_claim(
            "run-1", "publish", "attempt-1", "pr-create", "repo#1", timeout_ms=60_000
        )["effect_key"]
    wall.set(90)
    _after_the_step_is_seen(daemon, 1, "holder_sweep")
    with daemon.client() as client:
        (row,) = client.worker_list()["workers"]
        assert row["status"] == "active" and row["ended_at"] is None, row
        assert client.lease_get("milestone:M1")["live"]
        assert client.dispatch_get(dispatch)["status"] == "claimed"
        assert client.effect_get(effect)["status"] == "in_flight"
        clock = client.status()["clock"]
    assert 85_000 <= clock["offset_ms"] <= 95_000, clock
    assert '"wall_clock_step"' in daemon.log()
    assert daemon.stop() == 0


def test_a_forward_step_of_25_h_expires_no_key_completed_seconds_before(make_daemon, wall):
    """+25 h on the wall clock, the completed TTL 24 h: the expiry pass runs and the
    key completed seconds earlier still replays; after a restart in the same boot, too."""
    daemon = make_daemon()
    daemon.start("--expiry-interval", "0.1", env=wall.env(daemon))
    with daemon.client() as client:
        assert client.idem_claim("push", "k")["state"] == "claimed"
        client.idem_complete("push", "k", {"pushed": True})
    wall.set(25 * 3600)
    _after_the_step_is_seen(daemon, 1, "expiry")
    with daemon.client() as client:
        replay = client.idem_claim("push", "k")
    assert replay["state"] == "completed" and replay["result"] == {"pushed": True}
    assert daemon.stop() == 0
    daemon.start("--expiry-interval", "0.1", env=wall.env(daemon))
    start = _runs(daemon, "expiry")
    wait_for(lambda: _runs(daemon, "expiry") >= start + 2, what="two expiry passes")
    with daemon.client() as client:
        assert client.idem_claim("push", "k")["state"] == "completed"
        assert client.status()["reconciliation"]["expired"] == 0
    assert daemon.stop() == 0


def test_a_backward_step_never_sends_timestamps_back(make_daemon, wall):
    """-2 h: what is written after the step is not stamped before what was written
    before it, and a lease granted before the step keeps its real deadline."""
    daemon = make_daemon()
    daemon.start(env=wall.env(daemon))
    with daemon.client() as client:
        client.idem_claim("push", "before")
        before = client.idem_complete("push", "before", {})["updated_at"]
        lease = client.lease_acquire("r", ttl_ms=60_000)
    wall.set(-2 * 3600)
    _after_the_step_is_seen(daemon, 1)
    with daemon.client() as client:
        client.idem_claim("push", "after")
        after = client.idem_complete("push", "after", {})["updated_at"]
        renewed = client.lease_acquire("r", ttl_ms=60_000)
    assert after >= before
    assert renewed["fencing_token"] == lease["fencing_token"]  # the same lease, extended
    assert renewed["expires_at"] >= lease["expires_at"]
    assert daemon.stop() == 0
