"""Soft key-value state in the store: set, get, delete, list, the size limit, scopes and
msgpack round trips, on a real SQLite file.

Reads go through ``store.read_now`` (the loop's own read connection) as ``kv.get``'s
route does, and ``store.read`` as ``kv.list``'s does; every call is ``fn(tx, caller,
params)`` as in daemon/handlers.py. The clock of a write is moved by running it on a
shifted Tx, never by sleeping; a size limit or byte budget by running it on a Tx whose
config carries it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from store_helpers import at, caller, opened
from towerd.daemon.store import Store, kv
from towerd.daemon.store.tx import Tx, pack
from towerd.protocol.errors import BadArgs, NotFound
from towerd.protocol.methods import (
    DEFAULT_KV_MAX_VALUE,
    KvDeleteResult,
    KvEntry,
    KvKeyParams,
    KvListParams,
    KvListResult,
    KvSetParams,
)

pytestmark = pytest.mark.anyio

LIMIT = DEFAULT_KV_MAX_VALUE
BIG_BUDGET = 1 << 30
WHO = caller()  # who asks: kv rows are shared, a new one counts for its principal's quota


def configured(fn: Callable[..., Any], **settings: Any) -> Callable[..., Any]:
    """``fn`` run on a Tx whose config has ``settings`` (as ``towerd --kv-max-value`` etc.)."""

    def run(tx: Tx, *args: Any) -> Any:
        config = dataclasses.replace(tx.config, **settings)
        return fn(msgspec.structs.replace(tx, config=config), *args)

    return run


async def put(
    store: Store, key: str, value: Any, scope: str = "global", scope_id: str = "",
    shift: int = 0, max_bytes: int = LIMIT,
) -> KvEntry:  # fmt: skip
    fn = configured(at(shift, kv.set_value), kv_max_value=max_bytes)
    params = KvSetParams(scope=scope, key=key, value=value, scope_id=scope_id)
    return await store.write(fn, WHO, params)


def get(store: Store, key: str, scope: str = "global", scope_id: str = "") -> KvEntry:
    return store.read_now(kv.get_value, WHO, KvKeyParams(scope=scope, key=key, scope_id=scope_id))


async def delete(
    store: Store, key: str, scope: str = "global", scope_id: str = ""
) -> KvDeleteResult:
    params = KvKeyParams(scope=scope, key=key, scope_id=scope_id)
    return await store.write(kv.delete_value, WHO, params)


async def list_page(
    store: Store, scope: str, scope_id: str, after: str | None, limit: int, budget: int
) -> KvListResult:
    """One ``kv.list`` page under a byte budget of ``budget`` (a frame twice that size)."""
    params = KvListParams(scope=scope, scope_id=scope_id, after=after, limit=limit)
    return await store.read(configured(kv.list_values, max_frame=2 * budget), WHO, params)


async def rows(store: Store) -> list[tuple[Any, ...]]:
    return await store.read(
        lambda tx: tx.conn.execute(
            "SELECT scope, scope_id, key, value, updated_at FROM kv ORDER BY scope, scope_id, key"
        ).fetchall()
    )


async def test_set_get_and_overwrite(short_tmp: Path) -> None:
    """set answers the entry as stored (msgpack bytes, its write time); get reads it
    back; an overwrite replaces the value and moves updated_at, in one row."""
    async with opened(short_tmp) as store:
        first = await put(store, "cursor", {"page": 1})
        assert (first.scope, first.scope_id, first.key, first.value) == (
            "global", "", "cursor", {"page": 1},
        )  # fmt: skip
        assert await rows(store) == [("global", "", "cursor", pack({"page": 1}), first.updated_at)]
        assert get(store, "cursor") == first

        second = await put(store, "cursor", [2, "two"], shift=5_000)
        assert second.updated_at >= first.updated_at + 5_000
        assert get(store, "cursor") == KvEntry(
            "global", "", "cursor", [2, "two"], second.updated_at
        )
        assert await rows(store) == [("global", "", "cursor", pack([2, "two"]), second.updated_at)]


async def test_get_missing_is_not_found(short_tmp: Path) -> None:
    """A key that was never set, or was deleted, is NotFound naming scope, id and key."""
    async with opened(short_tmp) as store:
        with pytest.raises(NotFound) as missing:
            get(store, "nope", "worker", "w1")
        assert missing.value.code == "not_found"
        assert missing.value.data == {"scope": "worker", "scope_id": "w1", "key": "nope"}


async def test_delete_answers_whether_it_deleted(short_tmp: Path) -> None:
    """delete: deleted True the first time, False after; the value is gone; another
    key is untouched."""
    async with opened(short_tmp) as store:
        await put(store, "a", 1)
        kept = await put(store, "b", 2)
        assert await delete(store, "a") == KvDeleteResult(True)
        assert await delete(store, "a") == KvDeleteResult(False)
        assert await delete(store, "never") == KvDeleteResult(False)
        with pytest.raises(NotFound):
            get(store, "a")
        assert get(store, "b") == kept


async def test_the_size_limit_is_on_the_msgpack_bytes(short_tmp: Path) -> None:
    """A value exactly at the limit as msgpack is stored; one byte over is BadArgs with
    the sizes, and writes nothing (not even over an existing value)."""
    at_limit = b"x" * (LIMIT - 3)  # bin16: 3 header bytes
    over = b"x" * (LIMIT - 2)
    assert (len(pack(at_limit)), len(pack(over))) == (LIMIT, LIMIT + 1)
    async with opened(short_tmp) as store:
        stored = await put(store, "blob", at_limit)
        assert get(store, "blob").value == at_limit
        with pytest.raises(BadArgs) as too_big:
            await put(store, "blob", over)
        assert too_big.value.code == "bad_args"
        assert too_big.value.data == {"bytes": LIMIT + 1, "max_bytes": LIMIT}
        with pytest.raises(BadArgs):
            await put(store, "other", over)
        assert get(store, "blob") == stored
        assert [row[2] for row in await rows(store)] == ["blob"]

        # The limit is the configured one: a smaller --kv-max-value counts the same way.
        assert len(pack("abc")) == 4
        await put(store, "small", "abc", max_bytes=4)
        with pytest.raises(BadArgs):
            await put(store, "small", "abcd", max_bytes=4)


async def test_scopes_and_scope_ids_isolate_keys(short_tmp: Path) -> None:
    """The same key in global, worker w1, worker w2 and milestone w1 is four values;
    deleting one leaves the others."""
    places = [("global", ""), ("worker", "w1"), ("worker", "w2"), ("milestone", "w1")]
    async with opened(short_tmp) as store:
        for n, (scope, scope_id) in enumerate(places):
            await put(store, "last_seen", n, scope, scope_id)
        for n, (scope, scope_id) in enumerate(places):
            assert get(store, "last_seen", scope, scope_id).value == n
        with pytest.raises(NotFound):
            get(store, "last_seen", "global", "w1")
        deleted = await delete(store, "last_seen", "worker", "w1")
        assert deleted.deleted is True
        assert [(r[0], r[1]) for r in await rows(store)] == [
            ("global", ""), ("milestone", "w1"), ("worker", "w2"),
        ]  # fmt: skip
        listed = await list_page(store, "worker", "w2", None, 10, BIG_BUDGET)
        assert [(e.key, e.value) for e in listed.entries] == [("last_seen", 2)]


async def test_list_by_key_with_paging_and_a_byte_budget(short_tmp: Path) -> None:
    """kv.list: entries of one scope by key, ``limit`` a page with next_after the last
    key when more remain; a byte budget cuts a page short, never below one entry."""
    keys = ["a", "b", "c", "d", "e", "f", "g"]
    async with opened(short_tmp) as store:
        for n, k in enumerate(reversed(keys)):
            await put(store, k, {"n": n, "pad": "p" * 100}, "milestone", "M001")
        await put(store, "zzz", "elsewhere", "milestone", "M002")

        async def page(after: str | None, limit: int, budget: int = BIG_BUDGET) -> Any:
            return await list_page(store, "milestone", "M001", after, limit, budget)

        seen, after, sizes = [], None, []
        while True:
            result = await page(after, 3)
            seen += [e.key for e in result.entries]
            sizes.append(len(result.entries))
            if result.next_after is None:
                break
            assert result.next_after == result.entries[-1].key
            after = result.next_after
        assert (seen, sizes) == (keys, [3, 3, 1])

        whole = await page(None, 7)
        assert ([e.key for e in whole.entries], whole.next_after) == (keys, None)
        assert whole.entries[0] == get(store, "a", "milestone", "M001")
        assert ([e.key for e in (await page("g", 5)).entries]) == []
        assert [e.key for e in (await page("bb", 2)).entries] == ["c", "d"]

        one = len(pack(whole.entries[0]))
        cut = await page(None, 7, budget=2 * one + one // 2)
        assert ([e.key for e in cut.entries], cut.next_after) == (["a", "b"], "b")
        tiny = await page(None, 7, budget=1)
        assert ([e.key for e in tiny.entries], tiny.next_after) == (["a"], "a")
        empty = await list_page(store, "global", "", None, 10, BIG_BUDGET)
        assert (empty.entries, empty.next_after) == ([], None)


VALUES: dict[str, Any] = {
    "none": None,
    "true": True,
    "false": False,
    "zero": 0,
    "int64-min": -(2**63),
    "int64-max": 2**63 - 1,
    "uint64-max": 2**64 - 1,
    "negative": -1,
    "float": 1.5,
    "float-tiny": 5e-324,
    "float-huge": 1.7976931348623157e308,
    "negative-zero": -0.0,
    "infinity": math.inf,
    "string": "héllo \u2603 \x00 tail",
    "empty-string": "",
    "bytes": bytes(range(256)),
    "empty-bytes": b"",
    "list": [1, "two", None, [3.5, [b"\x00"]]],
    "empty-list": [],
    "map": {"a": 1, "b": {"c": [True, {"d": None}]}},
    "empty-map": {},
    "int-keys": {1: "one", -2: ["minus", "two"]},
    "nested": {"runs": [{"id": 1, "tags": ["x", "y"], "blob": b"\xff\xfe", "score": -2.25}]},
}


async def test_every_msgpack_type_round_trips(short_tmp: Path) -> None:
    """What set stores, get and list answer back equal and of the same types."""

    def same(a: Any, b: Any) -> bool:
        if isinstance(a, dict):
            return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        if isinstance(a, list):
            return isinstance(b, list) and len(a) == len(b) and all(map(same, a, b))
        if isinstance(a, float) and a == 0:
            return isinstance(b, float) and math.copysign(1, a) == math.copysign(1, b)
        return type(a) is type(b) and a == b

    async with opened(short_tmp) as store:
        for name, value in VALUES.items():
            await put(store, name, value, "worker", "w1")
        for name, value in VALUES.items():
            assert same(value, get(store, name, "worker", "w1").value), name
        listed = await list_page(store, "worker", "w1", None, 100, BIG_BUDGET)
        assert [e.key for e in listed.entries] == sorted(VALUES)
        for entry in listed.entries:
            assert same(VALUES[entry.key], entry.value), entry.key
