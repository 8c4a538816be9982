"""The clients' stdlib msgpack codec agrees with msgspec, the daemon's, on every value."""

from __future__ import annotations

import math

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from towerd.protocol import lite

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=False),
    st.text(),
    st.binary(),
)
values = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=20),
        st.dictionaries(st.one_of(st.text(), st.integers(-1000, 1000)), children, max_size=20),
    ),
    max_leaves=200,
)


@settings(max_examples=400, deadline=None)
@given(values)
def test_lite_and_msgspec_read_each_other(value):
    assert msgspec.msgpack.decode(lite.packb(value)) == value
    assert lite.unpackb(msgspec.msgpack.encode(value)) == value


def test_a_map_as_a_map_key_is_refused():
    """Found by the fuzzer below: {{}: 0} used to raise TypeError (unhashable dict)."""
    with pytest.raises(lite.MsgpackError):
        lite.unpackb(b"\x82\x00\x00\x80\x00")


@given(st.binary(max_size=64))
def test_garbage_is_refused_not_crashed(data):
    try:
        lite.unpackb(data)
    except lite.MsgpackError:
        pass


@pytest.mark.parametrize("size", [0, 15, 16, 31, 32, 255, 256, 65535, 65536])
def test_every_length_encoding(size):
    for value in (
        "x" * size,
        b"x" * size,
        list(range(size % 300)),
        {str(i): i for i in range(size % 300)},
    ):
        assert lite.unpackb(lite.packb(value)) == value
        assert lite.packb(value) == msgspec.msgpack.encode(value)


def test_edges():
    assert lite.unpackb(msgspec.msgpack.encode(math.inf)) == math.inf
    assert lite.unpackb(b"\xca\x3f\x80\x00\x00") == 1.0  # float32
    assert lite.unpackb(b"\x81\x92\x01\x02\x03") == {(1, 2): 3}  # array key, as msgspec does
    for bad in (b"", b"\xc1", b"\xd9\x05ab", b"\xa2\xff\xfe", b"\x01\x02", b"\xd4\x00\x00"):
        with pytest.raises(lite.MsgpackError):
            lite.unpackb(bad)
    with pytest.raises(lite.MsgpackError):
        lite.packb(2**64)
    with pytest.raises(lite.MsgpackError):
        lite.packb(object())
    deep = b"\x91" * 10_000 + b"\xc0"
    with pytest.raises(lite.MsgpackError):
        lite.unpackb(deep)
