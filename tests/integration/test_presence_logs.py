"""A box declared dead is logged by the box that declared it, whenever its transaction
committed: also when the presence heartbeat that declared it committed after its
caller had given up on it (the store's 5 s deadline).

Real parts: two daemons on one real PostgreSQL database, box a killed with kill -9,
and box b's server processes (its backends) stopped with SIGSTOP and continued with
SIGCONT: a server that hangs, then goes on. While they are stopped, b's heartbeat waits
on the server; it is answered ``unavailable`` at its deadline (b logs
``presence_beat_failed``); continued, the same transaction runs and commits, and it is
the one that declares box a dead. The old code logged ``box_declared_dead`` only from
the heartbeat's answer, so this death went unlogged.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

from pg_cluster import ROLE, Databases, PgCluster
from towerd_testing import Daemon, wait_for

PRESENCE = ["--presence-interval", "0.5", "--presence-ttl", "5"]


def log_events(daemon: Daemon, event: str) -> list[dict[str, Any]]:
    found = []
    for line in daemon.log().splitlines():
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if isinstance(record, dict) and record.get("event") == event:
                found.append(record)
    return found


def backends(cluster: PgCluster, database: str) -> dict[int, str]:
    """pid -> state of the towerd daemons' server processes on ``database`` that came in
    over the Unix socket (a daemon reaching the server over TCP is not among them)."""
    rows = cluster.psql(
        "postgres",
        f"""SELECT pid, state FROM pg_stat_activity
            WHERE datname = '{database}' AND usename = '{ROLE}'
              AND application_name = 'towerd' AND client_addr IS NULL""",
    )
    return {pid: state for pid, state in rows}


@contextlib.contextmanager
def hung(cluster: PgCluster, database: str, deadline_s: float = 10.0) -> Iterator[list[int]]:
    """Stop the server processes of the daemon(s) on ``database``'s Unix socket with
    SIGSTOP, each between two transactions (idle: no transaction of theirs is open on
    the server, so nothing of the server's own times out meanwhile); SIGCONT them at
    exit, whatever happens."""
    stopped: list[int] = []
    try:
        until = time.monotonic() + deadline_s
        while True:
            pids = list(backends(cluster, database))
            assert pids, "no daemon backend to stop"
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
            # A stopped process's state stays as it last reported it.
            states = backends(cluster, database)
            if all(states.get(pid) == "idle" for pid in pids):
                break
            for pid in stopped:  # one was inside a transaction: let it finish, again
                os.kill(pid, signal.SIGCONT)
            stopped.clear()
            assert time.monotonic() < until, f"the backends were never all idle: {states}"
        yield stopped
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def silent_for_ms(cluster: PgCluster, database: str, daemon_id: str) -> int:
    """How long ago (server clock) box ``daemon_id`` last heartbeat."""
    ((silent,),) = cluster.psql(
        database,
        f"""SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint - presence_at
            FROM daemons WHERE daemon_id = '{daemon_id}'""",
    )
    return int(silent)


def test_a_heartbeat_that_commits_after_its_deadline_still_logs_the_box_it_declared_dead(
    make_daemon: Callable[..., Daemon], pg_databases: Databases
) -> None:
    cluster = pg_databases.cluster
    unix = pg_databases()  # over the server's Unix socket
    name = pg_databases.names[unix]
    a = make_daemon("a")
    a.extra_args = ["--store", cluster.tcp_dsn(name), *PRESENCE]  # not stopped: over TCP
    b = make_daemon("b")
    b.extra_args = ["--store", unix, *PRESENCE]
    a.start()
    b.start()
    with a.client() as ca:
        dead = ca.status()["daemon_id"]
        assert ca.idem_claim("deploy", "release-3")["state"] == "claimed"
    a.kill9()
    # Silent for a second already (so that b's stalled heartbeat finds it lapsed), four
    # more before b's next heartbeat could.
    wait_for(lambda: silent_for_ms(cluster, name, dead) >= 1000, 5, "box a to fall silent")
    try:
        with hung(cluster, name):
            wait_for(lambda: log_events(b, "presence_beat_failed"), 8, "b's heartbeat to fail")
            assert not log_events(b, "box_declared_dead")
        # Continued: the heartbeat given up on commits now, and declares box a dead.
        ((dead_at,),) = wait_for(
            lambda: cluster.psql(
                name,
                f"SELECT dead_at FROM daemons WHERE daemon_id = '{dead}' AND dead_at IS NOT NULL",
            ),
            10,
            "box a to be declared dead",
        )
        logged = wait_for(
            lambda: [e for e in log_events(b, "box_declared_dead") if e.get("box") == dead],
            5,
            "box b to log box_declared_dead",
        )
        assert len(logged) == 1, logged
        assert logged[0]["declared_at"] == dead_at
        assert logged[0]["keys_unknown"] == 1 and logged[0]["code"] == "unavailable"
        # It was the heartbeat given up on: its failure was logged before the death.
        lines = b.log().splitlines()
        failed = next(i for i, line in enumerate(lines) if "presence_beat_failed" in line)
        declared = next(i for i, line in enumerate(lines) if "box_declared_dead" in line)
        assert failed < declared
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n--- b's log ---\n{b.log()[-6000:]}") from exc
