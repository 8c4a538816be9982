"""``backup`` into a directory other users can reach: nothing another local user
pre-creates there is ever opened, so they get no byte of the database and cannot
redirect the copy; a directory where they could swap files, and a target that is a
symlink or someone else's file, are refused with nothing written. A backup into
towerd's own state directory, by any path to it, is refused too: it could replace the
live database or its WAL.

The other user is real: ``nobody``, through setpriv. The database holds a marker (a
session's name) that is searched for in every file the attacker can read.
"""

from __future__ import annotations

import json
import os
import sqlite3
import stat
import subprocess
import uuid
from pathlib import Path

import pytest

from towerd_testing import towerctl

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="another uid needs root")

NOBODY = 65534
SQLITE_SIDE_SUFFIXES = ("-journal", "-wal", "-shm")


def as_nobody(script: str) -> None:
    """Run a shell script as the user nobody (umask 0, so what it creates is 0666)."""
    subprocess.run(
        ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
        + ["sh", "-euc", f"umask 0; {script}"],
        check=True,
        timeout=30,
    )


def shared_directory(parent: Path, name: str, mode: int) -> Path:
    """A directory of root's with ``mode`` in a parent nobody can traverse."""
    parent.chmod(0o755)
    directory = parent / name
    directory.mkdir()
    directory.chmod(mode)
    return directory


def store_marker(daemon) -> bytes:
    marker = f"marker-{uuid.uuid4()}"
    with daemon.client() as client:
        client.session_register(cwd="/r", agent="a", name=marker)
    return marker.encode()


def backup(daemon, target: Path, *extra: str) -> dict:
    result = towerctl(daemon, "--json", "backup", str(target), *extra)
    return json.loads(result.stdout) | {"exit": result.returncode}


def guessable_names(name: str, pid: int) -> list[str]:
    """Every name the old backup or SQLite opened beside the target (or could)."""
    partial = f".{name}.partial-{pid}"
    return [partial] + [base + side for base in (partial, name) for side in SQLITE_SIDE_SUFFIXES]


def plant(directory: Path, name: str, pid: int, *, partial_as_symlink_to: Path | None) -> None:
    """As nobody: pre-create every guessable name as a 0666 file (the partial one as a
    symlink to a file of nobody's, if asked), and keep a hard link to each file, so
    whatever is written into those inodes stays readable even if renamed away."""
    names = guessable_names(name, pid)
    lines = []
    for planted in names:
        if planted == names[0] and partial_as_symlink_to is not None:
            lines.append(f"ln -s '{partial_as_symlink_to}' '{directory / planted}'")
        else:
            lines.append(f": > '{directory / planted}'")
            lines.append(f"ln '{directory / planted}' '{directory / ('kept' + planted)}'")
    as_nobody("; ".join(lines))


def attackers_files(*directories: Path) -> dict[Path, bytes]:
    """The content of every regular file nobody owns in ``directories``."""
    found = {}
    for directory in directories:
        for path in directory.iterdir():
            info = path.lstat()
            if info.st_uid == NOBODY and stat.S_ISREG(info.st_mode):
                found[path] = path.read_bytes()
    return found


def assert_private_checked_copy(target: Path, marker: bytes) -> None:
    info = target.lstat()
    assert stat.S_ISREG(info.st_mode), f"{target} is not a regular file"
    assert info.st_uid == os.geteuid(), f"{target} belongs to uid {info.st_uid}"
    assert stat.S_IMODE(info.st_mode) == 0o600, oct(info.st_mode)
    assert marker in target.read_bytes()  # the marker is searchable: the search means something
    copy = sqlite3.connect(f"file:{target}?mode=ro", uri=True)
    try:
        assert copy.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        assert copy.execute("PRAGMA journal_mode").fetchone() == ("delete",)
    finally:
        copy.close()


@needs_root
def test_backup_in_a_sticky_shared_directory_ignores_every_planted_name(daemon, short_tmp):
    """In a 1777 directory where nobody pre-created the partial file (as a 0666 file for
    one target, as a symlink to its own file for the other) and every SQLite side file
    name: both backups succeed, each a 0600 regular file of ours passing integrity_check,
    nobody's files hold no byte of the database, and no private directory is left."""
    marker = store_marker(daemon)
    shared = shared_directory(short_tmp, "shared", 0o1777)
    loot = shared / "loot"
    as_nobody(f": > '{loot}'")
    plant(shared, "a.db", daemon.pid, partial_as_symlink_to=None)
    plant(shared, "b.db", daemon.pid, partial_as_symlink_to=loot)
    planted = attackers_files(shared)
    assert len(planted) == 1 + 2 * 7 + 2 * 6  # loot; a.db's 7 names, b.db's 6 files, linked
    names_before = {path.name for path in shared.iterdir()}

    answers = [backup(daemon, shared / name) for name in ("a.db", "b.db")]

    after = attackers_files(shared)
    leaks = [str(path) for path, content in after.items() if marker in content or content]
    assert not leaks, f"nobody's files were written to: {leaks}"
    assert after.keys() == planted.keys(), "a planted file was renamed, removed or added"
    for name, answer in zip(("a.db", "b.db"), answers, strict=True):
        assert answer["exit"] == 0 and answer["integrity"] == ["ok"], answer
        assert_private_checked_copy(shared / name, marker)
    left_behind = {path.name for path in shared.iterdir()} - names_before - {"a.db", "b.db"}
    assert not left_behind, f"left behind: {left_behind}"


@needs_root
@pytest.mark.parametrize("danger", ["world-writable, not sticky", "owned by another user"])
def test_backup_into_a_directory_others_can_swap_is_refused(daemon, short_tmp, danger):
    """A 0777 directory without the sticky bit, or one that nobody owns: bad_args saying
    why and what to do, and nothing written there."""
    store_marker(daemon)
    if danger == "world-writable, not sticky":
        directory = shared_directory(short_tmp, "open", 0o777)
    else:
        directory = shared_directory(short_tmp, "theirs", 0o755)
        os.chown(directory, NOBODY, NOBODY)
    answer = backup(daemon, directory / "copy.db")
    assert answer["exit"] == 1
    assert answer["error"]["code"] == "bad_args", answer
    message = answer["error"]["message"]
    assert str(directory) in message and "back up into a directory only you" in message
    assert list(directory.iterdir()) == []


@needs_root
@pytest.mark.parametrize(
    "target_kind", ["nobody's symlink", "nobody's file", "our own symlink", "a directory"]
)
def test_backup_refuses_a_target_that_is_not_a_regular_file_of_ours(daemon, short_tmp, target_kind):
    """Even with --overwrite, a target that is a symlink (whoever made it: it is never
    followed), another user's file or a directory is refused with bad_args and left as
    it was; what a symlink points to is untouched."""
    shared = shared_directory(short_tmp, "shared", 0o1777)
    target = shared / "copy.db"
    pointed_to = shared / "pointed-to"
    if target_kind == "nobody's symlink":
        as_nobody(f": > '{pointed_to}'; ln -s '{pointed_to}' '{target}'")
    elif target_kind == "nobody's file":
        as_nobody(f": > '{target}'")
    elif target_kind == "our own symlink":
        pointed_to.write_bytes(b"")
        target.symlink_to(pointed_to)
    else:
        target.mkdir()
    before = {path.name: (path.lstat(), path.is_file()) for path in shared.iterdir()}

    answer = backup(daemon, target, "--overwrite")
    assert answer["exit"] == 1
    assert answer["error"]["code"] == "bad_args", answer
    assert str(target) in answer["error"]["message"]
    after = {path.name: (path.lstat(), path.is_file()) for path in shared.iterdir()}
    assert after.keys() == before.keys()
    for name, (info, _) in before.items():
        assert after[name][0].st_ino == info.st_ino and after[name][0].st_uid == info.st_uid
    if pointed_to.exists():
        assert pointed_to.read_bytes() == b""


def state_files(daemon) -> dict[str, int]:
    """The state dir's entries and their inodes."""
    return {path.name: path.lstat().st_ino for path in daemon.state_dir.iterdir()}


@pytest.fixture
def bind_mounted(short_tmp):
    """Mounts a directory at a second path (``bind(directory)`` -> the new path); all
    are unmounted at the end."""
    mounted: list[Path] = []

    def bind(directory: Path) -> Path:
        if os.geteuid() != 0:
            pytest.skip("a bind mount needs root")
        mountpoint = short_tmp / f"bound{len(mounted)}"
        mountpoint.mkdir()
        subprocess.run(["mount", "--bind", str(directory), str(mountpoint)], check=True)
        mounted.append(mountpoint)
        return mountpoint

    yield bind
    for mountpoint in reversed(mounted):
        subprocess.run(["umount", str(mountpoint)], check=True)


@pytest.mark.parametrize("name", ["towerd.db-wal", "towerd.db"])
@pytest.mark.parametrize("via", ["the state dir", "a symlinked parent", "a bind mount"])
def test_backup_into_the_state_directory_is_refused(daemon, short_tmp, bind_mounted, name, via):
    """``backup STATE/towerd.db-wal --overwrite`` (or the database itself), also through
    a symlink to the state dir or a bind mount of it, once replaced the live file and the
    daemon stopped (exit 78): now bad_args saying why, nothing created or replaced, and
    the daemon still answers and writes."""
    marker = store_marker(daemon)
    if via == "the state dir":
        directory = daemon.state_dir
    elif via == "a symlinked parent":
        directory = short_tmp / "state-link"
        directory.symlink_to(daemon.state_dir)
    else:
        directory = bind_mounted(daemon.state_dir)
    before = state_files(daemon)
    assert {"towerd.db", "towerd.db-wal"} <= before.keys()

    answer = backup(daemon, directory / name, "--overwrite")

    assert answer["exit"] == 1
    assert answer["error"]["code"] == "bad_args", answer
    message = answer["error"]["message"]
    assert "state directory" in message and "replace the live database" in message, message
    assert state_files(daemon) == before, "an entry of the state dir was created or replaced"
    assert towerctl(daemon, "ping").returncode == 0
    with daemon.client() as client:
        client.session_register(cwd="/r", agent="a", name="after")
        names = {row["name"] for row in client.iter_fleet()}
    assert {marker.decode(), "after"} <= names
    assert daemon.proc is not None and daemon.proc.poll() is None


def test_backup_into_the_state_dirs_backups_directory_is_allowed(daemon):
    """The refusal is of the state dir itself: its ``backups`` subdirectory, where the
    refusal suggests to go, still takes a backup."""
    marker = store_marker(daemon)
    backups = daemon.state_dir / "backups"
    backups.mkdir(mode=0o700, exist_ok=True)
    answer = backup(daemon, backups / "copy.db")
    assert answer["exit"] == 0 and answer["integrity"] == ["ok"], answer
    assert_private_checked_copy(backups / "copy.db", marker)
