"""Daemon start-up in one transaction: identity, next epoch, own rows, reconciliation.

Runs before the socket accepts a connection. Every key still ``in_progress``
was held across a daemon that stopped, so its outcome is unknown; then every
``outcome_unknown`` key whose operation has an evidence probe is checked, and
a key whose effect left evidence completes with a result rebuilt from it.
Probes run over all unknown keys, so a probe added later also settles older
keys. The same probes settle the keys of a claimant that died while the
daemon kept running (``settle_dead_holders``). A key whose effect_ref is an
effect key (``eff_...``) completes once that effect is committed.
"""

from __future__ import annotations

import os
import re
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from towerd.daemon.clock import Anchor
from towerd.daemon.crashpoints import crash_point
from towerd.daemon.store import clock as clock_record
from towerd.daemon.store import effects
from towerd.daemon.store.idempotency import (
    COMPLETED,
    Holder,
    expire_completed,
    mark_holders_dead,
)
from towerd.daemon.store.ids import random_uuid
from towerd.daemon.store.tx import Tx, note, own_box, pack
from towerd.protocol import fields
from towerd.protocol.changes import IdemChanged
from towerd.protocol.methods import ReconcileReport
from towerd.protocol.naming import is_effect_key

EvidenceProbe = Callable[[Tx, str], "dict[str, Any] | None"]


def _fleet_row_evidence(*columns: str) -> EvidenceProbe:
    """Evidence = a fleet row whose session id is the key's effect_ref."""

    def probe(tx: Tx, effect_ref: str) -> dict[str, Any] | None:
        values = tx.conn.execute(
            f"SELECT session_id, {', '.join(columns)} FROM sessions WHERE session_id = ?"
            if columns
            else "SELECT session_id FROM sessions WHERE session_id = ?",
            (effect_ref,),
        ).fetchone()
        if values is None:
            return None
        return dict(zip(("session_id", *columns), values, strict=True))

    return probe


def _message_evidence(tx: Tx, effect_ref: str) -> dict[str, Any] | None:
    """Evidence = the message row whose id is the key's effect_ref."""
    row = tx.conn.execute(
        "SELECT message_id, status FROM messages WHERE message_id = ?", (effect_ref,)
    ).fetchone()
    return None if row is None else {"message_id": row[0], "status": row[1]}


_SESSION_ID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


def agent_processes(exclude: frozenset[int] = frozenset()) -> dict[str, int]:
    """Session ids carried by live processes of this uid: an argument that is the id (or
    ends ``=<id>``), or ``TOWERD_SESSION_ID`` in the environment; id -> pid. A process
    that cannot be read is skipped (it is no evidence either way)."""
    found: dict[str, int] = {}
    uid, own = os.getuid(), os.getpid()
    try:
        pids = [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return found
    for pid in pids:
        if pid == own or pid in exclude:
            continue
        try:
            if os.stat(f"/proc/{pid}").st_uid != uid:
                continue
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                words = handle.read().split(b"\0")
            with open(f"/proc/{pid}/environ", "rb") as handle:
                environment = handle.read().split(b"\0")
        except OSError:
            continue
        for word in words:
            text = word.decode("utf-8", "replace").rsplit("=", 1)[-1]
            if _SESSION_ID.match(text):
                found.setdefault(text, pid)
        for entry in environment:
            if entry.startswith(b"TOWERD_SESSION_ID="):
                text = entry.split(b"=", 1)[1].decode("utf-8", "replace")
                if _SESSION_ID.match(text):
                    found.setdefault(text, pid)
    return found


class _AgentProcesses:
    """``agent_processes`` read once, the first time a settle pass needs it."""

    def __init__(self, exclude: frozenset[int]) -> None:
        self.exclude = exclude
        self._found: dict[str, int] | None = None

    def pid_of(self, session_id: str) -> int | None:
        if self._found is None:
            self._found = agent_processes(self.exclude)
        return self._found.get(session_id)


EVIDENCE_PROBES: dict[str, EvidenceProbe] = {
    fields.SPAWN_OPERATION: _fleet_row_evidence("agent_session_id", "target", "target_identity"),
    fields.REGISTER_OPERATION: _fleet_row_evidence(),
    fields.MESSAGE_OPERATION: _message_evidence,
}


def mint_or_load_daemon_id(conn: sqlite3.Connection) -> str:
    row = conn.execute("SELECT value FROM meta WHERE key = 'daemon_id'").fetchone()
    if row is not None:
        return row[0]
    daemon_id = random_uuid()
    conn.execute("INSERT INTO meta (key, value) VALUES ('daemon_id', ?)", (daemon_id,))
    return daemon_id


def set_generation(conn: Any, token: str) -> None:
    """The database's generation (daemon/store/identity.py), in ``meta``."""
    conn.execute(
        "INSERT INTO meta (key, value) VALUES ('generation', ?) "
        "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
        (token,),
    )


def start_daemon(
    conn: sqlite3.Connection,
    *,
    daemon_id: str | None,
    pid: int,
    host: str,
    now: int,
    completed_ttl_ms: int,
    clock_anchor: Anchor | None = None,
    one_box: bool = True,
    generation: str | None = None,
) -> tuple[Tx, ReconcileReport]:
    """The start-up transaction. Returns the daemon's write context and what it did.
    ``generation``: the database's new one (daemon/store/identity.py), in the same
    commit as the new epoch."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        if clock_anchor is not None:
            clock_record.save_anchor(conn, clock_anchor, now)
        if generation is not None:
            set_generation(conn, generation)
        daemon_id = daemon_id or mint_or_load_daemon_id(conn)
        epoch = conn.execute(
            """INSERT INTO daemons (daemon_id, owner_epoch, pid, host, started_at)
               VALUES (?, 1, ?, ?, ?)
               ON CONFLICT (daemon_id) DO UPDATE SET owner_epoch = daemons.owner_epoch + 1,
                   pid = excluded.pid, host = excluded.host, started_at = excluded.started_at
               RETURNING owner_epoch""",
            (daemon_id, pid, host, now),
        ).fetchone()[0]
        tx = Tx(conn=conn, daemon_id=daemon_id, owner_epoch=epoch, now=now, one_box=one_box)
        report = ReconcileReport(at=now, owner_epoch=epoch)
        report.rows_taken = conn.execute(
            "UPDATE sessions SET owner_epoch = ? WHERE daemon_id = ?", (epoch, daemon_id)
        ).rowcount
        report.marked_unknown = conn.execute(
            """UPDATE idempotency SET state = 'outcome_unknown', updated_at = ?
               WHERE state = 'in_progress' AND daemon_id = ?""",
            (now, daemon_id),
        ).rowcount
        restart_silence_clocks(tx)
        report.completed_from_evidence, report.still_unknown = settle_from_evidence(tx)
        report.expired = expire_completed(tx, completed_ttl_ms)
        crash_point("reconcile.before_commit")
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    return tx, report


def restart_silence_clocks(tx: Tx) -> None:
    """Nobody can heartbeat a daemon that is not running: the silence deadlines of
    workers and in-flight effects start again at start-up. Dead processes are still
    found by the liveness sweep within a second."""
    box, args = own_box(tx)
    tx.conn.execute(
        f"UPDATE workers SET heartbeat_at = ? WHERE ended_at IS NULL AND heartbeat_at < ?{box}",
        (tx.now, tx.now, *args),
    )
    tx.conn.execute(
        f"UPDATE effects SET heartbeat_at = ? WHERE status = 'in_flight' AND heartbeat_at < ?{box}",
        (tx.now, tx.now, *args),
    )


def settle_from_evidence(tx: Tx) -> tuple[int, int]:
    """Complete every unknown key whose effect left evidence; (completed, still unknown)."""
    unknown = tx.conn.execute(
        "SELECT rowid, operation, effect_ref FROM idempotency "
        "WHERE state = 'outcome_unknown' AND daemon_id = ?",
        (tx.daemon_id,),
    ).fetchall()
    completed = settle(tx, unknown)
    return len(completed), len(unknown) - len(completed)


def any_unknown(tx: Tx) -> bool:
    """Whether this daemon has an outcome_unknown key that evidence could settle."""
    return (
        tx.conn.execute(
            "SELECT 1 FROM idempotency WHERE state = 'outcome_unknown' AND daemon_id = ? LIMIT 1",
            (tx.daemon_id,),
        ).fetchone()
        is not None
    )


def settle(tx: Tx, keys: list[tuple[int, str, str]]) -> set[int]:
    """Probe each (rowid, operation, effect_ref); complete those with evidence; their rowids."""
    completed = set()
    processes: _AgentProcesses | None = None
    for rowid, operation, effect_ref in keys:
        probe = EVIDENCE_PROBES.get(operation)
        if probe is None and is_effect_key(effect_ref):
            probe = effects.committed_evidence  # the key fronted an external effect
        result = None if probe is None else probe(tx, effect_ref)
        if (
            result is None
            and not tx.as_dead_box  # that box's processes are not this machine's
            and operation == fields.SPAWN_OPERATION
            and _SESSION_ID.match(effect_ref)
        ):
            # No fleet row yet: a live agent process carrying the session's id is evidence
            # the spawn happened (its claimant, if it lives, is not that evidence).
            if processes is None:
                processes = _AgentProcesses(_holder_pids(tx))
            pid = processes.pid_of(effect_ref)
            if pid is not None:
                result = {"session_id": effect_ref, "agent_pid": pid,
                          "evidence": "a live process carries the session id"}  # fmt: skip
        if result is None:
            continue
        principal, key = tx.conn.execute(
            "UPDATE idempotency SET state = ?, result = ?, updated_at = ? WHERE rowid = ? "
            "RETURNING principal, key",
            (COMPLETED, pack(result), tx.now, rowid),
        ).fetchone()
        note(tx, "idem", IdemChanged(principal, operation, key, COMPLETED, effect_ref))
        completed.add(rowid)
    return completed


def _holder_pids(tx: Tx) -> frozenset[int]:
    """Processes holding keys: a claimant's own command line may carry the id it claims."""
    return frozenset(
        pid
        for (pid,) in tx.conn.execute(
            "SELECT DISTINCT holder_pid FROM idempotency WHERE holder_pid IS NOT NULL"
        )
    )


@dataclass(frozen=True)
class DeadHolderReport:
    unknown: list[tuple[str, str, str]]  # (principal, operation, key) left outcome_unknown
    completed: list[tuple[str, str, str]]  # settled at once from evidence


def settle_dead_holders(tx: Tx, holders: list[Holder]) -> DeadHolderReport:
    """Keys of dead holders: outcome_unknown, then completed where evidence exists, in one
    transaction, so a claimant that died after leaving its evidence needs no restart."""
    moved = mark_holders_dead(tx, holders)
    completed = settle(tx, [(rowid, operation, ref) for rowid, _, operation, _, ref in moved])
    report = DeadHolderReport([], [])
    for rowid, principal, operation, key, _ref in moved:
        (report.completed if rowid in completed else report.unknown).append(
            (principal, operation, key)
        )
    return report
