"""Read by mypy in .ci/run, never run: the public client API is typed.

Each ``assert_type`` fails (the checker sees ``Any``) if a method loses its result
type; each ``type: ignore[...]`` fails as unused (``warn_unused_ignores``) if a
misspelt key or a wrong value type stops being caught.
"""

from __future__ import annotations

from typing import assert_type

from towerd.client import AsyncClient, Client
from towerd.client.results import (
    EffectClaimResult,
    FleetListResult,
    IdemClaimResult,
    SessionRow,
    StatusResult,
)


def blocking(client: Client, session_id: str) -> None:
    assert_type(client.fleet_get(session_id), SessionRow)
    assert_type(client.status(), StatusResult)
    assert_type(client.idem_claim("deploy", "k1"), IdemClaimResult)
    page = client.fleet_list(limit=10)
    assert_type(page, FleetListResult)
    assert_type(page["sessions"][0]["cwd"], str)
    for row in client.iter_fleet():
        assert_type(row, SessionRow)
    client.fleet_get(session_id)["cwdd"]  # type: ignore[typeddict-item]
    count: str = client.status()["pid"]  # type: ignore[assignment]
    del count


async def awaited(client: AsyncClient, session_id: str) -> None:
    assert_type(await client.fleet_get(session_id), SessionRow)
    assert_type(await client.effect_claim("r", "s", "a", "git-push", "t"), EffectClaimResult)
    async for row in client.iter_fleet():
        assert_type(row, SessionRow)
    (await client.status())["daemon_idd"]  # type: ignore[typeddict-item]
