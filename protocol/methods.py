"""One msgspec Struct per method's params and result, and the closed method table.

The daemon decodes every request's params straight into the method's params
Struct, so validation happens once, at the boundary, with msgspec's path
messages (``Expected `int`, got `str` - at `$.limit```). Unknown fields are
ignored so that newer clients can talk to older daemons. Timestamps are
integer milliseconds since the Unix epoch (UTC), never msgpack timestamps.

Clients do not import this module (it costs start-up time in short-lived
hooks); it is the reference the daemon and ``docs/protocol.md`` follow.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from towerd.protocol.fields import SESSION_FIELDS

# --- shared field types ------------------------------------------------------

UUID_PATTERN = "^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$"

SessionId = Annotated[str, Meta(pattern=UUID_PATTERN, description="lowercase hyphenated UUID")]
INT64_MAX = 2**63 - 1  # SQLite's integers are signed 64-bit
Millis = Annotated[
    int, Meta(ge=0, le=INT64_MAX, description="milliseconds since the Unix epoch, UTC")
]
Operation = Annotated[str, Meta(min_length=1, max_length=128)]
IdemKey = Annotated[str, Meta(min_length=1, max_length=255)]
EffectRef = Annotated[str, Meta(min_length=1, max_length=255)]
Pid = Annotated[int, Meta(ge=1, le=2**31 - 1)]
PageLimit = Annotated[int, Meta(ge=1, le=5000)]
Cursor = Annotated[int, Meta(ge=0, le=INT64_MAX)]
IdemState = Literal["in_progress", "completed", "outcome_unknown"]

DEFAULT_PAGE_LIMIT = 500


MAX_VALUE_DEPTH = 100  # nesting levels of a free-form value (payload, result, entry)


def _require_printable(field: str, value: str | None) -> None:
    if value is not None and not value.isprintable():
        raise ValueError(f"`{field}` must contain printable characters only")


def _require_shallow(field: str, value: Any) -> None:
    """Refuse free-form values nested deeper than MAX_VALUE_DEPTH (checked without recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = [*item.keys(), *item.values()]
        elif isinstance(item, list | tuple):
            children = list(item)
        else:
            continue
        if depth > MAX_VALUE_DEPTH:
            raise ValueError(f"`{field}` nests deeper than {MAX_VALUE_DEPTH} levels")
        stack.extend((child, depth + 1) for child in children)


class Empty(Struct):
    """Params of a method that takes none (extra fields are ignored)."""


# --- handshake and daemon ----------------------------------------------------


class HelloParams(Struct):
    protocol: int
    client: Annotated[str, Meta(max_length=256)]
    principal: Annotated[str, Meta(min_length=1, max_length=128)] | None = None

    def __post_init__(self) -> None:
        _require_printable("principal", self.principal)


class ServerInfo(Struct):
    name: str
    version: str


class HelloResult(Struct):
    daemon_id: str
    owner_epoch: int
    protocol: int
    server: ServerInfo
    max_frame: int
    features: list[str]
    principal: str


class PingResult(Struct):
    pong: bool
    now: Millis


class KeyCounts(Struct):
    in_progress: int = 0
    completed: int = 0
    outcome_unknown: int = 0


class ReconcileReport(Struct):
    """What startup reconciliation did, as logged and reported by ``status``."""

    at: Millis
    owner_epoch: int
    rows_taken: int = 0
    marked_unknown: int = 0
    completed_from_evidence: int = 0
    still_unknown: int = 0
    expired: int = 0


class ClockReport(Struct):
    """towerd's clock against the wall clock (docs/protocol.md, "Time")."""

    now: Millis  # towerd's time: real elapsed time since its anchor
    wall: Millis  # the wall clock at the same moment
    offset_ms: int  # wall - now: the wall-clock steps since the anchor
    steps_detected: int  # wall-clock steps noticed since this daemon started


class UpkeepTask(Struct):
    """One background task: how its runs went (a failing task retries with backoff)."""

    name: str
    runs: int
    failures: int  # consecutive failures; 0 when the last run succeeded
    last_error_code: str | None = None
    last_error: str | None = None
    last_failed_at: Millis | None = None


class StatusResult(Struct):
    daemon_id: str
    owner_epoch: int
    pid: int
    version: str
    protocol: int
    started_at: Millis
    uptime_ms: int
    db_path: str
    socket_path: str
    sessions: int
    keys: KeyCounts
    reconciliation: ReconcileReport
    clock: ClockReport | None = None
    upkeep: list[UpkeepTask] = []


class ShutdownResult(Struct):
    stopping: bool


# --- fleet -------------------------------------------------------------------


class SessionRow(Struct):
    """One fleet row as clients see it: the session's fields plus its ownership."""

    session_id: str
    agent_session_id: str | None
    name: str | None
    cwd: str
    agent: str
    pinned: bool
    last_attached_at: Millis | None
    exited: bool
    parent: str | None
    prompt: str | None
    result: str | None
    transcript_path: str | None
    model: str | None
    effort: str | None
    target: str | None
    target_identity: str | None
    daemon_id: str
    owner_epoch: int
    updated_at: Millis


class SessionEntry(Struct):
    """A whole session as ``fleet.write`` replaces it (fields left out are cleared)."""

    session_id: SessionId
    cwd: str
    agent: str
    agent_session_id: str | None = None
    name: str | None = None
    pinned: bool = False
    last_attached_at: Millis | None = None
    exited: bool = False
    parent: SessionId | None = None
    prompt: str | None = None
    result: str | None = None
    transcript_path: str | None = None
    model: str | None = None
    effort: str | None = None
    target: str | None = None
    target_identity: str | None = None


class SessionRegisterParams(Struct):
    cwd: str
    agent: str
    session_id: SessionId | None = None
    agent_session_id: str | None = None
    name: str | None = None
    pinned: bool = False
    last_attached_at: Millis | None = None
    exited: bool = False
    parent: SessionId | None = None
    prompt: str | None = None
    result: str | None = None
    transcript_path: str | None = None
    model: str | None = None
    effort: str | None = None
    target: str | None = None
    target_identity: str | None = None
    idempotency_key: IdemKey | None = None

    def __post_init__(self) -> None:
        _require_printable("idempotency_key", self.idempotency_key)


class SessionRegisterResult(Struct):
    session_id: str


class SessionUpdateParams(Struct):
    """Only the fields present are rewritten; ``null`` clears a nullable field."""

    session_id: SessionId
    agent_session_id: str | None | UnsetType = UNSET
    name: str | None | UnsetType = UNSET
    cwd: str | UnsetType = UNSET
    agent: str | UnsetType = UNSET
    pinned: bool | UnsetType = UNSET
    last_attached_at: Millis | None | UnsetType = UNSET
    exited: bool | UnsetType = UNSET
    parent: SessionId | None | UnsetType = UNSET
    prompt: str | None | UnsetType = UNSET
    result: str | None | UnsetType = UNSET
    transcript_path: str | None | UnsetType = UNSET
    model: str | None | UnsetType = UNSET
    effort: str | None | UnsetType = UNSET
    target: str | None | UnsetType = UNSET
    target_identity: str | None | UnsetType = UNSET

    def given_fields(self) -> dict[str, Any]:
        return {
            name: value for name in SESSION_FIELDS if (value := getattr(self, name)) is not UNSET
        }


class SessionIdParams(Struct):
    session_id: SessionId


class SessionRemoveResult(Struct):
    session_id: str
    removed: bool


class FleetListParams(Struct):
    limit: PageLimit = DEFAULT_PAGE_LIMIT
    cursor: Cursor | None = None


class FleetListResult(Struct):
    sessions: list[SessionRow]
    next_cursor: int | None = None


class FleetWriteParams(Struct):
    sessions: list[SessionEntry] = []
    removed: list[SessionId] = []


class FleetWriteResult(Struct):
    written: int
    removed: int
    dropped: list[str]
    relinked: int


class LegacyImportParams(Struct):
    """Entries of a legacy fleet file; each is validated on its own."""

    entries: list[Any]

    def __post_init__(self) -> None:
        _require_shallow("entries", self.entries)


class LegacySkip(Struct):
    index: int
    reason: str
    agent_session_id: str | None = None


class LegacyImported(Struct):
    agent_session_id: str
    session_id: str


class LegacyImportResult(Struct):
    imported: int
    skipped: int
    skips: list[LegacySkip]
    sessions: list[LegacyImported]


class FleetAdoptParams(Struct):
    daemon_id: Annotated[str, Meta(min_length=1, max_length=64)]


class FleetAdoptResult(Struct):
    adopted: int  # fleet rows moved
    from_daemon_id: str
    daemon_id: str
    owner_epoch: int
    keys_adopted: int = 0  # idempotency keys now reconciled by this daemon
    keys_marked_unknown: int = 0  # of those, in progress and without evidence
    keys_completed_from_evidence: int = 0


# --- idempotency ---------------------------------------------------------------


class IdemKeyParams(Struct):
    operation: Operation
    key: IdemKey

    def __post_init__(self) -> None:
        _require_printable("operation", self.operation)
        _require_printable("key", self.key)


class IdemClaimParams(IdemKeyParams):
    payload: Any = None
    effect_ref: EffectRef | None = None
    holder_pid: Pid | None = None
    replay_only: bool = False
    # A token the caller makes up once per logical claim and repeats when it retries
    # a claim whose answer was lost: the retry is answered "claimed" again.
    attempt: Annotated[str, Meta(min_length=1, max_length=64)] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        _require_shallow("payload", self.payload)


class IdemClaimResult(Struct, omit_defaults=True):
    state: Literal["claimed", "completed"]
    effect_ref: str
    result: Any = None


class IdemCompleteParams(IdemKeyParams):
    result: Any = None

    def __post_init__(self) -> None:
        super().__post_init__()
        _require_shallow("result", self.result)


class IdemReleaseResult(Struct):
    operation: str
    key: str
    released: bool


class IdemListParams(Struct):
    state: IdemState | None = None
    operation: Operation | None = None
    limit: PageLimit = DEFAULT_PAGE_LIMIT
    cursor: Cursor | None = None


class IdemRecord(Struct):
    operation: str
    key: str
    state: IdemState
    effect_ref: str
    result: Any
    created_at: Millis
    updated_at: Millis
    holder_pid: int | None


class IdemListResult(Struct):
    keys: list[IdemRecord]
    next_cursor: int | None = None


class IdemResolveParams(IdemKeyParams):
    outcome: Literal["completed", "abandoned"]
    result: Any = None

    def __post_init__(self) -> None:
        super().__post_init__()
        _require_shallow("result", self.result)


class IdemResolveResult(Struct):
    operation: str
    key: str
    outcome: str
    record: IdemRecord | None


class IdemReopenParams(IdemKeyParams):
    """Forget a completed key's outcome on purpose, so the next claim runs its effect
    again: how an operator retries a step that completed with a failure (a `towerctl
    run` whose command exited 1). ``result`` must be the stored result: the operator
    reopens the outcome they looked at, not one that changed since."""

    result: Any = None
    reason: Annotated[str, Meta(max_length=1000)] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        _require_shallow("result", self.result)


class IdemReopenResult(Struct):
    operation: str
    key: str
    reopened: bool
    previous: IdemRecord  # the record as it was before it was forgotten


# --- leases ------------------------------------------------------------------------------

LeaseTtl = Annotated[int, Meta(ge=5_000, le=600_000)]
DEFAULT_LEASE_TTL_MS = 300_000
Resource = Annotated[str, Meta(min_length=1, max_length=1024)]
Token = Annotated[int, Meta(ge=1, le=INT64_MAX)]


class LeaseAcquireParams(Struct):
    resource: Resource
    ttl_ms: LeaseTtl = DEFAULT_LEASE_TTL_MS


class LeaseRenewParams(Struct):
    resource: Resource
    fencing_token: Token
    ttl_ms: LeaseTtl = DEFAULT_LEASE_TTL_MS


class LeaseTokenParams(Struct):
    resource: Resource
    fencing_token: Token


class LeaseResourceParams(Struct):
    resource: Resource


class LeaseRecord(Struct):
    """A lease as the daemon's clock sees it; ``expires_at`` is daemon time."""

    resource: str
    fencing_token: int
    expires_at: Millis
    holder: str  # principal and pid, e.g. "uid:1000:default pid 4242"
    holder_pid: int | None
    acquired_at: Millis
    renewed_at: Millis
    live: bool


class LeaseAcquireResult(Struct):
    resource: str
    fencing_token: int
    expires_at: Millis
    holder: str
    renewed: bool


class LeaseReleaseResult(Struct):
    resource: str
    fencing_token: int
    released: bool


class LeaseListResult(Struct, omit_defaults=True):
    leases: list[LeaseRecord]
    truncated: bool = False  # sent (true) only when the list was cut to fit one frame


# --- the effects ledger -------------------------------------------------------------------

ActionKind = Literal[
    "git-branch", "git-commit", "git-push", "pr-create", "tracker-issue", "webhook"
]
EffectStatus = Literal["in_flight", "committed", "failed", "aborted", "uncertain"]
EffectKey = Annotated[str, Meta(pattern="^eff_[0-9a-f]{16}$")]
Name = Annotated[str, Meta(min_length=1, max_length=256)]
AttemptId = Annotated[str, Meta(min_length=1, max_length=128)]


class EffectClaimParams(Struct):
    run_id: Name
    step_id: Name
    attempt_id: AttemptId
    action_kind: ActionKind
    target_ref: Annotated[str, Meta(min_length=1, max_length=1024)]
    payload: Any = None
    timeout_ms: Annotated[int, Meta(ge=1_000, le=86_400_000)] = DEFAULT_LEASE_TTL_MS
    lease_ttl_ms: LeaseTtl = DEFAULT_LEASE_TTL_MS

    def __post_init__(self) -> None:
        _require_shallow("payload", self.payload)


class EffectClaimResult(Struct):
    effect_key: str
    status: str
    attempt_id: str
    lease_resource: str | None = None
    fencing_token: int | None = None
    lease_expires_at: Millis | None = None


class EffectAttemptParams(Struct):
    effect_key: EffectKey
    attempt_id: AttemptId
    lease_ttl_ms: LeaseTtl = DEFAULT_LEASE_TTL_MS


class EffectCommitParams(Struct):
    effect_key: EffectKey
    attempt_id: AttemptId
    receipt: Any = None

    def __post_init__(self) -> None:
        _require_shallow("receipt", self.receipt)


class EffectAbortParams(Struct):
    effect_key: EffectKey
    attempt_id: AttemptId
    reason: Annotated[str, Meta(max_length=4096)] | None = None


class EffectFailParams(Struct):
    effect_key: EffectKey
    attempt_id: AttemptId
    error: Any = None

    def __post_init__(self) -> None:
        _require_shallow("error", self.error)


class EffectResolveParams(Struct):
    effect_key: EffectKey
    outcome: Literal["committed", "aborted"]
    receipt: Any = None

    def __post_init__(self) -> None:
        _require_shallow("receipt", self.receipt)


class EffectKeyParams(Struct):
    effect_key: EffectKey


class EffectListParams(Struct):
    run_id: Name


class EffectRecord(Struct):
    """An effect's receipt: what was claimed, by which attempt, and how it ended."""

    effect_key: str
    run_id: str
    step_id: str
    attempt_id: str
    action_kind: str
    target_ref: str
    status: EffectStatus
    payload_hash: str  # hex SHA-256 of the canonical payload
    receipt: Any
    claimed_at: Millis
    heartbeat_at: Millis
    completed_at: Millis | None
    timeout_ms: int
    lease_resource: str | None
    fencing_token: int | None
    holder_pid: int | None


class EffectListResult(Struct, omit_defaults=True):
    effects: list[EffectRecord]
    truncated: bool = False  # sent (true) only when the list was cut to fit one frame


# --- workers -------------------------------------------------------------------------------

WorkerStatus = Literal["active", "stopping", "crashed"]
WorkerId = Annotated[str, Meta(min_length=1, max_length=64)]
AbsolutePath = Annotated[str, Meta(min_length=1, max_length=4096)]
DEFAULT_WORKER_TTL_MS = 60_000


def _require_absolute(field: str, value: str | None) -> None:
    if value is not None and ("\0" in value or not value.startswith("/")):
        raise ValueError(f"`{field}` must be an absolute path without NUL bytes")


class WorkerRegisterParams(Struct):
    project_root: AbsolutePath
    version: Annotated[str, Meta(max_length=256)] | None = None

    def __post_init__(self) -> None:
        _require_absolute("project_root", self.project_root)


class WorkerRegisterResult(Struct):
    worker_id: str
    heartbeat_ttl_ms: int  # heartbeat more often than this, or be reaped as crashed
    existing: bool = False  # this process had registered already (a retried register)


class WorkerIdParams(Struct):
    worker_id: WorkerId


class WorkerRecord(Struct):
    worker_id: str
    principal: str
    host: str
    pid: int
    process_start: int  # the process's start time (clock ticks since boot): tells pid reuse
    version: str | None
    project_root: str  # real path
    status: WorkerStatus
    registered_at: Millis
    heartbeat_at: Millis
    ended_at: Millis | None  # reaped, or its process gone after worker.stopping
    end_reason: str | None  # "heartbeat-timeout", "process-gone", "process-exited"


class WorkerListParams(Struct):
    status: WorkerStatus | None = None
    project_root: AbsolutePath | None = None

    def __post_init__(self) -> None:
        _require_absolute("project_root", self.project_root)


class WorkerListResult(Struct, omit_defaults=True):
    workers: list[WorkerRecord]
    truncated: bool = False  # sent (true) only when the list was cut to fit one frame


# --- the work-dispatch ledger --------------------------------------------------------------

DispatchStatus = Literal["claimed", "running", "completed", "failed", "stuck", "canceled", "paused"]
DispatchId = Annotated[int, Meta(ge=1, le=INT64_MAX)]
Reason = Annotated[str, Meta(max_length=4096)]
RecentLimit = Annotated[int, Meta(ge=1, le=500)]
DEFAULT_MAX_ATTEMPTS = 3


class DispatchClaimParams(Struct):
    worker_id: WorkerId
    lease_resource: Resource
    fencing_token: Token
    unit_type: Name
    unit_id: Name
    milestone_id: Name
    trace_id: Name
    slice_id: Name | None = None
    task_id: Name | None = None
    turn_id: Name | None = None
    max_attempts: Annotated[int, Meta(ge=1, le=1000)] = DEFAULT_MAX_ATTEMPTS


class DispatchClaimResult(Struct):
    dispatch_id: int
    attempt_n: int
    status: DispatchStatus = "claimed"


class DispatchFenceParams(Struct):
    """A transition without details (start, pause): fenced by worker and token."""

    dispatch_id: DispatchId
    worker_id: WorkerId
    fencing_token: Token


class DispatchCompleteParams(Struct):
    dispatch_id: DispatchId
    worker_id: WorkerId
    fencing_token: Token
    exit_reason: Reason | None = None


class DispatchFailParams(Struct):
    dispatch_id: DispatchId
    worker_id: WorkerId
    fencing_token: Token
    error_code: Name
    error_summary: Reason
    retry_after_ms: Annotated[int, Meta(ge=0, le=30 * 86_400_000)] | None = None


class DispatchReasonParams(Struct):
    """stuck and cancel: a transition with a reason."""

    dispatch_id: DispatchId
    worker_id: WorkerId
    fencing_token: Token
    reason: Reason


class DispatchIdParams(Struct):
    dispatch_id: DispatchId


class DispatchRecord(Struct):
    dispatch_id: int
    unit_key: str  # "unit_type/unit_id": the one key every query and rule uses
    unit_type: str
    unit_id: str
    milestone_id: str
    slice_id: str | None
    task_id: str | None
    trace_id: str
    turn_id: str | None
    worker_id: str
    lease_resource: str
    fencing_token: int
    status: DispatchStatus
    attempt_n: int
    max_attempts: int
    claimed_at: Millis
    started_at: Millis | None
    ended_at: Millis | None
    exit_reason: str | None
    error_code: str | None
    error_summary: str | None
    retry_after_ms: int | None
    next_run_at: Millis | None


class DispatchListParams(Struct):
    """Filters combine with AND; none given lists every dispatch."""

    unit_type: Name | None = None
    unit_id: Name | None = None
    milestone_id: Name | None = None
    status: DispatchStatus | None = None
    worker_id: WorkerId | None = None
    limit: RecentLimit = 50


class DispatchListResult(Struct, omit_defaults=True):
    dispatches: list[DispatchRecord]  # the most recent matches, oldest first
    truncated: bool = False  # sent (true) only when the list was cut to fit one frame


class DispatchRecentParams(Struct):
    """Exactly one of ``worker_id`` and ``project_root``."""

    worker_id: WorkerId | None = None
    project_root: AbsolutePath | None = None
    limit: RecentLimit = 20

    def __post_init__(self) -> None:
        if (self.worker_id is None) == (self.project_root is None):
            raise ValueError("give exactly one of `worker_id` and `project_root`")
        _require_absolute("project_root", self.project_root)


class DispatchRecentResult(Struct):
    unit_keys: list[str]  # oldest first


class DispatchStuckReportParams(Struct):
    project_root: AbsolutePath
    window: Annotated[int, Meta(ge=2, le=500)] = 20

    def __post_init__(self) -> None:
        _require_absolute("project_root", self.project_root)


class StuckVerdict(Struct):
    rule: str  # same-error, same-unit-consecutive, same-unit-in-window, oscillation
    unit_key: str
    reason: str


class DispatchStuckReportResult(Struct):
    stuck: bool
    verdict: StuckVerdict | None
    suppressed: list[StuckVerdict]  # verdicts held back: the unit has a retry scheduled
    window: list[str]  # the unit keys evaluated, oldest first


# --- audit ---------------------------------------------------------------------------------

AuditCategory = Literal["worker", "lease", "dispatch"]


class AuditListParams(Struct):
    category: AuditCategory | None = None
    type: Name | None = None
    trace_id: Name | None = None
    before: Cursor | None = None  # the ``next_before`` of the previous page
    limit: Annotated[int, Meta(ge=1, le=500)] = 50


class AuditEvent(Struct):
    seq: int  # order of recording
    event_id: str
    trace_id: str | None
    turn_id: str | None
    caused_by: str | None  # the event that caused this one (a reap causes releases)
    category: str
    type: str
    ts: Millis
    actor: str  # who: "principal pid N", or "daemon" for the daemon's own upkeep
    payload: Any


class AuditListResult(Struct):
    events: list[AuditEvent]  # newest first
    next_before: int | None = None


# --- soft state ------------------------------------------------------------------------------

KvScope = Literal["global", "worker", "milestone"]
KvScopeId = Annotated[str, Meta(max_length=256)]
DEFAULT_KV_MAX_VALUE = 64 * 1024


class KvKeyParams(Struct):
    scope: KvScope
    key: Name
    scope_id: KvScopeId = ""


class KvSetParams(Struct):
    scope: KvScope
    key: Name
    value: Any
    scope_id: KvScopeId = ""

    def __post_init__(self) -> None:
        _require_shallow("value", self.value)


class KvEntry(Struct):
    scope: str
    scope_id: str
    key: str
    value: Any
    updated_at: Millis


class KvDeleteResult(Struct):
    deleted: bool


class KvListParams(Struct):
    scope: KvScope
    scope_id: KvScopeId = ""
    after: Name | None = None  # the ``next_after`` of the previous page
    limit: PageLimit = DEFAULT_PAGE_LIMIT


class KvListResult(Struct):
    entries: list[KvEntry]  # by key
    next_after: str | None = None


# --- the event trail, messages, watch, restore plan ------------------------------------------

EventKind = Annotated[str, Meta(min_length=1, max_length=64)]
AgentSessionId = Annotated[str, Meta(min_length=1, max_length=256)]
DEFAULT_EVENT_PAGE, MAX_EVENT_PAGE = 50, 200
MAX_SCOPE_IDS = 1000  # ids (or kinds) in one list of event.list / session.activity
DEFAULT_EVENT_MAX_PAYLOAD = 64 * 1024
Attention = Literal["running", "needs_you", "done", "exited"]


class EventRecordParams(Struct):
    kind: EventKind  # a hook's hook_event_name verbatim: Notification, Stop, ...
    session_id: SessionId | None = None
    agent_session_id: AgentSessionId | None = None
    payload: Any = None

    def __post_init__(self) -> None:
        _require_shallow("payload", self.payload)


class EventRecordResult(Struct):
    event_id: int
    at: Millis
    session_id: str | None  # the fleet session the event was filed under, if known


class TrailEvent(Struct):
    event_id: int
    session_id: str | None
    agent_session_id: str | None
    kind: str
    at: Millis
    payload: Any


class EventListParams(Struct):
    """An absent id list does not filter; an empty one matches nothing; the two combine
    with OR."""

    session_ids: Annotated[list[SessionId], Meta(max_length=MAX_SCOPE_IDS)] | None = None
    agent_session_ids: Annotated[list[AgentSessionId], Meta(max_length=MAX_SCOPE_IDS)] | None = None
    kinds: Annotated[list[EventKind], Meta(max_length=MAX_SCOPE_IDS)] | None = None
    before: Cursor | None = None
    limit: Annotated[int, Meta(ge=1, le=MAX_EVENT_PAGE)] = DEFAULT_EVENT_PAGE


class EventListResult(Struct):
    events: list[TrailEvent]  # newest first; heartbeats left out
    next_before: int | None = None


class SessionActivityParams(Struct):
    # default: all of this daemon's sessions
    session_ids: Annotated[list[SessionId], Meta(max_length=MAX_SCOPE_IDS)] | None = None


class SessionActivity(Struct):
    session_id: str
    last_activity_at: Millis | None  # newest event, heartbeats included
    last_kind: str | None  # newest event that is not a heartbeat
    attention: Attention


class SessionActivityResult(Struct, omit_defaults=True):
    sessions: list[SessionActivity]
    truncated: bool = False  # sent (true) only when the list was cut to fit one frame


MessageStatus = Literal["queued", "delivered", "read"]


class SessionMessageParams(Struct):
    session_id: SessionId
    text: Annotated[str, Meta(min_length=1, max_length=65536)]
    idempotency_key: IdemKey | None = None

    def __post_init__(self) -> None:
        _require_printable("idempotency_key", self.idempotency_key)


class SessionMessageResult(Struct):
    message_id: str
    status: MessageStatus


class MessageRecord(Struct):
    message_id: str
    session_id: str
    agent_session_id: str | None
    text: str
    status: MessageStatus
    created_at: Millis
    updated_at: Millis


class MessageListParams(Struct):
    session_id: SessionId
    status: MessageStatus | None = None
    limit: Annotated[int, Meta(ge=1, le=500)] = 100


class MessageListResult(Struct, omit_defaults=True):
    messages: list[MessageRecord]  # oldest first
    truncated: bool = False  # sent (true) only when the list was cut to fit one frame


class MessageAckParams(Struct):
    message_id: Annotated[str, Meta(min_length=1, max_length=64)]
    status: Literal["delivered", "read"]


WatchTopic = Literal["fleet", "events", "idem", "leases", "effects", "dispatch"]
WATCH_TOPICS: tuple[str, ...] = ("fleet", "events", "idem", "leases", "effects", "dispatch")


class WatchParams(Struct):
    topics: Annotated[list[WatchTopic], Meta(min_length=1)]


class WatchResult(Struct):
    """The snapshot of each chosen topic; then pushed ``{event, seq, data}`` frames."""

    snapshot: dict[str, Any]
    seq: int


class RestorePlanEntry(Struct):
    session_id: str
    parent: str | None
    agent: str
    agent_session_id: str | None
    cwd: str
    name: str | None
    model: str | None
    effort: str | None
    target: str | None
    target_identity: str | None
    transcript_path: str | None
    last_activity_at: Millis | None


class RestorePlanResult(Struct, omit_defaults=True):
    sessions: list[RestorePlanEntry]  # newest activity first; a parent before its children
    truncated: bool = False  # sent (true) only when the list was cut to fit one frame


# --- operator tools --------------------------------------------------------------


class BackupParams(Struct):
    path: Annotated[str, Meta(min_length=1, max_length=4096)]  # absolute, on the daemon's host
    overwrite: bool = False

    def __post_init__(self) -> None:
        if "\0" in self.path or not self.path.startswith("/"):
            raise ValueError("`path` must be an absolute path without NUL bytes")


class BackupResult(Struct):
    path: str
    bytes: int
    pages: int
    integrity: list[str]  # PRAGMA integrity_check of the copy: ["ok"]
    duration_ms: int


class DoctorParams(Struct):
    full: bool = False  # integrity_check (slow, thorough) instead of quick_check


class UnknownKey(Struct):
    principal: str
    operation: str
    key: str
    effect_ref: str
    updated_at: Millis


class UncertainEffect(Struct):
    effect_key: str
    run_id: str
    action_kind: str
    target_ref: str
    attempt_id: str
    heartbeat_at: Millis


class DoctorResult(Struct):
    check: str
    integrity: list[str]  # ["ok"] or the problems found
    schema_version: int
    supported_schema_version: int
    db_path: str
    db_bytes: int
    wal_bytes: int
    keys: KeyCounts
    unknown_keys: list[UnknownKey]  # the oldest outcome_unknown keys, all principals
    oldest_in_progress_at: Millis | None
    uncertain_effects: list[UncertainEffect] = []  # effects waiting for effect.resolve
    live_leases: int = 0


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
    "session.register": MethodSpec(
        SessionRegisterParams, SessionRegisterResult, True, "insert one fleet row"
    ),
    "session.update": MethodSpec(SessionUpdateParams, SessionRow, True, "rewrite given fields"),
    "session.remove": MethodSpec(SessionIdParams, SessionRemoveResult, True, "delete one row"),
    "fleet.list": MethodSpec(FleetListParams, FleetListResult, False, "this daemon's rows, paged"),
    "fleet.get": MethodSpec(SessionIdParams, SessionRow, False, "one row"),
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
        IdemKeyParams, IdemReleaseResult, True, "drop a key whose effect never started"
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
        Empty, RestorePlanResult, False, "what to bring back after a restart"
    ),
    "backup": MethodSpec(BackupParams, BackupResult, False, "online copy of the database"),
    "doctor": MethodSpec(DoctorParams, DoctorResult, False, "health of the database"),
}

FEATURES = [
    "fleet", "idempotency", "pipelining", "paging", "leases", "effects", "workers", "dispatch",
    "audit", "kv", "events", "messages", "watch", "restore_plan",
]  # fmt: skip


PARAMS_DECODERS: dict[str, msgspec.msgpack.Decoder[Any]] = {
    name: msgspec.msgpack.Decoder(spec.params) for name, spec in METHODS.items()
}


def params_decoder(method: str) -> msgspec.msgpack.Decoder[Any]:
    """The decoder the daemon validates ``method``'s params with."""
    return PARAMS_DECODERS[method]
