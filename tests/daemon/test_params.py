"""A request's params that do not decode as its method's are answered ``bad_args``,
each way they can fail named in the message (daemon/server.py ``decode_params``, the
mapping the connection's own fast path shares)."""

from __future__ import annotations

import msgspec
import pytest

from towerd.daemon.server import bad_params, decode_params
from towerd.protocol.envelope import Request
from towerd.protocol.errors import BadArgs


def params_of(raw: bytes) -> BadArgs:
    with pytest.raises(BadArgs) as refused:
        decode_params("idem.get", Request(2, "idem.get", msgspec.Raw(raw)))
    return refused.value


def test_a_field_of_the_wrong_type_is_invalid_and_names_its_path() -> None:
    error = params_of(msgspec.msgpack.encode({"operation": 1, "key": "k"}))
    assert error.code == "bad_args"
    assert error.message.startswith("invalid params for idem.get:")
    assert "$.operation" in error.message


def test_bytes_that_are_not_msgpack_of_the_type_are_undecodable() -> None:
    # a map whose "operation" is a str of invalid UTF-8: well-formed msgpack framing
    error = params_of(b"\x82\xa9operation\xa2\xff\xfe\xa3key\xa1k")
    assert error.message.startswith("undecodable params for idem.get:")
    assert "UTF-8" in error.message


def test_too_deep_params_say_so() -> None:
    error = bad_params("idem.get", RecursionError())
    assert error.code == "bad_args"
    assert error.message == "params for idem.get are nested too deeply to decode"
