"""Stuck-loop rules on crafted histories: each rule fires, its near misses do not,
retry-backoff suppression, rule order and what lands in ``suppressed``."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from towerd.daemon.store.stuck import Attempt, StuckReport, UnitBudget, Verdict, evaluate, unit_key

NOW = 1_700_000_000_000
A = unit_key("execute-task", "M001/S01/T01")
B = unit_key("execute-task", "M001/S01/T02")
C = unit_key("plan-slice", "M001/S01")
RULES = ["same-error", "same-unit-consecutive", "same-unit-in-window", "oscillation"]

WAITING = UnitBudget(attempts=1, max_attempts=3, next_run_at=NOW + 60_000)
PAST = UnitBudget(attempts=1, max_attempts=3, next_run_at=NOW - 1)
DUE_NOW = UnitBudget(attempts=1, max_attempts=3, next_run_at=NOW)
EXHAUSTED = UnitBudget(attempts=3, max_attempts=3, next_run_at=NOW + 60_000)
NO_RETRY = UnitBudget(attempts=1, max_attempts=3, next_run_at=None)


def att(key: str, code: str | None = None, summary: str | None = None) -> Attempt:
    status = "failed" if code or summary else "completed"
    return Attempt(key, status, error_code=code, error_summary=summary)


def run(keys: list[str], budgets: dict[str, UnitBudget] | None = None) -> StuckReport:
    return evaluate([att(k) for k in keys], budgets or {}, NOW)


def rule_and_unit(report: StuckReport) -> tuple[str, str] | None:
    return None if report.verdict is None else (report.verdict.rule, report.verdict.unit_key)


def test_unit_key_keeps_slashes_of_the_id() -> None:
    assert unit_key("execute-task", "M001/S01/T03") == "execute-task/M001/S01/T03"


@pytest.mark.parametrize("window", [[], [att(A)], [att(A, "E1")], [att(A), att(B)]])
def test_short_windows_are_not_stuck(window: list[Attempt]) -> None:
    assert evaluate(window, {}, NOW) == StuckReport(None, [])


# -- same-error ---------------------------------------------------------------------------


def test_same_error_code_twice_in_a_row_names_the_last_unit() -> None:
    report = evaluate([att(A, "E_TIMEOUT"), att(B, "E_TIMEOUT")], {}, NOW)
    assert rule_and_unit(report) == ("same-error", B)
    assert "E_TIMEOUT" in report.verdict.reason and B in report.verdict.reason


def test_same_error_falls_back_to_summary_when_there_is_no_code() -> None:
    report = evaluate([att(A, summary="tests failed"), att(A, summary="tests failed")], {}, NOW)
    assert rule_and_unit(report) == ("same-error", A)
    assert "tests failed" in report.verdict.reason


@pytest.mark.parametrize(
    "window",
    [
        [att(A, "E1"), att(B, "E2")],  # different codes
        [att(A, "E1", "same text"), att(B, "E2", "same text")],  # code wins over summary
        [att(A, "E1"), att(B, summary="E1")],  # a code never equals a summary
        [att(A, "E1"), att(C), att(B, "E1")],  # same error, not adjacent
        [att(A, "E1"), att(B)],  # last carries no error
        [att(A), att(B)],  # neither carries an error
        [att(A, "", ""), att(B, "", "")],  # empty strings are no error
    ],
)
def test_same_error_near_misses(window: list[Attempt]) -> None:
    assert evaluate(window, {}, NOW).verdict is None


# -- same-unit-consecutive / same-unit-in-window ------------------------------------------


def test_same_unit_three_in_a_row() -> None:
    report = run([B, A, A, A])
    assert rule_and_unit(report) == ("same-unit-consecutive", A)
    assert report.verdict.reason == f"{A} dispatched 3 consecutive times without progress"


def test_same_unit_three_times_in_window_not_consecutive() -> None:
    report = run([A, B, A, C, A])
    assert rule_and_unit(report) == ("same-unit-in-window", A)
    assert (
        report.verdict.reason == f"{A} dispatched 3 times in the last 5 attempts without progress"
    )


@pytest.mark.parametrize(
    "keys",
    [
        [A, A, B],  # two in a row only
        [A, B, A, C],  # two in the window only
        [A, A, A, B],  # the repeated unit was left behind: the loop moved on
        [A, B, C, A, B, C],  # a three-cycle has every unit twice
    ],
)
def test_same_unit_near_misses(keys: list[str]) -> None:
    assert run(keys).verdict is None


def test_same_id_under_another_type_is_another_unit() -> None:
    plan, execute = unit_key("plan-task", "M001/S01/T01"), A
    assert run([plan, execute, plan, execute, C]).verdict is None
    assert run([execute, plan, execute, C, execute]).verdict.unit_key == execute


# -- oscillation --------------------------------------------------------------------------


def test_oscillation_names_both_units() -> None:
    report = run([C, A, B, A, B])
    assert rule_and_unit(report) == ("oscillation", B)
    assert A in report.verdict.reason and B in report.verdict.reason


@pytest.mark.parametrize("keys", [[A, B, A, C], [A, B, B, A], [C, A, B, A]])
def test_oscillation_near_misses(keys: list[str]) -> None:
    assert run(keys).verdict is None


def test_four_of_the_same_unit_is_not_oscillation() -> None:
    assert rule_and_unit(run([A, A, A, A])) == ("same-unit-consecutive", A)
    suppressed = run([A, A, A, A], {A: WAITING}).suppressed
    assert [v.rule for v in suppressed] == ["same-unit-consecutive", "same-unit-in-window"]


# -- suppression --------------------------------------------------------------------------


def test_unit_waiting_on_backoff_is_suppressed_by_every_rule_about_it() -> None:
    report = evaluate([att(C), att(A, "E1"), att(A, "E1"), att(A, "E1")], {A: WAITING}, NOW)
    assert report.verdict is None
    assert [(v.rule, v.unit_key) for v in report.suppressed] == [
        ("same-error", A),
        ("same-unit-consecutive", A),
        ("same-unit-in-window", A),
    ]


@pytest.mark.parametrize("budget", [PAST, DUE_NOW, EXHAUSTED, NO_RETRY])
def test_no_suppression_without_attempts_left_and_a_future_retry(budget: UnitBudget) -> None:
    report = run([C, A, A, A], {A: budget})
    assert rule_and_unit(report) == ("same-unit-consecutive", A)
    assert report.suppressed == []


def test_budgets_keyed_by_bare_id_or_for_another_unit_do_not_suppress() -> None:
    for budgets in ({"M001/S01/T01": WAITING}, {B: WAITING}, {}):
        assert rule_and_unit(run([A, A, A], budgets)) == ("same-unit-consecutive", A)


def test_budget_keyed_by_unit_key_with_slashes_suppresses() -> None:
    key = unit_key("execute-task", "M001/S01/T03")
    assert run([key, key, key], {key: WAITING}).verdict is None


def test_oscillation_is_suppressed_only_when_both_units_wait() -> None:
    keys = [A, B, A, B]
    assert rule_and_unit(run(keys, {A: WAITING})) == ("oscillation", B)
    assert rule_and_unit(run(keys, {B: WAITING})) == ("oscillation", B)
    assert rule_and_unit(run(keys, {A: WAITING, B: EXHAUSTED})) == ("oscillation", B)
    both = run(keys, {A: WAITING, B: WAITING})
    assert both.verdict is None
    assert [(v.rule, v.unit_key) for v in both.suppressed] == [("oscillation", B)]


# -- rule order ---------------------------------------------------------------------------


def test_same_error_comes_before_same_unit() -> None:
    report = evaluate([att(A, "E1"), att(A, "E1"), att(A, "E1")], {}, NOW)
    assert rule_and_unit(report) == ("same-error", A)
    assert report.suppressed == []


def test_suppressed_rule_falls_through_to_the_next_one() -> None:
    # Same error on A (suppressed: A waits), then B,A,B,A oscillation (B does not wait).
    window = [att(B), att(A), att(B, "E1"), att(A, "E1")]
    report = evaluate(window, {A: WAITING}, NOW)
    assert rule_and_unit(report) == ("oscillation", A)
    assert [(v.rule, v.unit_key) for v in report.suppressed] == [("same-error", A)]


def test_in_window_comes_before_oscillation() -> None:
    assert rule_and_unit(run([A, B, A, B, A, B])) == ("same-unit-in-window", B)
    report = run([A, B, A, B, A, B], {B: WAITING})
    assert rule_and_unit(report) == ("oscillation", B)
    assert [v.rule for v in report.suppressed] == ["same-unit-in-window"]


# -- properties ---------------------------------------------------------------------------

keys = st.sampled_from([A, B, C, unit_key("execute-task", "M001/S02/T01")])
errors = st.sampled_from([None, "E1", "E2"])
attempts = st.builds(att, keys, errors, st.sampled_from([None, "boom"]))
windows = st.lists(attempts, max_size=12)
budgets = st.dictionaries(keys, st.sampled_from([WAITING, PAST, DUE_NOW, EXHAUSTED, NO_RETRY]))


@given(windows, budgets)
def test_report_is_well_formed(window: list[Attempt], budgets: dict[str, UnitBudget]) -> None:
    before = (list(window), dict(budgets))
    report = evaluate(window, budgets, NOW)
    assert (window, budgets) == before
    found = report.suppressed + ([report.verdict] if report.verdict else [])
    order = [RULES.index(v.rule) for v in found]
    assert order == sorted(set(order))  # each rule at most once, in rule order
    assert all(v.unit_key == window[-1].unit_key for v in found)


@given(windows, budgets)
def test_budgets_that_do_not_wait_change_nothing(
    window: list[Attempt], budgets: dict[str, UnitBudget]
) -> None:
    idle = {k: b for k, b in budgets.items() if b is not WAITING}
    assert evaluate(window, idle, NOW) == evaluate(window, {}, NOW)
    assert evaluate(window, {}, NOW).suppressed == []


@given(windows)
def test_everyone_waiting_is_never_stuck(window: list[Attempt]) -> None:
    report = evaluate(window, {k: WAITING for k in (a.unit_key for a in window)}, NOW)
    assert report.verdict is None
    # Every rule that fires is now suppressed; unsuppressed, the first of them is the answer.
    first = report.suppressed[0] if report.suppressed else None
    assert evaluate(window, {}, NOW).verdict == first


@given(st.lists(keys, unique=True))
def test_distinct_units_without_errors_are_never_stuck(ks: list[str]) -> None:
    assert run(ks).verdict is None


def test_records_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        Verdict("oscillation", A, "r").rule = "same-error"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        att(A).unit_key = B  # type: ignore[misc]
