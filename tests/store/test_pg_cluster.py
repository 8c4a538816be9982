"""The private PostgreSQL cluster the tests run on (tests/pg_cluster.py): it starts,
hands out databases that belong to an unprivileged ``towerd``, is reachable over its
Unix socket and over TCP, and comes back after a crash. Not a store test: it runs once,
not once per store backend (``no_backend_param``)."""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest

from pg_cluster import ROLE, PgCluster, postgres_available, require_postgres

pytestmark = pytest.mark.no_backend_param


def dbname(dsn: str) -> str:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT current_database()").fetchone()
        assert row is not None
        return str(row[0])


@pytest.fixture
def durable_cluster() -> Iterator[PgCluster]:
    """A cluster of its own (this test kills it), with fsync and synchronous_commit on."""
    require_postgres(postgres_available())
    with PgCluster(durable=True) as cluster:
        yield cluster


def test_a_fresh_database_belongs_to_towerd_which_is_no_superuser(
    pg_cluster: PgCluster, pg_dsn: str
) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        assert conn.info.user == ROLE and conn.info.host == str(pg_cluster.sockdir)
        conn.execute("CREATE TABLE mine (x integer)")  # the owner may create in public
        conn.execute("INSERT INTO mine VALUES (1)")
    name = dbname(pg_dsn)
    assert pg_cluster.psql(
        "postgres", f"SELECT pg_get_userbyid(datdba) FROM pg_database WHERE datname = '{name}'"
    ) == [(ROLE,)]
    assert pg_cluster.psql(
        "postgres",
        "SELECT rolsuper, rolcreatedb, rolcreaterole, rolreplication, rolbypassrls, "
        f"rolcanlogin FROM pg_roles WHERE rolname = '{ROLE}'",
    ) == [(False, False, False, False, False, True)]
    assert pg_cluster.psql(name, "SELECT x FROM mine") == [(1,)]


def test_each_database_is_new_and_dropped_ones_are_gone(pg_cluster: PgCluster) -> None:
    first, second = pg_cluster.new_database(), pg_cluster.new_database()
    assert first != second
    with psycopg.connect(first, autocommit=True) as conn:
        conn.execute("CREATE TABLE only_in_first (x integer)")
    with psycopg.connect(second) as conn:
        assert conn.execute("SELECT to_regclass('only_in_first')").fetchone() == (None,)
    for dsn in (first, second):
        pg_cluster.drop_database(dbname(dsn))
        with pytest.raises(psycopg.OperationalError, match="does not exist"):
            psycopg.connect(dsn).close()


def test_the_tcp_dsn_reaches_the_same_database(pg_cluster: PgCluster, pg_dsn: str) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE seen (word text)")
        conn.execute("INSERT INTO seen VALUES ('over the socket')")
    with psycopg.connect(pg_cluster.tcp_dsn(dbname(pg_dsn))) as conn:
        assert (conn.info.host, conn.info.port) == ("127.0.0.1", pg_cluster.port)
        assert conn.execute("SELECT word FROM seen").fetchall() == [("over the socket",)]


def test_a_killed_cluster_restarts_with_what_it_committed(durable_cluster: PgCluster) -> None:
    """kill() is a crash (every server process gone at once); restart() recovers it on
    the same socket and port, so the DSNs handed out before still reach it."""
    cluster = durable_cluster
    dsn = cluster.new_database()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE kept (n integer)")
        conn.execute("INSERT INTO kept VALUES (1), (2)")
    postmaster = cluster.postmaster_pid()
    cluster.kill()
    assert not cluster.running
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(dsn, connect_timeout=5).close()
    cluster.restart()
    assert cluster.postmaster_pid() != postmaster
    assert "automatic recovery in progress" in cluster.log()  # it was a crash
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT n FROM kept ORDER BY n").fetchall() == [(1,), (2,)]
    with psycopg.connect(cluster.tcp_dsn(dbname(dsn))) as conn:
        assert conn.execute("SELECT count(*) FROM kept").fetchone() == (2,)
    cluster.stop()  # a clean stop, and a start from it
    assert not cluster.running
    cluster.start()
    assert cluster.psql(dbname(dsn), "SELECT count(*) FROM kept") == [(2,)]


@pytest.mark.parametrize(
    "environ, outcome",
    [({"CI": "true"}, pytest.fail.Exception), ({}, pytest.skip.Exception)],
    ids=["ci-fails", "locally-skips"],
)
def test_a_missing_postgres_fails_in_ci_and_skips_elsewhere(
    environ: dict[str, str], outcome: type[BaseException]
) -> None:
    with pytest.raises(outcome, match="no PostgreSQL here"):
        require_postgres("no PostgreSQL here", environ)
    require_postgres(None, environ)  # available: nothing happens
