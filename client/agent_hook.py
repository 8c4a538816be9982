"""``towerctl hook``: the command ``towerctl hooks install`` wires into an agent.

It records the hook's event as ``hook-report`` does (same budget, same rules: exit
0 whatever happens, nothing on stdout or stderr but a decision) and, in the same
single ``hook.event`` call, keeps the fleet (a session the daemon does not know is
registered; SessionEnd marks it exited) and guards edits: a PreToolUse of a tool
that writes files names its target paths (real paths, relative ones taken from the
payload's cwd), which the daemon leases to the session unless another live session
holds one; the PostToolUse after the edit holds them for the idle TTL (an edit that
never ran holds them two minutes). When a path is held, under ``--guard deny`` (the
default) the agent is told with its documented deny decision, whose reason names the
holder; under ``--guard warn`` the call is allowed and the agent told through
``additionalContext``; ``--guard off`` guards nothing. An allowed call prints
nothing: never an "allow" decision, which would skip the user's own permission prompt.

The agent is this process's nearest ancestor that is not a shell
(client/agents.py): its pid (with its start time, read by the daemon) is the
session's liveness and the holder of its path leases.

Fail open: no daemon, a hung daemon, a stale socket, garbage, an unknown tool, a
daemon too old for ``hook.event`` (then the event is recorded as hook-report would).
"""

from __future__ import annotations

import os
import sys
import time

from towerd.client import hook_report
from towerd.client.agents import (
    AGENTS,
    DEFAULT_GUARD,
    GUARD_POLICIES,
    agent_process,
    as_node_writes,
    edit_targets,
    resolve,
)

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs hooks ~3 ms
if TYPE_CHECKING:
    from typing import Any

# Characters of a path the daemon takes (protocol/schema/agents.py MAX_PATH_CHARS: not
# imported, hooks stay off msgspec's schema; tests/client/test_agent_payloads.py checks).
MAX_PATH = 4095
MAX_TEXT = 4096  # characters of a transcript path or a model name
MAX_PATHS = 256  # paths guarded per tool call (protocol/schema/agents.py MAX_PATHS)
# PreToolUse leases the paths (pending); PostToolUse, after the edit ran, holds them on.
GUARDED_KINDS = ("PreToolUse", "PostToolUse")


def options(argv: list[str]) -> tuple[str, str, str | None]:
    """(agent, guard, socket) from ``hook``'s command line; anything unknown is ignored
    (a hook never fails on its own command line)."""
    found: dict[str, str | None] = {"--agent": "claude", "--guard": DEFAULT_GUARD, "--socket": None}
    index = 0
    while index < len(argv):
        name, equals, value = argv[index].partition("=")
        index += 1
        if name in found:
            if not equals:
                if index == len(argv):
                    break
                value = argv[index]
                index += 1
            found[name] = value
    agent, guard = found["--agent"] or "", found["--guard"] or ""
    return (
        agent if agent in AGENTS else "claude",
        guard if guard in GUARD_POLICIES else DEFAULT_GUARD,
        found["--socket"],
    )


def run(argv: list[str]) -> int:
    """Handle the hook event on stdin; always returns 0; prints a decision or nothing."""
    agent, guard, socket_path = options(argv)
    saved = sys.stdout, sys.stderr
    sys.stdout = sys.stderr = hook_report._Null()
    decision = b""
    try:
        decision = _hook(socket_path, agent, guard, time.monotonic() + hook_report.DEADLINE)
    except BaseException:  # noqa: BLE001, S110 - a hook must never fail, not even on Ctrl-C
        pass
    finally:
        sys.stdout, sys.stderr = saved
    if decision:
        try:
            os.write(1, decision)
        except OSError:
            pass
    return 0


def _text(value: Any, limit: int = MAX_TEXT) -> str | None:
    ok = isinstance(value, str) and 0 < len(value) <= limit
    return as_node_writes(value) if ok else None


def _hook(socket_path: str | None, agent: str, guard: str, deadline: float) -> bytes:
    data = hook_report._read_stdin(deadline)
    if not data:
        return b""
    try:
        hook = hook_report.parse_json(data)
    except (ValueError, StopIteration, RecursionError):
        return b""
    if not isinstance(hook, dict):
        return b""
    kind = hook.get("hook_event_name")
    if not isinstance(kind, str) or not 0 < len(kind) <= hook_report.MAX_KIND:
        return b""
    agent_session_id = _text(hook.get("session_id"), hook_report.MAX_AGENT_SESSION_ID)
    session_id = hook_report._session_from_env()
    if session_id is None and agent_session_id is None:
        return b""
    cwd = _text(hook.get("cwd"), MAX_PATH)
    if cwd is not None and not cwd.startswith("/"):
        cwd = None
    paths: list[str] = []
    if kind in GUARDED_KINDS and guard != "off":
        targets = edit_targets(agent, hook) or []
        # An existing directory is no file an edit writes (the tool fails on it): never
        # leased from a hook, or one bad call would hold a whole tree.
        paths = [
            path
            for path in _resolved(targets[:MAX_PATHS], cwd)
            if path.startswith("/") and len(path) <= MAX_PATH and not os.path.isdir(path)
        ]
    params: dict[str, Any] = {"kind": kind, "agent": agent}
    for name, value in (
        ("session_id", session_id),
        ("agent_session_id", agent_session_id),
        ("agent_pid", agent_process()),
        ("cwd", cwd),
        ("transcript_path", _text(hook.get("transcript_path"))),
        ("model", _text(hook.get("model"))),
    ):
        if value is not None:
            params[name] = value
    if paths:
        params["paths"] = paths
        params["guard"] = guard

    from towerd.client.sync import Client
    from towerd.protocol import lite
    from towerd.protocol.errors import BadArgs, UnknownMethod

    params["payload"] = hook_report.compact(hook, lite.packb)
    client = Client(
        socket_path, timeout=hook_report._left(deadline), client_name=f"hook/{os.getpid()}",
        codec="lite",
    )  # fmt: skip
    try:
        try:
            result = _send(client, deadline, params)
        except BadArgs:
            # A payload the daemon refuses (a lower --event-max-payload): the scalars only.
            size = len(lite.packb(params["payload"]))
            params["payload"] = hook_report.top_level_scalars(hook, size, lite.packb)
            result = _send(client, deadline, params)
        except UnknownMethod:  # a daemon older than hook.event: record the event only
            client.timeout = hook_report._left(deadline)
            client.event_record(
                kind, session_id=session_id, agent_session_id=agent_session_id,
                payload=params["payload"],
            )  # fmt: skip
            return b""
    finally:
        client.close()
    return decision_output(result)


def _resolved(targets: list[str], cwd: str | None) -> list[str]:
    """Each target's real path; one with a NUL (no tool opens it) is left out alone."""
    found = []
    for target in targets:
        try:
            found.append(resolve(as_node_writes(target), cwd))
        except ValueError:
            continue
    return found


def _send(client: Any, deadline: float, params: dict[str, Any]) -> Any:
    client.timeout = hook_report._left(deadline)  # bounds the whole call
    return client.call("hook.event", params)


def decision_output(result: dict[str, Any]) -> bytes:
    """What the agent reads on stdout: its documented PreToolUse output (Claude Code's,
    which Codex takes too), or nothing for an allowed call."""
    decision, reason = result.get("decision", "allow"), result.get("reason") or ""
    if decision == "deny":
        fields = {
            "hookEventName": "PreToolUse",
            "permissionDecision": "deny",
            "permissionDecisionReason": reason,
        }
    elif decision == "warn":
        fields = {"hookEventName": "PreToolUse", "additionalContext": reason}
    else:
        return b""
    inner = ", ".join(
        f"{_json_string(key)}: {_json_string(value)}" for key, value in fields.items()
    )
    return ('{"hookSpecificOutput": {' + inner + "}}\n").encode("ascii")


def _json_string(text: str) -> str:
    """A JSON string (ASCII, escaped) without importing the json package (~1.5 ms)."""
    try:
        from _json import encode_basestring_ascii
    except ImportError:  # not CPython
        import json

        return json.dumps(text)
    return encode_basestring_ascii(text)
