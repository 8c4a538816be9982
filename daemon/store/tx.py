"""What every store function receives: the connection and who is writing, when."""

from __future__ import annotations

import sqlite3
import time
from dataclasses import dataclass
from typing import Any

import msgspec

from towerd.protocol.errors import Conflict, Internal, StorageFull, TowerdError

_packer = msgspec.msgpack.Encoder()
_sorted_packer = msgspec.msgpack.Encoder(order="sorted")
_unpacker = msgspec.msgpack.Decoder()


@dataclass(frozen=True, slots=True)
class Tx:
    """A store function's context; ``now`` is one clock reading per transaction."""

    conn: sqlite3.Connection
    daemon_id: str
    owner_epoch: int
    now: int


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def pack(value: Any) -> bytes:
    return _packer.encode(value)


def pack_canonical(value: Any) -> bytes:
    """msgpack with map keys sorted, so equal values encode to equal bytes."""
    return _sorted_packer.encode(value)


def unpack(data: bytes | None) -> Any:
    return None if data is None else _unpacker.decode(data)


SQLITE_FULL = 13


def translate_sqlite_error(exc: sqlite3.Error) -> TowerdError | None:
    """The wire error a SQLite failure means to a client, or None for a bug."""
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None and code & 0xFF == SQLITE_FULL:
        return StorageFull("the disk holding the state database is full; nothing was written")
    if isinstance(exc, sqlite3.IntegrityError):
        return Conflict(f"the write violates a constraint of the store: {exc}")
    if isinstance(exc, sqlite3.OperationalError) and "database is locked" in str(exc):
        return Internal(f"the state database is locked by another process: {exc}")
    return None
