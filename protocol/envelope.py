"""The request/response envelope, shared by the daemon and both clients.

Request  ``{"id": int, "method": str, "params": map}``
Response ``{"id": int, "result": any}`` or
         ``{"id": int, "error": {"code": str, "message": str, "data": map?}}``

Pushed   ``{"event": topic, "seq": int, "data": any}`` (no id), on a connection
         that sent ``watch``: one per committed change, ``seq`` +1 each time.

Ids are chosen by the client and must be >= 1; id 0 is reserved for errors
about a frame whose id could not be read. Unknown envelope fields are
ignored, so the envelope can grow without breaking older peers.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from towerd.protocol import lite
from towerd.protocol.errors import BadFrame, Internal, TowerdError
from towerd.protocol.framing import DEFAULT_MAX_FRAME, FRAME_ERROR_ID, encode_frame

MAX_REQUEST_ID = 2**63 - 1
EMPTY_MAP = msgspec.Raw(b"\x80")


class MalformedRequest(BadFrame):
    """A frame that is not a request envelope; ``request_id`` is 0 unless readable."""

    def __init__(self, message: str, request_id: int = FRAME_ERROR_ID) -> None:
        super().__init__(message)
        self.request_id = request_id


class Request(msgspec.Struct):
    """A decoded request; ``params`` stays raw until the method's type is known."""

    id: Annotated[int, msgspec.Meta(ge=1, le=MAX_REQUEST_ID)]
    method: str
    params: msgspec.Raw = EMPTY_MAP


class ErrorBody(msgspec.Struct, omit_defaults=True):
    code: str
    message: str
    data: dict[str, Any] | None = None


class Response(msgspec.Struct):
    id: int
    result: Any


class ErrorResponse(msgspec.Struct):
    id: int
    error: ErrorBody


_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Request)
_any_decoder = msgspec.msgpack.Decoder()


def decode_request(payload: bytes) -> Request:
    """Decode one request frame, or raise ``MalformedRequest`` (id kept if readable)."""
    try:
        return _request_decoder.decode(payload)
    except msgspec.ValidationError as exc:
        raise MalformedRequest(f"malformed request: {exc}", _readable_id(payload)) from None
    except msgspec.DecodeError as exc:
        raise MalformedRequest(f"malformed request frame: {exc}") from None
    except RecursionError:
        raise MalformedRequest(
            "request frame nested too deeply to decode", _peek_id(payload)
        ) from None


def _readable_id(payload: bytes) -> int:
    """The request id of a frame that is not a valid request, or 0 if it has none."""
    try:
        value = _any_decoder.decode(payload)
    except (msgspec.DecodeError, RecursionError):
        return _peek_id(payload)  # e.g. params nested too deeply to decode
    if isinstance(value, dict):
        request_id = value.get("id")
        if type(request_id) is int and 1 <= request_id <= MAX_REQUEST_ID:
            return request_id
    return FRAME_ERROR_ID


# msgpack type byte -> bytes that follow it (nil, bool, numbers, fixext)
_FIXED = {
    0xC0: 0, 0xC2: 0, 0xC3: 0, 0xCA: 4, 0xCB: 8, 0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8,
    0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8, 0xD4: 2, 0xD5: 3, 0xD6: 5, 0xD7: 9, 0xD8: 17,
}  # fmt: skip
# type byte -> width of the length field (bin, str, ext)
_SIZED = {0xC4: 1, 0xC5: 2, 0xC6: 4, 0xD9: 1, 0xDA: 2, 0xDB: 4, 0xC7: 1, 0xC8: 2, 0xC9: 4}
# type byte -> (width of the count field, values per counted item) for array16/32, map16/32
_CONTAINER = {0xDC: (2, 1), 0xDD: (4, 1), 0xDE: (2, 2), 0xDF: (4, 2)}


def _peek_id(payload: bytes) -> int:
    """Find a top-level ``id`` in a msgpack map without decoding nested values.

    Skips values with a counter instead of recursion, so any nesting depth is
    fine; returns 0 for anything that is not a map with a valid id.
    """
    view = memoryview(payload)
    try:
        first = view[0]
        if 0x80 <= first <= 0x8F:
            pairs, at = first & 0x0F, 1
        elif first in (0xDE, 0xDF):
            width = 2 if first == 0xDE else 4
            pairs, at = int.from_bytes(view[1 : 1 + width], "big"), 1 + width
        else:
            return FRAME_ERROR_ID
        for _ in range(pairs):
            key_start = at
            at = _skip(view, at)
            if bytes(view[key_start:at]) == b"\xa2id":
                value = view[at]
                if value <= 0x7F:
                    request_id = value
                elif value in (0xCC, 0xCD, 0xCE, 0xCF):
                    width = _FIXED[value]
                    request_id = int.from_bytes(view[at + 1 : at + 1 + width], "big")
                else:
                    return FRAME_ERROR_ID
                return request_id if 1 <= request_id <= MAX_REQUEST_ID else FRAME_ERROR_ID
            at = _skip(view, at)
    except (IndexError, KeyError):
        pass
    return FRAME_ERROR_ID


def _skip(view: memoryview, at: int) -> int:
    """Offset just past the msgpack value starting at ``at`` (iterative)."""
    pending = 1
    while pending:
        pending -= 1
        kind = view[at]
        if kind <= 0x7F or kind >= 0xE0:  # positive / negative fixint
            at += 1
        elif kind <= 0x8F:  # fixmap
            pending += 2 * (kind & 0x0F)
            at += 1
        elif kind <= 0x9F:  # fixarray
            pending += kind & 0x0F
            at += 1
        elif kind <= 0xBF:  # fixstr
            at += 1 + (kind & 0x1F)
        elif kind in _FIXED:
            at += 1 + _FIXED[kind]
        elif kind in _SIZED:
            width = _SIZED[kind]
            size = int.from_bytes(view[at + 1 : at + 1 + width], "big")
            at += 1 + width + size + (1 if kind in (0xC7, 0xC8, 0xC9) else 0)
        else:
            width, per_item = _CONTAINER[kind]  # KeyError for 0xC1, the never-used byte
            pending += per_item * int.from_bytes(view[at + 1 : at + 1 + width], "big")
            at += 1 + width
        if at > len(view):
            raise IndexError("truncated")
    return at


def encode_result(request_id: int, result: Any) -> bytes:
    """A whole frame (prefix included) answering ``request_id`` with ``result``."""
    return encode_frame(_encoder.encode(Response(request_id, result)))


def encode_error(request_id: int, error: TowerdError) -> bytes:
    """A whole frame answering ``request_id`` with ``error``."""
    body = ErrorBody(error.code, error.message, error.data)
    return encode_frame(_encoder.encode(ErrorResponse(request_id, body)))


class Push(msgspec.Struct):
    event: str
    seq: int
    data: msgspec.Raw


def encode_data(data: Any) -> msgspec.Raw:
    """Encode a change once, however many watchers it goes to."""
    return msgspec.Raw(_encoder.encode(data))


def encode_push(topic: str, seq: int, data: msgspec.Raw) -> bytes:
    """A whole pushed frame (no id) carrying an already encoded change."""
    return encode_frame(_encoder.encode(Push(topic, seq, data)))


def decode_frame(payload: bytes) -> Any:
    """``lite.decode_frame`` with msgspec's decoder."""
    try:
        return _any_decoder.decode(payload)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise Internal(f"daemon sent a malformed frame: {exc}") from None


def encode_request(
    request_id: int, method: str, params: dict[str, Any], max_frame: int = DEFAULT_MAX_FRAME
) -> bytes:
    """A whole request frame encoded with msgspec (see ``lite.encode_request``)."""
    return lite.encode_request(request_id, method, params, max_frame, _encoder.encode)


def decode_response(payload: bytes) -> tuple[int, Any, TowerdError | None]:
    """``lite.decode_response`` with msgspec's decoder, for clients that have it loaded."""
    try:
        value = _any_decoder.decode(payload)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise Internal(f"daemon sent a malformed frame: {exc}") from None
    return lite.response_parts(value)
