"""Workers, the work-dispatch ledger, the audit log and soft state: worker.*,
dispatch.*, audit.list, kv.*."""

from __future__ import annotations

from typing import Annotated, Any

from msgspec import Meta, Struct

from towerd.protocol.schema.base import (
    DEFAULT_PAGE_LIMIT,
    INT64_MAX,
    AuditCategory,
    Cursor,
    DispatchStatus,
    KvScope,
    Millis,
    PageLimit,
    WorkerStatus,
    _require_shallow,
)
from towerd.protocol.schema.effects import (
    Name,
    Resource,
    Token,
)

# --- workers -------------------------------------------------------------------------------

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

DispatchId = Annotated[int, Meta(ge=1, le=INT64_MAX)]
Reason = Annotated[str, Meta(max_length=4096)]
RecentLimit = Annotated[int, Meta(ge=1, le=500)]
# No '/': the unit key is "unit_type/unit_id", so ("x/y", "z") and ("x", "y/z") would be
# one unit with two active dispatches and two retry budgets.
UnitType = Annotated[str, Meta(min_length=1, max_length=256, pattern="^[^/]+$")]
DEFAULT_MAX_ATTEMPTS = 3


class DispatchClaimParams(Struct):
    worker_id: WorkerId
    lease_resource: Resource
    fencing_token: Token
    unit_type: UnitType
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
