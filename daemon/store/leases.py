"""Fenced leases: one holder per resource at a time, on the daemon's clock.

A holder is a principal plus the process (pid and start time) that acquired
the lease; its connections may come and go. Every grant takes the next
fencing token for the resource from ``lease_tokens``, which outlives the
lease itself, so a token is never issued twice: not after a release, an
expiry, or a daemon restart (the grant and the counter commit together, and
nobody hears of a token before that commit).

Retention keeps both tables bounded: a lease row that lapsed long ago goes, and
so does the token record of a resource that no lease and no in-flight effect
uses any more. Before a token record goes, its token raises a global floor in
``meta``; a resource with no record starts above that floor, so it too never
sees a token again.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from msgspec.structs import asdict

from towerd.daemon.processes import Holder, is_alive
from towerd.daemon.store import audit, quota
from towerd.daemon.store.tx import Caller, Tx, fitted, holder_at, own_box
from towerd.protocol.errors import LeaseExpired, LeaseHeld, LeaseNotFound, LeaseSuperseded
from towerd.protocol.methods import (
    Empty,
    LeaseAcquireParams,
    LeaseAcquireResult,
    LeaseListResult,
    LeaseRecord,
    LeaseReleaseResult,
    LeaseRenewParams,
    LeaseResourceParams,
    LeaseTokenParams,
)

_COLUMNS = (
    "resource, fencing_token, principal, holder_pid, holder_start, acquired_at, renewed_at, "
    "expires_at, session_id"
)


@dataclass(frozen=True, slots=True)
class Lease:
    resource: str
    token: int
    principal: str
    holder: Holder | None
    acquired_at: int
    renewed_at: int
    expires_at: int
    session_id: str | None = None  # the agent session a path lease is held for

    def held_by(self, principal: str, holder: Holder | None) -> bool:
        return self.principal == principal and self.holder == holder

    def live(self, now: int) -> bool:
        """Before its deadline, and (when it has one) its holder process still runs."""
        return self.expires_at > now and (self.holder is None or is_alive(self.holder))

    def record(self, now: int) -> LeaseRecord:
        return LeaseRecord(
            resource=self.resource,
            fencing_token=self.token,
            expires_at=self.expires_at,
            holder=describe_holder(self.principal, self.holder),
            holder_pid=self.holder.pid if self.holder else None,
            acquired_at=self.acquired_at,
            renewed_at=self.renewed_at,
            live=self.live(now),
            session_id=self.session_id,
        )


def describe_holder(principal: str, holder: Holder | None) -> str:
    return f"{principal} pid {holder.pid}" if holder else principal


def load(tx: Tx, resource: str) -> Lease | None:
    row = tx.conn.execute(
        f"SELECT {_COLUMNS}, daemon_id FROM leases WHERE resource = ?", (resource,)
    ).fetchone()
    if row is None:
        return None
    resource, token, principal, pid, start, acquired, renewed, expires, session_id, box = row
    holder = holder_at(tx, pid, start, box)
    return Lease(resource, token, principal, holder, acquired, renewed, expires, session_id)


def _token_record(tx: Tx, resource: str) -> int | None:
    row = tx.conn.execute(
        "SELECT last_token FROM lease_tokens WHERE resource = ?", (resource,)
    ).fetchone()
    return None if row is None else row[0]


def last_token(tx: Tx, resource: str) -> int:
    """The last token issued for ``resource`` (exact while it has a record: a resource
    with a lease or an in-flight effect always has one)."""
    return _token_record(tx, resource) or 0


TOKEN_FLOOR = "lease_token_floor"  # meta key: every pruned record's token is at most this


def token_floor(tx: Tx) -> int:
    row = tx.conn.execute("SELECT value FROM meta WHERE key = ?", (TOKEN_FLOOR,)).fetchone()
    return 0 if row is None else int(row[0])


def _issue_token(tx: Tx, resource: str, principal: str) -> int:
    """The next token: after the resource's record, or above the floor without one (its
    record may have been pruned). A new record counts for ``principal``."""
    last = _token_record(tx, resource)
    token = (token_floor(tx) if last is None else last) + 1
    tx.conn.execute(
        """INSERT INTO lease_tokens (resource, last_token, principal) VALUES (?, ?, ?)
           ON CONFLICT (resource) DO UPDATE SET last_token = excluded.last_token""",
        (resource, token, principal),
    )
    return token


def _require_room(
    tx: Tx, principal: str, resource: str, current: Lease | None, quota_rows: int
) -> None:
    """A grant adds a lease row for ``principal`` (unless it takes over its own lapsed
    one) and maybe a token record: both within its quota, checked before any write."""
    if current is None or current.principal != principal:
        quota.require_room(tx, principal, "leases", quota_rows)
    quota.require_room(
        tx, principal, "lease_tokens", quota_rows, lambda: _token_record(tx, resource) is None
    )


def _held_error(lease: Lease, now: int) -> LeaseHeld:
    return LeaseHeld(
        f"{lease.resource} is leased to {describe_holder(lease.principal, lease.holder)} "
        f"(token {lease.token}) until {lease.expires_at}",
        {"lease": asdict(lease.record(now))},
    )


def refuse_if_held_elsewhere(tx: Tx, caller: Caller, resource: str) -> None:
    """LeaseHeld if another holder has a live lease on ``resource`` (nothing written)."""
    current = load(tx, resource)
    if current is not None and current.live(tx.now):
        if not current.held_by(caller.principal, caller.holder):
            raise _held_error(current, tx.now)


def acquire(tx: Tx, caller: Caller, params: LeaseAcquireParams) -> LeaseAcquireResult:
    """Grant the lease to ``caller.holder``, or extend it (same token) for its current
    holder."""
    principal, holder = caller.principal, caller.holder
    resource, ttl_ms, quota_rows = params.resource, params.ttl_ms, tx.config.quota_rows
    current = load(tx, resource)
    expires_at = tx.now + ttl_ms
    if current is not None and current.live(tx.now):
        if not current.held_by(principal, holder):
            raise _held_error(current, tx.now)
        tx.conn.execute(
            "UPDATE leases SET renewed_at = ?, expires_at = ? WHERE resource = ?",
            (tx.now, expires_at, resource),
        )
        return LeaseAcquireResult(
            resource, current.token, expires_at, describe_holder(principal, holder), True
        )
    _require_room(tx, principal, resource, current, quota_rows)
    token = _issue_token(tx, resource, principal)
    _write(tx, resource, token, principal, holder, expires_at)
    _audit(
        tx, "lease-granted", resource, token, principal, holder,
        expires_at=expires_at, previous_token=current.token if current else None,
    )  # fmt: skip
    return LeaseAcquireResult(
        resource, token, expires_at, describe_holder(principal, holder), False
    )


def grant_for_session(
    tx: Tx, principal: str, holder: Holder | None, session_id: str, resource: str, ttl_ms: int
) -> tuple[int, int]:
    """(token, expires_at) of ``resource``'s lease for an agent session: a live lease of
    the session (or of its agent process: one agent, a new session after ``/clear``) is
    renewed under its token and passes to the session; otherwise a new token is granted.
    The caller has checked that no other live holder is in the way."""
    current = load(tx, resource)
    expires_at = tx.now + ttl_ms
    if current is not None and current.live(tx.now):
        expires_at = max(expires_at, current.expires_at)  # a renewal never shortens it
        tx.conn.execute(
            "UPDATE leases SET renewed_at = ?, expires_at = ?, session_id = ? WHERE resource = ?",
            (tx.now, expires_at, session_id, resource),
        )
        return current.token, expires_at
    _require_room(tx, principal, resource, current, tx.config.quota_rows)
    token = _issue_token(tx, resource, principal)
    _write(tx, resource, token, principal, holder, expires_at, session_id)
    _audit(
        tx, "lease-granted", resource, token, principal, holder, session_id=session_id,
        expires_at=expires_at, previous_token=current.token if current else None,
    )  # fmt: skip
    return token, expires_at


def live_in_the_way(tx: Tx, resources: list[str], below: str) -> list[Lease]:
    """The live leases on any of ``resources``, or on a resource below ``below`` (a
    directory's path lease resource, ``path:/dir``: the range is ``path:/dir/...``;
    for the root, ``path:/``, every path)."""
    marks = ", ".join("?" * len(resources))
    lower = below if below.endswith("/") else below + "/"
    upper = lower[:-1] + "0"  # the character after the slash, in sort order
    rows = tx.conn.execute(
        f"""SELECT resource FROM leases WHERE resource IN ({marks}) AND expires_at > ?
            UNION SELECT resource FROM leases
            WHERE resource > ? AND resource < ? AND expires_at > ?""",
        (*resources, tx.now, lower, upper, tx.now),
    ).fetchall()
    found = [load(tx, resource) for (resource,) in rows]
    return [lease for lease in found if lease is not None and lease.live(tx.now)]


def release_matching(
    tx: Tx, leases_to_go: list[Lease], reason: str, actor: str | None = None
) -> list[str]:
    """Release these leases (a session's path leases: it ended, or someone said so)."""
    for lease in leases_to_go:
        tx.conn.execute(
            "DELETE FROM leases WHERE resource = ? AND fencing_token = ?",
            (lease.resource, lease.token),
        )
        _audit(
            tx, "lease-released", lease.resource, lease.token, lease.principal, lease.holder,
            actor=actor, reason=reason, session_id=lease.session_id,
        )  # fmt: skip
    return [lease.resource for lease in leases_to_go]


def held_for_session(tx: Tx, session_id: str) -> list[Lease]:
    rows = tx.conn.execute(
        "SELECT resource FROM leases WHERE session_id = ?", (session_id,)
    ).fetchall()
    return [lease for (resource,) in rows if (lease := load(tx, resource)) is not None]


def _write(
    tx: Tx,
    resource: str,
    token: int,
    principal: str,
    holder: Holder | None,
    expires_at: int,
    session_id: str | None = None,
) -> None:
    """The lease row, replacing a lapsed one: deleted, then inserted, so the quota
    counters' triggers see both (REPLACE fires delete triggers only with
    recursive_triggers on)."""
    tx.conn.execute("DELETE FROM leases WHERE resource = ?", (resource,))
    tx.conn.execute(
        f"""INSERT INTO leases ({_COLUMNS}, daemon_id)
            VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)""",
        (
            resource,
            token,
            principal,
            holder.pid if holder else None,
            holder.start if holder else None,
            tx.now,
            tx.now,
            expires_at,
            session_id,
            tx.daemon_id,
        ),
    )


def _audit(
    tx: Tx,
    type: str,
    resource: str,
    token: int,
    principal: str,
    holder: Holder | None,
    *,
    actor: str | None = None,
    caused_by: str | None = None,
    **details: object,
) -> None:
    audit.record(
        tx,
        "lease",
        type,
        {"resource": resource, "fencing_token": token,
         "holder": describe_holder(principal, holder), **details},
        actor=actor or describe_holder(principal, holder),
        trace_id=resource,
        caused_by=caused_by,
    )  # fmt: skip


def _require_current(
    tx: Tx, principal: str, holder: Holder | None, resource: str, token: int
) -> Lease:
    current = load(tx, resource)
    if current is None:
        raise LeaseNotFound(f"no lease on {resource}", {"resource": resource})
    if current.token != token or not current.held_by(principal, holder):
        raise LeaseSuperseded(
            f"token {token} on {resource} is superseded: the lease is now token "
            f"{current.token} held by {describe_holder(current.principal, current.holder)}",
            {"lease": asdict(current.record(tx.now)), "fencing_token": token},
        )
    if current.expires_at <= tx.now:
        raise LeaseExpired(
            f"the lease on {resource} (token {token}) expired at {current.expires_at}; "
            "acquire it again for a new token",
            {"resource": resource, "fencing_token": token, "expired_at": current.expires_at},
        )
    return current


def renew(tx: Tx, caller: Caller, params: LeaseRenewParams) -> LeaseAcquireResult:
    principal, holder = caller.principal, caller.holder
    resource, token, ttl_ms = params.resource, params.fencing_token, params.ttl_ms
    current = _require_current(tx, principal, holder, resource, token)
    expires_at = tx.now + ttl_ms
    tx.conn.execute(
        "UPDATE leases SET renewed_at = ?, expires_at = ? WHERE resource = ?",
        (tx.now, expires_at, resource),
    )
    return LeaseAcquireResult(
        resource, current.token, expires_at, describe_holder(principal, holder), True
    )


def release(tx: Tx, caller: Caller, params: LeaseTokenParams) -> LeaseReleaseResult:
    principal, holder = caller.principal, caller.holder
    resource, token = params.resource, params.fencing_token
    _require_current(tx, principal, holder, resource, token)
    tx.conn.execute("DELETE FROM leases WHERE resource = ?", (resource,))
    _audit(tx, "lease-released", resource, token, principal, holder, reason="released")
    return LeaseReleaseResult(resource=resource, fencing_token=token, released=True)


def drop(tx: Tx, resource: str, token: int) -> None:
    """Release a lease held under ``token``, whoever asks (an effect settling)."""
    lease = load(tx, resource)
    if lease is None or lease.token != token:
        return
    tx.conn.execute("DELETE FROM leases WHERE resource = ?", (resource,))
    _audit(
        tx, "lease-released", resource, token, lease.principal, lease.holder,
        reason="effect-settled",
    )  # fmt: skip


def extend(tx: Tx, lease: Lease | None, resource: str, token: int, principal: str,
           holder: Holder | None, ttl_ms: int) -> int:  # fmt: skip
    """Keep ``token``'s lease alive for an effect whose fence is still the newest:
    its row is extended, or written again if it lapsed with nobody taking over."""
    expires_at = tx.now + ttl_ms
    if lease is not None and lease.token == token:
        tx.conn.execute(
            "UPDATE leases SET renewed_at = ?, expires_at = ? WHERE resource = ?",
            (tx.now, expires_at, resource),
        )
        return expires_at
    _write(tx, resource, token, principal, holder, expires_at)
    _audit(tx, "lease-restored", resource, token, principal, holder, expires_at=expires_at)
    return expires_at


def get(tx: Tx, caller: Caller, params: LeaseResourceParams) -> LeaseRecord:
    resource = params.resource
    current = load(tx, resource)
    if current is None:
        raise LeaseNotFound(f"no lease on {resource}", {"resource": resource})
    return current.record(tx.now)


def list_leases(tx: Tx, caller: Caller, params: Empty) -> LeaseListResult:
    """``lease.list``: the live leases, cut to fit a frame (flagged ``truncated``)."""
    return fitted(LeaseListResult(leases=list_live(tx)), tx.config.page_bytes)


def list_live(tx: Tx) -> list[LeaseRecord]:
    rows = tx.conn.execute(
        "SELECT resource FROM leases WHERE expires_at > ? ORDER BY resource", (tx.now,)
    ).fetchall()
    leases = [load(tx, resource) for (resource,) in rows]
    return [lease.record(tx.now) for lease in leases if lease is not None and lease.live(tx.now)]


def holders(tx: Tx) -> list[Holder]:
    box, args = own_box(tx)
    return [
        Holder(pid, start)
        for pid, start in tx.conn.execute(
            f"SELECT DISTINCT holder_pid, holder_start FROM leases WHERE holder_pid IS NOT NULL"
            f"{box}",
            args,
        )
    ]


def release_dead_holders(tx: Tx, dead: Iterable[Holder]) -> list[str]:
    """A dead holder's leases go at once, not at their deadline; the tokens stay used."""
    released: list[str] = []
    for holder in dead:
        released += release_held_by(tx, holder, "holder-died")
    return released


def release_held_by(tx: Tx, holder: Holder, reason: str, caused_by: str | None = None) -> list[str]:
    """Release every lease ``holder`` has (it died, or its worker was reaped)."""
    box, args = own_box(tx)
    rows = tx.conn.execute(
        f"DELETE FROM leases WHERE holder_pid = ? AND holder_start = ?{box} "
        "RETURNING resource, fencing_token, principal",
        (holder.pid, holder.start, *args),
    ).fetchall()
    for resource, token, principal in rows:
        _audit(
            tx, "lease-released", resource, token, principal, holder,
            actor=audit.DAEMON_ACTOR, caused_by=caused_by, reason=reason,
        )  # fmt: skip
    return [resource for resource, _token, _principal in rows]


def release_box(tx: Tx, reason: str) -> list[str]:
    """Release every lease the box ``tx.daemon_id`` granted (a dead box's); tokens stay used."""
    rows = tx.conn.execute(
        "DELETE FROM leases WHERE daemon_id = ? "
        "RETURNING resource, fencing_token, principal, holder_pid, holder_start",
        (tx.daemon_id,),
    ).fetchall()
    for resource, token, principal, pid, start in rows:
        holder = None if pid is None or start is None else Holder(pid, start)
        _audit(
            tx, "lease-released", resource, token, principal, holder,
            actor=audit.DAEMON_ACTOR, reason=reason,
        )  # fmt: skip
    return [row[0] for row in rows]


# --- retention ----------------------------------------------------------------------------


def prune_lapsed(tx: Tx, cutoff: int, limit: int) -> int:
    """Up to ``limit`` lease rows whose deadline passed before ``cutoff`` (a renew or
    release of one then hears ``lease_not_found`` instead of ``lease_expired``; an
    in-flight effect's heartbeat writes its row again, under its still-newest token)."""
    return tx.conn.execute(
        """DELETE FROM leases WHERE resource IN (
               SELECT resource FROM leases WHERE expires_at < ? LIMIT ?)""",
        (cutoff, limit),
    ).rowcount


def prune_tokens(tx: Tx, limit: int) -> int:
    """Up to ``limit`` token records of resources that have no lease row and no in-flight
    effect fenced on them; the floor rises to the highest token pruned, in the same
    transaction, so no resource is ever issued a token again."""
    pruned = tx.conn.execute(
        """DELETE FROM lease_tokens WHERE resource IN (
               SELECT resource FROM lease_tokens
               WHERE resource NOT IN (SELECT resource FROM leases)
                 AND resource NOT IN (
                     SELECT lease_resource FROM effects
                     WHERE status = 'in_flight' AND lease_resource IS NOT NULL)
               LIMIT ?)
           RETURNING last_token""",
        (limit,),
    ).fetchall()
    if pruned:
        floor = max(token_floor(tx), *(token for (token,) in pruned))
        tx.conn.execute(
            """INSERT INTO meta (key, value) VALUES (?, ?)
               ON CONFLICT (key) DO UPDATE SET value = excluded.value""",
            (TOKEN_FLOOR, str(floor)),
        )
    return len(pruned)
