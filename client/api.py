"""Typed calls shared by the blocking and the async client.

Each method only builds ``(method, params)`` and hands them to ``self.call``;
the blocking client returns the result, the async client returns an
awaitable of it, so one definition serves both. Results are the plain maps
documented in docs/protocol.md.
"""

from __future__ import annotations

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs hooks ~3 ms
if TYPE_CHECKING:  # annotations only: hooks import this module
    from collections.abc import Iterable, Mapping
    from typing import Any


def _given(**params: Any) -> dict[str, Any]:
    """Drop parameters left at None: the daemon's default applies."""
    return {name: value for name, value in params.items() if value is not None}


class TowerdAPI:
    """Calls return the result (blocking client) or an awaitable of it (async client)."""

    def call(self, method: str, params: Mapping[str, Any] | None = None) -> Any:
        raise NotImplementedError

    # --- daemon ---------------------------------------------------------------------------

    def ping(self) -> Any:
        return self.call("ping")

    def status(self) -> Any:
        return self.call("status")

    def shutdown(self) -> Any:
        return self.call("shutdown")

    # --- fleet ----------------------------------------------------------------------------

    def session_register(
        self,
        *,
        cwd: str,
        agent: str,
        session_id: str | None = None,
        idempotency_key: str | None = None,
        **fields: Any,
    ) -> Any:
        """Insert a fleet row -> ``{"session_id"}``; with a key, a retry returns the same id."""
        return self.call(
            "session.register",
            _given(cwd=cwd, agent=agent, session_id=session_id, idempotency_key=idempotency_key)
            | fields,
        )

    def session_update(self, session_id: str, **fields: Any) -> Any:
        """Rewrite the given fields (``None`` clears a field) -> the row."""
        return self.call("session.update", {"session_id": session_id, **fields})

    def session_remove(self, session_id: str) -> Any:
        return self.call("session.remove", {"session_id": session_id})

    def fleet_list(self, *, limit: int | None = None, cursor: int | None = None) -> Any:
        """One page: ``{"sessions": [...], "next_cursor": int | None}``."""
        return self.call("fleet.list", _given(limit=limit, cursor=cursor))

    def fleet_get(self, session_id: str) -> Any:
        return self.call("fleet.get", {"session_id": session_id})

    def fleet_write(
        self, sessions: Iterable[Mapping[str, Any]], removed: Iterable[str] = ()
    ) -> Any:
        return self.call("fleet.write", {"sessions": list(sessions), "removed": list(removed)})

    def fleet_import_legacy(self, entries: Iterable[Any]) -> Any:
        return self.call("fleet.import_legacy", {"entries": list(entries)})

    def fleet_adopt(self, daemon_id: str) -> Any:
        return self.call("fleet.adopt", {"daemon_id": daemon_id})

    # --- idempotency ------------------------------------------------------------------------

    def idem_claim(
        self,
        operation: str,
        key: str,
        *,
        payload: Any = None,
        effect_ref: str | None = None,
        holder_pid: int | None = None,
        replay_only: bool = False,
        attempt: str | None = None,
    ) -> Any:
        """``{"state": "claimed", "effect_ref"}`` or ``{"state": "completed", "result", ...}``.

        ``attempt``: a token of your own for this claim; repeat it when retrying a
        claim whose answer was lost, and the retry is answered ``claimed`` again.
        """
        return self.call(
            "idem.claim",
            _given(
                operation=operation,
                key=key,
                payload=payload,
                effect_ref=effect_ref,
                holder_pid=holder_pid,
                replay_only=replay_only or None,
                attempt=attempt,
            ),
        )

    def idem_complete(self, operation: str, key: str, result: Any = None) -> Any:
        return self.call("idem.complete", {"operation": operation, "key": key, "result": result})

    def idem_release(self, operation: str, key: str) -> Any:
        return self.call("idem.release", {"operation": operation, "key": key})

    def idem_mark_unknown(self, operation: str, key: str) -> Any:
        return self.call("idem.mark_unknown", {"operation": operation, "key": key})

    def idem_get(self, operation: str, key: str) -> Any:
        return self.call("idem.get", {"operation": operation, "key": key})

    def idem_list(
        self,
        *,
        state: str | None = None,
        operation: str | None = None,
        limit: int | None = None,
        cursor: int | None = None,
    ) -> Any:
        return self.call(
            "idem.list", _given(state=state, operation=operation, limit=limit, cursor=cursor)
        )

    def idem_resolve(self, operation: str, key: str, outcome: str, result: Any = None) -> Any:
        """Operator recovery of an ``outcome_unknown`` key: ``completed`` or ``abandoned``."""
        return self.call(
            "idem.resolve",
            {"operation": operation, "key": key, "outcome": outcome, "result": result},
        )

    def idem_reopen(
        self, operation: str, key: str, result: Any = None, *, reason: str | None = None
    ) -> Any:
        """Forget a completed key whose stored result is ``result``, so the next claim
        runs the step again (retrying a failed run); written to the operator log."""
        return self.call(
            "idem.reopen",
            _given(operation=operation, key=key, result=result, reason=reason),
        )

    # --- leases ----------------------------------------------------------------------------

    def lease_acquire(self, resource: str, *, ttl_ms: int | None = None) -> Any:
        """``{resource, fencing_token, expires_at, holder, renewed}``; ``LeaseHeld`` if taken."""
        return self.call("lease.acquire", _given(resource=resource, ttl_ms=ttl_ms))

    def lease_renew(self, resource: str, fencing_token: int, *, ttl_ms: int | None = None) -> Any:
        return self.call(
            "lease.renew", _given(resource=resource, fencing_token=fencing_token, ttl_ms=ttl_ms)
        )

    def lease_release(self, resource: str, fencing_token: int) -> Any:
        return self.call("lease.release", {"resource": resource, "fencing_token": fencing_token})

    def lease_get(self, resource: str) -> Any:
        return self.call("lease.get", {"resource": resource})

    def lease_list(self) -> Any:
        return self.call("lease.list")

    # --- the effects ledger ------------------------------------------------------------------

    def effect_claim(
        self,
        run_id: str,
        step_id: str,
        attempt_id: str,
        action_kind: str,
        target_ref: str,
        *,
        payload: Any = None,
        timeout_ms: int | None = None,
        lease_ttl_ms: int | None = None,
    ) -> Any:
        """``{effect_key, status, attempt_id, lease_resource?, fencing_token?}``."""
        return self.call(
            "effect.claim",
            _given(
                run_id=run_id,
                step_id=step_id,
                attempt_id=attempt_id,
                action_kind=action_kind,
                target_ref=target_ref,
                payload=payload,
                timeout_ms=timeout_ms,
                lease_ttl_ms=lease_ttl_ms,
            ),
        )

    def effect_heartbeat(
        self, effect_key: str, attempt_id: str, *, lease_ttl_ms: int | None = None
    ) -> Any:
        return self.call(
            "effect.heartbeat",
            _given(effect_key=effect_key, attempt_id=attempt_id, lease_ttl_ms=lease_ttl_ms),
        )

    def effect_commit(self, effect_key: str, attempt_id: str, receipt: Any = None) -> Any:
        return self.call(
            "effect.commit",
            {"effect_key": effect_key, "attempt_id": attempt_id, "receipt": receipt},
        )

    def effect_abort(self, effect_key: str, attempt_id: str, reason: str | None = None) -> Any:
        return self.call(
            "effect.abort", _given(effect_key=effect_key, attempt_id=attempt_id, reason=reason)
        )

    def effect_fail(self, effect_key: str, attempt_id: str, error: Any = None) -> Any:
        return self.call(
            "effect.fail", {"effect_key": effect_key, "attempt_id": attempt_id, "error": error}
        )

    def effect_resolve(self, effect_key: str, outcome: str, receipt: Any = None) -> Any:
        """Operator recovery of an ``uncertain`` effect: ``committed`` or ``aborted``."""
        return self.call(
            "effect.resolve", {"effect_key": effect_key, "outcome": outcome, "receipt": receipt}
        )

    def effect_get(self, effect_key: str) -> Any:
        return self.call("effect.get", {"effect_key": effect_key})

    def effect_list(self, run_id: str) -> Any:
        return self.call("effect.list", {"run_id": run_id})

    # --- workers and the dispatch ledger ------------------------------------------------------

    def worker_register(self, project_root: str, *, version: str | None = None) -> Any:
        """This process becomes a worker -> ``{"worker_id", "heartbeat_ttl_ms", "existing"}``;
        the leases it holds (over any connection) are the worker's."""
        return self.call("worker.register", _given(project_root=project_root, version=version))

    def worker_heartbeat(self, worker_id: str) -> Any:
        return self.call("worker.heartbeat", {"worker_id": worker_id})

    def worker_stopping(self, worker_id: str) -> Any:
        return self.call("worker.stopping", {"worker_id": worker_id})

    def worker_list(self, *, status: str | None = None, project_root: str | None = None) -> Any:
        return self.call("worker.list", _given(status=status, project_root=project_root))

    def dispatch_claim(
        self,
        worker_id: str,
        lease_resource: str,
        fencing_token: int,
        unit_type: str,
        unit_id: str,
        milestone_id: str,
        trace_id: str,
        *,
        slice_id: str | None = None,
        task_id: str | None = None,
        turn_id: str | None = None,
        max_attempts: int | None = None,
    ) -> Any:
        """Claim a unit under the worker's lease -> ``{"dispatch_id", "attempt_n", "status"}``."""
        return self.call(
            "dispatch.claim",
            _given(
                worker_id=worker_id,
                lease_resource=lease_resource,
                fencing_token=fencing_token,
                unit_type=unit_type,
                unit_id=unit_id,
                milestone_id=milestone_id,
                trace_id=trace_id,
                slice_id=slice_id,
                task_id=task_id,
                turn_id=turn_id,
                max_attempts=max_attempts,
            ),
        )

    def _dispatch(self, method: str, dispatch_id: int, worker_id: str, token: int, **more: Any):
        return self.call(
            method,
            _given(dispatch_id=dispatch_id, worker_id=worker_id, fencing_token=token, **more),
        )

    def dispatch_start(self, dispatch_id: int, worker_id: str, fencing_token: int) -> Any:
        return self._dispatch("dispatch.start", dispatch_id, worker_id, fencing_token)

    def dispatch_complete(
        self, dispatch_id: int, worker_id: str, fencing_token: int, exit_reason: str | None = None
    ) -> Any:
        return self._dispatch(
            "dispatch.complete", dispatch_id, worker_id, fencing_token, exit_reason=exit_reason
        )

    def dispatch_fail(
        self,
        dispatch_id: int,
        worker_id: str,
        fencing_token: int,
        error_code: str,
        error_summary: str,
        *,
        retry_after_ms: int | None = None,
    ) -> Any:
        return self._dispatch(
            "dispatch.fail", dispatch_id, worker_id, fencing_token, error_code=error_code,
            error_summary=error_summary, retry_after_ms=retry_after_ms,
        )  # fmt: skip

    def dispatch_stuck(
        self, dispatch_id: int, worker_id: str, fencing_token: int, reason: str
    ) -> Any:
        return self._dispatch(
            "dispatch.stuck", dispatch_id, worker_id, fencing_token, reason=reason
        )

    def dispatch_pause(self, dispatch_id: int, worker_id: str, fencing_token: int) -> Any:
        return self._dispatch("dispatch.pause", dispatch_id, worker_id, fencing_token)

    def dispatch_cancel(
        self, dispatch_id: int, worker_id: str, fencing_token: int, reason: str
    ) -> Any:
        return self._dispatch(
            "dispatch.cancel", dispatch_id, worker_id, fencing_token, reason=reason
        )

    def dispatch_get(self, dispatch_id: int) -> Any:
        return self.call("dispatch.get", {"dispatch_id": dispatch_id})

    def dispatch_list(
        self,
        *,
        unit_type: str | None = None,
        unit_id: str | None = None,
        milestone_id: str | None = None,
        status: str | None = None,
        worker_id: str | None = None,
        limit: int | None = None,
    ) -> Any:
        """The most recent matching dispatches, oldest first."""
        return self.call(
            "dispatch.list",
            _given(unit_type=unit_type, unit_id=unit_id, milestone_id=milestone_id,
                   status=status, worker_id=worker_id, limit=limit),
        )  # fmt: skip

    def dispatch_recent(
        self,
        *,
        worker_id: str | None = None,
        project_root: str | None = None,
        limit: int | None = None,
    ) -> Any:
        """Recent unit keys of a worker or a project, oldest first -> ``{"unit_keys"}``."""
        return self.call(
            "dispatch.recent",
            _given(worker_id=worker_id, project_root=project_root, limit=limit),
        )

    def dispatch_stuck_report(self, project_root: str, *, window: int | None = None) -> Any:
        return self.call("dispatch.stuck_report", _given(project_root=project_root, window=window))

    def audit_list(
        self,
        *,
        category: str | None = None,
        type: str | None = None,
        trace_id: str | None = None,
        before: int | None = None,
        limit: int | None = None,
    ) -> Any:
        """Audit events, newest first -> ``{"events", "next_before"}``."""
        return self.call(
            "audit.list",
            _given(category=category, type=type, trace_id=trace_id, before=before, limit=limit),
        )

    # --- soft state ----------------------------------------------------------------------------

    def kv_set(self, scope: str, key: str, value: Any, *, scope_id: str = "") -> Any:
        return self.call(
            "kv.set", {"scope": scope, "scope_id": scope_id, "key": key, "value": value}
        )

    def kv_get(self, scope: str, key: str, *, scope_id: str = "") -> Any:
        return self.call("kv.get", {"scope": scope, "scope_id": scope_id, "key": key})

    def kv_delete(self, scope: str, key: str, *, scope_id: str = "") -> Any:
        return self.call("kv.delete", {"scope": scope, "scope_id": scope_id, "key": key})

    def kv_list(
        self,
        scope: str,
        *,
        scope_id: str = "",
        after: str | None = None,
        limit: int | None = None,
    ) -> Any:
        return self.call(
            "kv.list", _given(scope=scope, scope_id=scope_id, after=after, limit=limit)
        )

    # --- the event trail, messages, restore plan ----------------------------------------------

    def event_record(
        self,
        kind: str,
        *,
        session_id: str | None = None,
        agent_session_id: str | None = None,
        payload: Any = None,
    ) -> Any:
        """Record one hook event -> ``{"event_id", "at", "session_id"}``."""
        return self.call(
            "event.record",
            _given(kind=kind, session_id=session_id, agent_session_id=agent_session_id)
            | {"payload": payload},
        )

    def event_list(
        self,
        *,
        session_ids: Iterable[str] | None = None,
        agent_session_ids: Iterable[str] | None = None,
        kinds: Iterable[str] | None = None,
        before: int | None = None,
        limit: int | None = None,
    ) -> Any:
        """The trail, newest first -> ``{"events", "next_before"}``. An absent id list does
        not filter, an empty one matches nothing; the two combine with OR."""
        return self.call(
            "event.list",
            _given(
                session_ids=None if session_ids is None else list(session_ids),
                agent_session_ids=None if agent_session_ids is None else list(agent_session_ids),
                kinds=None if kinds is None else list(kinds),
                before=before,
                limit=limit,
            ),
        )

    def session_activity(self, session_ids: Iterable[str] | None = None) -> Any:
        """Each session's last activity and attention (running, needs_you, done, exited)."""
        return self.call(
            "session.activity",
            _given(session_ids=None if session_ids is None else list(session_ids)),
        )

    def session_message(
        self, session_id: str, text: str, *, idempotency_key: str | None = None
    ) -> Any:
        """Leave a message for a session -> ``{"message_id", "status"}``; with a key, a
        retry answers the same message."""
        return self.call(
            "session.message",
            _given(session_id=session_id, text=text, idempotency_key=idempotency_key),
        )

    def message_list(
        self, session_id: str, *, status: str | None = None, limit: int | None = None
    ) -> Any:
        return self.call("message.list", _given(session_id=session_id, status=status, limit=limit))

    def message_ack(self, message_id: str, status: str = "read") -> Any:
        return self.call("message.ack", {"message_id": message_id, "status": status})

    def fleet_restore_plan(self) -> Any:
        """What to bring back after a restart: non-exited sessions, newest activity first,
        each parent before its sub-sessions."""
        return self.call("fleet.restore_plan")

    # --- operator tools ------------------------------------------------------------------

    def backup(self, path: str, *, overwrite: bool = False) -> Any:
        """An online, checked copy of the database at ``path`` (absolute, daemon's host)."""
        return self.call("backup", {"path": path, "overwrite": overwrite})

    def doctor(self, *, full: bool = False) -> Any:
        return self.call("doctor", {"full": full})
