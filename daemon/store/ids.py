"""Random ids the store mints (effect refs, session, message and event ids)."""

from __future__ import annotations

import os


def random_uuid() -> str:
    """A random (version 4) UUID as text, the same as ``str(uuid.uuid4())``.

    Built from the bytes directly: ``uuid.uuid4()`` and its ``str`` cost ~2.5 us, this
    ~1 us, and every new idempotency key mints one on the writer's loop."""
    raw = bytearray(os.urandom(16))
    raw[6] = raw[6] & 0x0F | 0x40  # version 4
    raw[8] = raw[8] & 0x3F | 0x80  # the RFC 4122 variant
    text = raw.hex()
    return f"{text[:8]}-{text[8:12]}-{text[12:16]}-{text[16:20]}-{text[20:]}"
