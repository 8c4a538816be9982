"""What towerd knows of the agents whose hooks it is: declared once (stdlib only).

``hooks install`` wires ``AGENT_EVENTS`` into each agent's settings, ``hooks status``
checks them, and ``towerctl hook`` reads a hook's payload with ``edit_targets`` and
finds the agent's process with ``agent_process``. A hook imports this module: it
costs nothing beyond ``os``.
"""

from __future__ import annotations

import os

from towerd.protocol.fields import AGENTS, GUARD_POLICIES

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs hooks ~3 ms
if TYPE_CHECKING:
    from typing import Any

__all__ = ["AGENTS", "AGENT_EVENTS", "GUARD_POLICIES", "agent_process", "edit_targets"]

DEFAULT_GUARD = "deny"
SCOPES = ("user", "project")  # whose settings hooks install writes: the user's, a project's

# The hook events towerd wires, per agent, in the order they are written. Claude Code's
# are its documented hook events that report a session's life or its attention; Codex's
# are those its hooks.json offers (it has no SessionEnd or Notification).
AGENT_EVENTS: dict[str, tuple[str, ...]] = {
    "claude": (
        "SessionStart",
        "UserPromptSubmit",
        "PreToolUse",
        "PostToolUse",
        "Notification",
        "Stop",
        "SubagentStop",
        "PreCompact",
        "SessionEnd",
    ),
    "codex": (
        "SessionStart",
        "UserPromptSubmit",
        "PreToolUse",
        "PermissionRequest",
        "PostToolUse",
        "PreCompact",
        "PostCompact",
        "Stop",
    ),
}
HOOK_TIMEOUT_SECONDS = 10  # the timeout written into each entry; the hook itself stops at 2 s

# The processes a hook runs through between the agent and towerctl.
SHELLS = frozenset({"sh", "bash", "dash", "zsh", "fish", "env", "timeout"})
MAX_ANCESTORS = 64

# Tools that write files, and where their payload names the file.
_CLAUDE_PATH_FIELDS = {
    "Edit": "file_path",
    "MultiEdit": "file_path",
    "Write": "file_path",
    "NotebookEdit": "notebook_path",
}
_CODEX_PATCH_TOOLS = frozenset({"apply_patch", "Edit", "Write"})  # Edit/Write: its aliases
# Codex's patch markers (codex-rs apply-patch, parser.rs).
_ADD, _DELETE, _UPDATE, _MOVE = (
    "*** Add File: ", "*** Delete File: ", "*** Update File: ", "*** Move to: "
)  # fmt: skip
_END_OF_FILE = "*** End of File"
_HEREDOC_OPENERS = ("<<EOF", "<<'EOF'", '<<"EOF"')  # its lenient mode's wrapper
# What Rust's str::trim removes (Unicode White_Space). Python's str.strip() also takes
# \x1c-\x1f, and str.splitlines() also breaks at \x0b, \x0c, \x1c-\x1e, \x85, \u2028,
# \u2029 and a lone \r: reading a patch with those, towerd lost a `*** Move to:` line
# Codex applies (another session's file moved onto without a lease).
_RUST_WHITESPACE = (
    "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007"
    "\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000"
)
MAX_TARGETS = 256  # paths guarded per tool call at most (a larger patch guards its first 256)


def edit_targets(agent: str, hook: dict[str, Any]) -> list[str] | None:
    """The paths a PreToolUse payload's tool is about to write, as given (maybe relative
    to the payload's cwd); None when the tool writes no file (or is unknown)."""
    tool = hook.get("tool_name")
    tool_input = hook.get("tool_input")
    if not isinstance(tool, str) or not isinstance(tool_input, dict):
        return None
    field = _CLAUDE_PATH_FIELDS.get(tool)
    path = tool_input.get(field) if field is not None else None
    if isinstance(path, str) and path and "\0" not in path:
        return [path]
    patch = tool_input.get("command") or tool_input.get("patch") or tool_input.get("input")
    if tool in _CODEX_PATCH_TOOLS or (isinstance(patch, str) and patch.startswith("*** Begin")):
        if not isinstance(patch, str):
            return None
        paths = [path for path in dict.fromkeys(patch_paths(patch)) if path and "\0" not in path]
        return paths[:MAX_TARGETS] or None
    return None


def patch_paths(patch: str) -> list[str]:
    """The files a Codex patch writes, read the way Codex's own parser reads them, so that
    the path guarded is the file Codex will write. A hunk header is its line with the
    whitespace around it trimmed, and the path is all that follows the marker: spaces at
    its start are part of the name (" a.py" is not "a.py"). ``*** Move to: `` counts only
    on the line right after an Update header, untrimmed. Lines inside a hunk (an added
    file's ``+`` lines, an update's chunk lines up to the next line starting with ``*``
    other than ``*** End of File``) are content, never headers, even when they read like
    one. Checked once against codex-rs's own parser, built from its source, on 60,000
    generated patches (16,817 of them valid to Codex): no path Codex writes was missed,
    none added."""
    lines = _rust_lines(patch.strip(_RUST_WHITESPACE))
    if len(lines) >= 4 and lines[0] in _HEREDOC_OPENERS and lines[-1].endswith("EOF"):
        lines = lines[1:-1]
    paths: list[str] = []
    index = 0
    while index < len(lines):
        header = lines[index].strip(_RUST_WHITESPACE)
        index += 1
        if header.startswith(_ADD):
            paths.append(header[len(_ADD) :])
            while index < len(lines) and lines[index].startswith("+"):
                index += 1
        elif header.startswith(_DELETE):
            paths.append(header[len(_DELETE) :])
        elif header.startswith(_UPDATE):
            paths.append(header[len(_UPDATE) :])
            if index < len(lines) and lines[index].startswith(_MOVE):
                paths.append(lines[index][len(_MOVE) :])
                index += 1
            # Its chunks: up to a line starting with "*", their "*** End of File" lines
            # included (Codex consumes that marker as the end of a chunk).
            while index < len(lines) and (
                not lines[index].startswith("*") or lines[index] == _END_OF_FILE
            ):
                index += 1
    return paths


def _rust_lines(text: str) -> list[str]:
    """``text``'s lines as Rust's ``str::lines`` gives them: split at ``\\n`` only, one
    ``\\r`` before it dropped, no empty last line after a final newline."""
    *ended, last = text.split("\n")
    lines = [line[:-1] if line.endswith("\r") else line for line in ended]
    return [*lines, last] if last else lines


def resolve(path: str, cwd: str | None) -> str:
    """``path``'s real path as towerd names it (:func:`wire_path`), relative paths taken
    from ``cwd`` (the agent's; None: this process's). ValueError for a NUL in it."""
    if not os.path.isabs(path) and cwd:
        path = os.path.join(cwd, path)
    return wire_path(os.path.realpath(path))


def as_node_writes(text: str) -> str:
    """``text`` from a hook's JSON, where half of a UTF-16 pair (``"\\ud800"``) is
    valid and Python keeps it as a lone surrogate, which no UTF-8 encoder takes (the
    whole hook then failed open): each becomes U+FFFD, as Node (Claude Code) spells
    it in a file name it writes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    return text


def wire_path(path: str) -> str:
    """``path`` as UTF-8 text, which the protocol carries. A name that is not UTF-8 (its
    bytes kept by Python as surrogate escapes) is spelled with a backslash escape per
    byte that is not (``caf\\xe9``): the hook and ``towerctl claim`` spell it alike, and
    a file literally named so shares its lease (contention, never a miss). Such a path
    used to fail the whole hook open, every path of the call unguarded."""
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        try:
            raw = path.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:  # a lone surrogate no file name can hold
            return as_node_writes(path)
        return raw.decode("utf-8", "backslashreplace")
    return path


def _comm_and_parent(pid: int) -> tuple[str, int] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            data = handle.read()
    except OSError:
        return None
    name = data[data.index(b"(") + 1 : data.rindex(b")")].decode("utf-8", "replace")
    return name, int(data[data.rindex(b")") + 2 :].split()[1])


def agent_process(start: int | None = None) -> int | None:
    """The pid of the agent a hook (or an agent's shell command) runs under: the nearest
    ancestor of this process, from ``start`` (default: the parent) up, that is not a
    shell (``SHELLS``); None when there is none below pid 1."""
    pid = os.getppid() if start is None else start
    for _ in range(MAX_ANCESTORS):
        if pid <= 1:
            return None
        found = _comm_and_parent(pid)
        if found is None:
            return None
        name, parent = found
        if name not in SHELLS:
            return pid
        pid = parent
    return None
