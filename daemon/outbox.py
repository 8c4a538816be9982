"""Hook events kept while the shared store is unreachable, forwarded in order once it
answers again.

A hook must never wait on the network or fail: while PostgreSQL cannot be reached,
``hook.event`` answers at once (``queued``) and the event waits here, in a bounded
file in the state dir, so a daemon restarted meanwhile still forwards it. Hook events
are soft state: past the bound the oldest are dropped and counted (``status``), never
the daemon's memory or disk. Forwarding keeps their order; an event the store refuses
for good (a bad argument) is dropped and counted, not retried forever. An event whose
write timed out may also have committed: each event keeps the filing key the daemon
minted before its first write, and a write under a key already filed files nothing
(``events.filing_key``), so an event is filed once; none is lost unless dropped and
counted.
"""

from __future__ import annotations

import os
import struct
from collections import deque
from pathlib import Path
from typing import Any

import msgspec
import structlog

from towerd.protocol.errors import TowerdError, store_unreachable
from towerd.protocol.methods import HookEventParams

log = structlog.get_logger("towerd.outbox")

OUTBOX_FILE = "outbox"
DEFAULT_LIMIT = 10_000  # events kept at most; ~1 KiB each: ~10 MiB of disk at worst
_LENGTH = struct.Struct(">I")


class QueuedEvent(msgspec.Struct, array_like=True):
    principal: str
    params: HookEventParams
    filing_key: str | None = None  # None: queued by a towerd before filing keys


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(QueuedEvent)


class Outbox:
    """The queue, in memory and in ``state_dir/outbox`` (length-prefixed msgpack records,
    appended; rewritten when forwarded events leave it or the bound drops some)."""

    def __init__(self, state_dir: Path, limit: int = DEFAULT_LIMIT) -> None:
        self.path = state_dir / OUTBOX_FILE
        self.limit = limit
        self.events: deque[QueuedEvent] = deque()
        self.dropped = 0  # past the bound, or refused by the store for good
        self.forwarded = 0
        self._load()

    @property
    def queued(self) -> int:
        return len(self.events)

    def _load(self) -> None:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return
        offset = 0
        while offset + _LENGTH.size <= len(data):
            (size,) = _LENGTH.unpack_from(data, offset)
            record = data[offset + _LENGTH.size : offset + _LENGTH.size + size]
            offset += _LENGTH.size + size
            if len(record) < size:
                break  # a torn last record (a crash mid-append): it was never answered queued
            try:
                self.events.append(_decoder.decode(record))
            except msgspec.DecodeError:
                self.dropped += 1
        self._trim()
        if self.events:
            log.info("outbox_loaded", queued=len(self.events), path=str(self.path))

    def put(self, principal: str, params: HookEventParams, filing_key: str | None) -> None:
        """Queue one event under its filing key (its agent process is not named: it may
        be gone when the event is forwarded)."""
        event = QueuedEvent(principal, msgspec.structs.replace(params, agent_pid=None), filing_key)
        self.events.append(event)
        if self._trim():
            self._rewrite()
            return
        record = _encoder.encode(event)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, _LENGTH.pack(len(record)) + record)
        finally:
            os.close(fd)

    def _trim(self) -> bool:
        over = len(self.events) - self.limit
        for _ in range(max(over, 0)):
            self.events.popleft()
            self.dropped += 1
        return over > 0

    def _rewrite(self) -> None:
        if not self.events:
            self.path.unlink(missing_ok=True)
            return
        temporary = self.path.with_name(f".{OUTBOX_FILE}.{os.getpid()}")
        records = b"".join(
            _LENGTH.pack(len(record)) + record
            for record in (_encoder.encode(event) for event in self.events)
        )
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, records)
        finally:
            os.close(fd)
        os.replace(temporary, self.path)

    async def forward(self, write: Any) -> int:
        """Send the queued events in order through ``write(principal, params,
        filing_key)`` (an awaitable store write); stop at the first that finds the store
        unreachable (it stays first, and is sent again under the same key).
        Returns how many left the queue."""
        sent = 0
        try:
            while self.events:
                event = self.events[0]
                try:
                    await write(event.principal, event.params, event.filing_key)
                except TowerdError as exc:
                    if store_unreachable(exc):
                        break
                    self.dropped += 1  # refused for good: keeping it would block the rest
                    log.warning("outbox_event_refused", code=exc.code, error=str(exc))
                self.events.popleft()
                sent += 1
                self.forwarded += 1
        finally:
            if sent:
                self._rewrite()
                log.info("outbox_forwarded", forwarded=sent, queued=len(self.events))
        return sent
