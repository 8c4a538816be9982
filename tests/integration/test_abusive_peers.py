"""Slow, idle, silent, flooding and non-reading peers, one process opening hundreds of
connections, huge echoed values and a daemon out of file descriptors: each costs the
daemon a bounded amount and never stops it from serving everyone else."""

from __future__ import annotations

import json
import os
import resource
import select
import socket
import struct
import time

import msgspec

from towerd.client import TowerdError
from towerd_testing import rss_kib, towerctl, wait_for


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


def served(daemon) -> bool:
    """A fresh client's ping is answered within 5 s."""
    try:
        return ping_latency(daemon) < 5
    except TowerdError:
        return False


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

    wait_for(lambda: served(daemon), timeout=10, what="a free connection slot")
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


def test_a_burst_of_connections_is_not_refused_by_a_short_backlog(make_daemon):
    """Hundreds of hooks connecting at the same instant: none is turned away by the
    kernel (asyncio's default listen backlog of 100 did exactly that). They all come
    from this one process, so its per-process cap is lifted."""
    daemon = make_daemon().start("--max-connections-per-process", "1024")
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
    assert daemon.stop() == 0


def first_frame_then_eof(sock: socket.socket) -> tuple[dict | None, bool]:
    """The first frame the daemon sent, and whether the stream then ended."""
    data = read_until_closed(sock)
    if len(data) < 4:
        return None, True
    (length,) = struct.unpack(">I", data[:4])
    return msgspec.msgpack.decode(data[4 : 4 + length]), len(data) == 4 + length


def test_a_connection_that_never_says_hello_is_closed_after_the_hello_timeout(make_daemon):
    """A silent connection gets one `unauthorized` frame (id 0, "no hello within N s")
    once --hello-timeout passes, and is closed; one that said hello stays open."""
    daemon = make_daemon().start("--hello-timeout", "0.5")
    greeted, silent = raw_connect(daemon), raw_connect(daemon)
    hello(greeted)
    started = time.monotonic()
    answer, ended = first_frame_then_eof(silent)
    assert 0.4 < time.monotonic() - started < 5
    assert answer == {
        "id": 0,
        "error": {
            "code": "unauthorized",
            "message": "no hello within 0.5 s; reconnect and send hello first",
        },
    }
    assert ended
    greeted.sendall(frame({"id": 2, "method": "ping", "params": {}}))  # past the deadline
    assert read_frames(greeted, 1)[0]["result"]["pong"] is True
    greeted.close()
    assert daemon.stop() == 0


def test_one_process_cannot_fill_the_connection_table(make_daemon):
    """300 silent sockets from one process against --max-connections 256: the default
    per-process cap (128) refuses the ones past it with `unavailable`, so another
    process is still served (`towerctl ping` used to exit 3)."""
    daemon = make_daemon().start("--max-connections", "256")
    cap = 128  # the default --max-connections-per-process
    held = [raw_connect(daemon) for _ in range(300)]
    try:
        pinged = towerctl(daemon, "ping")
        assert pinged.returncode == 0, pinged.stdout + pinged.stderr

        def refused() -> list[socket.socket]:
            ready, _, _ = select.select(held, [], [], 0)
            return ready

        wait_for(lambda: len(refused()) >= 300 - cap, timeout=10, what="the refusals")
        over = refused()
        assert len(over) == 300 - cap  # the rest are admitted and left alone
        answer, ended = first_frame_then_eof(over[0])
        assert answer["id"] == 0 and answer["error"]["code"] == "unavailable", answer
        assert answer["error"]["data"] == {
            "reason": "too_many_connections_per_process",
            "limit": cap,
            "pid": os.getpid(),
        }
        assert ended
    finally:
        for sock in held:
            sock.close()
    assert daemon.stop() == 0


def test_the_per_process_cap_is_set_with_its_option(make_daemon):
    """--max-connections-per-process 3: a fourth connection of this process is refused,
    and a closed one frees its slot."""
    daemon = make_daemon().start("--max-connections-per-process", "3")
    held = [raw_connect(daemon) for _ in range(3)]
    for sock in held:
        hello(sock)
    answer, _ = first_frame_then_eof(raw_connect(daemon))
    assert answer["error"]["data"]["reason"] == "too_many_connections_per_process"
    assert answer["error"]["data"]["limit"] == 3
    held.pop().close()

    wait_for(lambda: served(daemon), timeout=10, what="the freed slot")
    for sock in held:
        sock.close()
    assert daemon.stop() == 0


def test_a_huge_method_name_gets_a_short_error_and_a_short_log_line(make_daemon):
    """A 1,000,000-character method name is echoed cut to 200 characters (the cut
    marked, the length given) in the error and in the log, before and after hello;
    it used to come back as a 4 MB error and an 11 MB log line."""
    daemon = make_daemon().start()
    method = "\x01" * 1_000_000  # repr() makes each of these 4 characters
    first = raw_connect(daemon)
    first.sendall(frame({"id": 4241, "method": method, "params": {}}))
    answer, ended = first_frame_then_eof(first)
    assert answer["error"]["code"] == "unauthorized" and ended
    assert "[cut: 1000000 characters]" in answer["error"]["message"]
    assert len(answer["error"]["message"]) < 1200

    sock = raw_connect(daemon)
    hello(sock)
    sock.sendall(frame({"id": 4242, "method": method, "params": {}}))
    reply = sock.recv(65536)
    assert len(reply) < 2000, f"a {len(reply)}-byte error reply"
    answer = msgspec.msgpack.decode(reply[4:])
    assert answer["id"] == 4242 and answer["error"]["code"] == "unknown_method"
    assert answer["error"]["message"].startswith("unknown method '\\x01\\x01")
    assert answer["error"]["message"].endswith("… [cut: 1000000 characters]")
    sock.sendall(frame({"id": 4243, "method": "ping", "params": {}}))  # still open
    assert read_frames(sock, 1)[0]["result"]["pong"] is True
    sock.close()
    assert daemon.stop() == 0
    lines = [line for line in daemon.log().splitlines() if '"request_id": 424' in line]
    assert lines, "no log line about the requests"
    assert max(len(line) for line in daemon.log().splitlines()) < 4000
    failed = [json.loads(line) for line in lines if '"request_failed"' in line]
    assert failed and failed[0]["method"] == "\x01" * 200 + "… [cut: 1000000 characters]"


def test_an_error_reply_is_cut_to_fit_the_reply_limit():
    """Whatever an error carries, its reply fits max_frame + RESPONSE_SLACK: an oversized
    message is cut (and marked), oversized data is left out, the code is kept."""
    from towerd.daemon.server import error_reply
    from towerd.protocol.errors import BadArgs, Internal

    limit = 1024 + 65536
    reply = error_reply(9, Internal("x" * 3_000_000), limit)
    assert len(reply) <= limit
    body = msgspec.msgpack.decode(reply[4:])
    assert body["id"] == 9 and body["error"]["code"] == "internal"
    assert body["error"]["message"].startswith("xxx")
    assert body["error"]["message"].endswith("[cut: 3000000 characters, over the reply limit]")
    assert len(reply) > limit - 1024  # cut to fit, not cut to nothing

    reply = error_reply(9, BadArgs("short", {"blob": "y" * 3_000_000}), limit)
    assert len(reply) <= limit
    body = msgspec.msgpack.decode(reply[4:])
    assert body["error"]["code"] == "bad_args" and "data" not in body["error"]
    assert body["error"]["message"].startswith("short [its data was left out")

    small = BadArgs("fine", {"n": 1})
    assert msgspec.msgpack.decode(error_reply(3, small, limit)[4:])["error"] == {
        "code": "bad_args",
        "message": "fine",
        "data": {"n": 1},
    }


def test_out_of_file_descriptors_refuses_with_peer_unknown_and_keeps_serving(make_daemon):
    """With the daemon's fd limit at 64, connections are opened until it runs out: the
    one that takes its last descriptor cannot be identified (/proc unreadable, EMFILE)
    and is refused `unavailable` (reason `peer_unknown`); the daemon stays up and
    answers a ping once the connections are closed."""
    daemon = make_daemon()

    def low_fd_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))  # towerd cannot raise it

    daemon.start("--max-connections", "1000", preexec_fn=low_fd_limit)
    held, refusal = [], None
    try:
        for _ in range(100):
            sock = raw_connect(daemon)
            sock.settimeout(5)
            try:
                sock.sendall(
                    frame({"id": 1, "method": "hello", "params": {"protocol": 1, "client": "t"}})
                )
                answers = read_frames(sock, 1)
            except (ConnectionResetError, BrokenPipeError):
                answers = []  # accept() itself hit EMFILE: the loop closed it unread
            if answers and "result" in answers[0]:
                held.append(sock)
                continue
            sock.close()
            if answers:
                refusal = answers[0]
                break
        assert refusal is not None, f"no refusal after {len(held)} connections"
        assert refusal["id"] == 0 and refusal["error"]["code"] == "unavailable", refusal
        assert refusal["error"]["data"] == {"reason": "peer_unknown"}
        assert "cannot identify your process" in refusal["error"]["message"]
        assert daemon.proc.poll() is None
    finally:
        for sock in held:
            sock.close()

    wait_for(lambda: served(daemon), timeout=10, what="a ping once the connections are closed")
    assert daemon.stop() == 0
    # Nothing escaped connection_made (asyncio may log its own failed accept()).
    assert "connection_made" not in daemon.log()
