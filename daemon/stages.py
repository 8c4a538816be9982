"""Where a write request's time goes: a stamp at each stage of the write path.

For the benchmarks (``bench/writes.py --stages``), not for production: off unless
``TOWERD_STAGE_TRACE`` names a file, and then the daemon writes a JSON summary of
every traced write there when it stops. Off, each stamp point costs one test of a
module global. The stamps, in the order a write passes them:

* ``read``: the event loop received the request's bytes (``data_received``);
* ``queued``: decoded, routed, and handed to the writer (``Store.write``);
* ``taken``: the writer took it into a batch;
* ``on_thread``: the batch started on the database thread;
* ``statements``: the batch's statements ran (BEGIN, the epoch check, the store
  functions), before COMMIT;
* ``committed``: COMMIT returned (the write is durable);
* ``back``: the event loop heard that the batch committed;
* ``resolved``: the change notes were published and the caller's future resolved;
* ``written``: the reply was encoded and written to the socket.
"""

from __future__ import annotations

import json
import os
import time
from array import array
from typing import Any

STAMPS = (
    "read", "queued", "taken", "on_thread", "statements", "committed", "back", "resolved",
    "written",
)  # fmt: skip
STAGES = (  # (name, from stamp, to stamp): consecutive stamps, then the whole request
    ("decode + route", "read", "queued"),
    ("queue wait", "queued", "taken"),
    ("hop to db thread", "taken", "on_thread"),
    ("statements", "on_thread", "statements"),
    ("commit", "statements", "committed"),
    ("hop back", "committed", "back"),
    ("publish + resolve", "back", "resolved"),
    ("encode + write", "resolved", "written"),
    ("total", "read", "written"),
)
_INDEX = {name: index for index, name in enumerate(STAMPS)}
READ, QUEUED, TAKEN, ON_THREAD, STATEMENTS, COMMITTED, BACK, RESOLVED, WRITTEN = range(9)
BATCH_SIZE = len(STAMPS)  # a stamp list's last slot: how many writes its batch held

now_ns = time.perf_counter_ns


class Trace:
    """The stamps of every traced write, kept until :meth:`summary`."""

    def __init__(self) -> None:
        self.samples: list[array[int]] = [array("q") for _ in STAGES]
        self.batch_sizes: array[int] = array("l")
        self.last_read = 0  # the stamp of the bytes being dispatched now (daemon/server.py)
        self.answering: dict[int, list[int]] = {}  # id(future) -> its stamps, until written

    def new_stamps(self) -> list[int]:
        """A write's stamp list, its ``read`` and ``queued`` stamps set."""
        stamps = [0] * (len(STAMPS) + 1)
        stamps[READ] = self.last_read or now_ns()
        stamps[QUEUED] = now_ns()
        return stamps

    def finish(self, stamps: list[int]) -> None:
        """Count a write whose reply was just written."""
        stamps[WRITTEN] = now_ns()
        for samples, (_, start, end) in zip(self.samples, STAGES, strict=True):
            samples.append(stamps[_INDEX[end]] - stamps[_INDEX[start]])
        self.batch_sizes.append(stamps[BATCH_SIZE])

    def summary(self) -> dict[str, Any]:
        """Per stage: count, mean, p50, p90, p99 in microseconds; the batch sizes."""
        stages = {}
        for samples, (name, _, _) in zip(self.samples, STAGES, strict=True):
            ordered = sorted(samples)
            stages[name] = _describe([value / 1000 for value in ordered])
        return {"writes": len(self.batch_sizes), "stages": stages,
                "batch_size": _describe(sorted(self.batch_sizes))}  # fmt: skip


def _describe(ordered: list[float]) -> dict[str, float]:
    if not ordered:
        return {"count": 0}

    def at(fraction: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(fraction * len(ordered)))], 1)

    mean = round(sum(ordered) / len(ordered), 1)
    return {"count": len(ordered), "mean": mean, "p50": at(0.5), "p90": at(0.9), "p99": at(0.99)}


TRACE: Trace | None = Trace() if os.environ.get("TOWERD_STAGE_TRACE") else None


def enable() -> Trace:
    """Trace from now on in this process (the in-process engine benchmark)."""
    global TRACE
    TRACE = Trace()
    return TRACE


def write_summary() -> None:
    """Write the summary to ``TOWERD_STAGE_TRACE`` (at the daemon's stop)."""
    path = os.environ.get("TOWERD_STAGE_TRACE")
    if TRACE is not None and path:
        with open(path, "w") as handle:
            json.dump(TRACE.summary(), handle, indent=1)
