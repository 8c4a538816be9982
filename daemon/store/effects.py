"""The external-effects ledger: pushes, pull requests, tracker issues, webhooks.

An effect is keyed by what it does (run, step, kind, target), so two attempts at
the same effect meet on one row. Claiming is one transaction: the ledger is
consulted first (a committed effect is never claimed again, whoever holds its
target), then, for kinds whose target is shared with other runs, the target's
lease is taken, then the row is written with the lease's fencing token. A commit
is accepted only while that token is still the newest for the target; once
another holder has a newer one, the effect parks ``uncertain`` (it may have
touched the world) until an operator resolves it.

Fixes over the reference ledger: claim is one transaction (two claimers cannot
both win); abort and fail are guarded by status and attempt like commit; a
stale in-flight effect is parked, never silently re-armed, unless its kind is
local and safe to redo.

Settled effects (committed, failed, aborted) are pruned once settled for longer than
``--effect-retention-days``; a claim of a pruned effect then runs it again, like a
completed idempotency key after ``--completed-ttl``. In-flight and uncertain effects
are never pruned.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgspec
from msgspec.structs import asdict

from towerd.daemon.processes import Holder, is_alive
from towerd.daemon.store import leases, quota
from towerd.daemon.store.idempotency import log_operator_action, payload_hash
from towerd.daemon.store.tx import (
    Caller,
    Refused,
    Tx,
    fitted,
    holder_at,
    note,
    own_box,
    pack,
    unpack,
)
from towerd.protocol import naming
from towerd.protocol.changes import EffectGone
from towerd.protocol.errors import (
    EffectAlreadyCommitted,
    EffectAttemptSuperseded,
    EffectInFlight,
    EffectLeaseHeld,
    EffectLeaseSuperseded,
    EffectNotFound,
    EffectUncertain,
    IdempotencyConflict,
    LeaseHeld,
    TowerdError,
)
from towerd.protocol.methods import (
    EffectAbortParams,
    EffectAttemptParams,
    EffectClaimParams,
    EffectClaimResult,
    EffectCommitParams,
    EffectFailParams,
    EffectKeyParams,
    EffectListParams,
    EffectListResult,
    EffectRecord,
    EffectResolveParams,
    EffectSettleParams,
    GitPushTarget,
    LeaseAcquireParams,
    ProbeOutcome,
    ProbeState,
)

LOCAL_KINDS = frozenset(naming.LOCAL_KINDS)  # this run's own namespace: safe to redo

_COLUMNS = (
    "effect_key, run_id, step_id, attempt_id, action_kind, target_ref, status, payload_hash, "
    "receipt, claimed_at, heartbeat_at, completed_at, timeout_ms, lease_resource, "
    "fencing_token, holder_pid, principal, holder_start, git_target, probe_attempts, probe_at, "
    "probe_next_at, probe_verdict, probe_evidence"
)


@dataclass(frozen=True, slots=True)
class _Effect:
    record: EffectRecord
    principal: str
    holder: Holder | None
    digest: bytes


def _load(tx: Tx, key: str) -> _Effect | None:
    row = tx.conn.execute(
        f"SELECT {_COLUMNS}, daemon_id FROM effects WHERE effect_key = ?", (key,)
    ).fetchone()
    if row is None:
        return None
    (key, run, step, attempt, kind, target, status, digest, receipt, claimed, beat, completed,
     timeout, resource, token, pid, principal, start, git, attempts, probed_at, next_at,
     verdict, evidence, box) = row  # fmt: skip
    record = EffectRecord(
        effect_key=key,
        run_id=run,
        step_id=step,
        attempt_id=attempt,
        action_kind=kind,
        target_ref=target,
        status=status,
        payload_hash=digest.hex(),
        receipt=unpack(receipt),
        claimed_at=claimed,
        heartbeat_at=beat,
        completed_at=completed,
        timeout_ms=timeout,
        lease_resource=resource,
        fencing_token=token,
        holder_pid=pid,
        git=None if git is None else msgspec.convert(unpack(git), GitPushTarget),
        probe=None
        if verdict is None
        else ProbeState(verdict, attempts, probed_at, next_at, unpack(evidence)),
    )
    return _Effect(record, principal, holder_at(tx, pid, start, box), digest)


def _require(tx: Tx, key: str) -> _Effect:
    effect = _load(tx, key)
    if effect is None:
        raise EffectNotFound(f"no effect {key}", {"effect_key": key})
    return effect


def _data(record: EffectRecord) -> dict[str, Any]:
    return {"effect": asdict(record)}


def _set(tx: Tx, key: str, **columns: Any) -> None:
    assignments = ", ".join(f"{name} = ?" for name in columns)
    tx.conn.execute(
        f"UPDATE effects SET {assignments} WHERE effect_key = ?", (*columns.values(), key)
    )
    _noted(tx, key)


def _noted(tx: Tx, key: str) -> None:
    """Tell effects watchers the receipt as it now stands."""
    if tx.changes is not None:
        effect = _load(tx, key)
        note(tx, "effects", effect.record if effect else EffectGone(key))


def _stale(effect: _Effect, now: int) -> bool:
    record = effect.record
    if record.heartbeat_at + record.timeout_ms <= now:
        return True
    return effect.holder is not None and not is_alive(effect.holder)


def _park_uncertain(tx: Tx, effect: _Effect, error: TowerdError) -> Refused:
    _set(tx, effect.record.effect_key, status="uncertain")
    return Refused(error)


def _refuse_settled(effect: _Effect) -> None:
    """Answer anyone who meets an effect that is no longer in flight."""
    record = effect.record
    if record.status == "committed":
        raise EffectAlreadyCommitted(
            f"{record.action_kind} on {record.target_ref} was already committed "
            f"({record.effect_key}); it is never run again",
            _data(record),
        )
    if record.status == "uncertain":
        raise EffectUncertain(
            f"{record.action_kind} on {record.target_ref} ({record.effect_key}) may or may not "
            "have happened; it waits for effect.resolve",
            _data(record),
        )


# --- claim ------------------------------------------------------------------------------


def claim(tx: Tx, caller: Caller, params: EffectClaimParams) -> EffectClaimResult | Refused:
    principal, holder = caller.principal, caller.holder
    prefix, quota_rows = tx.config.branch_prefix, tx.config.quota_rows
    key = naming.effect_key(params.run_id, params.step_id, params.action_kind, params.target_ref)
    digest = payload_hash(params.payload)
    existing = _load(tx, key)
    if existing is not None:
        record = existing.record
        _refuse_settled(existing)
        if existing.digest != digest:
            raise IdempotencyConflict(
                f"effect {key} was claimed with a different payload",
                {"effect_key": key, "status": record.status},
            )
        if record.status == "in_flight":
            if record.attempt_id == params.attempt_id and existing.holder == holder:
                # The same claim again (its answer was lost), if its fence still holds.
                return _fence_lost(tx, existing) or _claimed(tx, record)
            if not _stale(existing, tx.now):
                raise EffectInFlight(
                    f"{record.action_kind} on {record.target_ref} is being executed by attempt "
                    f"{record.attempt_id}",
                    _data(record),
                )
            if record.action_kind not in LOCAL_KINDS:
                return _park_uncertain(
                    tx,
                    existing,
                    EffectUncertain(
                        f"attempt {record.attempt_id} of {record.action_kind} on "
                        f"{record.target_ref} went silent (no heartbeat, or its process died); "
                        "it may have happened, so it is parked for effect.resolve",
                        _data(msgspec.structs.replace(record, status="uncertain")),
                    ),
                )
            # A local effect (this run's own branch or commit) is safe to take over.
        # failed / aborted / a stale local effect: a new attempt runs it afresh.
    if existing is None or existing.principal != principal:  # a row for this principal
        quota.require_room(tx, principal, "effects", quota_rows)
    resource = token = lease_expires = None
    if naming.effect_requires_lease(params.action_kind, params.target_ref, params.run_id, prefix):
        resource = naming.lease_resource(params.action_kind, params.target_ref)
        try:
            # An effect claimed before short names were folded may still hold the lease
            # under the name it was given: it is the same branch.
            for other in naming.other_lease_names(params.action_kind, params.target_ref):
                leases.refuse_if_held_elsewhere(tx, caller, other)
            granted = leases.acquire(tx, caller, LeaseAcquireParams(resource, params.lease_ttl_ms))
        except LeaseHeld as exc:
            raise EffectLeaseHeld(
                f"{resource} is leased by another holder; nothing was recorded",
                exc.data,
            ) from None
        resource, token, lease_expires = granted.resource, granted.fencing_token, granted.expires_at
    attempt = {
        "attempt_id": params.attempt_id,
        "status": "in_flight",
        "payload_hash": digest,
        "receipt": None,
        "claimed_at": tx.now,
        "heartbeat_at": tx.now,
        "completed_at": None,
        "timeout_ms": params.timeout_ms,
        "lease_resource": resource,
        "fencing_token": token,
        "holder_pid": holder.pid if holder else None,
        "principal": principal,
        "holder_start": holder.start if holder else None,
        # What a probe asks, as this attempt claimed it; no probe of an earlier attempt.
        "git_target": None if params.git is None else pack(asdict(params.git)),
        "probe_attempts": 0,
        "probe_at": None,
        "probe_next_at": None,
        "probe_verdict": None,
        "probe_evidence": None,
    }
    if existing is not None:
        _set(tx, key, **attempt)  # a new attempt: the row keeps its place in the run
    else:
        row = {
            "effect_key": key,
            "run_id": params.run_id,
            "step_id": params.step_id,
            "action_kind": params.action_kind,
            "target_ref": params.target_ref,
            "daemon_id": tx.daemon_id,
            **attempt,
        }
        tx.conn.execute(
            f"INSERT INTO effects ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})",
            tuple(row.values()),
        )
        _noted(tx, key)
    return EffectClaimResult(
        effect_key=key,
        status="in_flight",
        attempt_id=params.attempt_id,
        lease_resource=resource,
        fencing_token=token,
        lease_expires_at=lease_expires,
    )


def _claimed(tx: Tx, record: EffectRecord) -> EffectClaimResult:
    lease = leases.load(tx, record.lease_resource) if record.lease_resource else None
    if lease is not None and lease.token != record.fencing_token:
        lease = None  # not this effect's lease
    return EffectClaimResult(
        effect_key=record.effect_key,
        status="in_flight",
        attempt_id=record.attempt_id,
        lease_resource=record.lease_resource,
        fencing_token=record.fencing_token,
        lease_expires_at=lease.expires_at if lease else None,
    )


# --- the attempt's own calls ------------------------------------------------------------


def _require_attempt(tx: Tx, key: str, attempt_id: str) -> _Effect:
    effect = _require(tx, key)
    _refuse_settled(effect)
    record = effect.record
    if record.status != "in_flight" or record.attempt_id != attempt_id:
        raise EffectAttemptSuperseded(
            f"attempt {attempt_id} does not own {key} (it is {record.status} under attempt "
            f"{record.attempt_id}); nothing was changed",
            _data(record),
        )
    return effect


def _fence_lost(tx: Tx, effect: _Effect) -> Refused | None:
    """For a fenced effect: None while its token is still the newest for the target,
    else the effect parked uncertain with ``effect_lease_superseded``."""
    record = effect.record
    if record.lease_resource is None or record.fencing_token is None:
        return None
    newest = leases.last_token(tx, record.lease_resource)
    if newest == record.fencing_token:
        return None
    return _park_uncertain(
        tx,
        effect,
        EffectLeaseSuperseded(
            f"the lease on {record.target_ref} moved on to token {newest} (this effect holds "
            f"{record.fencing_token}); the effect is parked uncertain for effect.resolve",
            _data(msgspec.structs.replace(record, status="uncertain")),
        ),
    )


def heartbeat(tx: Tx, caller: Caller, params: EffectAttemptParams) -> EffectRecord | Refused:
    principal, holder = caller.principal, caller.holder
    key, attempt_id, lease_ttl_ms = params.effect_key, params.attempt_id, params.lease_ttl_ms
    effect = _require_attempt(tx, key, attempt_id)
    lost = _fence_lost(tx, effect)
    if lost is not None:
        return lost
    record = effect.record
    if record.lease_resource is not None and record.fencing_token is not None:
        current = leases.load(tx, record.lease_resource)
        leases.extend(tx, current, record.lease_resource, record.fencing_token, principal,
                      holder, lease_ttl_ms)  # fmt: skip
    _set(tx, key, heartbeat_at=tx.now)
    return msgspec.structs.replace(record, heartbeat_at=tx.now)


def _finish(tx: Tx, effect: _Effect, status: str, receipt: Any) -> EffectRecord:
    record = effect.record
    _set(tx, record.effect_key, status=status, receipt=pack(receipt), completed_at=tx.now)
    if record.lease_resource is not None and record.fencing_token is not None:
        sharing = tx.conn.execute(
            """SELECT 1 FROM effects WHERE lease_resource = ? AND fencing_token = ?
               AND status = 'in_flight' AND effect_key != ? LIMIT 1""",
            (record.lease_resource, record.fencing_token, record.effect_key),
        ).fetchone()
        if sharing is None:  # the holder's other effects on this target keep the lease
            leases.drop(tx, record.lease_resource, record.fencing_token)
    return msgspec.structs.replace(
        record, status=status, receipt=unpack(pack(receipt)), completed_at=tx.now
    )


def commit(tx: Tx, caller: Caller, params: EffectCommitParams) -> EffectRecord | Refused:
    key, attempt_id, receipt = params.effect_key, params.attempt_id, params.receipt
    effect = _require(tx, key)
    record = effect.record
    if record.status == "committed" and record.attempt_id == attempt_id:
        return record  # the same commit again: its answer was lost
    effect = _require_attempt(tx, key, attempt_id)
    lost = _fence_lost(tx, effect)
    if lost is not None:
        return lost
    return _finish(tx, effect, "committed", receipt)


def abort(tx: Tx, caller: Caller, params: EffectAbortParams) -> EffectRecord:
    """The effect did not happen: the row says so and its lease goes back."""
    effect = _require_attempt(tx, params.effect_key, params.attempt_id)
    return _finish(tx, effect, "aborted", {"reason": params.reason})


def fail(tx: Tx, caller: Caller, params: EffectFailParams) -> EffectRecord:
    effect = _require_attempt(tx, params.effect_key, params.attempt_id)
    return _finish(tx, effect, "failed", {"error": params.error})


def resolve(tx: Tx, caller: Caller, params: EffectResolveParams) -> EffectRecord:
    """An operator's decision about an uncertain effect, in the operator log."""
    principal, key, outcome, receipt = (
        caller.principal, params.effect_key, params.outcome, params.receipt
    )  # fmt: skip
    effect = _require(tx, key)
    record = effect.record
    if record.status != "uncertain":
        raise EffectAttemptSuperseded(
            f"{key} is {record.status}; only an uncertain effect is resolved",
            _data(record),
        )
    settled = _finish(tx, effect, outcome, receipt)
    log_operator_action(tx, principal, "effect.resolve", {"effect_key": key, "outcome": outcome})
    return settled


# --- reads and upkeep ---------------------------------------------------------------------


def get(tx: Tx, caller: Caller, params: EffectKeyParams) -> EffectRecord:
    return record_of(tx, params.effect_key)


def record_of(tx: Tx, key: str) -> EffectRecord:
    return _require(tx, key).record


def list_run(tx: Tx, caller: Caller, params: EffectListParams) -> EffectListResult:
    """A run's effects in claim order, cut to fit a frame (flagged ``truncated``)."""
    keys = tx.conn.execute(
        "SELECT effect_key FROM effects WHERE run_id = ? ORDER BY rowid", (params.run_id,)
    ).fetchall()
    listed = [_require(tx, key).record for (key,) in keys]
    return fitted(EffectListResult(effects=listed), tx.config.page_bytes)


def holders(tx: Tx) -> list[Holder]:
    box, args = own_box(tx)
    return [
        Holder(pid, start)
        for pid, start in tx.conn.execute(
            f"""SELECT DISTINCT holder_pid, holder_start FROM effects
               WHERE status = 'in_flight' AND holder_pid IS NOT NULL{box}""",
            args,
        )
    ]


def park_stale(tx: Tx, dead: Iterable[Holder] = ()) -> list[str]:
    """In-flight effects that went silent (no heartbeat within their timeout) or whose
    process died become ``uncertain``; local kinds stay, for a new attempt to take."""
    dead_set = set(dead)
    parked = []
    box, args = own_box(tx)
    rows = tx.conn.execute(
        f"""SELECT effect_key, action_kind, holder_pid, holder_start, heartbeat_at, timeout_ms
           FROM effects WHERE status = 'in_flight'{box}""",
        args,
    ).fetchall()
    for key, kind, pid, start, beat, timeout in rows:
        silent = beat + timeout <= tx.now
        died = pid is not None and start is not None and Holder(pid, start) in dead_set
        if (silent or died) and kind not in LOCAL_KINDS:
            _set(tx, key, status="uncertain")
            parked.append(key)
    return parked


def committed_evidence(tx: Tx, effect_ref: str) -> dict[str, Any] | None:
    """Evidence for an idempotency key whose effect_ref is an effect key: its receipt,
    once the effect is committed."""
    effect = _load(tx, effect_ref)
    if effect is None or effect.record.status != "committed":
        return None
    return {"effect_key": effect_ref, "receipt": effect.record.receipt}


def prune_settled(tx: Tx, cutoff: int, limit: int) -> int:
    """Up to ``limit`` effects settled before ``cutoff``; in-flight and uncertain ones
    stay whatever their age."""
    return tx.conn.execute(
        """DELETE FROM effects WHERE rowid IN (
               SELECT rowid FROM effects
               WHERE status IN ('committed', 'failed', 'aborted') AND completed_at < ?
               LIMIT ?)""",
        (cutoff, limit),
    ).rowcount


# --- evidence probes ------------------------------------------------------------------------
#
# The daemon's probes (daemon/probes.py) read what to probe here, run git outside any
# transaction, and write the verdict back through ``record_probe``, which checks again
# that the effect is still the one probed and still unsettled.

PROBE_BACKOFF_CAP_MS = 3_600_000  # an unreachable remote is asked at least hourly
PROBE_PRINCIPAL = "towerd:probe"  # who settled it, in the operator log


@dataclass(frozen=True, slots=True)
class ToProbe:
    """An unsettled effect: ``git`` to probe it with, or the verdict it gets without a
    probe (``not_probeable``, ``holder_alive``, ``not_unsettled``)."""

    effect_key: str
    attempt_id: str
    status: str
    git: GitPushTarget | None
    verdict: str | None  # None: probe it
    holder_start: int | None = None  # its holder's start time (what it ran began later)


def _probeable(effect: _Effect) -> str | None:
    """None if ``effect`` may be probed now, else the verdict it gets without one."""
    record = effect.record
    alive = effect.holder is not None and is_alive(effect.holder)
    if record.status == "in_flight":
        if effect.holder is None or alive:
            return "holder_alive" if alive else "not_unsettled"  # a silent one parks first
    elif record.status != "uncertain":
        return "not_unsettled"
    elif alive:
        return "holder_alive"  # parked (lease lost, silent) while its process still runs
    if record.git is None:
        return "not_probeable"
    return None


def to_probe(tx: Tx, caller: Caller, params: EffectSettleParams, due_only: bool) -> list[ToProbe]:
    """The effects ``params`` names (its keys, or a run's unsettled effects; all
    unsettled ones when it names none), each with
    its git target or the verdict it gets without a probe. ``due_only``: only uncertain
    git-push effects with a target whose next probe is due (the periodic pass)."""
    if params.effect_keys:
        keys = list(dict.fromkeys(params.effect_keys))
    elif params.run_id is not None:
        keys = [
            key
            for (key,) in tx.conn.execute(
                """SELECT effect_key FROM effects WHERE run_id = ?
                   AND status IN ('uncertain', 'in_flight') ORDER BY rowid""",
                (params.run_id,),
            )
        ]
    elif due_only:
        keys = [
            key
            for (key,) in tx.conn.execute(
                """SELECT effect_key FROM effects WHERE status IN ('uncertain', 'in_flight')
                   AND git_target IS NOT NULL
                   AND (probe_next_at IS NULL OR probe_next_at <= ?) ORDER BY rowid""",
                (tx.now,),
            )
        ]
    else:
        keys = [
            key
            for (key,) in tx.conn.execute(
                """SELECT effect_key FROM effects WHERE status IN ('uncertain', 'in_flight')
                   ORDER BY rowid"""
            )
        ]
    found = []
    for key in keys:
        effect = _require(tx, key)
        record = effect.record
        verdict = _probeable(effect)
        if due_only and verdict is not None:
            continue
        start = effect.holder.start if effect.holder is not None else None
        found.append(ToProbe(key, record.attempt_id, record.status, record.git, verdict, start))
    return found


def probe_delay_ms(attempts: int, base_ms: int) -> int:
    """How long after its ``attempts``-th inconclusive probe an effect is probed again."""
    return min(base_ms * 2 ** min(attempts - 1, 20), max(base_ms, PROBE_BACKOFF_CAP_MS))


def record_probe(
    tx: Tx, probed: ToProbe, verdict: str, evidence: Any, base_ms: int
) -> ProbeOutcome:
    """Write a probe's verdict, if the effect is still the one probed and unsettled (a
    person's resolve, a new attempt or a live holder that came back wins): committed and
    aborted settle it (receipt and operator log say the probe did it, with the
    evidence); unknown counts the attempt and schedules the next one with backoff."""
    key = probed.effect_key
    effect = _load(tx, key)
    if effect is None:
        return ProbeOutcome("not_unsettled", "gone", effect_key=key)
    record = effect.record
    refusal = _probeable(effect)
    if record.attempt_id != probed.attempt_id:
        refusal = "not_unsettled"
    if refusal is not None:
        return ProbeOutcome(refusal, record.status, record.probe and record.probe.evidence,
                            effect_key=key)  # fmt: skip
    attempts = (record.probe.attempts if record.probe else 0) + 1
    next_at = None if verdict != "unknown" else tx.now + probe_delay_ms(attempts, base_ms)
    _set(tx, key, probe_attempts=attempts, probe_at=tx.now, probe_next_at=next_at,
         probe_verdict=verdict, probe_evidence=pack(evidence))  # fmt: skip
    if verdict == "unknown":
        return ProbeOutcome(verdict, record.status, evidence, effect_key=key)
    effect = _require(tx, key)
    if verdict == "committed":
        receipt = {"settled_by": "evidence probe", "evidence": evidence}
    else:
        receipt = {"reason": "evidence probe: it did not happen", "evidence": evidence}
    settled = _finish(tx, effect, verdict, receipt)
    log_operator_action(
        tx,
        PROBE_PRINCIPAL,
        "effect.probe",
        {"effect_key": key, "attempt_id": record.attempt_id, "outcome": verdict,
         "was": record.status, "evidence": evidence},
    )  # fmt: skip
    return ProbeOutcome(verdict, settled.status, evidence, effect_key=key)
