"""Idempotency keys: ``in_progress`` -> ``completed``, or ``outcome_unknown`` when unprovable.

A key is scoped to (principal, operation, key). The rule that matters: an
effect whose outcome cannot be proven is never run again under its key. A
retry of an ``outcome_unknown`` key is answered ``outcome_unknown`` until an
operator resolves it, or until its claimant (who knows) completes it.
"""

from __future__ import annotations

import hashlib
import json
import shlex
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import msgspec

from towerd.daemon.processes import Holder, is_alive
from towerd.daemon.store import quota
from towerd.daemon.store.ids import random_uuid
from towerd.daemon.store.tx import (
    Caller,
    Tx,
    holder_at,
    note,
    pack,
    pack_canonical,
    take_page,
    unpack,
    where,
)
from towerd.protocol import fields
from towerd.protocol.changes import IdemChanged, IdemExpired, idem_changed
from towerd.protocol.errors import (
    Conflict,
    IdempotencyConflict,
    IdempotencyInProgress,
    IdempotencyKeyUnknown,
    OutcomeUnknown,
)
from towerd.protocol.methods import (
    IdemClaimParams,
    IdemClaimResult,
    IdemCompleteParams,
    IdemKeyParams,
    IdemListParams,
    IdemListResult,
    IdemRecord,
    IdemReleaseParams,
    IdemReleaseResult,
    IdemReopenParams,
    IdemReopenResult,
    IdemResolveParams,
    IdemResolveResult,
    KeyCounts,
    ProbeOutcome,
)

IN_PROGRESS, COMPLETED, OUTCOME_UNKNOWN = fields.IDEM_STATES


def payload_hash(payload: Any) -> bytes:
    """SHA-256 of the canonical (sorted-keys) msgpack encoding; no payload hashes as null."""
    if payload is None:
        return _NULL_HASH  # most claims (a hook's) carry none
    return hashlib.sha256(pack_canonical(payload)).digest()


_NULL_HASH = hashlib.sha256(pack_canonical(None)).digest()


_RECORD_COLUMNS = (
    "operation, key, state, effect_ref, result, created_at, updated_at, holder_pid, "
    "payload_hash, holder_start, attempt"
)


@dataclass(frozen=True, slots=True)
class _Row:
    record: IdemRecord
    payload_hash: bytes
    holder: Holder | None
    attempt: str | None


def _row(values: tuple[Any, ...]) -> _Row:
    (
        operation,
        key,
        state,
        effect_ref,
        result,
        created_at,
        updated_at,
        pid,
        digest,
        start,
        attempt,
    ) = values
    return _Row(
        record=IdemRecord(
            operation=operation,
            key=key,
            state=state,
            effect_ref=effect_ref,
            result=unpack(result),
            created_at=created_at,
            updated_at=updated_at,
            holder_pid=pid,
        ),
        payload_hash=digest,
        holder=None if pid is None or start is None else Holder(pid, start),
        attempt=attempt,
    )


# Built once: every claim, complete and point read runs it (a statement is looked up
# in sqlite3's cache by its text, so an f-string per call costs a new string and hash).
_LOAD = (
    f"SELECT {_RECORD_COLUMNS} FROM idempotency WHERE principal = ? AND operation = ? AND key = ?"
)


def _load(tx: Tx, principal: str, operation: str, key: str) -> _Row | None:
    values = tx.conn.execute(_LOAD, (principal, operation, key)).fetchone()
    return None if values is None else _row(values)


def _require(tx: Tx, principal: str, operation: str, key: str) -> _Row:
    row = _load(tx, principal, operation, key)
    if row is None:
        raise IdempotencyKeyUnknown(
            f"no idempotency key {key!r} for operation {operation!r}",
            {"operation": operation, "key": key},
        )
    return row


def _set_state(tx: Tx, principal: str, row: _Row, state: str, result: Any = None) -> IdemRecord:
    """Move a key to ``state``; returns the record as now stored (without reading it back)."""
    packed = pack(result) if state == COMPLETED else None
    tx.conn.execute(
        "UPDATE idempotency SET state = ?, result = ?, updated_at = ? "
        "WHERE principal = ? AND operation = ? AND key = ?",
        (state, packed, tx.now, principal, row.record.operation, row.record.key),
    )
    record = msgspec.structs.replace(
        row.record, state=state, result=unpack(packed), updated_at=tx.now
    )
    note(tx, "idem", idem_changed(principal, record))
    return record


def _refuse_unsettled(row: _Row, caller: Holder | None) -> None:
    """The answer to anyone who meets a key that is not completed."""
    record = row.record
    if record.state == IN_PROGRESS:
        raise IdempotencyInProgress(
            f"key {record.key!r} of {record.operation!r} is in progress (holder pid "
            f"{record.holder_pid}); wait for it, or retry later",
            {
                "effect_ref": record.effect_ref,
                "holder_pid": record.holder_pid,
                "held_by_caller": caller is not None and caller == row.holder,
            },
        )
    raise OutcomeUnknown(
        f"the outcome of key {record.key!r} of {record.operation!r} is unknown; its effect "
        "is never run again under this key: check the effect, then settle it with idem.resolve "
        f"(towerctl idem resolve {shlex.quote(record.operation)} {shlex.quote(record.key)} "
        "--outcome completed|abandoned)",
        {"effect_ref": record.effect_ref},
    )


def _refused(operation: str, key: str, why: str, **data: Any) -> Conflict:
    """``conflict`` for a request this key's state does not allow: ``key 'k' of 'op' <why>``."""
    return Conflict(
        f"key {key!r} of {operation!r} {why}", {"operation": operation, "key": key, **data}
    )


def claim(tx: Tx, caller: Caller, params: IdemClaimParams) -> IdemClaimResult:
    """Claim a key for ``caller.holder``, or answer what it already holds (checked in the
    documented order).

    A retry carrying the same ``attempt`` token as the claim that created an
    ``in_progress`` key is that claim repeated (its answer was lost), so it is
    answered ``claimed`` again. An ``outcome_unknown`` key is never re-claimed. A new
    key past the principal's quota is refused ``quota_exceeded``, a replay never is.
    """
    principal, holder = caller.principal, caller.holder
    digest = payload_hash(params.payload)
    if not params.replay_only and quota.has_room(
        tx, principal, "idempotency", tx.config.quota_rows
    ):
        # The usual claim, a new key: one INSERT that does nothing when the key exists
        # (then it is answered below, as it stands), instead of a SELECT first.
        claimed = _insert_claim(tx, principal, params, digest, holder, if_new=True)
        if claimed is not None:
            return claimed
    row = _load(tx, principal, params.operation, params.key)
    if row is not None:
        if row.payload_hash != digest:
            raise IdempotencyConflict(
                f"key {params.key!r} of {params.operation!r} was claimed with a different "
                "payload; a retry must send the same payload",
                {"operation": params.operation, "key": params.key, "state": row.record.state},
            )
        if row.record.state == COMPLETED:
            return IdemClaimResult("completed", row.record.effect_ref, row.record.result)
        if row.record.state == IN_PROGRESS and params.attempt and params.attempt == row.attempt:
            return IdemClaimResult("claimed", row.record.effect_ref)  # its answer was lost
        _refuse_unsettled(row, holder)
    if params.replay_only:
        raise IdempotencyKeyUnknown(
            f"no idempotency key {params.key!r} for operation {params.operation!r} "
            "(replay_only: nothing recorded)",
            {"operation": params.operation, "key": params.key},
        )
    quota.require_room(tx, principal, "idempotency", tx.config.quota_rows)
    claimed = _insert_claim(tx, principal, params, digest, holder, if_new=False)
    assert claimed is not None  # a plain INSERT inserts or raises
    return claimed


def _insert_claim(
    tx: Tx,
    principal: str,
    params: IdemClaimParams,
    digest: bytes,
    holder: Holder | None,
    *,
    if_new: bool,
) -> IdemClaimResult | None:
    """Insert ``params``' key ``in_progress``: its answer, or None when ``if_new`` and the
    key exists (nothing was written)."""
    effect_ref = params.effect_ref or random_uuid()
    inserted = insert(
        tx,
        principal,
        params.operation,
        params.key,
        digest,
        IN_PROGRESS,
        effect_ref,
        None,
        holder,
        attempt=params.attempt,
        probe=params.probe,
        probe_cwd=params.probe_cwd,
        if_new=if_new,
    )
    return IdemClaimResult("claimed", effect_ref) if inserted else None


_INSERT = """INSERT INTO idempotency (principal, operation, key, payload_hash, state, effect_ref,
        result, holder_pid, holder_start, attempt, daemon_id, created_at, updated_at,
        probe, probe_cwd)
    VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"""
_INSERT_IF_NEW = f"{_INSERT} ON CONFLICT DO NOTHING"


def insert(
    tx: Tx,
    principal: str,
    operation: str,
    key: str,
    digest: bytes,
    state: str,
    effect_ref: str,
    result: Any,
    holder: Holder | None,
    *,
    attempt: str | None = None,
    probe: str | None = None,
    probe_cwd: str | None = None,
    if_new: bool = False,
) -> bool:
    """Insert a key; with ``if_new``, nothing when it exists. Whether it was inserted."""
    inserted = tx.conn.execute(
        _INSERT_IF_NEW if if_new else _INSERT,
        (
            principal,
            operation,
            key,
            digest,
            state,
            effect_ref,
            pack(result) if state == COMPLETED else None,
            holder.pid if holder else None,
            holder.start if holder else None,
            attempt,
            tx.daemon_id,
            tx.now,
            tx.now,
            probe,
            probe_cwd,
        ),
    ).rowcount
    if inserted != 1:
        return False
    note(tx, "idem", IdemChanged(principal, operation, key, state, effect_ref))
    return True


def replay_or_refuse(
    tx: Tx, principal: str, operation: str, key: str, digest: bytes, holder: Holder | None
) -> IdemRecord | None:
    """For methods that claim and complete in one transaction: the completed record to
    replay, or None when the key is new; refuses a key in any other state."""
    row = _load(tx, principal, operation, key)
    if row is None:
        return None
    if row.payload_hash != digest:
        raise IdempotencyConflict(
            f"key {key!r} of {operation!r} was used with different params; "
            "a retry must send the same params",
            {"operation": operation, "key": key, "state": row.record.state},
        )
    if row.record.state == COMPLETED:
        return row.record
    _refuse_unsettled(row, holder)
    return None  # unreachable: _refuse_unsettled always raises


def once_under_key(
    tx: Tx,
    principal: str,
    operation: str,
    params: Any,
    holder: Holder | None,
    create: Callable[[], dict[str, Any]],
    id_field: str,
    what: str,
) -> dict[str, Any]:
    """Claim, do and complete ``params.idempotency_key`` in this one transaction (for
    ``session.register``, ``session.message``): a retry gets the stored result and
    ``create`` never runs twice. ``create`` returns the result; its ``id_field`` (the id
    of what it made) becomes the key's effect_ref, which evidence probes look for."""
    key = params.idempotency_key
    request = msgspec.structs.asdict(params)
    del request["idempotency_key"]
    digest = payload_hash(request)
    stored = replay_or_refuse(tx, principal, operation, key, digest, holder)
    if stored is not None:
        result = stored.result
        if not isinstance(result, dict) or not isinstance(result.get(id_field), str):
            # Completed through idem.complete with something else.
            raise Conflict(
                f"key {key!r} of {operation} holds a result that is not {what} "
                f"({result!r:.100}); use another key",
                {"operation": operation, "key": key},
            )
        return result
    result = create()
    insert(tx, principal, operation, key, digest, COMPLETED, result[id_field], result, holder)
    return result


def complete(tx: Tx, caller: Caller, params: IdemCompleteParams) -> IdemRecord:
    """Record the outcome. Accepted from ``in_progress`` and from ``outcome_unknown``
    (the claimant knows what happened); a repeat with the same result is a no-op."""
    principal, operation, key, result = (
        caller.principal, params.operation, params.key, params.result
    )  # fmt: skip
    if params.effect_ref is not None:
        _require_claim(_require(tx, principal, operation, key), params.effect_ref)
    # The usual complete, of a key not completed yet: one UPDATE that returns the
    # record as now stored, instead of a SELECT first.
    packed = pack(result)
    values = tx.conn.execute(_COMPLETE, (packed, tx.now, principal, operation, key)).fetchone()
    if values is not None:
        record = _row(values).record
        note(tx, "idem", idem_changed(principal, record))
        return record
    row = _require(tx, principal, operation, key)  # no such key, or completed already
    if pack_canonical(row.record.result) != pack_canonical(result):
        raise _refused(operation, key, "is already completed with a different result")
    return row.record


_COMPLETE = f"""UPDATE idempotency SET state = 'completed', result = ?, updated_at = ?
    WHERE principal = ? AND operation = ? AND key = ? AND state != 'completed'
    RETURNING {_RECORD_COLUMNS}"""


def release(tx: Tx, caller: Caller, params: IdemReleaseParams) -> IdemReleaseResult:
    """Drop a key whose effect never started, so a retry runs fresh. Only ``in_progress``."""
    principal, operation, key = caller.principal, params.operation, params.key
    row = _require(tx, principal, operation, key)
    if params.effect_ref is not None:
        _require_claim(row, params.effect_ref)
    if row.record.state == COMPLETED:
        raise _refused(operation, key, "is completed; a completed key is never released")
    if row.record.state == OUTCOME_UNKNOWN:
        _refuse_unsettled(row, None)
    _delete(tx, principal, operation, key)
    return IdemReleaseResult(operation=operation, key=key, released=True)


def _delete(tx: Tx, principal: str, operation: str, key: str) -> None:
    tx.conn.execute(
        "DELETE FROM idempotency WHERE principal = ? AND operation = ? AND key = ?",
        (principal, operation, key),
    )
    note(tx, "idem", IdemChanged(principal, operation, key, None))


def mark_unknown(tx: Tx, caller: Caller, params: IdemKeyParams) -> IdemRecord:
    """The claimant cannot tell whether its effect happened."""
    principal, operation, key = caller.principal, params.operation, params.key
    row = _require(tx, principal, operation, key)
    if row.record.state == COMPLETED:
        raise _refused(operation, key, "is completed; its outcome is known")
    if row.record.state == IN_PROGRESS:
        return _set_state(tx, principal, row, OUTCOME_UNKNOWN)
    return row.record


def _require_claim(row: _Row, effect_ref: str) -> None:
    """Refuse a decision about a claim the key no longer holds: claimed again since the
    caller read it (a new claim has a new effect_ref)."""
    if effect_ref != row.record.effect_ref:
        raise _refused(
            row.record.operation,
            row.record.key,
            "was claimed again since the claim given was read (another effect_ref); read "
            "it again (idem.get) and settle the claim you mean",
            effect_ref=row.record.effect_ref,
        )


def resolve(tx: Tx, caller: Caller, params: IdemResolveParams) -> IdemResolveResult:
    """The operator's decision about an ``outcome_unknown`` key, written to the operator log."""
    principal, operation, key = caller.principal, params.operation, params.key
    outcome, result = params.outcome, params.result
    row = _require(tx, principal, operation, key)
    if row.record.state != OUTCOME_UNKNOWN:
        raise _refused(
            operation,
            key,
            f"is {row.record.state}; only an outcome_unknown key is resolved (mark it "
            "unknown first if its holder is stuck)",
            state=row.record.state,
        )
    if params.effect_ref is not None:
        _require_claim(row, params.effect_ref)
    record: IdemRecord | None = None
    if outcome == COMPLETED:
        record = _set_state(tx, principal, row, COMPLETED, result)
    else:
        _delete(tx, principal, operation, key)
    log_operator_action(
        tx,
        principal,
        "idem.resolve",
        {
            "operation": operation,
            "key": key,
            "outcome": outcome,
            "effect_ref": row.record.effect_ref,
        },
    )
    return IdemResolveResult(operation=operation, key=key, outcome=outcome, record=record)


def reopen(tx: Tx, caller: Caller, params: IdemReopenParams) -> IdemReopenResult:
    """The operator's decision to run a completed step again (it completed with a
    failure worth retrying): the key is forgotten, and the operator log says who did it,
    why, and what the outcome was. Only a completed key whose result is ``result``."""
    principal, operation, key = caller.principal, params.operation, params.key
    result, reason = params.result, params.reason
    row = _require(tx, principal, operation, key)
    record = row.record
    if record.state != COMPLETED:
        advice = (
            "settle it with idem.resolve (towerctl idem resolve OPERATION KEY; --outcome "
            "abandoned runs it again)"
            if record.state == OUTCOME_UNKNOWN
            else "wait for its claimant to finish"
        )
        raise _refused(
            operation,
            key,
            f"is {record.state}; only a completed key is reopened: {advice}",
            state=record.state,
        )
    if params.effect_ref is not None and params.effect_ref != record.effect_ref:
        raise _refused(
            operation,
            key,
            "ran again since the outcome given was read (another effect_ref); read it "
            "again (idem.get) and reopen the outcome you mean",
            effect_ref=record.effect_ref,
        )
    if pack_canonical(record.result) != pack_canonical(result):
        raise _refused(
            operation,
            key,
            "holds another result than the one given; read it again (idem.get) and reopen "
            "the outcome you mean",
            result=record.result,
        )
    _delete(tx, principal, operation, key)
    log_operator_action(
        tx,
        principal,
        "idem.reopen",
        {"operation": operation, "key": key, "effect_ref": record.effect_ref,
         "result": record.result, "reason": reason},
    )  # fmt: skip
    return IdemReopenResult(operation=operation, key=key, reopened=True, previous=record)


def log_operator_action(tx: Tx, principal: str, action: str, detail: dict[str, Any]) -> None:
    tx.conn.execute(
        "INSERT INTO operator_log (at, daemon_id, principal, action, detail) "
        "VALUES (?, ?, ?, ?, ?)",
        (tx.now, tx.daemon_id, principal, action, json.dumps(detail, sort_keys=True, default=str)),
    )


# --- reads -------------------------------------------------------------------------


def get(tx: Tx, caller: Caller, params: IdemKeyParams) -> IdemRecord:
    return _require(tx, caller.principal, params.operation, params.key).record


def list_keys(tx: Tx, caller: Caller, params: IdemListParams) -> IdemListResult:
    """The principal's keys in claim order, paged like ``fleet.list``."""
    limit, cursor, byte_budget = params.limit, params.cursor, tx.config.page_bytes
    clause, args = where(
        ("principal = ?", caller.principal),
        ("rowid > ?", cursor or 0),
        state=params.state,
        operation=params.operation,
    )
    rows = tx.conn.execute(
        f"SELECT rowid, {_RECORD_COLUMNS} FROM idempotency {clause} ORDER BY rowid LIMIT ?",
        (*args, limit + 1),
    ).fetchall()
    keys, next_cursor = take_page(
        [(values[0], _row(values[1:]).record) for values in rows], limit, byte_budget
    )
    return IdemListResult(keys=keys, next_cursor=next_cursor)


def count_by_state(tx: Tx) -> KeyCounts:
    counts = dict(
        tx.conn.execute("SELECT state, count(*) FROM idempotency GROUP BY state").fetchall()
    )
    return KeyCounts(**counts)


def live_holders(tx: Tx) -> list[Holder]:
    """Distinct holders of this daemon's in-progress keys, for the liveness sweep."""
    return [
        Holder(pid, start)
        for pid, start in tx.conn.execute(
            """SELECT DISTINCT holder_pid, holder_start FROM idempotency
               WHERE state = 'in_progress' AND daemon_id = ? AND holder_pid IS NOT NULL""",
            (tx.daemon_id,),
        )
    ]


# --- maintenance -----------------------------------------------------------------------


def mark_holders_dead(tx: Tx, holders: Iterable[Holder]) -> list[tuple[int, str, str, str, str]]:
    """In-progress keys of dead holders become ``outcome_unknown``.

    Returns the keys moved as (rowid, principal, operation, key, effect_ref).
    """
    moved: list[tuple[int, str, str, str, str]] = []
    for holder in holders:
        moved += tx.conn.execute(
            """UPDATE idempotency SET state = 'outcome_unknown', updated_at = ?
               WHERE state = 'in_progress' AND daemon_id = ? AND holder_pid = ? AND holder_start = ?
               RETURNING rowid, principal, operation, key, effect_ref""",
            (tx.now, tx.daemon_id, holder.pid, holder.start),
        ).fetchall()
    for _rowid, principal, operation, key, effect_ref in moved:
        note(tx, "idem", IdemChanged(principal, operation, key, OUTCOME_UNKNOWN, effect_ref))
    return moved


def mark_box_unknown(tx: Tx) -> list[tuple[int, str, str, str, str]]:
    """Every in-progress key of the box ``tx.daemon_id`` (a dead box: whoever held them,
    held them across a daemon that is gone) becomes ``outcome_unknown``; as above."""
    moved = tx.conn.execute(
        """UPDATE idempotency SET state = 'outcome_unknown', updated_at = ?
           WHERE state = 'in_progress' AND daemon_id = ?
           RETURNING rowid, principal, operation, key, effect_ref""",
        (tx.now, tx.daemon_id),
    ).fetchall()
    for _rowid, principal, operation, key, effect_ref in moved:
        note(tx, "idem", IdemChanged(principal, operation, key, OUTCOME_UNKNOWN, effect_ref))
    return moved


def expire_completed(tx: Tx, ttl_ms: int) -> int:
    """Forget completed keys older than the TTL; unsettled keys never expire."""
    expired = tx.conn.execute(
        "DELETE FROM idempotency WHERE state = 'completed' AND updated_at < ?",
        (tx.now - ttl_ms,),
    ).rowcount
    if expired:
        note(tx, "idem", IdemExpired(expired))
    return expired


# --- evidence probes of keys (``towerctl run --probe CMD``) ----------------------------------

PROBE_PRINCIPAL = "towerd:probe"  # who settled it, in the operator log


@dataclass(frozen=True, slots=True)
class KeyToProbe:
    rowid: int
    principal: str
    operation: str
    key: str
    effect_ref: str
    probe: str
    cwd: str | None
    attempt: str | None = None  # the claim's attempt token (towerctl run's command has it)
    holder_start: int | None = None  # its claimant's start time (what it ran began later)


def keys_to_probe(tx: Tx, due_only: bool) -> list[KeyToProbe]:
    """``outcome_unknown`` keys with a probe command whose holder is gone (a live holder
    knows the outcome and may still complete it); ``due_only``: whose next probe is due."""
    rows = tx.conn.execute(
        """SELECT rowid, principal, operation, key, effect_ref, probe, probe_cwd, holder_pid,
                  holder_start, daemon_id, attempt FROM idempotency
           WHERE state = 'outcome_unknown' AND probe IS NOT NULL
           AND (? = 0 OR probe_next_at IS NULL OR probe_next_at <= ?) ORDER BY rowid""",
        (int(due_only), tx.now),
    ).fetchall()
    return [
        KeyToProbe(rowid, principal, operation, key, ref, probe, cwd, attempt, start)
        for rowid, principal, operation, key, ref, probe, cwd, pid, start, box, attempt in rows
        if (holder := holder_at(tx, pid, start, box)) is None or not is_alive(holder)
    ]


def record_key_probe(
    tx: Tx, probed: KeyToProbe, verdict: str, evidence: Any, base_ms: int
) -> ProbeOutcome:
    """A key probe's verdict, if the key is still the one probed and still unknown:
    committed completes it (result ``{"settled_by", "probe", "evidence"}``, no exit
    status: it replays 0), aborted releases it so the next run runs it, unknown counts
    the attempt and schedules the next one with backoff. Settling goes to the operator
    log with the evidence."""
    ident = {"principal": probed.principal, "operation": probed.operation, "key": probed.key}
    row = tx.conn.execute(
        "SELECT state, effect_ref, holder_pid, holder_start, probe_attempts, daemon_id "
        "FROM idempotency "
        "WHERE rowid = ? AND principal = ? AND operation = ? AND key = ?",
        (probed.rowid, probed.principal, probed.operation, probed.key),
    ).fetchone()
    if row is None:
        return ProbeOutcome("not_unsettled", "gone", **ident)
    state, effect_ref, pid, start, attempts, box = row
    if state != OUTCOME_UNKNOWN or effect_ref != probed.effect_ref:
        return ProbeOutcome("not_unsettled", state, **ident)
    holder = holder_at(tx, pid, start, box)
    if holder is not None and is_alive(holder):
        return ProbeOutcome("holder_alive", state, **ident)
    attempts += 1
    next_at = None if verdict != "unknown" else tx.now + _key_probe_delay(attempts, base_ms)
    tx.conn.execute(
        "UPDATE idempotency SET probe_attempts = ?, probe_at = ?, probe_next_at = ?, "
        "probe_verdict = ? WHERE rowid = ?",
        (attempts, tx.now, next_at, verdict, probed.rowid),
    )
    if verdict == "unknown":
        return ProbeOutcome(verdict, state, evidence, **ident)
    loaded = _require(tx, probed.principal, probed.operation, probed.key)
    if verdict == "committed":
        result = {"settled_by": "evidence probe", "probe": probed.probe, "evidence": evidence}
        _set_state(tx, probed.principal, loaded, COMPLETED, result)
        now_state = COMPLETED
    else:
        _delete(tx, probed.principal, probed.operation, probed.key)
        now_state = "gone"
    log_operator_action(
        tx,
        PROBE_PRINCIPAL,
        "idem.probe",
        {**ident, "outcome": "completed" if verdict == "committed" else "abandoned",
         "effect_ref": effect_ref, "probe": probed.probe, "evidence": evidence},
    )  # fmt: skip
    return ProbeOutcome(verdict, now_state, evidence, **ident)


def _key_probe_delay(attempts: int, base_ms: int) -> int:
    return min(base_ms * 2 ** min(attempts - 1, 20), max(base_ms, 3_600_000))
