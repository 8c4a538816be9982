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

MOST = 10 * 365 * 86_400.0  # ten years: beyond any wait, inside every timer


class Seconds:
    """``Seconds()``: above 0; ``Seconds(zero=True)``: 0 or more."""

    def __init__(self, *, zero: bool = False) -> None:
        self.zero = zero
        self.__name__ = "seconds"  # argparse names the type in its own messages

    def __call__(self, text: str) -> float:
        value = float(text)  # ValueError: argparse says "invalid seconds value"
        if math.isfinite(value) and (value >= 0 if self.zero else value > 0) and value <= MOST:
            return value
        import argparse  # only on this error path: hooks never pay for it

        raise argparse.ArgumentTypeError(f"{text!r} is out of range: {self.describe()}")

    def describe(self) -> str:
        return f"seconds {'>=' if self.zero else '>'} 0 and <= {int(MOST)}"

    def __repr__(self) -> str:
        return f"Seconds(zero={self.zero})"
