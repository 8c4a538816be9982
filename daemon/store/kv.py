"""Soft-state key-value rows: UI cursors, dashboard caches, last-seen markers.

Invariant (documented in docs/protocol.md): nothing that drives control flow
lives here. Losing any row must never cause a double execution, a reordering or
a stuck loop; what does drive control flow has typed columns in the dispatch,
worker, lease and effect tables, with their fences.
"""

from __future__ import annotations

from towerd.daemon.store import quota
from towerd.daemon.store.tx import Caller, Tx, pack, take_page, unpack
from towerd.protocol.errors import BadArgs, NotFound
from towerd.protocol.methods import (
    KvDeleteResult,
    KvEntry,
    KvKeyParams,
    KvListParams,
    KvListResult,
    KvSetParams,
)


def set_value(tx: Tx, caller: Caller, params: KvSetParams) -> KvEntry:
    """Write a value; a new row counts for the caller's principal (who created it keeps
    it, whoever overwrites it later), so one past its quota is refused, an overwrite
    never is."""
    scope, scope_id, key, value = params.scope, params.scope_id, params.key, params.value
    max_bytes, principal, quota_rows = (
        tx.config.kv_max_value, caller.principal, tx.config.quota_rows
    )  # fmt: skip
    packed = pack(value)
    if len(packed) > max_bytes:
        raise BadArgs(
            f"the value of {scope}/{scope_id}/{key} is {len(packed)} bytes as msgpack; "
            f"the limit is {max_bytes}",
            {"bytes": len(packed), "max_bytes": max_bytes},
        )
    quota.require_room(
        tx, principal, "kv", quota_rows, lambda: not _exists(tx, scope, scope_id, key)
    )
    tx.conn.execute(
        """INSERT INTO kv (scope, scope_id, key, value, updated_at, principal)
           VALUES (?, ?, ?, ?, ?, ?)
           ON CONFLICT (scope, scope_id, key)
           DO UPDATE SET value = excluded.value, updated_at = excluded.updated_at""",
        (scope, scope_id, key, packed, tx.now, principal),
    )
    return KvEntry(scope, scope_id, key, value, tx.now)


def _exists(tx: Tx, scope: str, scope_id: str, key: str) -> bool:
    return (
        tx.conn.execute(
            "SELECT 1 FROM kv WHERE scope = ? AND scope_id = ? AND key = ?", (scope, scope_id, key)
        ).fetchone()
        is not None
    )


def get_value(tx: Tx, caller: Caller, params: KvKeyParams) -> KvEntry:
    scope, scope_id, key = params.scope, params.scope_id, params.key
    row = tx.conn.execute(
        "SELECT value, updated_at FROM kv WHERE scope = ? AND scope_id = ? AND key = ?",
        (scope, scope_id, key),
    ).fetchone()
    if row is None:
        raise NotFound(
            f"no value {key!r} in {scope} scope {scope_id!r}",
            {"scope": scope, "scope_id": scope_id, "key": key},
        )
    return KvEntry(scope, scope_id, key, unpack(row[0]), row[1])


def delete_value(tx: Tx, caller: Caller, params: KvKeyParams) -> KvDeleteResult:
    scope, scope_id, key = params.scope, params.scope_id, params.key
    deleted = tx.conn.execute(
        "DELETE FROM kv WHERE scope = ? AND scope_id = ? AND key = ?", (scope, scope_id, key)
    ).rowcount
    return KvDeleteResult(deleted=deleted > 0)


def list_values(tx: Tx, caller: Caller, params: KvListParams) -> KvListResult:
    """By key, paged: ``next_after`` continues after the last key of a page."""
    scope, scope_id, after, limit = params.scope, params.scope_id, params.after, params.limit
    byte_budget = tx.config.page_bytes
    rows = tx.conn.execute(
        "SELECT key, value, updated_at FROM kv WHERE scope = ? AND scope_id = ? AND key > ? "
        "ORDER BY key LIMIT ?",
        (scope, scope_id, after if after is not None else "", limit + 1),
    ).fetchall()
    entries = [(key, KvEntry(scope, scope_id, key, unpack(value), at)) for key, value, at in rows]
    page, next_after = take_page(entries, limit, byte_budget)
    return KvListResult(entries=page, next_after=next_after)  # type: ignore[arg-type]  # a key
