"""The hook event trail: one row per agent hook event, stamped with the daemon's clock.

An event is filed under the fleet session it belongs to and under the agent's
own session id, so a trail can be asked for by either: a session restored
under a new towerd id keeps its agent session id. ``heartbeat`` events count for
activity but are kept out of trails. Attention is derived from the newest
event: an agent that asked for the user (``Notification``) needs you, one that
finished its turn (``Stop``) is done, one that ended (``SessionEnd``, or a row
marked exited) has exited, anything else is running.
"""

from __future__ import annotations

from typing import Any

from towerd.daemon.store import fleet, quota
from towerd.daemon.store.tx import Caller, Tx, fitted, note, pack, take_page, unpack, where
from towerd.protocol import fields
from towerd.protocol.errors import BadArgs
from towerd.protocol.fields import attention
from towerd.protocol.methods import (
    EventListParams,
    EventListResult,
    EventRecordParams,
    EventRecordResult,
    RestorePlanEntry,
    RestorePlanParams,
    RestorePlanResult,
    SessionActivity,
    SessionActivityParams,
    SessionActivityResult,
    TrailEvent,
)

HEARTBEAT = fields.HEARTBEAT_KIND
# Hook events that end a session, or start it again, in its fleet row too.
_EXITED_BY_KIND = {"SessionEnd": True, "SessionStart": False}


def filed(tx: Tx, filing_key: str) -> EventRecordResult | None:
    """The event filed before under ``filing_key`` (a hook event written again after its
    first write's answer was lost: daemon/outbox.py), or None."""
    row = tx.conn.execute(
        "SELECT event_id, at, session_id FROM events WHERE filing_key = ?", (filing_key,)
    ).fetchone()
    return None if row is None else EventRecordResult(event_id=row[0], at=row[1], session_id=row[2])


def record(
    tx: Tx,
    caller: Caller,
    params: EventRecordParams,
    filing_key: str | None = None,
    *,
    drop_over_quota: bool = False,
) -> EventRecordResult:
    """File one event. A session id must be one of this daemon's sessions; without one,
    or with one it does not know but an agent session id beside it, the agent session id
    is matched to this daemon's session (or the event is filed under it alone). The event
    counts for the caller's quota, which bounds every trail of one principal together
    (agent session ids are the client's to choose). ``filing_key``: see :func:`filed`.
    ``drop_over_quota``: with the quota full the event is not filed (``event_id`` 0)
    instead of refused, and what it does to its session still happens (a hook's
    guard must not stop with its trail)."""
    kind, session_id, agent_session_id, payload = (
        params.kind, params.session_id, params.agent_session_id, params.payload
    )  # fmt: skip
    max_payload, principal, quota_rows = (
        tx.config.event_max_payload, caller.principal, tx.config.quota_rows
    )  # fmt: skip
    if session_id is None and agent_session_id is None:
        raise BadArgs("an event needs a session_id or an agent_session_id")
    row = None
    if session_id is not None:
        row = tx.conn.execute(
            "SELECT agent_session_id FROM sessions WHERE session_id = ? AND daemon_id = ?",
            (session_id, tx.daemon_id),
        ).fetchone()
        if row is None and agent_session_id is None:
            raise fleet.no_such_session(session_id)
    if row is not None:
        agent_session_id = agent_session_id or row[0]
    else:  # no session id, or a stale one (a wrapper's old id): the agent's own id decides
        found = tx.conn.execute(
            "SELECT session_id FROM sessions WHERE agent_session_id = ? AND daemon_id = ?",
            (agent_session_id, tx.daemon_id),
        ).fetchone()
        session_id = found[0] if found else None
    packed = pack(payload)
    if len(packed) > max_payload:
        raise BadArgs(
            f"the event payload is {len(packed)} bytes as msgpack; the limit is {max_payload}",
            {"bytes": len(packed), "max_bytes": max_payload},
        )
    if drop_over_quota and not quota.has_room(tx, principal, "events", quota_rows):
        event_id = 0
    else:
        quota.require_room(tx, principal, "events", quota_rows)
        event_id = tx.conn.execute(
            """INSERT INTO events (session_id, agent_session_id, kind, at, payload, daemon_id,
                   principal, filing_key)
               VALUES (?, ?, ?, ?, ?, ?, ?, ?) RETURNING event_id""",
            (session_id, agent_session_id, kind, tx.now, packed, tx.daemon_id, principal,
             filing_key),
        ).fetchone()[0]  # fmt: skip
        trail = TrailEvent(event_id, session_id, agent_session_id, kind, tx.now, payload)
        note(tx, "events", trail)
    if session_id is not None and kind in _EXITED_BY_KIND:
        fleet.set_exited(tx, session_id, _EXITED_BY_KIND[kind])
    return EventRecordResult(event_id=event_id, at=tx.now, session_id=session_id)


def _in(column: str, values: list[str]) -> tuple[str, list[str]]:
    """``column IN (?, ...)`` over the distinct values (the lists are bounded by
    MAX_SCOPE_IDS at the boundary, so SQLite's variable limit is never reached)."""
    distinct = list(dict.fromkeys(values))
    return f"{column} IN ({', '.join('?' * len(distinct))})", distinct


def list_events(tx: Tx, caller: Caller, params: EventListParams) -> EventListResult:
    """``event.list``: see :func:`page`."""
    return page(tx, params, tx.config.page_bytes)


def page(tx: Tx, params: EventListParams, byte_budget: int) -> EventListResult:
    """Newest first. An absent id list does not filter, an empty one matches nothing,
    and the given lists combine with OR; so a scope of only empty lists matches no row."""
    session_ids, agent_session_ids, kinds = (
        params.session_ids, params.agent_session_ids, params.kinds
    )  # fmt: skip
    before, limit = params.before, params.limit
    where: list[str] = ["event_id < ?"]
    args: list[Any] = [before if before is not None else 2**63 - 1]
    if session_ids is not None or agent_session_ids is not None:
        scope = [
            _in(column, ids)
            for column, ids in (
                ("session_id", session_ids),
                ("agent_session_id", agent_session_ids),
            )
            if ids
        ]
        if not scope:
            return EventListResult(events=[])
        where.append("(" + " OR ".join(clause for clause, _ in scope) + ")")
        args += [value for _, values in scope for value in values]
    if kinds is None:
        where.append("kind != ?")
        args.append(HEARTBEAT)
    elif not kinds:
        return EventListResult(events=[])
    else:
        clause, values = _in("kind", kinds)
        where.append(clause)
        args += values
    rows = tx.conn.execute(
        "SELECT event_id, session_id, agent_session_id, kind, at, payload FROM events "
        f"WHERE {' AND '.join(where)} ORDER BY event_id DESC LIMIT ?",
        (*args, limit + 1),
    ).fetchall()
    events = [(row[0], TrailEvent(*row[:5], payload=unpack(row[5]))) for row in rows]  # type: ignore[misc]
    page, next_before = take_page(events, limit, byte_budget)
    return EventListResult(events=page, next_before=next_before)


def _newest(
    tx: Tx, column: str, value: str, *, skip_heartbeats: bool
) -> tuple[int, int, str] | None:
    """(event_id, at, kind) of the newest event filed under one id: a backward walk of
    that id's index, a few rows at most, however long the session's trail is."""
    return tx.conn.execute(
        f"SELECT event_id, at, kind FROM events WHERE {column} = ?"
        + (" AND kind != ?" if skip_heartbeats else "")
        + " ORDER BY event_id DESC LIMIT 1",
        (value, HEARTBEAT) if skip_heartbeats else (value,),
    ).fetchone()


def _latest(tx: Tx, session_id: str, agent_session_id: str | None) -> tuple[Any, Any]:
    """(newest event time, newest non-heartbeat kind) filed under either id."""
    ids = [("session_id", session_id)]
    if agent_session_id:
        ids.append(("agent_session_id", agent_session_id))
    newest = max(
        (row for column, value in ids
         if (row := _newest(tx, column, value, skip_heartbeats=False)) is not None),
        default=None,
    )  # fmt: skip
    kind = max(
        (row for column, value in ids
         if (row := _newest(tx, column, value, skip_heartbeats=True)) is not None),
        default=None,
    )  # fmt: skip
    return (newest[1] if newest else None), (kind[2] if kind else None)


def activity(tx: Tx, caller: Caller, params: SessionActivityParams) -> SessionActivityResult:
    """Each session's last activity and attention, among the rows shown (fleet.shown_box),
    cut to fit a frame."""
    box = fleet.shown_box(tx, params.daemon_id)
    return fitted(activity_of(tx, params.session_ids, box), tx.config.page_bytes)


def activity_of(
    tx: Tx, session_ids: list[str] | None, daemon_id: str | None
) -> SessionActivityResult:
    """The activity of ``daemon_id``'s sessions (None: every box's), those of
    ``session_ids`` only when given, in stored order."""
    clause, args = where(daemon_id=daemon_id)
    rows = tx.conn.execute(
        f"SELECT session_id, agent_session_id, exited, live, daemon_id FROM sessions {clause} "
        "ORDER BY rowid",
        args,
    ).fetchall()
    wanted = None if session_ids is None else set(session_ids)
    sessions = []
    for session_id, agent_session_id, exited, live, box in rows:
        if wanted is not None and session_id not in wanted:
            continue
        newest, kind = _latest(tx, session_id, agent_session_id)
        sessions.append(
            SessionActivity(
                session_id,
                newest,
                kind,
                attention(bool(exited), kind),
                box,
                None if live is None else bool(live),
            )  # fmt: skip
        )
    return SessionActivityResult(sessions=sessions)


def restore_plan(tx: Tx, caller: Caller, params: RestorePlanParams) -> RestorePlanResult:
    """``fleet.restore_plan``: see :func:`plan`, cut to fit a frame."""
    return fitted(plan(tx, params.daemon_id), tx.config.page_bytes)


def plan(tx: Tx, daemon_id: str | None = None) -> RestorePlanResult:
    """The sessions shown (fleet.shown_box: ``daemon_id``'s, else by default this daemon's
    on the embedded store, every box's on a shared one) that have not exited, newest
    activity first, each top-level session followed by its own sub-sessions (newest
    first), so a wrapper restoring in order always brings a parent back before its
    children. A parent is always of its child's box (fleet rows link within one fleet)."""
    rows = [row for row in fleet.list_shown(tx, daemon_id) if not row.exited]
    present = {row.session_id for row in rows}

    def recency(row: Any) -> int:
        """Activity is the trail and the last attach; a row's own writes (a rename, a
        whole-fleet write) are not, and count only for a session with neither."""
        newest, _kind = _latest(tx, row.session_id, row.agent_session_id)
        active = max(newest or 0, row.last_attached_at or 0)
        return active or row.updated_at

    entries = {
        row.session_id: RestorePlanEntry(
            session_id=row.session_id,
            daemon_id=row.daemon_id,
            parent=row.parent if row.parent in present else None,
            agent=row.agent,
            agent_session_id=row.agent_session_id,
            cwd=row.cwd,
            name=row.name,
            model=row.model,
            effort=row.effort,
            target=row.target,
            target_identity=row.target_identity,
            transcript_path=row.transcript_path,
            last_activity_at=recency(row),
        )
        for row in rows
    }
    newest_first = sorted(entries.values(), key=lambda e: -(e.last_activity_at or 0))
    plan: list[RestorePlanEntry] = []
    for entry in newest_first:
        if entry.parent is None:
            plan.append(entry)
            plan += [child for child in newest_first if child.parent == entry.session_id]
    return RestorePlanResult(sessions=plan)


def prune(tx: Tx, cutoff: int, per_session: int, per_principal: int | None = None) -> int:
    """Events older than ``cutoff``, beyond the newest ``per_session`` of a session (and of
    an agent session id), and beyond the newest ``per_principal`` of a principal: so
    events filed under ever new agent session ids are bounded too."""
    pruned = tx.conn.execute("DELETE FROM events WHERE at < ?", (cutoff,)).rowcount
    if per_principal is not None:
        pruned += _prune_per_principal(tx, per_principal)
    for column in ("session_id", "agent_session_id"):
        crowded = tx.conn.execute(
            f"SELECT {column} FROM events WHERE {column} IS NOT NULL "
            f"GROUP BY {column} HAVING count(*) > ?",
            (per_session,),
        ).fetchall()
        for (owner,) in crowded:
            pruned += tx.conn.execute(
                f"""DELETE FROM events WHERE {column} = ? AND event_id < (
                        SELECT event_id FROM events WHERE {column} = ?
                        ORDER BY event_id DESC LIMIT 1 OFFSET ?)""",
                (owner, owner, per_session - 1),
            ).rowcount
    return pruned


def _prune_per_principal(tx: Tx, keep: int) -> int:
    """The oldest events of each principal that has more than ``keep`` (its count is read
    from the quota counters, not counted)."""
    crowded = tx.conn.execute(
        "SELECT principal, rows FROM quota_usage WHERE tbl = 'events' AND rows > ?", (keep,)
    ).fetchall()
    pruned = 0
    for principal, rows in crowded:
        pruned += tx.conn.execute(
            """DELETE FROM events WHERE event_id IN (
                   SELECT event_id FROM events WHERE principal = ? ORDER BY event_id LIMIT ?)""",
            (principal, rows - keep),
        ).rowcount
    return pruned
