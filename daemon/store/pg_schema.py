"""The schema ladder of the PostgreSQL backend, and its open contract.

One ladder per backend, one shape: the store's SQL runs unchanged on both (through
daemon/store/pg.py), so every table, column, constraint, index and trigger here is
the one daemon/store/schema.py makes in SQLite, in PostgreSQL's words. SQLite's
ladder is history (files of every age); this one starts where SQLite's ends: its
step 1 is SQLite's step 9. A later change is a new step on *both* ladders
(tests/store/test_pg_schema.py compares them).

The translation, once: INTEGER is BIGINT (an integer boolean stays an integer with
its ``CHECK (x IN (0, 1))``), BLOB is BYTEA, TEXT is TEXT in the bytewise collation
"C" (SQLite's BINARY), an AUTOINCREMENT key is an identity. SQLite gives a table
without an integer key a hidden ``rowid``; each table whose rowid the store's SQL
names (to page, order or address rows) has an explicit ``rowid`` identity column
here, declared last so that ``SELECT *`` starts with SQLite's columns. SQLite keys
every index by (its columns, the row's id), which cursors and
"newest first" lookups rely on; so the non-unique indexes of tables with a row id
end in it here (``rowid``, or the identity key). PostgreSQL has no ``user_version``
or ``application_id``: ``meta`` holds ``schema_version`` and ``application``.

A database this code does not recognise is refused before anything is written: one
stamped with a newer version, one with tables but no towerd stamp, one whose tables
do not have the shape the ladder makes (:func:`check_shape`). What an operator adds
beside towerd's tables is not towerd's to judge: an extension's objects
(``CREATE EXTENSION pg_stat_statements`` puts views into the schema it is installed
in), and views, which store nothing, are left out of both checks once the schema is
towerd's; a schema holding anything but an extension's objects is someone else's
until it has towerd's stamp.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

import psycopg

from towerd.daemon.private_paths import StartRefused

SCHEMA_VERSION = 3
MIGRATE_LOCK = 0x746F_7764_004D  # "towd" "M": held (per transaction) while migrating
APPLICATION = "towerd"  # meta 'application': this database is towerd's

# The tables counted per principal in quota_usage (daemon/store/quota.py), as in
# SQLite's step 6: a new counted table is a new step, not an edit of this tuple.
_COUNTED_IN_STEP_1 = (
    "idempotency",
    "kv",
    "messages",
    "events",
    "effects",
    "leases",
    "lease_tokens",
)

# One trigger function for every counted table (its name is the trigger's argument);
# the same effect as SQLite's three triggers per table. A row whose principal is NULL
# counts for nobody.
_QUOTA_FUNCTION = """CREATE FUNCTION quota_count() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP IN ('DELETE', 'UPDATE') THEN
        UPDATE quota_usage SET rows = rows - 1
        WHERE principal = OLD.principal AND tbl = TG_ARGV[0];
    END IF;
    IF TG_OP IN ('INSERT', 'UPDATE') AND NEW.principal IS NOT NULL THEN
        INSERT INTO quota_usage (principal, tbl, rows) VALUES (NEW.principal, TG_ARGV[0], 1)
        ON CONFLICT (principal, tbl) DO UPDATE SET rows = quota_usage.rows + 1;
    END IF;
    RETURN NULL;
END
$$"""


def _counter_triggers(table: str) -> tuple[str, ...]:
    """Triggers keeping ``quota_usage`` exact for ``table`` whatever deletes or moves a row."""
    count = f"FOR EACH ROW EXECUTE FUNCTION quota_count('{table}')"
    return (
        f"CREATE TRIGGER quota_{table}_insert AFTER INSERT ON {table} {count}",
        f"CREATE TRIGGER quota_{table}_delete AFTER DELETE ON {table} {count}",
        f"""CREATE TRIGGER quota_{table}_owner AFTER UPDATE OF principal ON {table}
            FOR EACH ROW WHEN (OLD.principal IS DISTINCT FROM NEW.principal)
            EXECUTE FUNCTION quota_count('{table}')""",
    )


@dataclass(frozen=True)
class Migration:
    version: int
    summary: str
    statements: tuple[str, ...]


def _bytewise(statements: tuple[str, ...]) -> tuple[str, ...]:
    """Each TEXT column of a CREATE or ALTER TABLE as ``TEXT COLLATE "C"``: SQLite compares and
    sorts text by its bytes (BINARY) whatever the locale, and so does "C", where the
    database's default collation may be a language's (``ORDER BY key``, ``key > ?``)."""
    return tuple(
        re.sub(r"\bTEXT\b", 'TEXT COLLATE "C"', statement)
        if statement.startswith(("CREATE TABLE", "ALTER TABLE"))
        else statement
        for statement in statements
    )


_AS_WRITTEN = (
    Migration(
        1,
        "SQLite's schema version 9: the daemon identity, fleet, idempotency keys, leases, "
        "effects, workers, dispatches, audit, soft state, hook events, messages, quotas",
        (
            """CREATE TABLE meta (
                key TEXT PRIMARY KEY,
                value TEXT NOT NULL
            )""",
            f"INSERT INTO meta (key, value) VALUES ('application', '{APPLICATION}')",
            # presence_at: the server's clock (ms) at the daemon's last heartbeat;
            # dead_at: when a live daemon declared this one's box dead (NULL: alive).
            """CREATE TABLE daemons (
                daemon_id TEXT PRIMARY KEY,
                owner_epoch BIGINT NOT NULL CHECK (owner_epoch >= 1),
                pid BIGINT NOT NULL,
                host TEXT NOT NULL,
                started_at BIGINT NOT NULL,
                presence_at BIGINT NOT NULL DEFAULT 0,
                dead_at BIGINT
            )""",
            # rowid: list pages (cursor = last rowid) and stored order.
            """CREATE TABLE sessions (
                session_id TEXT PRIMARY KEY,
                agent_session_id TEXT,
                name TEXT,
                cwd TEXT NOT NULL,
                agent TEXT NOT NULL,
                pinned BIGINT NOT NULL DEFAULT 0 CHECK (pinned IN (0, 1)),
                last_attached_at BIGINT,
                exited BIGINT NOT NULL DEFAULT 0 CHECK (exited IN (0, 1)),
                parent TEXT,
                prompt TEXT,
                result TEXT,
                transcript_path TEXT,
                model TEXT,
                effort TEXT,
                target TEXT,
                target_identity TEXT,
                daemon_id TEXT NOT NULL,
                owner_epoch BIGINT NOT NULL,
                updated_at BIGINT NOT NULL,
                agent_pid BIGINT,
                agent_start BIGINT,
                agent_named_at BIGINT,
                live BIGINT CHECK (live IN (0, 1)),
                rowid BIGINT GENERATED ALWAYS AS IDENTITY UNIQUE
            )""",
            "CREATE INDEX sessions_by_daemon ON sessions (daemon_id, rowid)",
            """CREATE INDEX sessions_by_parent ON sessions (parent, rowid)
               WHERE parent IS NOT NULL""",
            """CREATE UNIQUE INDEX sessions_by_agent_session
                ON sessions (daemon_id, agent_session_id) WHERE agent_session_id IS NOT NULL""",
            """CREATE INDEX sessions_by_agent_process
               ON sessions (agent_pid, agent_start, rowid) WHERE agent_pid IS NOT NULL""",
            "CREATE INDEX sessions_live ON sessions (live, rowid) WHERE live = 1",
            # rowid: list pages, probe order, and a probed key's handle.
            """CREATE TABLE idempotency (
                principal TEXT NOT NULL,
                operation TEXT NOT NULL,
                key TEXT NOT NULL,
                payload_hash BYTEA NOT NULL,
                state TEXT NOT NULL
                    CHECK (state IN ('in_progress', 'completed', 'outcome_unknown')),
                effect_ref TEXT NOT NULL,
                result BYTEA,
                holder_pid BIGINT,
                holder_start BIGINT,
                attempt TEXT,
                daemon_id TEXT NOT NULL,
                created_at BIGINT NOT NULL,
                updated_at BIGINT NOT NULL,
                probe TEXT,
                probe_cwd TEXT,
                probe_attempts BIGINT NOT NULL DEFAULT 0,
                probe_at BIGINT,
                probe_next_at BIGINT,
                probe_verdict TEXT,
                PRIMARY KEY (principal, operation, key),
                rowid BIGINT GENERATED ALWAYS AS IDENTITY UNIQUE
            )""",
            "CREATE INDEX idempotency_by_state ON idempotency (state, updated_at, rowid)",
            "CREATE INDEX idempotency_by_principal ON idempotency (principal, rowid)",
            """CREATE INDEX idempotency_by_principal_state
               ON idempotency (principal, state, rowid)""",
            """CREATE TABLE operator_log (
                at BIGINT NOT NULL,
                daemon_id TEXT NOT NULL,
                principal TEXT NOT NULL,
                action TEXT NOT NULL,
                detail TEXT NOT NULL
            )""",
            """CREATE TABLE leases (
                resource TEXT PRIMARY KEY,
                fencing_token BIGINT NOT NULL,
                principal TEXT NOT NULL,
                holder_pid BIGINT,
                holder_start BIGINT,
                acquired_at BIGINT NOT NULL,
                renewed_at BIGINT NOT NULL,
                expires_at BIGINT NOT NULL,
                daemon_id TEXT NOT NULL,
                session_id TEXT
            )""",
            """CREATE INDEX leases_by_session ON leases (session_id)
               WHERE session_id IS NOT NULL""",
            """CREATE TABLE lease_tokens (
                resource TEXT PRIMARY KEY,
                last_token BIGINT NOT NULL,
                principal TEXT
            )""",
            # rowid: a run's effects in claim order, and pruning by rowid.
            """CREATE TABLE effects (
                effect_key TEXT PRIMARY KEY,
                run_id TEXT NOT NULL,
                step_id TEXT NOT NULL,
                attempt_id TEXT NOT NULL,
                action_kind TEXT NOT NULL CHECK (action_kind IN ('git-branch', 'git-commit',
                    'git-push', 'pr-create', 'tracker-issue', 'webhook')),
                target_ref TEXT NOT NULL,
                status TEXT NOT NULL CHECK (status IN ('in_flight', 'committed', 'failed',
                    'aborted', 'uncertain')),
                payload_hash BYTEA NOT NULL,
                receipt BYTEA,
                principal TEXT NOT NULL,
                holder_pid BIGINT,
                holder_start BIGINT,
                timeout_ms BIGINT NOT NULL,
                claimed_at BIGINT NOT NULL,
                heartbeat_at BIGINT NOT NULL,
                completed_at BIGINT,
                lease_resource TEXT,
                fencing_token BIGINT,
                daemon_id TEXT NOT NULL,
                git_target BYTEA,
                probe_attempts BIGINT NOT NULL DEFAULT 0,
                probe_at BIGINT,
                probe_next_at BIGINT,
                probe_verdict TEXT,
                probe_evidence BYTEA,
                rowid BIGINT GENERATED ALWAYS AS IDENTITY UNIQUE
            )""",
            "CREATE INDEX effects_by_run ON effects (run_id, rowid)",
            """CREATE INDEX effects_in_flight ON effects (status, rowid)
               WHERE status = 'in_flight'""",
            """CREATE INDEX effects_settled ON effects (completed_at, rowid)
               WHERE status IN ('committed', 'failed', 'aborted')""",
            """CREATE INDEX effects_uncertain ON effects (status, rowid)
               WHERE status = 'uncertain'""",
            """CREATE TABLE workers (
                worker_id TEXT PRIMARY KEY,
                principal TEXT NOT NULL,
                host TEXT NOT NULL,
                pid BIGINT NOT NULL,
                process_start BIGINT NOT NULL,
                version TEXT,
                project_root TEXT NOT NULL,
                status TEXT NOT NULL CHECK (status IN ('active', 'stopping', 'crashed')),
                registered_at BIGINT NOT NULL,
                heartbeat_at BIGINT NOT NULL,
                ended_at BIGINT,
                end_reason TEXT,
                daemon_id TEXT NOT NULL
            )""",
            # One live worker per process: a retried register answers the same worker.
            """CREATE UNIQUE INDEX workers_live_per_process ON workers (pid, process_start)
               WHERE ended_at IS NULL""",
            "CREATE INDEX workers_by_project ON workers (project_root)",
            # An identity, as AUTOINCREMENT: a pruned dispatch's id never names a new one.
            """CREATE TABLE dispatches (
                dispatch_id BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
                unit_type TEXT NOT NULL,
                unit_id TEXT NOT NULL,
                milestone_id TEXT NOT NULL,
                slice_id TEXT,
                task_id TEXT,
                trace_id TEXT NOT NULL,
                turn_id TEXT,
                worker_id TEXT NOT NULL,
                lease_resource TEXT NOT NULL,
                fencing_token BIGINT NOT NULL,
                status TEXT NOT NULL CHECK (status IN ('claimed', 'running', 'completed',
                    'failed', 'stuck', 'canceled', 'paused')),
                attempt_n BIGINT NOT NULL CHECK (attempt_n >= 1),
                max_attempts BIGINT NOT NULL CHECK (max_attempts >= 1),
                claimed_at BIGINT NOT NULL,
                started_at BIGINT,
                ended_at BIGINT,
                exit_reason TEXT,
                error_code TEXT,
                error_summary TEXT,
                retry_after_ms BIGINT,
                next_run_at BIGINT,
                CHECK ((status IN ('claimed', 'running')) = (ended_at IS NULL))
            )""",
            # At most one active dispatch per unit, enforced by the database itself.
            """CREATE UNIQUE INDEX dispatches_active_per_unit ON dispatches (unit_type, unit_id)
               WHERE status IN ('claimed', 'running')""",
            "CREATE INDEX dispatches_by_unit ON dispatches (unit_type, unit_id, dispatch_id)",
            "CREATE INDEX dispatches_by_worker ON dispatches (worker_id, dispatch_id)",
            """CREATE INDEX dispatches_by_milestone
               ON dispatches (milestone_id, status, dispatch_id)""",
            """CREATE INDEX dispatches_settled ON dispatches (ended_at, dispatch_id)
               WHERE ended_at IS NOT NULL""",
            """CREATE TABLE audit_events (
                seq BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
                event_id TEXT NOT NULL UNIQUE,
                trace_id TEXT,
                turn_id TEXT,
                caused_by TEXT,
                category TEXT NOT NULL CHECK (category IN ('worker', 'lease', 'dispatch')),
                type TEXT NOT NULL,
                ts BIGINT NOT NULL,
                actor TEXT NOT NULL,
                payload BYTEA
            )""",
            "CREATE INDEX audit_by_ts ON audit_events (ts, seq)",
            "CREATE INDEX audit_by_trace ON audit_events (trace_id, seq)",
            """CREATE TABLE kv (
                scope TEXT NOT NULL CHECK (scope IN ('global', 'worker', 'milestone')),
                scope_id TEXT NOT NULL,
                key TEXT NOT NULL,
                value BYTEA NOT NULL,
                updated_at BIGINT NOT NULL,
                principal TEXT,
                PRIMARY KEY (scope, scope_id, key)
            )""",
            # An identity: ids are cursors (``before``); pruning must never let one return.
            """CREATE TABLE events (
                event_id BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
                session_id TEXT,
                agent_session_id TEXT,
                kind TEXT NOT NULL,
                at BIGINT NOT NULL,
                payload BYTEA,
                daemon_id TEXT NOT NULL,
                principal TEXT,
                CHECK (session_id IS NOT NULL OR agent_session_id IS NOT NULL)
            )""",
            """CREATE INDEX events_by_session ON events (session_id, event_id)
               WHERE session_id IS NOT NULL""",
            """CREATE INDEX events_by_agent_session ON events (agent_session_id, event_id)
               WHERE agent_session_id IS NOT NULL""",
            "CREATE INDEX events_by_at ON events (at, event_id)",
            # rowid: listing order among messages sent in the same millisecond; pruning.
            """CREATE TABLE messages (
                message_id TEXT PRIMARY KEY,
                session_id TEXT NOT NULL,
                agent_session_id TEXT,
                text TEXT NOT NULL,
                status TEXT NOT NULL CHECK (status IN ('queued', 'delivered', 'read')),
                created_at BIGINT NOT NULL,
                updated_at BIGINT NOT NULL,
                daemon_id TEXT NOT NULL,
                principal TEXT,
                rowid BIGINT GENERATED ALWAYS AS IDENTITY UNIQUE
            )""",
            "CREATE INDEX messages_by_session ON messages (session_id, created_at, rowid)",
            "CREATE INDEX messages_by_created ON messages (created_at, rowid)",
            """CREATE TABLE quota_usage (
                principal TEXT NOT NULL,
                tbl TEXT NOT NULL,
                rows BIGINT NOT NULL,
                PRIMARY KEY (principal, tbl)
            )""",
            _QUOTA_FUNCTION,
            *(trigger for table in _COUNTED_IN_STEP_1 for trigger in _counter_triggers(table)),
        ),
    ),
    Migration(
        2,
        "hook events filed once: the key a queued hook event is filed under",
        (
            # As SQLite's step 10: minted before a hook event's first write, kept with it in
            # the outbox; a second write under the same key files nothing.
            "ALTER TABLE events ADD COLUMN filing_key TEXT",
            """CREATE UNIQUE INDEX events_by_filing_key ON events (filing_key)
               WHERE filing_key IS NOT NULL""",
        ),
    ),
    Migration(
        3,
        "every agent process of a session: two processes may report one session",
        (
            # As SQLite's step 11: each agent process a session's hooks came from.
            """CREATE TABLE session_agents (
                session_id TEXT NOT NULL,
                pid BIGINT NOT NULL,
                start BIGINT NOT NULL,
                named_at BIGINT NOT NULL,
                PRIMARY KEY (session_id, pid, start)
            )""",
            "CREATE INDEX session_agents_by_process ON session_agents (pid, start)",
            """INSERT INTO session_agents (session_id, pid, start, named_at)
               SELECT session_id, agent_pid, agent_start, COALESCE(agent_named_at, 0)
               FROM sessions WHERE agent_pid IS NOT NULL AND agent_start IS NOT NULL""",
        ),
    ),
)

# The ladder as it runs: text compares bytewise, as in SQLite (_bytewise).
MIGRATIONS: tuple[Migration, ...] = tuple(
    replace(step, statements=_bytewise(step.statements)) for step in _AS_WRITTEN
)

assert [m.version for m in MIGRATIONS] == list(range(1, SCHEMA_VERSION + 1))


# --- the version gate and the climb


def migrate(conn: psycopg.Connection[Any]) -> int:
    """Bring the database to SCHEMA_VERSION; return the version found before.

    ``conn`` is in autocommit mode. Each step is one transaction holding the advisory
    lock :data:`MIGRATE_LOCK`, in which the version is read again: daemons starting
    together against a fresh database climb it once (the others find the new version).
    A newer or foreign database is refused before anything is written.
    """
    found: int | None = None
    while True:
        with conn.transaction():
            # READ COMMITTED whatever the server's default: each statement sees what a
            # daemon that held the lock before us committed.
            conn.execute("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATE_LOCK,))
            version = found_version(conn)
            found = version if found is None else found
            if version >= SCHEMA_VERSION:
                return found
            migration = MIGRATIONS[version]
            for statement in migration.statements:
                conn.execute(statement)
            conn.execute(
                "INSERT INTO meta (key, value) VALUES ('schema_version', %s) "
                "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                (str(migration.version),),
            )


# A relation ``c`` (of pg_class) that no extension installed: an extension's objects are
# the extension's, wherever CREATE EXTENSION put them (they go away with DROP EXTENSION).
_NOT_OF_AN_EXTENSION = """NOT EXISTS (
    SELECT 1 FROM pg_depend d
    WHERE d.classid = 'pg_class'::regclass AND d.objid = c.oid AND d.deptype = 'e')"""

# towerd's candidates in the current schema: its base tables (plain or partitioned) that
# no extension installed. Views, materialized views, foreign tables and every object of
# an extension are an operator's additions: they hold none of towerd's rows.
_OWN_TABLES = f"""SELECT c.oid, c.relname FROM pg_class c
    WHERE c.relnamespace = (SELECT oid FROM pg_namespace WHERE nspname = current_schema())
      AND c.relkind IN ('r', 'p') AND {_NOT_OF_AN_EXTENSION}"""


def found_version(conn: psycopg.Connection[Any]) -> int:
    """The schema version of the connection's current schema (0: no tables at all).

    Reads only; refuses a schema that is not towerd's or is newer than this code."""
    schema = conn.execute("SELECT current_schema()").fetchone()
    if schema is None or schema[0] is None:
        search_path = conn.execute("SHOW search_path").fetchone()
        raise StartRefused(
            f"PostgreSQL: no schema to keep towerd's tables in (search_path "
            f"{search_path[0] if search_path else '?'} names none that exists)"
        )
    where = f"PostgreSQL schema {schema[0]}"
    tables = [
        row[0]
        for row in conn.execute(
            f"""SELECT relname FROM pg_class c
               WHERE relnamespace = (SELECT oid FROM pg_namespace WHERE nspname = current_schema())
                 AND relkind IN ('r', 'p', 'v', 'm', 'f') AND {_NOT_OF_AN_EXTENSION}"""
        )
    ]
    if not tables:
        return 0
    foreign = StartRefused(
        f"{where}: not a towerd database (no towerd stamp in meta, tables {sorted(tables)}); "
        "point towerd at an empty database or schema"
    )
    if "meta" not in tables:
        raise foreign
    try:
        stamp = dict(
            conn.execute(
                "SELECT key, value FROM meta WHERE key IN ('application', 'schema_version')"
            ).fetchall()
        )
    except psycopg.errors.UndefinedColumn:  # someone else's meta table
        raise foreign from None
    if stamp.get("application") != APPLICATION:
        raise foreign
    try:
        version = int(stamp["schema_version"])
    except (KeyError, ValueError):
        raise StartRefused(
            f"{where}: towerd's meta table has no readable schema_version "
            f"({stamp.get('schema_version')!r})"
        ) from None
    if version > SCHEMA_VERSION:
        raise StartRefused(
            f"{where}: database schema version {version} is newer than this towerd "
            f"supports (schema version {SCHEMA_VERSION}); upgrade towerd, or restore a backup "
            "made for this version"
        )
    return version


# --- the shape check

Columns = tuple[tuple[str, str], ...]  # (name, type) in column order
Shape = dict[str, tuple[Columns, frozenset[str]]]  # table -> columns, indexes and triggers

_CREATE_TABLE = re.compile(r"CREATE TABLE (\w+) \((.*)\)\s*$", re.S)
_ADD_COLUMN = re.compile(r"ALTER TABLE (\w+) ADD COLUMN (.*)", re.S)
_CREATE_INDEX = re.compile(r"CREATE (?:UNIQUE )?INDEX (\w+)\s+ON (\w+)", re.S)
_CREATE_TRIGGER = re.compile(r"CREATE TRIGGER (\w+)\s.*?\sON (\w+)\s", re.S)
_COLUMN = re.compile(r"(\w+) (DOUBLE PRECISION|\w+)")
_CONSTRAINTS = ("PRIMARY KEY", "UNIQUE", "CHECK", "CONSTRAINT", "FOREIGN KEY", "EXCLUDE")


def _column(item: str) -> tuple[str, str]:
    """(name, type) of a column definition, the type as information_schema names it."""
    found = _COLUMN.match(item)
    assert found is not None, item
    return found[1], found[2].lower()


def _items(body: str) -> list[str]:
    """The comma-separated items of a CREATE TABLE body (commas inside parentheses kept)."""
    items, depth, start = [], 0, 0
    for at, char in enumerate(body):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            items.append(body[start:at].strip())
            start = at + 1
    items.append(body[start:].strip())
    return items


def expected_shape(version: int | None = None) -> Shape:
    """The shape the ladder makes up to ``version`` (default: the newest), read off its
    statements: the column lists are written once, in MIGRATIONS."""
    version = SCHEMA_VERSION if version is None else version
    columns: dict[str, list[tuple[str, str]]] = {}
    names: dict[str, set[str]] = {}
    for migration in MIGRATIONS[:version]:
        for statement in migration.statements:
            if table := _CREATE_TABLE.match(statement):
                columns[table[1]] = [
                    _column(item) for item in _items(table[2]) if not item.startswith(_CONSTRAINTS)
                ]
                names[table[1]] = set()
            elif added := _ADD_COLUMN.match(statement):
                columns[added[1]].append(_column(added[2]))
            elif index := _CREATE_INDEX.match(statement):
                names[index[2]].add(index[1])
            elif trigger := _CREATE_TRIGGER.match(statement):
                names[trigger[2]].add(f"trigger {trigger[1]}")
    return {table: (tuple(columns[table]), frozenset(names[table])) for table in columns}


def shape_of(conn: psycopg.Connection[Any]) -> Shape:
    """The current schema's base tables (those no extension installed: ``_OWN_TABLES``)
    with their columns (name, type) and the names of their indexes (not those behind a
    primary key or unique constraint) and triggers. Views and extensions' objects are
    not read: information_schema.columns lists a view's columns too, and an extension
    installed into towerd's schema made every start refused as "unexpected table"."""
    shape: dict[str, tuple[list[tuple[str, str]], set[str]]] = {}
    for (table,) in conn.execute(f"SELECT relname FROM ({_OWN_TABLES}) own"):
        shape[table] = ([], set())
    for table, column, data_type in conn.execute(
        f"""SELECT table_name, column_name, data_type FROM information_schema.columns
            WHERE table_schema = current_schema()
              AND table_name IN (SELECT relname FROM ({_OWN_TABLES}) own)
            ORDER BY table_name, ordinal_position"""
    ):
        shape[table][0].append((column, data_type))
    for table, name in conn.execute(
        f"""SELECT t.relname, i.relname FROM pg_index x
            JOIN pg_class i ON i.oid = x.indexrelid
            JOIN ({_OWN_TABLES}) t ON t.oid = x.indrelid
            WHERE NOT EXISTS (SELECT 1 FROM pg_constraint c
                              WHERE c.conindid = x.indexrelid AND c.conrelid = x.indrelid)"""
    ):
        shape[table][1].add(name)
    for table, name in conn.execute(
        f"""SELECT t.relname, g.tgname FROM pg_trigger g JOIN ({_OWN_TABLES}) t
            ON t.oid = g.tgrelid WHERE NOT g.tgisinternal"""
    ):
        shape[table][1].add(f"trigger {name}")
    return {table: (tuple(cols), frozenset(names)) for table, (cols, names) in shape.items()}


def check_shape(conn: psycopg.Connection[Any], version: int | None = None) -> None:
    """Refuse a schema whose tables differ from what the ladder makes at ``version``
    (default: the newest): tables, column names and types, index and trigger names.
    Only base tables count (:func:`shape_of`): an operator's views and extensions beside
    towerd's tables are theirs; another base table is not towerd's shape."""
    version = SCHEMA_VERSION if version is None else version
    actual, expected = shape_of(conn), expected_shape(version)
    problems = []
    for table in sorted(expected.keys() - actual.keys()):
        problems.append(f"table {table} is missing")
    for table in sorted(actual.keys() - expected.keys()):
        problems.append(f"unexpected table {table}")
    for table in sorted(expected.keys() & actual.keys()):
        (want_columns, want_names), (have_columns, have_names) = expected[table], actual[table]
        if want_columns != have_columns:
            problems.append(
                f"table {table} has columns {list(have_columns)}, expected {list(want_columns)}"
            )
        if want_names != have_names:
            problems.append(
                f"table {table} has indexes and triggers {sorted(have_names)}, "
                f"expected {sorted(want_names)}"
            )
    if problems:
        raise StartRefused(
            "PostgreSQL: tables do not have the shape towerd expects for schema version "
            f"{version}: {'; '.join(problems)}"
        )
