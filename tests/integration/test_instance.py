"""One daemon per state dir; takeover; stale sockets; a superseded daemon stops writing."""

from __future__ import annotations

import stat

import pytest

from towerd.client import StaleEpoch, Unavailable
from towerd_testing import store_execute

pytestmark = pytest.mark.both_backends

EXIT_ALREADY_RUNNING = 75
EXIT_REFUSED = 78


def test_second_instance_is_refused_naming_the_first(daemon, make_daemon):
    """A second towerd on the same state dir exits 75 naming the running pid and socket;
    the first keeps serving."""
    second = make_daemon("second")
    second.state_dir = daemon.state_dir
    proc = second.spawn()
    assert proc.wait(20) == EXIT_ALREADY_RUNNING
    log = second.log()
    assert f"pid {daemon.pid}" in log and str(daemon.socket_path) in log
    with daemon.client() as client:
        assert client.ping()["pong"]


def test_takeover_stops_the_running_daemon_and_starts_at_the_next_epoch(daemon, make_daemon):
    """--takeover asks the running daemon to stop, waits for its lock, and serves the same
    fleet as the same daemon id at epoch + 1; the old process exits 0."""
    with daemon.client() as client:
        before = client.status()
        session = client.session_register(cwd="/r", agent="claude")["session_id"]
    successor = make_daemon("successor")
    successor.state_dir, successor.socket_path = daemon.state_dir, daemon.socket_path
    successor.start("--takeover")
    assert daemon.proc.wait(20) == 0
    with successor.client() as client:
        after = client.status()
        assert after["pid"] == successor.pid
        assert after["daemon_id"] == before["daemon_id"]
        assert after["owner_epoch"] == before["owner_epoch"] + 1
        assert client.fleet_get(session)["owner_epoch"] == after["owner_epoch"]
    assert successor.stop() == 0


def test_stale_socket_of_a_killed_daemon_is_replaced(daemon):
    """kill -9 leaves the socket file behind; the next start replaces it."""
    daemon.kill9()
    assert stat.S_ISSOCK(daemon.socket_path.lstat().st_mode)
    with pytest.raises(Unavailable):
        daemon.client()
    daemon.start()
    with daemon.client() as client:
        assert client.ping()["pong"]


def test_clean_stop_removes_the_socket(daemon):
    """SIGTERM: exit 0, socket removed, DB closed cleanly (SQLite: no WAL left behind)."""
    assert daemon.stop() == 0
    assert not daemon.socket_path.exists()
    assert not (daemon.state_dir / "towerd.db-wal").exists()


def test_superseded_daemon_refuses_writes_and_exits(daemon):
    """If the store records a later epoch for this daemon id, its next write is refused
    stale_epoch (naming the daemon and epoch) and the process exits 78."""
    with daemon.client() as client:
        status = client.status()
    store_execute(
        daemon,
        "UPDATE daemons SET owner_epoch = owner_epoch + 1 WHERE daemon_id = ?",
        (status["daemon_id"],),
    )
    with daemon.client() as client, pytest.raises(StaleEpoch) as refused:
        client.session_register(cwd="/r", agent="claude")
    assert status["daemon_id"] in refused.value.message
    assert str(status["owner_epoch"]) in refused.value.message
    assert daemon.proc.wait(20) == EXIT_REFUSED


def test_rows_of_another_daemon_are_refused_until_adopted(daemon):
    """A row owned by another daemon id: writes refused stale_epoch naming both daemons
    and epochs, invisible in fleet.list; fleet.adopt moves it to this daemon's epoch."""
    other = "00000000-0000-4000-8000-000000000001"
    session = "11111111-1111-4111-8111-111111111111"
    # A box declared dead long ago (dead_at): on a store boxes share only a dead box's
    # rows may be adopted (README "Several boxes"); the embedded store ignores it.
    store_execute(
        daemon,
        "INSERT INTO daemons (daemon_id, owner_epoch, pid, host, started_at, dead_at) "
        "VALUES (?, 9, 1, 'h', 0, 1)",
        (other,),
    )
    store_execute(
        daemon,
        "INSERT INTO sessions (session_id, cwd, agent, daemon_id, owner_epoch, updated_at) "
        "VALUES (?, '/o', 'codex', ?, 9, 0)",
        (session, other),
    )
    with daemon.client() as client:
        status = client.status()
        assert client.fleet_list(daemon_id=status["daemon_id"])["sessions"] == []
        # Unfiltered, a store boxes share lists every box's rows (README "One fleet").
        shown = [row["session_id"] for row in client.fleet_list()["sessions"]]
        assert shown == ([session] if daemon.backend == "postgresql" else [])
        with pytest.raises(StaleEpoch) as refused:
            client.session_update(session, name="mine now")
        message = refused.value.message
        assert other in message and "epoch 9" in message
        assert status["daemon_id"] in message and f"epoch {status['owner_epoch']}" in message
        adopted = client.fleet_adopt(other)
        assert adopted["adopted"] == 1 and adopted["owner_epoch"] == status["owner_epoch"]
        assert client.session_update(session, name="mine now")["name"] == "mine now"
