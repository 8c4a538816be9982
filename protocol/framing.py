"""Length-prefixed framing: a 4-byte big-endian length N, then N payload bytes.

The decoder is incremental and allocation-aware: it checks the length prefix
against the limit *before* buffering a single payload byte, so a peer that
announces 4 GiB costs us nothing but an error.
"""

from __future__ import annotations

import struct

DEFAULT_MAX_FRAME = 1024 * 1024  # 1 MiB
# A response may exceed the request limit by this much: it can carry back a value
# that filled a whole request, plus the record and envelope around it.
RESPONSE_SLACK = 64 * 1024
FRAME_ERROR_ID = 0  # the id of an error about a frame whose own id could not be read
PREFIX = struct.Struct(">I")
PREFIX_SIZE = PREFIX.size


class FrameTooLargeError(ValueError):
    """The peer announced a frame longer than the limit."""

    def __init__(self, length: int, limit: int) -> None:
        super().__init__(f"frame of {length} bytes exceeds the limit of {limit} bytes")
        self.length = length
        self.limit = limit


def encode_frame(payload: bytes) -> bytes:
    """Prefix ``payload`` with its length."""
    return PREFIX.pack(len(payload)) + payload


class FrameDecoder:
    """Turns arbitrary chunks of a byte stream into whole frame payloads.

    Feed it whatever ``recv`` returned (split, merged, one byte at a time);
    it returns the payloads completed so far. When a length prefix announces
    more than ``max_frame``, the frames before it are still returned and
    ``error`` is set to a ``FrameTooLargeError``: the stream is out of sync,
    nothing more is decoded, and the caller should answer and close.
    """

    __slots__ = ("_buffer", "_need", "error", "max_frame")

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self._buffer = bytearray()
        self.max_frame = max_frame  # may be raised later (a client learns it from hello)
        self._need: int | None = None  # payload length of the frame in progress
        self.error: FrameTooLargeError | None = None

    @property
    def buffered(self) -> int:
        """Bytes held for frames not yet complete (a parsed length prefix is not counted)."""
        return len(self._buffer)

    @property
    def in_frame(self) -> bool:
        """True while a frame has started but not finished."""
        return bool(self._buffer) or self._need is not None

    def append(self, data: bytes) -> None:
        """Buffer ``data`` without decoding it: take frames out one at a time with
        :meth:`next_frame`, so a reader under backpressure can stop between frames."""
        if self.error is None:
            self._buffer += data

    def whole_frame(self, data: bytes) -> bytes | None:
        """``data``'s payload if ``data`` is exactly one whole frame within the limit and
        nothing is buffered (a peer with one request in flight sends just that), else
        None and nothing is done: the caller then appends ``data`` as usual."""
        if self._buffer or self._need is not None or self.error is not None:
            return None
        if len(data) < PREFIX_SIZE:
            return None
        (length,) = PREFIX.unpack_from(data)
        if length != len(data) - PREFIX_SIZE or length > self.max_frame:
            return None
        return data[PREFIX_SIZE:]

    def next_frame(self) -> bytes | None:
        """The next complete frame payload, or None until more bytes arrive. A length
        prefix over the limit sets ``error`` (and returns None), as in :meth:`feed`."""
        if self.error is not None:
            return None
        buffer = self._buffer
        if self._need is None:
            if len(buffer) < PREFIX_SIZE:
                return None
            (length,) = PREFIX.unpack_from(buffer)
            if length > self.max_frame:
                self.error = FrameTooLargeError(length, self.max_frame)
                buffer.clear()
                return None
            del buffer[:PREFIX_SIZE]  # O(1): CPython moves a bytearray's start
            self._need = length
        if len(buffer) < self._need:
            return None
        payload = bytes(buffer[: self._need])
        del buffer[: self._need]
        self._need = None
        return payload

    def feed(self, data: bytes) -> list[bytes]:
        if self.error is not None:
            return []
        self._buffer += data
        frames: list[bytes] = []
        buffer = self._buffer
        offset = 0
        while True:
            if self._need is None:
                if len(buffer) - offset < PREFIX_SIZE:
                    break
                (length,) = PREFIX.unpack_from(buffer, offset)
                if length > self.max_frame:
                    self.error = FrameTooLargeError(length, self.max_frame)
                    buffer.clear()
                    return frames
                offset += PREFIX_SIZE
                self._need = length
            if len(buffer) - offset < self._need:
                break
            end = offset + self._need
            frames.append(bytes(buffer[offset:end]))
            offset = end
            self._need = None
        if offset:
            del buffer[:offset]
        return frames
