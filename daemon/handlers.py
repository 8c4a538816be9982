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
import time
from asyncio import Future
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from towerd.daemon.processes import holder_of
from towerd.daemon.store import Store, effects, fleet, idempotency, leases, upkeep
from towerd.daemon.store.idempotency import Holder
from towerd.daemon.store.legacy import import_legacy
from towerd.daemon.store.status import status_counts
from towerd.daemon.store.tx import now_ms
from towerd.protocol import PROTOCOL_VERSION, SERVER_NAME, VERSION
from towerd.protocol import methods as m
from towerd.protocol.errors import BadArgs, Conflict


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
        )

    def shutdown(self, caller: Caller, params: m.Empty) -> m.ShutdownResult:
        self._request_shutdown(f"shutdown requested by {caller.principal} (pid {caller.pid})")
        return m.ShutdownResult(stopping=True)

    # --- fleet -------------------------------------------------------------------------

    def session_register(
        self, caller: Caller, params: m.SessionRegisterParams
    ) -> Future[m.SessionRegisterResult]:
        return self.store.write(fleet.register_session, caller.principal, params, caller.holder)

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
        return self.store.read_now(fleet.get_session, params.session_id)

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
        claimed = self.store.write(idempotency.claim, caller.principal, params, holder)
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
        return self.store.read_now(idempotency.get, caller.principal, params.operation, params.key)

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

    # --- leases ------------------------------------------------------------------------------

    def lease_acquire(
        self, caller: Caller, params: m.LeaseAcquireParams
    ) -> Future[m.LeaseAcquireResult]:
        return _holding(
            caller,
            self.store.write(
                leases.acquire, caller.principal, caller.holder, params.resource, params.ttl_ms
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
        return m.LeaseListResult(leases=await self.store.read(leases.list_live))

    # --- the effects ledger -------------------------------------------------------------------

    def effect_claim(
        self, caller: Caller, params: m.EffectClaimParams
    ) -> Future[m.EffectClaimResult]:
        return _holding(
            caller,
            self.store.write(
                effects.claim, caller.principal, caller.holder, params, self.info.branch_prefix
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
        return m.EffectListResult(effects=await self.store.read(effects.list_run, params.run_id))

    # --- operator tools -----------------------------------------------------------------

    async def backup(self, caller: Caller, params: m.BackupParams) -> m.BackupResult:
        return await self.store.on_own_connection(
            upkeep.backup, Path(params.path), params.overwrite
        )

    async def doctor(self, caller: Caller, params: m.DoctorParams) -> m.DoctorResult:
        return await self.store.on_own_connection(upkeep.health, params.full)


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
