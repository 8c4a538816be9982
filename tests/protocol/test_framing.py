"""FrameDecoder / encode_frame: any chunking of
the byte stream gives back exactly the frames."""

from __future__ import annotations

import struct

from hypothesis import given
from hypothesis import strategies as st

from towerd.protocol.framing import (
    DEFAULT_MAX_FRAME,
    PREFIX_SIZE,
    FrameDecoder,
    FrameTooLargeError,
    encode_frame,
)


def feed_all(decoder: FrameDecoder, chunks: list[bytes]) -> list[bytes]:
    frames: list[bytes] = []
    for chunk in chunks:
        frames += decoder.feed(chunk)
    return frames


def test_encode_frame_is_big_endian_length_then_payload() -> None:
    """The wire format is a 4-byte big-endian length followed by the payload bytes."""
    assert encode_frame(b"abc") == b"\x00\x00\x00\x03abc"
    assert encode_frame(b"") == b"\x00\x00\x00\x00"
    assert encode_frame(b"x" * 0x0102) == b"\x00\x00\x01\x02" + b"x" * 0x0102


def test_merged_frames_in_one_chunk_come_back_in_order() -> None:
    """Several frames arriving in one recv() are all
    returned, in order, including empty ones."""
    payloads = [b"first", b"", b"third" * 100]
    decoder = FrameDecoder()
    assert decoder.feed(b"".join(map(encode_frame, payloads))) == payloads
    assert decoder.buffered == 0
    assert not decoder.in_frame


def test_frame_split_across_chunks_is_held_until_complete() -> None:
    """A frame cut in the prefix and again in the
    payload is returned once, when complete."""
    wire = encode_frame(b"hello world")
    decoder = FrameDecoder()
    assert decoder.feed(wire[:2]) == []
    assert decoder.in_frame
    assert decoder.feed(wire[2:7]) == []
    assert decoder.in_frame
    assert decoder.feed(wire[7:]) == [b"hello world"]
    assert not decoder.in_frame
    assert decoder.buffered == 0


def test_one_byte_chunks() -> None:
    """Feeding one byte at a time yields every frame exactly once, at its last byte."""
    payloads = [b"a", b"", b"bc" * 50, bytes(range(256))]
    wire = b"".join(map(encode_frame, payloads))
    decoder = FrameDecoder()
    got: list[bytes] = []
    completions = []
    for index in range(len(wire)):
        frames = decoder.feed(wire[index : index + 1])
        if frames:
            completions.append(index)
        got += frames
    assert got == payloads
    assert completions[-1] == len(wire) - 1
    assert decoder.buffered == 0


def test_tail_of_next_frame_stays_buffered() -> None:
    """Bytes past the last whole frame are kept
    (payload bytes counted in ``buffered``)."""
    wire = encode_frame(b"one") + encode_frame(b"two")
    decoder = FrameDecoder()
    assert decoder.feed(wire[:-1]) == [b"one"]
    assert decoder.in_frame
    assert decoder.buffered == 2  # "tw"; the parsed prefix is held as the pending length
    assert decoder.feed(wire[-1:]) == [b"two"]
    assert not decoder.in_frame


@st.composite
def chunked_stream(draw: st.DrawFn) -> tuple[list[bytes], list[bytes]]:
    payloads = draw(st.lists(st.binary(max_size=300), min_size=1, max_size=8))
    wire = b"".join(map(encode_frame, payloads))
    cuts = sorted(draw(st.sets(st.integers(min_value=1, max_value=max(1, len(wire) - 1)))))
    bounds = [0, *[c for c in cuts if c < len(wire)], len(wire)]
    chunks = [wire[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    return payloads, chunks


@given(chunked_stream())
def test_any_chunking_gives_back_exactly_the_frames(
    case: tuple[list[bytes], list[bytes]],
) -> None:
    """Property: for random frames cut at random points,
    the decoder returns exactly those frames."""
    payloads, chunks = case
    decoder = FrameDecoder()
    assert feed_all(decoder, chunks) == payloads
    assert decoder.buffered == 0
    assert not decoder.in_frame


def test_oversize_prefix_is_refused_before_buffering_the_payload() -> None:
    """A 2^32-1 byte announcement is refused at once;
    the decoder holds no more than the prefix."""
    decoder = FrameDecoder()
    assert decoder.feed(struct.pack(">I", 2**32 - 1)) == []
    assert isinstance(decoder.error, FrameTooLargeError)
    assert decoder.error.length == 2**32 - 1
    assert decoder.error.limit == DEFAULT_MAX_FRAME
    assert str(2**32 - 1) in str(decoder.error)
    assert decoder.buffered <= PREFIX_SIZE
    assert decoder.feed(b"x" * 100) == [] and decoder.buffered <= PREFIX_SIZE


def test_oversize_prefix_announced_one_byte_at_a_time() -> None:
    """The limit is checked as soon as the 4th prefix byte arrives, not later."""
    decoder = FrameDecoder(max_frame=1000)
    prefix = struct.pack(">I", 1001)
    for byte in prefix[:-1]:
        assert decoder.feed(bytes([byte])) == []
        assert decoder.error is None
    assert decoder.feed(prefix[-1:]) == []
    assert (decoder.error.length, decoder.error.limit) == (1001, 1000)
    assert decoder.buffered <= PREFIX_SIZE


def test_frame_exactly_at_the_limit_is_accepted() -> None:
    """The limit is inclusive: a frame of max_frame
    bytes passes, one more byte is refused."""
    decoder = FrameDecoder(max_frame=16)
    assert decoder.feed(encode_frame(b"x" * 16)) == [b"x" * 16]
    assert decoder.error is None
    assert decoder.feed(encode_frame(b"x" * 17)) == []
    assert isinstance(decoder.error, FrameTooLargeError)


def test_raised_limit_applies_to_later_frames() -> None:
    """``max_frame`` can be raised after
    construction (a client learns it from hello)."""
    decoder = FrameDecoder(max_frame=4)
    decoder.max_frame = 64
    assert decoder.feed(encode_frame(b"y" * 64)) == [b"y" * 64]


def test_garbage_bytes_read_as_a_huge_length_are_refused() -> None:
    """Random text on the socket (here ASCII 'GET ')
    is a ~1.2 GB prefix: refused, not buffered."""
    decoder = FrameDecoder()
    assert decoder.feed(b"GET / HTTP/1.1\r\n\r\n") == []
    assert decoder.error.length == struct.unpack(">I", b"GET ")[0]


def test_frames_before_an_oversize_prefix_are_still_delivered() -> None:
    """Pipelined requests that precede a bad prefix in the same chunk are not lost:
    they are returned, and the error is reported after them."""
    decoder = FrameDecoder(max_frame=8)
    chunk = encode_frame(b"one") + encode_frame(b"two") + struct.pack(">I", 9) + b"x" * 9
    assert decoder.feed(chunk) == [b"one", b"two"]
    assert decoder.error is not None and decoder.error.length == 9


@given(st.lists(st.binary(max_size=64), max_size=3), st.binary(max_size=8))
def test_whole_frame_takes_exactly_one_whole_frame_and_nothing_else(
    payloads: list[bytes], tail: bytes
) -> None:
    """``whole_frame`` returns the payload only when the bytes are exactly one frame and
    nothing is held; otherwise it returns None and leaves the decoder as it was, so the
    bytes can be appended as usual and give back the same frames."""
    data = b"".join(map(encode_frame, payloads)) + tail
    decoder = FrameDecoder()
    taken = decoder.whole_frame(data)
    if len(payloads) == 1 and not tail:
        assert taken == payloads[0]
    else:
        assert taken is None
        assert decoder.buffered == 0 and not decoder.in_frame
        assert decoder.feed(data) == payloads


def test_whole_frame_leaves_a_started_frame_and_an_oversize_one_to_the_buffer() -> None:
    """With bytes of a frame already held, or a prefix over the limit, nothing is taken."""
    decoder = FrameDecoder(max_frame=4)
    assert decoder.whole_frame(encode_frame(b"12345")) is None  # over the limit
    assert decoder.error is None  # left for append/next_frame to refuse
    decoder.append(encode_frame(b"ab")[:3])
    assert decoder.whole_frame(encode_frame(b"cd")) is None


def test_the_framing_example_in_protocol_md_is_what_the_encoder_sends() -> None:
    """docs/protocol.md section 2 shows a ping request and its answer byte by byte;
    a field added to either (``PingResult.store`` was) must show in the dumps."""
    from pathlib import Path

    from towerd.protocol.envelope import encode_request, encode_result
    from towerd.protocol.methods import PingResult

    text = (Path(__file__).parents[2] / "docs" / "protocol.md").read_text()
    section = text.split("## 2. Framing", 1)[1].split("### Limits", 1)[0]
    request_dump, answer_dump = section.split("```")[3], section.split("```")[5]

    def dumped(block: str, annotated: bool) -> bytes:
        lines = [line.split("  ")[0] if annotated else line for line in block.splitlines()]
        return bytes.fromhex(" ".join(lines))

    assert dumped(request_dump, annotated=True) == encode_request(2, "ping", {})
    answer = PingResult(pong=True, now=1767225600000, store="reachable")
    assert dumped(answer_dump, annotated=False) == encode_result(2, answer)
    assert f"is {len(encode_request(2, 'ping', {}))} bytes" in section
    assert f"({len(encode_result(2, answer))} bytes;" in section
