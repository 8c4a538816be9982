"""towerd with perf_counter_ns stamps on its PostgreSQL write path (bench/pg_write_path.py).

Run as ``python bench/_pg_stamps.py [path/to/towerd] ARGS...``: it wraps, in this
process only, the points a write passes (the daemon's code is not changed): the
connection's ``data_received`` and ``send``, ``Store.write`` (queued) and the job's
future (resolved), ``_PgThread.submit`` for a batch (handed to the writer thread, the
thread's start and end, back on the loop), and each statement on the writer's
connection (``PgConnection.execute`` and ``begin_batch``). SIGUSR1 forgets what was
stamped, SIGUSR2 writes it as JSON to ``$TOWERD_STAMPS_OUT``. The stamps are
CLOCK_MONOTONIC (perf_counter_ns on Linux): one timeline for every process.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from typing import Any

from towerd.daemon import server
from towerd.daemon.main import main
from towerd.daemon.store import pg, pg_store, store

ns = time.perf_counter_ns
OUT = os.environ.get("TOWERD_STAMPS_OUT", f"/tmp/towerd-stamps-{os.getpid()}.json")
current: dict[str, Any] = {"conn": None, "read": None}
jobs: dict[int, dict[str, Any]] = {}  # id(future) -> the job's stamps
sends: list[tuple[int, int]] = []  # (connection, when a reply was written)
batches: list[dict[str, Any]] = []
in_thread = threading.local()


def _wrap(owner: Any, name: str, make: Any) -> None:
    original = getattr(owner, name, None)
    if original is None:
        raise SystemExit(f"bench/_pg_stamps.py: {owner.__name__}.{name} is gone; update me")
    setattr(owner, name, make(original))


def _data_received(original: Any) -> Any:
    def data_received(self: Any, data: bytes) -> None:
        current["conn"], current["read"] = id(self), ns()
        try:
            original(self, data)
        finally:
            current["conn"] = None

    return data_received


def _send(original: Any) -> Any:
    def send(self: Any, frame: bytes) -> None:
        sends.append((id(self), ns()))
        original(self, frame)

    return send


def _write(original: Any) -> Any:
    def write(self: Any, fn: Any, *args: Any) -> Any:
        queued = ns()
        future = original(self, fn, *args)
        job = {"conn": current["conn"], "read": current["read"], "queued": queued}
        jobs[id(future)] = job
        future.add_done_callback(lambda _: job.__setitem__("resolved", ns()))
        return future

    return write


def _submit(original: Any) -> Any:
    def submit(self: Any, fn: Any, *args: Any) -> Any:
        if getattr(fn, "__name__", "") != "_run_batch":
            return original(self, fn, *args)
        batch = {"call": ns(), "stmts": [], "jobs": [jobs.get(id(j.future)) for j in args[0]]}
        batches.append(batch)

        def stamped(conn: Any, *rest: Any) -> Any:
            batch["thread"] = ns()
            in_thread.batch = batch
            try:
                return fn(conn, *rest)
            finally:
                in_thread.batch = None
                batch["thread_end"] = ns()

        future = original(self, stamped, *args)
        future.add_done_callback(lambda _: batch.__setitem__("resume", ns()))
        return future

    return submit


def _statement(label: Any) -> Any:
    def wrap(original: Any) -> Any:
        def run(self: Any, *args: Any) -> Any:
            batch = getattr(in_thread, "batch", None)
            began = ns()
            try:
                return original(self, *args)
            finally:
                if batch is not None:
                    batch["stmts"].append((label(args), began, ns()))

        return run

    return wrap


def dump(*_: Any) -> None:
    with open(OUT, "w") as handle:
        json.dump({"batches": batches, "sends": sends}, handle)


def forget(*_: Any) -> None:
    batches.clear()
    sends.clear()
    jobs.clear()


_wrap(server.Connection, "data_received", _data_received)
_wrap(server.Connection, "send", _send)
_wrap(store.Store, "write", _write)
_wrap(pg_store._PgThread, "submit", _submit)
_wrap(pg.PgConnection, "execute", _statement(lambda args: args[0].split("\n")[0][:60]))
_wrap(pg.PgConnection, "begin_batch", _statement(lambda args: "BEGIN + lock + head"))
signal.signal(signal.SIGUSR1, forget)
signal.signal(signal.SIGUSR2, dump)

if __name__ == "__main__":
    if len(sys.argv) > 1 and os.path.basename(sys.argv[1]) == "towerd":
        del sys.argv[1]  # benchlib.Daemon runs [*prefix, towerd, ...]
    sys.argv[0] = "towerd"
    main()
