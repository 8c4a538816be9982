"""Several boxes, one fleet: two real daemons (two state dirs, two sockets) sharing one
real PostgreSQL database, talked to through the real client.

What is proven here: a lease contended through both boxes goes to one, with tokens
increasing; a box killed with kill -9 is declared dead once its presence lapses, and
the other box frees what it held (its in-progress key turns outcome_unknown, its lease
is taken over under a greater token); the dead box comes back under a new epoch; each
box sees the other's fleet rows; both daemons started at once on a fresh database
migrate it once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from towerd.client import LeaseHeld, OutcomeUnknown
from towerd_testing import Daemon, wait_for

PRESENCE = ["--presence-interval", "0.5", "--presence-ttl", "5"]


def box(make_daemon: Callable[..., Daemon], name: str, dsn: str) -> Daemon:
    daemon = make_daemon(name)
    daemon.extra_args = ["--store", dsn, *PRESENCE]
    return daemon


@pytest.fixture
def boxes(make_daemon: Callable[..., Daemon], pg_dsn: str) -> tuple[Daemon, Daemon]:
    return box(make_daemon, "a", pg_dsn).start(), box(make_daemon, "b", pg_dsn).start()


def test_two_boxes_are_two_daemon_ids_with_their_own_epochs(
    boxes: tuple[Daemon, Daemon],
) -> None:
    a, b = boxes
    with a.client() as ca, b.client() as cb:
        sa, sb = ca.status(), cb.status()
    assert sa["daemon_id"] != sb["daemon_id"]
    assert sa["owner_epoch"] == sb["owner_epoch"] == 1
    assert sa["db_path"].startswith("postgresql://")


def test_a_lease_contended_through_both_boxes_goes_to_one_and_tokens_increase(
    boxes: tuple[Daemon, Daemon],
) -> None:
    a, b = boxes
    with a.client() as ca, b.client() as cb:
        granted = ca.lease_acquire("deploy/prod", ttl_ms=600_000)
        with pytest.raises(LeaseHeld):
            cb.lease_acquire("deploy/prod", ttl_ms=600_000)  # the same pid, another box
        ca.lease_release("deploy/prod", granted["fencing_token"])
        taken = cb.lease_acquire("deploy/prod", ttl_ms=600_000)
        assert taken["fencing_token"] > granted["fencing_token"]
        with pytest.raises(LeaseHeld):
            ca.lease_acquire("deploy/prod", ttl_ms=600_000)


def test_each_box_sees_the_whole_fleet_and_writes_only_its_own(
    boxes: tuple[Daemon, Daemon],
) -> None:
    a, b = boxes
    with a.client() as ca, b.client() as cb:
        on_a = ca.session_register(cwd="/a", agent="claude")["session_id"]
        on_b = cb.session_register(cwd="/b", agent="codex")["session_id"]
        for client in (ca, cb):
            rows = {r["session_id"]: r["daemon_id"] for r in client.fleet_list()["sessions"]}
            assert rows == {on_a: ca.status()["daemon_id"], on_b: cb.status()["daemon_id"]}
        assert cb.fleet_get(on_a)["cwd"] == "/a"


def test_a_killed_box_is_declared_dead_and_the_other_frees_what_it_held(
    make_daemon: Callable[..., Daemon], pg_dsn: str
) -> None:
    a = box(make_daemon, "a", pg_dsn).start()
    b = box(make_daemon, "b", pg_dsn).start()
    with a.client() as ca:
        dead_box = ca.status()["daemon_id"]
        claimed = ca.idem_claim("deploy", "release-42")
        assert claimed["state"] == "claimed"
        granted = ca.lease_acquire("deploy/prod", ttl_ms=600_000)
    a.kill9()
    with b.client() as cb:
        with pytest.raises(LeaseHeld):  # the box is still present (its TTL has not passed)
            cb.lease_acquire("deploy/prod", ttl_ms=600_000)

        def taken() -> object:
            try:
                return cb.lease_acquire("deploy/prod", ttl_ms=600_000)
            except LeaseHeld:
                return None

        lease: Any = wait_for(taken, timeout=20, what="the dead box's lease to be freed")
        assert lease["fencing_token"] > granted["fencing_token"]
        # Logged once the declaring batch committed, which may be after the answer that
        # granted the lease: waited for, not read once.
        wait_for(lambda: "box_declared_dead" in (log := b.log()) and dead_box in log,
                 timeout=10, what="box b's log of the dead box")  # fmt: skip
    # Its key turned outcome_unknown (decided by box b): a retry through either box is
    # told so, never "claimed" again.
    a.start()
    with a.client() as ca:
        assert ca.status()["owner_epoch"] == 2  # the next epoch
        with pytest.raises(OutcomeUnknown):
            ca.idem_claim("deploy", "release-42")
    with b.client() as cb, pytest.raises(OutcomeUnknown):
        cb.idem_claim("deploy", "release-42")


def test_both_daemons_started_at_once_on_a_fresh_database_migrate_it_once(
    make_daemon: Callable[..., Daemon], pg_databases: Callable[..., str]
) -> None:
    empty = pg_databases(migrated=False)  # no schema yet: the daemons race to create it
    daemons = [box(make_daemon, name, empty) for name in ("a", "b", "c")]
    errors: list[BaseException] = []

    def start(daemon: Daemon) -> None:
        try:
            daemon.start()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(d,)) for d in daemons]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    ids = set()
    for daemon in daemons:
        with daemon.client() as client:
            ids.add(client.status()["daemon_id"])
    assert len(ids) == 3


def test_a_watcher_on_one_box_hears_of_changes_made_through_the_other(
    boxes: tuple[Daemon, Daemon],
) -> None:
    """Both boxes' rows are in the snapshot; a change made through box a reaches a
    watcher of box b (LISTEN/NOTIFY), once it committed."""
    a, b = boxes
    with a.client() as ca, b.client() as cb_writer:
        before = ca.session_register(cwd="/a", agent="claude")["session_id"]
        mine = cb_writer.session_register(cwd="/b", agent="codex")["session_id"]
        with b.client() as watcher:
            pushes = watcher.watch(["fleet"], idle_timeout=10)
            snapshot = next(pushes)["snapshot"]["fleet"]["sessions"]
            assert {row["session_id"] for row in snapshot} == {before, mine}
            later = ca.session_register(cwd="/a2", agent="claude")["session_id"]
            for push in pushes:
                session = push["data"].get("session") or {}
                if push["event"] == "fleet" and session.get("session_id") == later:
                    assert push["data"]["op"] == "upsert" and session["cwd"] == "/a2"
                    break


def test_each_box_is_judged_by_its_own_presence_settings(
    make_daemon: Callable[..., Daemon], pg_dsn: str
) -> None:
    """A box that heartbeats every 8 s (TTL 30) beside one whose TTL is 5: the second
    judged the first by its own TTL, declared it dead between two of its heartbeats and
    granted its live holder's lease again (a hostile tester's reproducer). Each box's
    TTL is recorded at its start, and a box is judged by its own."""
    a = box(make_daemon, "a", pg_dsn).start()  # 0.5 s heartbeats, TTL 5
    b = make_daemon("b")
    b.extra_args = ["--store", pg_dsn, "--presence-interval", "8", "--presence-ttl", "30"]
    b.start()
    with a.client() as ca, b.client() as cb:
        granted = cb.lease_acquire("deploy/prod", ttl_ms=600_000)
        (b_row,) = [e for e in ca.boxes_list()["boxes"] if not e["self"]]

        def a_beat_past_b_s_interval() -> bool:
            (mine,) = [e for e in ca.boxes_list()["boxes"] if e["self"]]
            return mine["presence_at"] > b_row["presence_at"] + 12_000

        wait_for(a_beat_past_b_s_interval, timeout=30, what="a's heartbeats past 12 s")
        states = {e["daemon_id"]: (e["state"], e["dead_at"]) for e in ca.boxes_list()["boxes"]}
        assert set(states.values()) == {("present", None)}, states
        with pytest.raises(LeaseHeld):
            ca.lease_acquire("deploy/prod", ttl_ms=600_000)
        cb.lease_renew("deploy/prod", granted["fencing_token"], ttl_ms=600_000)


def test_a_box_without_a_recorded_ttl_is_judged_by_no_shorter_than_the_default(
    make_daemon: Callable[..., Daemon], pg_dsn: str
) -> None:
    """A box whose presence TTL is not recorded (a box from before they were, in a
    rolling upgrade, or its record deleted) was judged by the judge's own shorter TTL
    again, and declared dead between two heartbeats (a hostile tester's finding)."""
    import psycopg

    from towerd.daemon.store.boxes import TTL_KEY

    a = box(make_daemon, "a", pg_dsn).start()  # 0.5 s heartbeats, TTL 5
    b = make_daemon("b")
    b.extra_args = ["--store", pg_dsn, "--presence-interval", "8", "--presence-ttl", "30"]
    b.start()
    with a.client() as ca, b.client() as cb:
        (b_row,) = [e for e in ca.boxes_list()["boxes"] if not e["self"]]
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute("DELETE FROM meta WHERE key = %s", (TTL_KEY + b_row["daemon_id"],))
        granted = cb.lease_acquire("deploy/prod", ttl_ms=600_000)

        def a_beat_past_b_s_interval() -> bool:
            (mine,) = [e for e in ca.boxes_list()["boxes"] if e["self"]]
            return mine["presence_at"] > b_row["presence_at"] + 12_000

        wait_for(a_beat_past_b_s_interval, timeout=30, what="a's heartbeats past 12 s")
        with pytest.raises(LeaseHeld):
            ca.lease_acquire("deploy/prod", ttl_ms=600_000)
        cb.lease_renew("deploy/prod", granted["fencing_token"], ttl_ms=600_000)


def test_a_box_starting_after_the_whole_fleet_stopped_starts(
    make_daemon: Callable[..., Daemon], pg_dsn: str
) -> None:
    """Every box stopped, one started again: it waits for a running box's next record of
    the fleet's clock (twice the longest heartbeat interval, 11 s at the default 5 s),
    and that wait, made in one call on the writer's connection, was cut off as stuck:
    the box never started (a hostile tester's finding)."""
    import psycopg

    from towerd.daemon.store.fleet_clock import KEY, Record

    a = make_daemon("a")
    a.extra_args = ["--store", pg_dsn]  # the default 5 s heartbeats
    a.start()
    b = make_daemon("b")
    b.extra_args = ["--store", pg_dsn]
    b.start()
    assert a.stop() == 0 and b.stop() == 0

    def record_older_than_a_running_fleet_s() -> bool:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            value, server = conn.execute(
                "SELECT value, floor(extract(epoch FROM clock_timestamp()) * 1000) "
                "FROM meta WHERE key = %s",
                (KEY,),
            ).fetchone()
        record = Record.parse(value)
        return record is not None and server - record.server_ms > 1500

    wait_for(record_older_than_a_running_fleet_s, timeout=10, what="the record to age")
    a.start()
    with a.client() as client:
        assert client.ping()["store"] == "reachable"
    assert "fleet_clock_waiting" in a.log()
