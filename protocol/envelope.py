"""The request/response envelope, shared by the daemon and both clients.

Request  ``{"id": int, "method": str, "params": map}``
Response ``{"id": int, "result": any}`` or
         ``{"id": int, "error": {"code": str, "message": str, "data": map?}}``

Ids are chosen by the client and must be >= 1; id 0 is reserved for errors
about a frame whose id could not be read. Unknown envelope fields are
ignored, so the envelope can grow without breaking older peers.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from towerd.protocol.errors import BadFrame, FrameTooLarge, Internal, TowerdError, error_for_code
from towerd.protocol.framing import DEFAULT_MAX_FRAME, encode_frame

FRAME_ERROR_ID = 0
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
        raise MalformedRequest("request frame nested too deeply to decode") from None


def _readable_id(payload: bytes) -> int:
    try:
        value = _any_decoder.decode(payload)
    except (msgspec.DecodeError, RecursionError):
        return FRAME_ERROR_ID
    if isinstance(value, dict):
        request_id = value.get("id")
        if type(request_id) is int and 1 <= request_id <= MAX_REQUEST_ID:
            return request_id
    return FRAME_ERROR_ID


def encode_result(request_id: int, result: Any) -> bytes:
    """A whole frame (prefix included) answering ``request_id`` with ``result``."""
    return encode_frame(_encoder.encode(Response(request_id, result)))


def encode_error(request_id: int, error: TowerdError) -> bytes:
    """A whole frame answering ``request_id`` with ``error``."""
    body = ErrorBody(error.code, error.message, error.data)
    return encode_frame(_encoder.encode(ErrorResponse(request_id, body)))


def encode_request(
    request_id: int, method: str, params: dict[str, Any], max_frame: int = DEFAULT_MAX_FRAME
) -> bytes:
    """A whole request frame, as clients send it; ``FrameTooLarge`` if the daemon would
    refuse it (so nothing is sent, and the caller knows nothing was applied)."""
    payload = _encoder.encode({"id": request_id, "method": method, "params": params})
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
        value = _any_decoder.decode(payload)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise Internal(f"daemon sent a malformed frame: {exc}") from None
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
