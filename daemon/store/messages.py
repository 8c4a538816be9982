"""Messages left for a session (by an operator or another agent), with their status.

``session.message`` with an idempotency key claims, inserts and completes the key
in one transaction, like ``session.register``, so a retry answers the same
message id and never stores a second copy. A key left ``outcome_unknown`` (an
``idem.claim`` under operation ``session.message`` whose claimant died) is settled
by reconciliation's evidence probe (``reconcile.EVIDENCE_PROBES``): the message row
named by its effect_ref.
Status only moves forward: queued, delivered, read.
Messages older than the retention (``--message-retention-days``, by when they were
sent, whatever their status) are pruned with the expiry sweep (:func:`prune`).
"""

from __future__ import annotations

import msgspec

from towerd.daemon.store import fleet, quota
from towerd.daemon.store.idempotency import once_under_key
from towerd.daemon.store.ids import random_uuid
from towerd.daemon.store.tx import Caller, Tx, fitted
from towerd.protocol import fields
from towerd.protocol.errors import Conflict, NotFound
from towerd.protocol.methods import (
    MessageAckParams,
    MessageListParams,
    MessageListResult,
    MessageRecord,
    SessionMessageParams,
    SessionMessageResult,
)

MESSAGE_OPERATION = fields.MESSAGE_OPERATION
_ORDER = {status: rank for rank, status in enumerate(fields.MESSAGE_STATUSES)}
_COLUMNS = "message_id, session_id, agent_session_id, text, status, created_at, updated_at"


def send(tx: Tx, caller: Caller, params: SessionMessageParams) -> SessionMessageResult:
    """Queue a message (a new row for ``principal``'s quota, and with a key a new key too:
    both are checked before anything is written; a replay creates neither)."""
    principal, holder, quota_rows = caller.principal, caller.holder, tx.config.quota_rows
    if params.idempotency_key is None:
        message_id = _insert(tx, principal, params.session_id, params.text, quota_rows)
        return SessionMessageResult(message_id, "queued")

    def create() -> dict[str, str]:
        message_id = _insert(tx, principal, params.session_id, params.text, quota_rows, keyed=True)
        return {"message_id": message_id, "status": "queued"}

    result = once_under_key(
        tx, principal, MESSAGE_OPERATION, params, holder, create, "message_id", "a message"
    )
    current = _load(tx, result["message_id"])  # a retry reports where it stands now
    return SessionMessageResult(result["message_id"], current.status if current else "queued")


def _insert(
    tx: Tx, principal: str, session_id: str, text: str, quota_rows: int, *, keyed: bool = False
) -> str:
    _parent, agent_session_id = fleet.require_own_row(tx, session_id)
    if keyed:  # the key is inserted after the message
        quota.require_room(tx, principal, "idempotency", quota_rows)
    quota.require_room(tx, principal, "messages", quota_rows)
    message_id = random_uuid()
    tx.conn.execute(
        f"""INSERT INTO messages ({_COLUMNS}, daemon_id, principal)
            VALUES (?, ?, ?, ?, 'queued', ?, ?, ?, ?)""",
        (message_id, session_id, agent_session_id, text, tx.now, tx.now, tx.daemon_id, principal),
    )
    return message_id


def _load(tx: Tx, message_id: str) -> MessageRecord | None:
    row = tx.conn.execute(
        f"SELECT {_COLUMNS} FROM messages WHERE message_id = ?", (message_id,)
    ).fetchone()
    return None if row is None else MessageRecord(*row)


def list_messages(tx: Tx, caller: Caller, params: MessageListParams) -> MessageListResult:
    """The oldest ``limit`` messages of a session (a queue is read from its head), cut to
    fit a frame."""
    session_id, status, limit = params.session_id, params.status, params.limit
    where, args = "session_id = ?", [session_id]
    if status is not None:
        where += " AND status = ?"
        args.append(status)
    rows = tx.conn.execute(
        f"SELECT {_COLUMNS} FROM messages WHERE {where} ORDER BY created_at, rowid LIMIT ?",
        (*args, limit),
    ).fetchall()
    listed = MessageListResult(messages=[MessageRecord(*row) for row in rows])
    return fitted(listed, tx.config.page_bytes)


def ack(tx: Tx, caller: Caller, params: MessageAckParams) -> MessageRecord:
    """Move a message forward (queued -> delivered -> read); acking again is a no-op."""
    message_id, status = params.message_id, params.status
    current = _load(tx, message_id)
    if current is None:
        raise NotFound(f"no message {message_id}", {"message_id": message_id})
    if _ORDER[status] < _ORDER[current.status]:
        raise Conflict(
            f"message {message_id} is already {current.status}; status only moves forward",
            {"message_id": message_id, "status": current.status},
        )
    if status != current.status:
        tx.conn.execute(
            "UPDATE messages SET status = ?, updated_at = ? WHERE message_id = ?",
            (status, tx.now, message_id),
        )
        current = msgspec.structs.replace(current, status=status, updated_at=tx.now)
    return current


def prune(tx: Tx, cutoff: int, limit: int) -> int:
    """Up to ``limit`` messages sent before ``cutoff``, oldest first."""
    return tx.conn.execute(
        """DELETE FROM messages WHERE rowid IN (
               SELECT rowid FROM messages WHERE created_at < ? ORDER BY created_at LIMIT ?)""",
        (cutoff, limit),
    ).rowcount
