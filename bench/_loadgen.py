"""Closed-loop load generator for length-prefixed frames over a Unix socket.

One event loop (uvloop's when installed) drives N connections, each a bare
``asyncio.Protocol``: it sends one pre-encoded request frame, waits for one
answer frame, sends the next (rotating through the given requests), and so on.
Nothing is encoded or decoded in the measured path: answers are only framed by
their length prefix and checked against the expected size (a frame of another
size is decoded afterwards, and an error answer is counted as an error).

A run is time-based: ``warmup`` seconds unrecorded, then every request *sent*
during the ``window`` is recorded (latency from ``perf_counter_ns`` before the
write to the complete answer). Throughput is recorded requests / window. The
generator's own CPU time and the server's (``/proc/PID/stat``, all threads)
over the window show which side is saturated.

The same function drives towerd and the echo ceiling (bench/echo_server.py);
only ``hello`` differs (towerd requires it, the echo server is not sent one).
"""

from __future__ import annotations

import asyncio
import os
import resource
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

try:
    import uvloop
except ImportError:  # pragma: no cover - the ceiling then runs on the stdlib loop too
    uvloop = None

_CLK_TCK = os.sysconf("SC_CLK_TCK")


def loop_name() -> str:
    return "uvloop" if uvloop is not None else "asyncio"


def frame(value: object) -> bytes:
    payload = msgspec.msgpack.encode(value)
    return len(payload).to_bytes(4, "big") + payload


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU of a whole process (every thread), from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK  # utime, stime


def machine_busy_seconds() -> float:
    """CPU seconds spent busy by the whole machine (all cores), from /proc/stat."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle = values[3] + values[4]  # idle, iowait
    return (sum(values[:8]) - idle) / _CLK_TCK  # up to steal; guest time is inside user


def ensure_fd_limit(needed: int) -> None:
    """Raise this process's soft RLIMIT_NOFILE to at least ``needed`` (children inherit it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= needed:
        return
    if hard != resource.RLIM_INFINITY and hard < needed:
        raise SystemExit(f"need {needed} file descriptors, the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))


def read_frame(sock: socket.socket) -> bytes:
    """One whole answer payload from a blocking socket."""

    def exactly(n: int) -> bytes:
        chunks = bytearray()
        while len(chunks) < n:
            data = sock.recv(n - len(chunks))
            if not data:
                raise ConnectionError("the server closed the connection")
            chunks += data
        return bytes(chunks)

    return exactly(int.from_bytes(exactly(4), "big"))


def check_result(payload: bytes, what: str) -> dict:
    answer = msgspec.msgpack.decode(payload)
    if not isinstance(answer, dict) or "result" not in answer:
        raise RuntimeError(f"{what} was not answered with a result: {answer!r}")
    return answer


def open_idle(path: Path, count: int, hello: bytes) -> list[socket.socket]:
    """``count`` blocking connections that said hello (and were answered), then stay idle."""
    ensure_fd_limit(count + 256)
    socks = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            socks.append(sock)
            sock.settimeout(30)
            sock.connect(str(path))
            sock.sendall(hello)
        for sock in socks:
            check_result(read_frame(sock), "an idle connection's hello")
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    return socks


@dataclass
class LoadResult:
    clients: int
    window_s: float
    samples: list[list[int]]  # latency in ns per request kind (index into ``requests``)
    gen_cpu_s: float
    server_cpu_s: float | None
    machine_cpu_s: float
    errors: list[str] = field(default_factory=list)

    @property
    def all_ns(self) -> list[int]:
        return [x for kind in self.samples for x in kind]

    @property
    def completed(self) -> int:
        return sum(len(kind) for kind in self.samples)

    @property
    def rps(self) -> float:
        return self.completed / self.window_s

    @property
    def gen_cpu_pct(self) -> float:
        return 100 * self.gen_cpu_s / self.window_s

    @property
    def server_cpu_pct(self) -> float:
        return (
            float("nan") if self.server_cpu_s is None else 100 * self.server_cpu_s / self.window_s
        )

    @property
    def other_cpu_pct(self) -> float:
        """Busy CPU of everything else on the machine (other processes, the kernel's own)."""
        ours = self.gen_cpu_s + (self.server_cpu_s or 0.0)
        return 100 * max(0.0, self.machine_cpu_s - ours) / self.window_s


class _Run:
    def __init__(self, requests: Sequence[bytes], sizes: Sequence[int], start: int, end: int):
        self.requests = list(requests)
        self.sizes = list(sizes)  # expected answer payload sizes
        self.start = start  # perf_counter_ns
        self.end = end
        self.samples: list[list[int]] = [[] for _ in requests]
        self.odd: list[bytes] = []  # answers of an unexpected size (kept: a few)
        self.odd_count = 0


class _Connection(asyncio.Protocol):
    def __init__(self, run: _Run, first: int, done: asyncio.Future[None]) -> None:
        self.run = run
        self.kind = first % len(run.requests)
        self.done = done
        self.buffer = bytearray()
        self.sent = 0
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future[bytes] | None = None  # for hello

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        error = ConnectionError(f"the server closed a connection ({exc})")
        for future in (self.waiter, self.done):
            if future is not None and not future.done():
                future.set_exception(error)

    def data_received(self, data: bytes) -> None:
        buffer = self.buffer
        if not buffer and len(data) >= 4 and int.from_bytes(data[:4], "big") + 4 == len(data):
            self.answered(data, len(data) - 4)  # the common case: exactly one whole frame
            return
        buffer += data
        while len(buffer) >= 4:
            end = 4 + int.from_bytes(buffer[:4], "big")
            if len(buffer) < end:
                return
            whole = bytes(buffer[:end])
            del buffer[:end]
            self.answered(whole, end - 4)

    def answered(self, whole: bytes, size: int) -> None:
        now = time.perf_counter_ns()
        if self.waiter is not None:
            waiter, self.waiter = self.waiter, None
            waiter.set_result(whole[4:])
            return
        run = self.run
        kind = self.kind
        if run.start <= self.sent < run.end:
            run.samples[kind].append(now - self.sent)
            if size != run.sizes[kind]:
                run.odd_count += 1
                if len(run.odd) < 5:
                    run.odd.append(whole[4:])
        if now >= run.end:
            if not self.done.done():
                self.done.set_result(None)
            return
        kind = self.kind = (kind + 1) % len(run.requests)
        self.sent = time.perf_counter_ns()
        self.transport.write(run.requests[kind])  # type: ignore[union-attr]

    def begin(self) -> None:
        self.sent = time.perf_counter_ns()
        self.transport.write(self.run.requests[self.kind])  # type: ignore[union-attr]


async def _drive(
    path: Path,
    requests: Sequence[bytes],
    sizes: Sequence[int],
    clients: int,
    warmup: float,
    window: float,
    hello: bytes | None,
    server_pid: int | None,
    spread: bool,
) -> LoadResult:
    loop = asyncio.get_running_loop()
    run = _Run(requests, sizes, 0, 0)
    connections: list[_Connection] = []
    for n in range(clients):
        done: asyncio.Future[None] = loop.create_future()
        first = n * len(requests) // clients if spread else n
        _, conn = await loop.create_unix_connection(
            lambda first=first, done=done: _Connection(run, first, done), str(path)
        )
        connections.append(conn)
        if hello is not None:
            conn.waiter = loop.create_future()
            conn.transport.write(hello)  # type: ignore[union-attr]
            check_result(await conn.waiter, "hello")
    cpu: dict[str, float] = {}

    def snapshot(label: str) -> None:
        cpu[f"gen_{label}"] = time.process_time()
        cpu[f"machine_{label}"] = machine_busy_seconds()
        if server_pid is not None:
            cpu[f"srv_{label}"] = process_cpu_seconds(server_pid)

    now = time.perf_counter_ns()
    run.start = now + int(warmup * 1e9)
    run.end = run.start + int(window * 1e9)
    loop.call_later(warmup, snapshot, "start")
    loop.call_later(warmup + window, snapshot, "end")
    for conn in connections:
        conn.begin()
    try:
        await asyncio.wait_for(
            asyncio.gather(*(conn.done for conn in connections)), warmup + window + 30
        )
    finally:
        for conn in connections:
            conn.transport.close()  # type: ignore[union-attr]
    if "gen_end" not in cpu:  # every answer came in before the timer fired
        snapshot("end")
    errors = []
    for payload in run.odd:
        answer = msgspec.msgpack.decode(payload)
        if isinstance(answer, dict) and "error" in answer:
            errors.append(repr(answer["error"]))
    if run.odd_count > len(run.odd) and errors:
        errors.append(f"... {run.odd_count} answers of an unexpected size in all")
    return LoadResult(
        clients=clients,
        window_s=window,
        samples=run.samples,
        gen_cpu_s=cpu["gen_end"] - cpu["gen_start"],
        server_cpu_s=(cpu["srv_end"] - cpu["srv_start"]) if server_pid is not None else None,
        machine_cpu_s=cpu["machine_end"] - cpu["machine_start"],
        errors=errors,
    )


def run_load(
    path: Path,
    requests: Sequence[bytes],
    sizes: Sequence[int],
    *,
    clients: int,
    warmup: float,
    window: float,
    hello: bytes | None = None,
    server_pid: int | None = None,
    spread: bool = False,
) -> LoadResult:
    """Drive ``clients`` closed-loop connections; ``sizes`` are the expected answer payloads'.

    Each connection sends ``requests`` in turn; with ``spread`` they start evenly apart
    in that list (else at their own index), so no two read the same item close in time."""
    ensure_fd_limit(clients + 256)
    loop_factory = uvloop.new_event_loop if uvloop is not None else None
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(
            _drive(path, requests, sizes, clients, warmup, window, hello, server_pid, spread)
        )
