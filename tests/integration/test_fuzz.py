"""Protocol fuzzing, CI-sized: hostile inputs thrown at a live daemon over its socket.

Inputs come from two sources: hypothesis strategies (framing, envelopes, every
method's params, method names, first frames, pipelined bursts), and a few thousand
inputs from the fast seeded generator in ``bench/fuzz_inputs.py`` (the one
``bench/fuzz.py`` uses for runs of 10^6). The oracle for every input: the daemon
answers well-formed frames (a result, or an error whose code is in ERROR_CODES) or
closes the connection cleanly; it never hangs, never crashes, keeps serving the
connection after a well-framed request, and still answers ping afterwards.
An ``internal`` answer to an input that is merely invalid is a bug.

Nothing is sent that could act outside the daemon's own state: no shutdown it would
obey, no backup outside a sandbox directory, only refused params to methods the
fuzzer does not know (``fuzz_inputs.classify`` checks every frame).

The ``test_regression_*`` tests are the minimal reproducers of the daemon bugs this
fuzzing found: at a56d68b one frame killed the daemon and three kinds of input were
answered ``internal`` (fixed in 9ea051a); at 927cee0 backup paths the OS refuses were
answered ``internal`` (fixed in 28b1b72). While a bug is open, its reproducer fails
and ``fuzz_inputs.KNOWN_BUGS`` lets the generic tests tell it from new ones. The
hand-written hostile inputs live in test_bad_input.py and are not repeated here.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import socket
import string
import struct
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st
from msgspec import inspect as mi

from towerd.protocol import methods as m
from towerd_testing import Daemon

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import fuzz_inputs as fi  # noqa: E402

MAX_FRAME = fi.MAX_FRAME
TIMEOUT = 10.0
RSS_GROWTH_LIMIT_KIB = 50 * 1024
SMOKE_INPUTS = 10_000
MAX_DEPTH = 5000  # nesting in generated inputs (the daemon once died at ~1000)
_enc = msgspec.msgpack.encode

FUZZ = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# --- the daemon and raw connections ---------------------------------------------------


def vm_rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS line")


RSS: dict[str, int] = {}
KNOWN_HITS: dict[str, int] = {}


@pytest.fixture(scope="module")
def fuzz_daemon():
    """One daemon for the module (quiet logs): every input must leave it serving."""
    root = Path(tempfile.mkdtemp(prefix="tf-", dir="/tmp"))
    running = Daemon(root, "fz")
    running.extra_args = ["--log-level", "warning"]
    (root / "sandbox").mkdir()
    fi.set_sandbox(root / "sandbox")  # the only place a fuzzed backup may write
    try:
        running.start()
        assert ping(running) is True
        RSS["start"] = vm_rss_kib(running.pid)
        yield running
        if running.proc.poll() is None:
            assert running.stop() == 0, running.log()[-3000:]
    finally:
        fi.set_sandbox(None)
        running.close()
        shutil.rmtree(root, ignore_errors=True)


def frame(payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + payload


def request(request_id: int, method: str, params=None) -> bytes:
    body: dict = {"id": request_id, "method": method}
    if params is not None:
        body["params"] = params
    return frame(_enc(body))


HELLO = request(1, "hello", {"protocol": 1, "client": "fuzz-test", "principal": "fuzz"})


class Wire:
    """A raw connection; every read times out (a hang fails the test)."""

    def __init__(self, daemon: Daemon) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(TIMEOUT)
        self.sock.connect(str(daemon.socket_path))
        self.buffer = b""

    def __enter__(self) -> Wire:
        return self

    def __exit__(self, *exc) -> None:
        self.sock.close()

    def send(self, data: bytes) -> None:
        try:
            self.sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the daemon closed (after a bad frame); what it said is still readable

    def _fill(self) -> bool:
        try:
            chunk = self.sock.recv(1 << 18)
        except ConnectionResetError:
            return False
        except TimeoutError:
            raise AssertionError(f"the daemon hung: nothing within {TIMEOUT}s") from None
        self.buffer += chunk
        return bool(chunk)

    def payload(self) -> bytes | None:
        """The next answer frame's payload, or None at EOF/reset (between frames)."""
        while True:
            if len(self.buffer) >= 4:
                (n,) = struct.unpack(">I", self.buffer[:4])
                assert n <= MAX_FRAME + fi.RESPONSE_SLACK, f"answer of {n} bytes"
                if len(self.buffer) >= 4 + n:
                    data, self.buffer = self.buffer[4 : 4 + n], self.buffer[4 + n :]
                    return data
            if not self._fill():
                assert self.buffer == b"", f"closed in the middle of an answer: {self.buffer!r}"
                return None

    def answer(self) -> fi.Answer:
        payload = self.payload()
        assert payload is not None, "connection closed where an answer was due"
        answer, outcome = fi.judge(payload)
        assert answer is not None, f"{outcome}: {payload[:300]!r}"
        return answer

    def hello(self) -> None:
        self.send(HELLO)
        answer = self.answer()
        assert answer.id == 1 and answer.error is None, answer

    def until_eof(self) -> list[fi.Answer]:
        """Half-close, then every answer left (each well-formed) until the daemon closes."""
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        answers = []
        while (payload := self.payload()) is not None:
            answer, outcome = fi.judge(payload)
            assert answer is not None, f"{outcome}: {payload[:300]!r}"
            answers.append(answer)
        return answers


def ping(daemon: Daemon) -> bool:
    with Wire(daemon) as wire:
        wire.send(HELLO + request(2, "ping", {}))
        assert wire.answer().id == 1
        answer = wire.answer()
        assert answer.id == 2 and answer.error is None, answer
        return msgspec.msgpack.decode(answer.result)["pong"]


def assert_not_internal(answer: fi.Answer, data: bytes) -> None:
    """``internal`` is a bug, unless it is a known open bug (``fi.KNOWN_BUGS``)."""
    if answer.error is None or answer.error.code != "internal":
        return
    bug = fi.known_bug(answer.error.message)
    assert bug is not None, (
        f"internal error for an invalid input: {answer.error.message}\n"
        f"input: {fi.rle_hex(data, 2000)}"
    )
    KNOWN_HITS[bug] = KNOWN_HITS.get(bug, 0) + 1


def assert_request_answered(
    daemon: Daemon, payload: bytes, label: str | None = None
) -> fi.Answer | None:
    """After hello: a well-framed request is answered by its id and the connection stays
    open; anything else gets well-formed error frames and a clean close."""
    what, request_id = fi.classify(payload)
    if what == fi.UNSAFE:  # shutdown, a backup outside the sandbox... (see fuzz_inputs)
        assume(False)
    with Wire(daemon) as wire:
        wire.hello()
        wire.send(frame(payload))
        if what == fi.TERMINAL:  # may end the connection: well-formed answers, then EOF
            answers = wire.until_eof()
            for answer in answers:
                assert_not_internal(answer, payload)
            return answers[0] if answers else None
        answer = wire.answer()
        if label is not None:  # shown by pytest --hypothesis-show-statistics
            event(f"{label}: {'result' if answer.error is None else answer.error.code}")
        assert answer.id == request_id, (answer, request_id)
        assert_not_internal(answer, payload)
        assert answer.error is None or answer.error.code not in ("bad_frame", "frame_too_large")
        wire.send(request(2**63 - 1, "ping", {}))
        pong = wire.answer()
        assert pong.id == 2**63 - 1 and pong.error is None, pong
        return answer


# --- hypothesis strategies: raw msgpack ------------------------------------------------

UTF8 = st.characters(codec="utf-8")  # no lone surrogates: msgpack str is UTF-8
_bad_utf8 = st.sampled_from([b"\xc3\x28", b"\xff", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\x80"])
odd_text = st.text(
    alphabet=st.one_of(
        st.sampled_from("\x00\x01\x07\t\n\r\x1b\x7f\x85\u2028\u200b\ufeff\u202e"),
        st.characters(codec="utf-8"),
    ),
    max_size=24,
)
raw_str = st.builds(
    lambda a, b, c: fi.mp_str(a + b + c), st.binary(max_size=6), _bad_utf8, st.binary(max_size=6)
)

leaves = st.one_of(
    st.none().map(_enc),
    st.booleans().map(_enc),
    st.integers(min_value=-(2**63), max_value=2**64 - 1).map(_enc),
    st.sampled_from(fi._INTERESTING_INTS).map(_enc),
    st.floats().map(_enc),
    odd_text.map(_enc),
    st.text(UTF8, max_size=16).map(_enc),
    st.binary(max_size=16).map(_enc),
    raw_str,
    st.builds(
        lambda code, data: _enc(msgspec.msgpack.Ext(code, data)),
        st.integers(-128, 127),
        st.binary(max_size=12),
    ),
    st.sampled_from(fi._WRONG),
)


def _containers(children):
    keys = st.one_of(st.text(UTF8, max_size=8).map(_enc), children)
    return st.one_of(
        st.lists(children, max_size=5).map(fi.mp_array),
        st.lists(st.tuples(keys, children), max_size=5).map(fi.mp_map),
    )


values = st.recursive(leaves, _containers, max_leaves=24)
deep = st.builds(
    lambda depth, unit, leaf: unit * depth + leaf,
    st.integers(1, MAX_DEPTH),
    st.sampled_from([b"\x91", b"\x81\xa1k", b"\x91\x81\xa1k"]),
    st.sampled_from([b"\xc0", b"\x01", b"\x80"]),
)
any_value = st.one_of(values, deep)


# --- hypothesis strategies: typed params -----------------------------------------------

SCHEMAS = {name: mi.type_info(spec.params) for name, spec in m.METHODS.items()}
UUIDS = [f"00000000-0000-4000-8000-{i:012x}" for i in range(1, 9)]


def valid_for(t, name: str = ""):
    """Values a field of type ``t`` accepts (ints kept below 2**53)."""
    if isinstance(t, mi.IntType):
        lo = t.ge if t.ge is not None else -(2**53)
        hi = t.le if t.le is not None else 2**53
        if name == "holder_pid":
            return st.sampled_from([1, os.getpid()]).map(_enc)
        return st.integers(lo, hi).map(_enc)
    if isinstance(t, mi.StrType):
        if t.pattern is not None:
            return st.one_of(st.sampled_from(UUIDS), st.uuids(version=4).map(str)).map(_enc)
        if name == "path":  # backup: inside the sandbox only (classify refuses the rest)
            root = fi.sandbox() or "/nonexistent"
            return st.sampled_from([f"{root}/b.db", f"{root}/x/b.db", f"{root}/"]).map(_enc)
        lo, hi = t.min_length or 0, min(t.max_length or 40, 40)
        if name in ("operation", "key", "idempotency_key", "principal"):
            return st.text(
                alphabet=string.ascii_letters + "._-", min_size=max(lo, 1), max_size=hi
            ).map(_enc)
        return st.text(UTF8, min_size=lo, max_size=hi).map(_enc)
    if isinstance(t, mi.BoolType):
        return st.booleans().map(_enc)
    if isinstance(t, mi.NoneType):
        return st.just(b"\xc0")
    if isinstance(t, mi.LiteralType):
        return st.sampled_from(list(t.values)).map(_enc)
    if isinstance(t, mi.UnionType):
        return st.one_of([valid_for(u, name) for u in t.types])
    if isinstance(t, mi.ListType):
        return st.lists(valid_for(t.item_type, name), max_size=3).map(fi.mp_array)
    if isinstance(t, mi.StructType):
        return struct_params(t, bad=False)
    return any_value


def edge_for(t, name: str = ""):
    """Values just outside what the field accepts, or of the wrong type."""
    options = [leaves]
    if isinstance(t, mi.IntType):
        edges = [2**63, 2**64 - 1, -(2**63), -1, 2**63 - 1]
        edges += [t.ge - 1] if t.ge is not None else []
        edges += [t.le + 1] if t.le is not None else []
        options.append(st.sampled_from(edges).map(_enc))
    elif isinstance(t, mi.StrType):
        if t.pattern is not None:
            options.append(
                st.sampled_from(UUIDS)
                .flatmap(
                    lambda u: st.sampled_from([u.upper(), u + "\n", u[:-1], u + "0", "{" + u + "}"])
                )
                .map(_enc)
            )
        if t.max_length is not None:
            options.append(st.just(_enc("x" * (t.max_length + 1))))
        if t.min_length:
            options.append(st.just(b"\xa0"))
        options += [odd_text.map(_enc), raw_str]
    elif isinstance(t, mi.LiteralType):
        options.append(st.sampled_from(list(t.values)).map(lambda v: _enc(str(v).upper() + " ")))
    elif isinstance(t, mi.UnionType):
        options += [edge_for(u, name) for u in t.types if not isinstance(u, mi.NoneType)]
    elif isinstance(t, mi.ListType):
        options.append(
            st.lists(edge_for(t.item_type, name), min_size=1, max_size=2).map(fi.mp_array)
        )
    elif isinstance(t, mi.StructType):
        options.append(struct_params(t, bad=True))
    elif isinstance(t, mi.AnyType):
        options.append(any_value)
    return st.one_of(options)


def struct_params(t: mi.StructType, bad: bool = True):
    """A params map for ``t``: each field valid, wrong, at an edge, or left out, plus
    unknown and non-string keys; with ``bad``, sometimes not a map at all."""

    @st.composite
    def build(draw):
        pairs = []
        for f in t.fields:
            choice = draw(
                st.sampled_from(["valid", "valid", "edge", "absent"] if bad else ["valid"])
            )
            if choice == "absent" or (not f.required and not bad and draw(st.booleans())):
                continue
            strategy = valid_for(f.type, f.name) if choice == "valid" else edge_for(f.type, f.name)
            pairs.append((fi.mp_key(f.encode_name), draw(strategy)))
        if bad:
            extra_keys = st.one_of(st.text(UTF8, max_size=8).map(_enc), leaves)
            pairs += draw(st.lists(st.tuples(extra_keys, any_value), max_size=2))
            pairs = draw(st.permutations(pairs))
        return fi.mp_map(pairs)

    if not bad:
        return build()
    return st.one_of(build(), build(), build(), any_value)


def envelope(request_id: int, method: bytes, params: bytes | None) -> bytes:
    pairs = [(b"\xa2id", _enc(request_id)), (b"\xa6method", method)]
    if params is not None:
        pairs.append((b"\xa6params", params))
    return fi.mp_map(pairs)


real_methods = st.sampled_from([name for name in m.METHODS if name != "shutdown"])
method_calls = real_methods.flatmap(
    lambda name: st.tuples(st.just(name), st.one_of(struct_params(SCHEMAS[name]), st.none()))
)


# --- hypothesis: framing, envelopes, params, names, first frames, bursts ---------------


@FUZZ
@given(
    stream=st.one_of(
        st.binary(max_size=300),
        st.builds(
            lambda n, tail: struct.pack(">I", n) + tail,
            st.integers(0, 2**32 - 1),
            st.binary(max_size=64),
        ),
        st.builds(
            lambda n, tail: struct.pack(">I", n) + tail,
            st.integers(MAX_FRAME + 1, 2**32 - 1),
            st.binary(max_size=8),
        ),
        values.map(frame),
        values.map(lambda v: frame(v)[: max(1, len(frame(v)) // 2)]),  # truncated
    ),
    after_hello=st.booleans(),
)
def test_framing(fuzz_daemon, stream, after_hello):
    """Any byte stream, before or after hello, then a half-close: well-formed error frames
    (or a result, for a stream that happens to hold a valid request) and a clean close."""
    assume(fi._guard(stream, first=not after_hello))
    with Wire(fuzz_daemon) as wire:
        if after_hello:
            wire.hello()
        wire.send(stream)
        for answer in wire.until_eof():
            assert_not_internal(answer, stream)


@FUZZ
@given(
    pairs=st.lists(
        st.tuples(
            st.one_of(
                st.sampled_from([b"\xa2id", b"\xa6method", b"\xa6params"]),
                st.text(UTF8, max_size=8).map(_enc),
                leaves,
            ),
            st.one_of(
                st.integers(0, 2**64 - 1).map(_enc),
                st.sampled_from(["ping", "status", "idem.get", "hello", "_private", ""]).map(_enc),
                any_value,
            ),
        ),
        max_size=5,
    ),
    base=st.one_of(st.none(), st.integers(1, 2**63 - 1)),
)
def test_envelopes(fuzz_daemon, pairs, base):
    """Maps with missing, extra, duplicate or wrong-typed id/method/params, and
    non-string keys: a request is answered by id, anything else is bad_frame + close."""
    if base is not None:  # start from a valid envelope, then add the drawn pairs
        pairs = [(b"\xa2id", _enc(base)), (b"\xa6method", b"\xa4ping"), *pairs]
    assert_request_answered(fuzz_daemon, fi.mp_map(pairs), label="envelope")


@settings(FUZZ, max_examples=300)
@given(call=method_calls, request_id=st.integers(1, 2**63 - 1))
def test_method_params(fuzz_daemon, call, request_id):
    """Every real method with params that are wrong-typed, out of range, missing
    required fields, with unknown or non-string keys, or not a map: never internal."""
    method, params = call
    payload = envelope(request_id, _enc(method), params)
    answer = assert_request_answered(fuzz_daemon, payload, label=method)
    assert answer is not None


@FUZZ
@given(
    name=st.one_of(
        st.sampled_from(fi.FAKE_METHODS),
        odd_text,
        st.text(UTF8, max_size=64),
        st.integers(256, 100_000).map(lambda n: "m" * n),
        real_methods.map(lambda name: name.upper()),
        real_methods.map(lambda name: "_" + name.replace(".", "_")),
    ),
    params=st.one_of(st.none(), st.just(b"\x80"), any_value),
)
def test_method_names(fuzz_daemon, name, params):
    """Dunders, dotted paths, control characters, very long names: unknown_method."""
    payload = envelope(7, _enc(name), params)
    answer = assert_request_answered(fuzz_daemon, payload, label="name")
    if name not in m.METHODS and fi.classify(payload)[0] == fi.REQUEST:
        assert answer.error is not None and answer.error.code == "unknown_method", answer


@FUZZ
@given(
    method=st.one_of(st.just("hello"), real_methods, st.sampled_from(fi.FAKE_METHODS)),
    params=st.one_of(
        struct_params(SCHEMAS["hello"]),
        st.fixed_dictionaries(
            {
                "protocol": st.one_of(st.just(1), st.integers(-(2**63), 2**64 - 1)),
                "client": st.text(UTF8, max_size=300),
            },
            optional={"principal": st.one_of(st.none(), st.text(UTF8, max_size=140))},
        ).map(_enc),
        st.none(),
    ),
    request_id=st.integers(1, 2**63 - 1),
)
def test_first_frame(fuzz_daemon, method, params, request_id):
    """The first request: a valid hello opens the connection; anything else is refused
    under its id with a closing code, then EOF."""
    payload = envelope(request_id, _enc(method), params)
    what, _ = fi.classify(payload)
    with Wire(fuzz_daemon) as wire:
        wire.send(frame(payload))
        if what == fi.TERMINAL:  # not an envelope, or nested deep enough to be refused
            for answer in wire.until_eof():
                assert_not_internal(answer, payload)
            return
        answer = wire.answer()
        assert answer.id == request_id
        assert_not_internal(answer, payload)
        if answer.error is None:
            assert method == "hello"
            wire.send(request(2, "ping", {}))
            assert wire.answer().error is None
            return
        if answer.error.code == "bad_frame":  # params nested past the decoder's depth limit
            assert "nested too deeply" in answer.error.message, answer
        else:
            assert answer.error.code in ("unauthorized", "bad_args", "protocol_mismatch"), answer
        assert method != "hello" or answer.error.code != "unauthorized"
        assert wire.until_eof() == []


@FUZZ
@given(
    calls=st.lists(
        st.one_of(method_calls, st.tuples(st.sampled_from(fi.FAKE_METHODS), st.none())),
        min_size=1,
        max_size=40,
    ),
    tail=st.sampled_from(
        [
            None,
            frame(b"\xc1"),  # not msgpack
            frame(b""),
            frame(_enc([1, "ping", {}])),  # not a map
            frame(_enc({"id": 0, "method": "ping"})),
            struct.pack(">I", 0xFFFFFFFF),  # too large
            struct.pack(">I", 1000) + b"\x80",  # truncated
        ]
    ),
    with_hello=st.booleans(),
)
def test_pipelined_burst(fuzz_daemon, calls, tail, with_hello):
    """Requests in one write (with hello in the same write, sometimes), perhaps ending
    in a bad frame: every request is answered by its id before the close."""
    payloads = [envelope(100 + i, _enc(method), params) for i, (method, params) in enumerate(calls)]
    kinds = [fi.classify(p) for p in payloads]
    assume(all(what == fi.REQUEST for what, _ in kinds))
    assume(with_hello or calls[0][0] != "hello")
    data = b"".join(frame(p) for p in payloads)
    with Wire(fuzz_daemon) as wire:
        wire.send((HELLO if with_hello else b"") + data + (tail or b""))
        if with_hello:
            assert wire.answer().id == 1
        answered = {}
        if not with_hello:  # the first request was not hello: refused, then closed
            first = wire.answer()
            assert first.id == 100 and first.error is not None
            assert first.error.code == "unauthorized", first
            assert wire.until_eof() == []
            return
        while len(answered) < len(payloads):
            answer = wire.answer()
            if answer.id == 0:
                assert tail is not None and answer.error is not None
                continue
            assert 100 <= answer.id < 100 + len(payloads) and answer.id not in answered, answer
            assert_not_internal(answer, payloads[answer.id - 100])
            answered[answer.id] = answer
        if tail is None:
            wire.send(request(2, "ping", {}))
            assert wire.answer().error is None
        else:
            for answer in wire.until_eof():
                assert answer.error is not None and answer.error.code in fi.CLOSING_CODES


@pytest.mark.parametrize("method", [name for name in m.METHODS if name != "shutdown"])
def test_strings_near_the_frame_limit(fuzz_daemon, method):
    """A string param filling the frame to exactly 1 MiB is answered (no internal);
    one byte more is frame_too_large and a close."""
    t = SCHEMAS[method]
    fields = [f for f in t.fields if fi._is_str(f.type)]
    name = fields[0].encode_name if fields else "pad"

    def payload(size: int) -> bytes:
        return envelope(5, _enc(method), fi.mp_map([(fi.mp_key(name), fi.mp_str(b"y" * size))]))

    size = MAX_FRAME - len(payload(70_000)) + 70_000
    exact = payload(size)
    assert len(exact) == MAX_FRAME and fi.classify(exact)[0] == fi.REQUEST
    answer = assert_request_answered(fuzz_daemon, exact)
    assert answer.id == 5
    with Wire(fuzz_daemon) as wire:
        wire.hello()
        wire.send(frame(payload(size + 1)))
        (refusal,) = wire.until_eof()
        assert refusal.id == 0 and refusal.error.code == "frame_too_large"


# --- the fast generator, against the live daemon --------------------------------------


def test_generated_inputs(fuzz_daemon):
    """A few thousand inputs from the bench generator: pipelined bad requests after hello,
    garbage, huge and truncated prefixes, bad envelopes, mutated frames, first frames."""
    seed = int(os.environ.get("FUZZ_SEED", random.randrange(2**32)))
    gen = fi.Generator(seed, max_depth=MAX_DEPTH, huge_rate=0.002)
    stats = fi.Stats()
    daemon = fuzz_daemon

    async def died() -> bool:
        await asyncio.sleep(0.2)
        return daemon.proc.poll() is not None

    async def run() -> None:
        driver = fi.Driver(str(daemon.socket_path), gen, stats, daemon_died=died, timeout=TIMEOUT)

        async def runner() -> None:
            while stats.inputs < SMOKE_INPUTS:
                await driver.session(min(SMOKE_INPUTS - stats.inputs, 300))

        await asyncio.gather(*(runner() for _ in range(6)))

    before = vm_rss_kib(daemon.pid)
    started = time.monotonic()
    asyncio.run(run())
    elapsed = time.monotonic() - started
    after = vm_rss_kib(daemon.pid)
    for bug, count in stats.internal_known.items():
        KNOWN_HITS[bug] = KNOWN_HITS.get(bug, 0) + count
    details = "\n".join(
        f"  {f.what} [{f.kind}]: {f.detail[:300]}\n    input: {fi.rle_hex(f.data, 600)}"
        for f in stats.findings
        if not f.what.startswith("known:")
    )
    print(
        f"\nfuzz smoke: seed={seed} inputs={stats.inputs} in {elapsed:.1f}s "
        f"outcomes={dict(stats.outcomes.most_common())} known_bugs={dict(stats.internal_known)} "
        f"rss {before} -> {after} KiB"
    )
    assert daemon.proc.poll() is None, f"the daemon died (seed {seed}):\n{daemon.log()[-3000:]}"
    assert not stats.failures, f"seed {seed}: {dict(stats.failures)}\n{details}"
    assert stats.inputs >= SMOKE_INPUTS
    # the inputs reached every layer: framer, envelope, hello, dispatcher, validation, store
    for outcome in ("result", "bad_args", "unknown_method", "bad_frame", "frame_too_large"):
        assert stats.outcomes[outcome] > 0, (outcome, stats.outcomes)
    assert after - before < RSS_GROWTH_LIMIT_KIB, f"RSS grew from {before} to {after} KiB"
    assert ping(daemon) is True


# --- regressions: minimal reproducers of the bugs found at a56d68b (fixed in 9ea051a) ---


def _survives(daemon: Daemon, data: bytes, after_hello: bool) -> None:
    with Wire(daemon) as wire:
        if after_hello:
            wire.hello()
        wire.send(data)
        for answer in wire.until_eof():
            assert answer.error is not None, answer
    time.sleep(0.2)
    assert daemon.proc.poll() is None, (
        f"the daemon died (exit {daemon.proc.returncode}) on {fi.rle_hex(data)}:\n"
        f"{daemon.log()[-1500:]}"
    )
    assert ping(daemon) is True


@pytest.mark.parametrize(
    "data, after_hello",
    [
        # 00 00 03 ec 81 a1 78 91*1000 c0: {"x": [[[...nil...]]]} (1000 arrays), no hello
        pytest.param(
            frame(b"\x81\xa1x" + b"\x91" * 1000 + b"\xc0"), False, id="unknown-field-1000"
        ),
        pytest.param(
            frame(b"\x81\xa1x" + b"\x91" * 100_000 + b"\xc0"), False, id="unknown-field-100k"
        ),
        pytest.param(
            frame(envelope(2, b"\xa4ping", b"\x81\xa1k" * 2000 + b"\xc0")), True, id="params-2000"
        ),
    ],
)
def test_regression_deep_nesting_killed_the_daemon(daemon, data, after_hello):
    """A frame nested ~1000 deep killed the whole daemon (exit 1) at a56d68b.

    msgspec raises RecursionError (not DecodeError) while skipping or decoding the
    nested value; decode_request (protocol/envelope.py) caught only msgspec errors, so
    the exception escaped the connection's task group and the server's, and the
    process exited. One 1008-byte frame on a fresh connection, no hello needed, did
    it. Expected: bad_frame (or bad_args) and a close; the daemon keeps serving.
    """
    _survives(daemon, data, after_hello)


@pytest.mark.parametrize(
    "method, params",
    [
        # e.g. ...a6 70 61 72 61 6d 73 81 a6 63 75 72 73 6f 72 cf 80 00 00 00 00 00 00 00
        ("fleet.list", {"cursor": 2**63}),
        ("idem.list", {"cursor": 2**64 - 1}),
        ("session.register", {"cwd": "/", "agent": "a", "last_attached_at": 2**63}),
        (
            "fleet.write",
            {
                "sessions": [
                    {"session_id": UUIDS[0], "cwd": "/", "agent": "a", "last_attached_at": 2**63}
                ]
            },
        ),
        (
            "fleet.import_legacy",
            {
                "entries": [
                    {"agentSessionID": "big", "cwd": "/", "agent": "a", "lastAttachedAt": 2**63}
                ]
            },
        ),
    ],
)
def test_regression_int_beyond_int64_was_internal(fuzz_daemon, method, params):
    """At a56d68b, Millis and Cursor fields had no upper bound, so 2**63..2**64-1 (valid
    msgpack uint64) passed validation and then overflowed SQLite's INTEGER:
    ``internal: OverflowError('Python int too large to convert to SQLite INTEGER')``.
    Expected: bad_args (or a result), never internal."""
    with Wire(fuzz_daemon) as wire:
        wire.hello()
        wire.send(request(2, method, params))
        answer = wire.answer()
        assert answer.error is None or answer.error.code != "internal", answer.error


def _idem_params(key: str, field: bytes, value: bytes) -> bytes:
    return fi.mp_map([(b"\xa9operation", b"\xa2fz"), (b"\xa3key", _enc(key)), (field, value)])


ARRAY_KEY_MAP = b"\x81\x92\x01\x02\x01"  # {[1, 2]: 1}: a map whose key is an array


@pytest.mark.parametrize("method", ["idem.claim", "idem.complete"])
def test_regression_array_map_key_was_internal(fuzz_daemon, method):
    """msgpack allows an array as a map key (msgspec decodes it as a tuple), but at
    a56d68b pack_canonical (daemon/store/tx.py) turned the key into a list and built a
    dict from it: ``internal: TypeError("unhashable type: 'list'")``. Hit by an
    idem.claim payload, and by repeating an idem.complete whose result holds such a map
    (the repeat compares canonical forms). Expected: a result or bad_args, not internal.
    """
    key = f"array-key-{method}-{os.getpid()}-{time.monotonic_ns()}"
    with Wire(fuzz_daemon) as wire:
        wire.hello()
        if method == "idem.complete":  # claim, complete once (that works), then repeat
            wire.send(request(2, "idem.claim", {"operation": "fz", "key": key}))
            assert wire.answer().error is None
            wire.send(
                frame(
                    envelope(
                        3, b"\xadidem.complete", _idem_params(key, b"\xa6result", ARRAY_KEY_MAP)
                    )
                )
            )
            assert wire.answer().error is None
            params = _idem_params(key, b"\xa6result", ARRAY_KEY_MAP)
        else:
            params = _idem_params(key, b"\xa7payload", ARRAY_KEY_MAP)
        wire.send(frame(envelope(4, _enc(method), params)))
        answer = wire.answer()
        assert answer.error is None or answer.error.code != "internal", answer.error


def test_regression_nested_payload_was_internal(fuzz_daemon):
    """At a56d68b an idem.claim payload nested 700 deep decoded (msgspec's limit is
    higher), then the recursive pack_canonical overflowed the stack on the database
    thread: ``internal: RecursionError(...)``. Expected: bad_args (too deep) or a result.
    """
    payload = b"\x91" * 700 + b"\xc0"
    params = _idem_params(f"nested-{time.monotonic_ns()}", b"\xa7payload", payload)
    with Wire(fuzz_daemon) as wire:
        wire.hello()
        wire.send(frame(envelope(2, b"\xaaidem.claim", params)))
        answer = wire.answer()
        assert answer.error is None or answer.error.code != "internal", answer.error


# --- regressions: backup paths the OS refuses (found at 927cee0, fixed in 28b1b72) -----


@pytest.mark.parametrize(
    "name",
    [
        # params: {"path": "<sandbox>/b\x00.db"}
        pytest.param("b\x00.db", id="nul-byte"),
        # params: {"path": "<sandbox>/nnn...n"} (256 bytes: one over NAME_MAX)
        pytest.param("n" * 256, id="name-over-255-bytes"),
        pytest.param("d" * 300 + "/b.db", id="dir-over-255-bytes"),
    ],
)
def test_regression_backup_path_the_os_refuses_was_internal(fuzz_daemon, name):
    """At 927cee0 (backup's first version) a path the OS refuses was answered
    ``internal``: a NUL byte (``ValueError('embedded null byte')`` from sqlite3.connect)
    or a component over 255 bytes (``OSError(36, 'File name too long')``, which
    Path.exists/is_dir do not swallow). Expected: bad_args, as for a missing directory.
    (The path is inside the sandbox: nothing is written anywhere else.)"""
    path = f"{fi.sandbox()}/{name}"
    with Wire(fuzz_daemon) as wire:
        wire.hello()
        wire.send(request(2, "backup", {"path": path}))
        answer = wire.answer()
        assert answer.error is not None and answer.error.code == "bad_args", answer.error


# --- last: the shared daemon survived all of the above ----------------------------------


def test_daemon_survived_with_bounded_memory(fuzz_daemon):
    """After everything above (this runs last): alive, answers ping, RSS growth bounded."""
    assert fuzz_daemon.proc.poll() is None, fuzz_daemon.log()[-3000:]
    assert ping(fuzz_daemon) is True
    end = vm_rss_kib(fuzz_daemon.pid)
    start = RSS.get("start", end)
    print(f"\nfuzz module: daemon RSS {start} -> {end} KiB; known bugs hit: {KNOWN_HITS}")
    assert end - start < RSS_GROWTH_LIMIT_KIB, f"RSS grew from {start} to {end} KiB"
