"""Steps of the PostgreSQL server's clock, several boxes on one fleet: real daemons, a
real private cluster whose wall clock libfaketime steps (its monotonic clock untouched,
as an NTP step leaves it), the real client.

Every deadline in a shared store is on the fleet's clock, which follows elapsed time
and comes back to the server's slowly (daemon/store/fleet_clock.py). What is proven
here: after
a step back larger than a lease's TTL, a lease granted through a box that started after
the step is not granted again through a box that ran before it (each box held its own
highest reading, and the older box read the new lease as expired: a hostile tester's
reproducer, a 60 s lease, a 120 s step back); after a step forward longer than the
presence TTL, no heartbeating box is declared dead and no live holder's lease is
granted again (the server's clock alone declared the other box dead on the first
heartbeat after the step: another of that tester's reproducers).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest

from pg_cluster import PgCluster, postgres_available, require_postgres
from towerd.client import LeaseHeld
from towerd_testing import TOWERCTL, Daemon, wait_for

FAKETIME = next(iter(sorted(Path("/usr/lib").glob("*/faketime/libfaketimeMT.so.1"))), Path("-"))
pytestmark = pytest.mark.skipif(
    not FAKETIME.exists() and os.environ.get("CI") != "true",
    reason="needs libfaketime (Debian package faketime)",
)

PRESENCE = ["--presence-interval", "0.5", "--presence-ttl", "30"]  # nobody lapses here
TTL_S = 5
QUICK_PRESENCE = ["--presence-interval", "0.5", "--presence-ttl", str(TTL_S)]


class ServerClock:
    """The offset libfaketime applies to the server's wall clock, read on every call
    (a file the server's user can read)."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="fk-", dir="/tmp"))
        self.dir.chmod(0o755)
        self.path = self.dir / "offset"
        self.set(0)

    def set(self, seconds: int) -> None:
        staging = self.dir / "offset.new"
        staging.write_text(f"{seconds:+d}s\n")
        staging.chmod(0o644)
        os.replace(staging, self.path)

    def env(self) -> dict[str, str]:
        return {
            "LD_PRELOAD": str(FAKETIME),
            "FAKETIME_TIMESTAMP_FILE": str(self.path),
            "FAKETIME_NO_CACHE": "1",
            "DONT_FAKE_MONOTONIC": "1",
        }

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def forget_stale_faketime_segments() -> None:
    """libfaketime (0.9.10) makes a semaphore and a shared memory segment named after
    the pid of each preloaded process it starts in, and nothing removes them when that
    process is killed: the suite's faked daemons (root, under CI) leave hundreds. When
    the server's first process (another user) gets the pid of one of them, it cannot
    make its own, and the server does not start. The dead ones go first."""
    shm = Path("/dev/shm")
    for entry in [*shm.glob("faketime_shm_*"), *shm.glob("sem.faketime_sem_*")]:
        pid = entry.name.rsplit("_", 1)[-1]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            entry.unlink(missing_ok=True)


@pytest.fixture
def stepped() -> Iterator[tuple[PgCluster, ServerClock]]:
    require_postgres(postgres_available())
    forget_stale_faketime_segments()
    clock = ServerClock()
    try:
        with PgCluster(server_env=clock.env()) as cluster:
            yield cluster, clock
    finally:
        clock.close()


def server_ms(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT floor(extract(epoch FROM clock_timestamp()) * 1000)").fetchone()
    assert row is not None
    return int(row[0])


def box(
    make_daemon: Callable[..., Daemon], name: str, dsn: str, presence: list[str] = PRESENCE
) -> Daemon:
    daemon = make_daemon(name)
    daemon.extra_args = ["--store", dsn, *presence]
    return daemon


def test_a_step_back_longer_than_a_lease_grants_it_once(
    make_daemon: Callable[..., Daemon], stepped: tuple[PgCluster, ServerClock]
) -> None:
    cluster, clock = stepped
    dsn = cluster.new_database(migrated=True)
    older = box(make_daemon, "a", dsn).start()
    with older.client() as client:  # batches on the clock before the step
        warm = client.lease_acquire("warm-up", ttl_ms=5000)
        client.lease_release("warm-up", warm["fencing_token"])
    before = server_ms(dsn)
    clock.set(-120)
    wait_for(lambda: server_ms(dsn) < before - 100_000, timeout=10, what="the step back")
    newer = box(make_daemon, "b", dsn).start()
    with newer.client() as on_newer, older.client() as on_older:
        granted = on_newer.lease_acquire("deploy/prod", ttl_ms=60_000)
        with pytest.raises(LeaseHeld):
            on_older.lease_acquire("deploy/prod", ttl_ms=60_000)
        # and the holder still holds it, through either box
        on_newer.lease_renew("deploy/prod", granted["fencing_token"], ttl_ms=60_000)
        with pytest.raises(LeaseHeld):
            on_older.lease_acquire("deploy/prod", ttl_ms=60_000)
    for name, daemon in (("older", older), ("newer", newer)):  # each says why nothing expires
        wait_for(lambda d=daemon: "server_clock_stepped" in d.log(), timeout=10,
                 what=f"the {name} box's warning")  # fmt: skip


def test_a_step_forward_longer_than_the_presence_ttl_declares_no_live_box_dead(
    make_daemon: Callable[..., Daemon], stepped: tuple[PgCluster, ServerClock]
) -> None:
    cluster, clock = stepped
    dsn = cluster.new_database(migrated=True)
    a = box(make_daemon, "a", dsn, QUICK_PRESENCE).start()
    b = box(make_daemon, "b", dsn, QUICK_PRESENCE).start()
    with a.client() as on_a, b.client() as on_b:
        granted = on_b.lease_acquire("deploy/prod", ttl_ms=600_000)
        before = server_ms(dsn)
        clock.set(30)
        wait_for(lambda: server_ms(dsn) > before + 25_000, timeout=10, what="the step forward")

        def a_s_presence() -> int:
            mine = [entry for entry in on_a.boxes_list()["boxes"] if entry["self"]]
            return int(mine[0]["presence_at"])

        stepped_at = a_s_presence()  # on the fleet's clock, which elapsed time moves

        def a_beat_a_ttl_after_the_step() -> bool:
            return a_s_presence() > stepped_at + (TTL_S + 1) * 1000

        # The old rule declared B dead at A's first heartbeat after the step; the rule
        # now waits for B's presence to stay unchanged for the TTL on A's own clock.
        wait_for(a_beat_a_ttl_after_the_step, timeout=30, what="A's heartbeats past a TTL")
        boxes = on_b.boxes_list()["boxes"]
        assert [(entry["state"], entry["dead_at"]) for entry in boxes] == [("present", None)] * 2
        with pytest.raises(LeaseHeld):
            on_a.lease_acquire("deploy/prod", ttl_ms=600_000)
        on_b.lease_renew("deploy/prod", granted["fencing_token"], ttl_ms=600_000)


def test_a_step_back_put_right_later_expires_nothing_early_and_declares_no_box_dead(
    make_daemon: Callable[..., Daemon], stepped: tuple[PgCluster, ServerClock]
) -> None:
    """The server's clock goes back 30 s and is put right after more than a presence
    TTL, with a box started in between. The fleet's clock stood still while the server's
    was back, then jumped forward at the correction: every heartbeat had written the
    same presence and the first box to beat after the correction declared the others
    dead, and a 5 s lease renewed every second through it expired and went to another
    holder (hostile testers' reproducers). The fleet's clock follows elapsed time: the
    renewed lease stays its holder's, nobody is declared dead, and status and doctor
    say the server's clock is apart from the fleet's."""
    cluster, clock = stepped
    dsn = cluster.new_database(migrated=True)
    a = box(make_daemon, "a", dsn, QUICK_PRESENCE).start()
    b = box(make_daemon, "b", dsn, QUICK_PRESENCE).start()
    before = server_ms(dsn)
    clock.set(-30)
    wait_for(lambda: server_ms(dsn) < before - 25_000, timeout=10, what="the step back")
    c = box(make_daemon, "c", dsn, QUICK_PRESENCE).start()  # started during the step
    with a.client() as on_a, b.client() as on_b, c.client() as on_c:
        held = {
            "deploy/b": (on_b, on_b.lease_acquire("deploy/b", ttl_ms=600_000)),
            "deploy/c": (on_c, on_c.lease_acquire("deploy/c", ttl_ms=600_000)),
        }
        short = on_b.lease_acquire("deploy/short", ttl_ms=5_000)

        def renew_short() -> None:  # its holder renews it every second, as a worker does
            renewed_at = time.monotonic()
            while time.monotonic() < renewed_at + 1:
                assert on_a.lease_get("deploy/short")["live"] is True
            with pytest.raises(LeaseHeld):
                on_a.lease_acquire("deploy/short", ttl_ms=5_000)
            on_b.lease_renew("deploy/short", short["fencing_token"], ttl_ms=5_000)

        stepped_at = time.monotonic()
        # The step lasts longer than the TTL on every box's own clock: not a wait for the
        # daemons, the length of the fault under test.
        while time.monotonic() < stepped_at + TTL_S + 2:
            renew_short()
        assert on_a.status()["store"]["clock_offset_ms"] < -20_000
        doctor = subprocess.run([TOWERCTL, "--socket", str(a.socket_path), "doctor"],
                                capture_output=True, text=True, timeout=60)  # fmt: skip
        assert "behind the fleet's" in doctor.stdout, doctor.stdout
        clock.set(0)
        wait_for(lambda: server_ms(dsn) > before, timeout=10, what="the clock put right")
        corrected_at = max(e["presence_at"] for e in on_a.boxes_list()["boxes"])

        def every_box_beat_a_ttl_after() -> bool:
            renew_short()
            boxes = on_a.boxes_list()["boxes"]
            return all(e["presence_at"] > corrected_at + (TTL_S + 1) * 1000 for e in boxes)

        wait_for(every_box_beat_a_ttl_after, timeout=30, what="heartbeats past a TTL")
        boxes = on_a.boxes_list()["boxes"]
        assert [(e["state"], e["dead_at"]) for e in boxes] == [("present", None)] * 3, boxes
        for daemon in (a, b, c):
            assert "box_declared_dead" not in daemon.log() and "box_revived" not in daemon.log()
        for resource, (holder, granted) in held.items():
            with pytest.raises(LeaseHeld):
                on_a.lease_acquire(resource, ttl_ms=600_000)
            holder.lease_renew(resource, granted["fencing_token"], ttl_ms=600_000)
        assert on_a.status()["store"]["clock_offset_ms"] == 0  # they agree again


def test_a_lease_granted_while_the_server_s_clock_is_back_lasts_its_ttl(
    make_daemon: Callable[..., Daemon], stepped: tuple[PgCluster, ServerClock]
) -> None:
    """While the server's clock is 120 s back, a 5 s lease lasts 5 s of elapsed time,
    and reads between two batches (heartbeats 20 s apart) see what writes see: live
    until it expires, then free for another holder (the fleet's clock stood still
    before, and the lease would have lasted until the server's clock caught up)."""
    cluster, clock = stepped
    dsn = cluster.new_database(migrated=True)
    slow_beats = ["--presence-interval", "20", "--presence-ttl", "60"]
    a = box(make_daemon, "a", dsn, slow_beats).start()
    b = box(make_daemon, "b", dsn, slow_beats).start()
    before = server_ms(dsn)
    clock.set(-120)
    wait_for(lambda: server_ms(dsn) < before - 100_000, timeout=10, what="the step back")
    with a.client() as on_a, b.client() as on_b:
        on_a.lease_acquire("deploy/short", ttl_ms=5_000)
        granted_at = time.monotonic()
        while time.monotonic() < granted_at + 4:  # within its TTL in elapsed time
            assert on_b.lease_get("deploy/short")["live"] is True
        wait_for(lambda: on_b.lease_get("deploy/short")["live"] is False, timeout=5,
                 what="the lease to expire in elapsed time")  # fmt: skip
        assert time.monotonic() - granted_at < 7
        on_b.lease_acquire("deploy/short", ttl_ms=5_000)


def test_a_box_started_after_a_step_forward_does_not_jump_the_fleet_s_clock(
    make_daemon: Callable[..., Daemon], stepped: tuple[PgCluster, ServerClock]
) -> None:
    """The server's clock steps 60 s forward just after a running box's heartbeat, and a
    box starts before the next one: it took the record moved on as the server's clock
    moved, step included, recorded that, and every box's clock jumped 60 s: a running
    holder's 30 s lease was granted again through the new box (a review's finding). A
    starting box now waits for a running box's next record and starts from it."""
    cluster, clock = stepped
    dsn = cluster.new_database(migrated=True)
    a = box(make_daemon, "a", dsn, ["--presence-interval", "8", "--presence-ttl", "30"]).start()
    with a.client() as on_a:
        on_a.lease_acquire("deploy/prod", ttl_ms=30_000)
        (mine,) = [e for e in on_a.boxes_list()["boxes"] if e["self"]]
        wait_for(
            lambda: (
                [e for e in on_a.boxes_list()["boxes"] if e["self"]][0]["presence_at"]
                != mine["presence_at"]
            ),
            timeout=15,
            what="a's next heartbeat",
        )  # the step comes right after it: the next is 8 s away
        before = server_ms(dsn)
        clock.set(60)
        wait_for(lambda: server_ms(dsn) > before + 55_000, timeout=10, what="the step")
        c = box(make_daemon, "c", dsn, QUICK_PRESENCE).start()
        with c.client() as on_c:
            with pytest.raises(LeaseHeld):
                on_c.lease_acquire("deploy/prod", ttl_ms=30_000)
