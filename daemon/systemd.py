"""The two halves of systemd integration, without libsystemd.

* ``notify``: a datagram to ``$NOTIFY_SOCKET`` (``@`` = abstract namespace):
  ``READY=1`` once reconciled and listening, ``STOPPING=1``, ``WATCHDOG=1``.
* ``listen_socket``: the listening socket systemd passes on fd 3 when
  ``$LISTEN_PID`` is this process and ``$LISTEN_FDS`` >= 1.

No maintained small library covers both (sdnotify dates from 2017, systemd-python
needs libsystemd's headers, cysystemd has no listen_fds), and each is a few lines
of the documented protocol.
"""

from __future__ import annotations

import os
import socket

SD_LISTEN_FDS_START = 3


def notify(message: str) -> bool:
    """Send one notification; False when not running under a notify socket."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        try:
            sock.sendto(message.encode(), address)
        except OSError:
            return False
    return True


def watchdog_interval() -> float | None:
    """Seconds between WATCHDOG=1 pings (half the configured timeout), or None."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return int(usec) / 2_000_000
    except ValueError:
        return None


def listen_socket() -> socket.socket | None:
    """The socket systemd passed us, or None when not socket-activated.

    The environment variables are removed so that child processes do not
    believe the socket is theirs.
    """
    pid, count = os.environ.get("LISTEN_PID"), os.environ.get("LISTEN_FDS")
    for name in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        os.environ.pop(name, None)
    if pid != str(os.getpid()) or not count or int(count) < 1:
        return None
    sock = socket.socket(fileno=SD_LISTEN_FDS_START)
    sock.set_inheritable(False)
    if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM:
        raise OSError(
            f"systemd passed a {sock.family!r}/{sock.type!r} socket, not a Unix stream socket"
        )
    return sock
