"""Names for a run's external effects: its branch, its effect keys, which kinds need a lease.

Pure functions, ported rule for rule from KXM's ``external-effects.ts``
(``slugifyBranchPart``, ``deterministicRunBranch``, ``isRunBranchRef``,
``effectRequiresHubLease``, ``computeEffectKey``), so a branch or key minted here
is the same one KXM mints for the same run. The ``kxm/`` branch prefix is a
parameter; everything else is fixed. Shared by the daemon (which decides which
claims take a lease) and the clients (which mint keys and branch names); stdlib
only, touches neither git nor a socket.

Two deliberate departures, both for input the TypeScript types rule out: an
unknown action kind raises ``ValueError`` (the reference would call it lease-free,
failing open), and so does an unknown branch ``format`` (the reference silently
uses ``run-suffix``).
"""

from __future__ import annotations

import hashlib
import re

ACTION_KINDS = ("git-branch", "git-commit", "git-push", "pr-create", "tracker-issue", "webhook")
# Shared with every other box: two runs naming the same target mean the same real thing.
SHARED_KINDS = ("git-push", "pr-create", "tracker-issue", "webhook")
# Written in a namespace the run already owns: never contended.
LOCAL_KINDS = ("git-branch", "git-commit")

# Set in the environment of a `towerctl run --probe` command (and so of everything it
# starts) to the run's attempt token, and of a `towerctl effect run` command to
# effect_attempt_mark(its attempt id): the daemon never probes a key or an effect while
# a process still carries it (daemon/probes.py).
RUN_ATTEMPT_VARIABLE = "TOWERD_RUN_ATTEMPT"


def effect_attempt_mark(attempt_id: str) -> str:
    """The RUN_ATTEMPT_VARIABLE value of an effect attempt's command."""
    return f"effect:{attempt_id}"


DEFAULT_PREFIX = "kxm/"
BRANCH_FORMATS = ("run-suffix", "prefix-run")

_NOT_SLUG = re.compile(r"[^a-z0-9]+")


def _clean_run_id(run_id: str) -> str:
    """A run id without its ``run_`` prefix (one occurrence, as the reference strips it)."""
    return run_id.removeprefix("run_")


def _check_kind(action_kind: str) -> None:
    if action_kind not in ACTION_KINDS:
        raise ValueError(
            f"unknown action kind {action_kind!r}; expected one of {', '.join(ACTION_KINDS)}"
        )


def slugify_branch_part(text: str, max_length: int = 40) -> str:
    """``text`` lowercased, each run of characters other than a-z and 0-9 turned into one
    dash, with no leading or trailing dash, cut to ``max_length`` (then trailing dashes
    dropped again, so a cut never leaves one)."""
    cleaned = _NOT_SLUG.sub("-", text.lower()).strip("-")
    if len(cleaned) <= max_length:
        return cleaned
    return cleaned[:max_length].rstrip("-")


def run_branch(
    run_id: str,
    description: str | None = None,
    workflow_id: str | None = None,
    issue_key: str | None = None,
    format: str = "run-suffix",
    prefix: str = DEFAULT_PREFIX,
) -> str:
    """The run's branch, derived only from its inputs so every retry names the same one.

    Without a slug: ``{prefix}run-{id}``. The slug joins the workflow id (25 chars),
    the issue key (20) and the description (35), each slugified, skipping a part
    already contained in an earlier one, cut to 50 chars. ``run-suffix`` gives
    ``{prefix}run-{id}-{slug}``, ``prefix-run`` gives ``{prefix}{slug}-run-{id}``.
    ``id`` is ``run_id`` without a leading ``run_``.
    """
    if format not in BRANCH_FORMATS:
        raise ValueError(f"unknown branch format {format!r}; expected one of {BRANCH_FORMATS}")
    clean_id = _clean_run_id(run_id)
    parts: list[str] = []
    for value, limit in ((workflow_id, 25), (issue_key, 20), (description, 35)):
        if not value:
            continue
        part = slugify_branch_part(value, limit)
        if part and not any(part in earlier for earlier in parts):
            parts.append(part)
    slug = "-".join(parts)[:50].rstrip("-")
    if not slug:
        return f"{prefix}run-{clean_id}"
    if format == "prefix-run":
        return f"{prefix}{slug}-run-{clean_id}"
    return f"{prefix}run-{clean_id}-{slug}"


def is_run_branch_ref(run_id: str, ref: str, prefix: str = DEFAULT_PREFIX) -> bool:
    """Whether ``ref`` (a branch name or ``refs/heads/...``) is a branch :func:`run_branch`
    could have made for this run, in any format: pushing it contends with nobody."""
    clean_id = _clean_run_id(run_id)
    if not clean_id:
        return False
    branch = ref.removeprefix("refs/heads/")
    if not branch.startswith(prefix):
        return False
    return (
        branch == f"{prefix}run-{clean_id}"
        or branch.startswith(f"{prefix}run-{clean_id}-")
        or branch.endswith(f"-run-{clean_id}")
    )


def effect_requires_lease(
    kind: str, target_ref: str, run_id: str, prefix: str = DEFAULT_PREFIX
) -> bool:
    """Whether an effect must hold a shared lease before it runs: every shared kind
    does, except a ``git-push`` to the run's own branch. Local kinds never do."""
    _check_kind(kind)
    if kind not in SHARED_KINDS:
        return False
    if kind == "git-push":
        return not is_run_branch_ref(run_id, target_ref, prefix)
    return True


# A push destination that does not start with ``refs/`` is, to git (git-push(1),
# ``<dst>``), the remote's ref it ends with: ``main`` and ``heads/main`` are
# refs/heads/main, ``tags/v1`` is refs/tags/v1.
SHORT_REF_PREFIXES = ("heads/", "tags/")


def lease_resource(kind: str, target_ref: str) -> str:
    """The shared lease an effect on ``target_ref`` takes: one name per target, so the
    spellings git accepts for a branch (``main``, ``heads/main``, ``refs/heads/main``)
    contend for one lease (each once had its own, and two runs pushed the branch at
    once)."""
    if kind != "git-push" or target_ref.startswith("refs/"):
        return target_ref
    if target_ref.startswith(SHORT_REF_PREFIXES):
        return f"refs/{target_ref}"
    return f"refs/heads/{target_ref}"


def other_lease_names(kind: str, target_ref: str) -> list[str]:
    """Leases that may stand for the ref a push to ``target_ref`` writes, which must not
    be held by another holder when it is claimed (contending too often is the safe
    side). A short name S (``main``, ``heads/X``, ``tags/X``) is leased as the ref git
    takes it for when the remote has one (:func:`lease_resource`); when the remote has
    none, git makes ``refs/heads/S`` (a branch pushed) or ``refs/tags/S`` (a tag), and
    S itself was leased as is before short names were folded. So a claim on S checks
    those, and a claim on a full ``refs/heads/S`` or ``refs/tags/S`` whose S starts
    with ``heads/`` or ``tags/`` checks ``refs/S`` and S, which a claim on S holds."""
    if kind != "git-push":
        return []
    if not target_ref.startswith("refs/"):
        names = [target_ref, f"refs/heads/{target_ref}"]
        if target_ref.startswith(SHORT_REF_PREFIXES):
            names.append(f"refs/tags/{target_ref}")
    else:
        names = []
        for made in ("refs/heads/", "refs/tags/"):
            short = target_ref.removeprefix(made)
            if short != target_ref and short.startswith(SHORT_REF_PREFIXES):
                names += [f"refs/{short}", short]
    resource = lease_resource(kind, target_ref)
    return [name for name in dict.fromkeys(names) if name != resource]


EFFECT_KEY_PREFIX = "eff_"  # an effect's key: this, then EFFECT_KEY_DIGITS hex digits
EFFECT_KEY_DIGITS = 16
EFFECT_KEY_PATTERN = f"^{EFFECT_KEY_PREFIX}[0-9a-f]{{{EFFECT_KEY_DIGITS}}}$"


def is_effect_key(ref: str) -> bool:
    """Whether ``ref`` is an effect's key (an idempotency key fronting an effect)."""
    return ref.startswith(EFFECT_KEY_PREFIX)


def effect_key(run_id: str, step_id: str, action_kind: str, target_ref: str) -> str:
    """The effect's idempotency key: ``eff_`` and the first 16 hex digits of the SHA-256
    of ``run:step:kind:target`` (UTF-8), the same key the reference ledger stores."""
    _check_kind(action_kind)
    raw = f"{run_id}:{step_id}:{action_kind}:{target_ref}"
    return EFFECT_KEY_PREFIX + hashlib.sha256(raw.encode("utf-8")).hexdigest()[:EFFECT_KEY_DIGITS]
