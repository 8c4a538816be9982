"""``towerctl``: drive towerd from a shell or a hook.

Global options go before or after the command: ``--socket``, ``--json``,
``--principal``, ``--timeout`` (not after the ``--`` of ``run``, ``effect run`` and
``lock worktree``: what follows is the command's). With ``--json`` the result is
printed as JSON on stdout, and an error, a usage error included (code ``usage``), as
``{"error": {"code", "message", "data"}}`` on stdout; without it, readable text on
stdout and errors on stderr.

Text for a terminal goes through :func:`printable`: a stored name, cwd or message may
hold escape sequences, and printing them raw would let whoever wrote them move the
cursor, retitle the window or break a table. JSON output is exact (``json.dumps``
escapes every control character).

Exit status: 0 success, 1 the daemon answered an error, 2 bad usage,
3 the daemon could not be reached. ``run``, ``effect run`` and ``lock worktree``
exit with their command's status, or one of their own (see ``EXIT_EPILOG``):
120 the outcome is unknown or uncertain (a person must decide; CMD was not run),
121 in progress, in flight or held elsewhere (CMD was not run: retry later),
126/127 CMD could not be executed / was not found (nothing ran).

Runs inside hooks on every agent event, so it imports only the blocking
client (no anyio, structlog or aiosqlite).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from towerd.client.entry import hook_report_socket, scan
from towerd.client.sync import Client
from towerd.protocol import VERSION
from towerd.protocol.errors import TowerdError, Unavailable
from towerd.protocol.fields import IDEM_STATES, SESSION_FIELDS

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_UNAVAILABLE = 0, 1, 2, 3
# run, effect run, lock worktree: their statuses are in towerd.client.exactly_once
EXIT_EPILOG = (
    "exit status: 0 ok, 1 the daemon answered an error, 2 bad usage, "
    "3 the daemon could not be reached; run, effect run and lock worktree exit with "
    "CMD's own status, or 120 the outcome is unknown or uncertain (a person must decide; "
    "CMD was not run), 121 in progress, in flight or held elsewhere (CMD was not run; "
    "retry later), 126/127 CMD could not be executed / was not found (nothing ran). "
    "CMD's own status may be any of these: use --json to tell them apart"
)

# The wire's enumerations (towerd.protocol.methods has them as Literals, but importing it
# pulls in msgspec); tests/client/test_cli_parser.py keeps these in step.
KV_SCOPES = ("global", "worker", "milestone")
WORKER_STATUSES = ("active", "stopping", "crashed")
DISPATCH_STATUSES = ("claimed", "running", "completed", "failed", "stuck", "canceled", "paused")
AUDIT_CATEGORIES = ("worker", "lease", "dispatch")
AUDIT_PAGE = 500  # the most events one audit.list call returns

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs hooks ~3 ms
if TYPE_CHECKING:
    from collections.abc import Callable, Sequence
    from typing import Any, NoReturn

    Command = Callable[[Client, argparse.Namespace], Any]


def _json() -> Any:
    """json on demand: it pulls in re, which a plain `towerctl ping` does not need."""
    import json

    return json


class UsageError(Exception):
    """Bad command-line input that argparse cannot see (invalid JSON, unreadable file)."""


class BadCommandLine(Exception):
    """argparse refused the command line: ``parser`` (the command's) says how to call it."""

    def __init__(self, parser: argparse.ArgumentParser, message: str) -> None:
        super().__init__(message)
        self.parser = parser
        self.message = message


class LocalFailure(Exception):
    """An offline command failed on this machine (no daemon involved): reported like a
    daemon error, ``code``, ``message``, ``data``; exit 1."""

    def __init__(self, code: str, message: str, data: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.data = code, message, data or {}

    def to_wire(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "data": self.data}


class Unhealthy(Exception):
    """An offline command's report says something failed (doctor found a problem, a
    branch cleanup step failed): print the report as usual, exit 1."""

    def __init__(self, result: dict[str, Any]) -> None:
        super().__init__("the report says something failed")
        self.result = result


# --- argument helpers ------------------------------------------------------------------


def _json_arg(text: str | None, what: str) -> Any:
    if text is None:
        return None
    try:
        return _json().loads(text)
    except ValueError as exc:
        raise UsageError(f"{what} is not valid JSON: {exc}") from None


_SESSION_TEXT_FIELDS = [
    name
    for name in SESSION_FIELDS
    if name not in ("pinned", "exited", "last_attached_at", "cwd", "agent")
]


def _add_session_field_options(parser: argparse.ArgumentParser, *, for_update: bool) -> None:
    for name in _SESSION_TEXT_FIELDS:
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, default=None)
    if for_update:
        parser.add_argument("--cwd", default=None)
        parser.add_argument("--agent", default=None)
    parser.add_argument(
        "--last-attached-at",
        dest="last_attached_at",
        type=int,
        default=None,
        metavar="MILLIS",
        help="milliseconds since the Unix epoch",
    )
    parser.add_argument("--pinned", action=argparse.BooleanOptionalAction, default=None)
    parser.add_argument("--exited", action=argparse.BooleanOptionalAction, default=None)


def _session_fields(args: argparse.Namespace) -> dict[str, Any]:
    return {
        name: getattr(args, name)
        for name in SESSION_FIELDS
        if name not in ("cwd", "agent") and getattr(args, name, None) is not None
    }


# --- commands ----------------------------------------------------------------------------


def cmd_session_register(client: Client, args: argparse.Namespace) -> Any:
    return client.session_register(
        cwd=args.cwd,
        agent=args.agent,
        session_id=args.session_id,
        idempotency_key=args.idempotency_key,
        **_session_fields(args),
    )


def cmd_session_update(client: Client, args: argparse.Namespace) -> Any:
    fields = _session_fields(args)
    for name in ("cwd", "agent"):
        if getattr(args, name) is not None:
            fields[name] = getattr(args, name)
    for name in args.clear:
        fields[name] = None
    if not fields:
        raise UsageError("nothing to update: give at least one field option or --clear FIELD")
    return client.session_update(args.session_id, **fields)


def cmd_fleet_list(client: Client, args: argparse.Namespace) -> Any:
    if args.limit is not None:
        return client.fleet_list(limit=args.limit, cursor=args.cursor)
    return {"sessions": list(client.iter_fleet())}


def cmd_fleet_import_legacy(client: Client, args: argparse.Namespace) -> Any:
    path = args.legacy_file
    try:
        with open(path, encoding="utf-8") as legacy:
            entries = _json().loads(legacy.read())
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}") from None
    except ValueError as exc:
        raise UsageError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(entries, list):
        raise UsageError(f"{path} must hold a JSON array of fleet entries")
    return client.fleet_import_legacy(entries)


def cmd_idem_claim(client: Client, args: argparse.Namespace) -> Any:
    return client.idem_claim(
        args.operation,
        args.key,
        payload=_json_arg(args.payload, "--payload"),
        effect_ref=args.effect_ref,
        # A CLI process exits right after claiming: by default the key is held by
        # the shell (or program) that ran us, which does the effect.
        holder_pid=args.holder_pid if args.holder_pid is not None else os.getppid(),
        replay_only=args.replay_only,
        attempt=args.attempt,
    )


def cmd_idem_list(client: Client, args: argparse.Namespace) -> Any:
    if args.limit is not None:
        return client.idem_list(
            state=args.state, operation=args.operation, limit=args.limit, cursor=args.cursor
        )
    keys = []
    cursor = None
    while True:
        page = client.idem_list(state=args.state, operation=args.operation, cursor=cursor)
        keys += page["keys"]
        cursor = page.get("next_cursor")
        if cursor is None:
            return {"keys": keys}


def cmd_backup(client: Client, args: argparse.Namespace) -> Any:
    return client.backup(os.path.abspath(args.path), overwrite=args.overwrite)


def cmd_doctor(_client: None, args: argparse.Namespace) -> Any:
    from pathlib import Path

    from towerd.client.doctor import examine

    result = examine(
        Path(args.socket) if args.socket else None,
        Path(args.state_dir) if args.state_dir else None,
        args.principal,
        args.full,
    )
    if not result["ok"]:
        raise Unhealthy(result)
    return result


def cmd_install_systemd(_client: None, args: argparse.Namespace) -> Any:
    from pathlib import Path

    from towerd.client.systemd_units import SystemctlFailed, install_units

    try:
        return install_units(Path(args.dir) if args.dir else None, enable=args.enable)
    except SystemctlFailed as exc:
        raise LocalFailure("systemctl_failed", str(exc), exc.data()) from None


def cmd_branch_cleanup(_client: None, args: argparse.Namespace) -> Any:
    from towerd.client.git_tools import GitError, cleanup_branch

    if args.branch is None:
        # Optional in the parser only so that every command parses with no arguments.
        raise UsageError("branch cleanup: give the BRANCH to clean up")
    if args.remote is not None and not args.delete_remote:
        raise UsageError("branch cleanup: --remote only applies with --delete-remote")
    try:
        result = cleanup_branch(
            args.repo,
            args.branch,
            keep_worktree=args.keep_worktree,
            delete_remote=args.delete_remote,
            remote=args.remote or "origin",
        )
    except (GitError, ValueError) as exc:
        raise UsageError(f"branch cleanup: {exc}") from None
    if not result["ok"]:
        raise Unhealthy(result)
    return result


def cmd_run(_client: None, args: argparse.Namespace) -> int:
    from towerd.client.exactly_once import shell_run

    return shell_run(args)


def cmd_effect_run(_client: None, args: argparse.Namespace) -> int:
    from towerd.client.exactly_once import effect_run

    return effect_run(args)


def cmd_lock_worktree(_client: None, args: argparse.Namespace) -> int:
    from towerd.client.locks import lock_worktree

    return lock_worktree(args)


def cmd_effects_list(client: Client, args: argparse.Namespace) -> Any:
    if args.run_id is None:
        # Optional in the parser only so that every command parses with no arguments.
        raise UsageError("effects list: give the RUN_ID whose effects to list")
    return client.effect_list(args.run_id)


def cmd_idem_reopen(client: Client, args: argparse.Namespace) -> Any:
    """Reopen the outcome as it is now: the daemon refuses if it changed meanwhile."""
    record = client.idem_get(args.operation, args.key)
    return client.idem_reopen(args.operation, args.key, record.get("result"), reason=args.reason)


def cmd_effects_resolve(client: Client, args: argparse.Namespace) -> Any:
    if args.effect_key is None or args.outcome is None:
        raise UsageError(
            "effects resolve: give the effect KEY and --outcome committed (it happened) "
            "or --outcome aborted (it did not)"
        )
    return client.effect_resolve(
        args.effect_key, args.outcome, _json_arg(args.receipt, "--receipt")
    )


def _positive(text: str) -> int:
    """An argparse type: an integer >= 1 (a bad one is a usage error, exit 2)."""
    try:
        number = int(text)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, not {text!r}")
    return number


def cmd_kv_set(client: Client, args: argparse.Namespace) -> Any:
    value = _json_arg(args.value, "VALUE_JSON")
    return client.kv_set(args.scope, args.key, value, scope_id=args.scope_id)


def cmd_kv_list(client: Client, args: argparse.Namespace) -> Any:
    entries: list[Any] = []
    after = None
    while True:
        page = client.kv_list(args.scope, scope_id=args.scope_id, after=after)
        entries += page["entries"]
        after = page.get("next_after")
        if after is None:
            return {"entries": entries}


def cmd_workers(client: Client, args: argparse.Namespace) -> Any:
    root = os.path.abspath(args.project_root) if args.project_root is not None else None
    return client.worker_list(status=args.status, project_root=root)


def cmd_dispatch_list(client: Client, args: argparse.Namespace) -> Any:
    return client.dispatch_list(
        unit_type=args.unit_type,
        unit_id=args.unit_id,
        milestone_id=args.milestone,
        status=args.status,
        worker_id=args.worker,
        limit=args.limit,
    )


def cmd_dispatch_stuck(client: Client, args: argparse.Namespace) -> Any:
    root = os.path.realpath(args.project_root if args.project_root is not None else os.getcwd())
    return client.dispatch_stuck_report(root, window=args.window)


def cmd_audit(client: Client, args: argparse.Namespace) -> Any:
    """The newest ``--limit`` matching events (newest first), over as many pages as that
    takes; ``next_before`` continues with ``--before``."""
    events: list[Any] = []
    before = args.before
    while len(events) < args.limit:
        page = client.audit_list(
            category=args.category,
            type=args.type,
            trace_id=args.trace_id,
            before=before,
            limit=min(args.limit - len(events), AUDIT_PAGE),
        )
        events += page["events"]
        before = page.get("next_before")
        if before is None or not page["events"]:
            break
    return {"events": events, "next_before": before}


# --- output ------------------------------------------------------------------------------


def printable(text: str) -> str:
    """``text`` safe for a terminal: each character that is not printable (C0 controls
    such as ESC, BEL, CR, backspace, newline and tab; DEL; C1 controls; Unicode format
    characters such as bidi overrides; lone surrogates) is shown as its Python escape,
    ``\\x1b``, ``\\n``, ``\\u202e``: it can move no cursor and break no table, and it is
    seen rather than silently dropped. A byte that was not UTF-8 (on the command line,
    in a path) shows as itself, ``\\xff``."""
    if text.isprintable():
        return text
    return "".join(char if char.isprintable() else _escaped(char) for char in text)


def _escaped(char: str) -> str:
    if "\udc80" <= char <= "\udcff":  # how Python hands over an undecodable byte
        return f"\\x{ord(char) - 0xDC00:02x}"
    return ascii(char)[1:-1]


def printable_lines(text: str) -> str:
    """:func:`printable` for a rendered block: its own line breaks are kept."""
    return "\n".join(printable(line) for line in text.split("\n"))


def say(text: str, *, to_stderr: bool = False) -> None:
    """Print text for a person: every text-mode line towerctl prints goes through here."""
    print(printable_lines(text), file=sys.stderr if to_stderr else sys.stdout)


def dumps_json(value: Any, **options: Any) -> str:
    """JSON for stdout: exact, and safe for a terminal as it is (with ``ensure_ascii``,
    json.dumps escapes every character outside printable ASCII, controls included)."""
    return _json().dumps(value, default=_jsonable, **options)


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes | bytearray):
        import base64

        return base64.b64encode(value).decode()
    raise TypeError(f"cannot show {type(value).__name__} as JSON")


def _is_time(key: str) -> bool:
    """Fields holding milliseconds since the epoch, shown as UTC times."""
    return isinstance(key, str) and (key.endswith("_at") or key in ("ts", "at"))


def _when(millis: Any) -> str:
    if not isinstance(millis, int):
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(millis / 1000))


def _cell(value: Any) -> str:
    """A value as one line of a table or of ``key: value`` lines (a stored newline is
    shown as ``\\n``, so it cannot start a row of its own)."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, dict | list):
        return dumps_json(value, sort_keys=True)
    return printable(str(value))


def _table(rows: list[dict[str, Any]], columns: Sequence[tuple[str, str]]) -> str:
    cells = [[title for _key, title in columns]]
    for row in rows:
        cells.append(
            [_when(row.get(key)) if _is_time(key) else _cell(row.get(key)) for key, _ in columns]
        )
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    return "\n".join(
        "  ".join(text.ljust(width) for text, width in zip(line, widths, strict=True)).rstrip()
        for line in cells
    )


def _pairs(mapping: dict[str, Any], indent: str = "") -> str:
    lines = []
    for key, value in mapping.items():
        name = _cell(key)
        if isinstance(value, dict) and value:
            lines.append(f"{indent}{name}:")
            lines.append(_pairs(value, indent + "  "))
        else:
            shown = _when(value) if _is_time(key) else _cell(value)
            lines.append(f"{indent}{name}: {shown}")
    return "\n".join(lines)


def render(result: Any) -> str:
    """The default: nested ``key: value`` lines."""
    return _pairs(result) if isinstance(result, dict) else _cell(result)


def render_fleet(result: dict[str, Any]) -> str:
    text = _table(
        result["sessions"],
        [
            ("session_id", "SESSION"),
            ("name", "NAME"),
            ("agent", "AGENT"),
            ("parent", "PARENT"),
            ("pinned", "PINNED"),
            ("exited", "EXITED"),
            ("cwd", "CWD"),
            ("updated_at", "UPDATED"),
        ],
    )
    cursor = result.get("next_cursor")
    return text + (f"\nnext cursor: {cursor}" if cursor is not None else "")


def render_keys(result: dict[str, Any]) -> str:
    text = _table(
        result["keys"],
        [
            ("operation", "OPERATION"),
            ("key", "KEY"),
            ("state", "STATE"),
            ("effect_ref", "EFFECT_REF"),
            ("updated_at", "UPDATED"),
        ],
    )
    cursor = result.get("next_cursor")
    return text + (f"\nnext cursor: {cursor}" if cursor is not None else "")


def render_import(result: dict[str, Any]) -> str:
    lines = [f"imported {result['imported']}, skipped {result['skipped']}"]
    lines += [f"  {row['agent_session_id']} -> {row['session_id']}" for row in result["sessions"]]
    lines += [
        f"  skipped entry {skip['index']}"
        + (f" ({skip['agent_session_id']})" if skip.get("agent_session_id") else "")
        + f": {skip['reason']}"
        for skip in result["skips"]
    ]
    return "\n".join(lines)


def render_effects(result: dict[str, Any]) -> str:
    rows = [
        {**effect, "updated_at": effect.get("completed_at") or effect.get("heartbeat_at")}
        for effect in result["effects"]
    ]
    return _table(
        rows,
        [
            ("effect_key", "EFFECT_KEY"),
            ("action_kind", "KIND"),
            ("target_ref", "TARGET"),
            ("status", "STATUS"),
            ("attempt_id", "ATTEMPT"),
            ("updated_at", "UPDATED"),
        ],
    )


def render_leases(result: dict[str, Any]) -> str:
    return _table(
        result["leases"],
        [
            ("resource", "RESOURCE"),
            ("fencing_token", "TOKEN"),
            ("holder", "HOLDER"),
            ("acquired_at", "ACQUIRED"),
            ("expires_at", "EXPIRES"),
        ],
    )


def _clip(text: str, width: int = 60) -> str:
    """One line of at most ``width`` characters (whitespace runs become one space)."""
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


def _value_json(value: Any) -> str:
    return dumps_json(value, sort_keys=True)


def render_kv_value(result: dict[str, Any]) -> str:
    """``kv get``: the value alone, as JSON, for scripts."""
    return _value_json(result["value"])


def render_kv_entry(result: dict[str, Any]) -> str:
    return _pairs({**result, "value": _value_json(result["value"])})


def render_kv_list(result: dict[str, Any]) -> str:
    rows = [
        {"key": entry["key"], "updated_at": entry["updated_at"],
         "value": _clip(_value_json(entry["value"]))}
        for entry in result["entries"]
    ]  # fmt: skip
    return _table(rows, [("key", "KEY"), ("updated_at", "UPDATED"), ("value", "VALUE")])


def render_workers(result: dict[str, Any]) -> str:
    return _table(
        result["workers"],
        [
            ("worker_id", "WORKER"),
            ("status", "STATUS"),
            ("pid", "PID"),
            ("host", "HOST"),
            ("project_root", "PROJECT"),
            ("heartbeat_at", "HEARTBEAT"),
            ("end_reason", "ENDED_REASON"),
        ],
    )


def _dispatch_reason(row: dict[str, Any]) -> str | None:
    """Why it ended: the error of a failed attempt, else its exit reason."""
    error = [part for part in (row.get("error_code"), row.get("error_summary")) if part]
    if error:
        return _clip(": ".join(error))
    reason = row.get("exit_reason")
    return _clip(reason) if reason else None


def render_dispatches(result: dict[str, Any]) -> str:
    rows = [
        {
            **row,
            "attempt": f"{row['attempt_n']}/{row['max_attempts']}",
            "reason": _dispatch_reason(row),
        }
        for row in result["dispatches"]
    ]
    return _table(
        rows,
        [
            ("dispatch_id", "ID"),
            ("unit_key", "UNIT"),
            ("status", "STATUS"),
            ("attempt", "ATTEMPT"),
            ("worker_id", "WORKER"),
            ("claimed_at", "CLAIMED"),
            ("reason", "EXIT_REASON/ERROR"),
        ],
    )


def render_stuck(result: dict[str, Any]) -> str:
    def line(verdict: dict[str, Any]) -> str:
        return f"{verdict['rule']} {verdict['unit_key']} \u2014 {verdict['reason']}"

    verdict = result["verdict"]
    lines = [f"stuck: {line(verdict)}" if verdict is not None else "not stuck"]
    lines += [f"suppressed (a retry is scheduled): {line(held)}" for held in result["suppressed"]]
    lines.append(f"window: {len(result['window'])} recent dispatches")
    return "\n".join(lines)


def render_audit(result: dict[str, Any]) -> str:
    text = _table(
        result["events"],
        [
            ("seq", "SEQ"),
            ("ts", "TS"),
            ("category", "CATEGORY"),
            ("type", "TYPE"),
            ("actor", "ACTOR"),
            ("trace_id", "TRACE"),
        ],
    )
    before = result.get("next_before")
    return text + (f"\nmore: --before {before}" if before is not None else "")


def render_pong(_result: Any) -> str:
    return "pong"


def render_branch_cleanup(result: dict[str, Any]) -> str:
    """One line per step: what was done, found absent, skipped, or failed."""
    errors = result["errors"]
    lines = [f"branch {result['branch']} in {result['repo']}"]
    if "worktree" in errors:
        worktree = f"FAILED: {errors['worktree']}"
    elif result["worktree_removed"]:
        worktree = f"removed {result['worktree_removed']}"
    elif result["worktree_kept"]:
        worktree = f"kept {result['worktree_kept']}"
    else:
        worktree = "none has the branch checked out"
    lines.append(f"  worktree: {worktree}")
    if "local_branch" in errors:
        local = f"FAILED: {errors['local_branch']}"
    else:
        local = "deleted" if result["local_branch_deleted"] else "not found"
    lines.append(f"  local branch: {local}")
    if result["remote"] is None:
        lines.append("  remote branch: left alone (no --delete-remote)")
    else:
        if "remote_branch" in errors:
            remote = f"FAILED: {errors['remote_branch']}"
        else:
            remote = "deleted" if result["remote_branch_deleted"] else "not found"
        lines.append(f"  remote branch on {result['remote']}: {remote}")
    return "\n".join(lines)


def render_doctor(result: dict[str, Any]) -> str:
    from towerd.client.doctor import render as render_report

    return render_report(result)


# --- the parser --------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse's parser, raising :class:`BadCommandLine` instead of printing and exiting,
    so that main() can report the error as JSON under ``--json``."""

    def error(self, message: str) -> NoReturn:
        raise BadCommandLine(self, message)


class _Formatter(argparse.HelpFormatter):
    """argparse's formatter, minus its `import shutil` (bz2, lzma, ...: ~2 ms per hook):
    argparse builds a formatter for every add_argument, and the default one imports
    shutil to measure the terminal."""

    def __init__(self, prog: str) -> None:
        try:
            columns = os.get_terminal_size(sys.stderr.fileno()).columns
        except (OSError, ValueError):
            columns = int(os.environ.get("COLUMNS", "80") or 80)
        super().__init__(prog, width=max(columns - 2, 40))


# Every command path; main() builds only the parser of the one on the command line
# (building all ~40 costs ~4 ms of a hook's budget). A test keeps this in step.
COMMAND_PATHS = frozenset(
    {
        ("ping",), ("status",), ("shutdown",), ("backup",), ("doctor",), ("install-systemd",),
        ("branch", "cleanup"),
        ("fleet", "list"), ("fleet", "get"), ("fleet", "import-legacy"), ("fleet", "adopt"),
        ("session", "register"), ("session", "update"), ("session", "remove"),
        ("idem", "claim"), ("idem", "complete"), ("idem", "release"), ("idem", "mark-unknown"),
        ("idem", "get"), ("idem", "resolve"), ("idem", "reopen"), ("idem", "list"),
        ("run",), ("effect", "run"), ("lock", "worktree"),
        ("effects", "list"), ("effects", "resolve"), ("leases",),
        ("kv", "get"), ("kv", "set"), ("kv", "delete"), ("kv", "list"), ("workers",),
        ("dispatch", "list"), ("dispatch", "get"), ("dispatch", "stuck"), ("audit",),
        ("hook-report",), ("events", "list"), ("events", "tail"), ("fleet", "restore-plan"),
        ("message", "send"), ("message", "list"), ("message", "ack"), ("top",),
    }
)  # fmt: skip


def command_path(argv: Sequence[str]) -> tuple[str, ...] | None:
    """The command the arguments name, if plain enough to tell without argparse (an
    option other than a global one before the command, such as --help, leaves it to
    the full parser)."""
    words, _given = scan(list(argv))
    for length in (1, 2):
        if tuple(words[:length]) in COMMAND_PATHS:
            return tuple(words[:length])
    return None


def _add_global_options(parser: argparse.ArgumentParser, *, defaults: bool) -> None:
    """--socket, --json, --principal, --timeout: on towerctl's parser with their defaults;
    on each command's parser too (defaults=False: given there, they override), so that
    they are taken after the command as well as before it."""
    group: Any = parser
    if not defaults:
        group = parser.add_argument_group("global options (before or after the command)")

    def default(value: Any) -> Any:
        return value if defaults else argparse.SUPPRESS

    group.add_argument(
        "--socket",
        default=default(None),
        help="daemon socket (default $TOWERD_SOCKET, else $XDG_RUNTIME_DIR/towerd/towerd.sock, "
        "else $XDG_STATE_HOME/towerd/towerd.sock)",
    )
    group.add_argument(
        "--json",
        action="store_true",
        default=default(False),
        help="print results and errors as JSON on stdout",
    )
    group.add_argument(
        "--principal",
        default=default(None),
        help="whose idempotency keys to use (default: default)",
    )
    group.add_argument(
        "--timeout", type=float, default=default(10.0), help="seconds to wait for an answer"
    )


class _Skipped:
    """Stands in for the parser of a command that is not on the command line."""

    def __getattr__(self, _name: str) -> Any:
        return lambda *args, **kwargs: self


def build_parser(only: tuple[str, ...] | None = None) -> argparse.ArgumentParser:
    """The CLI's parser; with ``only``, just the parsers on that command's path."""
    parser = _Parser(
        formatter_class=_Formatter,
        prog="towerctl",
        description="Talk to the towerd daemon.",
        epilog=EXIT_EPILOG,
    )
    _add_global_options(parser, defaults=True)
    parser.add_argument(
        "--version", action="version", version=f"towerctl {VERSION}", help="print the version"
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    paths = {id(commands): ()}

    def command(
        sub: Any, name: str, run: Command | None, help: str, show: Callable[[Any], str] = render
    ) -> Any:
        if isinstance(sub, _Skipped):
            return sub
        path = (*paths[id(sub)], name)
        if only is not None and only[: len(path)] != path:
            return _Skipped()
        # "resolve": an option of the command's own (lock worktree's --timeout) replaces
        # the global option of that name after the command.
        p = sub.add_parser(
            name, help=help, description=help, formatter_class=_Formatter,
            conflict_handler="resolve",
        )  # fmt: skip
        _add_global_options(p, defaults=False)
        p.set_defaults(run=run, render=show, parser=p)
        if run is None:  # a group: its subcommands come next
            group = p.add_subparsers(dest=f"{name}_command", required=True, metavar="SUBCOMMAND")
            paths[id(group)] = path
            return group
        return p

    command(commands, "ping", lambda c, a: c.ping(), "check that the daemon answers", render_pong)
    command(
        commands, "status", lambda c, a: c.status(), "daemon identity, counts, last reconciliation"
    )
    command(commands, "shutdown", lambda c, a: c.shutdown(), "stop the daemon gracefully")

    fleet = command(commands, "fleet", None, "fleet rows")
    p = command(fleet, "list", cmd_fleet_list, "this daemon's rows in stored order", render_fleet)
    p.add_argument("--limit", type=int, default=None, help="one page of at most N rows")
    p.add_argument("--cursor", type=int, default=None, help="continue after this cursor")
    p = command(fleet, "get", lambda c, a: c.fleet_get(a.session_id), "one row")
    p.add_argument("session_id")
    p = command(
        fleet,
        "import-legacy",
        cmd_fleet_import_legacy,
        "import a legacy fleet JSON file",
        render_import,
    )
    p.add_argument("legacy_file", metavar="PATH")
    p = command(
        fleet,
        "adopt",
        lambda c, a: c.fleet_adopt(a.daemon_id),
        "take over the rows of a daemon that is gone for good",
    )
    p.add_argument("daemon_id")
    command(
        fleet,
        "restore-plan",
        lambda c, a: c.fleet_restore_plan(),
        "what to bring back after a restart: sessions that have not exited, newest "
        "activity first, each parent before its sub-sessions",
        render_restore_plan,
    )

    session = command(commands, "session", None, "one fleet row")
    p = command(session, "register", cmd_session_register, "insert a row; prints its session id")
    p.add_argument("--cwd", required=True)
    p.add_argument("--agent", required=True)
    p.add_argument("--session-id", default=None, help="a UUID of your own (default: minted)")
    p.add_argument(
        "--idempotency-key",
        default=None,
        help="a retry with the same key returns the same session id",
    )
    _add_session_field_options(p, for_update=False)
    p = command(session, "update", cmd_session_update, "rewrite the given fields of a row")
    p.add_argument("session_id")
    _add_session_field_options(p, for_update=True)
    p.add_argument(
        "--clear",
        action="append",
        default=[],
        choices=[
            name for name in SESSION_FIELDS if name not in ("cwd", "agent", "pinned", "exited")
        ],
        metavar="FIELD",
        help="set FIELD to null (repeatable)",
    )
    p = command(session, "remove", lambda c, a: c.session_remove(a.session_id), "delete a row")
    p.add_argument("session_id")

    idem = command(commands, "idem", None, "idempotency keys")

    def keyed(name: str, run: Command, help: str) -> Any:
        p = command(idem, name, run, help)
        p.add_argument("operation")
        p.add_argument("key")
        return p

    p = keyed("claim", cmd_idem_claim, "claim a key before running its effect")
    p.add_argument(
        "--payload",
        default=None,
        metavar="JSON",
        help="the request's payload; a retry must send the same",
    )
    p.add_argument(
        "--effect-ref",
        default=None,
        metavar="REF",
        help="what the effect will create (default: a minted UUID)",
    )
    p.add_argument(
        "--holder-pid",
        type=int,
        default=None,
        metavar="PID",
        help="the process doing the effect (default: this command's parent)",
    )
    p.add_argument(
        "--replay-only", action="store_true", help="only report a stored outcome; never claim"
    )
    p.add_argument(
        "--attempt",
        default=None,
        metavar="TOKEN",
        help="a token for this claim; repeat it to retry a claim whose answer was lost",
    )
    p = keyed(
        "complete",
        lambda c, a: c.idem_complete(a.operation, a.key, _json_arg(a.result, "--result")),
        "record the effect's result",
    )
    p.add_argument("--result", default=None, metavar="JSON")
    keyed(
        "release",
        lambda c, a: c.idem_release(a.operation, a.key),
        "drop a key whose effect never started",
    )
    keyed(
        "mark-unknown",
        lambda c, a: c.idem_mark_unknown(a.operation, a.key),
        "declare that the effect's outcome cannot be known",
    )
    keyed("get", lambda c, a: c.idem_get(a.operation, a.key), "one key")
    p = keyed(
        "resolve",
        lambda c, a: c.idem_resolve(a.operation, a.key, a.outcome, _json_arg(a.result, "--result")),
        "settle an outcome_unknown key after checking the effect by hand",
    )
    p.add_argument(
        "--outcome",
        required=True,
        choices=["completed", "abandoned"],
        help="completed: it happened (give --result); abandoned: it did not, "
        "a retry runs it afresh",
    )
    p.add_argument("--result", default=None, metavar="JSON")
    p = keyed(
        "reopen",
        cmd_idem_reopen,
        "forget a completed outcome (e.g. a run whose command failed) so that the next "
        "claim runs it again; written to the operator log",
    )
    p.add_argument("--reason", default=None, help="why, for the operator log")
    p = command(idem, "list", cmd_idem_list, "this principal's keys", render_keys)
    p.add_argument("--state", choices=IDEM_STATES, default=None)
    p.add_argument("--operation", default=None)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--cursor", type=int, default=None)

    p = command(commands, "backup", cmd_backup, "an online, checked copy of the database")
    p.add_argument("path", help="where the copy goes (on the daemon's host)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing file")
    p = command(
        commands,
        "doctor",
        cmd_doctor,
        "what is wrong, and what to do about it (exit 1 if anything is)",
        render_doctor,
    )
    p.add_argument("--full", action="store_true", help="integrity_check instead of quick_check")
    p.add_argument("--state-dir", default=None, help="checked directly when no daemon answers")
    p.set_defaults(offline=True)
    p = command(
        commands,
        "install-systemd",
        cmd_install_systemd,
        "install towerd.service and towerd.socket as user units",
    )
    p.add_argument("--dir", default=None, help="unit directory (default ~/.config/systemd/user)")
    p.add_argument(
        "--enable",
        action="store_true",
        help="also run systemctl --user daemon-reload and enable --now towerd.socket",
    )
    p.set_defaults(offline=True)

    branch = command(commands, "branch", None, "git branches of runs (offline: no daemon)")
    p = command(
        branch,
        "cleanup",
        cmd_branch_cleanup,
        "remove the worktree that has BRANCH checked out (uncommitted changes included) "
        "and delete the branch; exit 1 if a step failed",
        render_branch_cleanup,
    )
    p.add_argument(
        "branch",
        nargs="?",
        default=None,
        metavar="BRANCH",
        help="the branch, e.g. kxm/run-42 (required)",
    )
    p.add_argument(
        "--keep-worktree",
        action="store_true",
        help="leave the worktree (git then refuses to delete the branch checked out there)",
    )
    p.add_argument(
        "--delete-remote", action="store_true", help="also delete the branch on the remote"
    )
    p.add_argument(
        "--remote", default=None, metavar="NAME", help="with --delete-remote (default: origin)"
    )
    p.add_argument(
        "--repo", default=".", metavar="PATH", help="any path in the repository (default: .)"
    )
    p.set_defaults(offline=True)

    _add_exactly_once_commands(command, commands)
    _add_dispatch_commands(command, commands)
    _add_trail_commands(command, commands)
    return parser


def _add_command_argv(p: Any, what: str) -> None:
    """The command after ``--``: everything after it is CMD's, options included."""
    p.add_argument(
        "argv",
        nargs=argparse.REMAINDER,
        metavar="-- CMD ...",
        help=f"the command {what}, after -- (required)",
    )
    p.set_defaults(offline=True, raw=True)
    p.epilog = EXIT_EPILOG


def _add_exactly_once_commands(command: Any, commands: Any) -> None:
    p = command(
        commands,
        "run",
        cmd_run,
        "run CMD at most once under an idempotency key: a retry after it ran prints the "
        "stored outcome and exits with the stored status without running it",
    )
    p.add_argument(
        "--key",
        default=None,
        help="(required) names what CMD does: the same on every retry, e.g. push:app#42",
    )
    p.add_argument("--operation", default="shell", help="the key's operation (default: shell)")
    p.add_argument(
        "--retry-failed",
        action="store_true",
        help="if an earlier run of this key completed with a non-zero exit status, run CMD "
        "again (the failed outcome is forgotten, and that is written to the operator log); "
        "a run that succeeded is still never run again",
    )
    _add_command_argv(p, "to run once")

    effect = command(commands, "effect", None, "run an external effect through the ledger")
    p = command(
        effect,
        "run",
        cmd_effect_run,
        "run CMD as one external effect of a run: claim (with the target's lease for "
        "shared kinds), heartbeat while it runs, commit on exit 0, fail otherwise",
    )
    if not isinstance(p, _Skipped):
        from towerd.protocol.naming import ACTION_KINDS

        p.add_argument("--run-id", default=None, help="(required) the run")
        p.add_argument("--step", default=None, help="(required) the run's step")
        p.add_argument(
            "--kind",
            default=None,
            choices=ACTION_KINDS,
            metavar="KIND",
            help=f"(required) one of {', '.join(ACTION_KINDS)}",
        )
        p.add_argument(
            "--target", default=None, help="(required) what it acts on, e.g. refs/heads/main"
        )
        p.add_argument(
            "--attempt", default=None, metavar="ID", help="this attempt's id (default: minted)"
        )
        p.add_argument(
            "--payload",
            default=None,
            metavar="JSON",
            help="the effect's payload; every attempt must send the same (default: none)",
        )
        p.add_argument(
            "--heartbeat",
            type=float,
            default=30.0,
            metavar="SECONDS",
            help="heartbeat interval while CMD runs (default: 30)",
        )
        p.add_argument(
            "--lease-ttl",
            type=int,
            default=None,
            metavar="MS",
            help="the target lease's TTL, 5000-600000 (default: the daemon's, 300000)",
        )
        _add_command_argv(p, "that does the effect")

    lock = command(commands, "lock", None, "run a command holding a lock")
    p = command(
        lock,
        "worktree",
        cmd_lock_worktree,
        "run CMD holding the lock of the git repository (shared by all its worktrees); "
        "released when CMD ends or towerctl dies: no lockfile to go stale",
    )
    p.add_argument(
        "--timeout",
        dest="wait_timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds to wait for the lock (default: 30); then exit 121",
    )
    p.add_argument(
        "--repo", default=".", metavar="PATH", help="any path in the repository (default: .)"
    )
    p.add_argument(
        "--lease-ttl",
        type=int,
        default=60_000,
        metavar="MS",
        help="the lock's TTL, renewed every third of it (default: 60000)",
    )
    _add_command_argv(p, "to run under the lock")

    effects = command(commands, "effects", None, "the effects ledger")
    p = command(effects, "list", cmd_effects_list, "a run's effects, in claim order",
                render_effects)  # fmt: skip
    p.add_argument("run_id", nargs="?", default=None, metavar="RUN_ID", help="(required)")
    p = command(
        effects,
        "resolve",
        cmd_effects_resolve,
        "settle an uncertain effect after checking the outside world by hand",
    )
    p.add_argument("effect_key", nargs="?", default=None, metavar="KEY", help="(required) eff_...")
    p.add_argument(
        "--outcome",
        default=None,
        choices=["committed", "aborted"],
        help="(required) committed: it happened (give --receipt); aborted: it did not, "
        "a new attempt runs it afresh",
    )
    p.add_argument("--receipt", default=None, metavar="JSON")
    command(commands, "leases", lambda c, a: c.lease_list(), "live leases", render_leases)


def _add_dispatch_commands(command: Any, commands: Any) -> None:
    """Soft state, workers, the dispatch ledger and the audit log."""
    kv = command(commands, "kv", None, "soft-state values by scope (global, worker, milestone)")

    def scoped(name: str, run: Command, help: str, show: Callable[[Any], str]) -> Any:
        p = command(kv, name, run, help, show)
        p.add_argument("scope", choices=KV_SCOPES, metavar="SCOPE", help=", ".join(KV_SCOPES))
        if name != "list":
            p.add_argument("key", metavar="KEY")
        return p

    def scope_id(p: Any) -> None:
        p.add_argument(
            "--scope-id",
            default="",
            metavar="ID",
            help="which worker or milestone (default: empty, as for global)",
        )

    p = scoped(
        "get",
        lambda c, a: c.kv_get(a.scope, a.key, scope_id=a.scope_id),
        "one value; printed as JSON (exit 1 not_found if unset)",
        render_kv_value,
    )
    scope_id(p)
    p = scoped("set", cmd_kv_set, "store a value (replaces any)", render_kv_entry)
    p.add_argument(
        "value", metavar="VALUE_JSON", help="the value as JSON, e.g. 1, '\"text\"' or '{\"n\": 1}'"
    )
    scope_id(p)
    p = scoped(
        "delete",
        lambda c, a: c.kv_delete(a.scope, a.key, scope_id=a.scope_id),
        "drop a value; prints whether there was one",
        render,
    )
    scope_id(p)
    p = scoped("list", cmd_kv_list, "every value of a scope, by key", render_kv_list)
    scope_id(p)

    p = command(commands, "workers", cmd_workers, "registered workers", render_workers)
    p.add_argument("--status", choices=WORKER_STATUSES, default=None)
    p.add_argument("--project-root", default=None, metavar="PATH", help="only this project's")

    dispatch = command(commands, "dispatch", None, "the work-dispatch ledger")
    p = command(
        dispatch,
        "list",
        cmd_dispatch_list,
        "the most recent matching dispatches, oldest first",
        render_dispatches,
    )
    p.add_argument("--unit-type", default=None, metavar="T")
    p.add_argument("--unit-id", default=None, metavar="U")
    p.add_argument("--milestone", default=None, metavar="M")
    p.add_argument("--status", choices=DISPATCH_STATUSES, default=None)
    p.add_argument("--worker", default=None, metavar="W", help="a worker id")
    p.add_argument(
        "--limit", type=_positive, default=None, metavar="N", help="at most N rows (default: 50)"
    )
    p = command(dispatch, "get", lambda c, a: c.dispatch_get(a.dispatch_id), "one dispatch")
    p.add_argument("dispatch_id", type=int, metavar="ID")
    p = command(
        dispatch,
        "stuck",
        cmd_dispatch_stuck,
        "is a project's dispatch loop stuck? (exit 0 either way: see `stuck` in --json)",
        render_stuck,
    )
    p.add_argument(
        "--project-root",
        default=None,
        metavar="PATH",
        help="the project (default: the current directory, symlinks resolved)",
    )
    p.add_argument(
        "--window",
        type=int,
        default=None,
        metavar="N",
        help="how many recent dispatches to judge, 2-500 (default: 20)",
    )

    p = command(
        commands,
        "audit",
        cmd_audit,
        "audit events of workers, leases and dispatches, newest first",
        render_audit,
    )
    p.add_argument("--category", choices=AUDIT_CATEGORIES, default=None)
    p.add_argument("--type", default=None, metavar="T", help="e.g. dispatch-failed")
    p.add_argument("--trace-id", default=None, metavar="ID")
    p.add_argument(
        "--before", type=int, default=None, metavar="SEQ", help="only events before this seq"
    )
    p.add_argument(
        "--limit", type=_positive, default=50, metavar="N", help="at most N events (default: 50)"
    )


def _add_trail_commands(command: Any, commands: Any) -> None:
    """hook-report, events list|tail, message send|list|ack, top."""
    p = command(
        commands,
        "hook-report",
        cmd_hook_report,
        "record an agent hook's JSON (stdin) as an event; run as a hook (without --help) "
        "it always exits 0 and prints nothing",
    )
    p.set_defaults(offline=True, raw=True)
    events = command(commands, "events", None, "the hook event trail")
    p = command(events, "list", cmd_events_list, "a trail, newest first", render_events)
    p.add_argument(
        "session",
        nargs="?",
        default=None,
        metavar="SESSION",
        help="a session id or agent session id (default: every session)",
    )
    p.add_argument(
        "--kind",
        action="append",
        dest="kinds",
        metavar="KIND",
        help="only events of this kind (repeatable)",
    )
    p.add_argument("--limit", type=int, default=None, help="at most N events (1-200)")
    p = command(events, "tail", cmd_events_tail, "print events as they arrive (Ctrl-C ends)")
    p.add_argument(
        "session",
        nargs="?",
        default=None,
        metavar="SESSION",
        help="a session id or agent session id (default: every session)",
    )
    p.add_argument(
        "--kind",
        action="append",
        dest="kinds",
        metavar="KIND",
        help="only events of this kind (repeatable)",
    )
    p.set_defaults(offline=True, raw=True)

    message = command(commands, "message", None, "messages left for sessions")
    p = command(message, "send", cmd_message_send, "leave a message for a session")
    p.add_argument("session_id")
    p.add_argument("text")
    p.add_argument("--key", default=None, help="idempotency key: a retry sends it once")
    p = command(
        message, "list", cmd_message_list, "a session's messages, oldest first", render_messages
    )
    p.add_argument("session_id")
    p.add_argument("--status", choices=["queued", "delivered", "read"], default=None)
    p = command(message, "ack", cmd_message_ack, "mark a message delivered or read")
    p.add_argument("message_id")
    p.add_argument("--status", choices=["delivered", "read"], default="read")

    p = command(commands, "top", cmd_top, "live dashboard: the fleet and what needs a decision")
    p.add_argument(
        "--refresh",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="redraw at least this often (default 1)",
    )
    p.set_defaults(offline=True, raw=True)  # fmt: skip


def cmd_hook_report(_client: None, args: argparse.Namespace) -> int:
    from towerd.client.hook_report import report

    return report(socket_path=args.socket)


def cmd_events_list(client: Client, args: argparse.Namespace) -> Any:
    ids = _scope_ids(args.session)
    return client.event_list(**ids, kinds=args.kinds, limit=args.limit)


def _scope_ids(session: str | None) -> dict[str, Any]:
    """A SESSION argument matches either id: a towerd session id or an agent session id."""
    if session is None:
        return {}
    return {"session_ids": [session] if _is_uuid(session) else [], "agent_session_ids": [session]}


def _is_uuid(text: str) -> bool:
    parts = text.split("-")
    return [len(part) for part in parts] == [8, 4, 4, 4, 12] and all(
        c in "0123456789abcdef" for c in text.replace("-", "")
    )


def cmd_events_tail(_client: None, args: argparse.Namespace) -> int:
    from towerd.client.trail import tail_events

    return tail_events(args, _scope_ids(args.session))


def cmd_message_send(client: Client, args: argparse.Namespace) -> Any:
    return client.session_message(args.session_id, args.text, idempotency_key=args.key)


def cmd_message_list(client: Client, args: argparse.Namespace) -> Any:
    return client.message_list(args.session_id, status=args.status)


def cmd_message_ack(client: Client, args: argparse.Namespace) -> Any:
    return client.message_ack(args.message_id, args.status)


def cmd_top(_client: None, args: argparse.Namespace) -> int:
    from towerd.client.top import run_top

    return run_top(args)


def render_events(result: dict[str, Any]) -> str:
    return _table(
        result["events"],
        [("event_id", "ID"), ("at", "AT"), ("kind", "KIND"), ("session_id", "SESSION"),
         ("agent_session_id", "AGENT_SESSION")],
    )  # fmt: skip


def render_messages(result: dict[str, Any]) -> str:
    return _table(
        result["messages"],
        [("message_id", "MESSAGE"), ("status", "STATUS"), ("created_at", "CREATED"),
         ("text", "TEXT")],
    )  # fmt: skip


def render_restore_plan(result: dict[str, Any]) -> str:
    return _table(
        result["sessions"],
        [("session_id", "SESSION"), ("parent", "PARENT"), ("agent", "AGENT"),
         ("agent_session_id", "AGENT_SESSION"), ("cwd", "CWD"),
         ("last_activity_at", "LAST_ACTIVITY")],
    )  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    is_hook, socket_path = hook_report_socket(argv)
    if is_hook:
        # Every agent hook runs this: no parser, no output, exit 0 whatever happens.
        from towerd.client.hook_report import report

        sys.exit(report(socket_path=socket_path))
    parser = build_parser(command_path(argv))
    try:
        args, unknown = parser.parse_known_args(argv)
        if unknown:  # refused, with the usage of the command they were given to
            refusing = getattr(args, "parser", parser)
            raise BadCommandLine(refusing, f"unrecognized arguments: {' '.join(unknown)}")
        _require_text(args)
    except BadCommandLine as exc:
        as_json = "--json" in scan(argv)[1]
        sys.exit(usage_error(exc.message, exc.parser, as_json=as_json, refused=True))
    sys.exit(run(args))


def usage_error(
    message: str, parser: argparse.ArgumentParser | None, *, as_json: bool, refused: bool
) -> int:
    """Report bad usage, exit 2. With --json, ``{"error": {"code": "usage", "message",
    "data": {"usage"}}}`` on stdout; else on stderr, as argparse does when argparse
    ``refused`` the line, or one ``towerctl: message`` line when a command did."""
    usage = parser.format_usage().strip() if parser is not None else None
    if as_json:
        data = {"usage": " ".join(usage.split())} if usage is not None else {}
        print(dumps_json({"error": {"code": "usage", "message": message, "data": data}}))
    elif refused and parser is not None:
        say(f"{usage}\n{parser.prog}: error: {message}", to_stderr=True)
    else:
        say(f"towerctl: {message}", to_stderr=True)
    return EXIT_USAGE


# Options naming files on this machine: any bytes the OS takes are fine there.
_LOCAL_PATHS = frozenset({"socket", "state_dir", "dir", "repo", "legacy_file", "argv"})


def _require_text(args: argparse.Namespace) -> None:
    """Every string argument sent to the daemon must be UTF-8 text (the wire's strings
    are; Python hands undecodable argv bytes over as lone surrogates)."""
    for dest, value in vars(args).items():
        if dest in _LOCAL_PATHS:
            continue
        for text in value if isinstance(value, list) else [value]:
            if isinstance(text, str) and not _is_utf8(text):
                raise BadCommandLine(
                    args.parser,
                    f"argument {_option_name(args.parser, dest)}: not valid UTF-8 "
                    f"({os.fsencode(text)!r}); towerd keeps text: give it in UTF-8",
                )


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _option_name(parser: argparse.ArgumentParser, dest: str) -> str:
    """How the command line spells the argument stored under ``dest`` (--key, SESSION)."""
    for action in parser._actions:
        if action.dest == dest:
            if action.option_strings:
                return action.option_strings[-1]
            return str(action.metavar or dest.upper())
    return dest


def run(args: argparse.Namespace) -> int:
    try:
        if getattr(args, "offline", False):
            result = args.run(None, args)
        else:
            with Client(
                args.socket, timeout=args.timeout, principal=args.principal, client_name="towerctl"
            ) as client:
                result = args.run(client, args)
        if getattr(args, "raw", False):
            return result  # it printed its own output; this is its exit status
    except UsageError as exc:
        parser = getattr(args, "parser", None)
        return usage_error(str(exc), parser, as_json=args.json, refused=False)
    except Unhealthy as exc:
        if args.json:
            print(dumps_json(exc.result, indent=2))
        else:
            say(args.render(exc.result))
        return EXIT_ERROR
    except (TowerdError, LocalFailure) as exc:
        if args.json:
            print(dumps_json({"error": exc.to_wire()}))
        else:
            say(f"towerctl: {exc.code}: {exc.message}", to_stderr=True)
        return EXIT_UNAVAILABLE if isinstance(exc, Unavailable) else EXIT_ERROR
    if args.json:
        print(dumps_json(result, indent=2, sort_keys=True))
    else:
        say(args.render(result))
        if isinstance(result, dict) and result.get("truncated"):
            say("towerctl: the list was cut to fit one answer; narrow it", to_stderr=True)
    return EXIT_OK


if __name__ == "__main__":
    main()
