"""One msgspec Struct per method's params and result, and the closed method table.

The daemon decodes every request's params straight into the method's params
Struct, so validation happens once, at the boundary, with msgspec's path
messages (``Expected `int`, got `str` - at `$.limit```). Unknown fields are
ignored so that newer clients can talk to older daemons. Timestamps are
integer milliseconds since the Unix epoch (UTC), never msgpack timestamps.

Clients do not import this module (it costs start-up time in short-lived
hooks); it is the reference the daemon and ``docs/protocol.md`` follow. The
Structs live by area in protocol/schema/ (base, daemon, fleet, idem, effects,
dispatch, trail, ops); this module is their one namespace, with the method table.
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import Struct

from towerd.protocol.schema.agents import *  # noqa: F403 - re-exported: one namespace for every message
from towerd.protocol.schema.base import *  # noqa: F403 - re-exported: one namespace for every message
from towerd.protocol.schema.daemon import *  # noqa: F403 - re-exported: one namespace for every message
from towerd.protocol.schema.dispatch import *  # noqa: F403 - re-exported: one namespace for every message
from towerd.protocol.schema.effects import *  # noqa: F403 - re-exported: one namespace for every message
from towerd.protocol.schema.fleet import *  # noqa: F403 - re-exported: one namespace for every message
from towerd.protocol.schema.idem import *  # noqa: F403 - re-exported: one namespace for every message
from towerd.protocol.schema.ops import *  # noqa: F403 - re-exported: one namespace for every message
from towerd.protocol.schema.trail import *  # noqa: F403 - re-exported: one namespace for every message

# --- the method table ------------------------------------------------------------


class MethodSpec(Struct, frozen=True):
    params: type
    result: type
    writes: bool
    summary: str


METHODS: dict[str, MethodSpec] = {
    "hello": MethodSpec(HelloParams, HelloResult, False, "handshake; must be the first request"),
    "ping": MethodSpec(Empty, PingResult, False, "liveness check"),
    "status": MethodSpec(
        Empty, StatusResult, False, "daemon identity, counts, last reconciliation"
    ),
    "shutdown": MethodSpec(
        Empty, ShutdownResult, False, "stop gracefully after in-flight requests"
    ),
    "boxes.list": MethodSpec(Empty, BoxListResult, False, "every box of the store"),
    "session.register": MethodSpec(
        SessionRegisterParams, SessionRegisterResult, True, "insert one fleet row"
    ),
    "session.update": MethodSpec(SessionUpdateParams, SessionRow, True, "rewrite given fields"),
    "session.remove": MethodSpec(SessionIdParams, SessionRemoveResult, True, "delete one row"),
    "fleet.list": MethodSpec(FleetListParams, FleetListResult, False, "fleet rows, paged"),
    "fleet.get": MethodSpec(FleetGetParams, SessionRow, False, "one row"),
    "fleet.write": MethodSpec(FleetWriteParams, FleetWriteResult, True, "replace given rows"),
    "fleet.import_legacy": MethodSpec(
        LegacyImportParams, LegacyImportResult, True, "import a legacy fleet file"
    ),
    "fleet.adopt": MethodSpec(
        FleetAdoptParams, FleetAdoptResult, True, "take over another daemon's rows"
    ),
    "idem.claim": MethodSpec(IdemClaimParams, IdemClaimResult, True, "claim a key"),
    "idem.complete": MethodSpec(IdemCompleteParams, IdemRecord, True, "record the outcome"),
    "idem.release": MethodSpec(
        IdemReleaseParams, IdemReleaseResult, True, "drop a key whose effect never started"
    ),
    "idem.mark_unknown": MethodSpec(IdemKeyParams, IdemRecord, True, "declare the outcome unknown"),
    "idem.get": MethodSpec(IdemKeyParams, IdemRecord, False, "one key"),
    "idem.list": MethodSpec(IdemListParams, IdemListResult, False, "keys, paged"),
    "idem.resolve": MethodSpec(
        IdemResolveParams, IdemResolveResult, True, "operator recovery of an unknown outcome"
    ),
    "idem.reopen": MethodSpec(
        IdemReopenParams, IdemReopenResult, True, "forget a completed outcome to run it again"
    ),
    "lease.acquire": MethodSpec(
        LeaseAcquireParams, LeaseAcquireResult, True, "take or extend a fenced lease"
    ),
    "lease.renew": MethodSpec(LeaseRenewParams, LeaseAcquireResult, True, "extend a lease"),
    "lease.release": MethodSpec(LeaseTokenParams, LeaseReleaseResult, True, "give a lease back"),
    "lease.get": MethodSpec(LeaseResourceParams, LeaseRecord, False, "one lease"),
    "lease.list": MethodSpec(Empty, LeaseListResult, False, "leases held now"),
    "effect.claim": MethodSpec(
        EffectClaimParams, EffectClaimResult, True, "claim an external effect (and its lease)"
    ),
    "effect.heartbeat": MethodSpec(
        EffectAttemptParams, EffectRecord, True, "keep an in-flight effect and its lease"
    ),
    "effect.commit": MethodSpec(EffectCommitParams, EffectRecord, True, "record that it happened"),
    "effect.abort": MethodSpec(EffectAbortParams, EffectRecord, True, "it did not happen"),
    "effect.fail": MethodSpec(EffectFailParams, EffectRecord, True, "it failed"),
    "effect.resolve": MethodSpec(
        EffectResolveParams, EffectRecord, True, "operator recovery of an uncertain effect"
    ),
    "effect.get": MethodSpec(EffectKeyParams, EffectRecord, False, "one effect's receipt"),
    "effect.list": MethodSpec(EffectListParams, EffectListResult, False, "a run's effects"),
    "effect.settle": MethodSpec(
        EffectSettleParams, EffectSettleResult, True, "run the evidence probes of unsettled effects"
    ),
    "worker.register": MethodSpec(
        WorkerRegisterParams, WorkerRegisterResult, True, "this process becomes a worker"
    ),
    "worker.heartbeat": MethodSpec(WorkerIdParams, WorkerRecord, True, "the worker is alive"),
    "worker.stopping": MethodSpec(WorkerIdParams, WorkerRecord, True, "the worker winds down"),
    "worker.list": MethodSpec(WorkerListParams, WorkerListResult, False, "workers"),
    "dispatch.claim": MethodSpec(
        DispatchClaimParams, DispatchClaimResult, True, "claim a unit of work under a lease"
    ),
    "dispatch.start": MethodSpec(DispatchFenceParams, DispatchRecord, True, "claimed -> running"),
    "dispatch.complete": MethodSpec(DispatchCompleteParams, DispatchRecord, True, "it is done"),
    "dispatch.fail": MethodSpec(DispatchFailParams, DispatchRecord, True, "it failed"),
    "dispatch.stuck": MethodSpec(DispatchReasonParams, DispatchRecord, True, "it is stuck"),
    "dispatch.pause": MethodSpec(DispatchFenceParams, DispatchRecord, True, "it is paused"),
    "dispatch.cancel": MethodSpec(DispatchReasonParams, DispatchRecord, True, "call it off"),
    "dispatch.get": MethodSpec(DispatchIdParams, DispatchRecord, False, "one dispatch"),
    "dispatch.list": MethodSpec(DispatchListParams, DispatchListResult, False, "dispatches"),
    "dispatch.recent": MethodSpec(
        DispatchRecentParams, DispatchRecentResult, False, "recent unit keys, oldest first"
    ),
    "dispatch.stuck_report": MethodSpec(
        DispatchStuckReportParams, DispatchStuckReportResult, False, "is the loop stuck?"
    ),
    "audit.list": MethodSpec(AuditListParams, AuditListResult, False, "audit events, paged"),
    "kv.set": MethodSpec(KvSetParams, KvEntry, True, "store a soft-state value"),
    "kv.get": MethodSpec(KvKeyParams, KvEntry, False, "one value"),
    "kv.delete": MethodSpec(KvKeyParams, KvDeleteResult, True, "drop a value"),
    "kv.list": MethodSpec(KvListParams, KvListResult, False, "a scope's values"),
    "event.record": MethodSpec(EventRecordParams, EventRecordResult, True, "record one hook event"),
    "event.list": MethodSpec(EventListParams, EventListResult, False, "the event trail, paged"),
    "event.last_seen": MethodSpec(
        Empty, EventLastSeenResult, False, "when each event kind last arrived, per agent"
    ),
    "hook.event": MethodSpec(
        HookEventParams, HookEventResult, True, "an agent hook: its event, session, path leases"
    ),
    "path.claim": MethodSpec(PathClaimParams, PathClaimResult, True, "lease paths to a session"),
    "path.release": MethodSpec(PathReleaseParams, PathReleaseResult, True, "give path leases back"),
    "session.activity": MethodSpec(
        SessionActivityParams, SessionActivityResult, False, "last activity and attention"
    ),
    "session.message": MethodSpec(
        SessionMessageParams, SessionMessageResult, True, "leave a message for a session"
    ),
    "message.list": MethodSpec(MessageListParams, MessageListResult, False, "a session's messages"),
    "message.ack": MethodSpec(MessageAckParams, MessageRecord, True, "mark delivered or read"),
    "watch": MethodSpec(WatchParams, WatchResult, False, "subscribe: snapshot, then changes"),
    "fleet.restore_plan": MethodSpec(
        RestorePlanParams, RestorePlanResult, False, "what to bring back after a restart"
    ),
    "backup": MethodSpec(BackupParams, BackupResult, False, "online copy of the database"),
    "doctor": MethodSpec(DoctorParams, DoctorResult, False, "health of the database"),
}

FEATURES = [
    "fleet", "idempotency", "pipelining", "paging", "leases", "effects", "workers", "dispatch",
    "audit", "kv", "events", "messages", "watch", "restore_plan", "agent_hooks", "path_leases",
    "boxes",
]  # fmt: skip


PARAMS_DECODERS: dict[str, msgspec.msgpack.Decoder[Any]] = {
    name: msgspec.msgpack.Decoder(spec.params) for name, spec in METHODS.items()
}


def params_decoder(method: str) -> msgspec.msgpack.Decoder[Any]:
    """The decoder the daemon validates ``method``'s params with."""
    return PARAMS_DECODERS[method]
