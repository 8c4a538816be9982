"""Bounded growth through a real daemon: per-principal quotas (``--quota``), retention
of hook events and messages, and a database file that shrinks once retention ran.

Row counts are read from the daemon's own file with a read-only SQLite connection.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

from towerd.client import Client, TowerdError
from towerd_testing import Daemon, can_mount_tmpfs, spawn_on_small_disk, towerctl, wait_for

TABLES = ("idempotency", "kv", "messages", "events", "effects", "leases", "lease_tokens")
LIMIT = 50
P1 = f"uid:{os.geteuid()}:p1"  # as the daemon names the client's principal


def db_file(daemon: Daemon) -> Path:
    return daemon.state_dir / "towerd.db"


def rows(daemon: Daemon, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    with closing(sqlite3.connect(f"file:{db_file(daemon)}?mode=ro", uri=True)) as conn:
        return conn.execute(sql, args).fetchall()


def row_counts(daemon: Daemon) -> dict[str, int]:
    return {table: rows(daemon, f"SELECT count(*) FROM {table}")[0][0] for table in TABLES}


def on_disk(daemon: Daemon) -> int:
    """The database and its WAL, in bytes."""
    return sum(
        os.path.getsize(path)
        for path in (db_file(daemon), Path(f"{db_file(daemon)}-wal"))
        if path.exists()
    )


def fill(client: Client, table: str, count: int, tag: str, session_id: str) -> list[Any]:
    """``count`` new rows of ``table`` for ``client``'s principal, pipelined."""
    calls: dict[str, Any] = {
        "idempotency": lambda n: ("idem.claim", {"operation": "op", "key": f"{tag}{n}"}),
        "kv": lambda n: ("kv.set", {"scope": "global", "key": f"{tag}{n}", "value": n}),
        "messages": lambda n: ("session.message", {"session_id": session_id, "text": f"{n}"}),
        "events": lambda n: ("event.record", {"kind": "Stop", "agent_session_id": f"{tag}{n}"}),
        "effects": lambda n: (
            "effect.claim",
            {
                "run_id": "r1",
                "step_id": f"{tag}{n}",
                "attempt_id": "a1",
                "action_kind": "git-commit",
                "target_ref": "abc",
            },
        ),
        "leases": lambda n: ("lease.acquire", {"resource": f"{tag}{n}"}),
    }
    return client.call_many([calls[table](n) for n in range(count)])


def test_a_principal_at_its_quota_is_refused_for_every_table_and_others_are_not(
    make_daemon: Any,
) -> None:
    """With --quota 50, a principal's 51st row in each counted table is refused
    quota_exceeded naming the table and the limit; nothing is written; another
    principal goes on; towerctl exits 1 with the same error as JSON."""
    daemon = make_daemon().start("--quota", str(LIMIT))
    with daemon.client(principal="p1") as p1, daemon.client(principal="p2") as p2:
        session = p1.session_register(cwd="/w", agent="claude")["session_id"]
        for table in ("idempotency", "kv", "messages", "events", "effects", "leases"):
            outcomes = fill(p1, table, LIMIT, "a-", session)
            assert not [o for o in outcomes if isinstance(o, Exception)], table
        # Token records stay after their leases are released: p2 fills lease_tokens.
        for n in range(LIMIT):
            granted = p2.lease_acquire(f"t-{n}")
            p2.lease_release(f"t-{n}", granted["fencing_token"])
        before = row_counts(daemon)

        for table in ("idempotency", "kv", "messages", "events", "effects", "leases"):
            (error,) = fill(p1, table, 1, "over-", session)
            assert isinstance(error, TowerdError) and error.code == "quota_exceeded", error
            assert error.data == {
                "table": table, "limit": LIMIT, "rows": LIMIT, "principal": P1,
            }  # fmt: skip
        (error,) = fill(p2, "leases", 1, "over-", session)
        assert (error.code, error.data["table"]) == ("quota_exceeded", "lease_tokens")
        cli = towerctl(daemon, "--json", "--principal", "p1", "kv", "set", "global", "cli", "1")
        assert cli.returncode == 1, cli
        refusal = json.loads(cli.stdout)["error"]
        assert refusal["code"] == "quota_exceeded"
        assert (refusal["data"]["table"], refusal["data"]["limit"]) == ("kv", LIMIT)
        assert row_counts(daemon) == before  # nothing written by any refusal

        for table in ("idempotency", "kv", "messages", "events", "effects"):
            assert not [o for o in fill(p2, table, 1, "b-", session) if isinstance(o, Exception)]
        assert p1.lease_acquire("a-0")["renewed"] is True  # its own lease: no new row


def test_deleting_releasing_or_retention_frees_quota(make_daemon: Any) -> None:
    """At the quota, a delete makes room at once; a released lease's token record and an
    old message make room once the expiry sweep pruned them."""
    daemon = make_daemon().start(
        "--quota", "3", "--expiry-interval", "0.2", "--message-retention-days", "0.00002"
    )
    with daemon.client(principal="p") as client:
        session = client.session_register(cwd="/w", agent="claude")["session_id"]
        for n in range(3):
            client.kv_set("global", f"k{n}", n)
        with pytest.raises(TowerdError) as full:
            client.kv_set("global", "k3", 3)
        assert full.value.code == "quota_exceeded"
        client.kv_delete("global", "k0")
        client.kv_set("global", "k3", 3)

        for n in range(3):
            token = client.lease_acquire(f"r{n}")["fencing_token"]
            client.lease_release(f"r{n}", token)

        def acquired(resource: str) -> bool:
            try:
                client.lease_acquire(resource)
            except TowerdError as exc:
                assert exc.code == "quota_exceeded" and exc.data["table"] == "lease_tokens"
                return False
            return True

        wait_for(lambda: acquired("r-new"), what="the released leases' token records pruned")

        def sent(text: str) -> bool:
            try:
                client.session_message(session, text)
            except TowerdError as exc:
                assert exc.code == "quota_exceeded" and exc.data["table"] == "messages"
                return False
            return True

        for n in range(3):
            assert sent(f"m{n}")
        wait_for(lambda: sent("after retention"), what="old messages pruned")
        assert rows(daemon, "SELECT text FROM messages")[-1] == ("after retention",)


def test_hook_events_under_distinct_agent_session_ids_stay_bounded(make_daemon: Any) -> None:
    """Events under ever new agent session ids escape the per-session cap; the principal's
    quota bounds them at once and the expiry sweep cuts them back to the newest
    --events-per-principal."""
    daemon = make_daemon().start(
        "--quota", "400", "--events-per-principal", "100", "--expiry-interval", "0.2"
    )
    with daemon.client() as client:
        for batch in range(10):
            client.call_many(
                [
                    ("event.record", {"kind": "PreToolUse", "agent_session_id": f"as-{batch}-{n}"})
                    for n in range(500)
                ]
            )
            assert rows(daemon, "SELECT count(*) FROM events")[0][0] <= 400

        def recorded() -> int | None:
            try:
                return client.event_record("Stop", agent_session_id="as-last")["event_id"]
            except TowerdError as exc:
                assert exc.code == "quota_exceeded" and exc.data["table"] == "events"
                return None

        last = wait_for(recorded, what="room for one more event")
        wait_for(
            lambda: rows(daemon, "SELECT count(*), max(event_id) FROM events") == [(100, last)],
            what="events cut back to the newest 100",
        )


def test_retention_shrinks_the_database_file(make_daemon: Any) -> None:
    """About 20 MB of hook events; once the expiry sweep pruned them (by age), the file
    and its WAL shrink to a fraction: freed pages go back to the file system."""
    daemon = make_daemon().start(
        "--event-retention-days", "0.00005",  # 4.3 s: longer than writing the events
        "--expiry-interval", "0.3",
        "--checkpoint-interval", "0.2",
    )  # fmt: skip
    big = {"kind": "PostToolUse", "agent_session_id": "as-big", "payload": {"blob": "x" * 50_000}}
    with daemon.client() as client:
        for _ in range(8):
            client.call_many([("event.record", big)] * 50)
        grown = on_disk(daemon)
        assert grown > 19_000_000
        wait_for(
            lambda: rows(daemon, "SELECT count(*) FROM events") == [(0,)],
            timeout=15,
            what="the events pruned",
        )
        try:
            wait_for(lambda: on_disk(daemon) < grown / 10, timeout=30, what="the file to shrink")
        except AssertionError:
            facts = rows(daemon, "PRAGMA freelist_count") + rows(daemon, "PRAGMA page_count")
            raise AssertionError(f"{on_disk(daemon)} bytes of {grown}; {facts}") from None


@pytest.mark.skipif(can_mount_tmpfs() is not None, reason=can_mount_tmpfs() or "")
def test_without_room_to_switch_auto_vacuum_the_daemon_logs_and_serves(
    make_daemon: Any, short_tmp: Path
) -> None:
    """A database that is not yet INCREMENTAL, on a disk without room to rewrite it: the
    daemon logs the deferral and serves with every row; on a disk with room, the next
    start switches it."""
    seed = make_daemon("seed").start()
    with seed.client() as client:
        kept = client.session_register(cwd="/w", agent="claude", prompt="p" * 60_000)
    assert seed.stop() == 0
    with closing(sqlite3.connect(db_file(seed), isolation_level=None)) as conn:
        conn.execute("PRAGMA auto_vacuum = NONE")
        conn.execute("VACUUM")  # as a file made before auto_vacuum was set
        assert conn.execute("PRAGMA auto_vacuum").fetchone() == (0,)

    daemon = make_daemon()
    mountpoint = short_tmp / "smallfs"
    mountpoint.mkdir(mode=0o700)
    daemon.state_dir = mountpoint / "state"
    spawn_on_small_disk(
        daemon, mountpoint, size="8m", before_exec=f'cp -a "{seed.state_dir}" "$M/state"'
    )
    proc = daemon.proc
    assert proc is not None
    daemon.notify.wait_for("READY=1", timeout=20, alive=lambda: proc.poll() is None)
    with daemon.client() as client:
        assert client.fleet_get(kept["session_id"])["prompt"] == "p" * 60_000
    assert '"incremental_vacuum_deferred"' in daemon.log()
    # SQLite resolves /proc/PID/root to this namespace's /, so read a copy of the files.
    inside = Path(f"/proc/{daemon.pid}/root{daemon.state_dir}")
    copy = short_tmp / "copy"
    copy.mkdir()
    for name in ("towerd.db", "towerd.db-wal"):
        if (inside / name).exists():
            shutil.copyfile(inside / name, copy / name)
    with closing(sqlite3.connect(copy / "towerd.db")) as conn:
        assert conn.execute("PRAGMA auto_vacuum").fetchone() == (0,)
    assert daemon.stop() == 0

    seed.start()
    with seed.client() as client:
        assert client.fleet_get(kept["session_id"])["prompt"] == "p" * 60_000
    assert rows(seed, "PRAGMA auto_vacuum") == [(2,)]
