"""The closed set of error codes, and one exception class per code.

Both ends raise and catch these: the daemon raises them from handlers and
the store, the clients rebuild them from error frames. A code this version
does not know (a newer daemon) becomes :class:`Internal`, keeping the
original code in ``data["code"]`` and the message as sent.
"""

from __future__ import annotations

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs hooks ~3 ms
if TYPE_CHECKING:  # no runtime import: hooks pay for every module they load
    from typing import Any


_CLASSES: dict[str, type[TowerdError]] = {}  # wire code -> its class (this module's)


class TowerdError(Exception):
    """An error with a wire code. ``data`` carries machine-readable details.

    Each class of this module that declares a ``code`` is that code's class (it
    registers itself): a list of them kept by hand let a new one reach clients as
    ``Internal``."""

    code = "internal"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__module__ == __name__ and "code" in cls.__dict__:
            assert cls.code not in _CLASSES, f"two classes for code {cls.code!r}"
            _CLASSES[cls.code] = cls

    def __init__(self, message: str, data: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.data = data

    def __repr__(self) -> str:
        name = type(self).__name__
        return f"{name}(code={self.code!r}, message={self.message!r}, data={self.data!r})"

    def to_wire(self) -> dict[str, Any]:
        body: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.data is not None:
            body["data"] = self.data
        return body


class BadFrame(TowerdError):
    """The frame could not be decoded as a request envelope."""

    code = "bad_frame"


class FrameTooLarge(TowerdError):
    """The length prefix announced more than the peer accepts."""

    code = "frame_too_large"


class ProtocolMismatch(TowerdError):
    """Client and daemon speak different protocol versions."""

    code = "protocol_mismatch"


class Unauthorized(TowerdError):
    """No hello yet, or a peer of another uid."""

    code = "unauthorized"


class UnknownMethod(TowerdError):
    code = "unknown_method"


class BadArgs(TowerdError):
    """Params failed validation; the message carries msgspec's path."""

    code = "bad_args"


class NotFound(TowerdError):
    code = "not_found"


class Conflict(TowerdError):
    """The request contradicts the stored state (duplicate id, wrong state)."""

    code = "conflict"


class StaleEpoch(TowerdError):
    """The write touches rows of another daemon or a later owner epoch."""

    code = "stale_epoch"


class IdempotencyConflict(TowerdError):
    """The key is known with a different payload."""

    code = "idempotency_conflict"


class IdempotencyInProgress(TowerdError):
    """Someone holds the key and has not finished; ``data.effect_ref``."""

    code = "idempotency_in_progress"


class OutcomeUnknown(TowerdError):
    """The effect under this key may or may not have happened: never re-run it."""

    code = "outcome_unknown"


class IdempotencyKeyUnknown(TowerdError):
    """A replay-only claim found no record."""

    code = "idempotency_key_unknown"


class StorageFull(TowerdError):
    """The disk is full; nothing was written."""

    code = "storage_full"


class QuotaExceeded(TowerdError):
    """The principal has as many rows of a table as ``--quota`` allows; nothing was
    written. ``data``: ``table``, ``limit``, ``rows``, ``principal``."""

    code = "quota_exceeded"


class Unavailable(TowerdError):
    """The daemon cannot be reached, or is shutting down."""

    code = "unavailable"


# ``Unavailable``'s data reason when the daemon's store (PostgreSQL) did not answer: the
# call may or may not have been applied, and is retried with the same key.
STORE_UNREACHABLE = "store_unreachable"


def store_unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` says the daemon's store could not be reached."""
    return isinstance(exc, Unavailable) and (exc.data or {}).get("reason") == STORE_UNREACHABLE


class Internal(TowerdError):
    """A bug on the other side; the message says what, the log says more."""

    code = "internal"


# --- leases and the effects ledger --------------------------------------------------


class LeaseHeld(TowerdError):
    """Another holder has a live lease on the resource; ``data`` is that lease."""

    code = "lease_held"


class LeaseSuperseded(TowerdError):
    """The lease now has another holder or token: yours is gone for good."""

    code = "lease_superseded"


class LeaseExpired(TowerdError):
    """Your lease's deadline passed; it is never resurrected under the old token."""

    code = "lease_expired"


class LeaseNotFound(TowerdError):
    code = "lease_not_found"


class StaleLease(TowerdError):
    """A fenced operation presented a lease that is not current."""

    code = "stale_lease"


class EffectAlreadyCommitted(TowerdError):
    """The effect happened; ``data.receipt`` says how. Never run it again."""

    code = "effect_already_committed"


class EffectInFlight(TowerdError):
    code = "effect_in_flight"


class EffectUncertain(TowerdError):
    """The effect may have happened; it waits for ``effect.resolve``."""

    code = "effect_uncertain"


class EffectLeaseHeld(TowerdError):
    """Another holder has the target's lease; nothing was recorded."""

    code = "effect_lease_held"


class EffectLeaseSuperseded(TowerdError):
    """Someone took the target's lease over; the effect is parked uncertain."""

    code = "effect_lease_superseded"


class EffectAttemptSuperseded(TowerdError):
    """A newer attempt owns the effect; this one changed nothing."""

    code = "effect_attempt_superseded"


class EffectNotFound(TowerdError):
    code = "effect_not_found"


# --- the work-dispatch ledger ---------------------------------------------------------


class AlreadyActive(TowerdError):
    """The unit has an active dispatch (``data.dispatch``); at most one at a time."""

    code = "already_active"


class AttemptsExhausted(TowerdError):
    """The unit has used every attempt ``max_attempts`` allows."""

    code = "attempts_exhausted"


class NotBefore(TowerdError):
    """The unit's last failure asked for a pause: ``data.next_run_at``."""

    code = "not_before"


class TooSlow(TowerdError):
    """A watcher fell behind its bounded queue; the daemon closes the subscription."""

    code = "too_slow"


ERROR_CODES: frozenset[str] = frozenset(_CLASSES)


def error_for_code(code: str, message: str, data: dict[str, Any] | None = None) -> TowerdError:
    """Rebuild the exception an error frame describes."""
    cls = _CLASSES.get(code)
    if cls is None:
        data = {**(data or {}), "code": code}
        return Internal(message, data)
    return cls(message, data)
