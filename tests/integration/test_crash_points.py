"""SIGKILL at named moments inside the daemon (TOWERD_CRASH_AT, test-only): before a
commit, after a commit but before the reply, inside reconciliation, inside a
migration. Each leaves a state the next start handles without loss or doubles."""

from __future__ import annotations

import signal
import sqlite3

import pytest

from towerd.client import Unavailable
from towerd_testing import start_crashing_at, store_query

pytestmark = pytest.mark.both_backends


def died_by_sigkill(daemon) -> bool:
    return daemon.proc.wait(20) == -signal.SIGKILL


def test_crash_before_commit_loses_only_the_unacknowledged_write(make_daemon):
    daemon = start_crashing_at(make_daemon(), "batch.before_commit", nth=2)
    with daemon.client() as client:
        kept = client.session_register(cwd="/r", agent="a", idempotency_key="first")
        with pytest.raises(Unavailable):
            client.session_register(cwd="/r", agent="a", idempotency_key="second")
    assert died_by_sigkill(daemon)
    daemon.start()
    with daemon.client() as client:
        rows = [row["session_id"] for row in client.iter_fleet()]
        assert rows == [kept["session_id"]]
        retried = client.session_register(cwd="/r", agent="a", idempotency_key="second")
        assert [row["session_id"] for row in client.iter_fleet()] == [
            kept["session_id"],
            retried["session_id"],
        ]


def test_crash_after_commit_before_reply_is_answered_by_the_retry(make_daemon):
    """The write committed but its reply was never sent: the retry with the same key
    returns the committed session id and inserts nothing."""
    daemon = start_crashing_at(make_daemon(), "batch.after_commit")
    with daemon.client() as client, pytest.raises(Unavailable):
        client.session_register(cwd="/r", agent="a", idempotency_key="lost-reply")
    assert died_by_sigkill(daemon)
    daemon.start()
    with daemon.client() as client:
        (row,) = list(client.iter_fleet())
        retried = client.session_register(cwd="/r", agent="a", idempotency_key="lost-reply")
        assert retried["session_id"] == row["session_id"]
        assert len(list(client.iter_fleet())) == 1


def test_crash_inside_reconciliation_changes_nothing(make_daemon):
    """A start killed inside its reconciliation transaction leaves the keys, the rows
    and the epoch as they were; the next start reconciles once."""
    daemon = make_daemon().start()
    with daemon.client() as client:
        epoch = client.status()["owner_epoch"]
        client.idem_claim("session.spawn", "interrupted")
    daemon.kill9()
    daemon.proc = daemon.spawn(env=daemon.env(TOWERD_CRASH_AT="reconcile.before_commit"))
    assert died_by_sigkill(daemon)
    assert store_query(daemon, "SELECT state FROM idempotency") == [("in_progress",)]
    assert store_query(daemon, "SELECT owner_epoch FROM daemons") == [(epoch,)]
    daemon.start()
    with daemon.client() as client:
        status = client.status()
        assert status["owner_epoch"] == epoch + 1
        assert status["reconciliation"]["marked_unknown"] == 1
        assert client.idem_get("session.spawn", "interrupted")["state"] == "outcome_unknown"


@pytest.mark.sqlite_only  # the file's ladder; PostgreSQL's: tests/store/test_pg_schema.py
def test_crash_inside_a_migration_keeps_the_old_schema(make_daemon):
    """A first start killed inside the migration transaction leaves an empty version-0
    file; the next start migrates cleanly."""
    daemon = make_daemon()
    daemon.proc = daemon.spawn(env=daemon.env(TOWERD_CRASH_AT="migrate.before_commit"))
    assert died_by_sigkill(daemon)
    db = sqlite3.connect(daemon.state_dir / "towerd.db")
    assert db.execute("PRAGMA user_version").fetchone() == (0,)
    assert db.execute("SELECT count(*) FROM sqlite_master").fetchone() == (0,)
    db.close()
    daemon.start()
    with daemon.client() as client:
        assert client.status()["owner_epoch"] == 1
        client.session_register(cwd="/r", agent="a")
    assert daemon.stop() == 0


def test_unknown_crash_point_is_refused(make_daemon):
    daemon = make_daemon()
    proc = daemon.spawn(env=daemon.env(TOWERD_CRASH_AT="nowhere"))
    assert proc.wait(20) != 0
    assert "unknown crash point" in daemon.log()
