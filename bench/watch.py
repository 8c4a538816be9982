"""Fan-out of ``watch``: how soon the last of N watchers has a change, and what
watchers cost the writer.

    .venv/bin/python bench/watch.py [--quick] [--watchers 100] [--writes 2000] [--batch 32]
                                    [--rounds 2]

Starts its own towerd (benchlib.Daemon, temp dir, default flags). The watchers
live in one separate process (this script run with ``--child``): one uvloop
event loop holding N raw connections, each a bare asyncio ``Protocol`` that says
hello, watches ``["events"]`` and then only stamps each chunk it receives with
``time.monotonic_ns()`` (decoded later, so a watcher's own work does not delay
the next one's reading). The writer is this process: a blocking ``Client``
(msgspec codec) recording ``event.record`` calls of a ~110-byte hook event, each
phase on a fresh session:

* sequential: ``--writes`` calls one after the other; for each, the time from
  the writer's ack (the call returned) to the moment the LAST watcher got its
  push (``monotonic`` is one clock for every process of the machine), and from
  the request being sent; the first watcher too;
* pipelined: the same number of calls, ``--batch`` at a time on one raw
  connection (the requests of a batch sent in one write, the next batch once all
  are answered); each answer is stamped when it is read.

Phases, each on the same daemon: ``--rounds`` rounds (default 2) of 0 watchers,
1 watcher (the latency baseline) and N watchers, every other round in reverse
order (0, 1, N, N, 1, 0) so drift over the run hits them alike; each
configuration's figures pool its rounds. Throughput ratios are against 0
watchers, latency ratios against 1 watcher. ``daemon us/write`` is the daemon's
user+system CPU time per write over a phase, ``watchers us/write`` the watcher
process's (10 ms clock ticks: coarse for short phases). Loss check: every
watcher must have received every seq of its subscription, 1 to the last, in
order, carrying the writer's event ids. The daemon publishes a commit to
watchers before it answers the writers, so a watcher can have a push before the
writer has read its answer: those latencies from the ack are negative.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from benchlib import Daemon, machine, percentile
from towerd.client import Client
from towerd.protocol import FrameDecoder
from towerd.protocol.envelope import encode_request

try:
    import uvloop
except ImportError:  # pragma: no cover - the daemon's own dependency
    uvloop = None

HOOK_EVENT = {
    "hook_event_name": "PostToolUse",
    "tool_name": "Bash",
    "tool_input": {"command": "git status --short"},
    "tool_response": {"exit_code": 0},
}
COLLECT_TIMEOUT = 60.0


# --- the watchers (the --child process) ------------------------------------------------


class Watcher(asyncio.Protocol):
    """hello, watch ["events"], then stamp every chunk that arrives."""

    def __init__(self, ready: asyncio.Future[None]) -> None:
        self.ready = ready
        self.decoder = FrameDecoder(2 * 1024 * 1024)
        self.answers = 0
        self.chunks: list[tuple[int, bytes]] = []
        self.seqs: list[int] = []  # decoded so far: seq, receive time, event id
        self.times: list[int] = []
        self.event_ids: list[int] = []
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        hello = {"protocol": 1, "client": "bench-watcher"}
        self.transport.write(  # type: ignore[union-attr]
            encode_request(1, "hello", hello) + encode_request(2, "watch", {"topics": ["events"]})
        )

    def data_received(self, data: bytes) -> None:
        if self.answers < 2:
            for frame in self.decoder.feed(data):
                answer = msgspec.msgpack.decode(frame)
                if "error" in answer:
                    self.ready.set_exception(RuntimeError(f"watch refused: {answer}"))
                    return
                self.answers += 1
            if self.answers == 2 and not self.ready.done():
                self.ready.set_result(None)
            return
        self.chunks.append((time.monotonic_ns(), data))

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.ready.done():
            self.ready.set_exception(RuntimeError(f"connection lost: {exc}"))

    def decode(self) -> None:
        chunks, self.chunks = self.chunks, []
        for stamp, data in chunks:
            for frame in self.decoder.feed(data):
                push = msgspec.msgpack.decode(frame)
                if "event" not in push:
                    raise RuntimeError(f"watcher got a non-push frame: {push}")
                self.seqs.append(push["seq"])
                self.times.append(stamp)
                self.event_ids.append(push["data"]["event_id"])


async def collect(watchers: list[Watcher], first: int, last: int) -> dict[str, Any]:
    """Wait until every watcher has seq ``last``; per seq ``first..last``: when the first
    and the last watcher got it; whether every watcher got exactly those seqs."""
    deadline = time.monotonic() + COLLECT_TIMEOUT
    while True:
        for watcher in watchers:
            watcher.decode()
        if all(len(w.seqs) >= last for w in watchers) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.01)
    wanted = list(range(first, last + 1))
    complete = sum(1 for w in watchers if w.seqs[first - 1 :] == wanted)
    reference = watchers[0].event_ids[first - 1 : last]
    agree = all(w.event_ids[first - 1 : last] == reference for w in watchers)
    earliest, latest = [], []
    for index in range(first - 1, last):
        stamps = [w.times[index] for w in watchers if len(w.times) > index]
        earliest.append(min(stamps, default=0))
        latest.append(max(stamps, default=0))
    return {
        "complete": complete,
        "agree": agree,
        "event_ids": reference,
        "first": earliest,
        "last": latest,
    }


async def child(socket_path: str, count: int) -> None:
    loop = asyncio.get_running_loop()
    watchers = []
    for _ in range(count):
        ready: asyncio.Future[None] = loop.create_future()
        _transport, watcher = await loop.create_unix_connection(
            lambda r=ready: Watcher(r), socket_path
        )
        watchers.append(watcher)
        await ready
    print(json.dumps({"ready": count}), flush=True)
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        command = line.split()
        if not command or command[0] == "exit":
            break
        first, last = int(command[1]), int(command[2])
        print(json.dumps(await collect(watchers, first, last)), flush=True)
    for watcher in watchers:
        assert watcher.transport is not None
        watcher.transport.close()


def run_child(socket_path: str, count: int) -> None:
    if uvloop is not None:
        uvloop.run(child(socket_path, count))
    else:
        asyncio.run(child(socket_path, count))


class Watchers:
    """The watcher process, driven over its stdin/stdout."""

    def __init__(self, socket_path: Path, count: int) -> None:
        self.count = count
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--child", str(socket_path), str(count)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert json.loads(self.readline())["ready"] == count
        self.seen = 0  # seqs handed out so far

    def readline(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the watcher process exited (rc {self.proc.wait(10)})")
        return line

    def collect(self, writes: int) -> dict[str, Any]:
        assert self.proc.stdin is not None
        first, last = self.seen + 1, self.seen + writes
        self.proc.stdin.write(f"collect {first} {last}\n")
        self.proc.stdin.flush()
        self.seen = last
        return json.loads(self.readline())

    def cpu_seconds(self) -> float:
        return cpu_seconds(self.proc.pid)

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("exit\n")
        self.proc.stdin.flush()
        self.proc.wait(30)


# --- the writer -------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Phase:
    name: str
    watchers: int
    mode: str
    writes: int = 0
    seconds: float = 0.0
    daemon_cpu: float = 0.0
    watchers_cpu: float = 0.0
    sent: list[int] = field(default_factory=list)  # per write, monotonic ns
    acked: list[int] = field(default_factory=list)
    event_ids: list[int] = field(default_factory=list)
    fanout: dict[str, Any] | None = None

    @property
    def rate(self) -> float:
        return self.writes / self.seconds

    def latencies_ms(self, key: str, since: list[int]) -> list[float]:
        assert self.fanout is not None
        return [(got - at) / 1e6 for got, at in zip(self.fanout[key], since, strict=True)]


class Pipe:
    """A raw connection for pipelined writes: each answer stamped as it is read."""

    def __init__(self, socket_path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(str(socket_path))
        self.decoder = FrameDecoder(2 * 1024 * 1024)
        self.sock.sendall(encode_request(1, "hello", {"protocol": 1, "client": "bench-writer"}))
        ((hello, _stamp),) = self.answers(1)
        assert "result" in hello, hello

    def answers(self, count: int) -> list[tuple[dict[str, Any], int]]:
        """The next ``count`` answers, in order, each with when it was read."""
        got: list[tuple[dict[str, Any], int]] = []
        while len(got) < count:
            data = self.sock.recv(1 << 20)
            if not data:
                raise RuntimeError("towerd closed the connection")
            stamp = time.monotonic_ns()
            for frame in self.decoder.feed(data):
                answer = msgspec.msgpack.decode(frame)
                if "error" in answer:
                    raise RuntimeError(f"a write failed: {answer}")
                got.append((answer, stamp))
        return got

    def close(self) -> None:
        self.sock.close()


def write_phase(
    client: Client,
    pipe: Pipe | None,
    daemon: Daemon,
    name: str,
    mode: str,
    writes: int,
    batch: int,
    watchers: Watchers | None,
) -> Phase:
    phase = Phase(name, watchers.count if watchers else 0, mode)
    session = client.session_register(cwd="/bench", agent="bench")["session_id"]
    params = {"kind": "PostToolUse", "session_id": session, "payload": HOOK_EVENT}
    daemon_cpu = cpu_seconds(daemon.pid)
    watchers_cpu = watchers.cpu_seconds() if watchers else 0.0
    started = time.perf_counter()
    if mode == "sequential":
        for _ in range(writes):
            sent = time.monotonic_ns()
            answer = client.call("event.record", params)
            phase.acked.append(time.monotonic_ns())
            phase.sent.append(sent)
            phase.event_ids.append(answer["event_id"])
    else:
        assert pipe is not None
        frames = [
            encode_request(request_id, "event.record", params) for request_id in range(1, batch + 1)
        ]
        for offset in range(0, writes, batch):
            size = min(batch, writes - offset)
            sent = time.monotonic_ns()
            pipe.sock.sendall(b"".join(frames[:size]))
            for answer, acked in pipe.answers(size):
                phase.event_ids.append(answer["result"]["event_id"])
                phase.acked.append(acked)
            phase.sent += [sent] * size
    phase.seconds = time.perf_counter() - started
    phase.writes = writes
    phase.daemon_cpu = cpu_seconds(daemon.pid) - daemon_cpu
    if watchers:
        phase.fanout = watchers.collect(writes)
        phase.watchers_cpu = watchers.cpu_seconds() - watchers_cpu
    return phase


def summary(values: list[float]) -> tuple[float, float, float, float]:
    return (
        percentile(values, 0.5),
        percentile(values, 0.95),
        percentile(values, 0.99),
        max(values),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--watchers", type=int, default=100)
    parser.add_argument("--writes", type=int, default=2000, help="per phase and mode")
    parser.add_argument("--batch", type=int, default=32, help="writes per pipelined batch")
    parser.add_argument("--rounds", type=int, default=2, help="of 0, 1, N watchers (ABC CBA...)")
    parser.add_argument("--quick", action="store_true", help="20 watchers, 300 writes, 1 round")
    parser.add_argument("--child", nargs=2, metavar=("SOCKET", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        run_child(args.child[0], int(args.child[1]))
        return
    if args.quick:
        args.watchers, args.writes, args.rounds = 20, 300, 1

    workdir = Path(tempfile.mkdtemp(prefix="watch-bench-", dir="/tmp"))
    # Every watcher's connection comes from one process.
    daemon = Daemon(workdir, ["--max-connections-per-process", str(args.watchers + 64)])
    daemon.start()
    print(machine())
    print(
        f"watchers: one {'uvloop' if uvloop else 'asyncio'} process, raw sockets; writer: "
        f"blocking Client (msgspec), event.record of a {len(msgspec.msgpack.encode(HOOK_EVENT))}"
        f"-byte hook event; {args.writes} writes per phase and mode, pipelined {args.batch} per "
        f"batch; {args.rounds} round(s) of 0, 1, {args.watchers} watchers, every other reversed"
    )
    phases: list[Phase] = []
    pipe = Pipe(daemon.socket_path)
    with Client(daemon.socket_path, codec="msgspec") as client:
        for _ in range(300):  # warm up
            client.ping()
        for round_ in range(args.rounds):
            counts = [0, 1, args.watchers]
            for count in counts if round_ % 2 == 0 else counts[::-1]:
                watchers = Watchers(daemon.socket_path, count) if count else None
                for mode in ("sequential", "pipelined"):
                    phases.append(
                        write_phase(
                            client, pipe, daemon, f"{count} watchers", mode, args.writes,
                            args.batch, watchers,
                        )
                    )  # fmt: skip
                if watchers:
                    watchers.close()
        client.ping()
    pipe.close()
    daemon.stop()
    report(phases, args.watchers)


@dataclass
class Pooled:
    """The phases of one (watchers, mode) pooled over the rounds."""

    phases: list[Phase]

    @property
    def rate(self) -> float:
        return sum(p.writes for p in self.phases) / sum(p.seconds for p in self.phases)

    def per_write_us(self, name: str) -> float:
        total = sum(getattr(p, name) for p in self.phases)
        return total / sum(p.writes for p in self.phases) * 1e6

    def latencies_ms(self, who: str, since: str) -> list[float]:
        return [v for p in self.phases for v in p.latencies_ms(who, getattr(p, since))]

    def lossless(self) -> bool:
        return all(
            p.fanout is not None
            and p.fanout["complete"] == p.watchers
            and p.fanout["agree"]
            and p.fanout["event_ids"] == p.event_ids
            for p in self.phases
        )


def report(phases: list[Phase], many: int) -> None:
    modes = ("sequential", "pipelined")
    pooled = {
        (count, mode): Pooled([p for p in phases if p.watchers == count and p.mode == mode])
        for count in (0, 1, many)
        for mode in modes
    }
    print()
    print("writer throughput (ratio: to 0 watchers; CPU: user+system per write, pooled rounds)")
    print(
        f"{'watchers':>8} {'mode':10} {'writes/s':>9} {'ratio':>6} {'rounds':>14} "
        f"{'daemon us/write':>16} {'watchers us/write':>18}"
    )
    for count in (0, 1, many):
        for mode in modes:
            pool = pooled[count, mode]
            rounds = "/".join(f"{p.rate:.0f}" for p in pool.phases)
            print(
                f"{count:8} {mode:10} {pool.rate:9.0f} {pool.rate / pooled[0, mode].rate:6.2f} "
                f"{rounds:>14} {pool.per_write_us('daemon_cpu'):16.0f} "
                f"{pool.per_write_us('watchers_cpu'):18.0f}"
            )

    print()
    print("fan-out latency, ms: until the first / last watcher had the push, from the writer's")
    print("ack (negative: the push beat the answer) and from the request being sent; x: the")
    print("from-sent figure against 1 watcher's")
    print(
        f"{'watchers':>8} {'mode':10} {'who':5} "
        f"{'ack p50':>8} {'p95':>7} {'p99':>7} {'max':>7}  "
        f"{'sent p50':>8} {'p95':>7} {'p99':>7} {'max':>7} {'p50 x':>6} {'p99 x':>6}"
    )
    for mode in modes:
        one = pooled[1, mode]
        r50, _, r99, _ = summary(one.latencies_ms("last", "sent"))
        for count, who in ((1, "last"), (many, "first"), (many, "last")):
            pool = pooled[count, mode]
            a50, a95, a99, amax = summary(pool.latencies_ms(who, "acked"))
            s50, s95, s99, smax = summary(pool.latencies_ms(who, "sent"))
            print(
                f"{count:8} {mode:10} {who:5} {a50:8.3f} {a95:7.3f} {a99:7.3f} {amax:7.3f}  "
                f"{s50:8.3f} {s95:7.3f} {s99:7.3f} {smax:7.3f} {s50 / r50:6.2f} {s99 / r99:6.2f}"
            )
    print()
    lossless = all(pooled[count, mode].lossless() for count in (1, many) for mode in modes)
    total = sum(p.writes for p in phases if p.watchers == many)
    print(
        f"loss check: each of the {many} watchers got every seq of its subscription in order "
        f"({total} pushes each), carrying the writer's event ids: {'yes' if lossless else 'NO'}"
    )
    seq, pipelined = pooled[many, "sequential"], pooled[many, "pipelined"]
    last = summary(seq.latencies_ms("last", "acked"))
    sent = summary(seq.latencies_ms("last", "sent"))
    fanout_us = (
        seq.per_write_us("daemon_cpu") - pooled[0, "sequential"].per_write_us("daemon_cpu")
    ) / many
    print(
        f"summary: {many} watchers, sequential writes: the last watcher has the push "
        f"{last[0]:.2f} ms (p50) / {last[2]:.2f} ms (p99) / {last[3]:.2f} ms (max) after the "
        f"writer's ack, {sent[0]:.2f} / {sent[2]:.2f} ms after the request was sent; writer "
        f"throughput {seq.rate / pooled[0, 'sequential'].rate:.2f}x (sequential), "
        f"{pipelined.rate / pooled[0, 'pipelined'].rate:.2f}x (pipelined) of 0 watchers; "
        f"daemon CPU per push per watcher ~{fanout_us:.1f} us; no loss: "
        f"{'yes' if lossless else 'NO'}"
    )
    print('target: none set by the issue ("measure fan-out to 100 watchers"); no loss: required')


if __name__ == "__main__":
    main()
