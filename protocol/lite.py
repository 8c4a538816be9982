"""The client side of the wire in the standard library only: msgpack and the envelope.

Hooks start a process for every agent event, and their budget is a few
milliseconds over a bare socket exchange. msgspec costs about 40 ms to import
here and the msgpack package about 7; this module costs well under one, so the
blocking client and ``towerctl`` use it. The daemon keeps msgspec, which
validates every message at the boundary. Both speak the same msgpack; the tests
check that they agree on every value either can produce.

Supported: nil, bool, int (-2^63 .. 2^64-1), float, str, bin, array, map.
Extension types are not used by the protocol and are refused.
"""

from __future__ import annotations

import struct

from towerd.protocol.errors import FrameTooLarge, Internal, TowerdError, error_for_code
from towerd.protocol.framing import DEFAULT_MAX_FRAME, encode_frame

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs hooks ~3 ms
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

_pack_into = struct.pack
_unpack_from = struct.unpack_from


# Deeper than anything the daemon sends (free-form values nest at most 100 levels),
# shallow enough to stay far from Python's recursion limit (two frames per level).
MAX_DEPTH = 256


class MsgpackError(ValueError):
    """Bytes that are not msgpack this codec reads, or a value it cannot write."""


# --- encoding ---------------------------------------------------------------------------


def packb(value: Any) -> bytes:
    out = bytearray()
    _pack(value, out, 0)
    return bytes(out)


def _pack_size(
    out: bytearray,
    size: int,
    fixed: int | None,
    fixed_below: int,
    code8: int | None,
    code16: int,
    code32: int,
) -> None:
    """The header of a str, bin, array or map of ``size``: the size in the type byte
    (``fixed | size``) when below ``fixed_below``, else the smallest code that holds it."""
    if fixed is not None and size < fixed_below:
        out.append(fixed | size)
    elif code8 is not None and size < 0x100:
        out += _pack_into(">BB", code8, size)
    elif size < 0x10000:
        out += _pack_into(">BH", code16, size)
    else:
        out += _pack_into(">BI", code32, size)


def _pack(value: Any, out: bytearray, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise MsgpackError("value nested too deeply")
    if value is None:
        out.append(0xC0)
    elif value is True:
        out.append(0xC3)
    elif value is False:
        out.append(0xC2)
    elif type(value) is int:
        _pack_int(value, out)
    elif type(value) is str:
        data = value.encode("utf-8")
        _pack_size(out, len(data), 0xA0, 32, 0xD9, 0xDA, 0xDB)
        out += data
    elif isinstance(value, dict):
        _pack_size(out, len(value), 0x80, 16, None, 0xDE, 0xDF)
        for key, item in value.items():
            _pack(key, out, depth + 1)
            _pack(item, out, depth + 1)
    elif isinstance(value, list | tuple):
        _pack_size(out, len(value), 0x90, 16, None, 0xDC, 0xDD)
        for item in value:
            _pack(item, out, depth + 1)
    elif type(value) is float:
        out += _pack_into(">Bd", 0xCB, value)
    elif isinstance(value, bytes | bytearray | memoryview):
        data = bytes(value)
        _pack_size(out, len(data), None, 0, 0xC4, 0xC5, 0xC6)
        out += data
    elif isinstance(value, int):  # bool and int subclasses (IntEnum) land here
        _pack_int(int(value), out)
    elif isinstance(value, str):
        _pack(str(value), out, depth)
    elif isinstance(value, float):
        _pack(float(value), out, depth)
    else:
        raise MsgpackError(f"cannot encode a {type(value).__name__} as msgpack")


def _pack_int(value: int, out: bytearray) -> None:
    if 0 <= value < 0x80:
        out.append(value)
    elif -32 <= value < 0:
        out.append(value & 0xFF)
    elif value >= 0:
        if value < 0x100:
            out += _pack_into(">BB", 0xCC, value)
        elif value < 0x10000:
            out += _pack_into(">BH", 0xCD, value)
        elif value < 0x100000000:
            out += _pack_into(">BI", 0xCE, value)
        elif value < 0x10000000000000000:
            out += _pack_into(">BQ", 0xCF, value)
        else:
            raise MsgpackError(f"integer {value} does not fit in 64 bits")
    elif value >= -0x80:
        out += _pack_into(">Bb", 0xD0, value)
    elif value >= -0x8000:
        out += _pack_into(">Bh", 0xD1, value)
    elif value >= -0x80000000:
        out += _pack_into(">Bi", 0xD2, value)
    elif value >= -0x8000000000000000:
        out += _pack_into(">Bq", 0xD3, value)
    else:
        raise MsgpackError(f"integer {value} does not fit in 64 bits")


# --- decoding ----------------------------------------------------------------------------

# type byte -> (struct format, size) for fixed-width scalars
_SCALARS = {
    0xCA: (">f", 4), 0xCB: (">d", 8),
    0xCC: (">B", 1), 0xCD: (">H", 2), 0xCE: (">I", 4), 0xCF: (">Q", 8),
    0xD0: (">b", 1), 0xD1: (">h", 2), 0xD2: (">i", 4), 0xD3: (">q", 8),
}  # fmt: skip
# type byte -> (struct format of the length, its size, "str" | "bin" | "array" | "map")
_SIZED = {
    0xD9: (">B", 1, "str"), 0xDA: (">H", 2, "str"), 0xDB: (">I", 4, "str"),
    0xC4: (">B", 1, "bin"), 0xC5: (">H", 2, "bin"), 0xC6: (">I", 4, "bin"),
    0xDC: (">H", 2, "array"), 0xDD: (">I", 4, "array"),
    0xDE: (">H", 2, "map"), 0xDF: (">I", 4, "map"),
}  # fmt: skip


def unpackb(data: bytes) -> Any:
    """Decode exactly one msgpack value filling ``data``."""
    try:
        value, end = _unpack(memoryview(data), 0, 0)
    except (IndexError, struct.error):
        raise MsgpackError("truncated msgpack data") from None
    if end != len(data):
        raise MsgpackError(f"{len(data) - end} bytes of trailing data")
    return value


def _unpack(view: memoryview, at: int, depth: int) -> tuple[Any, int]:
    if depth > MAX_DEPTH:
        raise MsgpackError("msgpack data nested too deeply")
    kind = view[at]
    at += 1
    if kind <= 0x7F:
        return kind, at
    if kind >= 0xE0:
        return kind - 0x100, at
    if kind <= 0x8F:
        return _unpack_map(view, at, kind & 0x0F, depth)
    if kind <= 0x9F:
        return _unpack_array(view, at, kind & 0x0F, depth)
    if kind <= 0xBF:
        end = at + (kind & 0x1F)
        return _text(view, at, end), end
    if kind == 0xC0:
        return None, at
    if kind == 0xC2:
        return False, at
    if kind == 0xC3:
        return True, at
    scalar = _SCALARS.get(kind)
    if scalar is not None:
        fmt, size = scalar
        return _unpack_from(fmt, view, at)[0], at + size
    sized = _SIZED.get(kind)
    if sized is None:
        raise MsgpackError(f"unsupported msgpack type byte 0x{kind:02x}")
    fmt, size, what = sized
    length = _unpack_from(fmt, view, at)[0]
    at += size
    if what == "str":
        return _text(view, at, at + length), at + length
    if what == "bin":
        if at + length > len(view):
            raise IndexError("truncated")
        return bytes(view[at : at + length]), at + length
    if what == "array":
        return _unpack_array(view, at, length, depth)
    return _unpack_map(view, at, length, depth)


def _text(view: memoryview, start: int, end: int) -> str:
    if end > len(view):
        raise IndexError("truncated")
    try:
        return str(view[start:end], "utf-8")
    except UnicodeDecodeError:
        raise MsgpackError("invalid UTF-8 in a msgpack string") from None


def _unpack_array(view: memoryview, at: int, count: int, depth: int) -> tuple[list[Any], int]:
    items = []
    for _ in range(count):
        item, at = _unpack(view, at, depth + 1)
        items.append(item)
    return items, at


def _unpack_map(view: memoryview, at: int, count: int, depth: int) -> tuple[dict[Any, Any], int]:
    mapping = {}
    for _ in range(count):
        key, at = _unpack(view, at, depth + 1)
        value, at = _unpack(view, at, depth + 1)
        if isinstance(key, list | dict):
            key = _frozen(key)  # a map as a key is refused, as msgspec refuses it
        mapping[key] = value
    return mapping, at


def _frozen(value: Any) -> Any:
    """An array used as a map key, made hashable (as msgspec does: a tuple)."""
    if isinstance(value, list):
        return tuple(_frozen(item) for item in value)
    if isinstance(value, dict):
        raise MsgpackError("a map cannot be a map key here")
    return value


# --- the client's envelope -------------------------------------------------------------


def encode_request(
    request_id: int,
    method: str,
    params: dict[str, Any],
    max_frame: int = DEFAULT_MAX_FRAME,
    pack: Callable[[Any], bytes] = packb,
) -> bytes:
    """A whole request frame; ``FrameTooLarge`` (nothing sent) if the daemon would refuse it."""
    payload = pack({"id": request_id, "method": method, "params": params})
    if len(payload) > max_frame:
        raise FrameTooLarge(
            f"the {method} request is {len(payload)} bytes, over the daemon's frame limit of "
            f"{max_frame} bytes; nothing was sent",
            {"length": len(payload), "limit": max_frame},
        )
    return encode_frame(payload)


def decode_response(payload: bytes) -> tuple[int, Any, TowerdError | None]:
    """Split a response frame into ``(id, result, error)``; exactly one of the last two is set."""
    try:
        value = unpackb(payload)
    except MsgpackError as exc:
        raise Internal(f"daemon sent a malformed frame: {exc}") from None
    return response_parts(value)


def is_push(value: Any) -> bool:
    """A frame a ``watch`` subscription pushes: ``{"event", "seq", "data"}``, no id."""
    return isinstance(value, dict) and "event" in value and "id" not in value


def decode_frame(payload: bytes) -> Any:
    """Any daemon frame decoded (a response or a pushed event)."""
    try:
        return unpackb(payload)
    except MsgpackError as exc:
        raise Internal(f"daemon sent a malformed frame: {exc}") from None


def response_parts(value: Any) -> tuple[int, Any, TowerdError | None]:
    """``(id, result, error)`` of a decoded response (whichever codec decoded it)."""
    if not isinstance(value, dict) or type(value.get("id")) is not int:
        raise Internal(f"daemon sent a frame that is not a response: {value!r:.200}")
    error = value.get("error")
    if error is None:
        return value["id"], value.get("result"), None
    if not isinstance(error, dict):
        return value["id"], None, Internal(f"malformed error body: {error!r:.200}")
    data = error.get("data")
    return (
        value["id"],
        None,
        error_for_code(
            str(error.get("code", "internal")),
            str(error.get("message", "")),
            data if isinstance(data, dict) else None,
        ),
    )
