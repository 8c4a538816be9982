"""Test-only crash points: SIGKILL this process at a named moment.

``TOWERD_CRASH_AT=point[:n][,point[:n]...]`` arms points; the process kills
itself with SIGKILL the n-th time (default 1st) execution reaches an armed
point. Unset (always, in production) a check is one frozenset lookup. The
crash torture uses this to die exactly before a commit, after a commit but
before the reply, inside reconciliation and inside a migration.
"""

from __future__ import annotations

import os
import signal

POINTS = frozenset(
    {
        "batch.before_commit",  # a write batch ran, its COMMIT has not
        "batch.after_commit",  # committed, no caller answered yet
        "reconcile.before_commit",  # start-up reconciliation done, not committed
        "migrate.before_commit",  # a migration step ran, not committed
        "generation.both_accepted",  # a new generation recorded beside the old one only
        "generation.in_database",  # the database took it, the record still has both
    }
)


def _parse(spec: str) -> dict[str, int]:
    armed: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, count = item.partition(":")
        if name not in POINTS:
            raise ValueError(
                f"TOWERD_CRASH_AT: unknown crash point {name!r} (known: {sorted(POINTS)})"
            )
        armed[name] = int(count or 1)
    return armed


_armed = _parse(os.environ.get("TOWERD_CRASH_AT", ""))
_ARMED_NAMES = frozenset(_armed)


def crash_point(name: str) -> None:
    """Die here if ``name`` is armed and this is its n-th arrival."""
    if name not in _ARMED_NAMES:
        return
    _armed[name] -= 1
    if _armed[name] <= 0:
        os.kill(os.getpid(), signal.SIGKILL)
