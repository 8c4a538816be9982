"""Fleet rows: one per agent session, owned by one daemon at one epoch.

Every write that touches a session first proves ownership: a session owned by
another daemon id, or recorded under a later epoch than the writer's, refuses
the whole write with ``stale_epoch``. Parent links always form a one-level
hierarchy within one daemon's fleet (see :mod:`relink`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import msgspec

from towerd.daemon.processes import Holder
from towerd.daemon.store import boxes, quota
from towerd.daemon.store.idempotency import log_operator_action, once_under_key
from towerd.daemon.store.ids import random_uuid
from towerd.daemon.store.reconcile import settle
from towerd.daemon.store.relink import relink
from towerd.daemon.store.tx import Caller, Tx, note, own_box, take_page, where
from towerd.protocol import fields
from towerd.protocol.changes import FleetAdopted, FleetRemoved, FleetUpserted, IdemChanged
from towerd.protocol.errors import BadArgs, Conflict, NotFound, StaleEpoch
from towerd.protocol.methods import (
    SESSION_FIELDS,
    FleetAdoptParams,
    FleetAdoptResult,
    FleetGetParams,
    FleetListParams,
    FleetListResult,
    FleetWriteParams,
    FleetWriteResult,
    SessionEntry,
    SessionIdParams,
    SessionRegisterParams,
    SessionRegisterResult,
    SessionRemoveResult,
    SessionRow,
    SessionUpdateParams,
)

_WRITTEN_COLUMNS = ("session_id", *SESSION_FIELDS, "daemon_id", "owner_epoch", "updated_at")
AGENT_COLUMNS = ("agent_pid", "live")  # kept by hooks (store/agents.py) and the sweep
ROW_COLUMNS = (*_WRITTEN_COLUMNS, *AGENT_COLUMNS)
_SELECT_ROW = f"SELECT {', '.join(ROW_COLUMNS)} FROM sessions"
# A point read's statements, built once (sqlite3 finds a prepared statement by its text).
_GET_ANY_BOX = f"{_SELECT_ROW} WHERE session_id = ?"
_GET_IN_BOX = f"{_SELECT_ROW} WHERE session_id = ? AND daemon_id = ?"
_BOOLEAN_FIELDS = frozenset({"pinned", "exited", "live"})
_SQLITE_MAX_VARIABLES = 500  # stay far below SQLite's limit when chunking IN (...)


_PINNED, _EXITED, _LIVE = (ROW_COLUMNS.index(name) for name in ("pinned", "exited", "live"))
assert ROW_COLUMNS == SessionRow.__struct_fields__, "SELECT order must match SessionRow"


def row_from_sql(values: Sequence[Any]) -> SessionRow:
    """A SessionRow from a row selected as ROW_COLUMNS (positional: a point read is hot)."""
    fields = list(values)
    fields[_PINNED] = bool(fields[_PINNED])
    fields[_EXITED] = bool(fields[_EXITED])
    if fields[_LIVE] is not None:
        fields[_LIVE] = bool(fields[_LIVE])
    return SessionRow(*fields)


def _sql_value(name: str, value: Any) -> Any:
    return int(value) if name in _BOOLEAN_FIELDS and value is not None else value


def _chunks(items: Sequence[str]) -> Iterable[Sequence[str]]:
    for start in range(0, len(items), _SQLITE_MAX_VARIABLES):
        yield items[start : start + _SQLITE_MAX_VARIABLES]


# --- ownership ---------------------------------------------------------------------


def require_writable(tx: Tx, session_ids: Iterable[str]) -> None:
    """Refuse the write if any session belongs to another daemon or a later epoch."""
    ids = sorted(set(session_ids))
    for chunk in _chunks(ids):
        stale = tx.conn.execute(
            f"""SELECT session_id, daemon_id, owner_epoch FROM sessions
                WHERE session_id IN ({",".join("?" * len(chunk))})
                  AND (daemon_id != ? OR owner_epoch > ?)
                LIMIT 1""",
            (*chunk, tx.daemon_id, tx.owner_epoch),
        ).fetchone()
        if stale is not None:
            session_id, daemon_id, epoch = stale
            raise StaleEpoch(
                f"session {session_id} is owned by daemon {daemon_id} at epoch {epoch}; "
                f"this daemon writes as {tx.daemon_id} at epoch {tx.owner_epoch}",
                {
                    "session_id": session_id,
                    "owner_daemon_id": daemon_id,
                    "owner_epoch": epoch,
                    "daemon_id": tx.daemon_id,
                    "epoch": tx.owner_epoch,
                },
            )


# --- reads -------------------------------------------------------------------------


def shown_box(tx: Tx, daemon_id: str | None) -> str | None:
    """The box a fleet read (``fleet.list``, ``fleet.get``, ``session.activity``,
    ``fleet.restore_plan``) shows the rows of, or None for every box's. A given
    ``daemon_id`` is that box; by default the embedded store (one box) shows this
    daemon's own rows (docs/protocol.md §8), a store several boxes share every box's.
    Reads only: writes stay the owner's (``require_writable``)."""
    if daemon_id is None:
        return tx.daemon_id if tx.one_box else None
    return daemon_id


def get_session(tx: Tx, session_id: str) -> SessionRow:
    """One of this daemon's rows (another daemon's rows are not visible here)."""
    values = tx.conn.execute(_GET_IN_BOX, (session_id, tx.daemon_id)).fetchone()
    if values is None:
        raise no_such_session(session_id)
    return row_from_sql(values)


def get(tx: Tx, caller: Caller, params: FleetGetParams) -> SessionRow:
    """``fleet.get``: the row, among the rows shown (see :func:`shown_box`)."""
    session_id, box = params.session_id, shown_box(tx, params.daemon_id)
    if box is None:
        values = tx.conn.execute(_GET_ANY_BOX, (session_id,)).fetchone()
    else:
        values = tx.conn.execute(_GET_IN_BOX, (session_id, box)).fetchone()
    if values is None:
        if box is None:
            raise no_such_session(session_id, "any box's fleet")
        if box != tx.daemon_id:
            raise no_such_session(session_id, f"daemon {box}'s fleet")
        raise no_such_session(session_id)
    return row_from_sql(values)


def list_sessions(tx: Tx, caller: Caller, params: FleetListParams) -> FleetListResult:
    """The rows shown (see :func:`shown_box`) in stored order, one page at a
    time (cursor = last rowid seen); a page holds at most ``limit`` rows and about half
    a frame of encoded bytes."""
    limit, cursor, byte_budget = params.limit, params.cursor, tx.config.page_bytes
    clause, args = where(("rowid > ?", cursor or 0), daemon_id=shown_box(tx, params.daemon_id))
    rows = tx.conn.execute(
        f"""SELECT rowid, {", ".join(ROW_COLUMNS)} FROM sessions
            {clause} ORDER BY rowid LIMIT ?""",
        (*args, limit + 1),
    ).fetchall()
    sessions, next_cursor = take_page(
        [(row[0], row_from_sql(row[1:])) for row in rows], limit, byte_budget
    )
    return FleetListResult(sessions=sessions, next_cursor=next_cursor)


def list_all(tx: Tx) -> list[SessionRow]:
    """Every one of this daemon's rows, in stored order (the watch snapshot)."""
    return _rows_where(tx, *where(daemon_id=tx.daemon_id))


def list_shown(tx: Tx, daemon_id: str | None) -> list[SessionRow]:
    """Every row shown (see :func:`shown_box`), in stored order (the restore plan)."""
    return _rows_where(tx, *where(daemon_id=shown_box(tx, daemon_id)))


def _rows_where(tx: Tx, clause: str, args: list[Any]) -> list[SessionRow]:
    return [
        row_from_sql(values)
        for values in tx.conn.execute(f"{_SELECT_ROW} {clause} ORDER BY rowid", args)
    ]


def count_sessions(tx: Tx) -> int:
    return tx.conn.execute(
        "SELECT count(*) FROM sessions WHERE daemon_id = ?", (tx.daemon_id,)
    ).fetchone()[0]


# --- single-row writes ---------------------------------------------------------------


def no_such_session(session_id: str, where: str = "this daemon's fleet") -> NotFound:
    return NotFound(f"no session {session_id} in {where}", {"session_id": session_id})


def own_row(tx: Tx, session_id: str) -> tuple[str | None, str | None] | None:
    """(parent, agent_session_id) of one of this daemon's rows, or None."""
    return tx.conn.execute(
        "SELECT parent, agent_session_id FROM sessions WHERE session_id = ? AND daemon_id = ?",
        (session_id, tx.daemon_id),
    ).fetchone()


def require_own_row(tx: Tx, session_id: str) -> tuple[str | None, str | None]:
    """``own_row``, or ``not_found`` when this daemon has no such row."""
    row = own_row(tx, session_id)
    if row is None:
        raise no_such_session(session_id)
    return row


def _top_level_parent(tx: Tx, parent: str) -> str:
    """The top-level row a new link to ``parent`` must point at (rule 3 of relink)."""
    row = own_row(tx, parent)
    if row is None:
        raise NotFound(
            f"parent session {parent} is not in this daemon's fleet", {"session_id": parent}
        )
    return row[0] or parent


def _require_unique_agent_session(tx: Tx, agent_session_id: str | None, session_id: str) -> None:
    if agent_session_id is None:
        return
    holder = tx.conn.execute(
        """SELECT session_id FROM sessions
           WHERE daemon_id = ? AND agent_session_id = ? AND session_id != ?""",
        (tx.daemon_id, agent_session_id, session_id),
    ).fetchone()
    if holder is not None:
        raise Conflict(
            f"agent session {agent_session_id} already belongs to session {holder[0]}",
            {"agent_session_id": agent_session_id, "session_id": holder[0]},
        )


def insert_session(tx: Tx, params: SessionRegisterParams) -> str:
    """Insert one row; the caller's session id is kept, else one is minted."""
    session_id = params.session_id or random_uuid()
    require_writable(tx, [session_id])
    if own_row(tx, session_id) is not None:
        raise Conflict(f"session {session_id} is already registered", {"session_id": session_id})
    fields = {name: getattr(params, name) for name in SESSION_FIELDS}
    if fields["parent"] is not None:
        if fields["parent"] == session_id:
            raise BadArgs("a session cannot be its own parent")
        fields["parent"] = _top_level_parent(tx, fields["parent"])
    _require_unique_agent_session(tx, fields["agent_session_id"], session_id)
    _insert_row(tx, session_id, fields)
    return session_id


def _noted(tx: Tx, session_id: str) -> None:
    """Tell fleet watchers the row as it now stands."""
    if tx.changes is not None:
        note(tx, "fleet", FleetUpserted(get_session(tx, session_id)))


def _insert_row(tx: Tx, session_id: str, fields: dict[str, Any]) -> None:
    tx.conn.execute(
        f"INSERT INTO sessions ({', '.join(_WRITTEN_COLUMNS)}) "
        f"VALUES ({', '.join('?' * len(_WRITTEN_COLUMNS))})",
        (
            session_id,
            *(_sql_value(name, fields[name]) for name in SESSION_FIELDS),
            tx.daemon_id,
            tx.owner_epoch,
            tx.now,
        ),
    )
    _noted(tx, session_id)


def _update_row(tx: Tx, session_id: str, fields: dict[str, Any]) -> None:
    assignments = ", ".join(f"{name} = ?" for name in fields)
    tx.conn.execute(
        f"UPDATE sessions SET {assignments}{', ' if fields else ''}owner_epoch = ?, updated_at = ? "
        "WHERE session_id = ?",
        (
            *(_sql_value(name, value) for name, value in fields.items()),
            tx.owner_epoch,
            tx.now,
            session_id,
        ),
    )
    _noted(tx, session_id)


def update_fields(tx: Tx, session_id: str, fields: dict[str, Any]) -> None:
    """Rewrite ``fields`` of one of this daemon's rows (checked writable by the caller)."""
    _update_row(tx, session_id, fields)


def update_session(tx: Tx, caller: Caller, params: SessionUpdateParams) -> SessionRow:
    """Rewrite the given fields of one row; a new parent keeps the hierarchy one level deep."""
    session_id = params.session_id
    require_writable(tx, [session_id])
    require_own_row(tx, session_id)
    fields = params.given_fields()
    if fields.get("parent") is not None:
        if fields["parent"] == session_id:
            raise BadArgs("a session cannot be its own parent")
        parent = _top_level_parent(tx, fields["parent"])
        if parent == session_id:
            raise Conflict(
                f"making {fields['parent']} the parent of {session_id} would create a cycle "
                f"({fields['parent']} is a sub-session of {session_id})",
                {"session_id": session_id, "parent": fields["parent"]},
            )
        fields["parent"] = parent
        # This row becomes a sub-session: its own sub-sessions move up with it.
        children = [
            row[0]
            for row in tx.conn.execute(
                "SELECT session_id FROM sessions WHERE parent = ? AND daemon_id = ?",
                (session_id, tx.daemon_id),
            )
        ]
        require_writable(tx, children)
        for child in children:
            _update_row(tx, child, {"parent": parent})
    if "agent_session_id" in fields:
        _require_unique_agent_session(tx, fields["agent_session_id"], session_id)
    _update_row(tx, session_id, fields)
    return get_session(tx, session_id)


def set_exited(tx: Tx, session_id: str, exited: bool) -> None:
    """The agent reported that its session ended (SessionEnd) or started again
    (SessionStart, after a resume): the row says so, for the fleet list, ``top`` and the
    restore plan. Nothing is written when the row already says it."""
    row = tx.conn.execute(
        "SELECT exited FROM sessions WHERE session_id = ? AND daemon_id = ?",
        (session_id, tx.daemon_id),
    ).fetchone()
    if row is None or bool(row[0]) == exited:
        return
    require_writable(tx, [session_id])
    _update_row(tx, session_id, {"exited": exited})


# --- the agent process (towerctl hook, the holder sweep) ---------------------------------


def agent_holder(tx: Tx, session_id: str) -> Holder | None:
    """The session's agent process while it is known to run: the one that hooked it last
    (every one is in ``session_agents``)."""
    row = tx.conn.execute(
        "SELECT agent_pid, agent_start FROM sessions WHERE session_id = ? AND live = 1",
        (session_id,),
    ).fetchone()
    return None if row is None else Holder(*row)


def bind_agent(tx: Tx, session_id: str, holder: Holder, *, naming: bool) -> None:
    """``holder`` is the session's agent process (and runs); ``naming``: its SessionStart
    names this session its current one. Written only when something changes."""
    row = tx.conn.execute(
        "SELECT agent_pid, agent_start, live FROM sessions WHERE session_id = ?", (session_id,)
    ).fetchone()
    if row is None:
        return
    changed = tuple(row) != (holder.pid, holder.start, 1)
    if not changed and not naming:
        return
    # Each process the session's hooks come from, however many (one session resumed in
    # two terminals, an inherited TOWERD_SESSION_ID): found as its agent by
    # session_of_agent whichever hooked last.
    tx.conn.execute(
        """INSERT INTO session_agents (session_id, pid, start, named_at) VALUES (?, ?, ?, ?)
           ON CONFLICT (session_id, pid, start) DO UPDATE SET named_at = CASE WHEN ? = 1
               THEN excluded.named_at ELSE session_agents.named_at END""",
        (session_id, holder.pid, holder.start, tx.now, naming),
    )
    tx.conn.execute(
        """UPDATE sessions SET agent_pid = ?, agent_start = ?, live = 1,
               agent_named_at = CASE WHEN ? = 1 OR agent_named_at IS NULL OR ? = 1 THEN ?
                                     ELSE agent_named_at END
           WHERE session_id = ?""",
        (holder.pid, holder.start, naming, changed, tx.now, session_id),
    )
    if changed:
        _noted(tx, session_id)


def session_of_agent(tx: Tx, holder: Holder, *, live_only: bool = False) -> str | None:
    """The session the agent process ``holder`` runs now: the one it joined or started
    last (``live_only``: among rows still shown live), whether or not another process
    hooked that session since."""
    row = tx.conn.execute(
        f"""SELECT s.session_id FROM session_agents a
           JOIN sessions s ON s.session_id = a.session_id
           WHERE a.pid = ? AND a.start = ? AND s.daemon_id = ?
           {"AND s.live = 1" if live_only else ""}
           ORDER BY a.named_at DESC, s.rowid DESC LIMIT 1""",
        (holder.pid, holder.start, tx.daemon_id),
    ).fetchone()
    return None if row is None else row[0]


def agent_holders(tx: Tx) -> list[Holder]:
    """The agent processes of sessions shown live, every one of each session."""
    box, args = own_box(tx)
    return [
        Holder(pid, start)
        for pid, start in tx.conn.execute(
            f"""SELECT DISTINCT a.pid, a.start FROM session_agents a
               JOIN sessions s ON s.session_id = a.session_id WHERE s.live = 1{box}""",
            args,
        )
    ]


def agents_gone(tx: Tx, dead: Iterable[Holder]) -> list[str]:
    """Sessions whose every agent process died are no longer live (not exited: a session
    that did not end is what a restore brings back); one whose last-hooking process
    died while another of its processes runs names that one."""
    box, args = own_box(tx)
    touched: list[str] = []
    for holder in dead:
        touched += [
            row[0]
            for row in tx.conn.execute(
                f"""SELECT session_id FROM sessions
                   WHERE agent_pid = ? AND agent_start = ? AND live = 1{box}""",
                (holder.pid, holder.start, *args),
            ).fetchall()
        ]
        tx.conn.execute(
            f"""DELETE FROM session_agents WHERE pid = ? AND start = ?
               AND session_id IN (SELECT session_id FROM sessions WHERE TRUE{box})""",
            (holder.pid, holder.start, *args),
        )
    gone: list[str] = []
    for session_id in dict.fromkeys(touched):
        other = tx.conn.execute(
            """SELECT pid, start FROM session_agents WHERE session_id = ?
               ORDER BY named_at DESC LIMIT 1""",
            (session_id,),
        ).fetchone()
        if other is None:
            tx.conn.execute("UPDATE sessions SET live = 0 WHERE session_id = ?", (session_id,))
            gone.append(session_id)
        else:
            tx.conn.execute(
                "UPDATE sessions SET agent_pid = ?, agent_start = ? WHERE session_id = ?",
                (*other, session_id),
            )
        _noted(tx, session_id)
    return gone


def remove_session(tx: Tx, caller: Caller, params: SessionIdParams) -> SessionRemoveResult:
    """Delete one row; its sub-sessions become top-level."""
    session_id = params.session_id
    require_writable(tx, [session_id])
    require_own_row(tx, session_id)
    tx.conn.execute("DELETE FROM sessions WHERE session_id = ?", (session_id,))
    tx.conn.execute("DELETE FROM session_agents WHERE session_id = ?", (session_id,))
    note(tx, "fleet", FleetRemoved(session_id))
    children = [
        row[0]
        for row in tx.conn.execute(
            "SELECT session_id FROM sessions WHERE parent = ? AND daemon_id = ?",
            (session_id, tx.daemon_id),
        )
    ]
    for child in children:
        _update_row(tx, child, {"parent": None})
    return SessionRemoveResult(session_id=session_id, removed=True)


# --- whole-fleet writes --------------------------------------------------------------


def write_fleet(tx: Tx, caller: Caller, params: FleetWriteParams) -> FleetWriteResult:
    """``fleet.write``: see :func:`replace_rows`."""
    return replace_rows(tx, params.sessions, params.removed)


def replace_rows(
    tx: Tx, entries: Sequence[SessionEntry], removed: Sequence[str]
) -> FleetWriteResult:
    """Replace the given rows and delete the removed ones, in one transaction.

    Rows not mentioned are kept. Among the given entries, those sharing an
    agent session id keep the one written last; a stored row that is not
    mentioned but shares an agent session id with a kept entry is a
    ``conflict`` (list it in ``removed`` to replace it). Parent links of the
    whole fleet are then relinked to one level.
    """
    removed_set = set(removed)
    both = removed_set.intersection(entry.session_id for entry in entries)
    if both:
        raise BadArgs(f"sessions both written and removed: {sorted(both)}")
    require_writable(tx, [*(entry.session_id for entry in entries), *removed_set])

    # Keep the last entry per session id, then the last per agent session id.
    latest: dict[str, SessionEntry] = {}
    for entry in entries:
        latest.pop(entry.session_id, None)
        latest[entry.session_id] = entry
    survivor_of: dict[str, str] = {}
    for entry in latest.values():
        if entry.agent_session_id is not None:
            survivor_of[entry.agent_session_id] = entry.session_id
    replaced = {
        entry.session_id: survivor_of[entry.agent_session_id]
        for entry in latest.values()
        if entry.agent_session_id is not None
        and survivor_of[entry.agent_session_id] != entry.session_id
    }
    kept = {sid: entry for sid, entry in latest.items() if sid not in replaced}

    stored = tx.conn.execute(
        "SELECT session_id, agent_session_id, parent FROM sessions "
        "WHERE daemon_id = ? ORDER BY rowid",
        (tx.daemon_id,),
    ).fetchall()
    stored_ids = {row[0] for row in stored}
    mentioned = kept.keys() | replaced.keys() | removed_set
    for session_id, agent_session_id, _parent in stored:
        if session_id in mentioned or agent_session_id is None:
            continue
        owner = survivor_of.get(agent_session_id)
        if owner is not None:
            raise Conflict(
                f"agent session {agent_session_id} is held by stored session {session_id}, "
                f"which this write does not mention; list it in `removed` to replace it",
                {"agent_session_id": agent_session_id, "session_id": session_id},
            )

    # The fleet after the write, in stored order, new rows appended in given order.
    order = [row[0] for row in stored if row[0] not in removed_set and row[0] not in replaced]
    order += [sid for sid in kept if sid not in stored_ids]
    links: dict[str, str | None] = {row[0]: row[2] for row in stored}
    links.update((sid, entry.parent) for sid, entry in latest.items())
    parents = relink(order, links, replaced)

    deleted = [sid for sid in (*removed_set, *replaced) if sid in stored_ids]
    for sid in deleted:
        tx.conn.execute("DELETE FROM sessions WHERE session_id = ?", (sid,))
        tx.conn.execute("DELETE FROM session_agents WHERE session_id = ?", (sid,))
        note(tx, "fleet", FleetRemoved(sid))
    # Free every agent session id being rewritten before any row takes one.
    for sid in kept.keys() & stored_ids:
        tx.conn.execute("UPDATE sessions SET agent_session_id = NULL WHERE session_id = ?", (sid,))

    relinked = 0
    for sid in order:
        kept_entry = kept.get(sid)
        if kept_entry is None:
            if parents[sid] != links[sid]:
                _update_row(tx, sid, {"parent": parents[sid]})
                relinked += 1
            continue
        if parents[sid] != kept_entry.parent:
            relinked += 1
        fields = {name: getattr(kept_entry, name) for name in SESSION_FIELDS}
        fields["parent"] = parents[sid]
        if sid in stored_ids:
            _update_row(tx, sid, fields)
        else:
            _insert_row(tx, sid, fields)
    return FleetWriteResult(
        written=len(kept),
        removed=sum(1 for sid in removed_set if sid in stored_ids),
        dropped=sorted(replaced),
        relinked=relinked,
    )


def agent_session_index(tx: Tx) -> dict[str, str]:
    """agent session id -> session id for this daemon's rows."""
    return dict(
        tx.conn.execute(
            "SELECT agent_session_id, session_id FROM sessions "
            "WHERE daemon_id = ? AND agent_session_id IS NOT NULL",
            (tx.daemon_id,),
        ).fetchall()
    )


def _refuse_a_box_not_dead(tx: Tx, daemon_id: str, presence_at: int, dead_at: int | None) -> None:
    """On a store several boxes share, only a box declared dead is adopted: a box still
    present (or lapsed, not yet declared dead) runs its agents, whose pids only it may
    check; adopted, their liveness would be judged by this box, on the wrong machine."""
    if tx.one_box:
        return
    ttl = boxes.ttl_of(tx, boxes.ttls(tx), daemon_id)
    box_state = boxes.state(tx, daemon_id, presence_at, dead_at, ttl)
    if box_state != "dead":
        raise Conflict(
            f"box {daemon_id} is {box_state}, not dead: only a dead box's fleet is adopted. "
            f"Wait until `towerctl boxes` shows it dead (silent for the presence TTL, "
            f"{ttl // 1000} s), or "
            "stop its daemon first",
            {"daemon_id": daemon_id, "state": box_state},
        )


LOGGED_PROBES = 100  # an adoption's operator-log entry lists at most this many probes


def _unprobe(tx: Tx, from_daemon_id: str) -> list[tuple[Any, ...]]:
    """A shared store: the adopted box's unsettled keys are not probed by this box. Their
    commands ran on that box, whose processes this one cannot see, and a box declared
    dead may only be cut off: a probe here would not know that the command (or what it
    started) still runs there, and its "did not happen" would let a retry run it again
    beside it (a hostile tester's reproducer). A person settles them (`idem resolve`);
    the operator log keeps their probes."""
    where = "WHERE daemon_id = ? AND state = 'outcome_unknown' AND probe IS NOT NULL"
    probes = tx.conn.execute(
        f"SELECT principal, operation, key, probe, probe_cwd FROM idempotency {where} "
        "ORDER BY rowid",
        (from_daemon_id,),
    ).fetchall()
    tx.conn.execute(
        f"UPDATE idempotency SET probe = NULL, probe_cwd = NULL, probe_next_at = NULL {where}",
        (from_daemon_id,),
    )
    return probes


def adopt_fleet(tx: Tx, caller: Caller, params: FleetAdoptParams) -> FleetAdoptResult:
    """Move every row of a daemon that is gone for good to this daemon, at its epoch.

    An operator's takeover: recorded in the operator log."""
    principal, from_daemon_id = caller.principal, params.daemon_id
    if from_daemon_id == tx.daemon_id:
        raise BadArgs("a daemon cannot adopt its own fleet")
    known = tx.conn.execute(
        "SELECT presence_at, dead_at FROM daemons WHERE daemon_id = ?", (from_daemon_id,)
    ).fetchone()
    if known is None:
        raise NotFound(
            f"no daemon {from_daemon_id} is recorded in this store",
            {"daemon_id": from_daemon_id},
        )
    _refuse_a_box_not_dead(tx, from_daemon_id, *known)
    clash = tx.conn.execute(
        """SELECT theirs.session_id, theirs.agent_session_id, ours.session_id
           FROM sessions AS theirs JOIN sessions AS ours
             ON ours.agent_session_id = theirs.agent_session_id AND ours.daemon_id = ?
           WHERE theirs.daemon_id = ? LIMIT 1""",
        (tx.daemon_id, from_daemon_id),
    ).fetchone()
    if clash is not None:
        raise Conflict(
            f"session {clash[0]} of daemon {from_daemon_id} and session {clash[2]} of this "
            f"daemon share agent session {clash[1]}; remove this daemon's session {clash[2]} "
            "(session.remove) before adopting",
            {"session_id": clash[2], "other_session_id": clash[0], "agent_session_id": clash[1]},
        )
    adopted = tx.conn.execute(
        "UPDATE sessions SET daemon_id = ?, owner_epoch = ?, updated_at = ? WHERE daemon_id = ?",
        (tx.daemon_id, tx.owner_epoch, tx.now, from_daemon_id),
    ).rowcount
    note(tx, "fleet", FleetAdopted(from_daemon_id, adopted))
    # Its keys come along and are reconciled as at a start: whatever it had in
    # progress is unknown now, unless the effect left evidence.
    interrupted = tx.conn.execute(
        """UPDATE idempotency SET state = 'outcome_unknown', updated_at = ?
           WHERE state = 'in_progress' AND daemon_id = ?
           RETURNING rowid, operation, effect_ref, principal, key""",
        (tx.now, from_daemon_id),
    ).fetchall()
    for _rowid, operation, effect_ref, key_principal, key in interrupted:
        note(tx, "idem", IdemChanged(key_principal, operation, key, "outcome_unknown",
                                     effect_ref))  # fmt: skip
    interrupted = [(rowid, operation, ref) for rowid, operation, ref, _p, _k in interrupted]
    unprobed = [] if tx.one_box else _unprobe(tx, from_daemon_id)
    keys_adopted = tx.conn.execute(
        "UPDATE idempotency SET daemon_id = ? WHERE daemon_id = ?", (tx.daemon_id, from_daemon_id)
    ).rowcount
    # On a shared store that box's processes are not this machine's: none is evidence.
    settled = settle(tx if tx.one_box else msgspec.structs.replace(tx, as_dead_box=True),
                     interrupted)  # fmt: skip
    detail: dict[str, Any] = {
        "from_daemon_id": from_daemon_id, "adopted": adopted, "keys_adopted": keys_adopted
    }  # fmt: skip
    if unprobed:
        detail["keys_not_probed"] = len(unprobed)
        detail["probes"] = [
            {"principal": p, "operation": o, "key": k, "probe": c, "cwd": d}
            for p, o, k, c, d in unprobed[:LOGGED_PROBES]
        ]
    log_operator_action(tx, principal, "fleet.adopt", detail)
    return FleetAdoptResult(
        adopted=adopted,
        from_daemon_id=from_daemon_id,
        daemon_id=tx.daemon_id,
        owner_epoch=tx.owner_epoch,
        keys_adopted=keys_adopted,
        keys_marked_unknown=len(interrupted) - len(settled),
        keys_completed_from_evidence=len(settled),
    )


REGISTER_OPERATION = fields.REGISTER_OPERATION


def register_session(
    tx: Tx, caller: Caller, params: SessionRegisterParams
) -> SessionRegisterResult:
    """Insert one row; with an idempotency key, claim + insert + complete in this one
    transaction, so a retry answers the same session id and never inserts twice. A new
    key counts for the principal's quota, checked before the row is inserted."""
    if params.idempotency_key is None:
        return SessionRegisterResult(session_id=insert_session(tx, params))

    def create() -> dict[str, str]:
        quota.require_room(tx, caller.principal, "idempotency", tx.config.quota_rows)
        return {"session_id": insert_session(tx, params)}

    result = once_under_key(
        tx, caller.principal, REGISTER_OPERATION, params, caller.holder, create,
        "session_id", "a registration",
    )  # fmt: skip
    return SessionRegisterResult(session_id=result["session_id"])
