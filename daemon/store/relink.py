"""Parent relinking for fleet rewrites: a pure function, no SQL.

Two rows share an agent session id when one resumes the other's agent
session; the fleet keeps the one written last. What remains must be a
one-level hierarchy of rows the fleet holds:

1. A link to a dropped row follows to the row that replaced it. A row that
   replaced its own parent follows that parent's link instead, and a link to
   a row the fleet does not hold makes the row top-level.
2. Where links form a cycle, the row written first in the cycle becomes
   top-level.
3. A row whose parent is itself a sub-session moves up to the top-level row
   above it.

Every walk is bounded, so any input terminates, in O(n) overall.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def relink(
    order: Sequence[str],
    links: Mapping[str, str | None],
    replaced: Mapping[str, str] | None = None,
) -> dict[str, str | None]:
    """The parent of every kept row after relinking.

    ``order`` lists the kept rows in written order; ``links`` gives the parent
    link of every row, kept or dropped; ``replaced`` maps a dropped row to the
    kept row that replaced it.
    """
    replaced = replaced or {}
    position = {session_id: index for index, session_id in enumerate(order)}
    bound = len(links) + len(order) + 1

    def surviving_parent(session_id: str) -> str | None:
        link = links.get(session_id)
        for _ in range(bound):
            if link is None:
                return None
            target = replaced.get(link, link)
            if target != session_id:
                return target if target in position else None
            link = links.get(link)  # this row replaced its own parent
        return None

    linked = {session_id: surviving_parent(session_id) for session_id in order}
    _break_cycles(order, linked, position)
    return _flatten(order, linked)


def _break_cycles(
    order: Sequence[str], linked: dict[str, str | None], position: Mapping[str, int]
) -> None:
    done: set[str] = set()
    for start in order:
        path: list[str] = []
        on_path: dict[str, int] = {}
        current: str | None = start
        while current is not None and current not in done:
            if current in on_path:
                cycle = path[on_path[current] :]
                linked[min(cycle, key=position.__getitem__)] = None
                break
            on_path[current] = len(path)
            path.append(current)
            current = linked[current]
        done.update(path)


def _flatten(order: Sequence[str], linked: Mapping[str, str | None]) -> dict[str, str | None]:
    top: dict[str, str] = {}
    for start in order:
        path: list[str] = []
        current = start
        while current not in top:
            parent = linked[current]
            if parent is None:
                top[current] = current
                break
            path.append(current)
            current = parent
        root = top[current]
        for session_id in path:
            top[session_id] = root
    return {
        session_id: None if top[session_id] == session_id else top[session_id]
        for session_id in order
    }
