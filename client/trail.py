"""``towerctl events tail``: placeholder, being written."""

from typing import Any


def tail_events(args: Any, scope: dict[str, Any]) -> int:
    raise NotImplementedError
