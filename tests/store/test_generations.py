"""The database's generation while the daemon runs (daemon/store/identity.py): every
generation the store wrote, or may have written, stays accepted by its own write
batches, which refuse a database holding any other (an older copy written over it)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from store_helpers import opened, query

pytestmark = [pytest.mark.anyio, pytest.mark.sqlite_only]  # PostgreSQL has no generation


async def test_a_rotation_whose_caller_went_away_leaves_the_store_serving(
    short_tmp: Path,
) -> None:
    """A backup's rotation cancelled once its write was queued: the write commits all
    the same (a queued write stands), and the store then refused its own next write as
    if an older copy had been written over the database (a review's reproducer). The
    generation it may have written stays accepted."""
    async with opened(short_tmp) as store:
        before = store.generation
        queue_write = store.write

        def write(fn: Any, *args: Any) -> Any:
            future = queue_write(fn, *args)
            if store._rotating_to is not None:
                rotation.cancel()  # its caller goes away; the write is queued
            return future

        store.write = write  # type: ignore[method-assign]
        rotation = asyncio.ensure_future(store.new_generation())
        with pytest.raises(asyncio.CancelledError):
            await rotation
        del store.write
        await store.write(lambda tx: None)  # after the rotation's batch
        assert store.lost_reason is None
        [(stored,)] = await store.read(
            lambda tx: tx.conn.execute("SELECT value FROM meta WHERE key = 'generation'").fetchall()
        )
    assert stored != before  # the rotation's write committed
    assert query(short_tmp, "SELECT value FROM meta WHERE key = 'generation'") == [(stored,)]
