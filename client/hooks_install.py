"""Wire ``towerctl hook`` into Claude Code's and Codex's hook settings, take it out again,
and say how it stands: the logic of ``towerctl hooks install|uninstall|status`` and of
``towerctl doctor``'s hooks findings. Stdlib only; the CLI (towerd.client.cli.hooks)
is a thin layer over :func:`install`, :func:`uninstall` and :func:`hooks_status`.

Both agents read one shape, Claude Code from ``settings.json``, Codex from ``hooks.json``::

    {"hooks": {"<Event>": [{"matcher": "...", "hooks": [{"type": "command",
                                                          "command": "...", "timeout": 10}]}]}}

A matcher group without ``matcher`` matches every tool. towerd adds one such group per
event of ``AGENT_EVENTS[agent]``, holding its one handler. Its handlers are told from
the user's by their command alone (:func:`towerctl_subcommand`), never by position, so
every other key and entry of the file is the user's and is kept, in order.

A file is changed only whole: every file of a command line is read and checked first
(any one not valid refuses the lot, exit 65, nothing written), then each is replaced
atomically, the previous bytes kept beside it as ``<name>.towerd-backup``.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile

from towerd.client.agents import (
    AGENT_EVENTS,
    AGENTS,
    DEFAULT_GUARD,
    GUARD_POLICIES,
    HOOK_TIMEOUT_SECONDS,
    SCOPES,
)
from towerd.protocol import VERSION

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: the rest of towerctl avoids it too
if TYPE_CHECKING:
    from collections.abc import Iterable
    from typing import Any

__all__ = [
    "AGENT_CHOICES",
    "GUARD_POLICIES",
    "SCOPES",
    "STATES",
    "HooksError",
    "hook_command",
    "hooks_status",
    "install",
    "settings_path",
    "towerctl_path",
    "uninstall",
]

AGENT_CHOICES = ("all", *AGENTS)
BACKUP_SUFFIX = ".towerd-backup"
EX_DATAERR = 65  # sysexits.h: the settings file is not what an agent reads
EX_UNAVAILABLE = 69  # sysexits.h: no towerctl to wire in
EX_CANTCREAT = 73  # sysexits.h: the settings file is read-only
VERSION_TIMEOUT = 5.0  # seconds `<towerctl> --version` may take in status
HAND_WIRED_NOTE = "also wired by hand: towerctl hook-report (events recorded twice)"
CODEX_TRUST_HINT = (
    "Codex skips hooks the user has not trusted: in Codex, run /hooks, then trust them"
)

# An agent's verdict in ``hooks status`` (and ``towerctl doctor``), and how doctor rates
# it: not being installed is information, never a failure.
STATES = {
    "ok": "ok",
    "not_installed": "ok",
    "unverified": "ok",  # installed and runnable; the daemon could not be asked
    "installed_never_fired": "warning",
    "incomplete": "warning",
    "stale_version": "warning",
    "broken_command": "error",
    "invalid_file": "warning",  # the agent cannot read it either
}


class HooksError(Exception):
    """A hooks command refused or failed: reported as towerctl reports every error
    (``code``, ``message``, ``data``), exiting with ``exit_status``."""

    def __init__(
        self, code: str, message: str, data: dict[str, Any] | None = None, exit_status: int = 1
    ) -> None:
        super().__init__(message)
        self.code, self.message, self.data, self.exit_status = (
            code,
            message,
            data or {},
            exit_status,
        )

    def to_wire(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "data": self.data}


# --- where, and what -----------------------------------------------------------------------


def selected_agents(choice: str) -> tuple[str, ...]:
    """The agents ``--agent`` names (``all``: every agent towerd knows)."""
    return AGENTS if choice == "all" else (choice,)


def project_dir(project: str | None) -> str:
    """``--project`` as an absolute path (default: the current directory), so that the
    files reported and written do not depend on how it was spelled."""
    return os.path.abspath(project or os.getcwd())


def settings_path(agent: str, scope: str, project: str | None = None) -> str:
    """The file ``agent`` reads its hooks from in ``scope``: Claude Code's settings.json
    under ~/.claude or PROJECT/.claude; Codex's hooks.json under $CODEX_HOME (else
    ~/.codex) or PROJECT/.codex."""
    home = os.path.expanduser("~")
    if scope == "project":
        base = os.path.join(project_dir(project), f".{agent}")
    elif agent == "codex":
        base = os.path.abspath(os.environ.get("CODEX_HOME") or os.path.join(home, ".codex"))
    else:
        base = os.path.join(home, f".{agent}")
    return os.path.join(base, "hooks.json" if agent == "codex" else "settings.json")


def towerctl_path() -> str:
    """The absolute path of this installation's towerctl: hooks run through ``sh -c``
    without the venv on PATH, so the command must name it in full. The script beside
    this Python first (its venv's), else the one on PATH."""
    if sys.executable:
        beside = os.path.join(os.path.dirname(sys.executable), "towerctl")
        if os.path.isfile(beside) and os.access(beside, os.X_OK):
            return os.path.abspath(beside)
    found = shutil.which("towerctl")
    if found:
        return os.path.abspath(found)
    raise HooksError(
        "towerctl_not_found",
        f"no towerctl script beside {sys.executable or 'this Python'} nor on PATH: "
        "install towerd (pip install towerd) so that hooks have a towerctl to run",
        exit_status=EX_UNAVAILABLE,
    )


LAUNCHER = "_hook_launch.py"  # towerd/client/_hook_launch.py: towerctl without site
LAUNCHER_FLAGS = ("-I", "-S")


def hook_runner() -> list[str]:
    """What hooks run instead of the ``towerctl`` script: this installation's Python,
    ``-I -S``, and the launcher beside this module (``towerd/client/_hook_launch.py``).
    The same commands as towerctl, without ``site`` (an editable install's import
    finder, pip's script wrapper: ~10 ms a hook; bench/oneshot.py)."""
    if not sys.executable:
        raise HooksError(
            "python_not_found",
            "this Python does not know its own executable (sys.executable is empty): "
            "run towerctl hooks install from an installed towerd",
            exit_status=EX_UNAVAILABLE,
        )
    launcher = os.path.join(os.path.dirname(os.path.abspath(__file__)), LAUNCHER)
    return [sys.executable, *LAUNCHER_FLAGS, launcher]


def hook_command(agent: str, guard: str, runner: list[str] | str) -> str:
    """The command towerd wires for ``agent``: ``runner`` (:func:`hook_runner`, or a
    towerctl's path) then ``hook --agent AGENT``; ``--guard`` only when not the default,
    so that a default install reads plainly."""
    program = shlex.quote(runner) if isinstance(runner, str) else shlex.join(runner)
    command = f"{program} hook --agent {agent}"
    return command if guard == DEFAULT_GUARD else f"{command} --guard {guard}"


def towerd_group(command: str) -> dict[str, Any]:
    """The matcher group towerd appends to an event: no matcher (every tool), one handler."""
    return {"hooks": [{"type": "command", "command": command, "timeout": HOOK_TIMEOUT_SECONDS}]}


def handler_argv(handler: Any) -> list[str] | None:
    """A handler's command split as ``sh`` would, leading ``NAME=value`` assignments
    left out (``TOWERD_SOCKET=/x towerctl hook`` is still towerd's); None: not a command
    handler, or one shlex cannot split."""
    if not isinstance(handler, dict) or not isinstance(handler.get("command"), str):
        return None
    try:
        argv = shlex.split(handler["command"])
    except ValueError:
        return None
    while argv and _ASSIGNMENT.match(argv[0]):
        argv.pop(0)
    return argv


_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")


def towerctl_runner(argv: list[str]) -> int:
    """How many leading words of ``argv`` run towerctl: 1 for a ``towerctl`` script
    (``/venv/bin/towerctl hook``), 1 + flags + 1 for the launcher (``/venv/bin/python
    -I -S /.../towerd/client/_hook_launch.py hook``); 0 if it runs no towerctl."""
    if not argv:
        return 0
    program = os.path.basename(argv[0])
    if program == "towerctl":
        return 1
    if program.startswith("python"):
        index = 1
        while index < len(argv) and argv[index].startswith("-"):
            index += 1
        if index < len(argv) and os.path.basename(argv[index]) == LAUNCHER:
            return index + 1
    return 0


def towerctl_subcommand(handler: Any) -> str | None:
    """The towerctl command a handler runs (``hook``, ``hook-report``), None if it runs
    no towerctl. Any towerctl counts, whatever its directory (an install from another
    venv is still towerd's), as a ``towerctl`` script or as the launcher that
    ``install`` wires (:func:`hook_runner`)."""
    argv = handler_argv(handler)
    if argv is None:
        return None
    runner = towerctl_runner(argv)
    if not runner or len(argv) <= runner:
        return None
    return argv[runner]


def is_towerd_handler(handler: Any) -> bool:
    """Whether ``install`` wrote this handler (``towerctl hook ...``, exactly ``hook``:
    a hand-written ``towerctl hook-report`` is the user's)."""
    return towerctl_subcommand(handler) == "hook"


def group_handlers(group: Any) -> list[Any]:
    """A matcher group's handlers ([] for anything that is not a group: kept as it is)."""
    handlers = group.get("hooks") if isinstance(group, dict) else None
    return handlers if isinstance(handlers, list) else []


def all_handlers(data: dict[str, Any]) -> Iterable[tuple[str, Any]]:
    """(event, handler) for every handler of a checked settings object."""
    for event, groups in data.get("hooks", {}).items():
        for group in groups:
            for handler in group_handlers(group):
                yield event, handler


def file_notes(data: dict[str, Any]) -> list[str]:
    """What a person should know about a file's own entries."""
    hand_wired = any(towerctl_subcommand(h) == "hook-report" for _e, h in all_handlers(data))
    return [HAND_WIRED_NOTE] if hand_wired else []


# --- reading -------------------------------------------------------------------------------


def _json_type(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean"}
    if value is None:
        return "null"
    return names.get(type(value), "a number")


def _invalid(path: str, problem: str, **data: Any) -> HooksError:
    return HooksError(
        "hooks_file_invalid",
        f"{path}: {problem}; fix it by hand (towerd left it untouched)",
        {"path": path, **data},
        exit_status=EX_DATAERR,
    )


def check_shape(path: str, data: Any) -> dict[str, Any]:
    """``data`` if it has the shape both agents read (an object; ``hooks`` an object of
    lists), else refuse: rewriting a file the agent cannot read would lose what the user
    meant by it."""
    if not isinstance(data, dict):
        raise _invalid(path, f"the top level is {_json_type(data)}, not an object")
    hooks = data.get("hooks", {})
    if not isinstance(hooks, dict):
        raise _invalid(path, f'"hooks" is {_json_type(hooks)}, not an object')
    for event, groups in hooks.items():
        if not isinstance(groups, list):
            raise _invalid(path, f'"hooks"."{event}" is {_json_type(groups)}, not a list')
    return data


def load_settings(path: str) -> tuple[bytes | None, dict[str, Any]]:
    """(the file's bytes, its checked content); (None, {}) when there is no file. An
    empty file reads as ``{}``, as a freshly touched file means nothing yet."""
    try:
        with open(path, "rb") as handle:
            raw = handle.read()
    except FileNotFoundError:
        return None, {}
    except OSError as exc:
        raise HooksError(
            "hooks_file_unreadable", f"{path}: {exc.strerror}", {"path": path}
        ) from None
    if not raw.strip():
        return raw, {}
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise _invalid(
            path, f"not valid JSON: {exc}", line=exc.lineno, column=exc.colno, position=exc.pos
        ) from None
    except ValueError as exc:  # not UTF-8 (nor UTF-16/32)
        raise _invalid(path, f"not valid JSON text: {exc}") from None
    return raw, check_shape(path, data)


# --- merging -------------------------------------------------------------------------------


def without_towerd(groups: list[Any]) -> tuple[list[Any], int]:
    """(an event's matcher groups minus towerd's handlers, how many were taken out). A
    group only that removal emptied is dropped; every other group is kept as it was."""
    kept: list[Any] = []
    removed = 0
    for group in groups:
        handlers = group_handlers(group)
        rest = [handler for handler in handlers if not is_towerd_handler(handler)]
        if len(rest) == len(handlers):
            kept.append(group)
            continue
        removed += len(handlers) - len(rest)
        if rest:
            kept.append({**group, "hooks": rest})
    return kept, removed


def strip_towerd(hooks: dict[str, Any]) -> tuple[dict[str, Any], int, set[str]]:
    """(``hooks`` minus towerd's handlers, how many were taken out, the events whose list
    only that removal emptied). The emptied keys stay in place, so that an install that
    refills them keeps the file's order."""
    stripped: dict[str, Any] = {}
    removed = 0
    emptied: set[str] = set()
    for event, groups in hooks.items():
        stripped[event], count = without_towerd(groups)
        removed += count
        if count and not stripped[event]:
            emptied.add(event)
    return stripped, removed, emptied


def installed_data(data: dict[str, Any], agent: str, command: str) -> tuple[dict[str, Any], int]:
    """(``data`` with towerd's handlers replaced by one group running ``command`` at the end
    of each of ``agent``'s events, how many old handlers were replaced)."""
    hooks, replaced, emptied = strip_towerd(data.get("hooks", {}))
    for event in AGENT_EVENTS[agent]:
        hooks.setdefault(event, []).append(towerd_group(command))
        emptied.discard(event)
    for event in emptied:  # an event towerd no longer wires
        del hooks[event]
    return {**data, "hooks": hooks}, replaced


def uninstalled_data(data: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """(``data`` without towerd's handlers, how many there were). Drops only what that
    removal emptied: groups, event keys, and ``hooks`` itself, so that an install then an
    uninstall gives the user's data back."""
    if "hooks" not in data:
        return data, 0
    hooks, removed, emptied = strip_towerd(data["hooks"])
    if not removed:
        return data, 0
    for event in emptied:
        del hooks[event]
    if not hooks:
        return {key: value for key, value in data.items() if key != "hooks"}, removed
    return {**data, "hooks": hooks}, removed


def serialize(data: dict[str, Any]) -> bytes:
    """The file's new text: one stable form, so that reinstalling changes no byte."""
    return (json.dumps(data, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


# --- writing -------------------------------------------------------------------------------


def fsync_dir(directory: str) -> None:
    """Make a rename in ``directory`` durable (a crash after it keeps the new file)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: str, content: bytes, mode: int) -> None:
    """Replace ``path`` with ``content`` (permission bits ``mode``) so that a reader, or a
    crash, sees the old file or the new one, never half of one."""
    directory, name = os.path.split(path)
    fd, temp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as handle:
            os.fchmod(handle.fileno(), mode)
            handle.write(content)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, path)
    except BaseException:
        try:
            os.unlink(temp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(directory)


def save_settings(path: str, content: bytes, previous: bytes | None, scope: str) -> str | None:
    """Write ``content`` to the settings file whose bytes were ``previous`` (None: there
    was none); returns the backup of the previous bytes, if any. A symlinked file (a
    dotfiles checkout) keeps its link: its target is replaced. The file's permission
    bits are kept; a new one is private (0600), in a private directory for user scope."""
    target = os.path.realpath(path)
    try:
        if previous is None:
            directory_mode = 0o700 if scope == "user" else 0o777  # 0777: less the umask
            os.makedirs(os.path.dirname(target), mode=directory_mode, exist_ok=True)
            if os.path.lexists(target):
                raise HooksError(
                    "hooks_file_changed",
                    f"{path} appeared while towerctl was writing it: run the command again",
                    {"path": path},
                )
            write_atomically(target, content, 0o600)
            return None
        with open(target, "rb") as handle:
            if handle.read() != previous:
                raise HooksError(
                    "hooks_file_changed",
                    f"{path} changed while towerctl was writing it: run the command again",
                    {"path": path},
                )
        mode = stat.S_IMODE(os.stat(target).st_mode)
        if not mode & stat.S_IWUSR:
            raise HooksError(
                "hooks_file_read_only",
                f"{path} is read-only (mode {mode:o}): left as it is; make it writable "
                "(chmod u+w) to let towerctl change it",
                {"path": path, "mode": f"{mode:o}"},
                EX_CANTCREAT,
            )
        backup = target + BACKUP_SUFFIX
        write_atomically(backup, previous, mode)
        write_atomically(target, content, mode)
        return backup
    except OSError as exc:
        raise HooksError(
            "hooks_write_failed", f"{path}: {exc.strerror or exc}", {"path": path}
        ) from None


# --- install, uninstall --------------------------------------------------------------------


def install(agent: str, scope: str, project: str | None, guard: str) -> dict[str, Any]:
    """``towerctl hooks install``: every file read and checked before any is written."""
    runner = hook_runner()
    towerctl = shlex.join(runner)
    plans = []
    for name in selected_agents(agent):
        path = settings_path(name, scope, project)
        previous, data = load_settings(path)
        command = hook_command(name, guard, runner)
        new_data, replaced = installed_data(data, name, command)
        plans.append((name, path, previous, serialize(new_data), command, replaced, data))
    files = []
    for name, path, previous, content, command, replaced, data in plans:
        done = {
            "agent": name,
            "path": path,
            "command": command,
            "events": list(AGENT_EVENTS[name]),
            "replaced": replaced,
            "backup": None,
            "notes": file_notes(data),
        }
        if content == previous:
            done["change"] = "already_installed"
        else:
            done["change"] = "installed"
            done["backup"] = save_settings(path, content, previous, scope)
        files.append(done)
    return {
        "action": "install",
        "scope": scope,
        "guard": guard,
        "towerctl": towerctl,
        "files": files,
    }


def uninstall(agent: str, scope: str, project: str | None) -> dict[str, Any]:
    """``towerctl hooks uninstall``: towerd's handlers out, everything else kept."""
    plans = []
    for name in selected_agents(agent):
        path = settings_path(name, scope, project)
        previous, data = load_settings(path)
        plans.append((name, path, previous, data, *uninstalled_data(data)))
    files = []
    for name, path, previous, data, new_data, removed in plans:
        done: dict[str, Any] = {
            "agent": name,
            "path": path,
            "removed": removed,
            "backup": None,
            "notes": file_notes(data),
        }
        if previous is None:
            done["change"] = "no_file"
        elif not removed:
            done["change"] = "not_installed"
        else:
            done["change"] = "removed"
            done["backup"] = save_settings(path, serialize(new_data), previous, scope)
        files.append(done)
    return {"action": "uninstall", "scope": scope, "files": files}


# --- status --------------------------------------------------------------------------------


def check_command(command: str, agent: str, versions: dict[str, Any]) -> dict[str, Any]:
    """What an installed handler runs: its towerctl (resolved as ``sh`` would), whether
    that is an executable file and this version (``versions``: the answers so far, by
    path, so that each towerctl is asked once), its agent and guard policy, and what is
    wrong with it, if anything (``problem``)."""
    from towerd.client.agent_hook import options

    argv = handler_argv({"command": command}) or shlex.split(command)
    runner = towerctl_runner(argv)
    program = argv[0] if "/" in argv[0] else (shutil.which(argv[0]) or argv[0])
    hook_agent, guard, _socket = options(argv[runner + 1 :])
    prefix = [program, *argv[1:runner]]
    launcher = argv[runner - 1] if runner > 1 else None
    found: dict[str, Any] = {
        "command": command,
        "towerctl": shlex.join(prefix) if launcher else program,
        "agent": hook_agent,
        "guard": guard,
        "executable": os.path.isfile(program) and os.access(program, os.X_OK),
        "version": None,
        "problem": None,
        "stale": False,
    }
    if not found["executable"]:
        found["problem"] = f"{program} is not an executable file"
        return found
    if launcher is not None and not os.path.isfile(launcher):
        found["executable"] = False
        found["problem"] = f"{launcher} is not a file (towerd moved or uninstalled?)"
        return found
    shown = found["towerctl"]
    if shown not in versions:
        versions[shown] = towerctl_version(prefix)
    version, problem = versions[shown]
    found["version"] = version
    if problem:
        found["problem"] = problem
    elif version != VERSION:
        found["stale"] = True
    if hook_agent != agent:
        found["problem"] = f"runs as agent {hook_agent} in {agent}'s settings"
    return found


def towerctl_version(program: str | list[str]) -> tuple[str | None, str | None]:
    """(the version ``program --version`` prints, what went wrong running it);
    ``program``: a towerctl's path, or the words that run one (the launcher)."""
    argv = [program] if isinstance(program, str) else list(program)
    program = shlex.join(argv) if len(argv) > 1 else argv[0]
    try:
        done = subprocess.run(
            [*argv, "--version"],
            capture_output=True,
            text=True,
            timeout=VERSION_TIMEOUT,
            stdin=subprocess.DEVNULL,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return None, f"{program} --version did not answer within {VERSION_TIMEOUT:g} s"
    except OSError as exc:
        return None, f"{program} does not run: {exc.strerror or exc}"
    words = done.stdout.split()
    if done.returncode != 0 or len(words) != 2 or words[0] != "towerctl":
        return None, f"{program} --version exits {done.returncode}, printing {done.stdout!r}"
    return words[1], None


def file_status(agent: str, scope: str, path: str, versions: dict[str, Any]) -> dict[str, Any]:
    """One settings file as ``agent`` reads it: which of its events run towerd, with which
    commands, and what else a person should know."""
    found: dict[str, Any] = {
        "scope": scope,
        "path": path,
        "exists": False,
        "error": None,
        "wired": [],
        "missing": list(AGENT_EVENTS[agent]),
        "other_events": [],
        "commands": [],
        "notes": [],
    }
    try:
        raw, data = load_settings(path)
    except HooksError as exc:
        found["exists"] = os.path.lexists(path)
        found["error"] = exc.message
        return found
    found["exists"] = raw is not None
    wired: dict[str, None] = {}
    commands: dict[str, None] = {}
    for event, handler in all_handlers(data):
        if is_towerd_handler(handler):
            wired[event] = None
            commands[handler["command"]] = None
    found["wired"] = [event for event in AGENT_EVENTS[agent] if event in wired]
    found["missing"] = [event for event in AGENT_EVENTS[agent] if event not in wired]
    found["other_events"] = [event for event in wired if event not in AGENT_EVENTS[agent]]
    found["commands"] = [check_command(command, agent, versions) for command in commands]
    found["notes"] = file_notes(data)
    return found


def agent_scopes(agent: str, project: str | None) -> list[tuple[str, str]]:
    """(scope, file) for ``agent``: the user's, and the project's unless it is the same
    file (a project at $HOME)."""
    user = settings_path(agent, "user")
    scopes = [("user", user)]
    project_file = settings_path(agent, "project", project)
    if os.path.realpath(project_file) != os.path.realpath(user):
        scopes.append(("project", project_file))
    return scopes


def agent_status(
    agent: str,
    project: str | None,
    last_seen: list[dict[str, Any]] | None,
    versions: dict[str, Any],
) -> dict[str, Any]:
    """How ``agent``'s hooks stand: its files, each event's last arrival (``last_seen``:
    the daemon's ``event.last_seen`` kinds, None if it could not be asked) and a verdict,
    ``state`` (one of ``STATES``) with ``detail`` and ``fix``."""
    scopes = agent_scopes(agent, project)
    files = [file_status(agent, scope, path, versions) for scope, path in scopes]
    seen = {row["kind"]: row for row in last_seen or [] if row.get("agent") == agent}
    wired = {event for found in files for event in found["wired"]}
    kinds = [*AGENT_EVENTS[agent], *(kind for kind in seen if kind not in AGENT_EVENTS[agent])]
    events = [event_row(kind, kind in wired, seen.get(kind)) for kind in kinds]
    notes = [f"{found['path']}: {note}" for found in files for note in found["notes"]]
    if sum(1 for found in files if found["wired"]) > 1:
        notes.append("wired in both user and project scope: each event is recorded twice")
    state, detail, fix = _verdict(agent, files, wired, seen, last_seen is not None)
    hint = CODEX_TRUST_HINT if agent == "codex" and state == "installed_never_fired" else None
    return {
        "agent": agent,
        "state": state,
        "detail": detail,
        "fix": fix,
        "installed": bool(wired),
        "never_fired": bool(wired) and last_seen is not None and not seen,
        "files": files,
        "events": events,
        "notes": notes,
        "hint": hint,
    }


def event_row(kind: str, wired: bool, seen: dict[str, Any] | None) -> dict[str, Any]:
    """One event kind of an agent: wired or not, when it last arrived and how many the
    daemon's trail keeps (last_at None: none has)."""
    return {
        "event": kind,
        "wired": wired,
        "last_at": seen["last_at"] if seen else None,
        "count": seen["count"] if seen else 0,
    }


def _verdict(
    agent: str,
    files: list[dict[str, Any]],
    wired: set[str],
    seen: dict[str, Any],
    asked: bool,
) -> tuple[str, str, str]:
    """(state, detail, fix): the worst thing about ``agent``'s hooks, first come first."""
    reinstall = f"towerctl hooks install --agent {agent}"
    invalid = [found for found in files if found["error"]]
    if invalid:
        return "invalid_file", invalid[0]["error"], f"fix the file, then `{reinstall}`"
    if not wired:
        return "not_installed", "not installed", f"`{reinstall}` wires them"
    commands = [command for found in files for command in found["commands"]]
    broken = [command for command in commands if command["problem"]]
    if broken:
        return "broken_command", broken[0]["problem"], f"`{reinstall}` (with the scope it was in)"
    stale = [command for command in commands if command["stale"]]
    if stale:
        return (
            "stale_version",
            f"{stale[0]['towerctl']} is towerctl {stale[0]['version']}, this is {VERSION}",
            f"`{reinstall}` to run this version",
        )
    missing = [event for event in AGENT_EVENTS[agent] if event not in wired]
    if missing:
        return "incomplete", f"not wired: {', '.join(missing)}", f"`{reinstall}`"
    if not asked:
        return "unverified", "installed; the daemon could not be asked what arrived", ""
    if not seen:
        fix = f"start a {agent} session; " + (
            CODEX_TRUST_HINT if agent == "codex" else "check `claude --debug` for hook errors"
        )
        return "installed_never_fired", "installed but never fired: no event has arrived", fix
    kind, row = max(seen.items(), key=lambda item: item[1]["last_at"])
    return "ok", f"installed; last event {kind} at {_when(row['last_at'])}", ""


def _when(millis: int) -> str:
    import time

    return time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(millis / 1000))


def hooks_status(
    agents: Iterable[str], project: str | None, last_seen: list[dict[str, Any]] | None
) -> dict[str, Any]:
    """``towerctl hooks status``: every agent's verdict, keyed by agent."""
    versions: dict[str, Any] = {}
    return {
        "project": project_dir(project),
        "agents": {agent: agent_status(agent, project, last_seen, versions) for agent in agents},
    }
