"""towerd's client library.

* :class:`Client`: blocking, for hooks and scripts (imports no event loop).
* :class:`AsyncClient`: asyncio (anyio on asyncio too), for services; imported on first
  use only.
* :func:`run_once` / :func:`run_once_async`: run an effect at most once under
  an idempotency key, across lost connections and daemon restarts.
* ``with client.effect(run_id, step_id, kind, target) as fx`` (and ``async with``
  on :class:`AsyncClient`): one external effect through the effects ledger,
  claimed, heartbeaten in the background and committed with ``fx.receipt``, a
  :class:`ClaimedEffect`; :class:`Heartbeat` is the background helper it uses.
* One exception class per wire error code, all subclasses of
  :class:`TowerdError` with ``.code``, ``.message`` and ``.data``.
"""

from __future__ import annotations

from towerd.client.sync import Client
from towerd.protocol.errors import (
    AlreadyActive,
    AttemptsExhausted,
    BadArgs,
    BadFrame,
    Conflict,
    EffectAlreadyCommitted,
    EffectAttemptSuperseded,
    EffectInFlight,
    EffectLeaseHeld,
    EffectLeaseSuperseded,
    EffectNotFound,
    EffectUncertain,
    FrameTooLarge,
    IdempotencyConflict,
    IdempotencyInProgress,
    IdempotencyKeyUnknown,
    Internal,
    LeaseExpired,
    LeaseHeld,
    LeaseNotFound,
    LeaseSuperseded,
    NotBefore,
    NotFound,
    OutcomeUnknown,
    ProtocolMismatch,
    QuotaExceeded,
    StaleEpoch,
    StaleLease,
    StorageFull,
    TooSlow,
    TowerdError,
    Unauthorized,
    Unavailable,
    UnknownMethod,
)

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs hooks ~3 ms
if TYPE_CHECKING:
    from typing import Any

    from towerd.client.aio import AsyncClient, run_once_async
    from towerd.client.effect import ClaimedEffect, Heartbeat
    from towerd.client.idempotent import EffectNotStarted, run_once

# Imported on first use: a hook that only needs Client pays for nothing else.
_LAZY = {
    "AsyncClient": "towerd.client.aio",
    "run_once_async": "towerd.client.aio",
    "EffectNotStarted": "towerd.client.idempotent",
    "run_once": "towerd.client.idempotent",
    "ClaimedEffect": "towerd.client.effect",
    "Heartbeat": "towerd.client.effect",
}

__all__ = [
    "AlreadyActive",
    "AsyncClient",
    "AttemptsExhausted",
    "BadArgs",
    "BadFrame",
    "ClaimedEffect",
    "Client",
    "Conflict",
    "EffectAlreadyCommitted",
    "EffectAttemptSuperseded",
    "EffectInFlight",
    "EffectLeaseHeld",
    "EffectLeaseSuperseded",
    "EffectNotFound",
    "EffectNotStarted",
    "EffectUncertain",
    "FrameTooLarge",
    "Heartbeat",
    "IdempotencyConflict",
    "IdempotencyInProgress",
    "IdempotencyKeyUnknown",
    "Internal",
    "LeaseExpired",
    "LeaseHeld",
    "LeaseNotFound",
    "LeaseSuperseded",
    "NotBefore",
    "NotFound",
    "OutcomeUnknown",
    "ProtocolMismatch",
    "QuotaExceeded",
    "StaleEpoch",
    "StaleLease",
    "StorageFull",
    "TooSlow",
    "TowerdError",
    "Unauthorized",
    "Unavailable",
    "UnknownMethod",
    "run_once",
    "run_once_async",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'towerd.client' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
