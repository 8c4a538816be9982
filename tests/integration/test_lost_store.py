"""A database deleted or replaced under the daemon: nothing more is acknowledged, the
daemon stops, and the next start refuses to mint a fresh identity (which would forget
every acknowledged key) unless told --new-store."""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
from contextlib import closing
from pathlib import Path

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


def test_a_backup_copied_over_the_running_database_is_noticed(daemon, short_tmp):
    """A backup copied over the live file in place (`cp`: same inode, which the file
    guard cannot see), after a checkpoint had moved every page into the file: the daemon
    served the backup's rows, so a key it had acknowledged completed was claimed again
    (a hostile tester's reproducer). The file's generation is older than the daemon's:
    the write is refused, nothing more is acknowledged, and the daemon stops."""
    db, backup = daemon.state_dir / "towerd.db", short_tmp / "backup.db"
    with daemon.client() as client:
        client.backup(str(backup))
    _complete(daemon, "after-backup")
    with closing(sqlite3.connect(db)) as conn:  # as a checkpoint under steady writes does
        conn.execute("PRAGMA busy_timeout = 5000")
        assert conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0] == 0
    inode = os.stat(db).st_ino
    shutil.copyfile(backup, db)
    assert os.stat(db).st_ino == inode
    with daemon.client() as client:
        with pytest.raises(Unavailable) as refused:
            client.idem_claim("push", "after-backup")  # old code: "claimed", run again
    # The write batch or the once-a-second guard noticed first: either way, refused.
    assert refused.value.data.get("reason") in ("store_lost", "closed", "connection"), refused
    assert daemon.proc.wait(10) == EXIT_REFUSED
    assert "an older copy (a backup?) was written over it" in daemon.log()


def test_an_idle_daemon_notices_by_itself(daemon):
    """No request needed: the guard sees the file gone within about a second."""
    (daemon.state_dir / "towerd.db").unlink()
    assert daemon.proc.wait(10) == EXIT_REFUSED
    assert '"store_lost"' in daemon.log()


def test_an_idle_daemon_notices_a_backup_copied_over_it_by_itself(daemon, short_tmp):
    """No request needed either for a backup copied over the file in place (same inode,
    the file guard sees nothing): the once-a-second guard reads the file's generation,
    finds one this daemon never wrote, and the daemon stops before anyone is answered
    from the backup."""
    db, backup = daemon.state_dir / "towerd.db", short_tmp / "backup.db"
    with daemon.client() as client:
        client.backup(str(backup))
    _complete(daemon, "after-backup")
    with closing(sqlite3.connect(db)) as conn:
        conn.execute("PRAGMA busy_timeout = 5000")
        assert conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()[0] == 0
    shutil.copyfile(backup, db)
    assert daemon.proc.wait(10) == EXIT_REFUSED
    assert "an older copy (a backup?) was written over it" in daemon.log()


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


# --- a database rolled back: restored from a backup, or a copy put back --------------------


def _refused_as_older(daemon) -> None:
    before = (daemon.state_dir / "towerd.db").read_bytes()
    assert daemon.spawn().wait(20) == EXIT_REFUSED
    log = daemon.log()
    assert "older than the one this daemon last ran" in log and "--new-store" in log, log
    assert (daemon.state_dir / "towerd.db").read_bytes() == before, "the refused file changed"


def _put_back(daemon, copy) -> None:
    for name in DB_FILES:
        (daemon.state_dir / name).unlink(missing_ok=True)
    shutil.copy2(copy, daemon.state_dir / "towerd.db")


def test_a_backup_restored_over_a_newer_database_is_refused(daemon, short_tmp):
    """`towerctl backup`, a key completed after it, the backup copied back over the
    database: the daemon id is right, yet the key completed since is not in it (its
    step would run again). The start is refused (exit 78), the file untouched;
    --new-store runs on it knowingly, and the later key is then indeed unknown."""
    from towerd.client import IdempotencyKeyUnknown
    from towerd_testing import towerctl

    _complete(daemon, "before")
    copy = short_tmp / "copy.db"
    towerctl(daemon, "backup", str(copy), check=True)
    _complete(daemon, "after")
    assert daemon.stop() == 0
    _put_back(daemon, copy)
    _refused_as_older(daemon)
    daemon.start("--new-store")
    with daemon.client() as client:
        assert client.idem_get("push", "before")["state"] == "completed"
        with pytest.raises(IdempotencyKeyUnknown):
            client.idem_get("push", "after")
    assert daemon.stop() == 0
    daemon.start()  # adopted: an ordinary start from now on
    assert daemon.stop() == 0


def test_a_copy_taken_while_stopped_is_refused_after_a_later_start(daemon, short_tmp):
    """A plain copy of the stopped daemon's files (no towerctl backup) put back after the
    daemon ran again: every start begins a new generation, so it is older."""
    _complete(daemon, "before")
    assert daemon.stop() == 0
    copy = short_tmp / "stopped.db"
    shutil.copy2(daemon.state_dir / "towerd.db", copy)
    assert not (daemon.state_dir / "towerd.db-wal").exists() or (
        daemon.state_dir / "towerd.db-wal").stat().st_size == 0  # fmt: skip
    daemon.start()
    _complete(daemon, "after")
    assert daemon.stop() == 0
    _put_back(daemon, copy)
    _refused_as_older(daemon)


@pytest.mark.parametrize("point", ["generation.both_accepted", "generation.in_database"])
def test_a_start_killed_while_it_records_a_new_generation_starts_again(daemon, point):
    """SIGKILL between the steps of a generation change (the record holding both, the
    database taking the new one): the next start is not taken for a restored copy."""
    _complete(daemon, "before")
    assert daemon.stop() == 0
    proc = daemon.spawn(env=daemon.env(TOWERD_CRASH_AT=point))
    assert proc.wait(20) == -9
    daemon.start()
    with daemon.client() as client:
        assert client.idem_get("push", "before")["state"] == "completed"
    assert daemon.stop() == 0
    daemon.start()
    assert daemon.stop() == 0


def test_concurrent_backups_never_leave_a_database_the_next_start_refuses(daemon, short_tmp):
    """Each backup starts a new generation; two at once used to interleave their steps
    (and share a temporary file name), leaving a record that did not accept the
    database's own generation: the next ordinary start was refused (a tester's
    reproducer, within a few dozen rounds of two backups)."""
    import subprocess

    from towerd_testing import TOWERCTL

    _complete(daemon, "before")
    for round_ in range(30):
        backups = [
            subprocess.Popen(
                [
                    TOWERCTL,
                    "--socket",
                    str(daemon.socket_path),
                    "backup",
                    str(short_tmp / f"b{round_}-{i}.db"),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )  # fmt: skip
            for i in range(4)
        ]
        assert [backup.wait(60) for backup in backups] == [0] * 4
    assert "generation_not_rotated" not in daemon.log()
    assert daemon.stop() == 0
    daemon.start()
    with daemon.client() as client:
        assert client.idem_get("push", "before")["state"] == "completed"


def _traced_by(pid: int, tracer: int) -> bool:
    """Whether every thread of ``pid`` is stopped under ``tracer`` (strace attached)."""
    tasks = list((Path("/proc") / str(pid) / "task").iterdir())
    return bool(tasks) and all(
        f"TracerPid:\t{tracer}\n" in (task / "status").read_text() for task in tasks
    )


@pytest.mark.skipif(
    shutil.which("strace") is None or os.geteuid() != 0,
    reason="needs strace(1) and root to fail one of the daemon's renames",
)
def test_a_failed_rotation_after_a_half_recorded_one_leaves_a_database_the_next_start_takes(
    daemon, short_tmp
):
    """A backup's rotation whose last record write fails (the database took the new
    generation, the record still accepts the old and the new), then a backup whose
    rotation cannot write the database (another process holds SQLite's write lock):
    the daemon used to keep the old generation as current after the first, so the
    second recorded old + newest, leaving out the one the database holds, and the
    next ordinary start refused the current database as a restored copy. The first
    fault is real (strace makes the kernel fail that rename with ENOSPC), the second a
    real lock; the start must take the database, and an older backup stay refused."""
    from towerd_testing import towerctl, wait_for

    _complete(daemon, "before")
    older = short_tmp / "older.db"
    towerctl(daemon, "backup", str(older), check=True)
    # The renames of a backup: the copy into place, the record accepting both
    # generations, then the record accepting the new one only: that third one fails.
    trace = short_tmp / "renames.trace"
    strace = subprocess.Popen(
        ["strace", "-qq", "-f", "-o", str(trace), "-e", "trace=rename,renameat,renameat2",
         "-e", "inject=rename,renameat,renameat2:error=ENOSPC:when=3", "-p", str(daemon.pid)],
    )  # fmt: skip
    try:
        wait_for(lambda: _traced_by(daemon.pid, strace.pid), what="strace attached")
        towerctl(daemon, "backup", str(short_tmp / "first.db"), check=True)
    finally:
        strace.terminate()
        strace.wait(10)
    renames = trace.read_text()
    assert renames.count("(INJECTED)") == 1, renames
    injected = next(line for line in renames.splitlines() if "(INJECTED)" in line)
    assert injected.split(", ")[-1].startswith(f'"{daemon.state_dir / "generation"}"'), renames
    assert len((daemon.state_dir / "generation").read_text().split()) == 2

    with sqlite3.connect(daemon.state_dir / "towerd.db", isolation_level=None) as holder:
        holder.execute("BEGIN IMMEDIATE")  # past the daemon's busy timeout (5 s)
        towerctl(daemon, "backup", str(short_tmp / "second.db"), check=True)
        holder.execute("COMMIT")
    assert "generation_not_rotated" in daemon.log()

    _complete(daemon, "after")
    assert daemon.stop() == 0
    daemon.start()  # refused (exit 78) before the fix
    with daemon.client() as client:
        assert client.idem_get("push", "after")["state"] == "completed"
    assert daemon.stop() == 0
    _put_back(daemon, older)
    _refused_as_older(daemon)
