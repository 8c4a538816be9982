"""Under steady writes the WAL file stays bounded.

SQLite can only start its WAL over when no reader holds a mark in it; a read
transaction left open on the daemon's loop (pinned before every batch, or left
over from the last point read) kept one there, and the WAL grew by ~4 KiB per
write, ~30 MB a second at 64 writers, until the 30 s truncating checkpoint.
Each test writes ~16,000 keys (~60 MB of WAL if nothing is reclaimed) and
requires the file to stay within a few auto-checkpoints' worth (1,000 pages).
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
import uuid

from towerd.client import IdempotencyKeyUnknown
from towerd_testing import Daemon, wait_for

WRITERS = 4
ROUNDS = 16  # per writer
KEYS_PER_ROUND = 128  # claimed in one pipelined burst, then completed in another
WAL_BOUND = 16 * 1024 * 1024  # 4x the 1,000-page auto-checkpoint threshold


def wal_bytes(daemon: Daemon) -> int:
    try:
        return os.path.getsize(daemon.state_dir / "towerd.db-wal")
    except FileNotFoundError:
        return 0


def write_keys(daemon: Daemon, failures: list[str]) -> None:
    with daemon.client() as client:
        for _ in range(ROUNDS):
            keys = [str(uuid.uuid4()) for _ in range(KEYS_PER_ROUND)]
            claims = client.call_many(
                [("idem.claim", {"operation": "wal", "key": key}) for key in keys]
            )
            completes = client.call_many(
                [("idem.complete", {"operation": "wal", "key": k, "result": k}) for k in keys]
            )
            failures.extend(repr(o) for o in claims + completes if isinstance(o, Exception))


def run_writers(daemon: Daemon) -> int:
    """All writers to the end; returns the largest WAL size seen meanwhile."""
    failures: list[str] = []
    threads = [threading.Thread(target=write_keys, args=(daemon, failures)) for _ in range(WRITERS)]
    for thread in threads:
        thread.start()
    largest = 0
    while any(thread.is_alive() for thread in threads):
        largest = max(largest, wal_bytes(daemon))
        threads[0].join(0.05)
    for thread in threads:
        thread.join()
    assert not failures, failures[:3]
    with daemon.client() as client:
        assert client.status()["keys"]["completed"] == WRITERS * ROUNDS * KEYS_PER_ROUND
    return max(largest, wal_bytes(daemon))


def test_the_wal_stays_bounded_after_a_point_read(make_daemon):
    """One point read, then only writes: the read's transaction must not stay open."""
    daemon = make_daemon().start()
    with daemon.client() as client:
        try:
            client.idem_get("wal", "nothing-yet")
        except IdempotencyKeyUnknown:
            pass
    largest = run_writers(daemon)
    assert largest < WAL_BOUND, f"the WAL grew to {largest / 1e6:.1f} MB"


def test_the_wal_stays_bounded_while_reads_run_between_the_writes(make_daemon):
    daemon = make_daemon().start()
    stop = threading.Event()

    def read() -> None:
        with daemon.client() as client:
            while not stop.is_set():
                client.call_many([("idem.get", {"operation": "wal", "key": "absent"})] * 4)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        largest = run_writers(daemon)
    finally:
        stop.set()
        reader.join(10)
    assert largest < WAL_BOUND, f"the WAL grew to {largest / 1e6:.1f} MB"


def test_the_loops_read_transaction_ends_when_reads_stop(make_daemon):
    """Point reads share one read transaction for at most a millisecond (daemon/store
    store.py ``SHARED_READ_S``): once they stop, with no write to end it, nothing of the
    daemon's holds a mark in the WAL and a truncating checkpoint gets through."""
    daemon = make_daemon().start()
    with daemon.client() as client:
        client.idem_claim("wal", "written")  # frames in the WAL for a checkpoint to move
        for _ in range(50):  # absent keys are never cached: each read goes to SQLite
            with contextlib.suppress(IdempotencyKeyUnknown):
                client.idem_get("wal", "absent")

        def truncated() -> bool:
            with contextlib.closing(sqlite3.connect(daemon.state_dir / "towerd.db")) as conn:
                conn.execute("PRAGMA busy_timeout = 0")
                busy, _, _ = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
            return busy == 0 and wal_bytes(daemon) == 0

        wait_for(truncated, timeout=5, what="a truncating checkpoint with no reader in the way")
        assert client.idem_get("wal", "written")["state"] == "in_progress"
