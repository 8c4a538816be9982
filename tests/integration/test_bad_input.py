"""Malformed and hostile input on raw sockets: exact errors, closes, survival."""

from __future__ import annotations

import shutil
import socket
import struct
import tempfile
import uuid
from pathlib import Path

import msgspec
import pytest

from towerd.client import IdempotencyKeyUnknown
from towerd_testing import Daemon

pytestmark = pytest.mark.both_backends

MAX_FRAME = 1024 * 1024
TIMEOUT = 10.0


def frame(payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + payload


def request(request_id, method, params=None) -> bytes:
    body = {"id": request_id, "method": method}
    if params is not None:
        body["params"] = params
    return frame(msgspec.msgpack.encode(body))


HELLO = request(1, "hello", {"protocol": 1, "client": "raw-test"})


def hello_frame(principal: str) -> bytes:
    return request(1, "hello", {"protocol": 1, "client": "raw-test", "principal": principal})


class Raw:
    """One raw AF_UNIX connection speaking frames by hand (reads time out)."""

    def __init__(self, path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(TIMEOUT)
        self.sock.connect(str(path))
        self.buffer = b""
        self.principal = uuid.uuid4().hex  # each connection's keys are its own

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _read(self, n: int) -> bytes | None:
        while len(self.buffer) < n:
            chunk = self.sock.recv(65536)
            if not chunk:
                return None
            self.buffer += chunk
        data, self.buffer = self.buffer[:n], self.buffer[n:]
        return data

    def recv(self) -> dict:
        prefix = self._read(4)
        assert prefix is not None, "connection closed while a frame was expected"
        (length,) = struct.unpack(">I", prefix)
        payload = self._read(length)
        assert payload is not None, "connection closed in the middle of a frame"
        message = msgspec.msgpack.decode(payload)
        assert isinstance(message, dict) and type(message.get("id")) is int, message
        return message

    def expect_eof(self) -> None:
        """The daemon closed the connection (EOF), with nothing more to read."""
        assert self.buffer == b"", self.buffer
        try:
            data = self.sock.recv(65536)
        except ConnectionResetError:
            return
        assert data == b"", f"expected EOF, got {data!r}"

    def hello(self) -> dict:
        self.send(hello_frame(self.principal))
        answer = self.recv()
        assert answer["id"] == 1 and answer["result"]["protocol"] == 1, answer
        return answer["result"]

    def call(self, request_id: int, method: str, params=None) -> dict:
        self.send(request(request_id, method, params))
        answer = self.recv()
        assert answer["id"] == request_id, answer
        return answer

    def ping(self, request_id: int) -> None:
        answer = self.call(request_id, "ping")
        assert answer["result"]["pong"] is True, answer

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(scope="module")
def daemon():
    """One daemon for the module: every hostile input must leave it serving."""
    root = Path(tempfile.mkdtemp(prefix="td-", dir="/tmp"))
    running = Daemon(root, "bad")
    try:
        running.start()
        yield running
        if running.proc.poll() is None:
            assert running.stop() == 0, running.log()
    finally:
        running.close()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def raw(daemon):
    """Raw connections to the daemon; afterwards the daemon must still serve."""
    opened: list[Raw] = []

    def connect() -> Raw:
        conn = Raw(daemon.socket_path)
        opened.append(conn)
        return conn

    yield connect
    for conn in opened:
        conn.close()
    assert_serving(daemon)


def assert_serving(daemon) -> None:
    assert daemon.proc.poll() is None, daemon.log()
    with daemon.client(timeout=TIMEOUT) as c:
        assert c.ping()["pong"] is True


def error_of(answer: dict) -> dict:
    assert "result" not in answer, answer
    error = answer["error"]
    assert isinstance(error["message"], str) and error["message"]
    return error


def vm_rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS line")


# --- the handshake --------------------------------------------------------------------


@pytest.mark.parametrize(
    "first",
    [
        request(5, "ping"),
        request(5, "status", {}),
        request(5, "idem.claim", {"operation": "refused-op", "key": "k"}),
        request(5, "shutdown"),
        request(5, "_private"),
    ],
)
def test_first_request_must_be_hello(raw, daemon, first):
    """A first request other than hello gets unauthorized (same id), then EOF."""
    conn = raw()
    conn.send(first)
    answer = conn.recv()
    assert answer["id"] == 5
    error = error_of(answer)
    assert error["code"] == "unauthorized"
    assert "hello" in error["message"]
    conn.expect_eof()
    with daemon.client() as c, pytest.raises(IdempotencyKeyUnknown):
        c.idem_get("refused-op", "k")  # the refused claim was never applied


def test_protocol_mismatch(raw):
    """hello protocol 2 is protocol_mismatch naming both versions, then EOF."""
    conn = raw()
    conn.send(request(1, "hello", {"protocol": 2, "client": "future"}))
    answer = conn.recv()
    assert answer["id"] == 1
    error = error_of(answer)
    assert error["code"] == "protocol_mismatch"
    assert "1" in error["message"] and "2" in error["message"]
    assert "restart" in error["message"]
    assert error["data"] == {"client_protocol": 2, "daemon_protocol": 1}
    conn.expect_eof()


@pytest.mark.parametrize(
    "params, path",
    [
        ({"protocol": "1", "client": "x"}, "$.protocol"),
        ({"client": "x"}, "protocol"),
        ({"protocol": 1}, "client"),
        ({"protocol": 1, "client": "x", "principal": ""}, "$.principal"),
        ({"protocol": 1, "client": "x", "principal": "bad\x00name"}, "principal"),
    ],
)
def test_bad_hello_params(raw, params, path):
    """hello with invalid params is bad_args naming the field, then EOF."""
    conn = raw()
    conn.send(request(1, "hello", params))
    error = error_of(conn.recv())
    assert error["code"] == "bad_args"
    assert path in error["message"]
    conn.expect_eof()


def test_second_hello_is_conflict_and_connection_stays(raw):
    """A second hello on a connection is 'conflict'; the connection keeps serving."""
    conn = raw()
    conn.hello()
    answer = conn.call(2, "hello", {"protocol": 1, "client": "again"})
    assert error_of(answer)["code"] == "conflict"
    conn.ping(3)


# --- frames that are not requests -----------------------------------------------------


@pytest.mark.parametrize("after_hello", [False, True])
@pytest.mark.parametrize(
    "payload",
    [
        pytest.param(b"\xc1", id="never-used-byte"),
        pytest.param(b"", id="empty-frame"),
        pytest.param(b"\x81\xa2id", id="truncated-map"),
        pytest.param(msgspec.msgpack.encode([1, "ping", {}]), id="array"),
        pytest.param(msgspec.msgpack.encode(7), id="integer"),
        pytest.param(msgspec.msgpack.encode({"id": 0, "method": "ping"}), id="id-zero"),
        pytest.param(msgspec.msgpack.encode({"id": -3, "method": "ping"}), id="id-negative"),
        pytest.param(msgspec.msgpack.encode({"id": "1", "method": "ping"}), id="id-string"),
        pytest.param(msgspec.msgpack.encode({"id": 2**63, "method": "ping"}), id="id-too-big"),
        pytest.param(msgspec.msgpack.encode({"method": "ping"}), id="no-id"),
        pytest.param(msgspec.msgpack.encode({"id": 1, "method": "ping"}) + b"\x00", id="trailing"),
    ],
)
def test_garbage_frame_is_bad_frame_id_0(raw, payload, after_hello):
    """A frame without a readable request id gets bad_frame with id 0, then EOF."""
    conn = raw()
    if after_hello:
        conn.hello()
    conn.send(frame(payload))
    answer = conn.recv()
    assert answer["id"] == 0
    assert error_of(answer)["code"] == "bad_frame"
    conn.expect_eof()


@pytest.mark.parametrize("after_hello", [False, True])
@pytest.mark.parametrize(
    "body",
    [
        pytest.param({"id": 7}, id="no-method"),
        pytest.param({"id": 7, "method": 5}, id="method-int"),
        pytest.param({"id": 7, "method": None}, id="method-nil"),
    ],
)
def test_malformed_envelope_keeps_readable_id(raw, body, after_hello):
    """A map with a readable id but no valid method: bad_frame with that id, EOF."""
    conn = raw()
    if after_hello:
        conn.hello()
    conn.send(frame(msgspec.msgpack.encode(body)))
    answer = conn.recv()
    assert answer["id"] == 7
    assert error_of(answer)["code"] == "bad_frame"
    conn.expect_eof()


def test_requests_before_a_bad_frame_are_answered(raw):
    """Pipelined requests ahead of a bad frame are answered before the close."""
    conn = raw()
    conn.hello()
    conn.send(b"".join(request(i, "ping") for i in (2, 3, 4)) + frame(b"\xc1") + request(5, "ping"))
    answers = {}
    for _ in range(4):
        answer = conn.recv()
        answers[answer["id"]] = answer
    assert sorted(answers) == [0, 2, 3, 4]
    assert all(answers[i]["result"]["pong"] is True for i in (2, 3, 4))
    assert error_of(answers[0])["code"] == "bad_frame"
    conn.expect_eof()


# --- oversized frames -----------------------------------------------------------------


@pytest.mark.parametrize("after_hello", [False, True])
def test_huge_length_prefix_is_refused_without_allocating(raw, daemon, after_hello):
    """A 4 GiB length prefix: frame_too_large (id 0), EOF, and no RSS jump."""
    conn = raw()
    if after_hello:
        conn.hello()
    before = vm_rss_kib(daemon.pid)
    conn.send(struct.pack(">I", 0xFFFFFFFF) + b"\x00" * 64)
    answer = conn.recv()
    assert answer["id"] == 0
    error = error_of(answer)
    assert error["code"] == "frame_too_large"
    assert str(0xFFFFFFFF) in error["message"] and str(MAX_FRAME) in error["message"]
    conn.expect_eof()
    assert_serving(daemon)
    after = vm_rss_kib(daemon.pid)
    assert after - before < 32 * 1024, f"RSS grew from {before} KiB to {after} KiB"


def test_one_byte_over_the_limit_is_refused(raw):
    """A frame announcing 1 MiB + 1 bytes is frame_too_large before any payload."""
    conn = raw()
    conn.hello()
    conn.send(struct.pack(">I", MAX_FRAME + 1))
    answer = conn.recv()
    assert answer["id"] == 0
    error = error_of(answer)
    assert error["code"] == "frame_too_large"
    assert str(MAX_FRAME + 1) in error["message"]
    conn.expect_eof()


def test_frame_of_exactly_the_limit_is_accepted(raw):
    """A request frame of exactly 1 MiB is served (the limit is inclusive)."""
    conn = raw()
    conn.hello()
    base = len(msgspec.msgpack.encode({"id": 2, "method": "ping", "params": {"pad": ""}}))
    # str8/16/32 headers differ in size; a pad over 65535 bytes uses a 5-byte header (vs
    # 1).
    pad = "x" * (MAX_FRAME - base - 4)
    payload = msgspec.msgpack.encode({"id": 2, "method": "ping", "params": {"pad": pad}})
    assert len(payload) == MAX_FRAME
    conn.send(frame(payload))
    answer = conn.recv()
    assert answer["id"] == 2 and answer["result"]["pong"] is True
    conn.ping(3)


# --- bad params and method names ------------------------------------------------------


@pytest.mark.parametrize(
    "method, params, path",
    [
        ("idem.claim", {"operation": "op", "key": 5}, "`$.key`"),
        ("idem.claim", {"operation": "op"}, "key"),
        (
            "idem.claim",
            {"operation": "op", "key": "k", "holder_pid": 0},
            "`$.holder_pid`",
        ),
        ("idem.list", {"limit": "ten"}, "`$.limit`"),
        ("idem.list", {"state": "done"}, "`$.state`"),
        ("fleet.list", {"cursor": -1}, "`$.cursor`"),
        ("fleet.get", {"session_id": "NOT-A-UUID"}, "`$.session_id`"),
        (
            "fleet.write",
            {"sessions": [{"session_id": "x", "cwd": "/", "agent": "a"}]},
            "`$.sessions[0].session_id`",
        ),
        ("session.register", {"cwd": 1, "agent": "a"}, "`$.cwd`"),
        (
            "idem.resolve",
            {"operation": "o", "key": "k", "outcome": "maybe"},
            "`$.outcome`",
        ),
        ("ping", [1, 2], "Expected `object`, got `array`"),
        ("status", "params", "Expected `object`, got `str`"),
        ("idem.get", b"\xc1", "Expected `object`, got `bytes`"),
    ],
)
def test_bad_params_keep_the_connection(raw, method, params, path):
    """Bad params get bad_args with msgspec's path; the connection stays usable."""
    conn = raw()
    conn.hello()
    error = error_of(conn.call(2, method, params))
    assert error["code"] == "bad_args"
    assert path in error["message"]
    assert method in error["message"]
    conn.ping(3)


@pytest.mark.parametrize(
    "method",
    [
        "_private",
        "__init__",
        "__class__",
        "__dict__",
        "__getattribute__",
        "a.b.c",
        "idem",
        "idem.",
        ".ping",
        "idem.__class__",
        "idem_claim",
        "session_register",
        "table",
        "store",
        "_answer",
        "PING",
        "ping ",
        "",
        "idem.claim.extra",
        "\x00",
        "méthode",
    ],
)
def test_unknown_method_names_keep_the_connection(raw, method):
    """Names outside the method table (dunders, dotted, attributes): unknown_method."""
    conn = raw()
    conn.hello()
    error = error_of(conn.call(2, method, {}))
    assert error["code"] == "unknown_method"
    assert repr(method) in error["message"]
    conn.ping(3)


def test_unknown_method_wins_over_bad_params(raw):
    """An unknown method with junk params is unknown_method, not bad_args."""
    conn = raw()
    conn.hello()
    assert error_of(conn.call(2, "__class__", [b"\x00", None]))["code"] == "unknown_method"
    conn.ping(3)


# --- stream handling ------------------------------------------------------------------


def test_pipelined_frames_all_answered_by_id(raw):
    """Ten requests in one write are all answered, each under its own id."""
    conn = raw()
    conn.hello()
    batch = []
    for i in range(1, 11):
        if i % 2:
            batch.append(request(i + 100, "ping"))
        else:
            batch.append(
                request(
                    i + 100,
                    "idem.claim",
                    {"operation": "pipe", "key": f"k{i}", "effect_ref": f"ref-{i}"},
                )
            )
    conn.send(b"".join(batch))
    answers = {}
    for _ in range(10):
        answer = conn.recv()
        assert answer["id"] not in answers
        answers[answer["id"]] = answer["result"]
    assert sorted(answers) == list(range(101, 111))
    for i in range(1, 11):
        if i % 2:
            assert answers[i + 100]["pong"] is True
        else:
            assert answers[i + 100] == {"state": "claimed", "effect_ref": f"ref-{i}"}


def test_answers_of_many_connections_at_once_all_arrive_in_order(raw):
    """Forty connections each send a pipeline of reads and refusals at once, so the
    daemon answers many in one pass and holds all but the first until the pass ends
    (daemon/bursts.py): every answer arrives with no further request, in each
    connection's own order, refusals (written at once) included."""
    conns = [raw() for _ in range(40)]
    for conn in conns:
        conn.hello()
    pipeline = []
    for n in range(13):  # the last a read: held, nothing written after it
        if n % 3 == 2:  # refused at once: the held answer before it must go first
            pipeline.append(request(200 + n, "idem.get", {"operation": "none", "key": "k"}))
        else:
            pipeline.append(request(200 + n, "ping"))
    burst = b"".join(pipeline)
    for _ in range(5):
        for conn in conns:
            conn.send(burst)
        for conn in conns:
            answers = [conn.recv() for _ in pipeline]  # a held answer never sent: timeout
            assert [a["id"] for a in answers] == [200 + n for n in range(13)]
            for n, answer in enumerate(answers):
                if n % 3 == 2:
                    assert answer["error"]["code"] == "idempotency_key_unknown", answer
                else:
                    assert answer["result"]["pong"] is True, answer


def test_pipelined_reads_then_eof_are_all_answered_before_the_close(raw):
    """Reads pipelined just before the peer's EOF, on several connections at once, are
    all answered (the last of each pipeline held for its pass) before the close."""
    conns = [raw() for _ in range(10)]
    for conn in conns:
        conn.hello()
    for conn in conns:
        # An odd count: of a pipeline, every other answer is held, so the last one is.
        conn.send(b"".join(request(300 + n, "ping") for n in range(21)))
        conn.sock.shutdown(socket.SHUT_WR)
    for conn in conns:
        assert [conn.recv()["id"] for _ in range(21)] == list(range(300, 321))
        conn.expect_eof()


def test_ids_are_echoed_as_sent(raw):
    """Any id in range is echoed, including the largest, in any order."""
    conn = raw()
    conn.hello()
    for request_id in (2**63 - 1, 42, 3, 2**32 + 1):
        conn.ping(request_id)


def test_one_byte_writes(raw):
    """Frames dribbled one byte per write are reassembled and answered."""
    conn = raw()
    data = (
        hello_frame(conn.principal)
        + request(2, "ping")
        + request(3, "idem.claim", {"operation": "o", "key": "k"})
    )
    for byte in data:
        conn.send(bytes([byte]))
    assert conn.recv()["result"]["protocol"] == 1
    answers = {conn.recv()["id"]: None for _ in range(2)}
    assert sorted(answers) == [2, 3]
    conn.ping(4)


def test_hello_split_across_writes_with_next_request(raw):
    """A write boundary inside a prefix, and two frames in one write, are handled."""
    conn = raw()
    data = HELLO + request(2, "ping")
    conn.send(data[:2])
    conn.send(data[2 : len(HELLO) + 3])
    conn.send(data[len(HELLO) + 3 :])
    assert conn.recv()["id"] == 1
    assert conn.recv()["result"]["pong"] is True


def test_garbage_on_one_connection_does_not_disturb_another(raw, daemon):
    """While other peers send garbage, a connected client keeps being served."""
    good = raw()
    good.hello()
    good.ping(2)
    with daemon.client() as client:
        assert client.ping()["pong"] is True
        for n, (junk, say_hello) in enumerate(
            [
                (frame(b"\xc1"), False),
                (struct.pack(">I", 0xFFFFFFFF), True),
                (frame(b""), True),
                (request(9, "ping"), False),  # not hello: unauthorized
                (frame(msgspec.msgpack.encode({"id": 4})), True),
            ]
        ):
            bad = raw()
            if say_hello:
                bad.hello()
            bad.send(junk)
            bad.recv()
            bad.expect_eof()
            good.ping(10 + n)
            assert client.ping()["pong"] is True
        # A connection that announced a frame and stalls mid-payload blocks nobody else.
        stalled = raw()
        stalled.hello()
        stalled.send(struct.pack(">I", 1000) + b"\x80")
        good.ping(20)
        assert client.status()["pid"] == daemon.pid
    good.ping(21)


def test_client_disconnect_mid_frame(raw, daemon):
    """A peer vanishing mid-frame or mid-request costs nothing; service goes on."""
    principal = uuid.uuid4().hex
    for cut in (2, 4, 10):
        conn = raw()
        hello = hello_frame(principal)
        data = hello + request(2, "idem.claim", {"operation": "gone", "key": str(cut)})
        conn.send(data[: len(hello) + cut])
        conn.close()
    conn = raw()
    conn.hello()
    conn.send(request(2, "ping"))
    conn.sock.shutdown(socket.SHUT_WR)  # half-close: the answer must still arrive
    assert conn.recv()["result"]["pong"] is True
    with daemon.client(principal=principal) as c:
        assert c.idem_list()["keys"] == []


def test_peer_that_never_reads_does_not_block_others(raw, daemon):
    """A peer flooding requests without reading answers stalls only itself."""
    flood = raw()
    flood.hello()
    flood.sock.setblocking(False)
    batch = b"".join(request(i, "status") for i in range(2, 20002))
    sent = 0
    try:
        while sent < len(batch):
            sent += flood.sock.send(batch[sent:])
    except BlockingIOError:
        pass  # the daemon stopped reading this peer: backpressure, as it should
    good = raw()
    good.hello()
    for request_id in range(2, 12):
        good.ping(request_id)
    with daemon.client() as c:
        assert c.status()["pid"] == daemon.pid
    flood.close()
    good.ping(20)
