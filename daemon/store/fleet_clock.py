"""The fleet's clock, on a store several boxes share (PostgreSQL): what every TTL,
deadline and presence is measured on, the same for every box.

The server's wall clock alone is not it. Every box reads deadlines another box wrote,
so each must read the same clock; and a step of the server's clock is not elapsed
time. Each box held its own highest reading once, and after a step back a box that
had run before it read a lease granted since as expired and granted it again; then
every box stood still at one recorded reading until the server's caught up, and the
correction of the step (a jump forward by the freeze's length) expired leases their
holders had renewed every second (hostile testers' reproducers, libfaketime on the
server).

So the fleet's clock follows elapsed time. A box reads it as its anchor (a reading and
its own ``CLOCK_BOOTTIME`` then) plus the time elapsed since on its own clock, moved
toward the server's by at most ``SLEW`` of that elapsed time, never below the reading
recorded in ``meta`` (``KEY``: the fleet's reading and the server's, written by a
batch when the record is ``RECORD_EVERY_MS`` old). A box with no anchor yet (its
first batch) takes the record plus what the server's clock advanced since it, or the
server's clock when there is no record. A step of the server's clock, either way, is
then followed at 1% of elapsed time (a minute's step in 100 minutes), and the boxes
agree within the record's granularity.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from towerd.daemon.clock import boottime_ms

KEY = "fleet_clock"  # meta: "FLEET_MS SERVER_MS" at the last record
RECORD_EVERY_MS = 200  # a batch records its reading when the record is this old
SLEW = 0.01  # how fast the fleet's clock comes back to the server's after a step
ANCHOR_EVERY_MS = 1000  # a box moves its anchor on after this much elapsed time
APART_MS = 1000  # the server's clock this far from the fleet's is reported
FRESH_MS = 1000  # a record this recent on the server's clock is a running fleet's
LOOK_EVERY_S = 0.2  # how often a starting box looks for a running box's next record
START_WAIT_MAX_S = 21.0  # the longest a starting box waits for it (two default beats)


@dataclass(frozen=True)
class Record:
    """The fleet's reading and the server's, as the last recording batch read them."""

    fleet_ms: int
    server_ms: int

    @classmethod
    def parse(cls, text: str | bytes | None) -> Record | None:
        """The record as stored; a value that is not one (edited by hand) is none."""
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        try:
            fleet_ms, server_ms = (int(part) for part in (text or "").split())
        except ValueError:
            return None
        return cls(fleet_ms, server_ms)


def needs_fresh_record(server_ms: int, record: Record | None) -> bool:
    """Whether a starting box should wait for a running box's next record: the record
    moved on as the server's clock moved since takes a step of the server's clock made
    since the last record for elapsed time (a box started between a forward step and
    the next heartbeat took it, recorded it, and every box's clock jumped: a review's
    finding). A record fresher than FRESH_MS leaves no room for a step to hide in."""
    return record is not None and server_ms - record.server_ms > FRESH_MS


def at_start(server_ms: int, record: Record | None) -> int:
    """The reading of a box with no anchor: the record moved on as the server's clock
    moved since (never back), or the server's clock."""
    if record is None:
        return server_ms
    return record.fleet_ms + max(0, server_ms - record.server_ms)


class FleetClock:
    """One box's reading of the fleet's clock (its anchor), kept across reconnects."""

    def __init__(self) -> None:
        self.anchor: tuple[int, int] | None = None  # (fleet ms, boottime ms) then
        self.last = 0  # this box's last batch reading: the slew's turns never go back

    def begin(self, server_ms: int, record: Record | None) -> int:
        """A box's first reading, before it serves, from the record it chose (a starting
        box waits for a running box's next record: ``needs_fresh_record``)."""
        fleet = at_start(server_ms, record)
        self.anchor, self.last = (fleet, boottime_ms()), fleet
        return fleet

    def reading(self, server_ms: int, record: Record | None) -> int:
        """The clock of a write batch, given the server's clock and the record read
        under the writers' lock."""
        now = boottime_ms()
        if self.anchor is None:
            fleet = at_start(server_ms, record)
            self.anchor, self.last = (fleet, now), fleet
            return fleet
        fleet = max(self._moved_on(server_ms, now), self.last)
        floored = record is not None and fleet < record.fleet_ms
        if record is not None and floored:
            fleet = record.fleet_ms
        if floored or now - self.anchor[1] >= ANCHOR_EVERY_MS:
            self.anchor = (fleet, now)
        self.last = fleet
        return fleet

    def read(self, fallback: int) -> int:
        """The clock of a read: never ahead of what a batch would read now (the server's
        clock may have stepped since the last batch: the slew taken as the most it could
        be back), so a read never calls free what a write still refuses; ``fallback``
        before this box's first batch."""
        if self.anchor is None:
            return fallback
        anchored, since = self.anchor
        elapsed = max(0, boottime_ms() - since)
        return anchored + elapsed - int(elapsed * SLEW)

    def _moved_on(self, server_ms: int, now: int) -> int:
        """The anchor moved on by the elapsed time since, and toward the server's clock
        by at most SLEW of it."""
        assert self.anchor is not None
        anchored, since = self.anchor
        elapsed = max(0, now - since)
        guess = anchored + elapsed
        most = elapsed * SLEW
        return guess + int(max(-most, min(most, server_ms - guess)))


def record_if_due(conn: Any, fleet_ms: int, server_ms: int, record: Record | None) -> None:
    """In the batch's transaction: record this reading when the record is old enough."""
    if record is None or fleet_ms - record.fleet_ms >= RECORD_EVERY_MS:
        conn.execute(
            """INSERT INTO meta (key, value) VALUES (?, ?)
               ON CONFLICT (key) DO UPDATE SET value = excluded.value""",
            (KEY, f"{fleet_ms} {server_ms}"),
        )
