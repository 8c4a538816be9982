"""The naming rules must mint exactly what KXM's external-effects.ts mints for the same
run, or the two would disagree on which branch and which effect key a run owns. The
expected values were checked against the reference functions run under node."""

from __future__ import annotations

import pytest

from towerd.protocol.naming import (
    ACTION_KINDS,
    LOCAL_KINDS,
    SHARED_KINDS,
    effect_key,
    effect_requires_lease,
    is_run_branch_ref,
    run_branch,
    slugify_branch_part,
)


def test_kind_sets():
    assert ACTION_KINDS == (
        "git-branch",
        "git-commit",
        "git-push",
        "pr-create",
        "tracker-issue",
        "webhook",
    )
    assert SHARED_KINDS == ("git-push", "pr-create", "tracker-issue", "webhook")
    assert LOCAL_KINDS == ("git-branch", "git-commit")
    assert set(SHARED_KINDS) | set(LOCAL_KINDS) == set(ACTION_KINDS)
    assert not set(SHARED_KINDS) & set(LOCAL_KINDS)


@pytest.mark.parametrize(
    ("text", "max_length", "slug"),
    [
        ("Fix the Login Bug!", 40, "fix-the-login-bug"),
        ("--Hello__World--", 40, "hello-world"),  # leading/trailing dashes trimmed
        ("Café Über", 40, "caf-ber"),  # only a-z0-9 survive
        ("", 40, ""),
        ("!!!", 40, ""),
        ("abcd", 4, "abcd"),  # exactly max_length: untouched
        ("abc def", 4, "abc"),  # cut to "abc-", then the trailing dash goes
        ("a" * 34 + " b", 35, "a" * 34),
        ("x" * 50, 40, "x" * 40),  # the default limit
    ],
)
def test_slugify_branch_part(text, max_length, slug):
    assert slugify_branch_part(text, max_length) == slug


def test_slugify_default_max_length_is_40():
    assert slugify_branch_part("y" * 41) == "y" * 40


@pytest.mark.parametrize(
    ("run_id", "branch"),
    [
        ("run_abc", "kxm/run-abc"),
        ("abc", "kxm/run-abc"),
        ("run_run_x", "kxm/run-run_x"),  # one run_ prefix stripped; the id is not slugified
    ],
)
def test_run_branch_without_slug(run_id, branch):
    assert run_branch(run_id) == branch


def test_run_branch_description_positional_or_keyword():
    expected = "kxm/run-a1-fix-login-bug"
    assert run_branch("run_a1", "Fix login bug") == expected
    assert run_branch("run_a1", description="Fix login bug") == expected


def test_run_branch_description_cut_at_35():
    branch = run_branch("run_a1", "Fix the login bug in the authentication module")
    assert branch == "kxm/run-a1-fix-the-login-bug-in-the-authentica"


def test_run_branch_formats():
    assert run_branch("run_a1", "Fix bug", format="run-suffix") == "kxm/run-a1-fix-bug"
    assert run_branch("run_a1", "Fix bug", format="prefix-run") == "kxm/fix-bug-run-a1"


@pytest.mark.parametrize("description", ["", "!!!", None])
@pytest.mark.parametrize("format", ["run-suffix", "prefix-run"])
def test_run_branch_empty_slug_falls_back(description, format):
    assert run_branch("run_a1", description, format=format) == "kxm/run-a1"
    assert run_branch("run_a1", workflow_id="--", issue_key="", format=format) == "kxm/run-a1"


def test_run_branch_skips_a_part_contained_in_an_earlier_one():
    # "proj-12" is inside "deploy-proj-12", and so is "deploy".
    branch = run_branch("run_a1", "deploy", workflow_id="Deploy PROJ-12", issue_key="PROJ-12")
    assert branch == "kxm/run-a1-deploy-proj-12"


def test_run_branch_inclusion_is_one_way():
    """A later part containing an earlier one is kept: only the reverse is skipped."""
    branch = run_branch(
        "run_a1", "Fix bug", workflow_id="proj", issue_key="PROJ-12", format="prefix-run"
    )
    assert branch == "kxm/proj-proj-12-fix-bug-run-a1"


def test_run_branch_part_limits_and_slug_cut_at_50():
    """Workflow 25, issue 20, description 35, joined slug 50: here the cut at 50 lands on a
    dash, which is trimmed."""
    branch = run_branch("run_a1", "xy z", workflow_id="w" * 30, issue_key="i" * 30)
    assert branch == "kxm/run-a1-" + "w" * 25 + "-" + "i" * 20 + "-xy"


def test_run_branch_prefix_is_configurable():
    assert run_branch("run_a1", "Fix bug", prefix="tw/") == "tw/run-a1-fix-bug"
    assert run_branch("run_a1", prefix="") == "run-a1"


def test_run_branch_unknown_format():
    with pytest.raises(ValueError, match="unknown branch format"):
        run_branch("run_a1", "x", format="suffix")


@pytest.mark.parametrize(
    "ref",
    [
        "kxm/run-a1",
        "kxm/run-a1-fix-bug",
        "kxm/fix-bug-run-a1",
        "refs/heads/kxm/run-a1",
        "refs/heads/kxm/run-a1-fix-bug",
        "refs/heads/kxm/fix-bug-run-a1",
        # The reference's rule is a prefix match, so a run "a1-2" branch counts as a1's too.
        "kxm/run-a1-2",
    ],
)
def test_is_run_branch_ref_own(ref):
    assert is_run_branch_ref("run_a1", ref)
    assert is_run_branch_ref("a1", ref)  # with or without run_


@pytest.mark.parametrize(
    "ref",
    [
        "kxm/run-a10",  # another run
        "kxm/run-a",
        "kxm/fix-bug-run-a10",
        "main",
        "other/run-a1",  # outside the prefix
        "run-a1",
        "refs/remotes/origin/kxm/run-a1",  # only refs/heads/ is stripped
        "refs/heads/refs/heads/kxm/run-a1",  # and only once
    ],
)
def test_is_run_branch_ref_foreign(ref):
    assert not is_run_branch_ref("run_a1", ref)


def test_is_run_branch_ref_every_format_of_run_branch():
    for format in ("run-suffix", "prefix-run"):
        assert is_run_branch_ref("run_a1", run_branch("run_a1", "Fix bug", format=format))
    assert is_run_branch_ref("run_a1", run_branch("run_a1"))


def test_is_run_branch_ref_empty_run_id_owns_nothing():
    assert not is_run_branch_ref("run_", "kxm/run-")
    assert not is_run_branch_ref("", "kxm/run-")


def test_is_run_branch_ref_custom_prefix():
    assert is_run_branch_ref("run_a1", "tw/run-a1", prefix="tw/")
    assert not is_run_branch_ref("run_a1", "kxm/run-a1", prefix="tw/")


@pytest.mark.parametrize("kind", LOCAL_KINDS)
def test_local_kinds_never_need_a_lease(kind):
    assert not effect_requires_lease(kind, "main", "run_a1")
    assert not effect_requires_lease(kind, "kxm/run-a1", "run_a1")


@pytest.mark.parametrize("kind", ["pr-create", "tracker-issue", "webhook"])
def test_shared_kinds_other_than_push_always_need_a_lease(kind):
    assert effect_requires_lease(kind, "kxm/run-a1", "run_a1")
    assert effect_requires_lease(kind, "https://hooks.example/x", "run_a1")


def test_push_needs_a_lease_only_to_a_foreign_branch():
    assert not effect_requires_lease("git-push", "kxm/run-a1", "run_a1")
    assert not effect_requires_lease("git-push", "refs/heads/kxm/fix-bug-run-a1", "run_a1")
    assert effect_requires_lease("git-push", "main", "run_a1")
    assert effect_requires_lease("git-push", "kxm/run-a10", "run_a1")
    assert effect_requires_lease("git-push", "tw/run-a1", "run_a1")
    assert not effect_requires_lease("git-push", "tw/run-a1", "run_a1", prefix="tw/")


def test_unknown_kind_is_refused_not_called_lease_free():
    with pytest.raises(ValueError, match="unknown action kind 'git-tag'"):
        effect_requires_lease("git-tag", "main", "run_a1")
    with pytest.raises(ValueError, match="unknown action kind"):
        effect_key("run_a1", "s", "git-tag", "main")


def test_effect_key():
    # sha256("run_a1:push:git-push:refs/heads/kxm/run-a1") = a82c5facd2f582ca...
    assert effect_key("run_a1", "push", "git-push", "refs/heads/kxm/run-a1") == (
        "eff_a82c5facd2f582ca"
    )


def test_effect_key_depends_on_every_part():
    base = ("run_a1", "push", "git-push", "main")
    keys = {effect_key(*base)}
    for index, other in enumerate(("run_a2", "push2", "pr-create", "dev")):
        changed = list(base)
        changed[index] = other
        keys.add(effect_key(*changed))
    assert len(keys) == 5
    assert all(len(key) == 20 and key.startswith("eff_") for key in keys)
