"""The PostgreSQL ladder makes SQLite's final shape, refuses what is not towerd's, and
climbs once however many daemons start together.

Each comparison is against a SQLite database climbed by daemon/store/schema.py, so the
two ladders cannot drift apart unnoticed.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import sqlite3
import subprocess
import tempfile
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pg_cluster import runuser
from towerd.daemon.private_paths import StartRefused
from towerd.daemon.store import pg_schema, schema

# Not a store test (tests/store/conftest.py): each test here picks its databases itself.
pytestmark = pytest.mark.no_backend_param

# --- a private PostgreSQL cluster (until the shared pg_cluster fixture replaces it)


def _bin_dir() -> Path | None:
    """The newest /usr/lib/postgresql/VERSION/bin with initdb."""
    found = [Path(path).parent for path in glob.glob("/usr/lib/postgresql/*/bin/initdb")]

    def version(bin_dir: Path) -> int:
        return int(bin_dir.parent.name) if bin_dir.parent.name.isdigit() else 0

    return max(found, key=version) if found else None


def _as_postgres(*args: str | Path) -> None:
    """Run a server program; initdb refuses root: as root, the cluster belongs to (and
    runs as) postgres."""
    command = [str(arg) for arg in args]
    if os.geteuid() == 0:
        command = [runuser() or "runuser", "-u", "postgres", "--", *command]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed: {done.stdout}{done.stderr}")


@dataclass
class _Cluster:
    sockdir: Path
    _names: Iterator[int] = field(default_factory=count)

    def connect(self, dbname: str, user: str = "towerd", **options: Any) -> psycopg.Connection[Any]:
        return psycopg.connect(
            host=str(self.sockdir), dbname=dbname, user=user, autocommit=True, **options
        )

    def new_database(self, options: str = "") -> str:
        """A fresh database owned by the non-superuser role towerd."""
        name = f"schema_{next(self._names)}"
        with self.connect("postgres", user="postgres") as admin:
            admin.execute(f"CREATE DATABASE {name} OWNER towerd {options}")
        return name


@pytest.fixture(scope="session")
def _schema_cluster() -> Iterator[_Cluster]:
    bindir = _bin_dir()
    if bindir is None:
        pytest.skip("no PostgreSQL server binaries in /usr/lib/postgresql/*/bin")
    root = Path(tempfile.mkdtemp(prefix="tpg-", dir="/tmp"))
    data, sockdir, logfile = root / "data", root / "sock", root / "log"
    data.mkdir(mode=0o700)
    sockdir.mkdir(mode=0o755)
    root.chmod(0o755)
    if os.geteuid() == 0:
        for path in (root, data, sockdir):
            shutil.chown(path, "postgres", "postgres")
    options = (
        f"-k {sockdir} -c listen_addresses='' -c fsync=off -c full_page_writes=off "
        "-c synchronous_commit=off"
    )
    try:
        _as_postgres(bindir / "initdb", "-A", "trust", "-U", "postgres", "--no-sync", "-D", data)
        try:
            _as_postgres(bindir / "pg_ctl", "-w", "-D", data, "-o", options, "-l", logfile, "start")
        except RuntimeError as exc:
            raise RuntimeError(
                f"{exc}\n{logfile.read_text() if logfile.exists() else ''}"
            ) from None
        cluster = _Cluster(sockdir)
        with cluster.connect("postgres", user="postgres") as admin:
            admin.execute("CREATE ROLE towerd LOGIN")  # no superuser, no CREATEDB
        yield cluster
    finally:
        with contextlib.suppress(RuntimeError):  # not running: nothing to stop
            _as_postgres(bindir / "pg_ctl", "-D", data, "-m", "immediate", "stop")
        shutil.rmtree(root, ignore_errors=True)


@dataclass
class _Database:
    cluster: _Cluster
    name: str
    opened: list[psycopg.Connection[Any]] = field(default_factory=list)

    def connect(self, **options: Any) -> psycopg.Connection[Any]:
        conn = self.cluster.connect(self.name, **options)
        self.opened.append(conn)
        return conn

    def close(self) -> None:
        for conn in self.opened:
            conn.close()


@pytest.fixture
def fresh(_schema_cluster: _Cluster) -> Iterator[_Database]:
    """A fresh, empty database."""
    database = _Database(_schema_cluster, _schema_cluster.new_database())
    yield database
    database.close()


@pytest.fixture
def pg(fresh: _Database) -> psycopg.Connection[Any]:
    """A connection (as towerd, autocommit) to a fresh, empty database."""
    return fresh.connect()


@pytest.fixture
def lite(tmp_path: Path) -> Iterator[sqlite3.Connection]:
    """A SQLite file climbed to the top of daemon/store/schema.py's ladder."""
    conn = sqlite3.connect(tmp_path / "towerd.db", isolation_level=None)
    schema._climb(conn, 0)
    assert conn.execute("PRAGMA user_version").fetchone() == (schema.SCHEMA_VERSION,)
    yield conn
    conn.close()


# --- helpers


def _here(column: str) -> str:
    """SQL: the namespace ``column`` is the connection's current schema."""
    return f"{column} = (SELECT oid FROM pg_namespace WHERE nspname = current_schema())"


def state(conn: psycopg.Connection[Any]) -> list[tuple[Any, ...]]:
    """Everything a migration could write: the schema's catalog rows (with the xmin of
    the transaction that wrote each) and every table's rows (likewise)."""
    found: list[tuple[Any, ...]] = list(
        conn.execute(
            f"""SELECT 'class', c.relname, c.xmin::text FROM pg_class c
                WHERE {_here("c.relnamespace")}
                UNION ALL SELECT 'trigger', g.tgname, g.xmin::text FROM pg_trigger g
                JOIN pg_class c ON c.oid = g.tgrelid WHERE {_here("c.relnamespace")}
                UNION ALL SELECT 'function', p.proname, p.xmin::text FROM pg_proc p
                WHERE {_here("p.pronamespace")}
                ORDER BY 1, 2"""
        )
    )
    for (table,) in conn.execute(
        f"SELECT relname FROM pg_class c WHERE {_here('c.relnamespace')} AND relkind = 'r'"
    ).fetchall():
        found += conn.execute(
            f"SELECT '{table}', t.xmin::text, row_to_json(t)::text FROM {table} t ORDER BY 2, 3"
        ).fetchall()
    return found


def sqlite_columns(conn: sqlite3.Connection) -> dict[str, dict[str, tuple[Any, ...]]]:
    """table -> column -> (type as PostgreSQL names it, not null, default)."""
    types = {"INTEGER": "bigint", "TEXT": "text", "BLOB": "bytea", "REAL": "double precision"}
    tables = conn.execute(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'"
    ).fetchall()
    return {
        table: {
            name: (types[kind], bool(notnull or pk), default)
            for _, name, kind, notnull, default, pk in conn.execute(f"PRAGMA table_info({table})")
        }
        for (table,) in tables
    }


def pg_columns(conn: psycopg.Connection[Any]) -> dict[str, dict[str, tuple[Any, ...]]]:
    found: dict[str, dict[str, tuple[Any, ...]]] = {}
    for table, name, kind, nullable, default in conn.execute(
        """SELECT table_name, column_name, data_type, is_nullable, column_default
           FROM information_schema.columns WHERE table_schema = current_schema()"""
    ):
        found.setdefault(table, {})[name] = (kind, nullable == "NO", default)
    return found


# The columns only PostgreSQL has: an explicit rowid where the store's SQL uses SQLite's
# implicit one.
ROWID = ("bigint", True, None)
PG_ONLY = {
    "sessions": {"rowid": ROWID},
    "idempotency": {"rowid": ROWID},
    "effects": {"rowid": ROWID},
    "messages": {"rowid": ROWID},
}


class Both:
    """The same statement on the SQLite and the PostgreSQL database."""

    def __init__(self, lite: sqlite3.Connection, pg: psycopg.Connection[Any]) -> None:
        self.lite, self.pg = lite, pg

    def run(self, sql: str, args: Sequence[Any] = ()) -> tuple[list[Any], list[Any]]:
        """Both databases' rows for ``sql`` (``?`` placeholders)."""
        on_lite = self.lite.execute(sql, args).fetchall()
        cursor = self.pg.execute(sql.replace("?", "%s"), args or None)
        on_pg = [tuple(row) for row in cursor.fetchall()] if cursor.description else []
        return on_lite, on_pg

    def same(self, sql: str, args: Sequence[Any] = ()) -> list[Any]:
        on_lite, on_pg = self.run(sql, args)
        assert on_pg == on_lite, sql
        return on_lite

    def insert(self, table: str, **values: Any) -> None:
        """A row of ``table``: MINIMAL's values but for ``values``."""
        self.run(*insert_of(table, values))

    def refusals(self, table: str, **values: Any) -> tuple[bool, bool]:
        """Whether each database refuses the row as breaking a constraint."""
        sql, args = insert_of(table, values)
        try:
            self.lite.execute(sql, args)
            on_lite = False
        except sqlite3.IntegrityError:
            on_lite = True
        try:
            with self.pg.transaction():  # a savepoint in an open transaction
                self.pg.execute(sql.replace("?", "%s"), args)
            on_pg = False
        except psycopg.errors.IntegrityError:
            on_pg = True
        return on_lite, on_pg


def insert_of(table: str, values: dict[str, Any], returning: str = "") -> tuple[str, list[Any]]:
    row = {**MINIMAL[table], **values}
    marks = ", ".join("?" for _ in row)
    sql = f"INSERT INTO {table} ({', '.join(row)}) VALUES ({marks}) {returning}"
    return sql, list(row.values())


@pytest.fixture
def both(lite: sqlite3.Connection, pg: psycopg.Connection[Any]) -> Both:
    """Both databases fresh (identities start at 1)."""
    assert pg_schema.migrate(pg) == 0
    return Both(lite, pg)


@pytest.fixture(scope="module")
def _migrated_once(_schema_cluster: _Cluster) -> Iterator[Both]:
    database = _Database(_schema_cluster, _schema_cluster.new_database())
    pg = database.connect()
    pg_schema.migrate(pg)
    lite = sqlite3.connect(":memory:", isolation_level=None)
    schema._climb(lite, 0)
    yield Both(lite, pg)
    lite.close()
    database.close()


@pytest.fixture
def rolled_back(_migrated_once: Both) -> Iterator[Both]:
    """Both databases, migrated once for the module; each test's writes are rolled back."""
    _migrated_once.lite.execute("BEGIN")
    _migrated_once.pg.execute("BEGIN")
    yield _migrated_once
    _migrated_once.lite.execute("ROLLBACK")
    _migrated_once.pg.execute("ROLLBACK")


# The smallest valid row of each table the tests write.
MINIMAL: dict[str, dict[str, Any]] = {
    "daemons": dict(daemon_id="d1", owner_epoch=1, pid=1, host="h", started_at=0),
    "sessions": dict(
        session_id="s1", cwd="/", agent="claude", daemon_id="d1", owner_epoch=1, updated_at=0
    ),
    "idempotency": dict(
        principal="p", operation="op", key="k1", payload_hash=b"h", state="completed",
        effect_ref="r", daemon_id="d1", created_at=0, updated_at=0,
    ),
    "leases": dict(
        resource="r1", fencing_token=1, principal="p", acquired_at=0, renewed_at=0,
        expires_at=1, daemon_id="d1",
    ),
    "lease_tokens": dict(resource="r1", last_token=1, principal="p"),
    "effects": dict(
        effect_key="e1", run_id="run", step_id="st", attempt_id="a", action_kind="webhook",
        target_ref="t", status="in_flight", payload_hash=b"h", principal="p", timeout_ms=1,
        claimed_at=0, heartbeat_at=0, daemon_id="d1",
    ),
    "workers": dict(
        worker_id="w1", principal="p", host="h", pid=1, process_start=1, project_root="/",
        status="active", registered_at=0, heartbeat_at=0, daemon_id="d1",
    ),
    "dispatches": dict(
        unit_type="task", unit_id="u1", milestone_id="m", trace_id="t", worker_id="w1",
        lease_resource="r", fencing_token=1, status="claimed", attempt_n=1, max_attempts=1,
        claimed_at=0,
    ),
    "audit_events": dict(event_id="ae1", category="worker", type="x", ts=0, actor="a"),
    "kv": dict(scope="global", scope_id="", key="k1", value=b"v", updated_at=0, principal="p"),
    "events": dict(session_id="s1", kind="k", at=0, daemon_id="d1", principal="p"),
    "messages": dict(
        message_id="m1", session_id="s1", text="hi", status="queued", created_at=0,
        updated_at=0, daemon_id="d1", principal="p",
    ),
    "meta": dict(key="k", value="v"),
}  # fmt: skip


# --- the shape


def test_a_fresh_database_gets_sqlite_final_tables_and_columns(
    pg: psycopg.Connection[Any], lite: sqlite3.Connection
) -> None:
    """Every table of SQLite's final shape, every column with its type, NOT NULL and
    default; and nothing else but the declared PostgreSQL-only columns."""
    assert pg_schema.migrate(pg) == 0
    on_pg, on_lite = pg_columns(pg), sqlite_columns(lite)
    assert sorted(on_pg) == sorted(on_lite)
    common = {
        table: {name: c for name, c in columns.items() if name not in PG_ONLY.get(table, {})}
        for table, columns in on_pg.items()
    }
    assert common == on_lite
    extra = {
        table: {name: c for name, c in columns.items() if name not in on_lite[table]}
        for table, columns in on_pg.items()
    }
    assert {table: columns for table, columns in extra.items() if columns} == PG_ONLY


def test_the_shape_check_reads_the_ladder_right(pg: psycopg.Connection[Any]) -> None:
    """The expected shape parsed off MIGRATIONS is what migrating makes."""
    pg_schema.migrate(pg)
    assert pg_schema.shape_of(pg) == pg_schema.expected_shape()
    pg_schema.check_shape(pg)


def sqlite_indexes(conn: sqlite3.Connection) -> dict[str, dict[str, tuple[Any, ...]]]:
    """table -> index -> (unique, partial, columns) and trigger names as ``trigger NAME``."""
    found: dict[str, dict[str, tuple[Any, ...]]] = {}
    for (table,) in conn.execute(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'"
    ).fetchall():
        found[table] = {
            name: (bool(unique), bool(partial), [row[2] for row in conn.execute(
                f"PRAGMA index_info({name})")])
            for _, name, unique, _origin, partial in conn.execute(f"PRAGMA index_list({table})")
            if not name.startswith("sqlite_autoindex")
        }  # fmt: skip
        for (name,) in conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'trigger' AND tbl_name = ?", (table,)
        ):
            found[table][f"trigger {name}"] = ()
    return found


def pg_indexes(conn: psycopg.Connection[Any]) -> dict[str, dict[str, tuple[Any, ...]]]:
    found: dict[str, dict[str, tuple[Any, ...]]] = {}
    for (table,) in conn.execute(
        f"SELECT relname FROM pg_class c WHERE {_here('c.relnamespace')} AND relkind = 'r'"
    ).fetchall():
        found[table] = {}
    for table, name, unique, partial, columns in conn.execute(
        f"""SELECT t.relname, i.relname, x.indisunique, x.indpred IS NOT NULL,
                   array(SELECT a.attname FROM unnest(x.indkey) WITH ORDINALITY AS k(attnum, n)
                         JOIN pg_attribute a ON a.attrelid = x.indrelid AND a.attnum = k.attnum
                         ORDER BY k.n)
            FROM pg_index x JOIN pg_class i ON i.oid = x.indexrelid
            JOIN pg_class t ON t.oid = x.indrelid
            WHERE {_here("t.relnamespace")} AND NOT EXISTS (
                SELECT 1 FROM pg_constraint WHERE conindid = x.indexrelid)"""
    ):
        found[table][name] = (unique, partial, list(columns))
    for table, name in conn.execute(
        f"""SELECT c.relname, g.tgname FROM pg_trigger g JOIN pg_class c ON c.oid = g.tgrelid
            WHERE {_here("c.relnamespace")} AND NOT g.tgisinternal"""
    ):
        found[table][f"trigger {name}"] = ()
    return found


# The row id of each table that has one: SQLite's implicit rowid where the store's SQL
# names it, the identity key where SQLite's rowid is an INTEGER PRIMARY KEY.
ROW_IDS = {
    "sessions": ("rowid", "ALWAYS"),
    "idempotency": ("rowid", "ALWAYS"),
    "effects": ("rowid", "ALWAYS"),
    "messages": ("rowid", "ALWAYS"),
    "dispatches": ("dispatch_id", "BY DEFAULT"),
    "audit_events": ("seq", "BY DEFAULT"),
    "events": ("event_id", "BY DEFAULT"),
}


def test_the_row_ids_are_the_only_identities(pg: psycopg.Connection[Any]) -> None:
    pg_schema.migrate(pg)
    identities = pg.execute(
        """SELECT table_name, column_name, identity_generation FROM information_schema.columns
           WHERE table_schema = current_schema() AND is_identity = 'YES'"""
    ).fetchall()
    assert {table: (column, how) for table, column, how in identities} == ROW_IDS


def test_indexes_and_triggers_are_sqlites(
    pg: psycopg.Connection[Any], lite: sqlite3.Connection
) -> None:
    """Same names, uniqueness, partialness and columns, and the same trigger names.
    SQLite keys each index of a rowid table by (its columns, the row id), which the
    store's cursors and newest-first lookups use: here a non-unique index of a table
    with a row id ends in it."""
    pg_schema.migrate(pg)
    expected: dict[str, dict[str, tuple[Any, ...]]] = {}
    for table, entries in sqlite_indexes(lite).items():
        expected[table] = {}
        for name, spec in entries.items():
            if spec and not spec[0] and table in ROW_IDS:
                unique, partial, columns = spec
                spec = (unique, partial, [*columns, ROW_IDS[table][0]])
            expected[table][name] = spec
    assert pg_indexes(pg) == expected


@pytest.mark.parametrize(
    "setup, table, bad",
    [
        ([], "daemons", dict(owner_epoch=0)),
        ([], "sessions", dict(pinned=2)),
        ([], "sessions", dict(exited=None)),
        ([], "sessions", dict(live=2)),
        (
            [("sessions", dict(session_id="s1", agent_session_id="a1")),
             ("sessions", dict(session_id="s2", agent_session_id=None)),
             ("sessions", dict(session_id="s3", agent_session_id=None)),
             ("sessions", dict(session_id="s4", agent_session_id="a1", daemon_id="d2"))],
            "sessions", dict(session_id="s5", agent_session_id="a1"),
        ),
        ([], "idempotency", dict(state="done")),
        ([("idempotency", {})], "idempotency", {}),
        ([], "effects", dict(action_kind="ftp")),
        ([], "effects", dict(status="done")),
        ([], "workers", dict(status="zombie")),
        (
            [("workers", dict(worker_id="w1", ended_at=5)),
             ("workers", dict(worker_id="w2"))],
            "workers", dict(worker_id="w3"),
        ),
        ([], "dispatches", dict(status="running", ended_at=5)),
        ([], "dispatches", dict(status="completed")),
        ([], "dispatches", dict(attempt_n=0)),
        ([], "dispatches", dict(max_attempts=0)),
        (
            [("dispatches", dict(status="completed", ended_at=1)),
             ("dispatches", dict(status="running")),
             ("dispatches", dict(unit_id="u2"))],
            "dispatches", dict(status="claimed"),
        ),
        ([], "audit_events", dict(category="other")),
        ([("audit_events", {})], "audit_events", {}),
        ([], "kv", dict(scope="box")),
        ([], "events", dict(session_id=None, agent_session_id=None)),
        ([], "messages", dict(status="sent")),
        ([], "meta", dict(value=None)),
    ],
)  # fmt: skip
def test_constraints_refuse_what_sqlites_refuse(
    rolled_back: Both, setup: list[tuple[str, dict[str, Any]]], table: str, bad: dict[str, Any]
) -> None:
    """CHECKs, NOT NULLs, keys and partial unique indexes: the rows before are accepted
    by both databases, the last row is refused by both."""
    for name, values in setup:
        rolled_back.insert(name, **values)
    assert rolled_back.refusals(table, **bad) == (True, True)


def test_text_sorts_bytewise_as_in_sqlite_whatever_the_databases_collation(
    _schema_cluster: _Cluster, lite: sqlite3.Connection
) -> None:
    """In a database whose default collation is a language's (ICU en-US: 'a' < 'B'),
    text still orders and compares by bytes, as SQLite's BINARY does: kv lists and
    pages (``key > ?``) alike on both backends."""
    try:
        name = _schema_cluster.new_database(
            "TEMPLATE template0 LOCALE_PROVIDER icu ICU_LOCALE 'en-US'"
        )
    except psycopg.Error as exc:  # a server without ICU, or older than 15
        pytest.skip(f"no ICU database here: {exc}")
    database = _Database(_schema_cluster, name)
    try:
        pg = database.connect()
        assert pg.execute("SELECT 'a' < 'B', 'é' < 'f'").fetchone() == (True, True)
        pg_schema.migrate(pg)
        not_bytewise = pg.execute(
            """SELECT table_name, column_name, collation_name FROM information_schema.columns
               WHERE table_schema = current_schema() AND data_type = 'text'
               AND collation_name IS DISTINCT FROM 'C'"""
        ).fetchall()
        assert not_bytewise == []
        both = Both(lite, pg)
        keys = ["b", "B", "a", "_", "é", "f", "A", "Z"]
        for key in keys:
            both.insert("kv", key=key)
        listed = both.same("SELECT key FROM kv ORDER BY key")
        assert [key for (key,) in listed] == sorted(keys, key=str.encode)
        page = "SELECT key FROM kv WHERE scope = ? AND scope_id = ? AND key > ? ORDER BY key"
        assert both.same(page, ["global", "", "Z"]) == [("_",), ("a",), ("b",), ("f",), ("é",)]
    finally:
        database.close()


# --- the quota triggers

COUNTED = {  # table -> the column naming a row here, whether its principal may be NULL
    "idempotency": ("key", False),
    "kv": ("key", True),
    "messages": ("message_id", True),
    "events": ("kind", True),
    "effects": ("effect_key", False),
    "leases": ("resource", False),
    "lease_tokens": ("resource", True),
}


def test_every_counted_table_is_counted() -> None:
    assert set(COUNTED) == set(schema._COUNTED_IN_STEP_6) == set(pg_schema._COUNTED_IN_STEP_1)


@pytest.mark.parametrize("table", sorted(COUNTED))
def test_quota_usage_stays_exact_as_on_sqlite(rolled_back: Both, table: str) -> None:
    """Inserts, deletes (one row and many), changes of owner (to another, to the same,
    from and to NULL): quota_usage is what SQLite's triggers make of the same
    statements, and every count is the table's real count."""
    both = rolled_back
    marker, nullable = COUNTED[table]
    other = None if nullable else "c"
    for n, principal in enumerate(["a", "a", "b", "b", "c", other, other]):
        both.insert(table, **{marker: f"r{n}", "principal": principal})
    where = f"WHERE {marker} = ?"
    both.run(f"DELETE FROM {table} {where}", ["r0"])
    both.run(f"UPDATE {table} SET principal = 'b' {where}", ["r1"])
    both.run(f"UPDATE {table} SET principal = principal {where}", ["r2"])
    both.run(f"UPDATE {table} SET principal = 'a' {where}", ["r5"])
    if nullable:
        both.run(f"UPDATE {table} SET principal = NULL {where}", ["r4"])
    usage = f"SELECT principal, tbl, rows FROM quota_usage WHERE tbl = '{table}' ORDER BY 1"
    real = f"""SELECT principal, '{table}', count(*) FROM {table}
               WHERE principal IS NOT NULL GROUP BY principal ORDER BY 1"""
    middle = both.same(usage)
    assert [row for row in middle if row[2]] == both.same(real)
    assert ("a", table, 1) in middle and ("b", table, 3) in middle
    both.run(f"DELETE FROM {table} WHERE principal = 'b'")
    both.insert(table, **{marker: "r7", "principal": "a"})
    after = both.same(usage)
    assert [row for row in after if row[2]] == both.same(real)
    assert ("a", table, 2) in after and ("b", table, 0) in after


# --- the version gate


def test_a_second_migrate_changes_nothing(pg: psycopg.Connection[Any]) -> None:
    assert pg_schema.migrate(pg) == 0
    pg.execute("INSERT INTO lease_tokens (resource, last_token) VALUES ('r', 1)")
    before = state(pg)
    assert pg_schema.migrate(pg) == pg_schema.SCHEMA_VERSION
    assert state(pg) == before
    assert pg.execute("SELECT key, value FROM meta ORDER BY key").fetchall() == [
        ("application", "towerd"),
        ("schema_version", str(pg_schema.SCHEMA_VERSION)),
    ]


def test_a_newer_database_is_refused_naming_both_versions_and_untouched(
    pg: psycopg.Connection[Any],
) -> None:
    pg_schema.migrate(pg)
    newer = pg_schema.SCHEMA_VERSION + 1
    pg.execute("UPDATE meta SET value = %s WHERE key = 'schema_version'", (str(newer),))
    before = state(pg)
    with pytest.raises(StartRefused) as refused:
        pg_schema.migrate(pg)
    assert f"version {newer} is newer" in str(refused.value)
    assert f"schema version {pg_schema.SCHEMA_VERSION})" in str(refused.value)
    assert state(pg) == before


TOWERD_META = "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)"


@pytest.mark.parametrize(
    "setup, words",
    [
        (["CREATE TABLE intruder (x int)", "INSERT INTO intruder VALUES (1)"], "not a towerd"),
        (["CREATE VIEW intruder AS SELECT 1 AS x"], "not a towerd"),
        ([TOWERD_META], "not a towerd"),
        (["CREATE TABLE meta (name TEXT)", "INSERT INTO meta VALUES ('x')"], "not a towerd"),
        (
            [
                TOWERD_META,
                "INSERT INTO meta VALUES ('application', 'other'), ('schema_version', '1')",
            ],
            "not a towerd",
        ),
        ([TOWERD_META, "INSERT INTO meta VALUES ('application', 'towerd')"], "no readable"),
    ],
    ids=["table", "view", "empty-meta", "foreign-meta", "other-application", "no-version"],
)
def test_a_database_that_is_not_towerds_is_refused_untouched(
    pg: psycopg.Connection[Any], setup: list[str], words: str
) -> None:
    for statement in setup:
        pg.execute(statement)
    before = state(pg)
    with pytest.raises(StartRefused, match=words):
        pg_schema.migrate(pg)
    assert state(pg) == before


def test_only_the_current_schema_counts(fresh: _Database) -> None:
    """Tables elsewhere do not make a schema foreign; each schema named first on the
    search_path gets its own towerd tables (nothing is written to public)."""
    admin = fresh.connect()
    admin.execute("CREATE SCHEMA box_a")
    admin.execute("CREATE TABLE public.intruder (x int)")
    in_a = fresh.connect(options="-c search_path=box_a")
    assert pg_schema.migrate(in_a) == 0
    pg_schema.check_shape(in_a)
    assert admin.execute(
        "SELECT relname FROM pg_class WHERE relnamespace = 'public'::regnamespace"
    ).fetchall() == [("intruder",)]
    with pytest.raises(StartRefused, match="intruder"):
        pg_schema.migrate(admin)


@pytest.mark.parametrize("isolation", ["read committed", "repeatable read", "serializable"])
def test_daemons_starting_together_migrate_once(fresh: _Database, isolation: str) -> None:
    """Four connections migrate one fresh database at once, whatever the server's
    default isolation: one climbs from 0, each step is taken once, none fails."""
    default = isolation.replace(" ", "\\ ")
    conns = [fresh.connect(options=f"-c default_transaction_isolation={default}") for _ in range(4)]
    start = threading.Barrier(len(conns))
    found: list[int] = []
    errors: list[BaseException] = []

    def start_daemon(conn: psycopg.Connection[Any]) -> None:
        start.wait()
        try:
            found.append(pg_schema.migrate(conn))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=start_daemon, args=(conn,)) for conn in conns]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)  # a guard against a hang, not synchronisation
    assert not any(thread.is_alive() for thread in threads)
    assert errors == []
    # One climbed from 0; the others found the top, or a step the first had taken and
    # took the next themselves: a step run twice would have failed (its ALTER TABLE).
    assert sorted(found)[0] == 0 and 0 not in sorted(found)[1:]
    assert all(0 < version <= pg_schema.SCHEMA_VERSION for version in sorted(found)[1:])
    pg_schema.check_shape(conns[0])


@pytest.mark.parametrize(
    "tamper, words",
    [
        ("DROP TRIGGER quota_kv_owner ON kv", "trigger quota_kv_owner"),
        ("DROP INDEX effects_by_run", "effects_by_run"),
        ("ALTER TABLE messages ADD COLUMN extra TEXT", "extra"),
        ("ALTER TABLE daemons DROP COLUMN dead_at", "dead_at"),
        ("ALTER TABLE daemons ALTER COLUMN pid TYPE integer", "'integer'"),
        ("CREATE TABLE intruder (x int)", "unexpected table intruder"),
        ("DROP TABLE operator_log", "table operator_log is missing"),
    ],
)
def test_a_misshapen_database_is_refused(
    pg: psycopg.Connection[Any], tamper: str, words: str
) -> None:
    pg_schema.migrate(pg)
    pg.execute(tamper)
    with pytest.raises(StartRefused) as refused:
        pg_schema.check_shape(pg)
    assert words in str(refused.value)


# --- what an operator adds beside towerd's tables

# An extension of the Debian server package (contrib): it puts two views and a few
# functions into the schema it is installed in, which is towerd's when the operator
# installs it in towerd's database.
EXTENSION = "pg_stat_statements"
NEWER = pg_schema.SCHEMA_VERSION + 1


def _installed(fresh: _Database) -> None:
    """``CREATE EXTENSION`` as an operator runs it (the superuser: it is not trusted),
    into the database's public schema, where towerd keeps its tables."""
    with fresh.cluster.connect(fresh.name, user="postgres") as admin:
        admin.execute(f"CREATE EXTENSION {EXTENSION}")


def test_an_extension_and_views_beside_towerds_tables_do_not_refuse_the_start(
    fresh: _Database,
) -> None:
    """information_schema.columns lists views too: an extension installed into towerd's
    database made every start refused as "unexpected table pg_stat_statements"."""
    pg = fresh.connect()
    assert pg_schema.migrate(pg) == 0
    _installed(fresh)
    pg.execute("CREATE VIEW my_fleet AS SELECT session_id, cwd FROM sessions")
    pg.execute("CREATE MATERIALIZED VIEW my_keys AS SELECT key FROM idempotency")
    kinds = dict(pg.execute(
        "SELECT relname, relkind::text FROM pg_class "
        "WHERE relnamespace = 'public'::regnamespace AND relkind IN ('v', 'm')"
    ).fetchall())  # fmt: skip
    assert kinds == {"pg_stat_statements": "v", "pg_stat_statements_info": "v",
                     "my_fleet": "v", "my_keys": "m"}  # fmt: skip
    assert pg_schema.migrate(pg) == pg_schema.SCHEMA_VERSION  # the start: no refusal
    pg_schema.check_shape(pg)
    assert pg_schema.shape_of(pg) == pg_schema.expected_shape()


def test_an_extension_installed_before_the_first_start_leaves_the_database_empty(
    fresh: _Database,
) -> None:
    """A fresh database holding only an extension's objects is towerd's to climb (it was
    refused as "not a towerd database")."""
    _installed(fresh)
    pg = fresh.connect()
    assert pg_schema.found_version(pg) == 0
    assert pg_schema.migrate(pg) == 0
    pg_schema.check_shape(pg)


@pytest.mark.parametrize(
    "tamper, words",
    [
        ("ALTER TABLE messages ADD COLUMN extra TEXT", "extra"),
        ("CREATE TABLE intruder (x int)", "unexpected table intruder"),
        ("CREATE INDEX mine ON sessions (cwd)", "mine"),
        (f"UPDATE meta SET value = '{NEWER}' WHERE key = 'schema_version'", "is newer"),
        ("DELETE FROM meta WHERE key = 'application'", "not a towerd"),
    ],
    ids=["column", "table", "index", "newer", "foreign"],
)
def test_beside_an_extension_a_misshapen_newer_or_foreign_database_is_still_refused(
    fresh: _Database, tamper: str, words: str
) -> None:
    pg = fresh.connect()
    pg_schema.migrate(pg)
    _installed(fresh)
    pg.execute("CREATE VIEW my_fleet AS SELECT session_id FROM sessions")
    pg.execute(tamper)
    with pytest.raises(StartRefused, match=words):
        pg_schema.migrate(pg)
        pg_schema.check_shape(pg)


# --- identities and rowid


@pytest.mark.parametrize(
    "table, key",
    [("events", "event_id"), ("dispatches", "dispatch_id"), ("audit_events", "seq")],
)
def test_identity_keys_count_up_and_never_return(both: Both, table: str, key: str) -> None:
    """The store's INSERTs omit the key (and read it back with RETURNING); as with
    AUTOINCREMENT, a deleted newest id is never issued again."""
    column = {"events": "kind", "dispatches": "unit_id", "audit_events": "event_id"}[table]
    issued = []
    for n in range(4):
        if n == 3:
            both.same(f"DELETE FROM {table} WHERE {key} = 3")
        issued += both.same(*insert_of(table, {column: f"x{n}"}, returning=f"RETURNING {key}"))
    assert issued == [(1,), (2,), (3,), (4,)]


@pytest.mark.parametrize(
    "table, key", [("sessions", "session_id"), ("idempotency", "key"), ("effects", "effect_key"),
                   ("messages", "message_id")],
)  # fmt: skip
def test_rowid_orders_rows_as_inserted(both: Both, table: str, key: str) -> None:
    """rowid is the insertion order, kept through an update, as SQLite's rowid."""
    for name in ["m", "z", "a"]:
        both.insert(table, **{key: name})
    both.run(f"UPDATE {table} SET daemon_id = 'd2' WHERE {key} = 'z'")
    assert both.same(f"SELECT {key}, rowid FROM {table} ORDER BY rowid") == [
        ("m", 1),
        ("z", 2),
        ("a", 3),
    ]


def test_the_stores_rowid_statements_run_alike(both: Both) -> None:
    """The statements of daemon/store that use rowid, on both databases."""
    for name in ["s-c", "s-a", "s-b", "s-d"]:
        both.insert("sessions", session_id=name)
    page = """SELECT rowid, session_id FROM sessions
              WHERE daemon_id = ? AND rowid > ? ORDER BY rowid LIMIT ?"""  # fleet.list_sessions
    first = both.same(page, ["d1", 0, 3])
    assert [row[1] for row in first] == ["s-c", "s-a", "s-b"]
    assert both.same(page, ["d1", first[-1][0], 3]) == [(4, "s-d")]

    for name in ["k2", "k1"]:
        both.insert("idempotency", key=name, state="outcome_unknown", probe="true")
    keys = both.same(  # idempotency.keys_to_probe, then a probe's update by rowid
        """SELECT rowid, principal, operation, key FROM idempotency
           WHERE state = 'outcome_unknown' AND probe IS NOT NULL
           AND (? = 0 OR probe_next_at IS NULL OR probe_next_at <= ?) ORDER BY rowid""",
        [1, 5],
    )
    assert [row[3] for row in keys] == ["k2", "k1"]
    both.same(
        "UPDATE idempotency SET probe_attempts = ?, probe_at = ? WHERE rowid = ? RETURNING key",
        [1, 5, keys[1][0]],
    )
    assert both.same("SELECT key, probe_attempts FROM idempotency ORDER BY rowid") == [
        ("k2", 0),
        ("k1", 1),
    ]

    for n, status in enumerate(["committed", "in_flight", "failed", "committed"]):
        both.insert("effects", effect_key=f"e{n}", status=status, completed_at=n)
    both.same(  # effects.prune_settled
        """DELETE FROM effects WHERE rowid IN (
               SELECT rowid FROM effects
               WHERE status IN ('committed', 'failed', 'aborted') AND completed_at < ?
               LIMIT ?)""",
        [3, 10],
    )
    assert both.same("SELECT effect_key FROM effects WHERE run_id = ? ORDER BY rowid", ["run"]) == [
        ("e1",),
        ("e3",),
    ]

    for name in ["m2", "m1", "m3"]:
        both.insert("messages", message_id=name, created_at=7)
    assert both.same(
        "SELECT message_id FROM messages WHERE session_id = ? ORDER BY created_at, rowid LIMIT ?",
        ["s1", 10],
    ) == [("m2",), ("m1",), ("m3",)]
    both.same(  # messages.prune
        """DELETE FROM messages WHERE rowid IN (
               SELECT rowid FROM messages WHERE created_at < ? ORDER BY created_at LIMIT ?)""",
        [8, 2],
    )
    assert len(both.same("SELECT message_id FROM messages")) == 1
