"""Refusals of the PostgreSQL store options: each a clear message and exit 78 before
anything is served, and nothing written."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import psycopg

from towerd_testing import Daemon

EXIT_REFUSED = 78


def refused(daemon: Daemon, *extra: str) -> str:
    proc = daemon.spawn(*extra)
    assert proc.wait(30) == EXIT_REFUSED, daemon.log()
    return daemon.log()


def test_a_dsn_file_others_may_read_is_refused(
    make_daemon: Callable[..., Daemon], short_tmp: Path, pg_dsn: str
) -> None:
    dsn_file = short_tmp / "dsn"
    dsn_file.write_text(pg_dsn + "\n")
    dsn_file.chmod(0o644)
    log = refused(make_daemon(), "--store-dsn-file", str(dsn_file))
    assert "store DSN file" in log and "0644" in log
    with psycopg.connect(pg_dsn) as conn:  # the database was never touched
        assert conn.execute("SELECT count(*) FROM daemons").fetchone() == (0,)


def test_a_dsn_file_of_this_user_mode_0600_is_used(
    make_daemon: Callable[..., Daemon], short_tmp: Path, pg_dsn: str
) -> None:
    dsn_file = short_tmp / "dsn"
    dsn_file.write_text(pg_dsn + "\n")
    dsn_file.chmod(0o600)
    daemon = make_daemon().start("--store-dsn-file", str(dsn_file))
    with daemon.client() as client:
        assert client.status()["store"]["backend"] == "postgresql"


def test_a_presence_ttl_under_five_seconds_is_refused(
    make_daemon: Callable[..., Daemon], pg_dsn: str
) -> None:
    log = refused(make_daemon(), "--store", pg_dsn, "--presence-ttl", "2")
    assert "--presence-ttl 2 must be at least 5 seconds" in log


def test_a_database_that_forgot_this_box_is_refused_unless_new_store(
    make_daemon: Callable[..., Daemon], pg_databases: Callable[..., str]
) -> None:
    """The state dir's daemon is unknown to the database (it was replaced or reset):
    starting would forget every key this box acknowledged."""
    first, replaced = pg_databases(), pg_databases()
    daemon = make_daemon()
    daemon.start("--store", first)
    assert daemon.stop() == 0
    log = refused(daemon, "--store", replaced)
    assert "does not know this state dir's daemon" in log and "--new-store" in log
    with psycopg.connect(replaced) as conn:
        assert conn.execute("SELECT count(*) FROM daemons").fetchone() == (0,)
    daemon.start("--store", replaced, "--new-store")
    with daemon.client() as client:
        assert client.status()["owner_epoch"] == 1
