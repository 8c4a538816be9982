"""The daemon's clock: every TTL, heartbeat age, silence deadline and expiry runs on it.

A wall-clock step is not elapsed time. Measured on the wall clock, an NTP step of
+90 s reaped a live, heartbeating worker and parked its effect, and +25 h expired
a key completed seconds before, so its retry ran the step again. towerd's clock
is therefore ``CLOCK_BOOTTIME`` (never stepped; unlike ``CLOCK_MONOTONIC`` it
counts suspend, so a TTL still means real elapsed time on a laptop that slept)
offset to read as the wall clock did when the anchor was set. The anchor is
persisted (daemon/store/clock.py) and reused by every daemon start in the same
boot (boot id), so a restart after a step does not pick the step up either; the
first start after a reboot anchors to the wall clock again, never earlier than
the last reading persisted before the reboot, so towerd's time never runs back.

Timestamps towerd stores and shows are on this clock; after a step they differ
from the wall clock by the step until the next reboot (``status`` shows the
offset, ``doctor`` warns). A detected step is logged and does nothing else.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"
STEP_THRESHOLD_MS = 1000  # an offset change larger than this is reported as a wall-clock step


def boot_id() -> str:
    """This boot's id ("" if the kernel does not say): boot-time readings compare only
    within one boot."""
    try:
        with open(BOOT_ID_PATH) as handle:
            return handle.read().strip()
    except OSError:
        return ""


def boottime_ms() -> int:
    return time.clock_gettime_ns(time.CLOCK_BOOTTIME) // 1_000_000


def wall_ms() -> int:
    return time.time_ns() // 1_000_000


@dataclass(frozen=True, slots=True)
class Anchor:
    """At boot time ``boottime_ms`` of boot ``boot_id``, towerd's clock read ``clock_ms``."""

    boot_id: str
    boottime_ms: int
    clock_ms: int


class DaemonClock:
    """Milliseconds since the Unix epoch as towerd counts them: real elapsed time since
    its anchor."""

    def __init__(self, anchor: Anchor) -> None:
        self.anchor = anchor
        self._base = anchor.clock_ms - anchor.boottime_ms

    @classmethod
    def at_wall_clock(cls) -> DaemonClock:
        return cls(Anchor(boot_id(), boottime_ms(), wall_ms()))

    @classmethod
    def resume(cls, previous: Anchor | None, high_water_ms: int | None) -> DaemonClock:
        """Continue ``previous`` when it was set in this boot (so the time since then is
        real elapsed time, whatever the wall clock did); else anchor to the wall clock,
        but never before ``high_water_ms``, the last reading of the previous boot."""
        current_boot = boot_id()
        if previous is not None and current_boot and previous.boot_id == current_boot:
            return cls(previous)
        start = max(wall_ms(), high_water_ms or 0)
        return cls(Anchor(current_boot, boottime_ms(), start))

    def now_ms(self) -> int:
        return self._base + time.clock_gettime_ns(time.CLOCK_BOOTTIME) // 1_000_000

    def offset_ms(self) -> int:
        """How far the wall clock is ahead of towerd's (negative: behind)."""
        return wall_ms() - self.now_ms()


class StepDetector:
    """Notices wall-clock steps: the offset between wall and towerd's clock moves only
    when the wall clock is stepped (both run at the same rate otherwise)."""

    def __init__(self, clock: DaemonClock) -> None:
        self.clock = clock
        self.last_offset_ms = clock.offset_ms()
        self.steps = 0

    def check(self) -> int | None:
        """The size of a step since the last check (ms, signed), or None."""
        offset = self.clock.offset_ms()
        step = offset - self.last_offset_ms
        self.last_offset_ms = offset
        if abs(step) <= STEP_THRESHOLD_MS:
            return None
        self.steps += 1
        return step
