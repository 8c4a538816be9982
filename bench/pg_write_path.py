"""Where a durable write's time goes on the PostgreSQL store, stage by stage.

    .venv/bin/python bench/pg_write_path.py [--seconds 3] [--clients 1,8] [--rounds 2]

A private durable cluster (tests/pg_cluster.py, ``durable=True``: fsync and
synchronous_commit on, over its Unix socket), one fresh database, two towerd boxes on
it, each run through bench/_pg_stamps.py (perf_counter_ns stamps at each stage of the
write path; the daemon's code is unchanged, the stamps cost it a few microseconds per
stage). For each N (client processes per box) on one box and on two boxes, N client
processes per box do ``idem_claim`` + ``idem_complete`` of fresh keys for the window;
the daemons' stamps of that window give, per request (medians, microseconds):

* decode + handler: the socket read to the write queued (``Store.write``);
* queue wait: queued to its batch handed to the writer thread (``_PgThread.submit``);
* hop to thread, hop back: the handover to the writer's thread and back to the loop;
* BEGIN + lock + head: BEGIN, the writer lock (its wait, on two boxes) and the
  clock/epoch/dead_at statement, one round trip (``PgConnection.begin_batch``);
* the store functions' statements (summed per batch), COMMIT (with the batch's
  notifications; the server's fsync), and the Python between statements;
* resolved: back on the loop to the caller's future resolved; reply: to the reply
  written to the socket. TOTAL: socket read to reply written.

Rounds are interleaved (one box, two boxes, ...) and pooled. The figures are the
daemon's only: the client's own time and the socket hops to it are not in TOTAL.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from benchlib import Daemon, machine
from towerd.client import Client

HERE = Path(__file__).resolve().parent
STAMPED = [sys.executable, str(HERE / "_pg_stamps.py")]
BOX_ARGS = ["--log-level", "warning"]


def worker(socket_path: str, index: int, start: float, seconds: float, done: Any) -> None:
    with Client(Path(socket_path), codec="msgspec") as client:
        while time.monotonic() < start:
            time.sleep(0.001)
        n = 0
        while time.monotonic() < start + seconds:
            key = f"w{os.getpid()}-{n}"
            client.idem_claim("bench.path", key)
            client.idem_complete("bench.path", key, {"n": n})
            n += 1
        done.put(n)


def window(boxes: list[Daemon], outs: list[Path], per_box: int, seconds: float) -> float:
    """Run the clients for one window with the daemons' stamps reset before and written
    after it; returns the ops (claim + complete) per second."""
    ctx = mp.get_context("fork")
    done = ctx.Queue()
    for box in boxes:
        os.kill(box.pid, signal.SIGUSR1)
    start = time.monotonic() + 1.0
    workers = [
        ctx.Process(target=worker, args=(str(box.socket_path), i, start, seconds, done))
        for box in boxes
        for i in range(per_box)
    ]
    for proc in workers:
        proc.start()
    ops = sum(done.get(timeout=seconds + 60) for _ in workers)
    for proc in workers:
        proc.join(30)
    for box, out in zip(boxes, outs, strict=False):
        out.unlink(missing_ok=True)
        os.kill(box.pid, signal.SIGUSR2)
    for out in outs[: len(boxes)]:
        deadline = time.monotonic() + 10
        while not out.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # written in one go; let it finish
    return ops / seconds


BRACKETS = ("BEGIN + lock + head", "COMMIT")
STAGES = [
    "jobs per batch (mean)",
    "decode + handler",
    "queue wait",
    "hop to thread",
    "BEGIN + lock + head (incl. lock wait)",
    "store function statements (sum)",
    "statements per batch (mean)",
    "COMMIT (notifications, fsync)",
    "python between statements",
    "hop back to loop",
    "resolved",
    "reply",
    "TOTAL socket read -> reply",
]
MEANS = {"jobs per batch (mean)", "statements per batch (mean)"}


def stages(paths: list[Path]) -> dict[str, list[float]]:
    found: dict[str, list[float]] = defaultdict(list)
    for path in paths:
        data = json.loads(path.read_text())
        sends = defaultdict(list)
        for conn, at in data["sends"]:
            sends[conn].append(at)
        for batch in data["batches"]:
            stmts = batch["stmts"]
            if "resume" not in batch or "thread" not in batch or not stmts:
                continue
            own = [s for s in stmts if s[0] not in BRACKETS]
            found["jobs per batch (mean)"].append(len(batch["jobs"]))
            found["hop to thread"].append(batch["thread"] - batch["call"])
            for label, key in (("BEGIN + lock + head", "BEGIN + lock + head (incl. lock wait)"),
                               ("COMMIT", "COMMIT (notifications, fsync)")):  # fmt: skip
                found[key].append(sum(e - s for name, s, e in stmts if name == label))
            found["store function statements (sum)"].append(sum(e - s for _, s, e in own))
            found["statements per batch (mean)"].append(len(own))
            found["python between statements"].append(
                (stmts[0][1] - batch["thread"]) + (batch["thread_end"] - stmts[-1][2])
                + sum(b[1] - a[2] for a, b in zip(stmts, stmts[1:], strict=False))
            )  # fmt: skip
            found["hop back to loop"].append(batch["resume"] - batch["thread_end"])
            for job in batch["jobs"]:
                if not job or job.get("read") is None or "resolved" not in job:
                    continue
                found["decode + handler"].append(job["queued"] - job["read"])
                found["queue wait"].append(batch["call"] - job["queued"])
                found["resolved"].append(job["resolved"] - batch["resume"])
                replies = [at for at in sends[job["conn"]] if at >= job["resolved"]]
                if replies:
                    found["reply"].append(replies[0] - job["resolved"])
                    found["TOTAL socket read -> reply"].append(replies[0] - job["read"])
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--clients", default="1,8", help="client processes per box (1,8)")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    counts = [int(n) for n in args.clients.split(",")]
    sys.path.insert(0, str(HERE.parent / "tests"))
    from pg_cluster import PgCluster, postgres_available

    if (why := postgres_available()) is not None:
        raise SystemExit(f"no PostgreSQL here: {why}")
    root = Path(tempfile.mkdtemp(prefix="bench-pgpath-", dir="/tmp"))
    cluster = PgCluster(durable=True)
    boxes: list[Daemon] = []
    outs = [root / f"stamps-{name}.json" for name in ("a", "b")]
    pooled: dict[tuple[int, int], list[Path]] = defaultdict(list)
    rates: dict[tuple[int, int], list[float]] = defaultdict(list)
    try:
        cluster.start()
        dsn = cluster.new_database("towerd_path", migrated=True)
        cluster._close_admin()
        for name, out in zip(("a", "b"), outs, strict=True):
            workdir = root / f"box-{name}"
            workdir.mkdir(mode=0o700)
            box = Daemon(workdir, ["--store", dsn, *BOX_ARGS], prefix=STAMPED,
                         env={"TOWERD_STAMPS_OUT": str(out)})  # fmt: skip
            if not box.start():
                raise RuntimeError(f"towerd did not start; see {workdir / 'daemon.log'}")
            boxes.append(box)
        for rnd in range(args.rounds):
            for n in counts:
                for nboxes in (1, 2):
                    rates[n, nboxes].append(window(boxes[:nboxes], outs, n, args.seconds))
                    for out in outs[:nboxes]:
                        kept = root / f"r{rnd}-n{n}-b{nboxes}-{out.name}"
                        out.rename(kept)
                        pooled[n, nboxes].append(kept)
    finally:
        for box in boxes:
            try:
                box.stop()
            except Exception:  # noqa: BLE001 - it must not outlive the run
                box.kill()
        cluster.close()
    print(machine())
    print(
        f"PostgreSQL write path, claim + complete, durable private cluster over its Unix "
        f"socket; {args.rounds} round(s) of {args.seconds:g} s per column, pooled; medians "
        "in microseconds per request (per batch for the writer's stages)"
    )
    columns = [(n, b) for n in counts for b in (1, 2)]
    found = {key: stages(pooled[key]) for key in columns}
    head = f"{'stage':40s}" + "".join(f"{f'{n}/box, {b} box':>16s}" for n, b in columns)
    print(head)
    print("-" * len(head))
    rate = "".join(f"{statistics.mean(rates[key]):16.0f}" for key in columns)
    print(f"{'ops/s (claim + complete pairs)':40s}{rate}")
    for stage in STAGES:
        cells = ""
        for key in columns:
            values = found[key].get(stage, [])
            if not values:
                cells += f"{'-':>16s}"
            elif stage in MEANS:
                cells += f"{statistics.mean(values):16.1f}"
            else:
                cells += f"{statistics.median(values) / 1000:16.0f}"
        print(f"{stage:40s}{cells}")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
