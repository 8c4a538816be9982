"""Git chores for a run's branch: find the repository's common directory, clean a branch up.

git always runs as a list of arguments (never a shell) with every ``GIT_*`` variable
removed from its environment: a hook runs inside git with ``GIT_DIR`` or
``GIT_WORK_TREE`` set for *its* repository, and an inherited one would point these
commands at the wrong repository.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any


class GitError(Exception):
    """git could not be run, or the path is not in a git repository."""


def clean_env() -> dict[str, str]:
    """This process's environment without any ``GIT_*`` variable."""
    return {
        name: value for name, value in os.environ.items() if not name.upper().startswith("GIT_")
    }


def run_git(cwd: str | os.PathLike[str], *args: str) -> subprocess.CompletedProcess[str]:
    """``git ARGS`` in ``cwd`` with a clean environment, output captured, never prompting
    on stdin; a non-zero exit is returned, not raised."""
    try:
        return subprocess.run(
            ["git", *args],
            cwd=cwd,
            env=clean_env(),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            errors="surrogateescape",
            check=False,
        )
    except FileNotFoundError as exc:
        missing = "git" if exc.filename == "git" else str(cwd)
        raise GitError(f"cannot run git in {cwd}: {missing} not found") from None
    except NotADirectoryError:
        raise GitError(f"cannot run git in {cwd}: not a directory") from None


def _output(result: subprocess.CompletedProcess[str]) -> str:
    return (result.stderr.strip() or result.stdout.strip()).replace("\n", "; ")


def git_common_dir(path: str | os.PathLike[str]) -> Path:
    """The git directory shared by every worktree of the repository containing ``path``:
    the main ``.git`` whether ``path`` is in the main worktree or a linked one (whose own
    ``.git`` file points at a per-worktree directory). Repository-wide files, such as a
    lock on worktree changes, belong here."""
    path = Path(path).absolute()
    cwd = path if path.is_dir() else path.parent
    result = run_git(cwd, "rev-parse", "--git-common-dir")
    if result.returncode != 0:
        raise GitError(f"not a git repository: {path} ({_output(result)})")
    # Relative to cwd when git prints it relative (".git" at a worktree's top).
    return (cwd / result.stdout.rstrip("\n")).resolve()


def _worktrees(common_dir: Path) -> list[dict[str, str]]:
    """``git worktree list --porcelain`` as one dict per worktree; the main one first."""
    result = run_git(common_dir, "worktree", "list", "--porcelain")
    if result.returncode != 0:
        raise GitError(f"git worktree list failed: {_output(result)}")
    worktrees = []
    for block in result.stdout.split("\n\n"):
        fields = {}
        for line in block.strip("\n").splitlines():
            name, _, value = line.partition(" ")
            fields[name] = value
        if "worktree" in fields:
            worktrees.append(fields)
    return worktrees


def _check_name(what: str, name: str) -> None:
    # git would read a leading dash as an option.
    if not name or name.startswith("-"):
        raise ValueError(f"invalid {what} name: {name!r}")


def cleanup_branch(
    repo: str | os.PathLike[str],
    branch: str,
    keep_worktree: bool = False,
    delete_remote: bool = False,
    remote: str = "origin",
) -> dict[str, Any]:
    """Remove the worktree that has ``branch`` checked out (``--force``: its uncommitted
    changes go too), delete the local branch (``-D``: merged or not), and with
    ``delete_remote`` the branch on ``remote``.

    Every step is attempted and reported; a failed one is recorded in ``errors`` under
    ``worktree``, ``local_branch`` or ``remote_branch`` and ``ok`` is false. A branch
    that does not exist, here or on the remote, is reported as not found, not as an
    error. ``repo`` is any path in the main worktree or a linked one. Raises
    :class:`GitError` when ``repo`` is not in a git repository, ``ValueError`` for a
    name git would read as an option.
    """
    branch = branch.removeprefix("refs/heads/")
    _check_name("branch", branch)
    if delete_remote:
        _check_name("remote", remote)
    # Run everything from the common directory: the worktree being removed may be the
    # very directory `repo` names.
    common = git_common_dir(repo)
    report: dict[str, Any] = {
        "repo": str(Path(repo).absolute()),
        "branch": branch,
        "ok": True,
        "worktree_removed": None,
        "worktree_kept": None,
        "local_branch_found": False,
        "local_branch_deleted": False,
        "remote": remote if delete_remote else None,
        "remote_branch_found": None,
        "remote_branch_deleted": False,
        "errors": {},
    }
    errors: dict[str, str] = report["errors"]

    # 1. The worktree(s) with the branch checked out: normally at most one.
    try:
        worktrees = _worktrees(common)
    except GitError as exc:
        errors["worktree"] = str(exc)
        worktrees = []
    for index, worktree in enumerate(worktrees):
        if worktree.get("branch") != f"refs/heads/{branch}":
            continue
        path = worktree["worktree"]
        if keep_worktree:
            report["worktree_kept"] = path
        elif index == 0:
            errors["worktree"] = (
                f"{branch} is checked out in the main worktree {path}, which cannot be "
                "removed; check out another branch there first"
            )
        else:
            result = run_git(common, "worktree", "remove", "--force", path)
            if result.returncode == 0:
                report["worktree_removed"] = report["worktree_removed"] or path
            else:
                errors["worktree"] = f"git worktree remove {path} failed: {_output(result)}"

    # 2. The local branch, if there is one.
    found = run_git(common, "rev-parse", "--verify", "--quiet", f"refs/heads/{branch}")
    report["local_branch_found"] = found.returncode == 0
    if report["local_branch_found"]:
        result = run_git(common, "branch", "-D", branch)
        if result.returncode == 0:
            report["local_branch_deleted"] = True
        else:
            errors["local_branch"] = f"git branch -D {branch} failed: {_output(result)}"

    # 3. The remote branch, if asked and it is there. ls-remote matches patterns on
    # trailing path components, so the exact ref is picked out of what it lists.
    if delete_remote:
        ref = f"refs/heads/{branch}"
        listed = run_git(common, "ls-remote", remote, ref)
        if listed.returncode != 0:
            errors["remote_branch"] = f"git ls-remote {remote} failed: {_output(listed)}"
        elif ref not in (line.partition("\t")[2] for line in listed.stdout.splitlines()):
            report["remote_branch_found"] = False
        else:
            report["remote_branch_found"] = True
            result = run_git(common, "push", remote, "--delete", ref)
            if result.returncode == 0:
                report["remote_branch_deleted"] = True
            else:
                errors["remote_branch"] = (
                    f"git push {remote} --delete {branch} failed: {_output(result)}"
                )

    report["ok"] = not errors
    return report
