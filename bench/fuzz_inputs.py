"""Hostile inputs for towerd's wire protocol, and the oracle that judges the answers.

A fast seeded generator (hypothesis is far too slow for 10^6 inputs) shared by
``bench/fuzz.py`` (a long run against a live daemon) and
``tests/integration/test_fuzz.py`` (the CI smoke). Everything is built as raw
msgpack bytes, so an input can hold what no well-behaved encoder writes:
invalid UTF-8 in a ``str``, arrays or floats as map keys, duplicate keys,
integers in needlessly wide encodings, nesting thousands deep.

Each input is one of three things, and the session driver (:func:`run_session`)
treats them differently:

* a **request**: a frame the daemon's own envelope decoder accepts, sent after
  ``hello``: nearly always with bad params, an odd method name or an odd
  envelope encoding. The daemon must answer it by id, and keep serving.
* a **terminal** input: anything that may end the connection (garbage bytes, a
  huge or truncated length prefix, a frame that is not a request envelope, deep
  nesting, a mutated frame, unframed junk). It is the last thing sent on its
  connection, followed by a half-close (or an abrupt close): the daemon must
  answer with well-formed error frames and/or close, and must first answer every
  request pipelined ahead of it.
* a **hello attempt**: the first frame of a connection (a hello with odd params,
  another method, garbage), which either opens the connection or is refused and
  closed.

The oracle for every answer: a map with an int ``id`` and exactly one of
``result`` or ``error``; an error has a ``code`` in ``ERROR_CODES`` and a str
``message``. The daemon never hangs (every read has a timeout), and a close
without an answer is only acceptable where the protocol allows it.

Nothing is sent that could act outside the daemon's own state (``classify``): no
``shutdown`` it would obey, no ``backup`` outside a sandbox directory, and only refused
params to methods this file does not know.
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import re
import socket
import struct
import sys
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from msgspec import inspect as mi

from towerd.protocol import DEFAULT_MAX_FRAME, RESPONSE_SLACK, FrameDecoder
from towerd.protocol import methods as m
from towerd.protocol.envelope import MalformedRequest, _peek_id, decode_request
from towerd.protocol.errors import ERROR_CODES

MAX_FRAME = DEFAULT_MAX_FRAME
PREFIX = struct.Struct(">I")
_encode = msgspec.msgpack.Encoder().encode

# Codes after which the daemon closes the connection (bad_args only for a first hello).
CLOSING_CODES = frozenset(
    {"bad_frame", "frame_too_large", "unauthorized", "protocol_mismatch", "bad_args"}
)


# --- known daemon bugs ---------------------------------------------------------------
#
# An ``internal`` answer to an input that is merely invalid is a bug (an exception a
# handler did not expect). While such a bug is open, add it here (a pattern matching
# its message): the generic runs then count it apart, so that a *new* internal still
# stands out, and give it a minimal failing reproducer in tests/integration/test_fuzz.py.
# Remove the entry once the bug is fixed.
#
# Found by this fuzzer, each with a regression test in test_fuzz.py. At a56d68b, fixed
# in 9ea051a: ints >= 2**63 in Millis/Cursor fields overflowed SQLite
# ("OverflowError('Python int too large to convert to SQLite INTEGER')"); an array as
# a map key in a payload/result ("TypeError(\"unhashable type: 'list'\")"); values
# nested a few hundred deep ("RecursionError(...)"); and nesting ~1000 deep anywhere
# in a frame killed the daemon. At 927cee0, fixed in 28b1b72: a backup path with a
# NUL byte ("ValueError('embedded null byte')") or a name over 255 bytes
# ("OSError(36, 'File name too long')").


@dataclass(frozen=True)
class KnownBug:
    name: str
    pattern: re.Pattern[str]
    summary: str


KNOWN_BUGS: tuple[KnownBug, ...] = ()


def known_bug(message: str) -> str | None:
    for bug in KNOWN_BUGS:
        if bug.pattern.search(message):
            return bug.name
    return None


# --- raw msgpack ---------------------------------------------------------------------


def frame(payload: bytes) -> bytes:
    return PREFIX.pack(len(payload)) + payload


def mp_str(raw: bytes) -> bytes:
    """A msgpack str holding ``raw`` as is (which need not be UTF-8)."""
    n = len(raw)
    if n < 32:
        return bytes((0xA0 | n,)) + raw
    if n < 256:
        return b"\xd9" + bytes((n,)) + raw
    if n < 65536:
        return b"\xda" + n.to_bytes(2, "big") + raw
    return b"\xdb" + n.to_bytes(4, "big") + raw


def mp_key(name: str) -> bytes:
    return mp_str(name.encode())


def mp_map(pairs: list[tuple[bytes, bytes]]) -> bytes:
    n = len(pairs)
    if n < 16:
        head = bytes((0x80 | n,))
    elif n < 65536:
        head = b"\xde" + n.to_bytes(2, "big")
    else:
        head = b"\xdf" + n.to_bytes(4, "big")
    return head + b"".join(k + v for k, v in pairs)


def mp_array(items: list[bytes]) -> bytes:
    n = len(items)
    if n < 16:
        head = bytes((0x90 | n,))
    elif n < 65536:
        head = b"\xdc" + n.to_bytes(2, "big")
    else:
        head = b"\xdd" + n.to_bytes(4, "big")
    return head + b"".join(items)


def mp_wide_uint(value: int, rng: random.Random) -> bytes:
    """``value`` (>= 0) in a needlessly wide but valid encoding."""
    widths = [(0xCF, 8)]
    if value < 2**32:
        widths.append((0xCE, 4))
    if value < 2**16:
        widths.append((0xCD, 2))
    if value < 2**8:
        widths.append((0xCC, 1))
    tag, size = rng.choice(widths)
    return bytes((tag,)) + value.to_bytes(size, "big")


def rle_hex(data: bytes, limit: int = 400) -> str:
    """Hex with repeats collapsed (``91*2000``, ``(81a16b)*500``): deep or huge inputs
    stay readable and can be pasted back with :func:`unrle_hex`."""
    out: list[str] = []
    literal = bytearray()
    i = 0
    n = len(data)
    while i < n:
        best = None
        for period in (1, 2, 3, 4, 6):
            unit = data[i : i + period]
            if len(unit) < period:
                break
            reps = 1
            while data[i + reps * period : i + (reps + 1) * period] == unit:
                reps += 1
            if reps * period >= 12 and (best is None or reps * period > best[0] * best[1]):
                best = (reps, period)
        if best is None:
            literal.append(data[i])
            i += 1
            continue
        if literal:
            out.append(literal.hex())
            literal.clear()
        reps, period = best
        unit = data[i : i + period].hex()
        out.append(f"{unit}*{reps}" if period == 1 else f"({unit})*{reps}")
        i += reps * period
    if literal:
        out.append(literal.hex())
    text = " ".join(out)
    return text if len(text) <= limit else text[:limit] + f"...({n} bytes)"


def unrle_hex(text: str) -> bytes:
    """The bytes :func:`rle_hex` described (without a ``...`` cut)."""
    out = bytearray()
    for token in text.split():
        if "*" in token:
            unit, reps = token.rsplit("*", 1)
            out += bytes.fromhex(unit.strip("()")) * int(reps)
        else:
            out += bytes.fromhex(token)
    return bytes(out)


# Values of every msgpack type, encoded: the pool wrong-typed fields are drawn from.
_WRONG = [
    b"\xc0",  # nil
    b"\xc2",
    b"\xc3",
    b"\x00",
    b"\x01",
    b"\xff",  # -1
    b"\xd0\x80",  # -128
    b"\xd3\x80\x00\x00\x00\x00\x00\x00\x00",  # -2**63
    b"\xcf\x7f\xff\xff\xff\xff\xff\xff\xff",  # 2**63-1
    b"\xcf\x80\x00\x00\x00\x00\x00\x00\x00",  # 2**63
    b"\xcf\xff\xff\xff\xff\xff\xff\xff\xff",  # 2**64-1
    b"\xce\xff\xff\xff\xff",  # 2**32-1
    _encode(1.5),
    _encode(float("nan")),
    _encode(float("inf")),
    _encode(-0.0),
    b"\xca\x3f\x80\x00\x00",  # float32 1.0
    b"\xa0",  # ""
    b"\xa1x",
    b"\xa1\x00",
    b"\xa11",
    b"\xa4true",
    b"\xa2\xc3\x28",  # invalid UTF-8 str
    b"\xa3\xed\xa0\x80",  # a UTF-8-encoded surrogate
    b"\xc4\x00",  # bin ""
    b"\xc4\x04ping",
    b"\x90",
    b"\x91\x01",
    b"\x92\xa1a\xc0",
    b"\x80",
    b"\x81\xa1a\x01",
    b"\x81\x01\x02",  # int key
    b"\xd4\x01\x00",  # fixext1
    b"\xc7\x00\x05",  # ext8, empty
    b"\xd6\xff\x00\x00\x00\x01",  # timestamp 32
    b"\xd7\xff\xff\xff\xff\xff\xff\xff\xff\xff",  # timestamp 64, out of range nanos
    b"\xc7\x0c\xff" + b"\xff" * 12,  # timestamp 96, extreme
]

_INTERESTING_INTS = [
    0,
    1,
    -1,
    2,
    127,
    128,
    255,
    256,
    65535,
    65536,
    2**31 - 1,
    2**31,
    2**32 - 1,
    2**32,
    2**53,
    2**63 - 1,
    2**63,
    2**64 - 1,
    -(2**31),
    -(2**63),
]

_PRINTABLE = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_./:@ "
_UNICODE = "éßΩЖ中文😀\u200b\u00a0\ufeff\u202e"
_CONTROL = "\x00\x01\x07\x08\t\n\r\x1b\x7f\x85\u2028\u2029"
_PRINTABLE_FIELDS = frozenset({"principal", "idempotency_key", "operation", "key"})

FAKE_METHODS = [
    "_private",
    "__init__",
    "__class__",
    "__dict__",
    "__getattribute__",
    "a.b.c",
    "",
    " ",
    ".",
    "ping ",
    " ping",
    "PING",
    "Ping",
    "idem",
    "idem.",
    ".ping",
    "idem.claim.extra",
    "idem..claim",
    "idem_claim",
    "session_register",
    "table",
    "store",
    "handlers",
    "_answer",
    "hello\x00",
    "\x00",
    "méthode",
    "ping\n",
    "fleet.list\x00",
    "__import__",
    "eval",
    "shutdown.now",
]

_OPERATIONS = ["deploy", "session.spawn", "session.register", "op", "o"]
_KEYS = [f"k{i}" for i in range(16)]
_AGENT_IDS = [f"as-{i}" for i in range(12)]


def _uuid_pool(n: int) -> list[str]:
    return [f"00000000-0000-4000-8000-{i:012x}" for i in range(1, n + 1)]


# --- what the fuzzer may send --------------------------------------------------------
#
# Some methods act outside the daemon's own state: ``shutdown`` stops it, ``backup``
# writes a file wherever the client says (as the daemon's user, maybe root). Params
# those would accept are sent only where that is harmless: never to ``shutdown``, to
# ``backup`` only with a path inside the sandbox directory (``set_sandbox``; without
# one, never), and never to a method not vetted here (one added since), which only
# ever gets params its own decoder refuses. ``classify`` enforces this on every frame,
# however it was made (mutated and garbage frames included): such a frame is UNSAFE
# and is never sent after hello.

VETTED = frozenset(
    {
        "hello",
        "ping",
        "status",
        "boxes.list",  # read-only: the store's daemons rows
        "session.register",
        "session.update",
        "session.remove",
        "fleet.list",
        "fleet.get",
        "fleet.write",
        "fleet.import_legacy",
        "fleet.adopt",
        "idem.claim",
        "idem.complete",
        "idem.release",
        "idem.mark_unknown",
        "idem.get",
        "idem.list",
        "idem.resolve",
        "doctor",  # read-only checks of the daemon's own database
        # leases and effects: records in the daemon's own database only
        "lease.acquire",
        "lease.renew",
        "lease.release",
        "lease.get",
        "lease.list",
        "effect.claim",
        "effect.heartbeat",
        "effect.commit",
        "effect.abort",
        "effect.fail",
        "effect.resolve",
        "effect.get",
        "effect.list",
        # not "effect.settle": its probes run git against recorded remotes and run
        # recorded shell commands (towerctl run --probe): not the daemon's own database
        # workers, dispatch, audit, kv, the trail, messages: the daemon's own database only
        # (worker.register makes the fuzzing process a worker; it is reaped when it exits)
        "worker.register",
        "worker.heartbeat",
        "worker.stopping",
        "worker.list",
        "dispatch.claim",
        "dispatch.start",
        "dispatch.complete",
        "dispatch.fail",
        "dispatch.stuck",
        "dispatch.pause",
        "dispatch.cancel",
        "dispatch.get",
        "dispatch.list",
        "dispatch.recent",
        "dispatch.stuck_report",
        "audit.list",
        "kv.set",
        "kv.get",
        "kv.delete",
        "kv.list",
        "event.record",
        "event.list",
        "event.last_seen",
        # the agent's loop: fleet rows, events and path leases in the daemon's own database
        "hook.event",
        "path.claim",
        "path.release",
        "session.activity",
        "session.message",
        "message.list",
        "message.ack",
        "fleet.restore_plan",
        # not "watch": it turns the connection into a subscription of pushed frames,
        # which the fuzzer's request/answer oracle does not model
    }
)
SANDBOXED = {"backup": "path"}  # method -> the param naming a file it writes
_PARAMS = {name: msgspec.msgpack.Decoder(spec.params) for name, spec in m.METHODS.items()}
_UNSAFE_NAMES = tuple(name.encode() for name in m.METHODS if name not in VETTED)
_sandbox: str | None = None


def set_sandbox(path: str | os.PathLike[str] | None) -> None:
    """The directory ``backup`` may write to (None: nowhere)."""
    global _sandbox
    _sandbox = None if path is None else os.path.realpath(path)


def sandbox() -> str | None:
    return _sandbox


def _inside_sandbox(path: str) -> bool:
    return (
        _sandbox is not None
        and path.startswith("/")
        and os.path.normpath(path).startswith(_sandbox + "/")
    )


def _unsafe(method: str, params: msgspec.Raw) -> bool:
    """Would the daemon accept these params for a method whose effect is not harmless?"""
    if method in VETTED or method not in _PARAMS:
        return False
    try:
        decoded = _PARAMS[method].decode(params)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return False
    except RecursionError:  # cannot tell here; the daemon might decode it
        return True
    if method in SANDBOXED:
        return not _inside_sandbox(getattr(decoded, SANDBOXED[method]))
    return True  # shutdown, and anything not vetted


# --- generated inputs ----------------------------------------------------------------

REQUEST = "request"
TERMINAL = "terminal"
UNSAFE = "unsafe"


# The daemon decodes a frame with less stack to spare than we have here, so a frame
# nested a few hundred deep may decode here and be refused there (bad_frame, close).
# Such frames count as terminal: decode_request must succeed with this much headroom.
DAEMON_HEADROOM = 600


def _stack_depth() -> int:
    frame, depth = sys._getframe(), 0
    while frame is not None:
        frame, depth = frame.f_back, depth + 1
    return depth


def _decode_with_headroom(payload: bytes) -> Any:
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(_stack_depth() + DAEMON_HEADROOM)
    try:
        return decode_request(payload)
    finally:
        sys.setrecursionlimit(limit)


def classify(payload: bytes) -> tuple[str, int]:
    """What the daemon will make of one frame payload: ``(REQUEST, id)`` for a request
    it surely accepts and answers by id, ``(TERMINAL, 0)`` for one that may end the
    connection, ``(UNSAFE, id)`` for one that must not be sent (see above)."""
    if len(payload) > MAX_FRAME:
        return TERMINAL, 0
    try:
        request = decode_request(payload)
    except (MalformedRequest, RecursionError):
        # refused here, but a daemon with more stack to spare might decode a deep one:
        # only safe if it cannot name a method with effects outside the daemon. Either
        # way the answer carries the id if the envelope has a readable one.
        readable_id = _peek_id(payload)
        if any(name in payload for name in _UNSAFE_NAMES):
            return UNSAFE, readable_id
        return TERMINAL, readable_id
    if _unsafe(request.method, request.params):
        return UNSAFE, request.id
    if len(payload) > DAEMON_HEADROOM // 2:  # deep enough to matter, perhaps
        try:
            _decode_with_headroom(payload)
        except (MalformedRequest, RecursionError):  # the daemon may refuse it: terminal
            return TERMINAL, request.id
    return REQUEST, request.id


def _guard(data: bytes, *, first: bool = False) -> bool:
    """False if any whole frame in ``data`` is UNSAFE (with ``first``, the stream opens
    a connection, and its first frame is exempt: before hello, all but hello is refused,
    and a hello is harmless)."""
    decoder = FrameDecoder(MAX_FRAME)
    for index, payload in enumerate(decoder.feed(data)):
        if index == 0 and first:
            continue
        if classify(payload)[0] == UNSAFE:
            return False
    return True


@dataclass(slots=True)
class Request:
    data: bytes  # one whole frame
    request_id: int
    kind: str


@dataclass(slots=True)
class Terminal:
    data: bytes
    kind: str
    abort: bool = False  # close abruptly after sending instead of half-closing


@dataclass(slots=True)
class HelloAttempt:
    data: bytes
    kind: str
    request_id: int  # the id an answer would carry (0 if unreadable)
    opens: bool  # a valid hello: the connection stays open


class Generator:
    """Seeded hostile-input generator. ``max_depth`` caps nesting (the daemon crashes on
    deep enough nesting: see test_fuzz.py); ``huge`` enables frames near 1 MiB."""

    def __init__(
        self,
        seed: int,
        *,
        max_depth: int = 100_000,
        huge: bool = True,
        huge_rate: float = 0.0005,
        terminal_rate: float = 0.08,
        prehello_rate: float = 0.12,
    ) -> None:
        self.rng = random.Random(seed)
        self.max_depth = max_depth
        self.huge = huge
        self.huge_rate = huge_rate
        self.terminal_rate = terminal_rate
        self.prehello_rate = prehello_rate
        self.schemas = {name: mi.type_info(spec.params) for name, spec in m.METHODS.items()}
        # costly methods (a whole-database copy or check) are picked less often
        weights = {"backup": 0.1, "doctor": 0.3}
        self.methods = list(m.METHODS)
        self._method_weights = [weights.get(name, 1.0) for name in self.methods]
        self.uuids = _uuid_pool(24)
        self.principals = [f"fuzz-{seed % 1000}-{i}" for i in range(4)]
        self._seed_frames: list[bytes] = []  # recent request frames, for mutation
        self._odd_names = [self.odd_text().replace("/", "_") for _ in range(3)]

    # --- scalars -------------------------------------------------------------------

    def text(self, lo: int = 0, hi: int = 24, alphabet: str = _PRINTABLE) -> str:
        r = self.rng
        return "".join(r.choices(alphabet, k=r.randint(lo, hi)))

    def odd_text(self) -> str:
        """Strings with control characters, unicode, or nothing printable at all."""
        r = self.rng
        alphabet = r.choice((_CONTROL, _UNICODE, _PRINTABLE + _CONTROL, _UNICODE + _CONTROL))
        return "".join(r.choices(alphabet, k=r.randint(1, 16)))

    def odd_str_bytes(self) -> bytes:
        """An encoded str that is odd: control chars, unicode, or invalid UTF-8."""
        r = self.rng
        if r.random() < 0.35:
            bad = r.choice((b"\xc3\x28", b"\xff", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\x80"))
            raw = self.text(0, 6).encode() + bad + self.text(0, 6).encode()
            return mp_str(raw)
        return _encode(self.odd_text())

    def wrong(self) -> bytes:
        return self.rng.choice(_WRONG)

    def uuid(self) -> str:
        r = self.rng
        if r.random() < 0.85:
            return r.choice(self.uuids)
        return "%08x-%04x-4%03x-8%03x-%012x" % (  # noqa: UP031 - speed
            r.getrandbits(32),
            r.getrandbits(16),
            r.getrandbits(12),
            r.getrandbits(12),
            r.getrandbits(48),
        )

    def sandbox_path(self) -> str:
        """A backup target: a few names in the sandbox (so backups do not pile up), or
        one the daemon must refuse."""
        r = self.rng
        root = _sandbox or "/nonexistent-towerd-fuzz-sandbox"
        return r.choice(
            (
                f"{root}/backup-{r.randrange(3)}.db",
                f"{root}/backup-{r.randrange(3)}.db",
                f"{root}/no-such-dir/b.db",
                f"{root}/b\x00.db",  # NUL: a path the OS cannot take
                f"{root}/{'n' * 256}",  # a name over NAME_MAX
                f"{root}/{'d' * 300}/b.db",
                f"{root}/../escape.db",  # outside: classify turns it down if valid
                f"{root}/{r.choice(self._odd_names)}",
            )
        )

    def bad_uuid(self) -> bytes:
        r = self.rng
        u = r.choice(self.uuids)
        return _encode(
            r.choice(
                (
                    u.upper(),
                    u + "\n",  # `$` in a Python regex also matches before a final newline
                    u + "0",
                    u[:-1],
                    u.replace("-", ""),
                    "{" + u + "}",
                    " " + u,
                    u.replace("0", "g", 1),
                    "",
                    "NOT-A-UUID",
                    u + "\x00",
                )
            )
        )

    # --- values by msgspec type ------------------------------------------------------

    def valid(self, t: Any, name: str = "", depth: int = 0) -> bytes:
        r = self.rng
        if isinstance(t, mi.IntType):
            if name == "holder_pid":
                return _encode(r.choice((1, 1, 2, 2**31 - 1)))
            lo = t.ge if t.ge is not None else (t.gt + 1 if t.gt is not None else -1000)
            hi = t.le if t.le is not None else (t.lt - 1 if t.lt is not None else 2**41)
            if r.random() < 0.3:
                return _encode(r.choice((lo, min(hi, lo + 1), hi)))
            return _encode(r.randint(lo, min(hi, lo + 2**41)))
        if isinstance(t, mi.StrType):
            if t.pattern is not None:
                return _encode(self.uuid())
            if name == "path":  # backup: only ever inside the sandbox (classify checks)
                return _encode(self.sandbox_path())
            if name == "operation":
                return _encode(r.choice(_OPERATIONS))
            if name == "key" or name == "idempotency_key":
                return _encode(r.choice(_KEYS))
            if name == "agent_session_id":
                return _encode(r.choice(_AGENT_IDS))
            lo = max(t.min_length or 0, 0)
            hi = min(t.max_length if t.max_length is not None else 24, 24)
            alphabet = _PRINTABLE if name in _PRINTABLE_FIELDS or r.random() < 0.8 else _UNICODE
            return _encode(self.text(lo, max(lo, hi), alphabet))
        if isinstance(t, mi.BoolType):
            return b"\xc3" if r.random() < 0.5 else b"\xc2"
        if isinstance(t, mi.NoneType):
            return b"\xc0"
        if isinstance(t, mi.LiteralType):
            return _encode(r.choice(t.values))
        if isinstance(t, mi.UnionType):
            types = t.types
            if len(types) > 1 and r.random() < 0.7:
                types = [u for u in types if not isinstance(u, mi.NoneType)] or types
            return self.valid(r.choice(types), name, depth)
        if isinstance(t, mi.ListType):
            return mp_array(
                [self.valid(t.item_type, name, depth + 1) for _ in range(r.randint(0, 3))]
            )
        if isinstance(t, mi.StructType):
            return mp_map(self.valid_pairs(t, depth + 1))
        if isinstance(t, mi.AnyType):
            return self.any_value(depth)
        return _encode(None)

    def valid_pairs(self, t: mi.StructType, depth: int = 0) -> list[tuple[bytes, bytes]]:
        r = self.rng
        pairs = []
        for f in t.fields:
            if f.required or r.random() < 0.4:
                pairs.append((mp_key(f.encode_name), self.valid(f.type, f.name, depth)))
        return pairs

    def invalid(self, t: Any, name: str = "", depth: int = 0) -> bytes:
        """A value the field should refuse (or that probes its edge)."""
        r = self.rng
        if r.random() < 0.4:
            return self.wrong()
        if isinstance(t, mi.IntType):
            edges = [2**63, 2**64 - 1, -(2**63), -1, 2**63 - 1]
            if t.ge is not None:
                edges.append(t.ge - 1)
            if t.le is not None:
                edges += [t.le + 1, t.le + 2**32]
            value = r.choice(edges)
            if value >= 0 and r.random() < 0.3:
                return mp_wide_uint(value, r) if value < 2**64 else _encode(value)
            return _encode(value)
        if isinstance(t, mi.StrType):
            if t.pattern is not None:
                return self.bad_uuid()
            choice = r.random()
            if choice < 0.3 and t.max_length is not None:
                return _encode("x" * (t.max_length + r.choice((1, 1, 2, 1000))))
            if choice < 0.45 and t.min_length:
                return b"\xa0"
            if choice < 0.55:
                return _encode("x" * r.choice((300, 5000, 70_000)))
            return self.odd_str_bytes()
        if isinstance(t, mi.LiteralType):
            value = r.choice(t.values)
            return _encode(
                r.choice(
                    (
                        str(value).upper(),
                        str(value) + " ",
                        "done",
                        "",
                        "completed\x00",
                        str(value)[:-1],
                    )
                )
            )
        if isinstance(t, mi.BoolType):
            return r.choice((b"\x00", b"\x01", b"\xa4true", b"\xc0", b"\xa0"))
        if isinstance(t, mi.UnionType):
            types = [u for u in t.types if not isinstance(u, mi.NoneType)] or list(t.types)
            return self.invalid(r.choice(types), name, depth)
        if isinstance(t, mi.ListType):
            items = [self.valid(t.item_type, name, depth + 1) for _ in range(r.randint(0, 2))]
            items.insert(r.randint(0, len(items)), self.invalid(t.item_type, name, depth + 1))
            return mp_array(items) if r.random() < 0.8 else self.wrong()
        if isinstance(t, mi.StructType):
            return self.invalid_params_map(t, depth + 1)
        if isinstance(t, mi.AnyType):
            return self.nasty_any(depth)
        return self.wrong()

    def invalid_params_map(self, t: mi.StructType, depth: int = 0) -> bytes:
        r = self.rng
        pairs = self.valid_pairs(t, depth)
        if not t.fields:
            return self.wrong() if r.random() < 0.5 else mp_map(pairs)
        choice = r.random()
        required = [f for f in t.fields if f.required]
        if choice < 0.25 and required:  # a required field missing
            gone = mp_key(r.choice(required).encode_name)
            pairs = [p for p in pairs if p[0] != gone]
            return mp_map(pairs)
        if choice < 0.35:  # every field wrong
            return mp_map(
                [(mp_key(f.encode_name), self.invalid(f.type, f.name, depth)) for f in t.fields]
            )
        f = r.choice(t.fields)  # one field wrong
        key = mp_key(f.encode_name)
        pairs = [p for p in pairs if p[0] != key]
        pairs.insert(r.randint(0, len(pairs)), (key, self.invalid(f.type, f.name, depth)))
        return mp_map(pairs)

    def any_value(self, depth: int = 0) -> bytes:
        """A tame JSON-like value."""
        r = self.rng
        roll = r.random()
        if depth > 3 or roll < 0.5:
            return _encode(
                r.choice((None, True, 0, 1, -5, 1.25, "x", "result", 2**40, "", [1, 2], {"a": 1}))
            )
        if roll < 0.75:
            return mp_array([self.any_value(depth + 1) for _ in range(r.randint(0, 3))])
        return mp_map(
            [(_encode(self.text(1, 6)), self.any_value(depth + 1)) for _ in range(r.randint(0, 3))]
        )

    def nasty_any(self, depth: int = 0) -> bytes:
        """Valid msgpack that is hard on whoever walks it."""
        r = self.rng
        roll = r.random()
        if roll < 0.25:
            return self.deep(r.randint(2, 8) if r.random() < 0.5 else self.depth())
        if roll < 0.5:  # non-string map keys, at some depth
            key = r.choice(
                (
                    b"\x01",
                    b"\xff",
                    b"\xc0",
                    b"\xc3",
                    _encode(1.5),
                    _encode(float("nan")),
                    b"\xc4\x01k",
                    b"\x92\x01\x02",  # array key
                    b"\x91\x91\x01",
                    b"\xd6\xff\x00\x00\x00\x01",  # timestamp key
                    b"\xcf\xff\xff\xff\xff\xff\xff\xff\xff",
                )
            )
            inner = mp_map([(key, self.any_value(3)), (_encode("a"), b"\x01")])
            for _ in range(r.randint(0, 3)):
                inner = mp_array([inner]) if r.random() < 0.5 else mp_map([(b"\xa1k", inner)])
            return inner
        if roll < 0.65:
            return self.rng.choice(_WRONG)
        if roll < 0.8:
            return _encode(r.choice(_INTERESTING_INTS))
        if roll < 0.9:  # wide container
            n = r.choice((100, 1000, 20_000))
            return (
                mp_array([b"\xc0"] * n)
                if r.random() < 0.5
                else mp_map([(_encode(i), b"\xc0") for i in range(n)])
            )
        return self.odd_str_bytes()

    def depth(self) -> int:
        """Log-uniform nesting depth between 16 and ``max_depth``."""
        top = max(16, self.max_depth)
        return min(top, int(math.exp(self.rng.uniform(math.log(16), math.log(top)))))

    def deep(self, depth: int) -> bytes:
        r = self.rng
        leaf = r.choice((b"\xc0", b"\x01", b"\xa1x", b"\x80", b"\x90"))
        style = r.random()
        if style < 0.4:
            return b"\x91" * depth + leaf
        if style < 0.7:
            return b"\x81\xa1k" * depth + leaf
        if style < 0.85:
            return b"\x91\x81\xa1k" * (depth // 2) + leaf
        return b"\xdc\x00\x01" * depth + leaf  # array16 headers

    # --- params ------------------------------------------------------------------------

    def params(self, method: str) -> bytes | None:
        """Encoded params for ``method`` (None: the field is left out)."""
        r = self.rng
        t = self.schemas.get(method)
        if method not in VETTED and method not in SANDBOXED and t is not None:
            # shutdown (any map is valid and would stop the daemon), or a method added
            # since this was written: only params it refuses (classify checks)
            return self.invalid_params_map(t) if r.random() < 0.7 else self.wrong()
        if t is None:  # an unknown method
            roll = r.random()
            if roll < 0.2:
                return None
            if roll < 0.5:
                return b"\x80"
            return self.wrong() if roll < 0.8 else self.nasty_any()
        if self.huge and r.random() < self.huge_rate:
            return self.huge_params(method, t)
        roll = r.random()
        if roll < 0.14:  # valid: reach the handlers and the store
            return mp_map(self.valid_pairs(t))
        if roll < 0.56:
            return self.invalid_params_map(t)
        if roll < 0.63:  # valid plus unknown fields
            pairs = self.valid_pairs(t)
            for _ in range(r.randint(1, 3)):
                pairs.insert(
                    r.randint(0, len(pairs)), (_encode(self.text(1, 12)), self.nasty_any())
                )
            return mp_map(pairs)
        if roll < 0.7:  # not a map
            return self.wrong() if r.random() < 0.8 else self.nasty_any()
        if roll < 0.76:  # weird keys: non-string, invalid UTF-8, duplicates
            pairs = self.valid_pairs(t)
            weird = r.choice(
                (b"\x01", b"\xc0", b"\xc4\x03key", b"\xa2\xff\xfe", b"\x92\x01\x02", _encode(1.5))
            )
            pairs.insert(r.randint(0, len(pairs)), (weird, self.any_value(2)))
            if pairs and r.random() < 0.5:  # a duplicate key, with a wrong value
                key, _ = r.choice(pairs)
                pairs.append((key, self.wrong()))
            return mp_map(pairs)
        if roll < 0.84:  # odd strings in every str field
            pairs = []
            for f in t.fields:
                if f.required or r.random() < 0.5:
                    value = self.odd_str_bytes() if _is_str(f.type) else self.valid(f.type, f.name)
                    pairs.append((mp_key(f.encode_name), value))
            return mp_map(pairs)
        if roll < 0.92:  # nasty values in Any fields (payload, result, entries)
            pairs = self.valid_pairs(t)
            any_fields = [f for f in t.fields if _has_any(f.type)]
            if any_fields:
                f = r.choice(any_fields)
                key = mp_key(f.encode_name)
                pairs = [p for p in pairs if p[0] != key]
                value = self.nasty_any()
                if isinstance(f.type, mi.ListType):
                    value = mp_array([value, self.any_value(2)])
                pairs.append((key, value))
            else:
                pairs.append((b"\xa5extra", self.nasty_any()))
            return mp_map(pairs)
        if roll < 0.96:
            return b"\x80"
        return None

    def huge_params(self, method: str, t: mi.StructType) -> bytes:
        """A string field near the 1 MiB frame limit (sometimes just over it)."""
        r = self.rng
        pairs = self.valid_pairs(t)
        str_fields = [f for f in t.fields if _is_str(f.type)] or list(t.fields)
        if not str_fields:  # no fields at all: an unknown one, which is ignored
            base = len(method) + 140
            size = MAX_FRAME - base - r.choice((0, 10, 1000)) + r.choice((0, 0, 200))
            return mp_map([(b"\xa3pad", mp_str(b"x" * size))])
        f = r.choice(str_fields)
        key = mp_key(f.encode_name)
        pairs = [p for p in pairs if p[0] != key]
        if r.random() < 0.8 and [g for g in t.fields if g.required and g is not f]:
            # mostly refused (another required field dropped), so the store stays small
            req = r.choice([g for g in t.fields if g.required and g is not f])
            gone = mp_key(req.encode_name)
            pairs = [p for p in pairs if p[0] != gone]
        base = len(mp_map(pairs)) + 120 + len(method)
        size = MAX_FRAME - base - r.choice((0, 0, 10, 1000, 100_000)) + r.choice((0, 0, 0, 200))
        pairs.append((key, mp_str(b"x" * max(size, 1))))
        return mp_map(pairs)

    # --- requests ----------------------------------------------------------------------

    def method(self) -> str:
        r = self.rng
        roll = r.random()
        if roll < 0.82:
            return r.choices(self.methods, self._method_weights)[0]
        if roll < 0.93:
            return r.choice(FAKE_METHODS)
        if roll < 0.96:
            return "m" * r.choice((256, 4096, 100_000))
        if roll < 0.98:
            return self.odd_text()
        real = r.choice(self.methods)
        return r.choice((real.upper(), real + ".", "_" + real, real.replace(".", "_"), real[:-1]))

    def envelope(self, request_id: int, method: bytes, params: bytes | None) -> bytes:
        """A request map, in one of several valid but unusual encodings."""
        r = self.rng
        id_bytes = _encode(request_id) if r.random() < 0.8 else mp_wide_uint(request_id, r)
        pairs = [(b"\xa2id", id_bytes), (b"\xa6method", method)]
        if params is not None:
            pairs.append((b"\xa6params", params))
        roll = r.random()
        if roll < 0.1:
            r.shuffle(pairs)
        elif roll < 0.17:  # unknown envelope fields are ignored
            for _ in range(r.randint(1, 3)):
                pairs.insert(
                    r.randint(0, len(pairs)), (_encode(self.text(1, 10)), self.any_value(1))
                )
        elif roll < 0.2 and params is not None:  # params twice: the last one counts
            pairs.insert(0, (b"\xa6params", self.wrong()))
        return mp_map(pairs)

    def request(self, request_id: int) -> Request | Terminal:
        """The next input after hello: usually a request answered by ``request_id``;
        sometimes (terminal_rate) an input that ends the connection."""
        r = self.rng
        if r.random() < self.terminal_rate:
            return self.terminal()
        for _ in range(20):
            method = self.method()
            params = self.params(method)
            payload = self.envelope(request_id, _encode(method), params)
            what, rid = classify(payload)
            if what == REQUEST:
                data = frame(payload)
                if len(self._seed_frames) < 64:
                    self._seed_frames.append(payload)
                elif r.random() < 0.05:
                    self._seed_frames[r.randrange(64)] = payload
                kind = method if method in self.schemas else "unknown_method"
                return Request(data, rid, kind)
            if what == TERMINAL:  # e.g. over the frame limit, or too deep for the decoder
                return Terminal(
                    frame(payload) if len(payload) <= 2**32 - 1 else b"", "request_" + what
                )
        raise AssertionError("could not make a request")  # pragma: no cover

    # --- terminal inputs ---------------------------------------------------------------

    def terminal(self) -> Terminal:
        for _ in range(20):
            t = self._terminal()
            if _guard(t.data):
                return t
        raise AssertionError("could not make a terminal input")  # pragma: no cover

    def _terminal(self) -> Terminal:
        r = self.rng
        roll = r.random()
        if roll < 0.1:
            n = r.choice((0, 1, 2, 3, 4, 8, 16, 64, 1000))
            return Terminal(frame(r.randbytes(n)), "garbage_frame")
        if roll < 0.18:
            return Terminal(r.randbytes(r.randint(1, 300)), "garbage_stream")
        if roll < 0.26:
            length = r.choice(
                (
                    MAX_FRAME + 1,
                    MAX_FRAME + 2,
                    2**31,
                    2**32 - 1,
                    r.randint(MAX_FRAME + 1, 2**32 - 1),
                )
            )
            return Terminal(PREFIX.pack(length) + r.randbytes(r.choice((0, 1, 64))), "huge_prefix")
        if roll < 0.36:
            full = frame(
                self.envelope(r.randint(1, 2**20), _encode(r.choice(self.methods)), b"\x80")
            )
            if r.random() < 0.2:  # announce a big frame, send a little of it
                full = PREFIX.pack(r.randint(1000, MAX_FRAME)) + full[4:]
            cut = r.randint(1, len(full) - 1)
            return Terminal(full[:cut], "truncated", abort=r.random() < 0.3)
        if roll < 0.44:
            value = r.choice(_WRONG[:-3]) if r.random() < 0.8 else self.nasty_any()
            if value.startswith((b"\x80", b"\x81")):
                value = b"\x90"
            return Terminal(frame(value), "not_a_map")
        if roll < 0.62:
            return Terminal(frame(self.bad_envelope()), "bad_envelope")
        if roll < 0.67:
            payload = self.envelope(r.randint(1, 99), b"\xa4ping", b"\x80")
            return Terminal(
                frame(payload + r.choice((b"\x00", b"\xc0", b"\xc1", payload))), "trailing"
            )
        if roll < 0.77:
            return Terminal(self.deep_frame(), "deep")
        if roll < 0.97:
            return Terminal(self.mutated(), "mutated")
        return Terminal(frame(b"\xc1" * r.randint(1, 8)), "never_used_byte")

    def bad_envelope(self) -> bytes:
        r = self.rng
        good_id = _encode(r.randint(1, 2**40))
        good_method = _encode(r.choice(self.methods))
        bad_ids = [
            b"\x00",
            b"\xff",
            b"\xd3\x80\x00\x00\x00\x00\x00\x00\x00",
            b"\xcf\x80\x00\x00\x00\x00\x00\x00\x00",
            b"\xcf\xff\xff\xff\xff\xff\xff\xff\xff",
            b"\xa11",
            _encode(1.0),
            b"\xc3",
            b"\xc0",
            b"\x91\x01",
            b"\x80",
            b"\xc4\x01\x01",
        ]
        bad_methods = [
            b"\x05",
            b"\xc0",
            b"\xc4\x04ping",
            b"\xa2\xff\xfe",
            b"\x91\xa4ping",
            b"\x80",
            b"\xc3",
        ]
        roll = r.random()
        if roll < 0.25:
            pairs = [(b"\xa2id", r.choice(bad_ids)), (b"\xa6method", good_method)]
        elif roll < 0.5:
            pairs = [(b"\xa2id", good_id), (b"\xa6method", r.choice(bad_methods))]
        elif roll < 0.6:
            pairs = [(b"\xa6method", good_method)]  # no id
        elif roll < 0.7:
            pairs = [(b"\xa2id", good_id)]  # no method
        elif roll < 0.8:  # non-string keys around a good envelope
            pairs = [(b"\xa2id", good_id), (b"\xa6method", good_method)]
            pairs.insert(
                r.randint(0, 2),
                (r.choice((b"\x01", b"\xc0", b"\x92\x01\x02", b"\xc4\x02id")), b"\x01"),
            )
        elif roll < 0.9:  # an invalid UTF-8 key
            pairs = [(b"\xa2id", good_id), (b"\xa6method", good_method), (b"\xa2\xff\xfe", b"\x01")]
        else:  # a map header that promises more than there is
            return bytes((0x80 | r.randint(3, 15),)) + b"\xa2id" + good_id
        if r.random() < 0.3:
            pairs.append((b"\xa6params", self.wrong()))
        return mp_map(pairs)

    def deep_frame(self) -> bytes:
        r = self.rng
        nested = self.deep(self.depth())
        roll = r.random()
        if roll < 0.4:  # an unknown envelope field: skipped, but recursively
            payload = mp_map(
                [(b"\xa2id", b"\x07"), (b"\xa6method", b"\xa4ping"), (b"\xa1x", nested)]
            )
        elif roll < 0.7:
            payload = mp_map(
                [
                    (b"\xa2id", b"\x07"),
                    (b"\xa6method", b"\xaaidem.claim"),
                    (
                        b"\xa6params",
                        mp_map(
                            [
                                (b"\xa9operation", b"\xa1o"),
                                (b"\xa3key", b"\xa1k"),
                                (b"\xa7payload", nested),
                            ]
                        ),
                    ),
                ]
            )
        elif roll < 0.85:
            payload = mp_map([(b"\xa1x", nested)])
        else:
            payload = nested
        return frame(payload[:MAX_FRAME])

    def mutated(self) -> bytes:
        """A recent request frame with a few byte-level mutations."""
        r = self.rng
        if self._seed_frames:
            payload = bytearray(r.choice(self._seed_frames))
        else:
            payload = bytearray(self.envelope(3, b"\xa4ping", b"\x80"))
        for _ in range(r.randint(1, 4)):
            if not payload:
                payload.append(r.getrandbits(8))
                continue
            i = r.randrange(len(payload))
            op = r.random()
            if op < 0.35:
                payload[i] = r.choice(
                    (0x00, 0xFF, 0xC1, 0xC0, 0xDF, 0xDD, 0xDB, 0x7F, 0x80, 0x90, r.getrandbits(8))
                )
            elif op < 0.55:
                payload[i] ^= 1 << r.randrange(8)
            elif op < 0.7:
                del payload[i : i + r.randint(1, 8)]
            elif op < 0.85:
                payload[i:i] = r.randbytes(r.randint(1, 8))
            else:
                j = r.randrange(len(payload))
                payload[i:i] = payload[j : j + r.randint(1, 32)]
        data = bytes(payload)
        if r.random() < 0.85:
            return frame(data)
        raw = bytearray(frame(data))  # mutate the prefix too
        raw[r.randrange(4)] = r.getrandbits(8)
        return bytes(raw)

    # --- hello ---------------------------------------------------------------------------

    def hello(self, request_id: int = 1) -> bytes:
        r = self.rng
        params = {"protocol": 1, "client": "fuzz"}
        if r.random() < 0.9:
            params["principal"] = r.choice(self.principals)
        return frame(_encode({"id": request_id, "method": "hello", "params": params}))

    def hello_attempt(self) -> HelloAttempt | Terminal:
        """The first frame of a connection: a hello with odd params, or not a hello."""
        r = self.rng
        roll = r.random()
        if roll < 0.15:
            t = self.terminal()
            return Terminal(t.data, "prehello_" + t.kind, t.abort)
        request_id = r.randint(1, 2**63 - 1) if r.random() < 0.2 else r.randint(1, 1000)
        if roll < 0.35:  # another method first
            method = r.choice(self.methods + FAKE_METHODS)
            if method == "hello":
                method = "ping"
            params = self.params(method) if method != "shutdown" else b"\x80"
            payload = self.envelope(request_id, _encode(method), params)
            what, rid = classify(payload)
            if what == TERMINAL:
                return Terminal(frame(payload), "prehello_bad_envelope")
            return HelloAttempt(frame(payload), "prehello_" + method[:24], rid, False)
        pairs = [(b"\xa8protocol", b"\x01"), (b"\xa6client", _encode(self.text(0, 20)))]
        opens = True
        roll = r.random()
        if roll < 0.2:  # valid oddities: long client, control chars, wide ints, extra fields
            pairs[0] = (b"\xa8protocol", mp_wide_uint(1, r))
            pairs[1] = (b"\xa6client", _encode(r.choice(("x" * 256, self.odd_text(), ""))))
            pairs.append((b"\xa5extra", self.any_value(2)))
            pairs.append((b"\xa9principal", _encode(r.choice(("p" * 128, "é", self.text(1, 20))))))
        elif roll < 0.35:
            pairs[0] = (b"\xa8protocol", _encode(r.choice((0, 2, -1, 2**63, 2**64 - 1, 1000))))
            opens = False
        elif roll < 0.5:
            pairs[0] = (b"\xa8protocol", self.wrong())
            opens = pairs[0][1] in (b"\x01",)
        elif roll < 0.6:
            pairs.pop(r.randrange(2))
            opens = False
        elif roll < 0.7:
            pairs[1] = (
                b"\xa6client",
                r.choice((_encode("c" * 257), self.wrong(), self.odd_str_bytes())),
            )
            opens = False
        elif roll < 0.85:
            bad = r.choice(("", "p" * 129, "bad\x00name", "tab\there", "\u2028", "\x7f"))
            value = (
                _encode(bad) if r.random() < 0.8 else r.choice((self.wrong(), self.odd_str_bytes()))
            )
            pairs.append((b"\xa9principal", value))
            opens = False
        else:  # params not a map, or nasty
            payload = self.envelope(
                request_id, b"\xa5hello", r.choice((self.wrong(), self.nasty_any(), None))
            )
            what, rid = classify(payload)
            if what == TERMINAL:
                return Terminal(frame(payload), "prehello_bad_envelope")
            return HelloAttempt(frame(payload), "hello_bad_params", rid, False)
        payload = self.envelope(request_id, b"\xa5hello", mp_map(pairs))
        what, rid = classify(payload)
        if what == TERMINAL:
            return Terminal(frame(payload), "prehello_bad_envelope")
        # "opens" is only a guess (a wrong-typed value can still be valid); the driver
        # follows the answer, not the guess.
        return HelloAttempt(frame(payload), "hello_odd", rid, opens)


def _is_str(t: Any) -> bool:
    if isinstance(t, mi.StrType):
        return True
    if isinstance(t, mi.UnionType):
        return any(isinstance(u, mi.StrType) for u in t.types)
    return False


def _has_any(t: Any) -> bool:
    if isinstance(t, mi.AnyType):
        return True
    if isinstance(t, mi.ListType):
        return _has_any(t.item_type)
    return False


# --- the oracle ------------------------------------------------------------------------


class ErrorBody(msgspec.Struct):
    code: str
    message: str
    data: dict[str, Any] | None = None


_NO_RESULT = msgspec.Raw(b"")


class Answer(msgspec.Struct):
    id: int
    result: msgspec.Raw = _NO_RESULT
    error: ErrorBody | None = None


_answer_decoder = msgspec.msgpack.Decoder(Answer)


def judge(payload: bytes) -> tuple[Answer | None, str]:
    """Decode one answer frame: ``(answer, outcome)``, or ``(None, why)`` if it breaks
    the protocol (not a map, neither or both of result/error, unknown code...)."""
    try:
        answer = _answer_decoder.decode(payload)
    except (msgspec.DecodeError, RecursionError) as exc:
        return None, f"undecodable answer: {exc}"
    has_result = len(answer.result) > 0
    if has_result == (answer.error is not None):
        return None, "an answer must carry exactly one of result and error"
    if answer.error is None:
        return answer, "result"
    if answer.error.code not in ERROR_CODES:
        return None, f"unknown error code {answer.error.code!r}"
    if answer.id < 0:
        return None, f"negative id {answer.id}"
    return answer, answer.error.code


# --- the session driver --------------------------------------------------------------


@dataclass
class Finding:
    """An oracle failure, a known-bug sample, or a crash suspect, with what was sent."""

    what: str  # hang, bad_answer, unanswered, unclean_close, internal, crash_suspect, ...
    detail: str
    data: bytes = b""
    kind: str = ""


@dataclass
class Stats:
    inputs: int = 0
    sessions: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    kinds: Counter[str] = field(default_factory=Counter)
    by_kind: Counter[tuple[str, str]] = field(default_factory=Counter)
    internal_known: Counter[str] = field(default_factory=Counter)
    failures: Counter[str] = field(default_factory=Counter)
    findings: list[Finding] = field(default_factory=list)  # failures and samples
    suspects: list[Finding] = field(default_factory=list)  # what was in flight at a crash
    deaths_seen: int = 0
    cpu: float = 0.0  # the client's CPU seconds
    max_findings: int = 60
    max_suspects: int = 200

    def add(self, kind: str, outcome: str) -> None:
        self.inputs += 1
        self.outcomes[outcome] += 1
        self.kinds[kind] += 1
        self.by_kind[kind, outcome] += 1

    def fail(self, finding: Finding) -> None:
        self.failures[finding.what] += 1
        if len(self.findings) < self.max_findings:
            self.findings.append(finding)

    def merge(self, other: Stats) -> None:
        self.inputs += other.inputs
        self.sessions += other.sessions
        self.outcomes.update(other.outcomes)
        self.kinds.update(other.kinds)
        self.by_kind.update(other.by_kind)
        self.internal_known.update(other.internal_known)
        self.failures.update(other.failures)
        self.deaths_seen += other.deaths_seen
        self.cpu += other.cpu
        self.findings.extend(other.findings[: max(self.max_findings - len(self.findings), 0)])
        self.suspects.extend(other.suspects[: max(self.max_suspects - len(self.suspects), 0)])


class Closed(Exception):
    def __init__(self, how: str) -> None:
        super().__init__(how)
        self.how = how  # eof, reset, eof_mid_frame, oversized_answer


_SHUT_WR = object()


class Conn:
    """One connection: queue bytes to write, read answer frames (each read times out).

    Writing runs in its own task on the raw socket, so a write the daemon refuses
    (it closed after a bad frame while we were still sending) never stops us from
    reading the answers it sent before closing.
    """

    def __init__(self, sock: socket.socket, timeout: float) -> None:
        self.sock = sock
        self.loop = asyncio.get_running_loop()
        self.timeout = timeout
        self.decoder = FrameDecoder(MAX_FRAME + RESPONSE_SLACK)
        self.pending: deque[bytes] = deque()
        self._outbox: deque[Any] = deque()
        self._writer: asyncio.Task[None] | None = None
        self.write_error: OSError | None = None

    @classmethod
    async def open(cls, path: str, timeout: float) -> Conn:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await asyncio.wait_for(asyncio.get_running_loop().sock_connect(sock, path), timeout)
        except BaseException:
            sock.close()
            raise
        return cls(sock, timeout)

    def send(self, data: bytes) -> None:
        self._outbox.append(data)
        if self._writer is None or self._writer.done():
            self._writer = self.loop.create_task(self._write())

    def half_close(self) -> None:
        self.send(_SHUT_WR)  # type: ignore[arg-type]

    async def _write(self) -> None:
        while self._outbox:
            item = self._outbox.popleft()
            try:
                if item is _SHUT_WR:
                    self.sock.shutdown(socket.SHUT_WR)
                else:
                    await self.loop.sock_sendall(self.sock, item)
            except OSError as exc:  # the daemon closed: what it said is still readable
                self.write_error = exc
                self._outbox.clear()
                return

    async def next_payload(self) -> bytes:
        """The next answer frame; ``Closed`` at EOF/reset; ``TimeoutError`` if none comes."""
        while not self.pending:
            try:
                data = await asyncio.wait_for(self.loop.sock_recv(self.sock, 1 << 18), self.timeout)
            except (ConnectionResetError, BrokenPipeError):
                raise Closed("reset") from None
            if not data:
                raise Closed("eof_mid_frame" if self.decoder.in_frame else "eof")
            self.pending.extend(self.decoder.feed(data))
            if self.decoder.error is not None:
                raise Closed("oversized_answer")
        return self.pending.popleft()

    async def flush(self) -> None:
        """Wait until everything queued is written (or the write failed)."""
        if self._writer is not None:
            await asyncio.wait_for(asyncio.shield(self._writer), self.timeout)

    def close(self) -> None:
        if self._writer is not None and not self._writer.done():
            self._writer.cancel()
        self.sock.close()


DaemonDied = Callable[[], Awaitable[bool]]


class Driver:
    """Runs fuzz sessions (one connection each) against the daemon at ``path``.

    ``daemon_died`` is awaited only when a connection is lost where the protocol does
    not allow it: True means the daemon process died (a crash; what was in flight is
    kept as suspects), False that the daemon dropped a connection while alive (a bug).
    """

    def __init__(
        self,
        path: str,
        gen: Generator,
        stats: Stats,
        *,
        daemon_died: DaemonDied,
        timeout: float = 30.0,
        max_batch: int = 64,
        max_batches: int = 12,
    ) -> None:
        self.path = path
        self.gen = gen
        self.stats = stats
        self.daemon_died = daemon_died
        self.timeout = timeout
        self.max_batch = max_batch
        self.max_batches = max_batches
        # sessions that ended without a word from the daemon (a truncated frame, an
        # abort): a crash they caused is only noticed by other connections
        self.recent_silent: deque[tuple[float, bytes, str]] = deque(maxlen=32)

    async def session(self, budget: int) -> int:
        """One connection's worth of inputs (about ``budget``); returns how many."""
        before = self.stats.inputs
        try:
            conn = await Conn.open(self.path, self.timeout)
        except (OSError, TimeoutError) as exc:
            if not await self.daemon_died():
                self.stats.fail(Finding("connect", repr(exc)))
            return 0
        self.stats.sessions += 1
        session = _Session(self, conn)
        try:
            await session.run(budget)
        except TimeoutError:
            self.stats.fail(
                Finding("hang", f"no answer or close within {self.timeout}s", session.tail())
            )
        except OSError as exc:  # writing to a connection the daemon dropped
            await session.lost(repr(exc), "unexpected_close", "write")
        finally:
            session.conn.close()
        return self.stats.inputs - before

    def note_silent(self, data: bytes, kind: str) -> None:
        self.recent_silent.append((time.monotonic(), data, kind))

    def crashed(self, data: bytes, detail: str, kind: str) -> None:
        stats = self.stats
        stats.deaths_seen += 1
        room = stats.max_suspects - len(stats.suspects)
        if room > 0:
            stats.suspects.append(Finding("crash_suspect", detail, data, kind))
        now = time.monotonic()
        while self.recent_silent and room > 1:
            at, silent, silent_kind = self.recent_silent.popleft()
            if now - at < 5.0:
                stats.suspects.append(
                    Finding("crash_suspect", "closed silently just before", silent, silent_kind)
                )
                room -= 1


class _Session:
    def __init__(self, driver: Driver, conn: Conn) -> None:
        self.d = driver
        self.gen = driver.gen
        self.stats = driver.stats
        self.conn = conn
        self.sent: list[bytes] = []
        # request ids: large and random, so a mutated frame from another session (which
        # carries that session's ids) never answers under one of ours
        self.next_id = self.gen.rng.randint(2**40, 2**52)

    def send(self, data: bytes) -> None:
        self.sent.append(data)
        self.conn.send(data)

    def tail(self, limit: int = 8192) -> bytes:
        return b"".join(self.sent)[-limit:]

    async def lost(self, how: str, what: str, kind: str) -> None:
        if await self.d.daemon_died():
            self.d.crashed(b"".join(self.sent), f"connection {how} during {kind}", kind)
        else:
            self.stats.fail(Finding(what, f"connection {how} during {kind}", self.tail(), kind))

    def bad(self, detail: str, data: bytes, kind: str) -> None:
        self.stats.fail(Finding("bad_answer", detail, data[:8192], kind))

    def check_internal(self, answer: Answer, data: bytes, kind: str) -> None:
        if answer.error is None or answer.error.code != "internal":
            return
        message = answer.error.message
        bug = known_bug(message)
        if bug is None:
            self.stats.fail(Finding("internal", message[:500], data[:65536], kind))
            return
        self.stats.internal_known[bug] += 1
        if self.stats.internal_known[bug] <= 2 and len(self.stats.findings) < 60:
            self.stats.findings.append(Finding("known:" + bug, message[:300], data[:4096], kind))

    def batch(self, n: int) -> tuple[list[Request], Terminal | None]:
        """Up to ``n`` inputs: requests, and at most one terminal input, which ends it."""
        requests: list[Request] = []
        for _ in range(n):
            item = self.gen.request(self.next_id)
            self.next_id += 1
            if isinstance(item, Terminal):
                return requests, item
            requests.append(item)
        return requests, None

    async def run(self, budget: int) -> None:
        r = self.gen.rng
        if r.random() < self.gen.prehello_rate:
            if not await self.first_frame():
                return
            budget -= 1
        else:
            requests: list[Request] = []
            terminal = None
            if r.random() < 0.3:  # hello and a first batch in one write
                requests, terminal = self.batch(min(budget, r.randint(1, self.d.max_batch)))
                budget -= len(requests) + (terminal is not None)
            tail = terminal.data if terminal is not None and not terminal.abort else b""
            self.send(self.gen.hello() + b"".join(x.data for x in requests) + tail)
            try:
                payload = await self.conn.next_payload()
            except Closed as closed:
                await self.lost(closed.how, "unexpected_close", "hello")
                return
            answer, outcome = judge(payload)
            if answer is None or answer.error is not None or answer.id != 1:
                self.bad(f"hello answered {outcome}: {payload[:300]!r}", self.tail(), "hello")
                return
            if (requests or terminal) and not await self.exchange(requests, terminal, sent=True):
                return
        for _ in range(r.randint(1, self.d.max_batches)):
            if budget <= 0:
                break
            requests, terminal = self.batch(min(budget, r.randint(1, self.d.max_batch)))
            budget -= len(requests) + (terminal is not None)
            if not await self.exchange(requests, terminal):
                return
        if r.random() < 0.5:  # a clean end: half-close; the daemon must close too
            self.conn.half_close()
            await self.drain_to_eof("end")

    async def first_frame(self) -> bool:
        """A connection's first input is not a plain hello; True if it opened anyway."""
        attempt = self.gen.hello_attempt()
        if isinstance(attempt, Terminal):
            await self.exchange([], attempt)
            return False
        self.send(attempt.data)
        try:
            payload = await self.conn.next_payload()
        except Closed as closed:
            self.stats.add(attempt.kind, "lost")
            await self.lost(closed.how, "unexpected_close", attempt.kind)
            return False
        answer, outcome = judge(payload)
        if answer is None:
            self.bad(outcome + f": {payload[:300]!r}", attempt.data, attempt.kind)
            return False
        self.stats.add(attempt.kind, outcome)
        self.check_internal(answer, attempt.data, attempt.kind)
        if answer.id != attempt.request_id:
            self.bad(
                f"answer id {answer.id} for id {attempt.request_id}", attempt.data, attempt.kind
            )
        if answer.error is None:
            return True
        if answer.error.code not in CLOSING_CODES:
            self.bad(f"first request refused with {outcome}", attempt.data, attempt.kind)
        await self.drain_to_eof(attempt.kind)  # a refused first request closes the connection
        return False

    async def exchange(
        self, requests: list[Request], terminal: Terminal | None, *, sent: bool = False
    ) -> bool:
        """Send a pipelined batch (with the terminal input last), collect every answer by
        id; True if the connection stays open."""
        closing = terminal is not None and not terminal.abort
        if not sent:
            self.send(b"".join(x.data for x in requests) + (terminal.data if closing else b""))
        if closing:
            self.conn.half_close()  # the answers to what was sent must still all come
        outstanding = {x.request_id: x for x in requests}
        terminal_outcome: str | None = None
        try:
            while outstanding:
                payload = await self.conn.next_payload()
                answer, outcome = judge(payload)
                if answer is None:
                    self.bad(outcome + f": {payload[:300]!r}", self.tail(), "batch")
                    return False
                request = outstanding.pop(answer.id, None)
                if request is None:
                    if closing:  # the terminal input's answer overtook a request's
                        assert terminal is not None
                        self.check_internal(answer, terminal.data, terminal.kind)
                        terminal_outcome = _merge(terminal_outcome, outcome)
                        continue
                    self.bad(f"answer for unknown id {answer.id}", self.tail(), "batch")
                    return False
                if outcome == "bad_frame" and closing:
                    # The terminal input's refusal carries its readable id, which a
                    # mutated copy of a request shares: the request's own answer is
                    # still to come.
                    assert terminal is not None
                    outstanding[answer.id] = request
                    self.check_internal(answer, terminal.data, terminal.kind)
                    terminal_outcome = _merge(terminal_outcome, outcome)
                    continue
                self.stats.add(request.kind, outcome)
                self.check_internal(answer, request.data, request.kind)
                if outcome in ("bad_frame", "frame_too_large"):
                    self.bad(
                        f"a well-framed request answered {outcome}", request.data, request.kind
                    )
        except Closed as closed:
            for request in outstanding.values():
                self.stats.add(request.kind, "lost")
            if terminal is not None:
                self.stats.add(terminal.kind, "lost")
            await self.lost(closed.how, "unanswered", f"{len(outstanding)} outstanding requests")
            return False
        if terminal is None:
            return True
        if terminal.abort:  # vanish in the middle of it
            self.send(terminal.data)
            await self.conn.flush()
            self.conn.close()
            self.stats.add(terminal.kind, "abort")
            self.d.note_silent(b"".join(self.sent), terminal.kind)
            return False
        while True:  # what is left: answers to the terminal input, then the close
            try:
                payload = await self.conn.next_payload()
            except Closed as closed:
                if closed.how not in ("eof", "reset"):
                    await self.lost(closed.how, "unclean_close", terminal.kind)
                    terminal_outcome = terminal_outcome or closed.how
                elif terminal_outcome is None:
                    terminal_outcome = "close" if closed.how == "eof" else "reset"
                    self.d.note_silent(b"".join(self.sent), terminal.kind)
                break
            answer, outcome = judge(payload)
            if answer is None:
                self.bad(outcome + f": {payload[:300]!r}", terminal.data, terminal.kind)
                terminal_outcome = "bad_answer"
                break
            self.check_internal(answer, terminal.data, terminal.kind)
            terminal_outcome = _merge(terminal_outcome, outcome)
        self.stats.add(terminal.kind, terminal_outcome)
        return False

    async def drain_to_eof(self, kind: str) -> None:
        """After a refusal or a half-close: anything left must be well-formed, then EOF."""
        while True:
            try:
                payload = await self.conn.next_payload()
            except Closed as closed:
                if closed.how not in ("eof", "reset"):
                    await self.lost(closed.how, "unclean_close", kind)
                return
            answer, outcome = judge(payload)
            if answer is None:
                self.bad(outcome, self.tail(), kind)
                return
            self.bad(f"an answer ({outcome}, id {answer.id}) after the end", self.tail(), kind)


def _merge(current: str | None, outcome: str) -> str:
    """A terminal input's outcome: its first error code, else result."""
    if current is None or (current == "result" and outcome != "result"):
        return outcome
    return current
