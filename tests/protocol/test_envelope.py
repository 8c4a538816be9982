"""The request/response envelope: refusals keep
the id when readable, round trips are exact."""

from __future__ import annotations

import msgspec
import pytest

from towerd.protocol.envelope import (
    FRAME_ERROR_ID,
    MAX_REQUEST_ID,
    MalformedRequest,
    decode_request,
    decode_response,
    encode_error,
    encode_request,
    encode_result,
)
from towerd.protocol.errors import (
    ERROR_CODES,
    BadFrame,
    Conflict,
    Internal,
    OutcomeUnknown,
    TowerdError,
    error_for_code,
)
from towerd.protocol.framing import FrameDecoder

pack = msgspec.msgpack.encode


def unframe(frame: bytes) -> bytes:
    """The single payload of a whole frame (checks the prefix matches)."""
    [payload] = FrameDecoder().feed(frame)
    return payload


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",  # a msgpack opcode that is never valid
        b"\xff\xfe garbage",
        b"\x81\xa2id",  # truncated map
        pack([1, "ping", {}]),  # an array, not a map
        pack("ping"),
        pack({"id": 1, "method": "ping"}) + b"\x00",  # trailing bytes
    ],
)
def test_garbage_is_malformed_with_request_id_zero(payload: bytes) -> None:
    """A frame that is not a request map is
    MalformedRequest (a BadFrame) with request_id 0."""
    with pytest.raises(MalformedRequest) as caught:
        decode_request(payload)
    assert caught.value.request_id == FRAME_ERROR_ID == 0
    assert caught.value.code == "bad_frame"
    assert isinstance(caught.value, BadFrame)


def test_map_with_valid_id_but_no_method_keeps_the_id() -> None:
    """The error can be correlated: a readable id is kept on the refusal."""
    with pytest.raises(MalformedRequest) as caught:
        decode_request(pack({"id": 42, "params": {}}))
    assert caught.value.request_id == 42
    assert "method" in caught.value.message


def test_wrong_method_type_keeps_the_id() -> None:
    """A validation failure other than the id
    (method not a string) also keeps the id."""
    with pytest.raises(MalformedRequest) as caught:
        decode_request(pack({"id": 7, "method": 5}))
    assert caught.value.request_id == 7
    assert "$.method" in caught.value.message


@pytest.mark.parametrize("bad_id", [0, -1, -(2**63), 2**63, 2**64 - 1, "5", 1.0, True, None])
def test_invalid_ids_are_refused_with_id_zero(bad_id: object) -> None:
    """Ids must be ints in 1..2^63-1; anything
    else is refused and answered under id 0."""
    with pytest.raises(MalformedRequest) as caught:
        decode_request(pack({"id": bad_id, "method": "ping", "params": {}}))
    assert caught.value.request_id == 0


def test_id_bounds_are_inclusive() -> None:
    """Ids 1 and 2^63-1 are both valid."""
    assert decode_request(pack({"id": 1, "method": "ping"})).id == 1
    assert decode_request(pack({"id": MAX_REQUEST_ID, "method": "ping"})).id == MAX_REQUEST_ID


def test_unknown_envelope_fields_are_ignored() -> None:
    """A newer peer's extra envelope fields do not break decoding."""
    request = decode_request(
        pack(
            {
                "id": 3,
                "trace": {"span": 1},
                "method": "ping",
                "params": {"a": 1},
                "zzz": [1],
            }
        )
    )
    assert (request.id, request.method) == (3, "ping")
    assert msgspec.msgpack.decode(request.params) == {"a": 1}


def test_missing_params_default_to_an_empty_map() -> None:
    """``params`` is optional and then decodes as ``{}``."""
    request = decode_request(pack({"id": 9, "method": "ping"}))
    assert msgspec.msgpack.decode(request.params) == {}


def test_encode_request_round_trips_through_decode_request() -> None:
    """What a client sends is what the daemon reads, params kept raw and exact."""
    params = {"operation": "op", "key": "k", "payload": {"nested": [1, 2, None]}}
    request = decode_request(unframe(encode_request(11, "idem.claim", params)))
    assert (request.id, request.method) == (11, "idem.claim")
    assert msgspec.msgpack.decode(request.params) == params


def test_result_round_trip() -> None:
    """encode_result -> decode_response gives (id, result, None)."""
    result = {"sessions": [{"session_id": "x"}], "next_cursor": None, "n": 2**40}
    assert decode_response(unframe(encode_result(5, result))) == (5, result, None)


def test_none_result_round_trip() -> None:
    """A null result is still a result, not an error."""
    assert decode_response(unframe(encode_result(6, None))) == (6, None, None)


@pytest.mark.parametrize("code", sorted(ERROR_CODES))
def test_every_error_code_round_trips_to_its_class(code: str) -> None:
    """Each known code comes back as the class
    with that code, message and data intact."""
    original = error_for_code(code, f"message for {code}", {"effect_ref": "e-1", "n": 3})
    assert type(original) is not Internal or code == "internal"
    request_id, result, error = decode_response(unframe(encode_error(8, original)))
    assert (request_id, result) == (8, None)
    assert type(error) is type(original)
    assert error.code == code
    assert error.message == f"message for {code}"
    assert error.data == {"effect_ref": "e-1", "n": 3}


def test_error_without_data_round_trips_with_data_none() -> None:
    """An error with no data leaves data out on the wire and comes back as None."""
    raw = unframe(encode_error(2, Conflict("taken")))
    assert "data" not in msgspec.msgpack.decode(raw)["error"]
    _, _, error = decode_response(raw)
    assert isinstance(error, Conflict)
    assert (error.message, error.data) == ("taken", None)


def test_unknown_code_becomes_internal_keeping_message_and_code() -> None:
    """A code from a newer daemon maps to Internal;
    message kept, original code in data['code']."""
    error = error_for_code("from_the_future", "too many sessions", {"limit": 10})
    assert type(error) is Internal
    assert error.code == "internal"
    assert error.message == "too many sessions"
    assert error.data == {"limit": 10, "code": "from_the_future"}


def test_unknown_code_from_the_wire_without_data() -> None:
    """The same mapping applies to an error frame
    decoded by a client, even with no data."""
    raw = pack({"id": 4, "error": {"code": "brand_new", "message": "m"}})
    _, _, error = decode_response(raw)
    assert type(error) is Internal
    assert (error.message, error.data) == ("m", {"code": "brand_new"})


def test_decode_response_refuses_a_non_response() -> None:
    """Garbage from the daemon raises Internal
    rather than being mistaken for a result."""
    with pytest.raises(Internal):
        decode_response(b"\xc1")
    with pytest.raises(Internal):
        decode_response(pack([1, 2]))
    with pytest.raises(Internal):
        decode_response(pack({"id": "1", "result": 1}))


def test_malformed_error_body_is_internal() -> None:
    """An error body that is not a map is reported as Internal under the response id."""
    request_id, result, error = decode_response(pack({"id": 12, "error": "boom"}))
    assert (request_id, result) == (12, None)
    assert isinstance(error, Internal)


def test_towerd_error_to_wire_matches_the_encoded_body() -> None:
    """to_wire() and encode_error agree on the body fields."""
    error: TowerdError = OutcomeUnknown("unknown", {"effect_ref": "r"})
    body = msgspec.msgpack.decode(unframe(encode_error(1, error)))["error"]
    assert (
        body
        == error.to_wire()
        == {
            "code": "outcome_unknown",
            "message": "unknown",
            "data": {"effect_ref": "r"},
        }
    )


def test_request_id_is_read_even_when_params_are_too_deep_to_decode() -> None:
    """The id of a frame too deeply nested to decode is still answered: the envelope
    is scanned without recursion (any depth), whatever the key order."""
    from towerd.protocol.envelope import MalformedRequest, decode_request

    deep = b"\x91" * 100_000 + b"\xc0"
    for payload in (
        b"\x83\xa2id\xcd\x01\x00\xa6method\xa4ping\xa6params" + deep,
        b"\x83\xa6method\xa4ping\xa6params" + deep + b"\xa2id\xcd\x01\x00",
    ):
        with pytest.raises(MalformedRequest) as refused:
            decode_request(payload)
        assert refused.value.request_id == 256
        assert "nested too deeply" in refused.value.message
