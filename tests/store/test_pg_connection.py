"""daemon/store/pg.py's connection: statements through libpq, read as sqlite3 cursors.

The store functions run unchanged on PostgreSQL because ``PgConnection`` answers as a
sqlite3 connection does; since statements go through libpq (not a psycopg cursor, for
the write path's CPU), these pin what the store functions rely on: the types psycopg's
adapters give, rows and ``rowcount``, ``total_changes``, errors as psycopg's, and plans
that are made again as tables grow.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from decimal import Decimal

import psycopg
import pytest

from towerd.daemon.store import pg
from towerd.daemon.store.pg import PgConnection, connect, numbered

pytestmark = pytest.mark.no_backend_param


@pytest.fixture
def conn(pg_dsn: str) -> Iterator[PgConnection]:
    connection = connect(pg_dsn)
    try:
        yield connection
    finally:
        connection.close()


def test_placeholders_are_numbered_outside_literals_and_quoted_names() -> None:
    sql = """SELECT '?', "a?b", x FROM t WHERE a = ? AND b LIKE 'x%' AND c IN (?, ?)"""
    assert numbered(sql) == (
        b"""SELECT '?', "a?b", x FROM t WHERE a = $1 AND b LIKE 'x%' AND c IN ($2, $3)"""
    )


def test_arguments_and_rows_keep_psycopgs_types(conn: PgConnection) -> None:
    for _ in range(3):  # the first run unprepared, then prepared: the same answer
        row = conn.execute(
            "SELECT ?::bigint, ?::text, ?::bytea, ?::bigint, sum(?::bigint), ?::text IS NULL, "
            "?::double precision, 'a%b'",
            (2**40, "naïve", b"\x00\xff", True, 3, None, 1.5),
        ).fetchone()
        assert row == (2**40, "naïve", b"\x00\xff", 1, Decimal(3), True, 1.5, "a%b")
        assert type(row[3]) is int  # a bool is sent as the integer the schema stores


def test_rows_read_as_a_sqlite3_cursor_reads(conn: PgConnection) -> None:
    def rows() -> pg.Rows:
        return conn.execute("SELECT generate_series(1, ?)", (4,))

    assert rows().fetchall() == [(1,), (2,), (3,), (4,)]
    assert [r for r in rows()] == [(1,), (2,), (3,), (4,)]
    cursor = rows()
    assert cursor.rowcount == 4
    assert cursor.fetchone() == (1,)
    assert cursor.fetchmany(2) == [(2,), (3,)]
    assert cursor.fetchall() == [(4,)]
    assert cursor.fetchone() is None
    assert conn.execute("SELECT 1 WHERE ? = 2", (1,)).fetchone() is None


def test_rowcount_and_total_changes_count_rows_written(conn: PgConnection) -> None:
    conn.raw.execute("CREATE TEMP TABLE t (k bigint PRIMARY KEY, v text)")
    before = conn.total_changes
    assert conn.execute("INSERT INTO t VALUES (?, ?), (?, ?)", (1, "a", 2, "b")).rowcount == 2
    updated = conn.execute("UPDATE t SET v = ? WHERE k >= ? RETURNING k", ("c", 1))
    assert updated.rowcount == 2 and sorted(updated.fetchall()) == [(1,), (2,)]
    assert conn.execute("DELETE FROM t WHERE k = ?", (3,)).rowcount == 0
    assert conn.execute("SELECT v FROM t WHERE k = ?", (1,)).fetchall() == [("c",)]
    assert conn.total_changes - before == 4  # reads do not count, as in sqlite3


def test_a_failed_statement_raises_psycopgs_error_and_the_transaction_must_roll_back(
    conn: PgConnection,
) -> None:
    conn.raw.execute("CREATE TEMP TABLE t (k bigint PRIMARY KEY)")
    conn.execute("BEGIN")
    conn.execute("INSERT INTO t VALUES (?)", (1,))
    with pytest.raises(psycopg.errors.UniqueViolation):
        conn.execute("INSERT INTO t VALUES (?)", (1,))
    assert conn.failed and conn.in_transaction
    conn.execute("ROLLBACK")
    assert not conn.in_transaction
    assert conn.execute("SELECT count(*) FROM t WHERE k >= ?", (0,)).fetchone() == (0,)


def test_a_lost_connection_is_an_operational_error_and_leaves_it_broken(
    conn: PgConnection,
) -> None:
    conn.execute("SELECT ?::int", (1,))
    conn.interrupt()
    with pytest.raises(psycopg.OperationalError):
        conn.execute("SELECT ?::int", (1,))
    assert conn.broken


def test_notes_go_out_with_the_commit_and_never_with_a_rollback(pg_dsn: str) -> None:
    listener = psycopg.connect(pg_dsn, autocommit=True)
    writer = connect(pg_dsn)
    try:
        listener.execute("LISTEN towerd_test")
        writer.execute("BEGIN")
        writer.notify_at_commit("towerd_test", "dropped: 'quoted'")
        writer.execute("ROLLBACK")
        writer.execute("BEGIN")
        writer.notify_at_commit("towerd_test", "first: 'quoted'")
        writer.notify_at_commit("towerd_test", "second")
        writer.execute("COMMIT")
        heard = [n.payload for n in listener.notifies(timeout=2, stop_after=2)]
        assert heard == ["first: 'quoted'", "second"]
    finally:
        writer.close()
        listener.close()


def test_plans_made_on_a_tiny_table_are_made_again_as_it_grows(conn: PgConnection) -> None:
    """A lookup prepared while its table is tiny gets a sequential scan as its plan; the
    connection makes its plans again every REPLAN_EVERY statements, so once the table
    has grown the lookup uses its index."""
    conn.raw.execute("CREATE TABLE grows (a text, b text, c text, v bigint, PRIMARY KEY (a, b, c))")
    conn.raw.execute("INSERT INTO grows VALUES ('p', 'o', 'k', 1)")
    conn.raw.execute("ANALYZE grows")
    lookup = "SELECT v FROM grows WHERE a = ? AND b = ? AND c = ?"
    key = ("p", "o", "k")
    for _ in range(8):  # prepared at its second run; a generic plan after five more
        assert conn.execute(lookup, key).fetchone() == (1,)
    name = conn._prepared[lookup, conn._tx.types].decode()

    def plan() -> str:
        rows = conn.raw.execute(f"EXPLAIN EXECUTE {name}('p', 'o', 'k')").fetchall()
        return "\n".join(row[0] for row in rows)

    assert "Seq Scan" in plan(), "the premise: a tiny table's generic plan scans it"
    conn.raw.execute(
        "INSERT INTO grows SELECT 'p', 'o', g::text, g FROM generate_series(1, 20000) g"
    )
    for _ in range(pg.REPLAN_EVERY):
        conn.execute(lookup, (str(uuid.uuid4()), "o", "k"))
    assert conn.execute(lookup, key).fetchone() == (1,)
    assert "Index" in plan()
