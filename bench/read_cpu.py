"""Where a read's CPU goes: towerd against the echo ceiling, by shared object.

    .venv/bin/python bench/read_cpu.py [--method ping] [--clients 50] [--seconds 2]

The 50-client read targets (bench/reads.py) are CPU-bound on towerd's one event-loop
thread: its answer costs more CPU than the echo's. This drives the same closed-loop
load at towerd and at the uvloop echo server (bench/_loadgen.py, bench/echo_server.py),
samples each with ``perf record`` over the window, and prints the microseconds of CPU
an answer spent in each shared object (the kernel, libpython's interpreter, uvloop,
msgspec, libc): which part of the request path a change must shrink. Needs ``perf``
(Debian: linux-perf) and permission to profile (root, or perf_event_paranoid <= 1).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import reads
from _loadgen import run_load

from benchlib import Daemon, machine, start_echo

ROWS_SHOWN = 8


def perf_while(pid: int, seconds: float, out: Path) -> threading.Thread:
    """``perf record`` of ``pid`` for ``seconds``, in a thread (started)."""
    command = ["perf", "record", "-q", "-F", "2999", "-o", str(out), "-p", str(pid),
               "--", "sleep", str(seconds)]  # fmt: skip
    thread = threading.Thread(target=subprocess.run, args=(command,),
                              kwargs={"capture_output": True})  # fmt: skip
    thread.start()
    return thread


def shares_by_object(data: Path) -> dict[str, float]:
    """Share of the samples in each shared object (0..1)."""
    report = subprocess.run(
        ["perf", "report", "-i", str(data), "--no-children", "--sort", "dso", "--stdio"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    shares: dict[str, float] = {}
    for line in report.splitlines():
        found = re.match(r"\s*([\d.]+)%\s+(\S+)", line)
        if found:
            name = re.sub(r"\.cpython-\d+-[^.]+\.so$|\.so[.\d]*$", "", found.group(2))
            shares[name] = shares.get(name, 0.0) + float(found.group(1)) / 100
    return shares


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", default="ping", choices=["ping", "fleet.get", "idem.get"])
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=2.0, help="profiled window")
    args = parser.parse_args()
    if shutil.which("perf") is None:
        raise SystemExit("needs perf (Debian: apt-get install linux-perf)")
    print(machine())
    workdir = Path(tempfile.mkdtemp(prefix="bench-read-cpu-", dir="/tmp"))
    daemon = Daemon(workdir, ["--max-connections-per-process", str(args.clients + 64)])
    echo = None
    try:
        if not daemon.start():
            raise SystemExit(f"towerd did not start; see {workdir / 'daemon.log'}")
        requests = reads.setup(daemon)
        answers = reads.record_answers(daemon.socket_path, requests)
        sizes = {method: len(answer) - 4 for method, answer in answers.items()}
        replies = workdir / "replies.json"
        replies.write_text(
            json.dumps([[requests[m][4:].hex(), answers[m].hex()] for m in requests])
        )
        echo_path = workdir / "echo.sock"
        echo = start_echo(echo_path, replies, True)
        servers = [
            ("towerd", daemon.socket_path, daemon.pid, reads.HELLO),
            ("echo uvloop", echo_path, echo.pid, None),
        ]
        per_answer: dict[str, dict[str, float]] = {}
        totals: dict[str, float] = {}
        for name, path, pid, hello in servers:
            data = workdir / f"perf-{name.replace(' ', '-')}.data"
            profiler = perf_while(pid, args.seconds, data)
            # The load runs past the profiled window on both sides (warm-up before it).
            load = run_load(path, [requests[args.method]], [sizes[args.method]],
                            clients=args.clients, warmup=0.5, window=args.seconds + 1.0,
                            hello=hello, server_pid=pid)  # fmt: skip
            profiler.join()
            cpu_us = load.server_cpu_pct / 100 / load.rps * 1e6
            totals[name] = cpu_us
            per_answer[name] = {obj: share * cpu_us for obj, share in
                                shares_by_object(data).items()}  # fmt: skip
            print(f"{name}: {load.rps:.0f} req/s, {load.server_cpu_pct:.0f}% of a core, "
                  f"{cpu_us:.2f} us of CPU an answer")  # fmt: skip
        objects = sorted(per_answer["towerd"], key=lambda o: -per_answer["towerd"][o])
        print(f"\n{args.method}, {args.clients} clients: us of CPU an answer, by shared object")
        print(f"{'object':<28} {'towerd':>8} {'echo':>8} {'towerd - echo':>14}")
        for obj in objects[:ROWS_SHOWN]:
            ours, theirs = per_answer["towerd"][obj], per_answer["echo uvloop"].get(obj, 0.0)
            print(f"{obj:<28} {ours:8.2f} {theirs:8.2f} {ours - theirs:14.2f}")
        ours, theirs = totals["towerd"], totals["echo uvloop"]
        print(f"{'all':<28} {ours:8.2f} {theirs:8.2f} {ours - theirs:14.2f}")
    finally:
        if echo is not None:
            echo.kill()
        daemon.stop()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
