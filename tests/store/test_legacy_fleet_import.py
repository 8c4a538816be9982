"""Legacy fleet import: per-entry validation,
de-dup, parents mapped to minted session ids."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from store_helpers import caller, opened, parents, register, rows
from towerd.daemon.store import Store
from towerd.daemon.store.legacy_fleet_import import import_legacy, snake_case
from towerd.protocol.methods import UUID_PATTERN, LegacyImportParams, LegacyImportResult

pytestmark = pytest.mark.anyio


async def import_entries(store: Store, raw: list[Any]) -> LegacyImportResult:
    """fleet.import_legacy of these raw entries, through the store."""
    return await store.write(import_legacy, caller(), LegacyImportParams(entries=raw))


def camel(agent_session_id: str, **extra: Any) -> dict[str, Any]:
    return {
        "agentSessionID": agent_session_id,
        "cwd": f"/src/{agent_session_id}",
        "agent": "claude",
        **extra,
    }


def snake(agent_session_id: str, **extra: Any) -> dict[str, Any]:
    return {
        "agent_session_id": agent_session_id,
        "cwd": f"/src/{agent_session_id}",
        "agent": "codex",
        **extra,
    }


def minted(result: LegacyImportResult) -> dict[str, str]:
    """agent session id -> minted session id."""
    return {s.agent_session_id: s.session_id for s in result.sessions}


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        ("agentSessionID", "agent_session_id"),
        ("lastAttachedAt", "last_attached_at"),
        ("transcriptPath", "transcript_path"),
        ("targetIdentity", "target_identity"),
        ("agent_session_id", "agent_session_id"),
        ("cwd", "cwd"),
    ],
)
def test_snake_case_of_legacy_keys(key: str, expected: str) -> None:
    """camelCase legacy keys map onto the store's
    snake_case fields; snake_case passes through."""
    assert snake_case(key) == expected


async def test_camel_case_entries_are_imported_with_every_field(
    short_tmp: Path,
) -> None:
    """agentSessionID, lastAttachedAt, transcriptPath
    and friends land in the right columns."""
    raw = [
        camel(
            "A",
            name="alpha",
            pinned=True,
            lastAttachedAt=1_700_000_000_000,
            exited=True,
            prompt="do it",
            result="done",
            transcriptPath="/t/A.jsonl",
            model="opus",
            effort="high",
            target="tmux",
            targetIdentity="%1",
        )
    ]
    async with opened(short_tmp) as store:
        result = await import_entries(store, raw)
        assert (result.imported, result.skipped, result.skips) == (1, 0, [])
        [row] = await rows(store)
        assert row.session_id == minted(result)["A"]
        assert re.fullmatch(UUID_PATTERN, row.session_id)
        assert (row.agent_session_id, row.name, row.cwd, row.agent) == (
            "A",
            "alpha",
            "/src/A",
            "claude",
        )
        assert (row.pinned, row.exited, row.last_attached_at) == (
            True,
            True,
            1_700_000_000_000,
        )
        assert (row.prompt, row.result, row.transcript_path) == (
            "do it",
            "done",
            "/t/A.jsonl",
        )
        assert (row.model, row.effort, row.target, row.target_identity) == (
            "opus",
            "high",
            "tmux",
            "%1",
        )
        assert row.parent is None


async def test_snake_case_entries_are_imported(short_tmp: Path) -> None:
    """The same file written with snake_case keys imports identically."""
    raw = [snake("S", last_attached_at=5, transcript_path="/t/S")]
    async with opened(short_tmp) as store:
        result = await import_entries(store, raw)
        assert result.imported == 1
        [row] = await rows(store)
        assert (
            row.agent_session_id,
            row.agent,
            row.last_attached_at,
            row.transcript_path,
        ) == (
            "S",
            "codex",
            5,
            "/t/S",
        )


async def test_bad_entries_are_skipped_with_index_and_reason(short_tmp: Path) -> None:
    """Each bad entry is reported by index with
    a reason; the good ones around it import."""
    raw = [
        camel("good1"),
        "not an object",
        {"agentSessionID": "no-cwd", "agent": "claude"},
        camel("bad-pinned", pinned="yes"),
        camel("bad-time", lastAttachedAt="yesterday"),
        {"agentSessionID": 12, "cwd": "/x", "agent": "claude"},
        camel(""),
        [1, 2],
        None,
        camel("good2"),
    ]
    async with opened(short_tmp) as store:
        result = await import_entries(store, raw)
        assert result.imported == 2
        assert [s.agent_session_id for s in result.sessions] == ["good1", "good2"]
        assert result.skipped == len(result.skips) == 8
        by_index = {s.index: s for s in result.skips}
        assert sorted(by_index) == [1, 2, 3, 4, 5, 6, 7, 8]
        assert "not an object" in by_index[1].reason and "str" in by_index[1].reason
        assert "cwd" in by_index[2].reason
        assert by_index[2].agent_session_id == "no-cwd"
        assert "$.pinned" in by_index[3].reason
        assert "$.last_attached_at" in by_index[4].reason
        assert "$.agent_session_id" in by_index[5].reason
        assert "empty" in by_index[6].reason
        assert "list" in by_index[7].reason
        assert "NoneType" in by_index[8].reason
        assert all(s.reason.startswith("invalid entry: ") for s in result.skips)
        assert sorted(r.agent_session_id for r in await rows(store)) == [
            "good1",
            "good2",
        ]


async def test_bad_snake_case_entry_skip_names_its_agent_session(
    short_tmp: Path,
) -> None:
    """A skipped entry names its agent session id whichever spelling the file used."""
    raw = [
        {"agentSessionID": "camel-no-cwd", "agent": "a"},
        {"agent_session_id": "snake-no-cwd", "agent": "a"},
    ]
    async with opened(short_tmp) as store:
        result = await import_entries(store, raw)
        assert [(s.index, s.agent_session_id) for s in result.skips] == [
            (0, "camel-no-cwd"),
            (1, "snake-no-cwd"),
        ]


async def test_duplicates_keep_the_last_entry(short_tmp: Path) -> None:
    """Entries sharing an agent session id: the
    last one is imported, earlier ones skipped."""
    raw = [
        camel("D", name="first"),
        camel("E"),
        camel("D", name="second"),
        snake("D", name="third"),
    ]
    async with opened(short_tmp) as store:
        result = await import_entries(store, raw)
        assert result.imported == 2
        assert [(s.index, s.agent_session_id) for s in result.skips] == [
            (0, "D"),
            (2, "D"),
        ]
        assert all("superseded by entry" in s.reason for s in result.skips)
        assert {(r.agent_session_id, r.name) for r in await rows(store)} == {
            ("D", "third"),
            ("E", None),
        }


async def test_entries_already_in_the_fleet_are_skipped(short_tmp: Path) -> None:
    """An agent session the fleet already holds is
    skipped naming its session; it is not touched."""
    async with opened(short_tmp) as store:
        existing = await register(store, agent_session_id="OLD", name="kept")
        result = await import_entries(store, [camel("OLD", name="legacy"), camel("NEW")])
        assert result.imported == 1
        [skip] = result.skips
        assert (skip.index, skip.agent_session_id) == (0, "OLD")
        assert existing in skip.reason
        assert {(r.agent_session_id, r.name) for r in await rows(store)} == {
            ("OLD", "kept"),
            ("NEW", None),
        }


async def test_parents_are_mapped_to_minted_ids(short_tmp: Path) -> None:
    """A legacy parent (an agent session id) becomes the parent's
    minted session id; a parent given after its child, a parent
    already in the fleet, and an unknown parent all resolve."""
    async with opened(short_tmp) as store:
        stored = await register(store, agent_session_id="STORED")
        raw = [
            camel("kid", parent="P"),  # parent appears later in the file
            camel("P"),
            camel("kid2", parent="STORED"),  # parent already in the fleet
            camel("orphan", parent="nobody"),
        ]
        result = await import_entries(store, raw)
        ids = minted(result)
        assert result.imported == 4
        assert await parents(store) == {
            stored: None,
            ids["kid"]: ids["P"],
            ids["P"]: None,
            ids["kid2"]: stored,
            ids["orphan"]: None,
        }


async def test_legacy_grandchildren_and_cycles_are_relinked(short_tmp: Path) -> None:
    """Legacy chains are flattened and legacy cycles broken at the first entry."""
    raw = [
        camel("R"),
        camel("C1", parent="R"),
        camel("C2", parent="C1"),
        camel("X", parent="Y"),
        camel("Y", parent="X"),
    ]
    async with opened(short_tmp) as store:
        result = await import_entries(store, raw)
        ids = minted(result)
        assert await parents(store) == {
            ids["R"]: None,
            ids["C1"]: ids["R"],
            ids["C2"]: ids["R"],
            ids["X"]: None,
            ids["Y"]: ids["X"],
        }


async def test_imported_count_and_order(short_tmp: Path) -> None:
    """imported counts exactly the rows written; rows are stored in file order."""
    raw = [camel(f"s{i}") for i in range(25)] + [42]
    async with opened(short_tmp) as store:
        result = await import_entries(store, raw)
        assert (result.imported, result.skipped) == (25, 1)
        assert [r.agent_session_id for r in await rows(store)] == [f"s{i}" for i in range(25)]
        again = await import_entries(store, raw)
        assert (again.imported, again.skipped) == (0, 26)
        assert len(await rows(store)) == 25


async def test_empty_import(short_tmp: Path) -> None:
    """An empty legacy file imports nothing and fails nothing."""
    async with opened(short_tmp) as store:
        result = await import_entries(store, [])
        assert (result.imported, result.skipped, result.sessions) == (0, 0, [])
