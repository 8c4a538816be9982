"""Keep the event loop awake for a moment after an answer, in case the next request is close.

Why: a client writing in turn (a service, an agent loop; bench/writes.py at 1 client)
sends its next request tens of microseconds after its answer. If the loop went to sleep
in ``epoll_wait`` meanwhile, that request pays for waking it: on this project's VMs the
idle vCPU halts and an interrupt must bring it back, and the client's own ``send`` does
the wake-up. Measured (bench/README.md, "The loop stays awake after an answer"): 1-client
writes +15%, 8 clients +7%, a 1-client read's round trip ~90 -> ~25 us; 64 clients and
50-client reads unchanged within the noise. So after each answer the loop goes on
polling, ``epoll_wait`` with a zero timeout, until ``window`` has passed with no answer,
as Go's scheduler spins a little before it parks a thread.

What it costs: at most one window of CPU after the last answer, then the loop sleeps as
before (an idle daemon uses no CPU); a busy loop pays one callback a pass. It is off
when this process may run on one CPU only (the poll would hold the CPU the client
needs), and each idle pass yields the CPU to anything else runnable on it. ``--spin-us
0`` turns it off.
"""

from __future__ import annotations

import asyncio
import os
import time

DEFAULT_SPIN_US = 200
AFFINITY_RECHECK_S = 1.0  # on one CPU: how long before the affinity is asked again


def cpus_available() -> int:
    """How many CPUs this process may run on (its affinity, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not on Linux
        return os.cpu_count() or 1


class Spinner:
    """Call ``answered()`` after each answer: the loop keeps polling until ``window_us``
    has passed without one. ``spinning`` says whether it does now."""

    def __init__(self, window_us: int) -> None:
        self.window_s = max(window_us, 0) / 1e6
        self.spinning = False
        self.answers = 0  # answers so far: a pass that sees a new one knows the loop is busy
        self._seen = 0
        self._quiet_since = 0.0
        self._single_cpu_until = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None

    def answered(self) -> None:
        # Per answer only a count: the clock is read once a pass, in _poll.
        self.answers += 1
        if not self.spinning and self.window_s:
            self._start()

    def _start(self) -> None:
        now = time.perf_counter()
        if now < self._single_cpu_until:
            return
        # Asked when a spin starts, not per answer: it costs a system call, and the
        # affinity can change under us (taskset).
        if cpus_available() < 2:
            self._single_cpu_until = now + AFFINITY_RECHECK_S
            return
        self.spinning = True
        self._seen, self._quiet_since = self.answers, now
        self._loop = asyncio.get_running_loop()
        self._loop.call_soon(self._poll)

    def _poll(self) -> None:
        """One pass of the loop. While a callback is ready the loop polls for I/O without
        sleeping, so this one queues itself again until the window is over."""
        now = time.perf_counter()
        if self.answers != self._seen:  # answered since the last pass: busy, go on
            self._seen, self._quiet_since = self.answers, now
        elif now - self._quiet_since >= self.window_s:
            self.spinning = False
            return
        else:
            os.sched_yield()  # idle: anything else runnable on this CPU goes first
        assert self._loop is not None
        self._loop.call_soon(self._poll)
