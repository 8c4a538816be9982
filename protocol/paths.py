"""Where the daemon listens and keeps its state, when nobody says otherwise.

Shared by the daemon and the clients so both agree without configuration:
``TOWERD_SOCKET`` / ``TOWERD_STATE_DIR`` win, then the XDG directories, then
per-user fallbacks. Plain strings and ``os.path``: hooks import this, and
pathlib would cost them a few milliseconds.

Without ``XDG_RUNTIME_DIR`` the socket goes in the user's own state home
(``$XDG_STATE_HOME/towerd``, else ``~/.local/state/towerd``), never in a shared
``/tmp``: a guessable directory there can be made first by another user, who then
answers in towerd's place or keeps it from starting. It does not follow
``TOWERD_STATE_DIR``, so a daemon and a client given different state dirs still meet
on one socket. ``/run/user/<uid>`` is not guessed either: logind removes it at the
last logout, so a daemon and a later client could disagree about it.
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
    return os.path.join(_default_state_home(), "towerd", SOCKET_NAME)


def default_state_dir() -> str:
    explicit = os.environ.get("TOWERD_STATE_DIR")
    if explicit:
        return explicit
    return os.path.join(_default_state_home(), "towerd")


def _default_state_home() -> str:
    """``$XDG_STATE_HOME``, else ``~/.local/state``."""
    state_home = os.environ.get("XDG_STATE_HOME")
    if state_home:
        return state_home
    return os.path.join(os.path.expanduser("~"), ".local", "state")
