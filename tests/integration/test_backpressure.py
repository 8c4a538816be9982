"""Backpressure between frames: a peer that writes a burst of requests and never reads
its answers gets only a bounded number of them run, costs the daemon bounded memory,
and does not slow anyone else down; a watcher that does the same is told ``too_slow``.

The bounds follow from the daemon's limits: at most ``MAX_IN_FLIGHT`` requests run at
once per connection, and no more are dispatched once an answer waits unsent (the
kernel's socket buffer is full), so what a non-reader gets done is what the kernel's
socket buffer holds in answers plus what was in flight.
"""

from __future__ import annotations

import json
import select
import socket
import struct
import time

import msgspec

from towerd_testing import rss_kib, wait_for

MAX_IN_FLIGHT = 16  # server.Limits.max_in_flight
WATCH_ID = 7


def frame(value) -> bytes:
    payload = msgspec.msgpack.encode(value)
    return struct.pack(">I", len(payload)) + payload


def request(request_id: int, method: str, params: dict | None = None) -> bytes:
    return frame({"id": request_id, "method": method, "params": params or {}})


HELLO = request(1, "hello", {"protocol": 1, "client": "backpressure-test"})


def raw_connect(daemon) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(str(daemon.socket_path))
    return sock


def read_exactly(sock: socket.socket, size: int) -> bytes | None:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def read_frame(sock: socket.socket) -> bytes | None:
    """One whole frame (prefix included), or None at end of stream."""
    prefix = read_exactly(sock, 4)
    if prefix is None:
        return None
    payload = read_exactly(sock, struct.unpack(">I", prefix)[0])
    return None if payload is None else prefix + payload


def decode(whole: bytes) -> dict:
    return msgspec.msgpack.decode(whole[4:])


def frames_until_closed(sock: socket.socket) -> list[dict]:
    values = []
    try:
        while (whole := read_frame(sock)) is not None:
            values.append(decode(whole))
    except ConnectionResetError:
        pass
    return values


def send_what_fits(sock: socket.socket, data: bytes) -> int:
    """Write ``data`` without blocking; the bytes the kernel took."""
    sock.setblocking(False)
    sent = 0
    try:
        while sent < len(data):
            sent += sock.send(data[sent:])
    except (BlockingIOError, BrokenPipeError, ConnectionResetError):
        pass
    return sent


def kernel_holds(frame_size: int) -> int:
    """How many writes of ``frame_size`` bytes one Unix socket's kernel buffer takes
    before the writer would block (the daemon writes each answer separately)."""
    writer, reader = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with writer, reader:
        writer.setblocking(False)
        writes = 0
        try:
            while True:
                writer.send(b"x" * frame_size)
                writes += 1
        except BlockingIOError:
            return writes + 1  # and the one the kernel took only part of


def log_events(daemon, event: str) -> list[dict]:
    """The daemon's JSON log entries for ``event`` (a line still being written is skipped)."""
    *complete, _partial = daemon.log().split("\n")
    entries = [json.loads(line) for line in complete if line.startswith("{")]
    return [entry for entry in entries if entry.get("event") == event]


def test_one_write_of_4000_registers_from_a_non_reader_runs_only_a_bounded_few(make_daemon):
    """4,000 `session.register` frames in one write from a peer that never reads: the
    daemon runs at most what the kernel's socket buffer holds in answers plus the 16 in
    flight, then drops the peer after the send timeout (the old code committed all)."""
    daemon = make_daemon().start("--send-timeout", "1")
    params = {"cwd": "/r", "agent": "a"}
    sizer = raw_connect(daemon)
    sizer.sendall(HELLO + request(2, "session.register", params))
    read_frame(sizer)
    answer_size = len(read_frame(sizer))  # every register answer has this size
    sizer.close()

    abuser = raw_connect(daemon)
    abuser.sendall(HELLO)
    read_frame(abuser)
    burst = b"".join(request(n, "session.register", params) for n in range(2, 4002))
    try:
        abuser.sendall(burst)  # one write; it blocks once the daemon stops reading
    except (BrokenPipeError, ConnectionResetError):
        pass  # dropped mid-write: the daemon read only part of the burst
    with daemon.client() as good:

        def registered() -> int:
            return good.status()["sessions"] - 1  # less the sizer's one

        wait_for(
            lambda: log_events(daemon, "peer_not_reading") or registered() == 4000,
            timeout=20,
            what="the daemon to drop the peer that never reads",
        )
        abuser.close()
        committed = registered()
    bound = kernel_holds(answer_size) + MAX_IN_FLIGHT
    assert 0 < committed <= bound, f"{committed} registers ran (bound {bound})"
    assert bound < 1000  # the bound is small: the peer got a few hundred, not 4,000
    assert daemon.stop() == 0


def test_non_readers_bursting_status_cost_bounded_memory_and_no_one_else_waits(make_daemon):
    """60 peers each write one ~271 KB burst of `status` and never read (the old code
    grew to ~1.2 GB and a ping took seconds): daemon RSS grows by at most 1 MiB per
    such peer (a read's worth of frames waiting undispatched, 256 KiB, and 16 answers),
    and a good client's pings stay fast meanwhile."""
    peers = 60
    daemon = make_daemon().start("--log-level", "info")
    burst = b"".join(request(n, "status") for n in range(2, 8200))
    assert 260_000 < len(burst) < 280_000
    with daemon.client(timeout=30) as good:
        good.ping()
        rss_before = rss_kib(daemon.pid)
        latencies = []
        abusers = []
        try:
            for _ in range(peers):
                abuser = raw_connect(daemon)
                send_what_fits(abuser, HELLO + burst)
                abusers.append(abuser)
                started = time.perf_counter()
                good.ping()
                latencies.append(time.perf_counter() - started)
            for _ in range(200):
                started = time.perf_counter()
                good.ping()
                latencies.append(time.perf_counter() - started)
            grown_kib = rss_kib(daemon.pid) - rss_before
        finally:
            for abuser in abusers:
                abuser.close()
    latencies.sort()
    p99 = latencies[int(len(latencies) * 0.99)]
    assert grown_kib < peers * 1024, f"daemon RSS grew {grown_kib} KiB for {peers} non-readers"
    assert p99 < 0.25, f"good client's ping p99 {p99 * 1000:.1f} ms"
    assert latencies[-1] < 1.0, f"slowest ping {latencies[-1] * 1000:.1f} ms"
    assert daemon.stop() == 0


def test_a_watcher_that_sends_requests_and_never_reads_is_told_too_slow(make_daemon):
    """A watcher's answers to the requests it sends (all `conflict`) count against its
    queue bound: past --watch-max-queue it is sent `too_slow` with its watch id and
    closed, instead of keeping megabytes queued forever."""
    limit = 16384
    daemon = make_daemon().start("--watch-max-queue", str(limit))
    watcher = raw_connect(daemon)
    watcher.sendall(HELLO + request(WATCH_ID, "watch", {"topics": ["fleet"]}))
    assert "result" in decode(read_frame(watcher))
    assert decode(read_frame(watcher))["result"]["seq"] == 0
    pings = b"".join(request(n, "ping") for n in range(10, 1010))

    def told_too_slow() -> bool:
        send_what_fits(watcher, pings)  # keeps sending, never reads
        return bool(log_events(daemon, "watcher_too_slow"))

    wait_for(told_too_slow, timeout=20, what="the flooding watcher to be told too_slow")
    watcher.setblocking(True)
    watcher.settimeout(10)
    *answers, last = frames_until_closed(watcher)
    assert answers and {a["error"]["code"] for a in answers} == {"conflict"}
    assert last["id"] == WATCH_ID, last
    assert last["error"]["code"] == "too_slow", last
    assert last["error"]["data"]["limit"] == limit
    assert last["error"]["data"]["queued_bytes"] > limit
    with daemon.client() as good:
        assert good.ping()["pong"] is True
    assert daemon.stop() == 0


def test_a_pipelining_peer_that_reads_gets_every_answer(make_daemon):
    """Backpressure loses nothing: a peer writes 2,000 requests as fast as the daemon
    takes them, half-closes, and reads all along: every id is answered once."""
    daemon = make_daemon().start()
    peer = raw_connect(daemon)
    peer.sendall(HELLO)
    read_frame(peer)
    ids = range(2, 2002)
    burst = b"".join(
        request(n, "ping") if n % 2 else request(n, "idem.claim", {"operation": "o", "key": f"{n}"})
        for n in ids
    )
    peer.setblocking(False)
    sent, pending, received = 0, b"", []
    while len(received) < len(ids):
        unsent = [peer] if sent < len(burst) else []
        readable, writable, _ = select.select([peer], unsent, [], 10)
        assert readable or writable, f"stalled after {len(received)} answers"
        if writable:
            sent += peer.send(burst[sent:])
            if sent == len(burst):
                peer.shutdown(socket.SHUT_WR)
        if readable:
            chunk = peer.recv(65536)
            assert chunk, f"closed after {len(received)} answers"
            pending += chunk
            while len(pending) >= 4 and len(pending) >= 4 + struct.unpack(">I", pending[:4])[0]:
                length = struct.unpack(">I", pending[:4])[0]
                received.append(msgspec.msgpack.decode(pending[4 : 4 + length]))
                pending = pending[4 + length :]
    assert sorted(a["id"] for a in received) == list(ids)
    assert all("result" in a for a in received)
    assert daemon.stop() == 0
