"""Every agent process of a session (schema step 11, ``session_agents``): a file made
before the step keeps each session's agent, found as before."""

from __future__ import annotations

from pathlib import Path

import pytest

from store_helpers import opened, query, register
from towerd.daemon.processes import Holder
from towerd.daemon.store import fleet, schema

pytestmark = pytest.mark.anyio

P1, P2 = Holder(4242, 1111), Holder(4343, 2222)


@pytest.mark.sqlite_only
async def test_a_version_10_file_keeps_each_sessions_agent(
    short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(schema, "MIGRATIONS", schema.MIGRATIONS[:10])
    monkeypatch.setattr(schema, "SCHEMA_VERSION", 10)
    async with opened(short_tmp) as store:
        session = await register(store)

        def bound(tx):  # what the version-10 code wrote for a hook of P1
            tx.conn.execute(
                "UPDATE sessions SET agent_pid = ?, agent_start = ?, live = 1, "
                "agent_named_at = 5 WHERE session_id = ?",
                (P1.pid, P1.start, session),
            )

        await store.write(bound)
    monkeypatch.undo()
    assert query(short_tmp, "PRAGMA user_version") == [(10,)]
    async with opened(short_tmp) as store:
        assert await store.read(lambda tx: fleet.session_of_agent(tx, P1)) == session
        # A second process of the same session: both are found as its agent, the row
        # names the one that hooked last, and each one's death leaves the other's.
        await store.write(lambda tx: fleet.bind_agent(tx, session, P2, naming=False))
        assert await store.read(lambda tx: fleet.session_of_agent(tx, P1)) == session
        assert await store.read(lambda tx: fleet.session_of_agent(tx, P2)) == session
        assert await store.read(lambda tx: fleet.agent_holder(tx, session)) == P2
        assert await store.write(lambda tx: fleet.agents_gone(tx, [P2])) == []
        assert await store.read(lambda tx: fleet.agent_holder(tx, session)) == P1
        assert await store.write(lambda tx: fleet.agents_gone(tx, [P1])) == [session]
        assert await store.read(lambda tx: fleet.session_of_agent(tx, P1)) is None
    assert query(short_tmp, "PRAGMA user_version") == [(schema.SCHEMA_VERSION,)]
