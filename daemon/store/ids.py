"""Random ids the store mints (effect refs, session, message and event ids)."""

from __future__ import annotations

import os
import threading

# Random bytes are read from the kernel for this many ids at a time, hex-encoded at once:
# a getrandom call per id cost ~4% of the writes at 64 clients (bench/README.md).
IDS_PER_READ = 256
_VARIANT = {digit: "89ab"[int(digit, 16) & 3] for digit in "0123456789abcdef"}  # RFC 4122

_lock = threading.Lock()  # ids are minted on the loop and on PostgreSQL's writer thread
_pool = ""  # hex digits not yet used
_used = 0


def random_uuid() -> str:
    """A random (version 4) UUID as text, the same as ``str(uuid.uuid4())``, made from
    random bytes directly: ``uuid.uuid4()`` and its ``str`` cost ~2.5 us (a ``getrandom``
    call each), this under 1 us; every new idempotency key mints one on the writer's loop."""
    global _pool, _used
    with _lock:
        if _used >= len(_pool):
            _pool, _used = os.urandom(16 * IDS_PER_READ).hex(), 0
        digits = _pool[_used : _used + 32]
        _used += 32
    return (
        f"{digits[:8]}-{digits[8:12]}-4{digits[13:16]}-"
        f"{_VARIANT[digits[16]]}{digits[17:20]}-{digits[20:]}"
    )


def _forget_pool() -> None:
    """A forked child must not mint the ids its parent will (and gets a lock of its
    own: another thread of the parent may have held this one at the fork)."""
    global _lock, _pool, _used
    _lock, _pool, _used = threading.Lock(), "", 0


os.register_at_fork(after_in_child=_forget_pool)
