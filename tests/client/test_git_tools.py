"""Branch cleanup deletes things: these tests run it against real repositories, worktrees and
a bare remote made in a temp dir, and check what is left on disk and in git afterwards."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from towerd.client.git_tools import GitError, cleanup_branch, git_common_dir
from towerd_testing import TOWERCTL

BRANCH = "kxm/run-a1"


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("GIT_")}
    return {**env, "LC_ALL": "C", **extra}


def git(cwd: Path, *args: str) -> str:
    """Set-up and inspection: git with a test identity, independent of the caller's env."""
    return subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false", *args],
        cwd=cwd,
        env=clean_env(),
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def branches(repo: Path) -> set[str]:
    return set(git(repo, "for-each-ref", "--format=%(refname:short)", "refs/heads/").split())


def worktrees(repo: Path) -> list[str]:
    listing = git(repo, "worktree", "list", "--porcelain").splitlines()
    return [line.removeprefix("worktree ") for line in listing if line.startswith("worktree ")]


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path.resolve()  # git reports real paths


@pytest.fixture
def repo(root: Path) -> Path:
    path = root / "repo"
    git(root, "init", "-q", "-b", "main", str(path))
    git(path, "commit", "-q", "--allow-empty", "-m", "init")
    return path


@pytest.fixture
def worktree(repo: Path, root: Path) -> Path:
    """BRANCH checked out in a linked worktree, with a commit main does not have."""
    path = root / "wt"
    git(repo, "worktree", "add", "-q", "-b", BRANCH, str(path))
    (path / "f.txt").write_text("work\n")
    git(path, "add", "f.txt")
    git(path, "commit", "-q", "-m", "work")
    return path


@pytest.fixture
def remote(repo: Path, root: Path) -> Path:
    """A bare repository as the repo's origin."""
    path = root / "origin.git"
    git(root, "init", "-q", "--bare", str(path))
    git(repo, "remote", "add", "origin", str(path))
    return path


@pytest.fixture(autouse=True)
def hostile_env(monkeypatch, root: Path):
    """As inside a git hook of another repository: none of this may leak into our git."""
    monkeypatch.setenv("GIT_DIR", str(root / "bogus.git"))
    monkeypatch.setenv("GIT_WORK_TREE", str(root / "bogus"))
    monkeypatch.setenv("GIT_INDEX_FILE", str(root / "bogus.index"))
    monkeypatch.setenv("LC_ALL", "C")


def report(repo: Path, **fields) -> dict:
    """The report of a cleanup that found nothing to do, with ``fields`` changed."""
    return {
        "repo": str(repo),
        "branch": BRANCH,
        "ok": True,
        "worktree_removed": None,
        "worktree_kept": None,
        "local_branch_found": False,
        "local_branch_deleted": False,
        "remote": None,
        "remote_branch_found": None,
        "remote_branch_deleted": False,
        "errors": {},
        **fields,
    }


# --- git_common_dir ------------------------------------------------------------------------


def test_common_dir_is_the_same_from_main_and_linked_worktrees(repo, worktree):
    (worktree / "sub").mkdir()
    expected = repo / ".git"
    assert git_common_dir(repo) == expected
    assert git_common_dir(worktree) == expected
    assert git_common_dir(worktree / "sub") == expected
    assert git_common_dir(worktree / "f.txt") == expected  # a file: its directory's repo
    assert git_common_dir(repo / ".git") == expected
    assert (worktree / ".git").is_file()  # really a linked worktree


def test_common_dir_of_a_bare_repository(remote):
    assert git_common_dir(remote) == remote


def test_common_dir_outside_a_repository(root):
    (root / "plain").mkdir()
    with pytest.raises(GitError, match="not a git repository: .*plain"):
        git_common_dir(root / "plain")
    with pytest.raises(GitError, match="not found"):
        git_common_dir(root / "missing" / "deeper")


# --- cleanup_branch ------------------------------------------------------------------------


def test_cleanup_removes_the_worktree_and_the_branch(repo, worktree):
    result = cleanup_branch(repo, BRANCH)
    assert result == report(
        repo, worktree_removed=str(worktree), local_branch_found=True, local_branch_deleted=True
    )
    assert not worktree.exists()
    assert worktrees(repo) == [str(repo)]
    assert branches(repo) == {"main"}


def test_cleanup_from_inside_the_worktree_it_removes(repo, worktree):
    result = cleanup_branch(worktree, f"refs/heads/{BRANCH}")
    assert result == report(
        worktree, worktree_removed=str(worktree), local_branch_found=True, local_branch_deleted=True
    )
    assert not worktree.exists()
    assert branches(repo) == {"main"}


def test_cleanup_of_a_worktree_whose_directory_is_gone(repo, worktree):
    git(repo, "worktree", "remove", "--force", str(worktree))
    git(repo, "worktree", "add", "-q", str(worktree), BRANCH)
    subprocess.run(["rm", "-rf", str(worktree)], check=True)
    result = cleanup_branch(repo, BRANCH)
    assert result == report(
        repo, worktree_removed=str(worktree), local_branch_found=True, local_branch_deleted=True
    )
    assert worktrees(repo) == [str(repo)]
    assert branches(repo) == {"main"}


def test_keep_worktree_then_git_refuses_the_branch(repo, worktree):
    result = cleanup_branch(repo, BRANCH, keep_worktree=True)
    error = result["errors"].pop("local_branch")
    assert error.startswith(f"git branch -D {BRANCH} failed: ")
    assert str(worktree) in error
    assert result == report(repo, ok=False, worktree_kept=str(worktree), local_branch_found=True)
    assert (worktree / "f.txt").read_text() == "work\n"
    assert branches(repo) == {"main", BRANCH}


def test_keep_worktree_with_no_worktree_deletes_the_branch(repo):
    git(repo, "branch", BRANCH)
    result = cleanup_branch(repo, BRANCH, keep_worktree=True)
    assert result == report(repo, local_branch_found=True, local_branch_deleted=True)
    assert branches(repo) == {"main"}


def test_a_branch_checked_out_in_the_main_worktree_is_left_alone(repo):
    git(repo, "checkout", "-q", "-b", BRANCH)
    result = cleanup_branch(repo, BRANCH)
    assert result["errors"]["worktree"] == (
        f"{BRANCH} is checked out in the main worktree {repo}, which cannot be removed; "
        "check out another branch there first"
    )
    assert result["errors"]["local_branch"].startswith(f"git branch -D {BRANCH} failed: ")
    assert result["ok"] is False
    assert result["worktree_removed"] is None
    assert result["local_branch_deleted"] is False
    assert branches(repo) == {"main", BRANCH}
    assert (repo / ".git").is_dir()


def test_a_missing_branch_is_reported_not_failed(repo):
    assert cleanup_branch(repo, BRANCH) == report(repo)
    assert branches(repo) == {"main"}


def test_delete_remote(repo, worktree, remote):
    git(worktree, "push", "-q", "origin", BRANCH)
    git(repo, "push", "-q", "origin", "main")
    result = cleanup_branch(repo, BRANCH, delete_remote=True)
    assert result == report(
        repo,
        worktree_removed=str(worktree),
        local_branch_found=True,
        local_branch_deleted=True,
        remote="origin",
        remote_branch_found=True,
        remote_branch_deleted=True,
    )
    assert branches(remote) == {"main"}
    assert branches(repo) == {"main"}


def test_delete_remote_of_a_branch_only_on_the_remote(repo, worktree, remote):
    git(worktree, "push", "-q", "origin", BRANCH)
    git(repo, "worktree", "remove", "--force", str(worktree))
    git(repo, "branch", "-D", BRANCH)
    result = cleanup_branch(repo, BRANCH, delete_remote=True)
    assert result == report(
        repo, remote="origin", remote_branch_found=True, remote_branch_deleted=True
    )
    assert branches(remote) == set()


def test_delete_remote_matches_the_exact_branch_only(repo, worktree, remote):
    """ls-remote's pattern "run-a1" would also match kxm/run-a1."""
    git(worktree, "push", "-q", "origin", BRANCH)
    result = cleanup_branch(repo, "run-a1", delete_remote=True)
    assert result == {
        **report(repo, remote="origin", remote_branch_found=False),
        "branch": "run-a1",
    }
    assert branches(remote) == {BRANCH}


def test_delete_remote_with_a_remote_name(repo, worktree, root):
    mirror = root / "mirror.git"
    git(root, "init", "-q", "--bare", str(mirror))
    git(repo, "remote", "add", "mirror", str(mirror))
    git(worktree, "push", "-q", "mirror", BRANCH)
    result = cleanup_branch(repo, BRANCH, delete_remote=True, remote="mirror")
    assert result["ok"] and result["remote"] == "mirror" and result["remote_branch_deleted"]
    assert branches(mirror) == set()


def test_an_unknown_remote_is_a_step_error_after_the_local_steps(repo, worktree):
    result = cleanup_branch(repo, BRANCH, delete_remote=True, remote="nowhere")
    error = result["errors"].pop("remote_branch")
    assert error.startswith("git ls-remote nowhere failed: ")
    assert result == report(
        repo,
        ok=False,
        worktree_removed=str(worktree),
        local_branch_found=True,
        local_branch_deleted=True,
        remote="nowhere",
    )
    assert branches(repo) == {"main"}


@pytest.mark.parametrize(("branch", "remote"), [("-D", "origin"), ("", "origin"), ("b", "--all")])
def test_names_git_would_read_as_options_are_refused(repo, branch, remote):
    with pytest.raises(ValueError, match="invalid"):
        cleanup_branch(repo, branch, delete_remote=True, remote=remote)


def test_cleanup_outside_a_repository(root):
    with pytest.raises(GitError, match="not a git repository"):
        cleanup_branch(root, BRANCH)


# --- towerctl branch cleanup -----------------------------------------------------------------


def towerctl(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """towerctl as a hook would run it: GIT_DIR and GIT_WORK_TREE point elsewhere."""
    env = clean_env(GIT_DIR=str(cwd / "bogus.git"), GIT_WORK_TREE=str(cwd / "bogus"))
    return subprocess.run(
        [TOWERCTL, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=30
    )


def test_towerctl_branch_cleanup_text(repo, worktree):
    done = towerctl(repo, "branch", "cleanup", BRANCH)
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout == (
        f"branch {BRANCH} in {repo}\n"
        f"  worktree: removed {worktree}\n"
        "  local branch: deleted\n"
        "  remote branch: left alone (no --delete-remote)\n"
    )
    assert not worktree.exists()
    assert branches(repo) == {"main"}


def test_towerctl_branch_cleanup_json_with_repo_and_remote(repo, worktree, remote, root):
    git(worktree, "push", "-q", "origin", BRANCH)
    done = towerctl(
        root, "--json", "branch", "cleanup", BRANCH, "--repo", str(worktree), "--delete-remote"
    )
    assert (done.returncode, done.stderr) == (0, "")
    assert json.loads(done.stdout) == report(
        worktree,
        worktree_removed=str(worktree),
        local_branch_found=True,
        local_branch_deleted=True,
        remote="origin",
        remote_branch_found=True,
        remote_branch_deleted=True,
    )
    assert branches(remote) == set()


def test_towerctl_branch_cleanup_failed_step_exits_1(repo, worktree):
    done = towerctl(repo, "branch", "cleanup", BRANCH, "--keep-worktree")
    assert done.returncode == 1
    lines = done.stdout.splitlines()
    assert lines[:2] == [f"branch {BRANCH} in {repo}", f"  worktree: kept {worktree}"]
    assert lines[2].startswith(f"  local branch: FAILED: git branch -D {BRANCH} failed: ")
    assert lines[3:] == ["  remote branch: left alone (no --delete-remote)"]
    assert branches(repo) == {"main", BRANCH}

    done = towerctl(repo, "--json", "branch", "cleanup", BRANCH, "--keep-worktree")
    assert done.returncode == 1
    assert set(json.loads(done.stdout)["errors"]) == {"local_branch"}


def test_towerctl_branch_cleanup_missing_branch_exits_0(repo, remote):
    done = towerctl(repo, "branch", "cleanup", "kxm/run-none", "--delete-remote")
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout == (
        f"branch kxm/run-none in {repo}\n"
        "  worktree: none has the branch checked out\n"
        "  local branch: not found\n"
        "  remote branch on origin: not found\n"
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "towerctl: branch cleanup: give the BRANCH to clean up\n"),
        ([BRANCH, "--remote", "x"], "towerctl: branch cleanup: --remote only applies with "),
        ([BRANCH, "--repo", "/"], "towerctl: branch cleanup: not a git repository: /"),
    ],
)
def test_towerctl_branch_cleanup_usage_errors(repo, args, message):
    done = towerctl(repo, "branch", "cleanup", *args)
    assert done.returncode == 2
    assert done.stderr.startswith(message)
    assert done.stdout == ""
