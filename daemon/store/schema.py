"""The schema ladder and the open contract of the state database.

Every schema version is one step of a forward-only ladder, applied in its own
transaction after a backup copy of the file. A database this code does not
recognise is refused, never reshaped: one stamped with a newer version, one
that is not a towerd database, and one whose tables do not have the shape the
ladder produces. Refusals raise :class:`StartRefused` before anything is
written to the file.

Every database ends up with ``auto_vacuum = INCREMENTAL`` (:func:`use_incremental_vacuum`),
so that what retention deletes can be handed back to the file system
(``retention.vacuum_step``).
"""

from __future__ import annotations

import os
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

import structlog

from towerd.daemon.crashpoints import crash_point
from towerd.daemon.private_paths import StartRefused

log = structlog.get_logger("towerd.store")

APPLICATION_ID = 0x746F7764  # "towd", stamped in the SQLite header
SCHEMA_VERSION = 11


# The tables whose rows a principal can create without bound, each counted per principal
# in ``quota_usage`` by triggers (daemon/store/quota.py). Step 6 below is frozen: a new
# counted table is a new step, not an edit of this tuple.
_COUNTED_IN_STEP_6 = (
    "idempotency",
    "kv",
    "messages",
    "events",
    "effects",
    "leases",
    "lease_tokens",
)


def _counter_triggers(table: str) -> tuple[str, ...]:
    """Triggers keeping ``quota_usage`` exact for ``table`` whatever deletes or moves a row
    (a request, expiry, retention, a dead holder's release). A row whose principal is
    NULL (written before step 6) counts for nobody."""
    add = f"""INSERT INTO quota_usage (principal, tbl, rows) SELECT NEW.principal, '{table}', 1
              WHERE NEW.principal IS NOT NULL
              ON CONFLICT (principal, tbl) DO UPDATE SET rows = rows + 1;"""
    remove = f"""UPDATE quota_usage SET rows = rows - 1
                 WHERE principal = OLD.principal AND tbl = '{table}';"""
    return (
        f"CREATE TRIGGER quota_{table}_insert AFTER INSERT ON {table} BEGIN {add} END",
        f"CREATE TRIGGER quota_{table}_delete AFTER DELETE ON {table} BEGIN {remove} END",
        f"""CREATE TRIGGER quota_{table}_owner AFTER UPDATE OF principal ON {table}
            WHEN OLD.principal IS NOT NEW.principal BEGIN {remove} {add} END""",
    )


def _count_existing(table: str) -> str:
    return f"""INSERT INTO quota_usage (principal, tbl, rows)
               SELECT principal, '{table}', count(*) FROM {table}
               WHERE principal IS NOT NULL GROUP BY principal"""


@dataclass(frozen=True)
class Migration:
    version: int
    summary: str
    statements: tuple[str, ...]


MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        1,
        "daemon identity, fleet rows with ownership, idempotency keys, operator log",
        (
            f"PRAGMA application_id = {APPLICATION_ID}",
            """CREATE TABLE meta (
                key TEXT PRIMARY KEY,
                value TEXT NOT NULL
            ) STRICT""",
            """CREATE TABLE daemons (
                daemon_id TEXT PRIMARY KEY,
                owner_epoch INTEGER NOT NULL CHECK (owner_epoch >= 1),
                pid INTEGER NOT NULL,
                host TEXT NOT NULL,
                started_at INTEGER NOT NULL
            ) STRICT""",
            """CREATE TABLE sessions (
                session_id TEXT PRIMARY KEY,
                agent_session_id TEXT,
                name TEXT,
                cwd TEXT NOT NULL,
                agent TEXT NOT NULL,
                pinned INTEGER NOT NULL DEFAULT 0 CHECK (pinned IN (0, 1)),
                last_attached_at INTEGER,
                exited INTEGER NOT NULL DEFAULT 0 CHECK (exited IN (0, 1)),
                parent TEXT,
                prompt TEXT,
                result TEXT,
                transcript_path TEXT,
                model TEXT,
                effort TEXT,
                target TEXT,
                target_identity TEXT,
                daemon_id TEXT NOT NULL,
                owner_epoch INTEGER NOT NULL,
                updated_at INTEGER NOT NULL
            ) STRICT""",
            "CREATE INDEX sessions_by_daemon ON sessions (daemon_id)",
            "CREATE INDEX sessions_by_parent ON sessions (parent) WHERE parent IS NOT NULL",
            """CREATE UNIQUE INDEX sessions_by_agent_session
                ON sessions (daemon_id, agent_session_id) WHERE agent_session_id IS NOT NULL""",
            """CREATE TABLE idempotency (
                principal TEXT NOT NULL,
                operation TEXT NOT NULL,
                key TEXT NOT NULL,
                payload_hash BLOB NOT NULL,
                state TEXT NOT NULL
                    CHECK (state IN ('in_progress', 'completed', 'outcome_unknown')),
                effect_ref TEXT NOT NULL,
                result BLOB,
                holder_pid INTEGER,
                holder_start INTEGER,
                attempt TEXT,
                daemon_id TEXT NOT NULL,
                created_at INTEGER NOT NULL,
                updated_at INTEGER NOT NULL,
                PRIMARY KEY (principal, operation, key)
            ) STRICT""",
            "CREATE INDEX idempotency_by_state ON idempotency (state, updated_at)",
            """CREATE TABLE operator_log (
                at INTEGER NOT NULL,
                daemon_id TEXT NOT NULL,
                principal TEXT NOT NULL,
                action TEXT NOT NULL,
                detail TEXT NOT NULL
            ) STRICT""",
        ),
    ),
    Migration(
        2,
        # idem.list pages by rowid within a principal: without these, every page
        # sorted all of the principal's keys (143 ms a page at 10^6 keys).
        "index idempotency keys by principal (and state) for paged listings",
        (
            "CREATE INDEX idempotency_by_principal ON idempotency (principal)",
            "CREATE INDEX idempotency_by_principal_state ON idempotency (principal, state)",
        ),
    ),
    Migration(
        3,
        "fenced leases and the external-effects ledger",
        (
            """CREATE TABLE leases (
                resource TEXT PRIMARY KEY,
                fencing_token INTEGER NOT NULL,
                principal TEXT NOT NULL,
                holder_pid INTEGER,
                holder_start INTEGER,
                acquired_at INTEGER NOT NULL,
                renewed_at INTEGER NOT NULL,
                expires_at INTEGER NOT NULL,
                daemon_id TEXT NOT NULL
            ) STRICT""",
            # The last token ever issued per resource: outlives its lease, so a token
            # is never issued twice (not after a release, an expiry or a restart).
            """CREATE TABLE lease_tokens (
                resource TEXT PRIMARY KEY,
                last_token INTEGER NOT NULL
            ) STRICT""",
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
                payload_hash BLOB NOT NULL,
                receipt BLOB,
                principal TEXT NOT NULL,
                holder_pid INTEGER,
                holder_start INTEGER,
                timeout_ms INTEGER NOT NULL,
                claimed_at INTEGER NOT NULL,
                heartbeat_at INTEGER NOT NULL,
                completed_at INTEGER,
                lease_resource TEXT,
                fencing_token INTEGER,
                daemon_id TEXT NOT NULL
            ) STRICT""",
            "CREATE INDEX effects_by_run ON effects (run_id)",
            "CREATE INDEX effects_in_flight ON effects (status) WHERE status = 'in_flight'",
        ),
    ),
    Migration(
        4,
        "workers, the work-dispatch ledger, the audit log, soft key-value state",
        (
            """CREATE TABLE workers (
                worker_id TEXT PRIMARY KEY,
                principal TEXT NOT NULL,
                host TEXT NOT NULL,
                pid INTEGER NOT NULL,
                process_start INTEGER NOT NULL,
                version TEXT,
                project_root TEXT NOT NULL,
                status TEXT NOT NULL CHECK (status IN ('active', 'stopping', 'crashed')),
                registered_at INTEGER NOT NULL,
                heartbeat_at INTEGER NOT NULL,
                ended_at INTEGER,
                end_reason TEXT,
                daemon_id TEXT NOT NULL
            ) STRICT""",
            # One live worker per process: a retried register answers the same worker.
            """CREATE UNIQUE INDEX workers_live_per_process ON workers (pid, process_start)
               WHERE ended_at IS NULL""",
            "CREATE INDEX workers_by_project ON workers (project_root)",
            # AUTOINCREMENT: a pruned dispatch's id never names a new one.
            """CREATE TABLE dispatches (
                dispatch_id INTEGER PRIMARY KEY AUTOINCREMENT,
                unit_type TEXT NOT NULL,
                unit_id TEXT NOT NULL,
                milestone_id TEXT NOT NULL,
                slice_id TEXT,
                task_id TEXT,
                trace_id TEXT NOT NULL,
                turn_id TEXT,
                worker_id TEXT NOT NULL,
                lease_resource TEXT NOT NULL,
                fencing_token INTEGER NOT NULL,
                status TEXT NOT NULL CHECK (status IN ('claimed', 'running', 'completed',
                    'failed', 'stuck', 'canceled', 'paused')),
                attempt_n INTEGER NOT NULL CHECK (attempt_n >= 1),
                max_attempts INTEGER NOT NULL CHECK (max_attempts >= 1),
                claimed_at INTEGER NOT NULL,
                started_at INTEGER,
                ended_at INTEGER,
                exit_reason TEXT,
                error_code TEXT,
                error_summary TEXT,
                retry_after_ms INTEGER,
                next_run_at INTEGER,
                CHECK ((status IN ('claimed', 'running')) = (ended_at IS NULL))
            ) STRICT""",
            # At most one active dispatch per unit, enforced by SQLite itself.
            """CREATE UNIQUE INDEX dispatches_active_per_unit ON dispatches (unit_type, unit_id)
               WHERE status IN ('claimed', 'running')""",
            "CREATE INDEX dispatches_by_unit ON dispatches (unit_type, unit_id)",
            "CREATE INDEX dispatches_by_worker ON dispatches (worker_id)",
            "CREATE INDEX dispatches_by_milestone ON dispatches (milestone_id, status)",
            "CREATE INDEX dispatches_settled ON dispatches (ended_at) WHERE ended_at IS NOT NULL",
            """CREATE TABLE audit_events (
                seq INTEGER PRIMARY KEY AUTOINCREMENT,
                event_id TEXT NOT NULL UNIQUE,
                trace_id TEXT,
                turn_id TEXT,
                caused_by TEXT,
                category TEXT NOT NULL CHECK (category IN ('worker', 'lease', 'dispatch')),
                type TEXT NOT NULL,
                ts INTEGER NOT NULL,
                actor TEXT NOT NULL,
                payload BLOB
            ) STRICT""",
            "CREATE INDEX audit_by_ts ON audit_events (ts)",
            "CREATE INDEX audit_by_trace ON audit_events (trace_id)",
            """CREATE TABLE kv (
                scope TEXT NOT NULL CHECK (scope IN ('global', 'worker', 'milestone')),
                scope_id TEXT NOT NULL,
                key TEXT NOT NULL,
                value BLOB NOT NULL,
                updated_at INTEGER NOT NULL,
                PRIMARY KEY (scope, scope_id, key)
            ) STRICT, WITHOUT ROWID""",
        ),
    ),
    Migration(
        5,
        "the hook event trail and session messages",
        (
            # AUTOINCREMENT: ids are cursors (``before``); pruning must never let one return.
            """CREATE TABLE events (
                event_id INTEGER PRIMARY KEY AUTOINCREMENT,
                session_id TEXT,
                agent_session_id TEXT,
                kind TEXT NOT NULL,
                at INTEGER NOT NULL,
                payload BLOB,
                daemon_id TEXT NOT NULL,
                CHECK (session_id IS NOT NULL OR agent_session_id IS NOT NULL)
            ) STRICT""",
            "CREATE INDEX events_by_session ON events (session_id) WHERE session_id IS NOT NULL",
            """CREATE INDEX events_by_agent_session ON events (agent_session_id)
               WHERE agent_session_id IS NOT NULL""",
            "CREATE INDEX events_by_at ON events (at)",
            """CREATE TABLE messages (
                message_id TEXT PRIMARY KEY,
                session_id TEXT NOT NULL,
                agent_session_id TEXT,
                text TEXT NOT NULL,
                status TEXT NOT NULL CHECK (status IN ('queued', 'delivered', 'read')),
                created_at INTEGER NOT NULL,
                updated_at INTEGER NOT NULL,
                daemon_id TEXT NOT NULL
            ) STRICT""",
            "CREATE INDEX messages_by_session ON messages (session_id, created_at)",
        ),
    ),
    Migration(
        6,
        "per-principal row quotas; retention of messages, settled effects and lease tokens",
        (
            # Who created the row, for the quota (NULL on older rows: counted for nobody).
            "ALTER TABLE kv ADD COLUMN principal TEXT",
            "ALTER TABLE messages ADD COLUMN principal TEXT",
            "ALTER TABLE events ADD COLUMN principal TEXT",
            "ALTER TABLE lease_tokens ADD COLUMN principal TEXT",
            """CREATE TABLE quota_usage (
                principal TEXT NOT NULL,
                tbl TEXT NOT NULL,
                rows INTEGER NOT NULL,
                PRIMARY KEY (principal, tbl)
            ) STRICT, WITHOUT ROWID""",
            *(trigger for table in _COUNTED_IN_STEP_6 for trigger in _counter_triggers(table)),
            *(_count_existing(table) for table in _COUNTED_IN_STEP_6),
            # Retention deletes by age without scanning the whole table.
            "CREATE INDEX messages_by_created ON messages (created_at)",
            """CREATE INDEX effects_settled ON effects (completed_at)
               WHERE status IN ('committed', 'failed', 'aborted')""",
        ),
    ),
    Migration(
        7,
        "agent sessions from hooks: a session's agent process, path leases by session",
        (
            # The agent process (pid + start time) whose hooks report the session, when
            # its most recent SessionStart named it, and whether it still runs (NULL:
            # towerd knows no agent process for the row).
            "ALTER TABLE sessions ADD COLUMN agent_pid INTEGER",
            "ALTER TABLE sessions ADD COLUMN agent_start INTEGER",
            "ALTER TABLE sessions ADD COLUMN agent_named_at INTEGER",
            "ALTER TABLE sessions ADD COLUMN live INTEGER CHECK (live IN (0, 1))",
            """CREATE INDEX sessions_by_agent_process ON sessions (agent_pid, agent_start)
               WHERE agent_pid IS NOT NULL""",
            "CREATE INDEX sessions_live ON sessions (live) WHERE live = 1",
            # The session a lease (a path lease) is held for.
            "ALTER TABLE leases ADD COLUMN session_id TEXT",
            "CREATE INDEX leases_by_session ON leases (session_id) WHERE session_id IS NOT NULL",
        ),
    ),
    Migration(
        8,
        "evidence probes: what a git push claimed, a run's probe command, probe verdicts",
        (
            # A git-push effect's target as claimed (msgpack {repo, remote_url, commit,
            # ref}; NULL: it cannot be probed), and the last probe of an unsettled effect.
            "ALTER TABLE effects ADD COLUMN git_target BLOB",
            "ALTER TABLE effects ADD COLUMN probe_attempts INTEGER NOT NULL DEFAULT 0",
            "ALTER TABLE effects ADD COLUMN probe_at INTEGER",
            "ALTER TABLE effects ADD COLUMN probe_next_at INTEGER",
            "ALTER TABLE effects ADD COLUMN probe_verdict TEXT",
            "ALTER TABLE effects ADD COLUMN probe_evidence BLOB",
            "CREATE INDEX effects_uncertain ON effects (status) WHERE status = 'uncertain'",
            # A key's probe command (`towerctl run --probe CMD`), the directory it runs
            # in, and its last verdict while the key is outcome_unknown.
            "ALTER TABLE idempotency ADD COLUMN probe TEXT",
            "ALTER TABLE idempotency ADD COLUMN probe_cwd TEXT",
            "ALTER TABLE idempotency ADD COLUMN probe_attempts INTEGER NOT NULL DEFAULT 0",
            "ALTER TABLE idempotency ADD COLUMN probe_at INTEGER",
            "ALTER TABLE idempotency ADD COLUMN probe_next_at INTEGER",
            "ALTER TABLE idempotency ADD COLUMN probe_verdict TEXT",
        ),
    ),
    Migration(
        9,
        "boxes: a daemon's last presence and when it was declared dead (shared stores)",
        (
            # On a store several boxes share (PostgreSQL), each daemon heartbeats its row;
            # one silent past the presence TTL is declared dead by a live one. The embedded
            # store has one box, so these only say when it last served.
            "ALTER TABLE daemons ADD COLUMN presence_at INTEGER NOT NULL DEFAULT 0",
            "ALTER TABLE daemons ADD COLUMN dead_at INTEGER",
        ),
    ),
    Migration(
        10,
        "hook events filed once: the key a queued hook event is filed under",
        (
            # Minted by the daemon before a hook event's first write on a shared store and
            # kept with it in the outbox (daemon/outbox.py): a second write under the same
            # key files nothing. NULL for every other event.
            "ALTER TABLE events ADD COLUMN filing_key TEXT",
            """CREATE UNIQUE INDEX events_by_filing_key ON events (filing_key)
               WHERE filing_key IS NOT NULL""",
        ),
    ),
    Migration(
        11,
        "every agent process of a session: two processes may report one session",
        (
            # A session's row names the agent process that hooked it last; two processes
            # may report one session (resumed twice, an inherited TOWERD_SESSION_ID), and
            # each must still be found as that session's agent (store/fleet.py).
            # named_at: when the process joined the session or last started it.
            """CREATE TABLE session_agents (
                session_id TEXT NOT NULL,
                pid INTEGER NOT NULL,
                start INTEGER NOT NULL,
                named_at INTEGER NOT NULL,
                PRIMARY KEY (session_id, pid, start)
            ) STRICT, WITHOUT ROWID""",
            "CREATE INDEX session_agents_by_process ON session_agents (pid, start)",
            """INSERT INTO session_agents (session_id, pid, start, named_at)
               SELECT session_id, agent_pid, agent_start, COALESCE(agent_named_at, 0)
               FROM sessions WHERE agent_pid IS NOT NULL AND agent_start IS NOT NULL""",
        ),
    ),
)

assert [m.version for m in MIGRATIONS] == list(range(1, SCHEMA_VERSION + 1))


def check_header(conn: sqlite3.Connection, db_path: Path) -> int:
    """Refuse a file that is not ours or is newer; return its schema version.

    Reads only: nothing is written before the file passes these checks.
    """
    try:
        application_id = conn.execute("PRAGMA application_id").fetchone()[0]
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        tables = [
            row[0]
            for row in conn.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'"
            )
        ]
    except sqlite3.DatabaseError as exc:
        raise StartRefused(
            f"{db_path}: damaged or not a SQLite database: reading its schema failed ({exc}); "
            f"PRAGMA quick_check: {_quick_check_outcome(conn)}"
        ) from None
    if application_id == 0:
        if version != 0 or tables:
            raise StartRefused(
                f"{db_path}: not a towerd database (no towerd stamp, tables {sorted(tables)}); "
                "move it away or point --state-dir elsewhere"
            )
        return 0
    if application_id != APPLICATION_ID:
        raise StartRefused(f"{db_path}: not a towerd database (application_id {application_id:#x})")
    if version > SCHEMA_VERSION:
        raise StartRefused(
            f"{db_path}: database schema version {version} is newer than this towerd "
            f"supports (schema version {SCHEMA_VERSION}); upgrade towerd, or restore a backup "
            "made for this version"
        )
    return version


def _quick_check_outcome(conn: sqlite3.Connection) -> str:
    try:
        return "; ".join(row[0] for row in conn.execute("PRAGMA quick_check").fetchmany(5))
    except sqlite3.DatabaseError as exc:
        return f"failed ({exc})"


def check_integrity(conn: sqlite3.Connection, db_path: Path) -> None:
    """Refuse a damaged file before any write could spread the damage."""
    try:
        rows = [row[0] for row in conn.execute("PRAGMA quick_check")]
    except sqlite3.DatabaseError as exc:
        raise StartRefused(f"{db_path}: PRAGMA quick_check failed: {exc}") from None
    if rows != ["ok"]:
        raise StartRefused(f"{db_path}: PRAGMA quick_check failed: {'; '.join(rows[:5])}")


def migrate(conn: sqlite3.Connection, from_version: int, db_path: Path, backup_dir: Path) -> None:
    """Climb the ladder from ``from_version``, one transaction per step; then make sure
    the file can return freed pages (:func:`use_incremental_vacuum`)."""
    if from_version < SCHEMA_VERSION:
        if from_version > 0:
            backup_copy(conn, backup_dir / f"towerd-v{from_version}-{int(time.time())}.db")
        _climb(conn, from_version)
    use_incremental_vacuum(conn, db_path)


def _climb(conn: sqlite3.Connection, from_version: int) -> None:
    for migration in MIGRATIONS[from_version:]:
        conn.execute("BEGIN IMMEDIATE")
        try:
            for statement in migration.statements:
                conn.execute(statement)
            conn.execute(f"PRAGMA user_version = {migration.version}")
            crash_point("migrate.before_commit")
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise


AUTO_VACUUM_INCREMENTAL = 2  # PRAGMA auto_vacuum's value for INCREMENTAL
VACUUM_SPARE_BYTES = 16 * 1024 * 1024  # free space left over after a switching VACUUM


def use_incremental_vacuum(conn: sqlite3.Connection, db_path: Path) -> bool:
    """Switch the file to ``auto_vacuum = INCREMENTAL`` if it is not already; True once it is.

    The mode can only change before the file's first page is written, or by a VACUUM
    (outside any transaction), and the writer's connection has already written that page
    when it switched to WAL: so a fresh file and one made by older code alike are
    switched by ``VACUUM``, instant on a fresh file. VACUUM keeps the rowids that paged
    listings use as cursors and stored order: it copies the rows of a table that has an
    index (every such table here has its primary key's) with their rowids. It writes the
    file's live pages
    twice (a temporary copy, then the WAL), and drops its free pages, so it is tried
    only with room for two copies of the live pages to spare; without room, or if it
    fails anyway, it is logged and tried again at the next start: nothing is lost, only
    space that retention frees is not returned to the file system meanwhile."""
    if conn.execute("PRAGMA auto_vacuum").fetchone()[0] == AUTO_VACUUM_INCREMENTAL:
        return True
    page_size = conn.execute("PRAGMA page_size").fetchone()[0]
    pages = conn.execute("PRAGMA page_count").fetchone()[0]
    live = (pages - conn.execute("PRAGMA freelist_count").fetchone()[0]) * page_size
    free = _free_bytes(db_path.parent)
    if free < 2 * live + VACUUM_SPARE_BYTES:
        log.warning(
            "incremental_vacuum_deferred",
            code="storage_full",
            db_bytes=pages * page_size,
            live_bytes=live,
            free_bytes=free,
            note="too little free space to rewrite the database; retried at the next start",
        )
        return False
    started = time.monotonic()
    conn.execute(f"PRAGMA auto_vacuum = {AUTO_VACUUM_INCREMENTAL}")
    try:
        conn.execute("VACUUM")
    except sqlite3.Error as exc:
        log.warning(
            "incremental_vacuum_deferred",
            code="storage_full" if getattr(exc, "sqlite_errorcode", 0) & 0xFF == 13 else "internal",
            db_bytes=pages * page_size,
            reason=str(exc),
            note="the database is unchanged; retried at the next start",
        )
        return False
    if pages * page_size > 1024 * 1024:  # not worth a line for a fresh file
        log.info(
            "incremental_vacuum_enabled",
            db_bytes=pages * page_size,
            live_bytes=live,
            seconds=round(time.monotonic() - started, 3),
        )
    return conn.execute("PRAGMA auto_vacuum").fetchone()[0] == AUTO_VACUUM_INCREMENTAL


def _free_bytes(directory: Path) -> int:
    info = os.statvfs(directory)
    return info.f_bavail * info.f_frsize


def backup_copy(conn: sqlite3.Connection, target: Path) -> None:
    """A consistent copy through SQLite's backup API (safe while the file is open)."""
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    copy = sqlite3.connect(target)
    try:
        conn.backup(copy)
    finally:
        copy.close()
    target.chmod(0o600)


Shape = dict[str, tuple[tuple[tuple[object, ...], ...], frozenset[str]]]


def shape_of(conn: sqlite3.Connection) -> Shape:
    """Tables with their columns (name, type, not null, default, pk) and the names of
    their indexes and triggers (``trigger NAME``: the quota counters are triggers, and a
    file missing one would count wrongly)."""
    shape: Shape = {}
    tables = conn.execute(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'"
    ).fetchall()
    for (table,) in tables:
        columns = tuple(
            tuple(row[1:]) for row in conn.execute(f"PRAGMA table_info({_quote(table)})")
        )
        indexes = frozenset(
            row[1]
            for row in conn.execute(f"PRAGMA index_list({_quote(table)})")
            if not row[1].startswith("sqlite_autoindex")
        )
        triggers = frozenset(
            f"trigger {row[0]}"
            for row in conn.execute(
                "SELECT name FROM sqlite_master WHERE type = 'trigger' AND tbl_name = ?", (table,)
            )
        )
        shape[table] = (columns, indexes | triggers)
    return shape


def expected_shape(version: int | None = None) -> Shape:
    """The shape the ladder produces up to ``version`` (default: the newest), built on a
    scratch in-memory database."""
    version = SCHEMA_VERSION if version is None else version
    scratch = sqlite3.connect(":memory:", isolation_level=None)
    try:
        for migration in MIGRATIONS[:version]:
            for statement in migration.statements:
                scratch.execute(statement)
        return shape_of(scratch)
    finally:
        scratch.close()


def check_shape(conn: sqlite3.Connection, db_path: Path, version: int | None = None) -> None:
    """Refuse a database whose tables differ from what the ladder makes at ``version``.

    Checked before migrating (so a misshapen old file is refused untouched) and after.
    """
    version = SCHEMA_VERSION if version is None else version
    actual, expected = shape_of(conn), expected_shape(version)
    problems = []
    for table in sorted(expected.keys() - actual.keys()):
        problems.append(f"table {table} is missing")
    for table in sorted(actual.keys() - expected.keys()):
        problems.append(f"unexpected table {table}")
    for table in sorted(expected.keys() & actual.keys()):
        (want_columns, want_indexes), (have_columns, have_indexes) = expected[table], actual[table]
        if want_columns != have_columns:
            problems.append(
                f"table {table} has columns {[c[0] for c in have_columns]}, "
                f"expected {[c[0] for c in want_columns]} (or different types/constraints)"
            )
        if want_indexes != have_indexes:
            problems.append(
                f"table {table} has indexes and triggers {sorted(have_indexes)}, "
                f"expected {sorted(want_indexes)}"
            )
    if problems:
        raise StartRefused(
            f"{db_path}: tables do not have the shape towerd expects for schema version "
            f"{version}: {'; '.join(problems)}"
        )


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'
