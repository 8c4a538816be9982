"""Durable writes under concurrency: towerd against SQLite opened directly.

    .venv/bin/python bench/writes.py [--seconds 5] [--clients 1,8,64] [--quick]
    .venv/bin/python bench/writes.py --stages [--clients 1,8]

``--stages`` measures where one write's time goes instead (daemon/stages.py): the
daemon with ``TOWERD_STAGE_TRACE`` under N client processes, and the store engine
in-process, each write stamped from the socket read to the reply write.

One op is an idempotent claim then complete of a fresh key (one completed row).
For each N, every measurement on a fresh state dir or database file:

* towerd, N client processes: each its own blocking ``Client``, one op after
  the other (``idem_claim`` then ``idem_complete``, distinct keys);
* towerd, N tasks in one process: each task its own ``AsyncClient`` connection;
* direct SQLite (the baseline): N processes open the same file (WAL,
  ``synchronous=FULL``, ``busy_timeout=5000``) and run claim and complete as
  one ``BEGIN IMMEDIATE`` transaction each, with towerd's own statements and
  table, retrying on ``SQLITE_BUSY`` (``bench/_direct_sqlite.py``);

* two single-writer floors, one thread and nothing else (no socket, no event
  loop, no client): the writes N clients with one request outstanding each
  would hand a perfect group-commit writer, N per transaction (the N claims,
  then the N completes): once as the direct baseline's bare statements
  (``floor: SQL``), once through towerd's own store functions as its writer
  runs them (``floor: store functions``). No design with one SQLite writer
  running these statements can beat the first, so it bounds what any daemon
  can reach at that N on this machine;

with 1 client, a socket round trip: a blocking client and a bare echo server
(bench/echo_server.py) exchanging claim-sized frames. One client must have its
claim answered before it sends the complete, so an op costs at least a floor's op
plus two round trips: the 1-client target line prints that bound;

and once, the ceiling: one process inserting the same completed rows with
plain sqlite3 at ``synchronous=FULL``, 100 and 1000 rows per transaction (the
better of the two is the ceiling).

towerd runs at its default durability (WAL, ``synchronous=FULL``: a reply means
the write is on disk). Workers are forked, connect, and wait on a barrier;
a second barrier starts the window together, and only ops that finished inside
the window are counted (worker start-up is not). Latency is one whole op
(claim + complete). ``daemon CPU`` is the daemon's user+system time over the
window (its event loop plus its SQLite threads; 100% = one core), ``clients
CPU`` the same for all worker processes together; ``busy`` is the share of all
the machine's cores in use (anything else running counts too). Clients, daemon
and SQLite all share this machine's cores.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import socket
import tempfile
import threading
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _direct_sqlite as direct

from benchlib import Daemon, machine, percentile, start_echo
from towerd.client import Client

OPERATION = "bench.write"
BARRIER_TIMEOUT = 120.0
CEILING_BATCHES = (100, 1000)
# Issue 17's targets: towerd's client processes against the direct baseline at each N.
TARGETS = {1: 0.8, 8: 1.5, 64: 4.0}
TARGET_N = 64  # the bound and budget lines are priced at this N
TARGET_VS_BASELINE = TARGETS[TARGET_N]


# --- workers (forked) ------------------------------------------------------------------


@dataclass
class Sync:
    """Start line shared by the parent and its workers."""

    ready: Any  # multiprocessing Barrier: every worker connected
    go: Any  # multiprocessing Barrier: the window starts
    deadline: Any  # shared double, time.monotonic() at the end of the window

    def start(self) -> float:
        """Called by a worker once set up; returns the end of the window."""
        self.ready.wait(BARRIER_TIMEOUT)
        self.go.wait(BARRIER_TIMEOUT)
        return float(self.deadline.value)


Outcome = tuple[int, array, int]  # ops inside the window, their latencies (ms), busy retries
Body = Callable[[int, int, Any, Sync], Outcome]


def towerd_process(index: int, n: int, socket_path: Path, sync: Sync) -> Outcome:
    latencies = array("d")
    # A long-running writer, not a hook: it takes the C msgpack codec (the default for
    # a process that has not loaded msgspec is the stdlib one, for fast start-up).
    with Client(socket_path, codec="msgspec") as client:
        deadline = sync.start()
        i = 0
        while True:
            key = f"p{index}-{i}"
            started = time.monotonic()
            client.idem_claim(OPERATION, key)
            client.idem_complete(OPERATION, key, {"i": i})
            finished = time.monotonic()
            if finished > deadline:
                break
            latencies.append((finished - started) * 1000)
            i += 1
    return len(latencies), latencies, 0


def towerd_tasks(index: int, n: int, socket_path: Path, sync: Sync) -> Outcome:
    from contextlib import AsyncExitStack

    import anyio

    from towerd.client import AsyncClient

    latencies = array("d")

    async def one_client(task: int, client: AsyncClient, deadline: float) -> None:
        i = 0
        while True:
            key = f"t{task}-{i}"
            started = time.monotonic()
            await client.idem_claim(OPERATION, key)
            await client.idem_complete(OPERATION, key, {"i": i})
            finished = time.monotonic()
            if finished > deadline:
                return
            latencies.append((finished - started) * 1000)
            i += 1

    async def main() -> None:
        async with AsyncExitStack() as stack:
            clients = [
                await stack.enter_async_context(AsyncClient.open(socket_path)) for _ in range(n)
            ]
            deadline = await anyio.to_thread.run_sync(sync.start)
            async with anyio.create_task_group() as tasks:
                for task, client in enumerate(clients):
                    tasks.start_soon(one_client, task, client, deadline)

    anyio.run(main)
    return len(latencies), latencies, 0


def store_engine(index: int, n: int, arg: tuple[Path, Path | None], sync: Sync) -> Outcome:
    """towerd's store in-process: N tasks, no socket, no client. What the daemon's write
    engine (group commit) can do when nothing else shares the machine's two cores. With
    a trace file, each write is stamped (daemon/stages.py) and the summary written there."""
    import json

    import anyio

    from towerd.daemon import stages
    from towerd.daemon.store import StoreConfig, idempotency, open_store
    from towerd.daemon.store.idempotency import Holder
    from towerd.daemon.store.tx import Caller
    from towerd.protocol.methods import IdemClaimParams, IdemCompleteParams

    state_dir, trace_path = arg
    latencies = array("d")
    caller = Caller(principal="p", pid=os.getpid(), holder=Holder(os.getpid(), 0))
    trace = stages.enable() if trace_path else None

    async def write(store: Any, fn: Any, params: Any) -> None:
        future = store.write(fn, caller, params)
        await future
        if trace is not None:  # no socket: the reply is "written" once the caller has it
            trace.finish(trace.answering.pop(id(future)))

    async def main() -> None:
        async with open_store(StoreConfig(state_dir)) as store:

            async def one_client(task: int, deadline: float) -> None:
                i = 0
                while True:
                    key = f"t{task}-{i}"
                    started = time.monotonic()
                    await write(store, idempotency.claim, IdemClaimParams(OPERATION, key))
                    await write(
                        store,
                        idempotency.complete,
                        IdemCompleteParams(operation=OPERATION, key=key, result={"i": i}),
                    )
                    finished = time.monotonic()
                    if finished > deadline:
                        return
                    latencies.append((finished - started) * 1000)
                    i += 1

            deadline = sync.start()
            async with anyio.create_task_group() as tasks:
                for task in range(n):
                    tasks.start_soon(one_client, task, deadline)

    anyio.run(main, backend="asyncio", backend_options={"use_uvloop": True})
    if trace is not None and trace_path is not None:
        trace_path.write_text(json.dumps(trace.summary()))
    return len(latencies), latencies, 0


def single_writer_floor(index: int, n: int, arg: tuple[Path, str], sync: Sync) -> Outcome:
    """N virtual clients in lockstep: one transaction holds the N claims, the next the
    N completes (keys spread as N clients spread them). ``mode`` "sql" runs the direct
    baseline's statements alone, "store" towerd's store functions (as its writer runs them:
    no savepoint unless a write fails after changing rows)."""
    db_path, mode = arg
    latencies = array("d")
    if mode == "store":
        claim, complete = _store_function_writes(db_path)
    elif mode == "minimal":
        claim = lambda conn, key: direct.minimal_claim(conn, OPERATION, key)  # noqa: E731
        complete = lambda conn, key, result: direct.minimal_complete(  # noqa: E731
            conn, OPERATION, key, result
        )
    else:
        claim = lambda conn, key: direct.claim_statements(conn, OPERATION, key)  # noqa: E731
        complete = lambda conn, key, result: direct.complete_statements(  # noqa: E731
            conn, OPERATION, key, result
        )
    conn = direct.connect(db_path)
    try:
        deadline = sync.start()
        i = 0
        while True:
            batch = [f"f{client}-{i}" for client in range(n)]
            started = time.monotonic()
            for write in (claim, complete):
                conn.execute("BEGIN IMMEDIATE")
                for key in batch:
                    if write is claim:
                        claim(conn, key)
                    else:
                        complete(conn, key, {"i": i})
                conn.execute("COMMIT")
            finished = time.monotonic()
            if finished > deadline:
                break
            latencies.extend([(finished - started) * 1000] * n)
            i += 1
    finally:
        conn.close()
    return len(latencies), latencies, 0


def _store_function_writes(db_path: Path) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """towerd's idempotency.claim / complete on a plain connection, as its writer calls
    them (a Tx collecting change notes); the database was created by towerd."""
    from towerd.daemon.store import idempotency
    from towerd.daemon.store.idempotency import Holder
    from towerd.daemon.store.tx import Caller, Tx, now_ms
    from towerd.protocol.methods import IdemClaimParams, IdemCompleteParams

    conn = direct.connect(db_path)
    daemon_id, epoch = conn.execute("SELECT daemon_id, owner_epoch FROM daemons").fetchone()
    conn.close()
    caller = Caller(principal="p", pid=os.getpid(), holder=Holder(os.getpid(), 0))

    def tx(conn: Any) -> Tx:
        return Tx(conn, daemon_id, epoch, now_ms(), changes=[])

    def claim(conn: Any, key: str) -> None:
        params = IdemClaimParams(operation=OPERATION, key=key)
        idempotency.claim(tx(conn), caller, params)

    def complete(conn: Any, key: str, result: Any) -> None:
        params = IdemCompleteParams(operation=OPERATION, key=key, result=result)
        idempotency.complete(tx(conn), caller, params)

    return claim, complete


def direct_process(index: int, n: int, db_path: Path, sync: Sync) -> Outcome:
    latencies = array("d")
    keys = direct.DirectKeys(db_path, OPERATION)
    try:
        deadline = sync.start()
        i = 0
        while True:
            key = f"d{index}-{i}"
            started = time.monotonic()
            keys.claim(key)
            keys.complete(key, {"i": i})
            finished = time.monotonic()
            if finished > deadline:
                break
            latencies.append((finished - started) * 1000)
            i += 1
    finally:
        keys.close()
    return len(latencies), latencies, keys.retries


def ceiling_process(index: int, n: int, arg: tuple[Path, int], sync: Sync) -> Outcome:
    """Rows committed inside the window; latencies are whole batches."""
    db_path, batch = arg
    latencies = array("d")
    conn = direct.connect(db_path)
    pid = os.getpid()
    rows_done = 0
    try:
        deadline = sync.start()
        while True:
            started = time.monotonic()
            rows = [
                direct.completed_row(OPERATION, f"c{rows_done + j}", {"i": rows_done + j}, pid)
                for j in range(batch)
            ]
            direct.insert_batch(conn, rows)
            finished = time.monotonic()
            if finished > deadline:
                break
            latencies.append((finished - started) * 1000)
            rows_done += batch
    finally:
        conn.close()
    return rows_done, latencies, 0


def _worker_main(body: Body, index: int, n: int, arg: Any, sync: Sync, results: Any) -> None:
    try:
        ops, latencies, retries = body(index, n, arg, sync)
        results.put((index, ops, latencies.tobytes(), retries, None))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        sync.ready.abort()
        sync.go.abort()
        results.put((index, 0, b"", 0, f"{type(exc).__name__}: {exc}"))


# --- measuring -------------------------------------------------------------------------


@dataclass
class Sample:
    label: str
    n: int
    seconds: float
    ops: int
    latencies: list[float]
    retries: int = 0
    daemon_cpu: float | None = None  # percent of one core
    clients_cpu: float | None = None  # percent of one core, all worker processes together
    machine_busy: float | None = None  # percent of all cores
    per_batch: bool = False

    @property
    def rate(self) -> float:
        return self.ops / self.seconds


def _proc_cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _machine_ticks() -> tuple[int, int]:
    with open("/proc/stat") as handle:
        values = [int(v) for v in handle.readline().split()[1:]]
    idle = values[3] + values[4]
    return sum(values), idle


def measure(
    label: str,
    body: Body,
    processes: int,
    n: int,
    arg: Any,
    seconds: float,
    daemon_pid: int | None = None,
) -> Sample:
    """Fork ``processes`` workers, start them together, collect what they did in the window."""
    ctx = mp.get_context("fork")
    sync = Sync(ctx.Barrier(processes + 1), ctx.Barrier(processes + 1), ctx.RawValue("d", 0.0))
    results = ctx.Queue()
    workers = [
        ctx.Process(target=_worker_main, args=(body, index, n, arg, sync, results), daemon=True)
        for index in range(processes)
    ]
    for worker in workers:
        worker.start()
    try:
        sync.ready.wait(BARRIER_TIMEOUT)
        sync.deadline.value = time.monotonic() + seconds
        sync.go.wait(BARRIER_TIMEOUT)
    except threading.BrokenBarrierError:
        error = results.get(timeout=30)[4]  # the first worker that failed aborted the barriers
        for worker in workers:
            worker.kill()
        raise RuntimeError(f"{label}: a worker failed before the window: {error}") from None
    cpu_before = _proc_cpu_seconds(daemon_pid) if daemon_pid else 0.0
    clients_before = sum(_proc_cpu_seconds(worker.pid) for worker in workers)
    ticks_before = _machine_ticks()
    window_start = time.monotonic()
    time.sleep(max(0.0, sync.deadline.value - time.monotonic()))
    elapsed = time.monotonic() - window_start
    cpu_after = _proc_cpu_seconds(daemon_pid) if daemon_pid else 0.0
    clients_after = sum(_proc_cpu_seconds(worker.pid) for worker in workers)
    ticks_after = _machine_ticks()
    outcomes = [results.get(timeout=BARRIER_TIMEOUT) for _ in workers]
    for worker in workers:
        worker.join(30)
    failures = [error for *_, error in outcomes if error]
    if failures:
        raise RuntimeError(f"{label}: {len(failures)} worker(s) failed: {failures[0]}")
    latencies: list[float] = []
    for _, _, data, _, _ in outcomes:
        chunk = array("d")
        chunk.frombytes(data)
        latencies.extend(chunk)
    total, idle = (after - before for after, before in zip(ticks_after, ticks_before, strict=True))
    return Sample(
        label=label,
        n=n,
        seconds=seconds,
        ops=sum(ops for _, ops, _, _, _ in outcomes),
        latencies=latencies,
        retries=sum(retries for _, _, _, retries, _ in outcomes),
        daemon_cpu=100 * (cpu_after - cpu_before) / elapsed if daemon_pid else None,
        clients_cpu=100 * (clients_after - clients_before) / elapsed,
        machine_busy=100 * (total - idle) / total if total else None,
    )


def fresh_dir(root: Path, name: str) -> Path:
    path = root / name
    path.mkdir(mode=0o700)
    return path


def measure_towerd(
    root: Path, n: int, seconds: float, tasks: bool, trace_path: Path | None = None
) -> Sample:
    workdir = fresh_dir(root, f"towerd-{'tasks' if tasks else 'procs'}-{n}")
    env = {"TOWERD_STAGE_TRACE": str(trace_path)} if trace_path else {}
    daemon = Daemon(workdir, env=env)
    if not daemon.start():
        raise RuntimeError(f"towerd did not start; see {workdir / 'daemon.log'}")
    try:
        if tasks:
            label = "towerd, tasks in 1 process"
            sample = measure(label, towerd_tasks, 1, n, daemon.socket_path, seconds, daemon.pid)
        else:
            label = "towerd, client processes"
            sample = measure(label, towerd_process, n, n, daemon.socket_path, seconds, daemon.pid)
        with Client(daemon.socket_path) as client:
            completed = client.status()["keys"]["completed"]
        if completed < sample.ops:
            raise RuntimeError(f"{label}: {sample.ops} ops counted, {completed} keys completed")
    finally:
        daemon.stop()
    return sample


def measure_direct(root: Path, n: int, seconds: float) -> Sample:
    db_path = fresh_dir(root, f"direct-{n}") / "direct.db"
    direct.create_db(db_path)
    sample = measure("direct SQLite, processes", direct_process, n, n, db_path, seconds)
    completed = direct.count_completed(db_path)
    if completed < sample.ops:
        raise RuntimeError(f"direct: {sample.ops} ops counted, {completed} keys completed")
    return sample


def measure_engine(root: Path, n: int, seconds: float, trace_path: Path | None = None) -> Sample:
    state_dir = fresh_dir(root, f"engine-{n}")
    label = "towerd store engine, no socket"
    return measure(label, store_engine, 1, n, (state_dir, trace_path), seconds)


def measure_floor(root: Path, n: int, seconds: float, mode: str) -> Sample:
    workdir = fresh_dir(root, f"floor-{mode}-{n}")
    if mode == "store":  # towerd's own database, created (and its daemon row) by towerd
        daemon = Daemon(workdir)
        if not daemon.start():
            raise RuntimeError(f"towerd did not start; see {workdir / 'daemon.log'}")
        daemon.stop()
        db_path = daemon.state_dir / "towerd.db"
    else:
        db_path = workdir / "floor.db"
        direct.create_db(db_path)
    label = {
        "store": "floor: store functions, 1 thread",
        "sql": "floor: SQL, 1 thread",
        "minimal": "floor: 2 statements, 1 thread",
    }[mode]
    return measure(label, single_writer_floor, 1, n, (db_path, mode), seconds)


def measure_ceiling(root: Path, batch: int, seconds: float) -> Sample:
    db_path = fresh_dir(root, f"ceiling-{batch}") / "ceiling.db"
    direct.create_db(db_path)
    sample = measure(
        f"ceiling: sqlite3, {batch} rows/tx", ceiling_process, 1, 1, (db_path, batch), seconds
    )
    sample.per_batch = True
    return sample


def measure_round_trip(root: Path, seconds: float) -> float:
    """The mean time, in us, of one request and its answer through a bare echo server
    (bench/echo_server.py, uvloop) from a blocking client in another process, frames the
    size of a claim's: what each write at 1 client pays on top of the store's work."""
    import msgspec

    path = fresh_dir(root, "echo") / "echo.sock"
    echo = start_echo(path)
    payload = msgspec.msgpack.encode(
        {"id": 2, "method": "idem.claim", "params": {"operation": OPERATION, "key": "k0-000001"}}
    )
    request = len(payload).to_bytes(4, "big") + payload
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.connect(str(path))

            def round_trip() -> None:
                sock.sendall(request)
                got = 0
                while got < len(request):
                    got += len(sock.recv(65536))

            for _ in range(200):
                round_trip()
            count, started = 0, time.perf_counter()
            deadline = started + seconds
            while time.perf_counter() < deadline:
                round_trip()
                count += 1
            return (time.perf_counter() - started) / count * 1e6
    finally:
        echo.terminate()
        echo.wait(10)


# --- report ------------------------------------------------------------------------------


def _ratio(value: float, against: float) -> str:
    return f"{value / against:.2f}x" if against else "-"


def report(samples: list[Sample], seconds: float, round_trip_us: float | None) -> None:
    ceilings = [s for s in samples if s.per_batch]
    ceiling = max(ceilings, key=lambda s: s.rate) if ceilings else None
    baselines = {s.n: s for s in samples if s.label.startswith("direct")}
    header = (
        f"{'measurement':<32} {'N':>3} {'ops/s':>8} {'median ms':>10} {'p99 ms':>9} "
        f"{'vs direct':>10} {'vs ceiling':>11} {'retries':>8} {'daemon CPU':>11} "
        f"{'clients CPU':>12} {'busy':>6}"
    )
    print(header)
    print("-" * len(header))
    for sample in samples:
        towerd = sample.label.startswith(("towerd", "floor"))
        baseline = baselines.get(sample.n)
        median, p99 = percentile(sample.latencies, 0.5), percentile(sample.latencies, 0.99)
        print(
            f"{sample.label:<32} {sample.n:>3} {sample.rate:>8.0f} {median:>10.2f} {p99:>9.2f} "
            f"{_ratio(sample.rate, baseline.rate) if towerd and baseline else '':>10} "
            f"{_ratio(sample.rate, ceiling.rate) if towerd and ceiling else '':>11} "
            f"{sample.retries if sample.label.startswith('direct') else '':>8} "
            f"{f'{sample.daemon_cpu:.0f}%' if sample.daemon_cpu is not None else '':>11} "
            f"{f'{sample.clients_cpu:.0f}%' if sample.clients_cpu is not None else '':>12} "
            f"{f'{sample.machine_busy:.0f}%' if sample.machine_busy is not None else '':>6}"
        )
    best = f" ({ceiling.label.split(': ')[1]}, {ceiling.rate:.0f} rows/s)" if ceiling else ""
    print(
        f"\nops/s = completed claim+complete pairs per second = rows/s; window {seconds:g} s per "
        "measurement. Ceiling rows: ops/s is rows/s and latency is one whole batch "
        f"transaction; the ceiling is the best batch size{best}. "
        "retries: direct transactions retried after SQLite answered SQLITE_BUSY. CPU columns: "
        "percent of one core over the window; busy: share of all cores in use, by anything."
    )
    print()
    for n, target in TARGETS.items():
        _report_target(samples, n, target, baselines.get(n), round_trip_us)
    _report_bounds(samples, baselines.get(TARGET_N), ceiling)


def _report_target(
    samples: list[Sample],
    n: int,
    target: float,
    baseline: Sample | None,
    round_trip_us: float | None,
) -> None:
    """One target line per N, and how close towerd came to its floors at that N: the
    same writes through its own store functions, and through the direct baseline's
    SQL, each in one thread with nothing else to do (no socket, no loop, no client).
    At 1 client, the bound that the floor and two socket round trips set."""
    sample = next((s for s in samples if s.label == "towerd, client processes" and s.n == n), None)
    if sample is None or baseline is None or not baseline.rate:
        print(f"target: durable claim+complete, {n} client(s): not measured in this run "
              f"(needs N={n} in --clients) -> NOT met")  # fmt: skip
        return
    ratio = sample.rate / baseline.rate
    print(
        f"target: durable claim+complete, {n} client process(es) >= {target:g}x direct SQLite: "
        f"measured {ratio:.2f}x ({sample.rate:.0f} vs {baseline.rate:.0f} ops/s) -> "
        f"{'met' if ratio >= target else 'NOT met'}"
    )
    for label in ("floor: store functions", "floor: SQL"):
        floor = next((s for s in samples if s.label.startswith(label) and s.n == n), None)
        if floor is not None and floor.rate:
            print(
                f"  vs its {label} ({n} per transaction, one thread): the floor is "
                f"{floor.rate / baseline.rate:.2f}x direct; towerd reached "
                f"{100 * sample.rate / floor.rate:.0f}% of it"
            )
    if n != 1 or not round_trip_us:
        return
    for label, what in (("floor: store functions", "towerd's store functions"),
                        ("floor: SQL", "the direct baseline's bare SQL")):  # fmt: skip
        floor = next((s for s in samples if s.label.startswith(label) and s.n == n), None)
        if floor is None or not floor.rate:
            continue
        op_us = 1e6 / floor.rate + 2 * round_trip_us
        bound = 1e6 / op_us / baseline.rate
        print(
            f"  bound at 1 client with {what}: a claim's answer must arrive before the "
            f"complete is sent, so an op takes at least their op alone ({1e6 / floor.rate:.0f} "
            f"us) plus two round trips through a bare echo server (2 x {round_trip_us:.0f} us, "
            f"measured in this run): {1e6 / op_us:.0f} ops/s = {bound:.2f}x direct"
            + (" (under the target)" if bound < target else "")
        )


def _report_bounds(samples: list[Sample], baseline: Sample | None, ceiling: Sample | None) -> None:
    """Why the durable-write targets are out of reach here, from this run's figures."""
    if baseline is None or ceiling is None:
        return
    for label in ("floor: SQL", "floor: 2 statements"):
        floor = next((s for s in samples if s.label.startswith(label) and s.n == TARGET_N), None)
        if floor is not None:
            print(
                f"bound ({label}): {TARGET_N} clients' claims then completes, {TARGET_N} per "
                f"transaction, one thread, nothing else running: {floor.rate:.0f} ops/s = "
                f"{_ratio(floor.rate, baseline.rate)} direct, {_ratio(floor.rate, ceiling.rate)} "
                "the ceiling"
            )
    needed = TARGET_VS_BASELINE * baseline.rate
    cores = os.cpu_count() or 1
    for mode in ("towerd, client processes", "towerd, tasks in 1 process"):
        sample = next((s for s in samples if s.label == mode and s.n == TARGET_N), None)
        if sample is None or not sample.rate or sample.daemon_cpu is None:
            continue
        client_us = 1e4 * sample.clients_cpu / sample.rate  # CPU microseconds per op
        daemon_us = 1e4 * sample.daemon_cpu / sample.rate
        print(
            f"budget ({mode.split(', ')[1]}): {client_us:.0f} us of client CPU and "
            f"{daemon_us:.0f} us of daemon CPU per op; {TARGET_VS_BASELINE:g}x direct "
            f"({needed:.0f} ops/s) would take {needed * client_us / 1e6:.1f} cores for the "
            f"clients and {needed * daemon_us / 1e6:.1f} for the daemon at these costs; "
            f"the machine has {cores}"
        )


def measure_stages(root: Path, counts: list[int], seconds: float) -> None:
    """Where one write's time goes (daemon/stages.py), through the daemon and in the
    engine alone, at each N: a row per stage, the mean and p50 in microseconds."""
    from towerd.daemon.stages import STAGES

    columns: list[tuple[str, Sample, dict[str, Any]]] = []
    for n in counts:
        for engine in (False, True):
            trace_path = root / f"stages-{'engine' if engine else 'daemon'}-{n}.json"
            if engine:
                sample = measure_engine(root, n, seconds, trace_path)
            else:
                sample = measure_towerd(root, n, seconds, tasks=False, trace_path=trace_path)
            summary = json.loads(trace_path.read_text())
            columns.append((f"{'engine' if engine else 'daemon'} N={n}", sample, summary))
    print("where one write's time goes (us; mean / p50), claim and complete alike:")
    header = f"{'stage':<20}" + "".join(f"{label:>22}" for label, _, _ in columns)
    print(header)
    print("-" * len(header))
    for name, _, _ in STAGES:
        cells = []
        for _, _, summary in columns:
            stage = summary["stages"].get(name, {})
            cells.append(
                f"{stage['mean']:>10.1f} / {stage['p50']:>8.1f}" if stage.get("count") else "-"
            )
        print(f"{name:<20}" + "".join(f"{cell:>22}" for cell in cells))
    sizes = [f"{s['batch_size'].get('mean', 0):>10.1f} / {s['batch_size'].get('p50', 0):>8.0f}"
             for _, _, s in columns]  # fmt: skip
    print(f"{'writes per batch':<20}" + "".join(f"{cell:>22}" for cell in sizes))
    rates = [f"{sample.rate:>21.0f}" for _, sample, _ in columns]
    print(f"{'ops/s (traced)':<20}" + "".join(f"{cell:>22}" for cell in rates))
    print(
        "\nstages: decode + route (socket read to the writer's queue), queue wait (to the "
        "batch that takes it), hop to db thread, statements (BEGIN, epoch check, the store "
        "functions), commit (COMMIT with its fsync), hop back (to the event loop), publish + "
        "resolve (change notes, the caller's future), encode + write (the reply on the "
        "socket; the engine has no socket: 0). Tracing costs a few us per write."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=None, help="window per measurement (5)")
    parser.add_argument("--clients", default="1,8,64", help="comma-separated N (1,8,64)")
    parser.add_argument("--quick", action="store_true", help="1.5 s windows: a smoke run")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directories")
    parser.add_argument("--stages", action="store_true", help="where each write's time goes")
    args = parser.parse_args()
    seconds = args.seconds or (1.5 if args.quick else 5.0)
    counts = [int(n) for n in args.clients.split(",")]
    if args.stages:
        print(machine())
        root = Path(tempfile.mkdtemp(prefix="towerd-stages-"))
        try:
            measure_stages(root, counts, seconds)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        return

    print(machine())
    print(
        f"durable writes: one op = idem.claim + idem.complete of a fresh key; window {seconds:g} "
        f"s; N = {', '.join(map(str, counts))}; towerd at its default durability "
        "(WAL, synchronous=FULL); direct baseline WAL, synchronous=FULL, busy_timeout=5000"
    )
    print()
    root = Path(tempfile.mkdtemp(prefix="towerd-writes-"))
    samples: list[Sample] = []
    try:
        for batch in CEILING_BATCHES:
            samples.append(measure_ceiling(root, batch, seconds))
        for n in counts:
            samples.append(measure_direct(root, n, seconds))
            samples.append(measure_towerd(root, n, seconds, tasks=False))
            samples.append(measure_towerd(root, n, seconds, tasks=True))
            samples.append(measure_engine(root, n, seconds))
            samples.append(measure_floor(root, n, seconds, "store"))
            samples.append(measure_floor(root, n, seconds, "sql"))
            samples.append(measure_floor(root, n, seconds, "minimal"))
        round_trip_us = measure_round_trip(root, seconds) if 1 in counts else None
    finally:
        if args.keep:
            print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    report(samples, seconds, round_trip_us)


if __name__ == "__main__":
    main()
