"""towerd's client library.

* :class:`Client`: blocking, for hooks and scripts (imports no event loop).
* :class:`AsyncClient`: anyio, for services; imported on first use only.
* :func:`run_once` / :func:`run_once_async`: run an effect at most once under
  an idempotency key, across lost connections and daemon restarts.
* One exception class per wire error code, all subclasses of
  :class:`TowerdError` with ``.code``, ``.message`` and ``.data``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from towerd.client.idempotent import EffectNotStarted, run_once
from towerd.client.sync import Client
from towerd.protocol.errors import (
    BadArgs,
    BadFrame,
    Conflict,
    FrameTooLarge,
    IdempotencyConflict,
    IdempotencyInProgress,
    IdempotencyKeyUnknown,
    Internal,
    NotFound,
    OutcomeUnknown,
    ProtocolMismatch,
    StaleEpoch,
    StorageFull,
    TowerdError,
    Unauthorized,
    Unavailable,
    UnknownMethod,
)

if TYPE_CHECKING:
    from towerd.client.aio import AsyncClient, run_once_async

__all__ = [
    "AsyncClient",
    "BadArgs",
    "BadFrame",
    "Client",
    "Conflict",
    "EffectNotStarted",
    "FrameTooLarge",
    "IdempotencyConflict",
    "IdempotencyInProgress",
    "IdempotencyKeyUnknown",
    "Internal",
    "NotFound",
    "OutcomeUnknown",
    "ProtocolMismatch",
    "StaleEpoch",
    "StorageFull",
    "TowerdError",
    "Unauthorized",
    "Unavailable",
    "UnknownMethod",
    "run_once",
    "run_once_async",
]


def __getattr__(name: str) -> Any:
    if name in ("AsyncClient", "run_once_async"):
        from towerd.client import aio

        return getattr(aio, name)
    raise AttributeError(f"module 'towerd.client' has no attribute {name!r}")
