"""The agent's own loop: a hook's event with its session, and path leases.

``hook.event`` is what ``towerctl hook`` sends for every agent hook. In one
transaction it finds the event's fleet session (``TOWERD_SESSION_ID``, else the
agent's own session id), registers one the daemon does not know (so a fleet is
built from hooks alone, and a retried or concurrent SessionStart finds the row the
first one wrote), records the agent process as the session's liveness, files the
event as ``event.record`` does, releases the session's path leases at SessionEnd,
and guards a PreToolUse's target paths.

A path lease is a lease on ``path:<real path>`` held for a session, by its agent
process (so it goes when that process dies), for an idle TTL renewed by every edit.
A path is in another session's way when a live lease of another session (and
another agent process) is on it, on a directory above it, or, for a directory, on
a path below it. The guard leases all target paths or, when one is in the way and
the policy is ``deny``, none.
"""

from __future__ import annotations

import shlex
import time

from msgspec.structs import asdict

from towerd.daemon.processes import Holder
from towerd.daemon.store import events, fleet, leases
from towerd.daemon.store.tx import Caller, Tx
from towerd.protocol.errors import BadArgs, Conflict, LeaseHeld, NotFound, QuotaExceeded
from towerd.protocol.fields import PATH_LEASE_PREFIX
from towerd.protocol.methods import (
    Empty,
    EventKindSeen,
    EventLastSeenResult,
    EventRecordParams,
    HookEventParams,
    HookEventResult,
    PathClaimParams,
    PathClaimResult,
    PathHolder,
    PathLease,
    PathReleaseParams,
    PathReleaseResult,
    SessionRegisterParams,
)

SESSION_START, SESSION_END = "SessionStart", "SessionEnd"
PRE_TOOL_USE, POST_TOOL_USE = "PreToolUse", "PostToolUse"
PENDING_TTL_MS = 120_000  # a path leased before its edit ran, until the edit is seen done


def hook_event(
    tx: Tx, caller: Caller, params: HookEventParams, filing_key: str | None = None
) -> HookEventResult:
    """``hook.event``. ``caller.holder`` is the agent process when the handler accepted
    ``agent_pid``, else None. Under a ``filing_key`` already filed (the same event sent
    again: daemon/outbox.py) it answers that event and changes nothing."""
    if filing_key is not None and (earlier := events.filed(tx, filing_key)) is not None:
        return HookEventResult(
            event_id=earlier.event_id, at=earlier.at, session_id=earlier.session_id
        )
    agent = caller.holder if params.agent_pid is not None else None
    session_id, registered = _session_of_hook(tx, params)
    if session_id is not None and agent is not None:
        fleet.bind_agent(tx, session_id, agent, naming=params.kind == SESSION_START)
    recorded = events.record(
        tx,
        caller,
        EventRecordParams(
            kind=params.kind,
            session_id=session_id,
            agent_session_id=params.agent_session_id,
            payload=params.payload,
        ),
        filing_key,
        drop_over_quota=True,
    )
    result = HookEventResult(
        event_id=recorded.event_id,
        at=recorded.at,
        session_id=recorded.session_id,
        registered=registered,
        unfiled=recorded.event_id == 0,
    )
    session_id = recorded.session_id
    if session_id is None:
        return result  # nobody to hold a path for: the guard fails open
    if params.kind == SESSION_END:
        # The ending process's leases only: another process reporting the same session
        # (an inherited TOWERD_SESSION_ID, one session resumed twice) is another agent,
        # still editing; its leases go with its own end or death.
        ending = [
            lease
            for lease in leases.held_for_session(tx, session_id)
            if _ours(lease, session_id, agent)
        ]
        leases.release_matching(tx, ending, "session-ended")
    elif params.paths and params.guard != "off" and params.kind in (PRE_TOOL_USE, POST_TOOL_USE):
        holder = agent or fleet.agent_holder(tx, session_id)
        in_the_way = _in_the_way(tx, params.paths, session_id, holder)
        if in_the_way and params.kind == PRE_TOOL_USE:
            result.conflicts = in_the_way
            result.reason = _reason(in_the_way, params.guard)
            result.decision = "deny" if params.guard == "deny" else "warn"
        if result.decision != "deny":
            blocked = {conflict.target for conflict in in_the_way}
            free = [path for path in dict.fromkeys(params.paths) if path not in blocked]
            # Before the tool runs the lease is pending: an edit that fails, or that the
            # user refuses, holds its paths a short while; the PostToolUse of an edit
            # that was done holds them for the whole idle TTL.
            ttl = tx.config.path_lease_ttl_ms
            if params.kind == PRE_TOOL_USE:
                ttl = min(ttl, PENDING_TTL_MS)
            for n, path in enumerate(free):
                try:
                    leases.grant_for_session(
                        tx, caller.principal, holder, session_id, PATH_LEASE_PREFIX + path, ttl
                    )
                except QuotaExceeded:  # refused before it wrote: the rest go unleased
                    result.unleased = free[n:]
                    free = free[:n]
                    break
            result.leased = free
    return result


def _session_of_hook(tx: Tx, params: HookEventParams) -> tuple[str | None, bool]:
    """(the session the event belongs to, whether this event registered it)."""
    if params.session_id is not None and (row := fleet.own_row(tx, params.session_id)):
        if params.kind == SESSION_START and params.agent_session_id not in (None, row[1]):
            _adopt_agent_session(tx, params.session_id, params.agent_session_id)
        return params.session_id, False
    if params.agent_session_id is None:
        return None, False
    found = tx.conn.execute(
        "SELECT session_id FROM sessions WHERE agent_session_id = ? AND daemon_id = ?",
        (params.agent_session_id, tx.daemon_id),
    ).fetchone()
    if found is not None:
        if params.kind == SESSION_START:
            _fill_in(tx, found[0], params)
        return found[0], False
    if params.kind == SESSION_END or params.cwd is None:
        return None, False  # an ended session is not registered now; nor one without a cwd
    session_id = fleet.insert_session(
        tx,
        SessionRegisterParams(
            agent_session_id=params.agent_session_id,
            cwd=params.cwd,
            agent=params.agent,
            transcript_path=params.transcript_path,
            model=params.model,
        ),
    )
    return session_id, True


def _adopt_agent_session(tx: Tx, session_id: str, agent_session_id: str | None) -> None:
    """A SessionStart under TOWERD_SESSION_ID reports a new agent session id (a resume
    that forked, a restore): the row takes it, unless another row of this fleet has it."""
    taken = tx.conn.execute(
        "SELECT 1 FROM sessions WHERE agent_session_id = ? AND daemon_id = ?",
        (agent_session_id, tx.daemon_id),
    ).fetchone()
    if taken is None:
        fleet.require_writable(tx, [session_id])
        fleet.update_fields(tx, session_id, {"agent_session_id": agent_session_id})


def _fill_in(tx: Tx, session_id: str, params: HookEventParams) -> None:
    """A SessionStart of a known session (a resume): its transcript and model, if new."""
    row = fleet.get_session(tx, session_id)
    given = {"transcript_path": params.transcript_path, "model": params.model}
    changed = {
        name: value
        for name, value in given.items()
        if value is not None and value != getattr(row, name)
    }
    if changed:
        fleet.require_writable(tx, [session_id])
        fleet.update_fields(tx, session_id, changed)


# --- who is in the way ------------------------------------------------------------------


def _lineage(path: str) -> list[str]:
    """``path`` and every directory above it, as path lease resources."""
    chain = [path]
    while path != "/":
        path = path.rsplit("/", 1)[0] or "/"
        chain.append(path)
    return [PATH_LEASE_PREFIX + item for item in chain]


def _ours(lease: leases.Lease, session_id: str, holder: Holder | None) -> bool:
    """Whether a lease is the caller's own: held by the same agent process (one agent,
    whichever of its sessions: a new one after ``/clear``); where either side has no
    process, by the same session. Two processes sharing one session id (an inherited
    TOWERD_SESSION_ID) are two agents, each in the other's way."""
    if holder is not None and lease.holder is not None:
        return lease.holder == holder
    return lease.session_id == session_id


def _in_the_way(
    tx: Tx, paths: list[str], session_id: str | None, holder: Holder | None
) -> list[PathHolder]:
    found: list[PathHolder] = []
    for target in dict.fromkeys(paths):
        resource = PATH_LEASE_PREFIX + target
        for lease in leases.live_in_the_way(tx, _lineage(target), resource):
            if session_id is not None and _ours(lease, session_id, holder):
                continue
            found.append(_describe(tx, lease, target))
    return found


def _describe(tx: Tx, lease: leases.Lease, target: str) -> PathHolder:
    row = None
    if lease.session_id is not None:
        row = tx.conn.execute(
            "SELECT name, agent, cwd FROM sessions WHERE session_id = ?", (lease.session_id,)
        ).fetchone()
    name, agent, cwd = row if row is not None else (None, None, None)
    return PathHolder(
        path=lease.resource.removeprefix(PATH_LEASE_PREFIX),
        target=target,
        session_id=lease.session_id,
        name=name,
        agent=agent,
        cwd=cwd,
        holder=leases.describe_holder(lease.principal, lease.holder),
        holder_pid=lease.holder.pid if lease.holder else None,
        since=lease.acquired_at,
        expires_at=lease.expires_at,
    )


def _clock(ms: int) -> str:
    return time.strftime("%H:%M:%S %Z", time.localtime(ms / 1000))


def _reason(conflicts: list[PathHolder], policy: str) -> str:
    """What the agent reads: who holds which path since when, and what to do."""
    lines = []
    for conflict in conflicts:
        who = conflict.name or conflict.session_id or conflict.holder
        what = f"{conflict.agent or 'agent'} session {who}"
        if conflict.holder_pid is not None:
            what += f", process {conflict.holder_pid}"
        if conflict.cwd:
            what += f" (in {conflict.cwd})"
        through = "" if conflict.path == conflict.target else f" (it holds {conflict.path})"
        lines.append(
            f"{conflict.target} is being edited by another {what} since "
            f"{_clock(conflict.since)}{through}."
        )
    if policy == "deny":
        paths = " ".join(shlex.quote(path) for path in sorted({c.path for c in conflicts}))
        lines.append(
            "towerd denied this edit so that two agents do not clobber one file. Work on "
            f"something else meanwhile, or ask the user to run `towerctl release {paths}`."
        )
    else:
        lines.append("towerd allowed this edit; the other session may overwrite it.")
    return " ".join(lines)


# --- towerctl claim / release ---------------------------------------------------------


def _session_of_claim(
    tx: Tx, caller: Caller, session_id: str | None, agent_pid: int | None
) -> tuple[str | None, Holder | None]:
    """(session, its agent process) that a claim or a release acts for.

    A caller that runs inside an agent session (its own process or an ancestor is a
    live session's agent, however many wrappers are in between) acts for that session
    only: naming another is ``conflict``, so an agent denied a path cannot free it by
    naming its holder. Otherwise the given session, or the one whose agent process is
    ``agent_pid``; (None, None) for a caller that is no session's (a person)."""
    inside = _session_inside(tx, caller)
    if inside is not None:
        if session_id is not None and session_id != inside[0]:
            raise Conflict(
                f"this runs inside agent session {inside[0]}, which acts for itself only; "
                f"session {session_id}'s paths are freed by it, by its end, or by a person "
                "outside any agent session",
                {"session_id": session_id, "caller_session_id": inside[0]},
            )
        return inside
    if session_id is not None:
        fleet.require_own_row(tx, session_id)
        return session_id, fleet.agent_holder(tx, session_id)
    if agent_pid is None or caller.holder is None:
        return None, None
    found = fleet.session_of_agent(tx, caller.holder)
    return (found, caller.holder) if found is not None else (None, None)


def _session_inside(tx: Tx, caller: Caller) -> tuple[str, Holder] | None:
    """The session of the nearest process in the caller's lineage that is a live
    session's agent, with that process."""
    for holder in caller.lineage:
        found = fleet.session_of_agent(tx, holder, live_only=True)
        if found is not None:
            return found, holder
    return None


def claim(tx: Tx, caller: Caller, params: PathClaimParams) -> PathClaimResult:
    """``path.claim``: lease every path to the session, or none (``lease_held``)."""
    session_id, holder = _session_of_claim(tx, caller, params.session_id, params.agent_pid)
    if session_id is None:
        if params.agent_pid is None:
            raise BadArgs("path.claim needs a session_id or the agent_pid of an agent session")
        raise NotFound(
            f"process {params.agent_pid} runs no agent session towerd knows of; "
            "name the session (towerctl claim --session S)",
            {"agent_pid": params.agent_pid},
        )
    in_the_way = _in_the_way(tx, params.paths, session_id, holder)
    if in_the_way:
        raise LeaseHeld(_reason(in_the_way, "deny"), {"conflicts": [asdict(c) for c in in_the_way]})
    ttl = params.ttl_ms or tx.config.path_lease_ttl_ms
    granted = []
    for path in dict.fromkeys(params.paths):
        resource = PATH_LEASE_PREFIX + path
        token, expires_at = leases.grant_for_session(
            tx, caller.principal, holder, session_id, resource, ttl
        )
        granted.append(PathLease(path, resource, token, expires_at))
    return PathClaimResult(session_id=session_id, leases=granted)


def release(tx: Tx, caller: Caller, params: PathReleaseParams) -> PathReleaseResult:
    """``path.release``: the leases on these paths and below them, of the session (or its
    agent process); from a caller that is no session's, whoever holds them (a person
    freeing a path an agent holds: audited as theirs)."""
    session_id, holder = _session_of_claim(tx, caller, params.session_id, params.agent_pid)
    chosen: dict[str, leases.Lease] = {}
    for path in params.paths:
        resource = PATH_LEASE_PREFIX + path
        for lease in leases.live_in_the_way(tx, [resource], resource):
            if session_id is None or _ours(lease, session_id, holder):
                chosen[lease.resource] = lease
    actor = None if session_id is not None else f"{caller.principal} pid {caller.pid}"
    released = leases.release_matching(tx, list(chosen.values()), "released", actor=actor)
    return PathReleaseResult(
        released=[resource.removeprefix(PATH_LEASE_PREFIX) for resource in released],
        session_id=session_id,
    )


# --- hooks status ---------------------------------------------------------------------


def last_seen(tx: Tx, caller: Caller, params: Empty) -> EventLastSeenResult:
    """``event.last_seen``: per agent (of the session an event is filed under) and kind,
    when the newest event arrived and how many the trail keeps."""
    rows = tx.conn.execute(
        """SELECT s.agent, e.kind, max(e.at), count(*) FROM events AS e
           LEFT JOIN sessions AS s ON s.session_id = e.session_id
           WHERE e.daemon_id = ? AND e.kind != ?
           GROUP BY s.agent, e.kind ORDER BY s.agent, e.kind""",
        (tx.daemon_id, events.HEARTBEAT),
    ).fetchall()
    return EventLastSeenResult(kinds=[EventKindSeen(*row) for row in rows])
