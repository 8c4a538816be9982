"""Where the daemon listens and keeps its state, when nobody says otherwise.

Shared by the daemon and the clients so both agree without configuration:
``TOWERD_SOCKET`` / ``TOWERD_STATE_DIR`` win, then the XDG directories, then
per-user fallbacks. Plain strings and ``os.path``: hooks import this, and
pathlib would cost them a few milliseconds.
"""

from __future__ import annotations

import os

SOCKET_NAME = "towerd.sock"


def default_socket_path() -> str:
    explicit = os.environ.get("TOWERD_SOCKET")
    if explicit:
        return explicit
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return os.path.join(runtime, "towerd", SOCKET_NAME)
    return os.path.join(f"/tmp/towerd-{os.geteuid()}", SOCKET_NAME)


def default_state_dir() -> str:
    explicit = os.environ.get("TOWERD_STATE_DIR")
    if explicit:
        return explicit
    state_home = os.environ.get("XDG_STATE_HOME")
    if state_home:
        return os.path.join(state_home, "towerd")
    return os.path.join(os.path.expanduser("~"), ".local", "state", "towerd")
