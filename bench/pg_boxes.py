"""Two boxes on one PostgreSQL database: towerd against PostgreSQL used directly.

    .venv/bin/python bench/pg_boxes.py [--seconds 4] [--clients 1,8,64] [--quick] [--keep]
                                       [--no-statements]

Starts its own private PostgreSQL cluster (tests/pg_cluster.py, ``durable=True``:
fsync, full_page_writes and synchronous_commit on; clients, daemons and server talk
over its Unix socket), one fresh database migrated by towerd's schema ladder, and two
real towerd daemons on it (boxes A and B: each its own state dir and socket, ``--store
DSN``). For each N (client processes *per box*: 2N in all, half on each box), every
measurement with fresh keys or resources:

* (a) durable claim + complete: one op = ``idem_claim`` then ``idem_complete`` of a
  fresh key through the blocking ``Client`` of a process, one op after the other;
  once through both boxes, once with all 2N processes on box A (one box);
* (b) lease acquire + release: one op = ``lease_acquire`` then ``lease_release`` of
  the process's own resource (no contention), and once all 2N processes on one
  resource (one op = an attempt: a refused acquire (``LeaseHeld``) ends it, a grant
  is released at once);

against the baseline, the same transactions run by the client processes directly on
PostgreSQL with psycopg (each its own connection, autocommit, in a database of its
own): claim = ``INSERT ... ON CONFLICT DO NOTHING`` into a small table, complete =
``UPDATE ... WHERE state = 'in_progress'``, each its own committed transaction; lease
acquire = one transaction of a token counter upsert (``ON CONFLICT DO UPDATE SET
last_token = last_token + 1 RETURNING``) and a lease upsert guarded by expiry (rolled
back when the lease is held), release = one ``DELETE ... WHERE token = ?``.

(c) Reads: ``ping``, ``fleet.get`` (an existing row) and ``idem.get`` (an existing
completed key) on box A (PostgreSQL: there is no read cache on this backend, every
read is a round trip to the server from the daemon's reader thread) against the same
on one SQLite daemon (embedded; the hot row comes from its read cache) in the same
run, with 1 and 50 clients (bench/_loadgen.py: one uvloop process, pre-encoded
frames, one request in flight per connection), 3 rounds interleaved and pooled.

Workers are forked, connect, and wait on a barrier; a second barrier starts the window
together, and only ops that finished inside the window are counted; they stay
connected until the parent has read the CPU counters after the window. Latency is one
whole op. CPU columns are percent of one core over the window: ``towerd`` both
daemons together, ``pg`` every process of the PostgreSQL server (backends, WAL
writer, checkpointer, and the children it reaped), ``clients`` all worker processes,
``other`` the rest of the machine's busy CPU (rows above 50% are listed as disturbed);
``busy`` is the share of all the machine's cores in use. Everything shares this
machine's cores. ``stmts/op`` counts the statements the server ran on the row's
database per op (pg_stat_statements, loaded into the cluster unless
``--no-statements``; BEGIN and COMMIT are left out), ``WAL B/op`` the WAL it wrote.
At the end, what each daemon logged (at ``--log-level warning``) is counted. The
daemons and the cluster are stopped on the way out, also on Ctrl-C, SIGTERM or an
error.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid
from array import array
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import psycopg
from _loadgen import LoadResult, ensure_fd_limit, machine_busy_seconds, process_cpu_seconds
from _loadgen import run_load as _run_load

from benchlib import Daemon, machine, percentile
from towerd.client import Client, LeaseHeld

HERE = Path(__file__).resolve().parent
BARRIER_TIMEOUT = 120.0
LEASE_TTL_MS = 60_000
READ_CLIENTS = (1, 50)
DISTURBED_PCT = 50  # "other" CPU above this share of a core: flagged in the report
BOX_ARGS = ["--log-level", "warning"]

# --- the direct baseline's schema and statements --------------------------------------

DIRECT_DDL = [
    """CREATE TABLE direct_idem (
        principal TEXT NOT NULL,
        operation TEXT NOT NULL,
        key TEXT NOT NULL,
        payload_hash BYTEA NOT NULL,
        state TEXT NOT NULL,
        effect_ref TEXT NOT NULL,
        result BYTEA,
        holder_pid BIGINT,
        created_at BIGINT NOT NULL,
        updated_at BIGINT NOT NULL,
        PRIMARY KEY (principal, operation, key)
    )""",
    """CREATE TABLE direct_lease_tokens (
        resource TEXT PRIMARY KEY,
        last_token BIGINT NOT NULL
    )""",
    """CREATE TABLE direct_leases (
        resource TEXT PRIMARY KEY,
        token BIGINT NOT NULL,
        holder_pid BIGINT NOT NULL,
        expires_at BIGINT NOT NULL
    )""",
]
PRINCIPAL = f"uid:{os.geteuid()}:default"
NULL_HASH = bytes(32)
CLAIM_SQL = """INSERT INTO direct_idem (principal, operation, key, payload_hash, state,
    effect_ref, holder_pid, created_at, updated_at)
    VALUES (%s, %s, %s, %s, 'in_progress', %s, %s, %s, %s) ON CONFLICT DO NOTHING"""
COMPLETE_SQL = """UPDATE direct_idem SET state = 'completed', result = %s, updated_at = %s
    WHERE principal = %s AND operation = %s AND key = %s AND state = 'in_progress'
    AND holder_pid = %s"""
TOKEN_SQL = """INSERT INTO direct_lease_tokens (resource, last_token) VALUES (%s, 1)
    ON CONFLICT (resource) DO UPDATE SET last_token = direct_lease_tokens.last_token + 1
    RETURNING last_token"""
LEASE_SQL = """INSERT INTO direct_leases (resource, token, holder_pid, expires_at)
    VALUES (%s, %s, %s, %s)
    ON CONFLICT (resource) DO UPDATE SET token = excluded.token,
        holder_pid = excluded.holder_pid, expires_at = excluded.expires_at
    WHERE direct_leases.expires_at <= %s
    RETURNING token"""
RELEASE_SQL = "DELETE FROM direct_leases WHERE resource = %s AND token = %s"
# Statements run on one database since the last reset, but for the transaction brackets
# (pg_stat_statements does not count every BEGIN and COMMIT it sees: they are left out).
STATEMENTS_SQL = """SELECT coalesce(sum(s.calls), 0) FROM pg_stat_statements s
    JOIN pg_database d ON d.oid = s.dbid
    WHERE d.datname = %s AND upper(s.query) NOT IN ('BEGIN', 'COMMIT', 'ROLLBACK')"""


def now_ms() -> int:
    return int(time.time() * 1000)


# --- workers (forked) ------------------------------------------------------------------


@dataclass
class Sync:
    """Start line shared by the parent and its workers."""

    ready: Any  # multiprocessing Barrier: every worker connected
    go: Any  # multiprocessing Barrier: the window starts
    deadline: Any  # shared double, time.monotonic() at the end of the window
    measured: Any  # multiprocessing Event: the parent read the CPU counters after the window

    def start(self) -> float:
        """Called by a worker once set up; returns the end of the window."""
        self.ready.wait(BARRIER_TIMEOUT)
        self.go.wait(BARRIER_TIMEOUT)
        return float(self.deadline.value)

    def hold(self) -> None:
        """Called by a worker after its last op, before it disconnects: its process and its
        server backend stay until the parent has read their CPU after the window."""
        self.measured.wait(BARRIER_TIMEOUT)


# ops inside the window, their latencies (ms), refused acquires, fencing tokens granted
Outcome = tuple[int, array, int, array]
Body = Callable[[int, int, Any, Sync], Outcome]


@dataclass(frozen=True)
class Work:
    """What a worker does: ``where`` is the boxes' sockets (a worker takes one by its
    index) or the direct database's DSN; ``name`` the operation or resource prefix."""

    where: tuple[Path, ...] | str
    name: str
    contended: bool = False

    def socket(self, index: int) -> Path:
        assert isinstance(self.where, tuple)
        return self.where[index % len(self.where)]

    def resource(self, index: int) -> str:
        return f"{self.name}/hot" if self.contended else f"{self.name}/c{index}"


def towerd_claims(index: int, n: int, work: Work, sync: Sync) -> Outcome:
    latencies = array("d")
    with Client(work.socket(index), codec="msgspec") as client:
        deadline = sync.start()
        i = 0
        while True:
            key = f"p{index}-{i}"
            started = time.monotonic()
            client.idem_claim(work.name, key)
            client.idem_complete(work.name, key, {"i": i})
            finished = time.monotonic()
            if finished > deadline:
                break
            latencies.append((finished - started) * 1000)
            i += 1
        sync.hold()
    return len(latencies), latencies, 0, array("q")


def towerd_leases(index: int, n: int, work: Work, sync: Sync) -> Outcome:
    latencies, tokens, refused = array("d"), array("q"), 0
    resource = work.resource(index)
    with Client(work.socket(index), codec="msgspec") as client:
        deadline = sync.start()
        while True:
            started = time.monotonic()
            try:
                granted = client.lease_acquire(resource, ttl_ms=LEASE_TTL_MS)
            except LeaseHeld:
                held = True
            else:
                held = False
                client.lease_release(resource, granted["fencing_token"])
            finished = time.monotonic()
            if finished > deadline:
                break
            latencies.append((finished - started) * 1000)
            if held:
                refused += 1
            else:
                tokens.append(granted["fencing_token"])
        sync.hold()
    return len(latencies), latencies, refused, tokens


def direct_claims(index: int, n: int, work: Work, sync: Sync) -> Outcome:
    latencies = array("d")
    pid = os.getpid()
    assert isinstance(work.where, str)
    with psycopg.connect(work.where, autocommit=True) as conn:
        deadline = sync.start()
        i = 0
        while True:
            key = f"d{index}-{i}"
            started = time.monotonic()
            at = now_ms()
            claimed = conn.execute(
                CLAIM_SQL,
                (PRINCIPAL, work.name, key, NULL_HASH, str(uuid.uuid4()), pid, at, at),
            )
            if claimed.rowcount != 1:
                raise RuntimeError(f"direct claim of {key}: the key exists")
            result = msgspec.msgpack.encode({"i": i})
            completed = conn.execute(
                COMPLETE_SQL, (result, now_ms(), PRINCIPAL, work.name, key, pid)
            )
            if completed.rowcount != 1:
                raise RuntimeError(f"direct complete of {key}: not in progress")
            finished = time.monotonic()
            if finished > deadline:
                break
            latencies.append((finished - started) * 1000)
            i += 1
        sync.hold()
    return len(latencies), latencies, 0, array("q")


def direct_leases(index: int, n: int, work: Work, sync: Sync) -> Outcome:
    latencies, tokens, refused = array("d"), array("q"), 0
    pid = os.getpid()
    resource = work.resource(index)
    assert isinstance(work.where, str)
    with psycopg.connect(work.where, autocommit=True) as conn:
        deadline = sync.start()
        while True:
            started = time.monotonic()
            token = None
            with conn.transaction():
                (issued,) = conn.execute(TOKEN_SQL, (resource,)).fetchone()  # type: ignore[misc]
                at = now_ms()
                row = conn.execute(
                    LEASE_SQL, (resource, issued, pid, at + LEASE_TTL_MS, at)
                ).fetchone()
                if row is None:  # held by another: the token is not issued either
                    raise psycopg.Rollback()
                token = row[0]
            if token is not None:
                released = conn.execute(RELEASE_SQL, (resource, token))
                if released.rowcount != 1:
                    raise RuntimeError(f"direct release of {resource} token {token}: not held")
            finished = time.monotonic()
            if finished > deadline:
                break
            latencies.append((finished - started) * 1000)
            if token is None:
                refused += 1
            else:
                tokens.append(token)
        sync.hold()
    return len(latencies), latencies, refused, tokens


def _worker_main(body: Body, index: int, n: int, arg: Any, sync: Sync, results: Any) -> None:
    try:
        ops, latencies, refused, tokens = body(index, n, arg, sync)
        results.put((index, ops, latencies.tobytes(), refused, tokens.tobytes(), None))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        sync.ready.abort()
        sync.go.abort()
        sync.measured.set()
        results.put((index, 0, b"", 0, b"", f"{type(exc).__name__}: {exc}"))


# --- measuring -------------------------------------------------------------------------


@dataclass
class Sample:
    label: str
    kind: str  # "claim", "lease", "hot lease": what the direct row of the same N is for
    n: int  # client processes per box
    processes: int
    seconds: float
    ops: int
    latencies: list[float]
    refused: int = 0
    tokens: list[int] | None = None
    towerd_cpu: float | None = None  # percent of one core, both daemons
    pg_cpu: float | None = None  # percent of one core, the whole server
    clients_cpu: float | None = None  # percent of one core, all worker processes
    machine_busy: float | None = None  # percent of all cores
    other_cpu: float | None = None  # percent of one core: busy CPU that is none of the above
    statements_per_op: float | None = None  # pg_stat_statements, BEGIN/COMMIT not counted
    wal_per_op: float | None = None  # bytes of WAL the server wrote per op

    @property
    def rate(self) -> float:
        return self.ops / self.seconds

    @property
    def grants(self) -> float:
        return (self.ops - self.refused) / self.seconds

    @property
    def direct(self) -> bool:
        return self.label.startswith("direct")


class PgServer:
    """CPU of every process of the cluster's server: the postmaster and its children
    (each backend, the WAL writer, the checkpointer; PostgreSQL puts every child in a
    process group of its own, so the group does not find them)."""

    def __init__(self, postmaster: int) -> None:
        self.postmaster = postmaster

    def pids(self) -> list[int]:
        found = [self.postmaster]
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as handle:
                    ppid = int(handle.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == self.postmaster:
                found.append(int(entry))
        return found

    def cpu_seconds(self) -> float:
        """The live processes' own CPU, and the postmaster's children's that exited (their
        time is added to its ``cutime``/``cstime`` when it reaps them: autovacuum workers
        come and go, and so does every backend of a direct client that disconnects)."""
        try:
            with open(f"/proc/{self.postmaster}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
        reaped = (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")
        return reaped + _cpu(self.pids())


def _machine_ticks() -> tuple[int, int]:
    with open("/proc/stat") as handle:
        values = [int(v) for v in handle.readline().split()[1:]]
    return sum(values), values[3] + values[4]  # all, idle + iowait


@contextmanager
def _sampling_priority() -> Iterator[None]:
    """The parent's CPU readings at the window's edges must not wait behind 2N runnable
    workers (on 2 cores a reading of /proc then takes seconds): nice -10 while it measures
    (root only; it sleeps through the window). Forked before, the workers keep nice 0."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, -10)
    except PermissionError:
        yield
        return
    try:
        yield
    finally:
        os.setpriority(os.PRIO_PROCESS, 0, 0)


def _cpu(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            total += process_cpu_seconds(pid)
        except OSError:
            pass  # gone: a worker that failed (reported) or a backend that ended
    return total


def measure(
    label: str,
    kind: str,
    body: Body,
    n: int,
    processes: int,
    work: Work,
    seconds: float,
    towerd_pids: list[int],
    pg: PgServer,
) -> Sample:
    """Fork ``processes`` workers, start them together, collect what they did in the window."""
    ctx = mp.get_context("fork")
    sync = Sync(
        ctx.Barrier(processes + 1), ctx.Barrier(processes + 1), ctx.RawValue("d", 0.0), ctx.Event()
    )
    results = ctx.Queue()
    workers = [
        ctx.Process(target=_worker_main, args=(body, index, n, work, sync, results), daemon=True)
        for index in range(processes)
    ]
    try:
        for worker in workers:
            worker.start()
        with _sampling_priority():
            try:
                sync.ready.wait(BARRIER_TIMEOUT)
            except threading.BrokenBarrierError:
                error = results.get(timeout=30)[5]  # the first worker that failed aborted them
                raise RuntimeError(f"{label}: a worker failed before the window: {error}") from None
            # Every worker waits at the start line: nothing competes with these reads.
            clients = [worker.pid for worker in workers if worker.pid]
            towerd_before, pg_before = _cpu(towerd_pids), pg.cpu_seconds()
            clients_before = _cpu(clients)
            machine_before, ticks_before = machine_busy_seconds(), _machine_ticks()
            window_start = time.monotonic()
            sync.deadline.value = window_start + seconds
            sync.go.wait(BARRIER_TIMEOUT)
            time.sleep(max(0.0, sync.deadline.value - time.monotonic()))
            # At the deadline the workers are finishing their last op (not counted): every
            # process, and every backend of the direct baseline, still runs.
            elapsed = time.monotonic() - window_start
            towerd_after, pg_after = _cpu(towerd_pids), pg.cpu_seconds()
            clients_after = _cpu(clients)
            machine_after, ticks_after = machine_busy_seconds(), _machine_ticks()
            sync.measured.set()
        outcomes = [results.get(timeout=BARRIER_TIMEOUT) for _ in workers]
        for worker in workers:
            worker.join(30)
    finally:
        for worker in workers:
            if worker.is_alive():
                worker.kill()
                worker.join(10)
    failures = [error for *_, error in outcomes if error]
    if failures:
        raise RuntimeError(f"{label}: {len(failures)} worker(s) failed: {failures[0]}")
    latencies: list[float] = []
    tokens: list[int] = []
    for _, _, data, _, granted, _ in outcomes:
        chunk = array("d")
        chunk.frombytes(data)
        latencies.extend(chunk)
        issued = array("q")
        issued.frombytes(granted)
        tokens.extend(issued)
    total, idle = (after - before for after, before in zip(ticks_after, ticks_before, strict=True))
    ours = (
        (towerd_after - towerd_before) + (pg_after - pg_before) + (clients_after - clients_before)
    )
    return Sample(
        label=label,
        kind=kind,
        n=n,
        processes=processes,
        seconds=seconds,
        ops=sum(outcome[1] for outcome in outcomes),
        latencies=latencies,
        refused=sum(outcome[3] for outcome in outcomes),
        tokens=tokens,
        towerd_cpu=100 * (towerd_after - towerd_before) / elapsed if towerd_pids else None,
        pg_cpu=100 * (pg_after - pg_before) / elapsed,
        clients_cpu=100 * (clients_after - clients_before) / elapsed,
        machine_busy=100 * (total - idle) / total if total else None,
        other_cpu=100 * max(0.0, machine_after - machine_before - ours) / elapsed,
    )


def query(dsn: str, sql: str, args: tuple[Any, ...] = ()) -> Any:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(sql, args).fetchone()
    assert row is not None
    return row[0]


@dataclass
class Bench:
    """The cluster's two databases, the two boxes, and what the run measured."""

    towerd_dsn: str
    direct_dsn: str
    admin_dsn: str  # the superuser's, on the postgres database: the counters
    boxes: list[Daemon]
    pg: PgServer
    seconds: float
    statements: bool  # pg_stat_statements is loaded: count statements per op

    @property
    def sockets(self) -> tuple[Path, ...]:
        return tuple(box.socket_path for box in self.boxes)

    @property
    def pids(self) -> list[int]:
        return [box.pid for box in self.boxes]

    def _counters(self, dsn: str, reset: bool) -> tuple[int, int | None]:
        """(WAL position, statements run on ``dsn``'s database since the last reset)."""
        dbname = psycopg.conninfo.conninfo_to_dict(dsn)["dbname"]
        with psycopg.connect(self.admin_dsn, autocommit=True) as conn:
            count = None
            if self.statements:
                (count,) = conn.execute(STATEMENTS_SQL, (dbname,)).fetchone()  # type: ignore[misc]
                if reset:
                    conn.execute("SELECT pg_stat_statements_reset()")
            (lsn,) = conn.execute(
                "SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '0/0')::bigint"
            ).fetchone()  # type: ignore[misc]
        return int(lsn), None if count is None else int(count)

    def _measure(self, label: str, kind: str, body: Body, n: int, work: Work) -> Sample:
        direct = isinstance(work.where, str)
        dsn = self.direct_dsn if direct else self.towerd_dsn
        wal_before, _ = self._counters(dsn, reset=True)
        pids = [] if direct else self.pids
        sample = measure(label, kind, body, n, 2 * n, work, self.seconds, pids, self.pg)
        wal_after, statements = self._counters(dsn, reset=False)
        performed = sample.ops + sample.processes  # each process's last op ended late
        sample.wal_per_op = (wal_after - wal_before) / performed
        if statements is not None:
            sample.statements_per_op = statements / performed
        return sample

    def claims(self, n: int, one_box: bool) -> Sample:
        operation = f"bench.pg.{n}.{'one' if one_box else 'two'}"
        sockets = self.sockets[:1] if one_box else self.sockets
        label = "towerd, 1 box (all on A)" if one_box else "towerd, 2 boxes"
        sample = self._measure(label, "claim", towerd_claims, n, Work(sockets, operation))
        completed = query(
            self.towerd_dsn,
            "SELECT count(*) FROM idempotency WHERE operation = %s AND state = 'completed'",
            (operation,),
        )
        if completed < sample.ops:
            raise RuntimeError(f"{label}: {sample.ops} ops counted, {completed} keys completed")
        return sample

    def direct_claims(self, n: int) -> Sample:
        operation = f"bench.direct.{n}"
        work = Work(self.direct_dsn, operation)
        sample = self._measure("direct PostgreSQL", "claim", direct_claims, n, work)
        completed = query(
            self.direct_dsn,
            "SELECT count(*) FROM direct_idem WHERE operation = %s AND state = 'completed'",
            (operation,),
        )
        if completed < sample.ops:
            raise RuntimeError(f"direct: {sample.ops} ops counted, {completed} keys completed")
        return sample

    def leases(self, n: int, contended: bool, direct: bool) -> Sample:
        kind = "hot lease" if contended else "lease"
        prefix = f"bench/{'direct' if direct else 'towerd'}/{n}/{kind.replace(' ', '-')}"
        if direct:
            work = Work(self.direct_dsn, prefix, contended)
            label, body = "direct PostgreSQL", direct_leases
        else:
            work = Work(self.sockets, prefix, contended)
            label, body = "towerd, 2 boxes", towerd_leases
        sample = self._measure(label, kind, body, n, work)
        table = "direct_leases" if direct else "leases"
        left = query(
            self.direct_dsn if direct else self.towerd_dsn,
            f"SELECT count(*) FROM {table} WHERE resource LIKE %s",
            (prefix + "/%",),
        )
        tokens = sample.tokens or []
        if left:
            raise RuntimeError(f"{label} {kind}: {left} lease(s) still held after the window")
        if len(set(tokens)) != len(tokens) and contended:
            raise RuntimeError(f"{label} {kind}: a fencing token was granted twice")
        return sample


# --- reads: PostgreSQL box against an SQLite daemon -------------------------------------


@dataclass
class ReadRow:
    """Rounds of one (method, clients, server), pooled."""

    method: str
    server: str
    clients: int
    rounds: list[LoadResult]
    pg_cpu: list[float]  # the server's CPU per round, percent of one core (warm-up + window)

    @property
    def samples(self) -> list[int]:
        return [x for r in self.rounds for x in r.all_ns]

    @property
    def p50_us(self) -> float:
        return percentile(self.samples, 0.5) / 1000

    @property
    def p99_us(self) -> float:
        return percentile(self.samples, 0.99) / 1000

    @property
    def rps(self) -> float:
        return sum(r.completed for r in self.rounds) / sum(r.window_s for r in self.rounds)

    @property
    def round_p50s(self) -> str:
        p50s = [percentile(r.all_ns, 0.5) / 1000 for r in self.rounds]
        return f"{min(p50s):.0f}-{max(p50s):.0f}" if len(p50s) > 1 else f"{p50s[0]:.0f}"

    def mean(self, values: list[float]) -> float:
        return sum(values) / len(values)

    @property
    def daemon_cpu(self) -> float:
        return self.mean([r.server_cpu_pct for r in self.rounds])

    @property
    def other_cpu(self) -> float:
        """Busy CPU of neither the load generator nor the daemon nor (PostgreSQL) the server."""
        return max(0.0, self.mean([r.other_cpu_pct for r in self.rounds]) - self.mean(self.pg_cpu))


def reads(
    box: Daemon, sqlite: Daemon, pg: PgServer, warmup: float, window: float, rounds: int
) -> list[ReadRow]:
    from reads import HELLO, record_answers, setup

    targets = []
    for name, daemon in (("PostgreSQL (box A)", box), ("SQLite", sqlite)):
        requests = setup(daemon)
        answers = record_answers(daemon.socket_path, requests)
        sizes = {method: len(answer) - 4 for method, answer in answers.items()}
        targets.append((name, daemon, requests, sizes))
    rows = []
    for clients in READ_CLIENTS:
        for method in ("ping", "fleet.get", "idem.get"):
            pooled = {name: ReadRow(method, name, clients, [], []) for name, *_ in targets}
            for _ in range(rounds):
                for name, daemon, requests, sizes in targets:  # interleaved: drift hits both
                    pg_before = pg.cpu_seconds()
                    result = _run_load(
                        daemon.socket_path, [requests[method]], [sizes[method]],
                        clients=clients, warmup=warmup, window=window, hello=HELLO,
                        server_pid=daemon.pid,
                    )  # fmt: skip
                    pg_after = pg.cpu_seconds()
                    if result.errors or not result.completed:
                        raise RuntimeError(f"reads {name} {method}: errors: {result.errors}")
                    pooled[name].rounds.append(result)
                    pooled[name].pg_cpu.append(100 * (pg_after - pg_before) / (warmup + window))
            rows.extend(pooled.values())
    return rows


# --- report ------------------------------------------------------------------------------


def _pct(value: float | None) -> str:
    return f"{value:.0f}%" if value is not None else ""


SECTIONS = {
    "claim": "(a) durable idem claim + complete (fresh keys)",
    "lease": "(b) lease acquire + release, each process its own resource",
    "hot lease": "(b') lease acquire (+ release when granted), every process on one resource",
}


def report(samples: list[Sample], seconds: float) -> None:
    baselines = {(s.kind, s.n): s for s in samples if s.direct}
    header = (
        f"{'measurement':<26} {'N/box':>5} {'procs':>5} {'ops/s':>7} {'median ms':>9} "
        f"{'p99 ms':>7} {'vs direct':>9} {'refused':>7} {'grants/s':>8} {'stmts/op':>8} "
        f"{'WAL B/op':>8} "
        f"{'towerd':>7} {'pg':>5} {'clients':>7} {'other':>5} {'busy':>5}"
    )
    for kind, title in SECTIONS.items():
        rows = [s for s in samples if s.kind == kind]
        if not rows:
            continue
        print(title)
        print(header)
        print("-" * len(header))
        for sample in rows:
            baseline = baselines.get((kind, sample.n))
            ratio = (
                f"{sample.rate / baseline.rate:.2f}x"
                if baseline and baseline.rate and not sample.direct
                else ""
            )
            refused = grants = ""
            if kind == "hot lease":
                refused = f"{100 * sample.refused / sample.ops:.0f}%" if sample.ops else "-"
                grants = f"{sample.grants:.0f}"
            statements = (
                f"{sample.statements_per_op:.1f}" if sample.statements_per_op is not None else ""
            )
            wal = f"{sample.wal_per_op:.0f}" if sample.wal_per_op is not None else ""
            print(
                f"{sample.label:<26} {sample.n:>5} {sample.processes:>5} {sample.rate:>7.0f} "
                f"{percentile(sample.latencies, 0.5):>9.2f} "
                f"{percentile(sample.latencies, 0.99):>7.2f} {ratio:>9} {refused:>7} {grants:>8} "
                f"{statements:>8} {wal:>8} {_pct(sample.towerd_cpu):>7} {_pct(sample.pg_cpu):>5} "
                f"{_pct(sample.clients_cpu):>7} {_pct(sample.other_cpu):>5} "
                f"{_pct(sample.machine_busy):>5}"
            )
        print()
    print(
        f"ops/s: ops finished inside the {seconds:g} s window per second (a) claim+complete "
        "pairs = completed keys, (b) acquire+release pairs, (b') attempts (refused: the share "
        "answered 'held'; grants/s: the attempts that got the lease, per second). N/box: "
        "client processes per box; the direct baseline runs the same "
        "total (procs), each its own connection. vs direct: ops/s over the direct row of the "
        "same N. stmts/op: statements the server ran on that database per op (pg_stat_statements"
        "; BEGIN and COMMIT not counted), WAL B/op: bytes of WAL per op; both over every op "
        "performed, the few that ended after the window included. towerd, pg, clients: CPU, "
        "percent of one core over the window (towerd: both daemons; pg: the whole server); "
        "other: busy CPU of anything else (the kernel's I/O threads, this script, other work "
        "on the machine: a high figure may mean a disturbed row); busy: share of all cores in "
        "use, by anything."
    )
    disturbed = [
        f"{s.kind} {s.label.split(',')[0]} {s.n}/box ({s.other_cpu:.0f}%)"
        for s in samples
        if s.other_cpu is not None and s.other_cpu > DISTURBED_PCT
    ]
    if disturbed:
        print(
            f"note: {len(disturbed)} row(s) ran beside more than {DISTURBED_PCT}% of a core of "
            f"other busy CPU: {', '.join(disturbed)}; compare those with care, or run again"
        )
    for kind in SECTIONS:
        for sample in samples:
            if sample.kind != kind or sample.direct:
                continue
            baseline = baselines.get((kind, sample.n))
            if baseline is None or not baseline.rate:
                continue
            line = (
                f"measured: {kind}, {sample.n} per box ({sample.label}): {sample.rate:.0f} vs "
                f"{baseline.rate:.0f} ops/s direct = {sample.rate / baseline.rate:.2f}x"
            )
            if kind == "hot lease" and baseline.grants:
                line += (
                    f"; grants {sample.grants:.0f} vs {baseline.grants:.0f}/s = "
                    f"{sample.grants / baseline.grants:.2f}x"
                )
            print(line)


def report_reads(rows: list[ReadRow], warmup: float, window: float, rounds: int) -> None:
    print()
    print(
        f"(c) reads, closed loop (bench/_loadgen.py), {rounds} round(s) of {warmup:g} s warm-up "
        f"+ {window:g} s per row, servers interleaved, pooled; PostgreSQL: box A, no read cache "
        "on this backend (every fleet.get / idem.get is a round trip from its reader thread); "
        "SQLite: one embedded daemon, the same hot row (from its read cache); towerd: the "
        "daemon's CPU over the window; pg: the server's, over warm-up and window; other: the "
        "rest of the machine's busy CPU"
    )
    header = (
        f"{'method':10} {'clients':>7} {'server':18} {'p50 us':>8} {'p99 us':>8} {'req/s':>8} "
        f"{'rounds p50':>11} {'towerd':>7} {'pg':>5} {'other':>6}  {'p50 x SQLite':>12} "
        f"{'req/s x SQLite':>14}"
    )
    print(header)
    print("-" * len(header))
    by_key = {(row.method, row.clients, row.server): row for row in rows}
    for row in rows:
        sqlite = by_key[row.method, row.clients, "SQLite"]
        ratios = ""
        if row.server != "SQLite":
            ratios = f"{row.p50_us / sqlite.p50_us:12.2f} {row.rps / sqlite.rps:14.2f}"
        pg_cpu = _pct(row.mean(row.pg_cpu)) if row.server != "SQLite" else ""
        print(
            f"{row.method:10} {row.clients:>7} {row.server:18} {row.p50_us:8.1f} "
            f"{row.p99_us:8.1f} {row.rps:8.0f} {row.round_p50s:>11} {_pct(row.daemon_cpu):>7} "
            f"{pg_cpu:>5} {_pct(row.other_cpu):>6}  {ratios}".rstrip()
        )
    for row in rows:
        if row.server == "SQLite" or row.method == "ping":
            continue
        sqlite = by_key[row.method, row.clients, "SQLite"]
        print(
            f"measured: reads {row.clients} client(s), {row.method} on PostgreSQL: p50 "
            f"{row.p50_us:.0f} us ({row.p50_us / sqlite.p50_us:.2f}x SQLite), "
            f"{row.rps:.0f} req/s ({row.rps / sqlite.rps:.2f}x SQLite)"
        )


def environment(cluster: Any, dsn: str, statements: bool) -> None:
    settings = ("server_version", "fsync", "synchronous_commit", "full_page_writes",
                "wal_sync_method", "shared_buffers", "max_connections")  # fmt: skip
    with psycopg.connect(dsn, autocommit=True) as conn:
        shown = {name: conn.execute(f"SHOW {name}").fetchone()[0] for name in settings}  # type: ignore[index]
    print(machine() + f", psycopg {psycopg.__version__} (libpq {psycopg.pq.version()})")
    print(
        f"PostgreSQL {shown['server_version']} (private cluster, {cluster.bin}), over its Unix "
        f"socket; durability: fsync={shown['fsync']}, synchronous_commit="
        f"{shown['synchronous_commit']}, full_page_writes={shown['full_page_writes']}, "
        f"wal_sync_method={shown['wal_sync_method']}; shared_buffers={shown['shared_buffers']}, "
        f"max_connections={shown['max_connections']}; "
        + (
            "pg_stat_statements loaded (for stmts/op; it costs every statement alike)"
            if statements
            else "no pg_stat_statements"
        )
    )


# --- the run -------------------------------------------------------------------------------


@contextmanager
def cleanup_on_signals() -> Iterator[None]:
    """SIGTERM (and SIGHUP) end the run as Ctrl-C does: through every ``finally``."""

    def interrupted(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = {sig: signal.signal(sig, interrupted) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


DAEMON_DIRS = {"box-a": "box A", "box-b": "box B", "sqlite": "SQLite daemon"}


def log_summary(path: Path) -> Counter[str]:
    """What a daemon logged (at ``--log-level warning``), counted by event and reason."""
    events: Counter[str] = Counter()
    try:
        lines = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return events
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            events[f"(not JSON) {line[:80]}"] += 1
            continue
        what = f"{entry.get('event')} ({entry.get('code')}"
        what += f": {entry['reason']})" if entry.get("reason") else ")"
        events[what] += 1
    return events


def stop(daemon: Daemon) -> None:
    if daemon.proc is None or daemon.proc.poll() is not None:
        return
    try:
        daemon.stop()
    except Exception:  # noqa: BLE001 - whatever happens, it must not outlive the run
        daemon.kill()


def start(daemon: Daemon, workdir: Path) -> Daemon:
    if not daemon.start():
        raise RuntimeError(f"towerd did not start; see {workdir / 'daemon.log'}")
    return daemon


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=None, help="window per measurement (4)")
    parser.add_argument("--clients", default="1,8,64", help="client processes per box (1,8,64)")
    parser.add_argument("--quick", action="store_true", help="1 s windows: a smoke run")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directories")
    parser.add_argument(
        "--no-statements",
        dest="statements",
        action="store_false",
        help="do not load pg_stat_statements (the stmts/op column)",
    )
    args = parser.parse_args()
    seconds = args.seconds or (1.0 if args.quick else 4.0)
    counts = [int(n) for n in args.clients.split(",")]
    read_warmup, read_window, read_rounds = (0.2, 0.6, 1) if args.quick else (0.4, 1.0, 3)

    sys.path.insert(0, str(HERE.parent / "tests"))
    from pg_cluster import PgCluster, postgres_available

    if (why := postgres_available()) is not None:
        raise SystemExit(f"no PostgreSQL here: {why}")
    ensure_fd_limit(8 * max(counts) + 512)
    root = Path(tempfile.mkdtemp(prefix="bench-pg-", dir="/tmp"))
    cluster = PgCluster(durable=True)
    daemons: list[Daemon] = []
    samples: list[Sample] = []
    read_rows: list[ReadRow] = []
    ok = False
    with cleanup_on_signals():
        try:
            cluster.start()
            if args.statements:  # loaded at start: a restart (the cluster keeps its port)
                cluster.psql(
                    "postgres", "ALTER SYSTEM SET shared_preload_libraries = 'pg_stat_statements'"
                )
                cluster.restart()
                cluster.psql("postgres", "CREATE EXTENSION pg_stat_statements")
            towerd_dsn = cluster.new_database("towerd_boxes", migrated=True)
            direct_dsn = cluster.new_database("direct")
            with psycopg.connect(direct_dsn, autocommit=True) as conn:
                for statement in DIRECT_DDL:
                    conn.execute(statement)
            cluster._close_admin()  # no open connection of the parent's in the forked workers
            environment(cluster, direct_dsn, args.statements)
            print(
                f"two boxes: two towerd daemons on one database ({', '.join(BOX_ARGS)}), each "
                f"its own state dir and socket; window {seconds:g} s; N per box = "
                f"{', '.join(map(str, counts))} (2N client processes in all); direct baseline: "
                "the same transactions from 2N processes with psycopg, autocommit, each its own "
                "connection, in a database of its own on the same cluster"
            )
            print()
            for name in ("a", "b"):
                workdir = root / f"box-{name}"
                workdir.mkdir(mode=0o700)
                daemons.append(Daemon(workdir, ["--store", towerd_dsn, *BOX_ARGS]))
                start(daemons[-1], workdir)
            bench = Bench(
                towerd_dsn, direct_dsn, cluster.dsn("postgres", user="postgres"), daemons[:2],
                PgServer(cluster.postmaster_pid()), seconds, args.statements,
            )  # fmt: skip
            with Client(daemons[0].socket_path) as client:
                boxes = client.boxes_list()["boxes"]
            if len(boxes) != 2:
                raise RuntimeError(f"expected two boxes in the store, found {json.dumps(boxes)}")
            for n in counts:
                samples.append(bench.direct_claims(n))
                samples.append(bench.claims(n, one_box=False))
                samples.append(bench.claims(n, one_box=True))
                for contended in (False, True):
                    samples.append(bench.leases(n, contended, direct=True))
                    samples.append(bench.leases(n, contended, direct=False))
            workdir = root / "sqlite"
            workdir.mkdir(mode=0o700)
            daemons.append(start(Daemon(workdir, BOX_ARGS), workdir))
            read_rows = reads(
                daemons[0], daemons[2], bench.pg, read_warmup, read_window, read_rounds
            )
            ok = True
        finally:
            for daemon in reversed(daemons):
                stop(daemon)
            logs = {name: log_summary(root / name / "daemon.log") for name in DAEMON_DIRS}
            try:
                cluster.close()
            finally:
                if args.keep or not ok:
                    print(f"kept {root} (daemon.log of each box)", file=sys.stderr)
                else:
                    shutil.rmtree(root, ignore_errors=True)
    report(samples, seconds)
    report_reads(read_rows, read_warmup, read_window, read_rounds)
    print()
    for name, events in logs.items():
        told = "; ".join(f"{count} x {what}" for what, count in events.most_common()) or "none"
        print(f"daemon log, {DAEMON_DIRS[name]} (warnings and errors over the run): {told}")


if __name__ == "__main__":
    main()
