"""The open contract: a database towerd does not recognise is refused, untouched."""

from __future__ import annotations

import hashlib
import os
import sqlite3
import stat
from contextlib import closing
from pathlib import Path

import pytest

from store_helpers import db_path, execute, opened, query, register, register_old_row, state_dir
from towerd.daemon.private_paths import StartRefused
from towerd.daemon.store import reconcile, schema

CURRENT = schema.SCHEMA_VERSION  # the ladder grows; these tests add the step after it

pytestmark = pytest.mark.anyio


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def private_state_dir(root: Path) -> Path:
    directory = state_dir(root)
    directory.mkdir(mode=0o700)
    return directory


def private_file(path: Path, content: bytes = b"") -> None:
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(content)


async def populated(root: Path, rows: int = 0) -> None:
    """A real towerd database, closed again, with ``rows`` fleet rows (of the first
    schema's columns: the ladder test makes a version-1 file with it)."""
    async with opened(root) as store:
        for n in range(rows):
            await register_old_row(store, name=f"row-{n}-" + "x" * 200, prompt="p" * 300)


async def refused(root: Path) -> StartRefused:
    with pytest.raises(StartRefused) as caught:
        async with opened(root):
            pass
    return caught.value


# --- versions and foreign files
# --------------------------------------------------------------


@pytest.mark.sqlite_only
async def test_newer_schema_version_is_refused_naming_both_versions_and_untouched(
    short_tmp: Path,
) -> None:
    """A file stamped SCHEMA_VERSION+1 is refused before anything is written:
    the message names both versions and the file's bytes are unchanged."""
    await populated(short_tmp, rows=2)
    execute(short_tmp, f"PRAGMA user_version = {schema.SCHEMA_VERSION + 1}")
    before = sha256(db_path(short_tmp))
    error = await refused(short_tmp)
    message = str(error)
    assert f"version {schema.SCHEMA_VERSION + 1}" in message
    assert f"schema version {schema.SCHEMA_VERSION}" in message
    assert sha256(db_path(short_tmp)) == before
    assert query(short_tmp, "PRAGMA user_version") == [(schema.SCHEMA_VERSION + 1,)]
    assert query(short_tmp, "SELECT count(*) FROM daemons") == [(1,)]
    assert query(short_tmp, "SELECT owner_epoch FROM daemons") == [(1,)]  # no new epoch started


WAL_ONLY_CHANGE = """
import os, sqlite3, sys
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("PRAGMA wal_autocheckpoint = 0")
conn.execute(sys.argv[2])
os._exit(0)  # no close: the change lives in the WAL only, as after a crash
"""


def change_in_wal_only(root: Path, statement: str) -> None:
    """Write ``statement`` as a process that dies before any checkpoint would."""
    import subprocess
    import sys

    subprocess.run(
        [sys.executable, "-c", WAL_ONLY_CHANGE, str(db_path(root)), statement], check=True
    )


@pytest.mark.sqlite_only
@pytest.mark.parametrize(
    "statement, words",
    [
        (f"PRAGMA user_version = {schema.SCHEMA_VERSION + 1}", "is newer"),
        ("PRAGMA application_id = 7", "not a towerd database"),
        ("CREATE TABLE intruder (x)", "unexpected table intruder"),
    ],
)
async def test_a_refusal_whose_cause_is_in_the_wal_leaves_db_and_wal_unchanged(
    short_tmp: Path, statement: str, words: str
) -> None:
    """A newer, foreign or misshapen database whose change lives only in its WAL is
    refused, and both files stay byte for byte as they were: the checks run on a
    read-only connection, which never checkpoints the WAL into the database."""
    await populated(short_tmp, rows=1)
    change_in_wal_only(short_tmp, statement)
    wal = db_path(short_tmp).with_name("towerd.db-wal")
    assert wal.stat().st_size > 0
    before = sha256(db_path(short_tmp)), sha256(wal)
    assert words in str(await refused(short_tmp))
    assert (sha256(db_path(short_tmp)), sha256(wal)) == before


@pytest.mark.sqlite_only
async def test_sqlite_file_with_foreign_tables_is_refused(short_tmp: Path) -> None:
    """Someone else's SQLite database (no towerd
    application_id) is refused, not adopted."""
    path = private_state_dir(short_tmp) / "towerd.db"
    private_file(path)
    with closing(sqlite3.connect(path)) as conn:
        conn.execute("CREATE TABLE notes (body TEXT)")
        conn.execute("INSERT INTO notes VALUES ('mine')")
        conn.commit()
    before = sha256(path)
    error = await refused(short_tmp)
    assert "not a towerd database" in str(error)
    assert "notes" in str(error)
    assert sha256(path) == before


@pytest.mark.sqlite_only
async def test_other_application_id_is_refused(short_tmp: Path) -> None:
    """A SQLite file stamped with another application's id is refused."""
    path = private_state_dir(short_tmp) / "towerd.db"
    private_file(path)
    with closing(sqlite3.connect(path)) as conn:
        conn.execute("PRAGMA application_id = 1234")
    error = await refused(short_tmp)
    assert "application_id 0x4d2" in str(error)


@pytest.mark.sqlite_only
async def test_user_version_without_tables_or_stamp_is_refused(short_tmp: Path) -> None:
    """An unstamped file with a user_version set is not a fresh database either."""
    path = private_state_dir(short_tmp) / "towerd.db"
    private_file(path)
    with closing(sqlite3.connect(path)) as conn:
        conn.execute("PRAGMA user_version = 7")
    assert "not a towerd database" in str(await refused(short_tmp))


@pytest.mark.sqlite_only
@pytest.mark.parametrize(
    "content",
    [
        b"this is a text file, not a database\n" * 200,
        os.urandom(8192),
        b"SQLite format 3\x00" + b"\xff" * 4080,
    ],
    ids=["text", "random", "bad-header"],
)
async def test_non_sqlite_file_is_refused_and_untouched(short_tmp: Path, content: bytes) -> None:
    """A file that is not SQLite at all is refused
    with StartRefused and left as it was."""
    path = private_state_dir(short_tmp) / "towerd.db"
    private_file(path, content)
    error = await refused(short_tmp)
    assert str(path) in str(error)
    assert path.read_bytes() == content


@pytest.mark.sqlite_only
async def test_empty_file_is_initialised(short_tmp: Path) -> None:
    """A zero-length towerd.db (as _create_private_file leaves it) is a new database."""
    path = private_state_dir(short_tmp) / "towerd.db"
    private_file(path)
    async with opened(short_tmp) as store:
        assert store.owner_epoch == 1
    assert query(short_tmp, "PRAGMA application_id") == [(schema.APPLICATION_ID,)]
    assert query(short_tmp, "PRAGMA user_version") == [(schema.SCHEMA_VERSION,)]


# --- shape
# -------------------------------------------------------------------------------------


@pytest.mark.sqlite_only
async def test_table_with_an_extra_column_is_refused_naming_it(short_tmp: Path) -> None:
    """A towerd database whose sessions table gained
    a column is refused, naming the table."""
    await populated(short_tmp)
    execute(short_tmp, "ALTER TABLE sessions ADD COLUMN extra TEXT")
    before = sha256(db_path(short_tmp))
    message = str(await refused(short_tmp))
    assert "table sessions" in message
    assert "extra" in message
    assert sha256(db_path(short_tmp)) == before


async def test_table_that_lost_a_column_is_refused_naming_it(short_tmp: Path) -> None:
    """A towerd database whose operator_log table
    lost a column is refused, naming the table."""
    await populated(short_tmp)
    execute(short_tmp, "ALTER TABLE operator_log DROP COLUMN detail")
    message = str(await refused(short_tmp))
    assert "table operator_log" in message


async def test_missing_or_unexpected_tables_and_indexes_are_refused(
    short_tmp: Path,
) -> None:
    """A dropped index, a dropped table and an extra table are each named."""
    await populated(short_tmp)
    execute(short_tmp, "DROP INDEX idempotency_by_state")
    execute(short_tmp, "DROP TABLE operator_log")
    execute(short_tmp, "CREATE TABLE scratch (x INTEGER)")
    message = str(await refused(short_tmp))
    assert "table operator_log is missing" in message
    assert "unexpected table scratch" in message
    assert "table idempotency has indexes" in message


@pytest.mark.sqlite_only
async def test_fresh_database_has_exactly_the_expected_shape(short_tmp: Path) -> None:
    """What open_store creates is what the ladder's scratch build describes."""
    await populated(short_tmp)
    with closing(sqlite3.connect(db_path(short_tmp))) as conn:
        assert schema.shape_of(conn) == schema.expected_shape()


# --- damage
# --------------------------------------------------------------------------------------


@pytest.mark.sqlite_only
async def test_corrupted_database_is_refused_by_quick_check(short_tmp: Path) -> None:
    """Garbage written over the table pages of a populated database
    is caught by quick_check before anything is written."""
    await populated(short_tmp, rows=60)
    path = db_path(short_tmp)
    with closing(sqlite3.connect(path, isolation_level=None)) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        page_size = conn.execute("PRAGMA page_size").fetchone()[0]
        pages = conn.execute("PRAGMA page_count").fetchone()[0]
    assert pages > 4
    data = bytearray(path.read_bytes())
    start = 2 * page_size  # page 3 onward; page 1 (header and schema) stays readable
    data[start:] = bytes((i * 37 + 11) % 251 for i in range(len(data) - start))
    path.write_bytes(bytes(data))
    before = sha256(path)
    message = str(await refused(short_tmp))
    assert "quick_check" in message
    assert sha256(path) == before


# --- private paths
# ----------------------------------------------------------------------------------


@pytest.mark.sqlite_only
async def test_state_dir_is_created_0700_and_db_file_0600(short_tmp: Path) -> None:
    """A new state dir is private to the user,
    and so are the database and its WAL files."""
    async with opened(short_tmp) as store:
        await register(store)
        assert stat.S_IMODE(os.stat(state_dir(short_tmp)).st_mode) == 0o700
        for name in ("towerd.db", "towerd.db-wal", "towerd.db-shm"):
            path = state_dir(short_tmp) / name
            assert path.exists(), name
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, name


async def test_state_dir_that_is_a_symlink_is_refused(short_tmp: Path) -> None:
    """A state dir that is a symlink (even to a private
    dir) is refused, and nothing is created."""
    real = short_tmp / "real"
    real.mkdir(mode=0o700)
    state_dir(short_tmp).symlink_to(real)
    assert "symlink" in str(await refused(short_tmp))
    assert list(real.iterdir()) == []


@pytest.mark.sqlite_only
async def test_db_path_that_is_a_symlink_is_refused(short_tmp: Path) -> None:
    """towerd.db as a symlink is refused and its target is not touched."""
    private_state_dir(short_tmp)
    target = short_tmp / "elsewhere.db"
    private_file(target, b"")
    db_path(short_tmp).symlink_to(target)
    assert "symlink" in str(await refused(short_tmp))
    assert target.read_bytes() == b""


async def test_state_dir_open_to_others_is_refused(short_tmp: Path) -> None:
    """A state dir with mode 0755 is refused with
    the chmod fix in the message; mode unchanged."""
    directory = state_dir(short_tmp)
    directory.mkdir()
    directory.chmod(0o755)
    message = str(await refused(short_tmp))
    assert "0755" in message and "chmod 700" in message
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o755
    assert not db_path(short_tmp).exists()


@pytest.mark.sqlite_only
async def test_db_file_open_to_others_is_refused(short_tmp: Path) -> None:
    """A database file readable by others is refused."""
    await populated(short_tmp)
    db_path(short_tmp).chmod(0o644)
    assert "chmod 600" in str(await refused(short_tmp))


# --- migrations -----------------------------------------------------------------------
# ----------------


@pytest.mark.sqlite_only
async def test_failed_migration_leaves_version_and_tables_intact(
    short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A v2 step that fails after a good statement rolls back whole: user_version
    stays 1, no new table, the data is all there; a backup copy was taken first."""
    await populated(short_tmp, rows=3)
    shape_before = schema.expected_shape()
    bad_step = schema.Migration(
        CURRENT + 1,
        "a step that breaks halfway",
        (
            "CREATE TABLE added_by_v2 (x INTEGER) STRICT",
            "ALTER TABLE sessions ADD COLUMN v2_column TEXT",
            "INSERT INTO no_such_table VALUES (1)",
        ),
    )
    monkeypatch.setattr(schema, "MIGRATIONS", (*schema.MIGRATIONS, bad_step))
    monkeypatch.setattr(schema, "SCHEMA_VERSION", CURRENT + 1)
    with pytest.raises(sqlite3.OperationalError, match="no_such_table"):
        async with opened(short_tmp):
            pass
    monkeypatch.undo()
    assert query(short_tmp, "PRAGMA user_version") == [(CURRENT,)]
    with closing(sqlite3.connect(db_path(short_tmp))) as conn:
        assert schema.shape_of(conn) == shape_before
    assert query(short_tmp, "SELECT count(*) FROM sessions") == [(3,)]
    backups = list((state_dir(short_tmp) / "backups").iterdir())
    assert len(backups) == 1 and backups[0].name.startswith(f"towerd-v{CURRENT}-")
    # The untouched v1 database still opens with the real ladder.
    async with opened(short_tmp) as store:
        assert store.owner_epoch == 2


@pytest.mark.sqlite_only
async def test_successful_migration_climbs_one_step(
    short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A good v2 step is applied once, stamps user_version 2, and keeps the data."""
    await populated(short_tmp, rows=2)
    good_step = schema.Migration(
        CURRENT + 1, "add a table", ("CREATE TABLE added_by_v2 (x INTEGER) STRICT",)
    )
    monkeypatch.setattr(schema, "MIGRATIONS", (*schema.MIGRATIONS, good_step))
    monkeypatch.setattr(schema, "SCHEMA_VERSION", CURRENT + 1)
    async with opened(short_tmp) as store:
        assert store.owner_epoch == 2
    assert query(short_tmp, "PRAGMA user_version") == [(CURRENT + 1,)]
    assert query(short_tmp, "SELECT count(*) FROM added_by_v2") == [(0,)]
    assert query(short_tmp, "SELECT count(*) FROM sessions") == [(2,)]


@pytest.mark.sqlite_only
async def test_misshapen_old_version_is_refused_before_it_is_migrated(
    short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A v1 file whose tables towerd does not recognise must
    be refused, never reshaped: a v2 towerd opening it refuses
    it with user_version still 1 and the bytes unchanged."""
    await populated(short_tmp, rows=1)
    execute(short_tmp, "ALTER TABLE sessions ADD COLUMN extra TEXT")
    before = sha256(db_path(short_tmp))
    good_step = schema.Migration(
        CURRENT + 1, "add a table", ("CREATE TABLE added_by_v2 (x INTEGER) STRICT",)
    )
    monkeypatch.setattr(schema, "MIGRATIONS", (*schema.MIGRATIONS, good_step))
    monkeypatch.setattr(schema, "SCHEMA_VERSION", CURRENT + 1)
    message = str(await refused(short_tmp))
    assert "table sessions" in message
    assert query(short_tmp, "PRAGMA user_version") == [(CURRENT,)]
    assert sha256(db_path(short_tmp)) == before


@pytest.mark.sqlite_only
async def test_misshapen_rollback_journal_database_is_refused_untouched(
    short_tmp: Path,
) -> None:
    """Refusals happen before anything is written, even for a towerd file that
    is not in WAL mode (e.g. a restored copy): its bytes stay the same."""
    await populated(short_tmp, rows=1)
    execute(short_tmp, "PRAGMA journal_mode = DELETE")
    execute(short_tmp, "ALTER TABLE sessions ADD COLUMN extra TEXT")
    before = sha256(db_path(short_tmp))
    assert "table sessions" in str(await refused(short_tmp))
    assert sha256(db_path(short_tmp)) == before


@pytest.mark.sqlite_only
async def test_a_version_1_database_climbs_the_whole_ladder(
    short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real ladder: a file made by the version-1 code is backed up, climbs every
    step (principal indexes, the lease and effect tables), keeps its rows, and the
    backup is a sound v1 file."""
    monkeypatch.setattr(schema, "MIGRATIONS", schema.MIGRATIONS[:1])
    monkeypatch.setattr(schema, "SCHEMA_VERSION", 1)
    # The version-1 code had no workers or effects whose clocks to restart.
    monkeypatch.setattr(reconcile, "restart_silence_clocks", lambda tx: None)
    await populated(short_tmp, rows=4)
    monkeypatch.undo()
    assert query(short_tmp, "PRAGMA user_version") == [(1,)]
    async with opened(short_tmp) as store:
        assert (
            len(await store.read(lambda tx: tx.conn.execute("SELECT * FROM sessions").fetchall()))
            == 4
        )
    assert query(short_tmp, "PRAGMA user_version") == [(schema.SCHEMA_VERSION,)]
    indexes = {
        row[0] for row in query(short_tmp, "SELECT name FROM sqlite_master WHERE type='index'")
    }
    assert {"idempotency_by_principal", "idempotency_by_principal_state"} <= indexes
    tables = {
        row[0] for row in query(short_tmp, "SELECT name FROM sqlite_master WHERE type='table'")
    }
    assert {"leases", "lease_tokens", "effects"} <= tables
    (backup,) = (state_dir(short_tmp) / "backups").iterdir()
    assert backup.name.startswith("towerd-v1-")
    with closing(sqlite3.connect(backup)) as old:
        assert old.execute("PRAGMA user_version").fetchone() == (1,)
        assert old.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        assert old.execute("SELECT count(*) FROM sessions").fetchone() == (4,)


@pytest.mark.sqlite_only
async def test_a_version_7_database_climbs_to_the_evidence_probe_columns(
    short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Step 8: a version-7 file's effects and keys keep their rows and read back with no
    probe target and no probe yet (nothing to probe until an attempt records one)."""
    from store_helpers import caller
    from towerd.daemon.store import effects, idempotency
    from towerd.protocol.methods import EffectClaimParams, EffectKeyParams

    monkeypatch.setattr(schema, "MIGRATIONS", schema.MIGRATIONS[:7])
    monkeypatch.setattr(schema, "SCHEMA_VERSION", 7)
    claim = EffectClaimParams("run_1", "push", "a-1", "git-push", "refs/heads/x")

    def old_claim(tx, _caller, params):  # the version-7 code wrote no probe columns
        row = {"effect_key": "eff_0123456789abcdef", "run_id": params.run_id,
               "step_id": params.step_id, "attempt_id": params.attempt_id,
               "action_kind": params.action_kind, "target_ref": params.target_ref,
               "status": "uncertain", "payload_hash": b"h", "principal": "p",
               "timeout_ms": 1000, "claimed_at": 1, "heartbeat_at": 1,
               "daemon_id": tx.daemon_id}  # fmt: skip
        tx.conn.execute(
            f"INSERT INTO effects ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})",
            tuple(row.values()),
        )

    async with opened(short_tmp) as store:
        await store.write(old_claim, caller(), claim)
        await store.write(
            lambda tx: tx.conn.execute(
                "INSERT INTO idempotency (principal, operation, key, payload_hash, state, "
                "effect_ref, daemon_id, created_at, updated_at) "
                "VALUES ('p', 'shell', 'k', x'00', 'outcome_unknown', 'r', ?, 1, 1)",
                (tx.daemon_id,),
            )
        )
    monkeypatch.undo()
    assert query(short_tmp, "PRAGMA user_version") == [(7,)]
    async with opened(short_tmp) as store:
        record = await store.read(effects.get, caller(), EffectKeyParams("eff_0123456789abcdef"))
        assert (record.status, record.git, record.probe) == ("uncertain", None, None)
        assert await store.read(idempotency.keys_to_probe, False) == []
    assert query(short_tmp, "PRAGMA user_version") == [(schema.SCHEMA_VERSION,)]
    assert query(short_tmp, "SELECT probe, probe_attempts FROM idempotency") == [(None, 0)]
    assert query(short_tmp, "SELECT git_target, probe_attempts FROM effects") == [(None, 0)]
