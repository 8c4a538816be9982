"""What an operator installs into towerd's PostgreSQL database does not stop the daemon:
an extension (pg_stat_statements, from the Debian server package: two views in
towerd's schema) and a view of their own. A real daemon, a real cluster."""

from __future__ import annotations

from collections.abc import Callable

from pg_cluster import Databases
from towerd_testing import Daemon


def test_a_daemon_starts_on_a_database_with_an_extension_and_a_view_beside_its_tables(
    make_daemon: Callable[..., Daemon], pg_databases: Databases
) -> None:
    dsn = pg_databases()  # migrated: towerd's tables are there
    name = pg_databases.names[dsn]
    pg_databases.cluster.psql(name, "CREATE EXTENSION pg_stat_statements")
    pg_databases.cluster.psql(
        name, "CREATE VIEW live_sessions AS SELECT session_id FROM sessions", user="towerd"
    )
    daemon = make_daemon()
    daemon.extra_args = ["--store", dsn]
    daemon.start()
    with daemon.client() as client:
        session_id = client.session_register(cwd="/x", agent="claude")["session_id"]
    rows = pg_databases.cluster.psql(name, "SELECT session_id FROM live_sessions")
    assert rows == [(session_id,)]
