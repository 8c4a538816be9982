"""RPC handlers: thin glue from a validated params Struct to one store call.

The dispatch table is a closed dict built here; the server looks a method up
in it and nowhere else, so a name like ``_private`` or ``__class__`` can only
ever be ``unknown_method``.

A handler returns its result when it has it at once (ping, point reads on the
loop's read connection), or an awaitable: the writer's future for a write
(answered when its batch has committed), a coroutine for slower reads and
operator methods. The server answers either way.
"""

from __future__ import annotations

import functools
import os
import socket
import time
from asyncio import Future
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from towerd.daemon.clock import StepDetector
from towerd.daemon.processes import holder_of, may_hold_for
from towerd.daemon.read_cache import ReadCache
from towerd.daemon.store import (
    Store,
    audit,
    dispatches,
    effects,
    events,
    fleet,
    idempotency,
    kv,
    leases,
    messages,
    snapshot,
    upkeep,
    workers,
)
from towerd.daemon.store.idempotency import Holder
from towerd.daemon.store.legacy import import_legacy
from towerd.daemon.store.status import status_counts
from towerd.daemon.store.tx import current_clock, fit, now_ms
from towerd.protocol import PROTOCOL_VERSION, SERVER_NAME, VERSION
from towerd.protocol import methods as m
from towerd.protocol.errors import BadArgs, Conflict

if TYPE_CHECKING:
    from towerd.daemon.maintenance import Upkeep


@dataclass
class Caller:
    """Who is asking: fixed per connection once ``hello`` succeeded."""

    principal: str
    pid: int
    holder: Holder | None  # the peer process, as a key holder
    hello_done: bool = False
    claimed: bool = False  # this connection's process took a key, lease or effect


@dataclass(frozen=True)
class DaemonInfo:
    socket_path: str
    max_frame: int
    started_at: int
    started_monotonic: float
    branch_prefix: str = "kxm/"  # run branches' prefix: a push to the run's own branch is unfenced
    kv_max_value: int = m.DEFAULT_KV_MAX_VALUE  # bytes of one soft-state value, as msgpack
    event_max_payload: int = m.DEFAULT_EVENT_MAX_PAYLOAD  # bytes of one hook event's payload
    host: str = field(default_factory=socket.gethostname)

    @property
    def page_bytes(self) -> int:
        """Byte budget of one page of a listing: half a frame leaves room for the envelope."""
        return self.max_frame // 2


Handler = Callable[[Caller, Any], Any]  # a result, or an awaitable of one


class Handlers:
    """One method per RPC; ``table`` maps wire names to them."""

    def __init__(
        self,
        store: Store,
        info: DaemonInfo,
        request_shutdown: Callable[[str], None],
    ) -> None:
        self.store = store
        self.info = info
        self.cache = ReadCache()  # fed by the store's change notes (see daemon/main.py)
        self.clock_steps = StepDetector(current_clock())  # the guard task checks it
        self.upkeep: Upkeep | None = None  # the background tasks' health, for status
        self._request_shutdown = request_shutdown
        self.table: dict[str, Handler] = {
            "hello": self.hello,
            "ping": self.ping,
            "status": self.status,
            "shutdown": self.shutdown,
            "session.register": self.session_register,
            "session.update": self.session_update,
            "session.remove": self.session_remove,
            "fleet.list": self.fleet_list,
            "fleet.get": self.fleet_get,
            "fleet.write": self.fleet_write,
            "fleet.import_legacy": self.fleet_import_legacy,
            "fleet.adopt": self.fleet_adopt,
            "idem.claim": self.idem_claim,
            "idem.complete": self.idem_complete,
            "idem.release": self.idem_release,
            "idem.mark_unknown": self.idem_mark_unknown,
            "idem.get": self.idem_get,
            "idem.list": self.idem_list,
            "idem.resolve": self.idem_resolve,
            "idem.reopen": self.idem_reopen,
            "lease.acquire": self.lease_acquire,
            "lease.renew": self.lease_renew,
            "lease.release": self.lease_release,
            "lease.get": self.lease_get,
            "lease.list": self.lease_list,
            "effect.claim": self.effect_claim,
            "effect.heartbeat": self.effect_heartbeat,
            "effect.commit": self.effect_commit,
            "effect.abort": self.effect_abort,
            "effect.fail": self.effect_fail,
            "effect.resolve": self.effect_resolve,
            "effect.get": self.effect_get,
            "effect.list": self.effect_list,
            "worker.register": self.worker_register,
            "worker.heartbeat": self.worker_heartbeat,
            "worker.stopping": self.worker_stopping,
            "worker.list": self.worker_list,
            "dispatch.claim": self.dispatch_claim,
            "dispatch.start": self.dispatch_start,
            "dispatch.complete": self.dispatch_complete,
            "dispatch.fail": self.dispatch_fail,
            "dispatch.stuck": self.dispatch_stuck,
            "dispatch.pause": self.dispatch_pause,
            "dispatch.cancel": self.dispatch_cancel,
            "dispatch.get": self.dispatch_get,
            "dispatch.list": self.dispatch_list,
            "dispatch.recent": self.dispatch_recent,
            "dispatch.stuck_report": self.dispatch_stuck_report,
            "audit.list": self.audit_list,
            "kv.set": self.kv_set,
            "kv.get": self.kv_get,
            "kv.delete": self.kv_delete,
            "kv.list": self.kv_list,
            "event.record": self.event_record,
            "event.list": self.event_list,
            "session.activity": self.session_activity,
            "session.message": self.session_message,
            "message.list": self.message_list,
            "message.ack": self.message_ack,
            "watch": self.watch,
            "fleet.restore_plan": self.fleet_restore_plan,
            "backup": self.backup,
            "doctor": self.doctor,
        }
        assert self.table.keys() == m.METHODS.keys(), "handler table out of step with protocol"

    # --- daemon ----------------------------------------------------------------------

    def hello(self, caller: Caller, params: m.HelloParams) -> m.HelloResult:
        if caller.hello_done:
            raise Conflict("this connection already said hello")
        return m.HelloResult(
            daemon_id=self.store.daemon_id,
            owner_epoch=self.store.owner_epoch,
            protocol=PROTOCOL_VERSION,
            server=m.ServerInfo(name=SERVER_NAME, version=VERSION),
            max_frame=self.info.max_frame,
            features=m.FEATURES,
            principal=caller.principal,
        )

    def ping(self, caller: Caller, params: m.Empty) -> m.PingResult:
        return m.PingResult(pong=True, now=now_ms())

    async def status(self, caller: Caller, params: m.Empty) -> m.StatusResult:
        sessions, keys = await self.store.read(status_counts)
        return m.StatusResult(
            daemon_id=self.store.daemon_id,
            owner_epoch=self.store.owner_epoch,
            pid=os.getpid(),
            version=VERSION,
            protocol=PROTOCOL_VERSION,
            started_at=self.info.started_at,
            uptime_ms=int((time.monotonic() - self.info.started_monotonic) * 1000),
            db_path=str(self.store.db_path),
            socket_path=self.info.socket_path,
            sessions=sessions,
            keys=keys,
            reconciliation=self.store.reconciliation,
            clock=self._clock_report(),
            upkeep=list(self.upkeep.tasks.values()) if self.upkeep else [],
        )

    def _clock_report(self) -> m.ClockReport:
        clock = self.clock_steps.clock
        now = clock.now_ms()
        offset = clock.offset_ms()
        return m.ClockReport(
            now=now, wall=now + offset, offset_ms=offset, steps_detected=self.clock_steps.steps
        )

    def shutdown(self, caller: Caller, params: m.Empty) -> m.ShutdownResult:
        self._request_shutdown(f"shutdown requested by {caller.principal} (pid {caller.pid})")
        return m.ShutdownResult(stopping=True)

    # --- fleet -------------------------------------------------------------------------

    def session_register(
        self, caller: Caller, params: m.SessionRegisterParams
    ) -> Future[m.SessionRegisterResult]:
        return self.store.write(
            fleet.register_session, caller.principal, params, caller.holder, self._quota
        )

    def session_update(self, caller: Caller, params: m.SessionUpdateParams) -> Future[m.SessionRow]:
        return self.store.write(fleet.update_session, params)

    def session_remove(
        self, caller: Caller, params: m.SessionIdParams
    ) -> Future[m.SessionRemoveResult]:
        return self.store.write(fleet.remove_session, params.session_id)

    async def fleet_list(self, caller: Caller, params: m.FleetListParams) -> m.FleetListResult:
        return await self.store.read(
            fleet.list_sessions, params.limit, params.cursor, self.info.page_bytes
        )

    def fleet_get(self, caller: Caller, params: m.SessionIdParams) -> m.SessionRow:
        cached = self.cache.fleet.get(params.session_id)
        if cached is not None:
            return cached
        row = self.store.read_now(fleet.get_session, params.session_id)
        return self.cache.remember(self.cache.fleet, params.session_id, row)

    def fleet_write(self, caller: Caller, params: m.FleetWriteParams) -> Future[m.FleetWriteResult]:
        return self.store.write(fleet.write_fleet, params.sessions, params.removed)

    def fleet_import_legacy(
        self, caller: Caller, params: m.LegacyImportParams
    ) -> Future[m.LegacyImportResult]:
        return self.store.write(import_legacy, params.entries)

    def fleet_adopt(self, caller: Caller, params: m.FleetAdoptParams) -> Future[m.FleetAdoptResult]:
        return self.store.write(fleet.adopt_fleet, caller.principal, params.daemon_id)

    # --- idempotency ---------------------------------------------------------------------

    def idem_claim(self, caller: Caller, params: m.IdemClaimParams) -> Future[m.IdemClaimResult]:
        holder = caller.holder
        if params.holder_pid is not None:
            holder = holder_of(params.holder_pid)
            if holder is None:
                raise BadArgs(f"holder_pid {params.holder_pid} is not a running process")
            if not may_hold_for(caller.pid, params.holder_pid):
                raise BadArgs(
                    f"holder_pid {params.holder_pid} is not your process (pid {caller.pid}), "
                    "an ancestor of it, or a descendant of it or of its parent, of your "
                    "uid: an unrelated holder would keep the key in progress for as long "
                    "as it runs; pass your shell's pid ($$), a child's ($!), or none",
                    {"holder_pid": params.holder_pid, "caller_pid": caller.pid},
                )
        claimed = self.store.write(idempotency.claim, caller.principal, params, holder, self._quota)
        if holder is not None and holder == caller.holder:
            claimed.add_done_callback(functools.partial(_note_own_claim, caller))
        return claimed

    def idem_complete(self, caller: Caller, params: m.IdemCompleteParams) -> Future[m.IdemRecord]:
        return self.store.write(
            idempotency.complete, caller.principal, params.operation, params.key, params.result
        )

    def idem_release(self, caller: Caller, params: m.IdemKeyParams) -> Future[m.IdemReleaseResult]:
        return self.store.write(idempotency.release, caller.principal, params.operation, params.key)

    def idem_mark_unknown(self, caller: Caller, params: m.IdemKeyParams) -> Future[m.IdemRecord]:
        return self.store.write(
            idempotency.mark_unknown, caller.principal, params.operation, params.key
        )

    def idem_get(self, caller: Caller, params: m.IdemKeyParams) -> m.IdemRecord:
        key = (caller.principal, params.operation, params.key)
        cached = self.cache.idem.get(key)
        if cached is not None:
            return cached
        record = self.store.read_now(idempotency.get, *key)
        return self.cache.remember(self.cache.idem, key, record)

    async def idem_list(self, caller: Caller, params: m.IdemListParams) -> m.IdemListResult:
        return await self.store.read(
            idempotency.list_keys,
            caller.principal,
            params.state,
            params.operation,
            params.limit,
            params.cursor,
            self.info.page_bytes,
        )

    def idem_resolve(
        self, caller: Caller, params: m.IdemResolveParams
    ) -> Future[m.IdemResolveResult]:
        return self.store.write(
            idempotency.resolve,
            caller.principal,
            params.operation,
            params.key,
            params.outcome,
            params.result,
        )

    def idem_reopen(self, caller: Caller, params: m.IdemReopenParams) -> Future[m.IdemReopenResult]:
        return self.store.write(
            idempotency.reopen,
            caller.principal,
            params.operation,
            params.key,
            params.result,
            params.reason,
        )

    # --- leases ------------------------------------------------------------------------------

    def lease_acquire(
        self, caller: Caller, params: m.LeaseAcquireParams
    ) -> Future[m.LeaseAcquireResult]:
        return _holding(
            caller,
            self.store.write(
                leases.acquire,
                caller.principal,
                caller.holder,
                params.resource,
                params.ttl_ms,
                self._quota,
            ),
        )

    def lease_renew(
        self, caller: Caller, params: m.LeaseRenewParams
    ) -> Future[m.LeaseAcquireResult]:
        return self.store.write(
            leases.renew,
            caller.principal,
            caller.holder,
            params.resource,
            params.fencing_token,
            params.ttl_ms,
        )

    def lease_release(
        self, caller: Caller, params: m.LeaseTokenParams
    ) -> Future[m.LeaseReleaseResult]:
        return self.store.write(
            leases.release, caller.principal, caller.holder, params.resource, params.fencing_token
        )

    def lease_get(self, caller: Caller, params: m.LeaseResourceParams) -> m.LeaseRecord:
        return self.store.read_now(leases.get, params.resource)

    async def lease_list(self, caller: Caller, params: m.Empty) -> m.LeaseListResult:
        return self._fitted(m.LeaseListResult(leases=await self.store.read(leases.list_live)))

    # --- the effects ledger -------------------------------------------------------------------

    def effect_claim(
        self, caller: Caller, params: m.EffectClaimParams
    ) -> Future[m.EffectClaimResult]:
        return _holding(
            caller,
            self.store.write(
                effects.claim,
                caller.principal,
                caller.holder,
                params,
                self.info.branch_prefix,
                self._quota,
            ),
        )

    def effect_heartbeat(
        self, caller: Caller, params: m.EffectAttemptParams
    ) -> Future[m.EffectRecord]:
        return self.store.write(
            effects.heartbeat,
            caller.principal,
            caller.holder,
            params.effect_key,
            params.attempt_id,
            params.lease_ttl_ms,
        )

    def effect_commit(self, caller: Caller, params: m.EffectCommitParams) -> Future[m.EffectRecord]:
        return self.store.write(
            effects.commit, caller.principal, params.effect_key, params.attempt_id, params.receipt
        )

    def effect_abort(self, caller: Caller, params: m.EffectAbortParams) -> Future[m.EffectRecord]:
        return self.store.write(effects.abort, params.effect_key, params.attempt_id, params.reason)

    def effect_fail(self, caller: Caller, params: m.EffectFailParams) -> Future[m.EffectRecord]:
        return self.store.write(effects.fail, params.effect_key, params.attempt_id, params.error)

    def effect_resolve(
        self, caller: Caller, params: m.EffectResolveParams
    ) -> Future[m.EffectRecord]:
        return self.store.write(
            effects.resolve, caller.principal, params.effect_key, params.outcome, params.receipt
        )

    def effect_get(self, caller: Caller, params: m.EffectKeyParams) -> m.EffectRecord:
        return self.store.read_now(effects.get, params.effect_key)

    async def effect_list(self, caller: Caller, params: m.EffectListParams) -> m.EffectListResult:
        listed = await self.store.read(effects.list_run, params.run_id)
        return self._fitted(m.EffectListResult(effects=listed))

    # --- workers and the dispatch ledger --------------------------------------------------

    def worker_register(
        self, caller: Caller, params: m.WorkerRegisterParams
    ) -> Future[m.WorkerRegisterResult]:
        return _holding(
            caller,
            self.store.write(
                workers.register,
                caller.principal,
                caller.holder,
                params.project_root,
                params.version,
                self.info.host,
                self.store.config.worker_ttl_ms,
            ),
        )

    def worker_heartbeat(self, caller: Caller, params: m.WorkerIdParams) -> Future[m.WorkerRecord]:
        return self.store.write(workers.heartbeat, params.worker_id)

    def worker_stopping(self, caller: Caller, params: m.WorkerIdParams) -> Future[m.WorkerRecord]:
        return self.store.write(workers.stopping, caller.principal, caller.holder, params.worker_id)

    async def worker_list(self, caller: Caller, params: m.WorkerListParams) -> m.WorkerListResult:
        return self._fitted(
            await self.store.read(workers.list_workers, params.status, params.project_root)
        )

    def dispatch_claim(
        self, caller: Caller, params: m.DispatchClaimParams
    ) -> Future[m.DispatchClaimResult]:
        return self.store.write(dispatches.claim, _actor(caller), params)

    def _transition(self, caller: Caller, params: Any, status: str, **columns: Any) -> Future[Any]:
        return self.store.write(
            functools.partial(dispatches.transition, **columns),
            _actor(caller),
            params.dispatch_id,
            params.worker_id,
            params.fencing_token,
            status,
        )

    def dispatch_start(self, caller: Caller, params: m.DispatchFenceParams) -> Future[Any]:
        return self._transition(caller, params, "running")

    def dispatch_complete(self, caller: Caller, params: m.DispatchCompleteParams) -> Future[Any]:
        return self._transition(caller, params, "completed", exit_reason=params.exit_reason)

    def dispatch_fail(self, caller: Caller, params: m.DispatchFailParams) -> Future[Any]:
        return self._transition(
            caller,
            params,
            "failed",
            error_code=params.error_code,
            error_summary=params.error_summary,
            retry_after_ms=params.retry_after_ms,
        )

    def dispatch_stuck(self, caller: Caller, params: m.DispatchReasonParams) -> Future[Any]:
        return self._transition(caller, params, "stuck", exit_reason=params.reason)

    def dispatch_pause(self, caller: Caller, params: m.DispatchFenceParams) -> Future[Any]:
        return self._transition(caller, params, "paused")

    def dispatch_cancel(self, caller: Caller, params: m.DispatchReasonParams) -> Future[Any]:
        return self._transition(caller, params, "canceled", exit_reason=params.reason)

    def dispatch_get(self, caller: Caller, params: m.DispatchIdParams) -> m.DispatchRecord:
        return self.store.read_now(dispatches.get, params.dispatch_id)

    async def dispatch_list(
        self, caller: Caller, params: m.DispatchListParams
    ) -> m.DispatchListResult:
        listed = await self.store.read(
            dispatches.list_dispatches,
            params.unit_type,
            params.unit_id,
            params.milestone_id,
            params.status,
            params.worker_id,
            params.limit,
        )
        return self._fitted(listed, keep="last")  # the most recent ones matter most

    async def dispatch_recent(
        self, caller: Caller, params: m.DispatchRecentParams
    ) -> m.DispatchRecentResult:
        if (params.worker_id is None) == (params.project_root is None):
            raise BadArgs("dispatch.recent: give exactly one of `worker_id` and `project_root`")
        return await self.store.read(
            dispatches.recent_unit_keys, params.worker_id, params.project_root, params.limit
        )

    async def dispatch_stuck_report(
        self, caller: Caller, params: m.DispatchStuckReportParams
    ) -> m.DispatchStuckReportResult:
        return await self.store.read(dispatches.stuck_report, params.project_root, params.window)

    async def audit_list(self, caller: Caller, params: m.AuditListParams) -> m.AuditListResult:
        return await self.store.read(
            audit.list_events,
            params.category,
            params.type,
            params.trace_id,
            params.before,
            params.limit,
            self.info.page_bytes,
        )

    # --- soft state ---------------------------------------------------------------------------

    def kv_set(self, caller: Caller, params: m.KvSetParams) -> Future[m.KvEntry]:
        return self.store.write(
            kv.set_value,
            params.scope,
            params.scope_id,
            params.key,
            params.value,
            self.info.kv_max_value,
            caller.principal,
            self._quota,
        )

    def kv_get(self, caller: Caller, params: m.KvKeyParams) -> m.KvEntry:
        return self.store.read_now(kv.get_value, params.scope, params.scope_id, params.key)

    def kv_delete(self, caller: Caller, params: m.KvKeyParams) -> Future[m.KvDeleteResult]:
        return self.store.write(kv.delete_value, params.scope, params.scope_id, params.key)

    async def kv_list(self, caller: Caller, params: m.KvListParams) -> m.KvListResult:
        return await self.store.read(
            kv.list_values,
            params.scope,
            params.scope_id,
            params.after,
            params.limit,
            self.info.page_bytes,
        )

    # --- the event trail, messages, watch --------------------------------------------------

    def event_record(
        self, caller: Caller, params: m.EventRecordParams
    ) -> Future[m.EventRecordResult]:
        return self.store.write(
            events.record,
            params.kind,
            params.session_id,
            params.agent_session_id,
            params.payload,
            self.info.event_max_payload,
            caller.principal,
            self._quota,
        )

    async def event_list(self, caller: Caller, params: m.EventListParams) -> m.EventListResult:
        return await self.store.read(
            events.list_events,
            params.session_ids,
            params.agent_session_ids,
            params.kinds,
            params.before,
            params.limit,
            self.info.page_bytes,
        )

    async def session_activity(
        self, caller: Caller, params: m.SessionActivityParams
    ) -> m.SessionActivityResult:
        return self._fitted(await self.store.read(events.activity, params.session_ids))

    def session_message(
        self, caller: Caller, params: m.SessionMessageParams
    ) -> Future[m.SessionMessageResult]:
        return self.store.write(messages.send, caller.principal, params, caller.holder, self._quota)

    async def message_list(
        self, caller: Caller, params: m.MessageListParams
    ) -> m.MessageListResult:
        return self._fitted(
            await self.store.read(
                messages.list_messages, params.session_id, params.status, params.limit
            )
        )

    def message_ack(self, caller: Caller, params: m.MessageAckParams) -> Future[m.MessageRecord]:
        return self.store.write(messages.ack, params.message_id, params.status)

    def watch(self, caller: Caller, params: m.WatchParams) -> Any:
        raise AssertionError("watch is served by the connection itself (server.start_watch)")

    def watch_snapshot(self, topics: frozenset[str]) -> dict[str, Any]:
        """The snapshot a new subscription starts from, read on the loop's connection."""
        return self.store.read_now(snapshot.take, topics, self.info.page_bytes)

    async def fleet_restore_plan(self, caller: Caller, params: m.Empty) -> m.RestorePlanResult:
        return self._fitted(await self.store.read(events.restore_plan))

    @property
    def _quota(self) -> int:
        """Rows per principal and table (``towerd --quota``; daemon/store/quota.py)."""
        return self.store.config.quota_rows

    def _fitted(self, result: Any, *, keep: str = "first") -> Any:
        """Cut a result's one list to fit a frame, flagging ``truncated``: these answers
        have no cursor, and an answer over the frame limit would be ``internal``."""
        (name,) = (f for f in result.__struct_fields__ if f != "truncated")
        items, truncated = fit(getattr(result, name), self.info.page_bytes, keep=keep)
        if not truncated:
            return result
        return msgspec.structs.replace(result, **{name: items, "truncated": True})

    # --- operator tools -----------------------------------------------------------------

    async def backup(self, caller: Caller, params: m.BackupParams) -> m.BackupResult:
        return await self.store.on_own_connection(
            upkeep.backup, Path(params.path), params.overwrite
        )

    async def doctor(self, caller: Caller, params: m.DoctorParams) -> m.DoctorResult:
        return await self.store.on_own_connection(upkeep.health, params.full)


def _actor(caller: Caller) -> str:
    """Who an audit event names as the cause of a change."""
    return f"{caller.principal} pid {caller.pid}"


def _note_own_claim(caller: Caller, claimed: Future[Any]) -> None:
    """Remember that this connection's process holds a key: its disconnect triggers a
    liveness sweep."""
    if not claimed.cancelled() and claimed.exception() is None:
        if claimed.result().state == "claimed":
            caller.claimed = True


def _holding(caller: Caller, granted: Future[Any]) -> Future[Any]:
    """A lease or effect granted to this connection's process: its disconnect triggers a
    liveness sweep, so a killed holder's lease is released at once."""

    def note(done: Future[Any]) -> None:
        if not done.cancelled() and done.exception() is None:
            caller.claimed = True

    granted.add_done_callback(note)
    return granted
