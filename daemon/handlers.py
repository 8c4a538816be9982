"""RPC handlers: the route from each method's validated params Struct to its store call.

Almost every method is data: ``ROUTES`` maps it to one store function (all of them
``fn(tx, caller, params)``, daemon/store/tx.py) and to how it runs: a write (the
group-commit writer's future, answered once its batch has committed), a read on
the reader thread, or a point read on the loop's own read connection. Only methods
that do something besides a store call have a handler method here: the handshake,
``ping``, ``status``, ``shutdown``, the cached point reads, the claim that checks
``holder_pid``, and the operator tools that work on a whole file.

The dispatch table is a closed dict built here from ``METHODS``; the server looks a
method up in it and nowhere else, so a name like ``_private`` or ``__class__`` can
only ever be ``unknown_method``. ``watch`` is not in it: the connection serves it
itself (daemon/server.py).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import secrets
import time
from asyncio import Future
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from towerd.daemon.clock import StepDetector
from towerd.daemon.outbox import Outbox
from towerd.daemon.processes import LivenessUnknown, ancestors, holder_of, may_hold_for
from towerd.daemon.read_cache import ReadCache
from towerd.daemon.store import (
    Store,
    agents,
    audit,
    boxes,
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
from towerd.daemon.store.legacy_fleet_import import import_legacy
from towerd.daemon.store.status import status_counts
from towerd.daemon.store.tx import Caller, Tx, current_clock, now_ms
from towerd.protocol import PROTOCOL_VERSION, SERVER_NAME, VERSION
from towerd.protocol import methods as m
from towerd.protocol.envelope import encode_data
from towerd.protocol.errors import BadArgs, Conflict, Unavailable, store_unreachable

if TYPE_CHECKING:
    from towerd.daemon.maintenance import Upkeep
    from towerd.daemon.probes import Prober

__all__ = ["ROUTES", "Caller", "DaemonInfo", "Handlers", "Route"]


@dataclass(frozen=True)
class DaemonInfo:
    """What ``status`` reports about this process (the store's settings are on its config)."""

    socket_path: str
    started_at: int
    started_monotonic: float


@dataclass(frozen=True)
class Route:
    """How one method runs: ``fn(tx, caller, params)`` as a ``write``, a ``read`` on the
    reader thread, or a point read ``now`` on the loop's connection. ``holds``: a grant
    to the caller's process, whose disconnect then triggers a liveness sweep."""

    fn: Callable[[Tx, Caller, Any], Any]
    how: str
    holds: bool = False


def write(fn: Callable[[Tx, Caller, Any], Any], *, holds: bool = False) -> Route:
    return Route(fn, "write", holds)


def read(fn: Callable[[Tx, Caller, Any], Any]) -> Route:
    return Route(fn, "read")


def now(fn: Callable[[Tx, Caller, Any], Any]) -> Route:
    return Route(fn, "now")


ROUTES: dict[str, Route] = {
    "boxes.list": read(boxes.list_boxes),
    "session.register": write(fleet.register_session),
    "session.update": write(fleet.update_session),
    "session.remove": write(fleet.remove_session),
    "fleet.list": read(fleet.list_sessions),
    "fleet.write": write(fleet.write_fleet),
    "fleet.import_legacy": write(import_legacy),
    "fleet.adopt": write(fleet.adopt_fleet),
    "fleet.restore_plan": read(events.restore_plan),
    "idem.complete": write(idempotency.complete),
    "idem.release": write(idempotency.release),
    "idem.mark_unknown": write(idempotency.mark_unknown),
    "idem.list": read(idempotency.list_keys),
    "idem.resolve": write(idempotency.resolve),
    "idem.reopen": write(idempotency.reopen),
    "lease.acquire": write(leases.acquire, holds=True),
    "lease.renew": write(leases.renew),
    "lease.release": write(leases.release),
    "lease.get": now(leases.get),
    "lease.list": read(leases.list_leases),
    "effect.claim": write(effects.claim, holds=True),
    "effect.heartbeat": write(effects.heartbeat),
    "effect.commit": write(effects.commit),
    "effect.abort": write(effects.abort),
    "effect.fail": write(effects.fail),
    "effect.resolve": write(effects.resolve),
    "effect.get": now(effects.get),
    "effect.list": read(effects.list_run),
    "worker.register": write(workers.register, holds=True),
    "worker.heartbeat": write(workers.heartbeat),
    "worker.stopping": write(workers.stopping),
    "worker.list": read(workers.list_workers),
    "dispatch.claim": write(dispatches.claim),
    "dispatch.start": write(dispatches.start),
    "dispatch.complete": write(dispatches.complete),
    "dispatch.fail": write(dispatches.fail),
    "dispatch.stuck": write(dispatches.mark_stuck),
    "dispatch.pause": write(dispatches.pause),
    "dispatch.cancel": write(dispatches.cancel),
    "dispatch.get": now(dispatches.get),
    "dispatch.list": read(dispatches.list_dispatches),
    "dispatch.recent": read(dispatches.recent_unit_keys),
    "dispatch.stuck_report": read(dispatches.stuck_report),
    "audit.list": read(audit.list_events),
    "kv.set": write(kv.set_value),
    "kv.get": now(kv.get_value),
    "kv.delete": write(kv.delete_value),
    "kv.list": read(kv.list_values),
    "event.record": write(events.record),
    "event.list": read(events.list_events),
    "event.last_seen": read(agents.last_seen),
    "session.activity": read(events.activity),
    "session.message": write(messages.send),
    "message.list": read(messages.list_messages),
    "message.ack": write(messages.ack),
}

SERVED_BY_THE_CONNECTION = frozenset({"watch"})  # daemon/server.py Connection.start_watch

Handler = Callable[[Caller, Any], Any]  # a result, or an awaitable of one


class Handlers:
    """The dispatch table: each method's route, or its handler method below."""

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
        self.prober: Prober | None = None  # the evidence probes (daemon/probes.py)
        self.outbox: Outbox | None = None  # hook events queued while a shared store is away
        self._request_shutdown = request_shutdown
        explicit: dict[str, Handler] = {
            "hello": self.hello,
            "ping": self.ping,
            "status": self.status,
            "shutdown": self.shutdown,
            "fleet.get": self.fleet_get,
            "idem.claim": self.idem_claim,
            "hook.event": self.hook_event,
            "path.claim": self.path_claim,
            "path.release": self.path_release,
            "idem.get": self.idem_get,
            "backup": self.backup,
            "doctor": self.doctor,
            "effect.settle": self.effect_settle,
        }
        assert explicit.keys().isdisjoint(ROUTES), "a method with both a route and a handler"
        self.table: dict[str, Handler] = {
            name: explicit[name] if name in explicit else self._routed(ROUTES[name])
            for name in m.METHODS
            if name not in SERVED_BY_THE_CONNECTION
        }

    def _routed(self, route: Route) -> Handler:
        store, fn = self.store, route.fn
        if route.how == "write":
            if route.holds:
                return lambda caller, params: _holding(caller, store.write(fn, caller, params))
            return lambda caller, params: store.write(fn, caller, params)
        if route.how == "read":
            return lambda caller, params: store.read(fn, caller, params)
        assert route.how == "now", route
        if not store.inline_reads:  # PostgreSQL: across the network, never on the loop
            return lambda caller, params: store.read(fn, caller, params)
        return lambda caller, params: store.read_now(fn, caller, params)

    # --- daemon ----------------------------------------------------------------------

    def hello(self, caller: Caller, params: m.HelloParams) -> m.HelloResult:
        if caller.hello_done:
            raise Conflict("this connection already said hello")
        return m.HelloResult(
            daemon_id=self.store.daemon_id,
            owner_epoch=self.store.owner_epoch,
            protocol=PROTOCOL_VERSION,
            server=m.ServerInfo(name=SERVER_NAME, version=VERSION),
            max_frame=self.store.config.max_frame,
            features=m.FEATURES,
            principal=caller.principal,
        )

    def ping(self, caller: Caller, params: m.Empty) -> m.PingResult:
        """Answered by the daemon itself, whatever the store's state (which it names)."""
        return m.PingResult(
            pong=True, now=now_ms(), store="reachable" if self.store.reachable else "unreachable"
        )

    def store_state(self) -> m.StoreState:
        outbox = self.outbox
        return m.StoreState(
            backend=self.store.backend,
            location=self.store.location,
            reachable=self.store.reachable,
            error=self.store.store_error,
            outbox_queued=outbox.queued if outbox else 0,
            outbox_dropped=outbox.dropped if outbox else 0,
            outbox_forwarded=outbox.forwarded if outbox else 0,
            clock_offset_ms=self.store.clock_offset_ms,
        )

    async def status(self, caller: Caller, params: m.Empty) -> m.StatusResult:
        """The daemon's own account; with the store unreachable its counts are zero and
        ``store`` says why (status must answer when nothing else does)."""
        sessions, keys = 0, m.KeyCounts()
        if self.store.reachable:  # else answer at once: the store's state says why
            try:
                sessions, keys = await self.store.read(status_counts)
            except Unavailable as exc:
                if not store_unreachable(exc):
                    raise
        return m.StatusResult(
            daemon_id=self.store.daemon_id,
            owner_epoch=self.store.owner_epoch,
            pid=os.getpid(),
            version=VERSION,
            protocol=PROTOCOL_VERSION,
            started_at=self.info.started_at,
            uptime_ms=int((time.monotonic() - self.info.started_monotonic) * 1000),
            db_path=self.store.location,
            socket_path=self.info.socket_path,
            sessions=sessions,
            keys=keys,
            reconciliation=self.store.reconciliation,
            clock=self._clock_report(),
            upkeep=list(self.upkeep.tasks.values()) if self.upkeep else [],
            store=self.store_state(),
            state_dir=str(self.store.config.state_dir),
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

    # --- point reads from the read cache -------------------------------------------------

    def fleet_get(self, caller: Caller, params: m.FleetGetParams) -> Any:
        if not self.store.inline_reads:  # another box may have written: no cache
            return self.store.read(fleet.get, caller, params)
        if params.daemon_id not in (None, self.store.daemon_id):  # the cache: own rows only
            return self.store.read_now(fleet.get, caller, params)
        cached = self.cache.fleet.get(params.session_id)
        if cached is not None:
            return cached
        row = self.store.read_now(fleet.get, caller, params)
        return self.cache.remember(self.cache.fleet, params.session_id, encode_data(row))

    def idem_get(self, caller: Caller, params: m.IdemKeyParams) -> Any:
        if not self.store.inline_reads:  # another box may have written: no cache
            return self.store.read(idempotency.get, caller, params)
        key = (caller.principal, params.operation, params.key)
        cached = self.cache.idem.get(key)
        if cached is not None:
            return cached
        record = self.store.read_now(idempotency.get, caller, params)
        return self.cache.remember(self.cache.idem, key, encode_data(record))

    # --- a claim for another process -----------------------------------------------------

    def idem_claim(self, caller: Caller, params: m.IdemClaimParams) -> Future[m.IdemClaimResult]:
        """The holder is the caller's process, or the process ``holder_pid`` names if it
        may hold for it (daemon/processes.py ``may_hold_for``)."""
        claimant = _holding_for(caller, params.holder_pid, "holder_pid")
        claimed = self.store.write(idempotency.claim, claimant, params)
        if claimant.holder is not None and claimant.holder == caller.holder:
            claimed.add_done_callback(functools.partial(_note_own_claim, caller))
        return claimed

    # --- the agent's loop: the agent process holds for its session -----------------------

    def hook_event(self, caller: Caller, params: m.HookEventParams) -> Future[m.HookEventResult]:
        """A hook names its agent process (``agent_pid``, an ancestor); one it may not
        name is left out rather than the event refused (a hook must not fail)."""
        try:
            claimant = _holding_for(caller, params.agent_pid, "agent_pid")
        except BadArgs:
            params.agent_pid = None
            claimant = caller
        if self.outbox is None:
            return self.store.write(agents.hook_event, claimant, params)
        return self._filed_or_queued(claimant, params)  # type: ignore[return-value]

    async def _filed_or_queued(
        self, claimant: Caller, params: m.HookEventParams
    ) -> m.HookEventResult:
        """On a shared store: with the store unreachable, the event waits in the outbox
        (daemon/outbox.py) and the hook is answered at once, deciding nothing. Its filing
        key is minted before the first write: if that write commits after its answer was
        given up on, the forward from the outbox files nothing more."""
        assert self.outbox is not None
        filing_key = secrets.token_hex(16)
        if self.store.reachable and not self.outbox.queued:  # queued ones stay first
            try:
                return await self.store.write(agents.hook_event, claimant, params, filing_key)
            except Unavailable as exc:
                if not store_unreachable(exc):
                    raise
        self.outbox.put(claimant.principal, params, filing_key)
        return m.HookEventResult(
            event_id=0, at=now_ms(), session_id=None, queued=True,
            reason="towerd's shared store is unreachable: the event is queued and filed "
            "when it returns; nothing was checked",
        )  # fmt: skip

    async def forward_outbox(self) -> int:
        """File the queued hook events, in order, once the store answers again."""
        if self.outbox is None or not self.outbox.queued:
            return 0

        async def write(principal: str, params: m.HookEventParams, filing_key: str | None) -> Any:
            caller = Caller(principal=principal, pid=0, holder=None)
            return await self.store.write(agents.hook_event, caller, params, filing_key)

        return await self.outbox.forward(write)

    def path_claim(self, caller: Caller, params: m.PathClaimParams) -> Future[m.PathClaimResult]:
        claimant = _with_lineage(_holding_for(caller, params.agent_pid, "agent_pid"))
        return self.store.write(agents.claim, claimant, params)

    def path_release(
        self, caller: Caller, params: m.PathReleaseParams
    ) -> Future[m.PathReleaseResult]:
        claimant = _with_lineage(_holding_for(caller, params.agent_pid, "agent_pid"))
        return self.store.write(agents.release, claimant, params)

    # --- watch and operator tools ----------------------------------------------------------

    def watch_snapshot(self, topics: frozenset[str]) -> dict[str, Any]:
        """The snapshot a new subscription starts from, read on the loop's connection."""
        return self.store.read_now(snapshot.take, topics, self.store.config.page_bytes)

    async def backup(self, caller: Caller, params: m.BackupParams) -> m.BackupResult:
        """The copy, then a new generation for the store: restored later over a newer
        database, the copy is refused at start (daemon/store/identity.py)."""
        result = await self.store.on_own_connection(
            upkeep.backup, Path(params.path), params.overwrite
        )
        await self.store.new_generation()
        return result

    async def effect_settle(
        self, caller: Caller, params: m.EffectSettleParams
    ) -> m.EffectSettleResult:
        """Run the evidence probes now (daemon/probes.py): network and commands, so not a
        store route; the verdicts are written through the store."""
        if self.prober is None:
            raise Unavailable("the evidence probes are not running yet; retry shortly")
        return m.EffectSettleResult(outcomes=await self.prober.settle(params))

    async def doctor(self, caller: Caller, params: m.DoctorParams) -> m.DoctorResult:
        return await self.store.doctor(params.full)


def _holding_for(caller: Caller, pid: int | None, field: str) -> Caller:
    """The caller, holding as the process ``pid`` if it names one it may hold for."""
    if pid is None:
        return caller
    holder = holder_of(pid)
    if holder is None:
        raise BadArgs(f"{field} {pid} is not a running process")
    if not may_hold_for(caller.pid, pid):
        raise BadArgs(
            f"{field} {pid} is not your process (pid {caller.pid}), "
            "an ancestor of it, or a descendant of it or of its parent, of your "
            "uid: an unrelated holder would keep the key in progress for as long "
            "as it runs; pass your shell's pid ($$), a child's ($!), or none",
            {field: pid, "caller_pid": caller.pid},
        )
    return dataclasses.replace(caller, holder=holder)


def _with_lineage(caller: Caller) -> Caller:
    """The caller with its process and ancestors as holders (nearest first): the store
    tells from them whether it runs inside an agent session, whatever runs in between."""
    lineage = []
    for pid in (caller.pid, *ancestors(caller.pid)):
        try:
            holder = holder_of(pid)
        except LivenessUnknown:
            continue
        if holder is not None:
            lineage.append(holder)
    return dataclasses.replace(caller, lineage=tuple(lineage))


def _note_own_claim(caller: Caller, claimed: Future[Any]) -> None:
    """Remember that this connection's process holds a key: its disconnect triggers a
    liveness sweep."""
    if not claimed.cancelled() and claimed.exception() is None:
        if claimed.result().state == "claimed":
            caller.claimed = True


def _holding(caller: Caller, granted: Future[Any]) -> Future[Any]:
    """A lease, effect or worker granted to this connection's process: its disconnect
    triggers a liveness sweep, so a killed holder's lease is released at once."""

    def note(done: Future[Any]) -> None:
        if not done.cancelled() and done.exception() is None:
            caller.claimed = True

    granted.add_done_callback(note)
    return granted
