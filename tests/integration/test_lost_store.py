"""A database deleted or replaced under the daemon: nothing more is acknowledged, the
daemon stops, and the next start refuses to mint a fresh identity (which would forget
every acknowledged key) unless told --new-store."""

from __future__ import annotations

import os
import shutil
import sqlite3

import pytest

from towerd.client import Unavailable

EXIT_REFUSED = 78
DB_FILES = ("towerd.db", "towerd.db-wal", "towerd.db-shm")


def _complete(daemon, key: str) -> None:
    with daemon.client() as client:
        assert client.idem_claim("push", key)["state"] == "claimed"
        client.idem_complete("push", key, {"pushed": key})


def test_deleted_database_is_not_written_into_and_the_daemon_stops(daemon):
    """`rm towerd.db*` under a live daemon: the next write is refused `unavailable`
    (never acknowledged into the unlinked file), and the daemon exits 78 saying why."""
    _complete(daemon, "before")
    with daemon.client() as client:
        for name in DB_FILES:
            (daemon.state_dir / name).unlink()
        with pytest.raises(Unavailable) as refused:
            client.idem_claim("push", "after")
    # The write batch or the once-a-second guard noticed first: either way, refused.
    assert refused.value.data.get("reason") in ("store_lost", "closed", "connection"), refused
    assert daemon.proc.wait(10) == EXIT_REFUSED
    log = daemon.log()
    assert '"store_lost"' in log and "towerd.db was removed" in log, log


def test_an_idle_daemon_notices_by_itself(daemon):
    """No request needed: the guard sees the file gone within about a second."""
    (daemon.state_dir / "towerd.db").unlink()
    assert daemon.proc.wait(10) == EXIT_REFUSED
    assert '"store_lost"' in daemon.log()


def test_a_removed_wal_is_not_written_into(daemon):
    """The WAL alone removed (its acknowledged keys would be gone at the next start):
    the next write is not acknowledged. After a commit the WAL is checked for being
    there only (daemon/store/store.py ``DatabaseFiles``), and that is enough here."""
    _complete(daemon, "before")
    with daemon.client() as client:
        (daemon.state_dir / "towerd.db-wal").unlink()
        with pytest.raises(Unavailable):
            client.idem_claim("push", "after")
    assert daemon.proc.wait(10) == EXIT_REFUSED
    assert "towerd.db-wal was removed" in daemon.log()


def test_a_wal_replaced_on_its_own_is_noticed_by_the_guard(daemon):
    """Another file renamed over the WAL: the WAL is not stat'ed after each commit, so
    the once-a-second guard, which checks every file by identity, notices it."""
    _complete(daemon, "before")
    wal = daemon.state_dir / "towerd.db-wal"
    other = daemon.state_dir / "other-wal"
    shutil.copyfile(wal, other)
    os.replace(other, wal)
    assert daemon.proc.wait(10) == EXIT_REFUSED
    assert "towerd.db-wal was replaced by another file" in daemon.log()


def test_restart_after_the_loss_refuses_a_fresh_identity(daemon):
    """The state dir still shows the store that was there (its daemon id record): the
    next start exits 78 naming it and --new-store; with --new-store, a new daemon id."""
    _complete(daemon, "before")
    with daemon.client() as client:
        old_id = client.status()["daemon_id"]
    assert daemon.stop() == 0
    for name in DB_FILES:
        (daemon.state_dir / name).unlink(missing_ok=True)
    proc = daemon.spawn()
    assert proc.wait(20) == EXIT_REFUSED
    log = daemon.log()
    assert "is missing" in log and old_id in log and "--new-store" in log, log
    assert not (daemon.state_dir / "towerd.db").exists()
    daemon.start("--new-store")
    with daemon.client() as client:
        assert client.status()["daemon_id"] != old_id
        assert client.idem_claim("push", "before")["state"] == "claimed"  # a new store, knowingly


def test_a_database_swapped_in_from_another_store_is_refused(make_daemon):
    """A database whose daemon id is not the one the state dir recorded is refused,
    untouched; --new-store adopts it."""
    mine, theirs = make_daemon("mine").start(), make_daemon("theirs").start()
    _complete(mine, "mine")
    with theirs.client() as client:
        their_id = client.status()["daemon_id"]
    assert mine.stop() == 0 and theirs.stop() == 0
    for name in DB_FILES:
        (mine.state_dir / name).unlink(missing_ok=True)
    shutil.copy2(theirs.state_dir / "towerd.db", mine.state_dir / "towerd.db")
    before = (mine.state_dir / "towerd.db").read_bytes()
    proc = mine.spawn()
    assert proc.wait(20) == EXIT_REFUSED
    assert "was replaced" in mine.log() and their_id in mine.log()
    assert (mine.state_dir / "towerd.db").read_bytes() == before
    mine.start("--new-store")
    with mine.client() as client:
        assert client.status()["daemon_id"] == their_id
    assert mine.stop() == 0


def test_a_first_start_needs_no_flag(make_daemon):
    """An empty state dir is no sign of a lost store."""
    fresh = make_daemon("fresh").start()
    with fresh.client() as client:
        daemon_id = client.status()["daemon_id"]
    assert (fresh.state_dir / "daemon_id").read_text().strip() == daemon_id
    assert fresh.stop() == 0


def test_an_upgraded_state_dir_gets_its_record(daemon):
    """A state dir from before the record existed: the record is written at start."""
    with daemon.client() as client:
        daemon_id = client.status()["daemon_id"]
    assert daemon.stop() == 0
    (daemon.state_dir / "daemon_id").unlink()
    daemon.start()
    assert (daemon.state_dir / "daemon_id").read_text().strip() == daemon_id
    with sqlite3.connect(daemon.state_dir / "towerd.db") as db:
        (stored,) = db.execute("SELECT value FROM meta WHERE key = 'daemon_id'").fetchone()
    assert stored == daemon_id
    assert os.stat(daemon.state_dir / "daemon_id").st_mode & 0o077 == 0
