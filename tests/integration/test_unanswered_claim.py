"""``towerctl run`` whose claim got no answer: what it says, and that what it says works.

A claim the daemon took but did not answer in time (a stalled daemon: here another
connection holds SQLite's write lock, so the claim's batch waits for it) may still be
recorded after towerctl gave up, and a retry then finds the key ``outcome_unknown``
(exit 120). towerctl says so, and how to settle it, only when a claim reached the
daemon: without a daemon nothing was claimed, and that hint would send a person after
a key that does not exist.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
from contextlib import closing
from pathlib import Path

from towerd.client import IdempotencyKeyUnknown
from towerd_testing import TOWERCTL, towerctl, wait_for

HINT = "The claim may have been recorded"


def test_without_a_daemon_run_says_nothing_was_claimed(short_tmp: Path) -> None:
    run_dir = short_tmp / "run"
    run_dir.mkdir(mode=0o700)
    ran = short_tmp / "ran"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOWERD_")}
    r = subprocess.run(
        [TOWERCTL, "--socket", str(run_dir / "towerd.sock"), "--timeout", "0.3",
         "run", "--key", "k", "--", "touch", str(ran)],
        capture_output=True, text=True, env=env, timeout=30,
    )  # fmt: skip
    assert r.returncode == 3, r.stderr
    assert "cannot connect to towerd" in r.stderr
    assert HINT not in r.stderr and "idem resolve" not in r.stderr
    assert not ran.exists()


def test_a_claim_left_unanswered_exits_3_and_its_hint_settles_the_key(daemon, short_tmp):
    log = short_tmp / "log"
    cmd = ["sh", "-c", f"echo ran >> {log}"]
    lock = sqlite3.connect(daemon.state_dir / "towerd.db", isolation_level=None)
    with closing(lock):
        lock.execute("BEGIN IMMEDIATE")  # the daemon's batches wait (up to its 5 s)
        try:
            stalled = towerctl(daemon, "--timeout", "0.3", "run", "--key", "k", "--", *cmd)
        finally:
            lock.execute("ROLLBACK")
    assert stalled.returncode == 3, stalled.stderr
    assert stalled.stderr.startswith("towerctl: unavailable: ")
    assert HINT in stalled.stderr
    assert "towerctl idem resolve shell k --outcome abandoned" in stalled.stderr
    assert not log.exists()  # CMD was not run

    # The lock gone, the claim commits; its claimant has exited: outcome_unknown.
    with daemon.client() as client:

        def state() -> str | None:
            try:
                return client.idem_get("shell", "k")["state"]
            except IdempotencyKeyUnknown:
                return None  # its batch still waits for its next try

        wait_for(lambda: state() == "outcome_unknown",
                 what="the unanswered claim to commit and turn outcome_unknown")  # fmt: skip
    retry = towerctl(daemon, "run", "--key", "k", "--", *cmd)
    assert retry.returncode == 120, retry.stderr  # as the hint says
    assert not log.exists()

    settled = towerctl(daemon, "idem", "resolve", "shell", "k", "--outcome", "abandoned")
    assert settled.returncode == 0, settled.stderr
    assert towerctl(daemon, "run", "--key", "k", "--", *cmd).returncode == 0
    assert log.read_text().splitlines() == ["ran"]
