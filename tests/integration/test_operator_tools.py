"""Operator safety: online backups while writes continue, doctor, bounded WAL, and
refusing a damaged or newer database at start."""

from __future__ import annotations

import json
import shutil
import sqlite3
import threading

from towerd_testing import towerctl, wait_for

EXIT_REFUSED = 78


def test_backup_while_writes_continue_is_consistent_and_opens(daemon, make_daemon, short_tmp):
    """A backup taken while another client keeps writing passes integrity_check, holds
    every row acknowledged before it started, and a towerd started on it serves them."""
    with daemon.client() as client:
        before = [
            client.session_register(cwd="/r", agent="a", name=f"s{n}")["session_id"]
            for n in range(50)
        ]
    stop = threading.Event()
    writes = []

    def keep_writing() -> None:
        with daemon.client() as writer:
            while not stop.is_set():
                writes.append(writer.session_register(cwd="/w", agent="a")["session_id"])

    writer = threading.Thread(target=keep_writing)
    writer.start()
    wait_for(lambda: len(writes) >= 20, what="concurrent writes")
    target = short_tmp / "copy.db"
    result = towerctl(daemon, "--json", "backup", str(target))
    stop.set()
    writer.join(30)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["integrity"] == ["ok"] and report["path"] == str(target)
    copy = sqlite3.connect(target)
    assert copy.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    copied = {row[0] for row in copy.execute("SELECT session_id FROM sessions")}
    copy.close()
    assert set(before) <= copied

    again = towerctl(daemon, "--json", "backup", str(target))
    assert again.returncode == 1 and json.loads(again.stdout)["error"]["code"] == "conflict"

    restored = make_daemon("restored")
    restored.state_dir.mkdir(mode=0o700)
    shutil.copy(target, restored.state_dir / "towerd.db")
    (restored.state_dir / "towerd.db").chmod(0o600)
    restored.start()
    with restored.client() as client:
        served = {row["session_id"] for row in client.iter_fleet()}
    assert set(before) <= served
    assert restored.stop() == 0


def test_doctor_reports_health_and_what_needs_attention(daemon):
    """A healthy daemon: exit 0, every finding ok. A key left outcome_unknown: exit 1,
    the key named, and the fix says how to resolve it."""
    healthy = towerctl(daemon, "--json", "doctor")
    assert healthy.returncode == 0, healthy.stdout + healthy.stderr
    report = json.loads(healthy.stdout)
    assert report["ok"] is True
    assert {f["check"] for f in report["findings"]} >= {
        "daemon",
        "socket dir",
        "socket",
        "state dir",
        "database file",
        "integrity",
        "schema",
        "wal",
        "outcome_unknown",
    }
    with daemon.client(principal="agent-3") as client:
        client.idem_claim("git.push", "branch-x")
        client.idem_mark_unknown("git.push", "branch-x")
    unhealthy = towerctl(daemon, "doctor")
    assert unhealthy.returncode == 1
    assert "git.push/branch-x" in unhealthy.stdout and "idem resolve" in unhealthy.stdout


def test_doctor_without_a_daemon_checks_the_files(daemon):
    """No daemon: doctor says so (exit 1) and still checks the database offline."""
    assert daemon.stop() == 0
    result = towerctl(daemon, "--json", "doctor", "--state-dir", str(daemon.state_dir))
    assert result.returncode == 1
    findings = {f["check"]: f for f in json.loads(result.stdout)["findings"]}
    assert findings["daemon"]["status"] == "error"
    assert findings["integrity"]["status"] == "ok" and "offline" in findings["integrity"]["detail"]


def test_wal_stays_bounded_once_a_long_reader_is_gone(make_daemon):
    """A reader holding an old snapshot lets the WAL grow (no checkpoint can pass it);
    when it ends, the periodic truncating checkpoint shrinks the WAL."""
    daemon = make_daemon()
    daemon.extra_args = ["--checkpoint-interval", "0.2"]
    daemon.start()
    wal = daemon.state_dir / "towerd.db-wal"
    reader = sqlite3.connect(daemon.state_dir / "towerd.db", isolation_level=None)
    reader.execute("BEGIN")
    reader.execute("SELECT count(*) FROM sessions").fetchone()  # holds its snapshot
    with daemon.client() as client:
        for n in range(120):
            client.session_register(cwd="/r", agent="a", prompt=str(n) * 50_000)
    grown = wal.stat().st_size
    assert grown > 5 * 1024 * 1024
    reader.execute("COMMIT")
    reader.close()
    wait_for(lambda: wal.stat().st_size < 1024 * 1024, timeout=15, what="the WAL to shrink")
    assert daemon.stop() == 0


def test_damaged_database_is_refused_at_start_untouched(daemon):
    """Bytes overwritten in table page headers: the next start exits 78 naming the
    failed check, and leaves the file as it found it."""
    with daemon.client() as client:
        for n in range(200):
            client.session_register(cwd="/r", agent="a", prompt=f"row {n} " * 40)
    assert daemon.stop() == 0
    db_path = daemon.state_dir / "towerd.db"
    data = bytearray(db_path.read_bytes())
    page = 4096
    for first in range(2 * page, len(data), 7 * page):  # b-tree page headers, every 7th page
        data[first : first + 12] = b"\x5a" * 12
    db_path.write_bytes(bytes(data))
    damaged = db_path.read_bytes()
    assert daemon.spawn().wait(30) == EXIT_REFUSED
    assert "quick_check" in daemon.log()
    assert db_path.read_bytes() == damaged


def test_newer_database_is_refused_at_start_untouched(daemon):
    assert daemon.stop() == 0
    db_path = daemon.state_dir / "towerd.db"
    db = sqlite3.connect(db_path)
    db.execute("PRAGMA user_version = 99")
    db.close()
    stamped = db_path.read_bytes()
    assert daemon.spawn().wait(30) == EXIT_REFUSED
    assert "99" in daemon.log() and "newer" in daemon.log()
    assert db_path.read_bytes() == stamped


PARKED = """
import signal, sys
from towerd.client import Client
with Client(sys.argv[1]) as client:
    client.effect_claim("run_3", "notify", "a-1", "webhook", "https://hooks.example/deploy")
print("claimed", flush=True)
signal.pause()
"""


def test_doctor_names_effects_waiting_for_a_decision(daemon):
    """A webhook whose claimant died mid-effect is parked uncertain: doctor exits 1,
    names it, and says how to resolve it."""
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-c", PARKED, str(daemon.socket_path)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "claimed"
    proc.kill()
    proc.wait(10)
    with daemon.client() as client:
        wait_for(
            lambda: client.effect_list("run_3")["effects"][0]["status"] == "uncertain",
            timeout=10,
            what="the effect to park",
        )
    result = towerctl(daemon, "doctor")
    assert result.returncode == 1
    assert "https://hooks.example/deploy" in result.stdout and "effects resolve" in result.stdout


def test_doctor_of_a_daemon_on_postgresql_is_healthy_and_names_the_server(make_daemon, pg_dsn):
    """On a PostgreSQL store db_path is the DSN: doctor neither takes it for a state dir
    nor looks for a database file or a WAL; a healthy daemon is exit 0, its integrity
    the server's own account (it used to exit 1, "state dir postgresql:/... does not
    exist", found by running the integration suite on PostgreSQL)."""
    daemon = make_daemon()
    daemon.extra_args += ["--store", pg_dsn]
    daemon.start()
    result = towerctl(daemon, "--json", "doctor", "--state-dir", str(daemon.state_dir))
    assert result.returncode == 0, result.stdout + result.stderr
    findings = {f["check"]: f for f in json.loads(result.stdout)["findings"]}
    assert all(f["status"] == "ok" for f in findings.values()), findings
    assert "wal" not in findings and "database file" not in findings
    assert findings["integrity"]["detail"] == "the PostgreSQL store: ok"
    assert findings["state dir"]["detail"].find(str(daemon.state_dir)) >= 0
