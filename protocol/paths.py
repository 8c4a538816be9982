"""Where the daemon listens and keeps its state, when nobody says otherwise.

Shared by the daemon and the clients so both agree without configuration:
``TOWERD_SOCKET`` / ``TOWERD_STATE_DIR`` win, then the XDG directories, then
per-user fallbacks.
"""

from __future__ import annotations

import os
from pathlib import Path

SOCKET_NAME = "towerd.sock"


def default_socket_path() -> Path:
    explicit = os.environ.get("TOWERD_SOCKET")
    if explicit:
        return Path(explicit)
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / "towerd" / SOCKET_NAME
    return Path(f"/tmp/towerd-{os.geteuid()}") / SOCKET_NAME


def default_state_dir() -> Path:
    explicit = os.environ.get("TOWERD_STATE_DIR")
    if explicit:
        return Path(explicit)
    state_home = os.environ.get("XDG_STATE_HOME")
    if state_home:
        return Path(state_home) / "towerd"
    return Path.home() / ".local" / "state" / "towerd"
