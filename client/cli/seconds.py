"""The type of every towerctl option that is a number of seconds (``--timeout``,
``--heartbeat``, ``--refresh``, ``--exec-timeout``, ``lock worktree --timeout``): a
finite number in a range, declared with the option. ``nan`` or ``inf`` used to reach
``socket.settimeout`` as a traceback, and ``--timeout 0`` or ``-1`` failed every call
as "timed out"; now argparse refuses the value by the option's name (exit 2).

Stdlib only and no argparse at import: the lean parser (lean.py) takes these options in
hook processes; a refused value sends the line to argparse, which says why.
"""

from __future__ import annotations

import math

# poll() takes an int of milliseconds: 2147483 s (~24.8 days) is the longest wait the
# blocking client can make (more raised OverflowError from select.poll).
MOST = 2_147_483.0
LEAST = 0.001  # a millisecond: below it a wait or a period is 0 in every timer used


class Seconds:
    """``Seconds()``: a millisecond or more; ``Seconds(zero=True)``: 0 or more."""

    def __init__(self, *, zero: bool = False) -> None:
        self.zero = zero
        self.__name__ = "seconds"  # argparse names the type in its own messages

    def __call__(self, text: str) -> float:
        value = float(text)  # ValueError: argparse says "invalid seconds value"
        least_ok = value >= 0 if self.zero else value >= LEAST
        if math.isfinite(value) and least_ok and value <= MOST:
            return value
        import argparse  # only on this error path: hooks never pay for it

        raise argparse.ArgumentTypeError(f"{text!r} is out of range: {self.describe()}")

    def describe(self) -> str:
        return f"seconds >= {0 if self.zero else LEAST:g} and <= {int(MOST)}"

    def __repr__(self) -> str:
        return f"Seconds(zero={self.zero})"
