"""Idempotency keys: idem.*."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import Meta, Struct

from towerd.protocol.schema.base import (
    DEFAULT_PAGE_LIMIT,
    Cursor,
    EffectRef,
    IdemKey,
    IdemOutcome,
    IdemState,
    Millis,
    Operation,
    PageLimit,
    Pid,
    _require_printable,
    _require_shallow,
)

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
    # A shell command that tells whether the effect happened, run (``sh -c``, in
    # ``probe_cwd``) by the daemon while the key is outcome_unknown: exit 0 = it did
    # (the key completes), 1 = it did not (the key is released), else cannot tell.
    # Stored with a new key; not part of its payload.
    probe: Annotated[str, Meta(min_length=1, max_length=4096)] | None = None
    probe_cwd: Annotated[str, Meta(min_length=1, max_length=4000, pattern="^/")] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        _require_shallow("payload", self.payload)
        if self.probe is not None and "\x00" in self.probe:
            raise ValueError("probe must not contain NUL")
        if self.probe_cwd is not None and self.probe is None:
            raise ValueError("probe_cwd is given with a probe only")


class IdemClaimResult(Struct, omit_defaults=True):
    state: Literal["claimed", "completed"]
    effect_ref: str
    result: Any = None


class IdemCompleteParams(IdemKeyParams):
    result: Any = None
    # The claim's effect_ref as read: a key claimed again since (a new claim has a new
    # one) is not completed, so the outcome of one claim never lands on another. None:
    # not checked.
    effect_ref: EffectRef | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        _require_shallow("result", self.result)


class IdemReleaseParams(IdemKeyParams):
    # The claim's effect_ref as read: a key claimed again since is not released, so a
    # run that gives up on its own launch never drops another's. None: not checked.
    effect_ref: EffectRef | None = None


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
    outcome: IdemOutcome
    result: Any = None
    # The unknown claim's effect_ref as read: a key claimed again since (a new claim has
    # a new one) is not resolved, so a decision about one claim never settles another.
    # None: not checked.
    effect_ref: EffectRef | None = None

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
    # The outcome's effect_ref as read: a key that ran again since (a new claim has a new
    # one), even to the same result, is not reopened. None: not checked.
    effect_ref: EffectRef | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        _require_shallow("result", self.result)


class IdemReopenResult(Struct):
    operation: str
    key: str
    reopened: bool
    previous: IdemRecord  # the record as it was before it was forgotten
