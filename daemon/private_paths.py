"""Directories and files only this user may touch: created private, refused otherwise.

towerd's state dir and socket dir hold everything another local user must
never read or replace. A path that is a symlink, belongs to another uid, or
is open to group or others is refused with the fix in the message, rather
than repaired behind the operator's back.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


class StartRefused(Exception):
    """towerd cannot start safely; the message says why and what to do."""


def ensure_private_dir(path: Path, what: str) -> Path:
    """Create ``path`` 0700 if missing, else check it is a private directory of ours."""
    if not path.is_absolute():
        path = Path.cwd() / path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise StartRefused(f"cannot create the {what} {path}: {exc.strerror}") from None
    check_private(path, what, want_dir=True)
    return path


def check_private(path: Path, what: str, *, want_dir: bool) -> None:
    """Refuse a symlink, a path of another uid, or one open to group/others."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISLNK(info.st_mode):
        raise StartRefused(f"the {what} {path} is a symlink; towerd refuses to follow it")
    kind_ok = stat.S_ISDIR(info.st_mode) if want_dir else stat.S_ISREG(info.st_mode)
    if not kind_ok:
        kind = "directory" if want_dir else "regular file"
        raise StartRefused(f"the {what} {path} is not a {kind}")
    if info.st_uid != os.geteuid():
        raise StartRefused(
            f"the {what} {path} belongs to uid {info.st_uid}, not to this user "
            f"(uid {os.geteuid()}); use a directory of your own"
        )
    if info.st_mode & 0o077:
        raise StartRefused(
            f"the {what} {path} has mode {stat.S_IMODE(info.st_mode):04o}, open to other "
            f"users; run `chmod {'700' if want_dir else '600'} {path}`"
        )
