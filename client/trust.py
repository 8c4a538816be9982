"""Is the listener at a socket path this user's own towerd? Checked before a byte is sent.

Another local user can listen where a client expects towerd (a directory it made in
a shared ``/tmp``, or one left open to others) and answer like towerd: a forged
``completed`` makes a step be skipped, a forged ``claimed`` makes it run on every
retry, and every hook payload (prompts included) goes to that user. So every client
connects only through a socket directory that is this user's alone (owned by the
effective uid, no group or other permission bits, not a symlink: ``os.lstat``), and
talks only to a listener whose ``SO_PEERCRED`` uid, read right after connecting, is
the same uid. Anything else is ``Unauthorized``, naming the path and who owns it.

Both the blocking and the async client call these. Stdlib only, and cheap (one
``lstat``, one ``getsockopt``): every agent hook pays for them.
"""

from __future__ import annotations

import _socket  # the C module: socket.py imports enum, selectors, collections (~4 ms a hook)
import errno
import os
import stat
import struct

from towerd.protocol.errors import Unauthorized

_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def check_socket_dir(socket_path: str) -> None:
    """Raise ``Unauthorized`` unless the directory holding ``socket_path`` is a private
    directory of this user's. ``OSError`` (no such directory...) is left to the caller,
    which reports it as a failure to connect."""
    if socket_path.startswith("\0"):
        return  # Linux abstract socket: no directory; the peer check alone applies
    directory = os.path.dirname(socket_path) or "."
    info = os.lstat(directory)
    me = os.geteuid()
    mode = stat.S_IMODE(info.st_mode)
    if stat.S_ISLNK(info.st_mode):
        problem = "is a symlink"
    elif not stat.S_ISDIR(info.st_mode):
        problem = "is not a directory"
    elif info.st_uid != me:
        problem = f"is not this user's (uid {me})"
    elif mode & 0o077:
        problem = "is open to other users"
    else:
        return
    shown = os.path.abspath(directory)
    fix = "Use a socket in a directory of your own with mode 0700 (towerd creates one)"
    if info.st_uid == me and stat.S_ISDIR(info.st_mode):
        fix = f"Run `chmod 700 {shown}`"
    raise Unauthorized(
        f"refusing the towerd socket {socket_path}: its directory {shown} (owner uid "
        f"{info.st_uid}, mode {mode:04o}) {problem}, so another user may be answering in "
        f"towerd's place; nothing was sent. {fix}",
        {
            "socket": socket_path,
            "directory": shown,
            "owner_uid": info.st_uid,
            "mode": f"{mode:04o}",
            "reason": "socket_dir",
        },
    )


def check_peer(sock: _socket.socket, socket_path: str) -> None:
    """Raise ``Unauthorized`` unless the process that listens on the connected ``sock``
    runs as this user (the kernel's record of the listener, not anything it says);
    ``OSError`` if ``sock`` turns out not to be connected at all."""
    pid, uid, _gid = _PEERCRED.unpack(
        sock.getsockopt(_socket.SOL_SOCKET, _socket.SO_PEERCRED, _PEERCRED.size)
    )
    me = os.geteuid()
    if uid == me:
        return
    if uid == -1:  # no credentials: not connected (asyncio takes EAGAIN, a full backlog, for done)
        raise ConnectionRefusedError(
            errno.EAGAIN, "the listener did not take the connection (its backlog may be full)"
        )
    raise Unauthorized(
        f"refusing the towerd socket {socket_path}: the process listening there "
        f"(pid {pid}) runs as uid {uid}, not as this user (uid {me}), so it is not "
        "your towerd; nothing was sent. Stop it, or point --socket / TOWERD_SOCKET "
        "at your own daemon's socket",
        {"socket": socket_path, "peer_uid": uid, "peer_pid": pid, "reason": "peer_uid"},
    )
