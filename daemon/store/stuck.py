"""Is a dispatch loop stuck? Rules over a window of recent dispatches, oldest first.

The module is pure (no SQL, no I/O, no clock): the store feeds it ledger rows and
the retry budgets it read in the same transaction, tests feed it crafted
histories, and both get the same answer for the same input.

Rules, evaluated in this order (after GSD's ``auto/detect-stuck.ts``):

1. ``same-error``: the last two attempts carry the same error (``error_code``,
   else ``error_summary``). Unit: the last attempt's.
2. ``same-unit-consecutive``: the last three attempts are the same unit.
3. ``same-unit-in-window``: the last attempt's unit appears 3+ times in the
   window. Only the last attempt's unit is counted, as in the reference: a unit
   that was retried and then left behind is not a loop happening now.
4. ``oscillation``: the last four attempts are A, B, A, B with A != B.
   Unit: the last attempt's (B); the reason names both.

A verdict about a unit still waiting on its own retry backoff (attempts left and
a future ``next_run_at``) is suppressed: it goes to ``StuckReport.suppressed``
and the next rule is tried. The first unsuppressed verdict is the answer.
Units are always named by ``unit_key(type, id)``, never by a bare id, so a
verdict and a budget can never miss each other.
"""

from __future__ import annotations

from dataclasses import dataclass


def unit_key(unit_type: str, unit_id: str) -> str:
    return f"{unit_type}/{unit_id}"


@dataclass(frozen=True, slots=True)
class Attempt:
    unit_key: str
    status: str  # claimed|running|completed|failed|stuck|canceled|paused
    error_code: str | None = None
    error_summary: str | None = None


@dataclass(frozen=True, slots=True)
class UnitBudget:
    attempts: int  # dispatch rows the unit has (every claimed row counts)
    max_attempts: int  # from its latest row
    next_run_at: int | None  # ms since epoch, from its latest failed row


@dataclass(frozen=True, slots=True)
class Verdict:
    rule: str
    unit_key: str
    reason: str


@dataclass(frozen=True, slots=True)
class StuckReport:
    verdict: Verdict | None
    suppressed: list[Verdict]


def _error(a: Attempt) -> tuple[str, str] | None:
    """The error to compare; a code never equals a summary. Empty strings count as absent."""
    if a.error_code:
        return ("code", a.error_code)
    if a.error_summary:
        return ("summary", a.error_summary)
    return None


def _same_error(w: list[Attempt]) -> tuple[Verdict, tuple[str, ...]] | None:
    if len(w) < 2:
        return None
    prev, last = _error(w[-2]), _error(w[-1])
    if last is None or last != prev:
        return None
    key = w[-1].unit_key
    why = f"Same error repeated on the last 2 attempts, last on {key}: {last[1][:200]}"
    return Verdict("same-error", key, why), (key,)


def _same_unit_consecutive(w: list[Attempt]) -> tuple[Verdict, tuple[str, ...]] | None:
    if len(w) < 3 or len({a.unit_key for a in w[-3:]}) != 1:
        return None
    key = w[-1].unit_key
    why = f"{key} dispatched 3 consecutive times without progress"
    return Verdict("same-unit-consecutive", key, why), (key,)


def _same_unit_in_window(w: list[Attempt]) -> tuple[Verdict, tuple[str, ...]] | None:
    if not w:
        return None
    key = w[-1].unit_key
    n = sum(1 for a in w if a.unit_key == key)
    if n < 3:
        return None
    why = f"{key} dispatched {n} times in the last {len(w)} attempts without progress"
    return Verdict("same-unit-in-window", key, why), (key,)


def _oscillation(w: list[Attempt]) -> tuple[Verdict, tuple[str, ...]] | None:
    """A, B, A, B: suppressed only if BOTH A and B are waiting on their own backoff.

    The alternation is a property of the pair. If only A has a retry pending, B's
    re-dispatches are explained by nothing, so the loop is cycling; suppressing on
    one unit would let a unit with no budget left ping-pong forever behind its
    partner's backoff.
    """
    if len(w) < 4:
        return None
    a, b, c, d = (x.unit_key for x in w[-4:])
    if not (a == c and b == d and a != b):
        return None
    why = f"Oscillation detected: {a} <-> {b}, alternating over the last 4 attempts"
    return Verdict("oscillation", d, why), (a, b)


_RULES = (_same_error, _same_unit_consecutive, _same_unit_in_window, _oscillation)


def _waiting_on_retry(key: str, budgets: dict[str, UnitBudget], now: int) -> bool:
    b = budgets.get(key)
    return (
        b is not None
        and b.attempts < b.max_attempts
        and b.next_run_at is not None
        and b.next_run_at > now
    )


def evaluate(window: list[Attempt], budgets: dict[str, UnitBudget], now: int) -> StuckReport:
    """The first unsuppressed verdict in rule order, plus every suppressed one before it."""
    suppressed: list[Verdict] = []
    for rule in _RULES:
        hit = rule(window)
        if hit is None:
            continue
        verdict, units = hit
        if all(_waiting_on_retry(u, budgets, now) for u in units):
            suppressed.append(verdict)
            continue
        return StuckReport(verdict, suppressed)
    return StuckReport(None, suppressed)
