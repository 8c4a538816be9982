"""Fenced leases and the external-effects ledger: lease.*, effect.*."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

from msgspec import Meta, Struct

from towerd.protocol import fields
from towerd.protocol.naming import EFFECT_KEY_PATTERN
from towerd.protocol.schema.base import (
    INT64_MAX,
    ActionKind,
    EffectOutcome,
    EffectStatus,
    Millis,
    _require_shallow,
)

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
    session_id: str | None = None  # the agent session a path lease is held for


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

EffectKey = Annotated[str, Meta(pattern=EFFECT_KEY_PATTERN)]
Name = Annotated[str, Meta(min_length=1, max_length=256)]
AttemptId = Annotated[str, Meta(min_length=1, max_length=128)]


if TYPE_CHECKING:  # mypy cannot read a Literal built at runtime
    ProbeVerdict = str
else:
    ProbeVerdict = Literal[fields.PROBE_VERDICTS]
GIT_OBJECT_PATTERN = "^[0-9a-f]{40}([0-9a-f]{24})?$"  # a full SHA-1 or SHA-256 object id
GIT_REF_PATTERN = "^refs/"


class GitPushTarget(Struct):
    """What a git-push effect pushes where, as claimed: enough for a probe to ask the
    remote (``git ls-remote``) whether the push happened, and the repository in which
    to decide ancestry."""

    repo: Annotated[str, Meta(min_length=2, max_length=4000, pattern="^/")]
    remote_url: Annotated[str, Meta(min_length=1, max_length=4000)]
    commit: Annotated[str, Meta(pattern=GIT_OBJECT_PATTERN)]
    ref: Annotated[str, Meta(max_length=1024, pattern=GIT_REF_PATTERN)]

    def __post_init__(self) -> None:
        if self.remote_url.startswith("-"):
            raise ValueError("git.remote_url must not start with '-'")


class EffectClaimParams(Struct):
    run_id: Name
    step_id: Name
    attempt_id: AttemptId
    action_kind: ActionKind
    target_ref: Annotated[str, Meta(min_length=1, max_length=1024)]
    payload: Any = None
    timeout_ms: Annotated[int, Meta(ge=1_000, le=86_400_000)] = DEFAULT_LEASE_TTL_MS
    lease_ttl_ms: LeaseTtl = DEFAULT_LEASE_TTL_MS
    # A git-push's target, for the evidence probe; not part of the effect's identity.
    git: GitPushTarget | None = None

    def __post_init__(self) -> None:
        _require_shallow("payload", self.payload)
        if self.git is not None and self.action_kind != "git-push":
            raise ValueError("git is given for git-push effects only")


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
    outcome: EffectOutcome
    receipt: Any = None

    def __post_init__(self) -> None:
        _require_shallow("receipt", self.receipt)


class EffectKeyParams(Struct):
    effect_key: EffectKey


class EffectListParams(Struct):
    run_id: Name


class ProbeState(Struct):
    """The last evidence probe of an effect (or key): its verdict, when, how many have
    run, when the next one is due while it stays unknown, and what it saw."""

    verdict: ProbeVerdict
    attempts: int
    at: Millis
    next_at: Millis | None = None
    evidence: Any = None


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
    git: GitPushTarget | None = None  # a git-push's target as claimed: what a probe asks
    probe: ProbeState | None = None  # the last evidence probe, once one ran


class EffectSettleParams(Struct):
    """Run the evidence probes now: of these effects, or of a run's unsettled effects
    (``run_id``), or (neither given) of every unsettled effect and every outcome_unknown
    key that has a probe."""

    effect_keys: list[EffectKey] = []
    run_id: Name | None = None


class ProbeOutcome(Struct):
    """One probe's verdict: on an effect (``effect_key``) or on a key (``operation``,
    ``key``, ``principal``), with the status it now has and the evidence."""

    verdict: ProbeVerdict
    status: str  # the effect's status or the key's state after the probe ("gone": released)
    evidence: Any = None
    effect_key: str | None = None
    principal: str | None = None
    operation: str | None = None
    key: str | None = None


class EffectSettleResult(Struct):
    outcomes: list[ProbeOutcome]


class EffectListResult(Struct, omit_defaults=True):
    effects: list[EffectRecord]
    truncated: bool = False  # sent (true) only when the list was cut to fit one frame
