"""``towerctl top``: placeholder, being written."""

from typing import Any


def run_top(args: Any) -> int:
    raise NotImplementedError
