"""Per-principal quotas on the rows a client can create without bound.

Idempotency keys, soft-state values, messages, hook events, effects, leases and
lease tokens are each counted per principal in ``quota_usage``, by triggers on
insert, delete and change of owner (schema step 6): the count is exact whatever
path deletes a row (a request, expiry, retention, a dead holder's release), and
reading it is one primary-key lookup. A write that would create a row past the
principal's quota for that table is refused ``quota_exceeded`` before it writes
anything. A row is counted for the principal that created it (for an effect or a
lease, the one that holds it now); rows from before step 6 count for nobody.

A principal is named by the client itself (``hello``): a quota stops one runaway
client, not a hostile one of the same uid, which may name new principals.
"""

from __future__ import annotations

from collections.abc import Callable

from towerd.daemon.store.tx import Tx
from towerd.protocol.errors import QuotaExceeded

DEFAULT_ROWS = 1_000_000

# What frees a table's rows, for the refusal's message.
_FREED_BY = {
    "idempotency": "completed keys expire after --completed-ttl; release keys whose effect "
    "never started, resolve outcome_unknown ones",
    "kv": "delete values you no longer need (kv.delete)",
    "messages": "messages are pruned after --message-retention-days",
    "events": "hook events are pruned by age and count (--event-retention-days, "
    "--events-per-session, --events-per-principal)",
    "effects": "settled effects are pruned after --effect-retention-days",
    "leases": "release leases you no longer need; lapsed ones are pruned",
    "lease_tokens": "the token records of released leases are pruned with the expiry sweep",
}


def usage(tx: Tx, principal: str, table: str) -> int:
    """How many rows of ``table`` count for ``principal``."""
    row = tx.conn.execute(
        "SELECT rows FROM quota_usage WHERE principal = ? AND tbl = ?", (principal, table)
    ).fetchone()
    return 0 if row is None else row[0]


def has_room(tx: Tx, principal: str, table: str, limit: int) -> bool:
    """Whether ``principal`` may create another row of ``table``."""
    return usage(tx, principal, table) < limit


def require_room(
    tx: Tx,
    principal: str | None,
    table: str,
    limit: int,
    creates_row: Callable[[], bool] | None = None,
) -> None:
    """Refuse, before anything is written, a new row of ``table`` for a principal that
    already has ``limit`` of them. ``creates_row`` (asked only at the limit) tells an
    upsert that only overwrites a row, which is never refused. Writes of no principal
    (internal callers) are not counted and never refused."""
    if principal is None:
        return
    rows = usage(tx, principal, table)
    if rows < limit or (creates_row is not None and not creates_row()):
        return
    raise QuotaExceeded(
        f"{principal} already has {rows} rows in {table}, its quota (towerd --quota {limit}); "
        f"nothing was written. {_FREED_BY[table][0].upper()}{_FREED_BY[table][1:]}, "
        "or ask the operator to raise --quota",
        {"table": table, "limit": limit, "rows": rows, "principal": principal},
    )
