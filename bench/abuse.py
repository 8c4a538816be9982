"""Latency of well-behaved clients while others abuse the daemon.

    .venv/bin/python bench/abuse.py [--pings 2000]

Scenarios, each measured in the same run against the same daemon:

* baseline: one client pings, nothing else going on;
* slow frames: 200 peers each start a frame and stall (held open until the
  frame timeout closes them);
* connection flood: peers connect until the cap (256 here) refuses them;
* non-readers: 4 peers pipeline large ``fleet.list`` requests and never read;
* burst non-readers: 100 peers each write one ~271 KB burst of ``status`` requests
  (8,200 of them) and never read: the daemon stops dispatching a peer's frames once
  its answers wait unsent, so each costs a few hundred answers, not 8,200.

The abusers all run in this one process, so the daemon is started with its
per-process connection cap lifted (``--max-connections-per-process``) and its hello
deadline far off (``--hello-timeout``: the flood takes ~50 s to reach the cap), so
the global cap (256) is what the flood meets.

Prints p50 / p99 of the well-behaved client's ping round trips, the ratio to the
baseline, how many abusive connections were refused or dropped, and the
daemon's RSS.
"""

from __future__ import annotations

import argparse
import socket
import struct
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

from benchlib import Daemon, machine, percentile
from towerd.client import Client


def frame(value: object) -> bytes:
    payload = msgspec.msgpack.encode(value)
    return struct.pack(">I", len(payload)) + payload


HELLO = frame({"id": 1, "method": "hello", "params": {"protocol": 1, "client": "abuser"}})


def connect(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(path))
    return sock


def pings(client: Client, count: int) -> list[float]:
    samples = []
    for _ in range(count):
        started = time.perf_counter()
        client.ping()
        samples.append((time.perf_counter() - started) * 1000)
    return samples


def slow_frames(path: Path) -> tuple[list[socket.socket], str]:
    peers = []
    for _ in range(200):
        sock = connect(path)
        sock.sendall(HELLO + struct.pack(">I", 1000) + b"\x83")  # 1 byte of a 1000-byte frame
        peers.append(sock)
    return peers, "200 stalled frames"


def flood(path: Path) -> tuple[list[socket.socket], str]:
    peers, refused = [], 0
    for _ in range(400):
        sock = connect(path)
        sock.settimeout(0.2)
        try:
            data = sock.recv(65536)  # the refusal frame, if over the cap
        except TimeoutError:
            peers.append(sock)  # admitted and idle
            continue
        refused += 1 if data else 0
        sock.close()
    return peers, f"{len(peers)} idle connections held, {refused} refused over the cap"


def non_readers(path: Path) -> tuple[list[socket.socket], str]:
    request = frame({"id": 2, "method": "fleet.list", "params": {}})
    peers = []
    for _ in range(4):
        sock = connect(path)
        sock.sendall(HELLO)
        sock.setblocking(False)
        try:
            for _ in range(2000):
                sock.send(request)
        except BlockingIOError:
            pass
        peers.append(sock)
    return peers, "4 peers pipelining ~800 KB answers, never reading"


def burst_non_readers(path: Path) -> tuple[list[socket.socket], str]:
    burst = b"".join(frame({"id": n, "method": "status", "params": {}}) for n in range(2, 8200))
    peers = []
    for _ in range(100):
        sock = connect(path)
        sock.setblocking(False)
        data, sent = HELLO + burst, 0
        try:
            while sent < len(data):
                sent += sock.send(data[sent:])
        except BlockingIOError:
            pass  # the daemon stopped reading this peer
        peers.append(sock)
    return peers, f"100 peers, one {len(burst) // 1024} KiB burst of status each, never reading"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pings", type=int, default=2000)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="abuse-", dir="/tmp"))
    daemon = Daemon(
        workdir,
        [
            *("--max-connections", "256", "--max-connections-per-process", "1024"),
            *("--hello-timeout", "600", "--send-timeout", "5"),
        ],
    )
    daemon.start()
    print(machine())
    with Client(daemon.socket_path) as setup:
        for n in range(40):
            setup.session_register(cwd="/r", agent="a", prompt=f"{n}" * 20000)
    scenarios: list[tuple[str, Callable[[Path], tuple[list[socket.socket], str]] | None]] = [
        ("baseline", None),
        ("slow frames", slow_frames),
        ("connection flood", flood),
        ("non-readers", non_readers),
        ("burst non-readers", burst_non_readers),
    ]
    print(f"{'scenario':18} {'p50 ms':>8} {'p99 ms':>8} {'p99 x':>6} {'RSS MiB':>8}  abuse")
    base_p99 = None
    with Client(daemon.socket_path) as client:  # connected before any flood
        pings(client, 200)  # warm up
        for name, abuse in scenarios:
            peers, what = abuse(daemon.socket_path) if abuse else ([], "none")
            samples = pings(client, args.pings)
            p50, p99 = percentile(samples, 0.5), percentile(samples, 0.99)
            base_p99 = base_p99 or p99
            print(
                f"{name:18} {p50:8.3f} {p99:8.3f} {p99 / base_p99:6.2f} "
                f"{daemon.rss_mib():8.1f}  {what}"
            )
            for sock in peers:
                sock.close()
    daemon.stop()


if __name__ == "__main__":
    main()
