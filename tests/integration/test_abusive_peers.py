"""Slow, idle, flooding and non-reading peers cost the daemon a bounded amount and never
stop it from serving everyone else."""

from __future__ import annotations

import socket
import struct
import time

import msgspec

from towerd_testing import wait_for


def raw_connect(daemon) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(str(daemon.socket_path))
    return sock


def frame(value) -> bytes:
    payload = msgspec.msgpack.encode(value)
    return struct.pack(">I", len(payload)) + payload


def hello(sock: socket.socket) -> None:
    sock.sendall(frame({"id": 1, "method": "hello", "params": {"protocol": 1, "client": "t"}}))
    read_frames(sock, 1)


def read_frames(sock: socket.socket, count: int) -> list[dict]:
    data = b""
    answers = []
    while len(answers) < count:
        while len(data) < 4 or len(data) < 4 + struct.unpack(">I", data[:4])[0]:
            chunk = sock.recv(65536)
            if not chunk:
                return answers
            data += chunk
        (length,) = struct.unpack(">I", data[:4])
        answers.append(msgspec.msgpack.decode(data[4 : 4 + length]))
        data = data[4 + length :]
    return answers


def read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk


def ping_latency(daemon) -> float:
    started = time.perf_counter()
    with daemon.client(timeout=5) as client:
        client.ping()
    return time.perf_counter() - started


def test_a_frame_that_never_finishes_is_closed_after_the_frame_timeout(make_daemon):
    """A peer that starts a frame and stalls is told bad_frame and closed once the
    frame timeout passes; an idle peer (no frame started) is left alone."""
    daemon = make_daemon()
    daemon.extra_args = ["--frame-timeout", "0.5"]
    daemon.start()
    idle, stalled = raw_connect(daemon), raw_connect(daemon)
    hello(idle)
    hello(stalled)
    stalled.sendall(struct.pack(">I", 100) + b"\x83")  # 1 of 100 bytes
    started = time.monotonic()
    answer = msgspec.msgpack.decode(read_until_closed(stalled)[4:])
    assert 0.4 < time.monotonic() - started < 5
    assert answer["id"] == 0 and answer["error"]["code"] == "bad_frame"
    assert "not completed" in answer["error"]["message"]
    idle.sendall(frame({"id": 2, "method": "ping", "params": {}}))
    assert read_frames(idle, 1)[0]["result"]["pong"] is True
    idle.close()
    assert daemon.stop() == 0


def test_connections_beyond_the_cap_are_refused_and_the_rest_served(make_daemon):
    """With --max-connections 8, the 9th connection gets `unavailable` and is closed;
    once one closes, a new client is served again."""
    daemon = make_daemon()
    daemon.extra_args = ["--max-connections", "8"]
    daemon.start()
    held = [raw_connect(daemon) for _ in range(8)]
    for sock in held:
        hello(sock)
    extra = raw_connect(daemon)
    answer = msgspec.msgpack.decode(read_until_closed(extra)[4:])
    assert answer["error"]["code"] == "unavailable"
    assert answer["error"]["data"] == {"reason": "too_many_connections", "limit": 8}
    held.pop().close()

    def served() -> bool:
        try:
            return ping_latency(daemon) < 5
        except Exception:
            return False

    wait_for(served, timeout=10, what="a free connection slot")
    for sock in held:
        sock.close()
    assert daemon.stop() == 0


def test_a_peer_that_never_reads_is_dropped_and_costs_bounded_memory(make_daemon):
    """A peer pipelines thousands of requests with large answers and never reads: the
    daemon stops reading from it (bounded in-flight), drops it after the send timeout,
    its RSS stays bounded, and other clients are served meanwhile."""
    daemon = make_daemon()
    daemon.extra_args = ["--send-timeout", "1"]
    daemon.start()
    with daemon.client() as client:
        for n in range(40):
            client.session_register(cwd="/r", agent="a", prompt=f"{n}" * 20000)
    rss_before = rss_kib(daemon.pid)
    greedy = raw_connect(daemon)
    hello(greedy)
    greedy.setblocking(False)
    request = frame({"id": 7, "method": "fleet.list", "params": {}})  # ~800 KB answers
    sent = 0
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and sent < 5000:
        try:
            greedy.send(request)
            sent += 1
        except BlockingIOError:
            break  # the daemon stopped reading from us: backpressure, not buffering
    latencies = [ping_latency(daemon) for _ in range(20)]
    assert max(latencies) < 2.0, latencies

    def dropped() -> bool:
        try:
            greedy.send(request)
        except (BrokenPipeError, ConnectionResetError):
            return True
        except BlockingIOError:
            return False
        return False

    wait_for(dropped, timeout=15, what="the daemon to drop the non-reading peer")
    greedy.close()
    assert rss_kib(daemon.pid) - rss_before < 200_000, "daemon memory grew without bound"
    assert ping_latency(daemon) < 2.0
    assert daemon.stop() == 0


def rss_kib(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_a_burst_of_connections_is_not_refused_by_a_short_backlog(daemon):
    """Hundreds of hooks connecting at the same instant: none is turned away by the
    kernel (asyncio's default listen backlog of 100 did exactly that)."""
    burst = []
    try:
        for _ in range(600):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.setblocking(False)
            sock.connect(str(daemon.socket_path))  # BlockingIOError if the backlog is full
            burst.append(sock)
    finally:
        for sock in burst:
            sock.close()
    assert len(burst) == 600
    assert ping_latency(daemon) < 2.0
