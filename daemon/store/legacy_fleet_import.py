"""Import of a legacy fleet file: a JSON array of entries keyed by agent session id.

Older tools kept the fleet as a JSON array of camelCase objects
(``agentSessionID``, ``lastAttachedAt``, ``parent`` as an agent session id).
Each entry is validated on its own: a bad entry is skipped with its index and
the reason, never swallowed, and never fails the good ones.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from towerd.daemon.store.fleet import agent_session_index, replace_rows
from towerd.daemon.store.ids import random_uuid
from towerd.daemon.store.tx import Caller, Tx
from towerd.protocol.methods import (
    LegacyImported,
    LegacyImportParams,
    LegacyImportResult,
    LegacySkip,
    SessionEntry,
    SessionFields,
)


class LegacyEntry(SessionFields, kw_only=True):
    """An entry of the legacy fleet file: the session fields, an agent session id
    always, and ``parent`` as the legacy file names it (an agent session id, mapped to
    a session id on import)."""

    agent_session_id: str
    parent: str | None = None


_CAMEL_BOUNDARY = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")


def snake_case(key: str) -> str:
    """``agentSessionID`` -> ``agent_session_id``, ``lastAttachedAt`` -> ``last_attached_at``."""
    return _CAMEL_BOUNDARY.sub("_", key).lower()


def _normalized(raw: dict[Any, Any]) -> dict[Any, Any]:
    return {snake_case(key) if isinstance(key, str) else key: value for key, value in raw.items()}


def parse_entry(raw: Any) -> LegacyEntry:
    if not isinstance(raw, dict):
        raise ValueError(f"entry is a {type(raw).__name__}, not an object")
    normalized = _normalized(raw)
    try:
        entry = msgspec.convert(normalized, LegacyEntry)
    except msgspec.ValidationError as exc:
        raise ValueError(str(exc)) from None
    if not entry.agent_session_id:
        raise ValueError("agent session id is empty")
    return entry


def import_legacy(tx: Tx, caller: Caller, params: LegacyImportParams) -> LegacyImportResult:
    """Mint session ids for new entries, map parents to them, write them as one fleet write."""
    raw_entries = params.entries
    skips: list[LegacySkip] = []
    parsed: dict[str, tuple[int, LegacyEntry]] = {}
    for index, raw in enumerate(raw_entries):
        try:
            entry = parse_entry(raw)
        except ValueError as exc:
            agent_session_id = (
                _normalized(raw).get("agent_session_id") if isinstance(raw, dict) else None
            )
            skips.append(
                LegacySkip(
                    index=index,
                    reason=f"invalid entry: {exc}",
                    agent_session_id=agent_session_id
                    if isinstance(agent_session_id, str)
                    else None,
                )
            )
            continue
        earlier = parsed.pop(entry.agent_session_id, None)
        if earlier is not None:
            skips.append(
                LegacySkip(
                    index=earlier[0],
                    reason=f"superseded by entry {index} with the same agent session id",
                    agent_session_id=entry.agent_session_id,
                )
            )
        parsed[entry.agent_session_id] = (index, entry)

    existing = agent_session_index(tx)
    minted: dict[str, str] = {}
    for agent_session_id, (index, _entry) in list(parsed.items()):
        if agent_session_id in existing:
            skips.append(
                LegacySkip(
                    index=index,
                    reason=f"already in the fleet as session {existing[agent_session_id]}",
                    agent_session_id=agent_session_id,
                )
            )
            del parsed[agent_session_id]
        else:
            minted[agent_session_id] = random_uuid()

    entries = []
    for agent_session_id, (_index, entry) in sorted(parsed.items(), key=lambda item: item[1][0]):
        fields = msgspec.structs.asdict(entry)
        legacy_parent = fields.pop("parent")
        parent = None
        if legacy_parent is not None:
            parent = minted.get(legacy_parent) or existing.get(legacy_parent)
        entries.append(SessionEntry(session_id=minted[agent_session_id], parent=parent, **fields))
    if entries:
        replace_rows(tx, entries, [])
    skips.sort(key=lambda skip: skip.index)
    return LegacyImportResult(
        imported=len(entries),
        skipped=len(skips),
        skips=skips,
        sessions=[
            LegacyImported(
                agent_session_id=entry.agent_session_id or "", session_id=entry.session_id
            )
            for entry in entries
        ],
    )
