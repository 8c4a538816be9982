"""Soft state, workers, the dispatch ledger and the audit log: ``kv get|set|delete|list``,
``workers``, ``dispatch list|get|stuck``, ``audit``."""

from __future__ import annotations

import argparse
import os

from towerd.client.cli.output import clip, dumps_json, json_arg, pairs, render, table, with_cursor
from towerd.client.cli.registry import Commands, arg
from towerd.protocol.fields import AUDIT_CATEGORIES, DISPATCH_STATUSES, KV_SCOPES, WORKER_STATUSES

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs hooks ~3 ms
if TYPE_CHECKING:
    from typing import Any

    from towerd.client.sync import Client

# The wire's enumerations (towerd.protocol.methods has them as Literals, but importing it
# pulls in msgspec); tests/client/test_cli_parser.py keeps these in step.
AUDIT_PAGE = 500  # the most events one audit.list call returns

COMMANDS = Commands()


def _positive(text: str) -> int:
    """An argparse type: an integer >= 1 (a bad one is a usage error, exit 2)."""
    try:
        number = int(text)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, not {text!r}")
    return number


# --- kv ----------------------------------------------------------------------------------

COMMANDS.group("kv", "soft-state values by scope (global, worker, milestone)")

SCOPE = arg("scope", choices=KV_SCOPES, metavar="SCOPE", help=", ".join(KV_SCOPES))
KEY = arg("key", metavar="KEY")
SCOPE_ID = arg(
    "--scope-id",
    default="",
    metavar="ID",
    help="which worker or milestone (default: empty, as for global)",
)


def _value_json(value: Any) -> str:
    return dumps_json(value, sort_keys=True)


def render_kv_value(result: dict[str, Any]) -> str:
    """``kv get``: the value alone, as JSON, for scripts."""
    return _value_json(result["value"])


@COMMANDS.command(
    "kv",
    "get",
    help="one value; printed as JSON (exit 1 not_found if unset)",
    render=render_kv_value,
    options=[SCOPE, KEY, SCOPE_ID],
)
def cmd_kv_get(client: Client, args: argparse.Namespace) -> Any:
    return client.kv_get(args.scope, args.key, scope_id=args.scope_id)


def render_kv_entry(result: dict[str, Any]) -> str:
    return pairs({**result, "value": _value_json(result["value"])})


@COMMANDS.command(
    "kv",
    "set",
    help="store a value (replaces any)",
    render=render_kv_entry,
    options=[
        SCOPE,
        KEY,
        arg(
            "value",
            metavar="VALUE_JSON",
            help="the value as JSON, e.g. 1, '\"text\"' or '{\"n\": 1}'",
        ),
        SCOPE_ID,
    ],
)
def cmd_kv_set(client: Client, args: argparse.Namespace) -> Any:
    value = json_arg(args.value, "VALUE_JSON")
    return client.kv_set(args.scope, args.key, value, scope_id=args.scope_id)


@COMMANDS.command(
    "kv",
    "delete",
    help="drop a value; prints whether there was one",
    render=render,
    options=[SCOPE, KEY, SCOPE_ID],
)
def cmd_kv_delete(client: Client, args: argparse.Namespace) -> Any:
    return client.kv_delete(args.scope, args.key, scope_id=args.scope_id)


def render_kv_list(result: dict[str, Any]) -> str:
    rows = [
        {"key": entry["key"], "updated_at": entry["updated_at"],
         "value": clip(_value_json(entry["value"]))}
        for entry in result["entries"]
    ]  # fmt: skip
    return table(rows, [("key", "KEY"), ("updated_at", "UPDATED"), ("value", "VALUE")])


@COMMANDS.command(
    "kv",
    "list",
    help="every value of a scope, by key",
    render=render_kv_list,
    options=[SCOPE, SCOPE_ID],
)
def cmd_kv_list(client: Client, args: argparse.Namespace) -> Any:
    entries: list[Any] = []
    after = None
    while True:
        page = client.kv_list(args.scope, scope_id=args.scope_id, after=after)
        entries += page["entries"]
        after = page.get("next_after")
        if after is None:
            return {"entries": entries}


# --- workers -----------------------------------------------------------------------------


def render_workers(result: dict[str, Any]) -> str:
    return table(
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


@COMMANDS.command(
    "workers",
    help="registered workers",
    render=render_workers,
    options=[
        arg("--status", choices=WORKER_STATUSES, default=None),
        arg("--project-root", default=None, metavar="PATH", help="only this project's"),
    ],
)
def cmd_workers(client: Client, args: argparse.Namespace) -> Any:
    root = os.path.abspath(args.project_root) if args.project_root is not None else None
    return client.worker_list(status=args.status, project_root=root)


# --- dispatch ----------------------------------------------------------------------------

COMMANDS.group("dispatch", "the work-dispatch ledger")


def _dispatch_reason(row: dict[str, Any]) -> str | None:
    """Why it ended: the error of a failed attempt, else its exit reason."""
    error = [part for part in (row.get("error_code"), row.get("error_summary")) if part]
    if error:
        return clip(": ".join(error))
    reason = row.get("exit_reason")
    return clip(reason) if reason else None


def render_dispatches(result: dict[str, Any]) -> str:
    rows = [
        {
            **row,
            "attempt": f"{row['attempt_n']}/{row['max_attempts']}",
            "reason": _dispatch_reason(row),
        }
        for row in result["dispatches"]
    ]
    return table(
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


@COMMANDS.command(
    "dispatch",
    "list",
    help="the most recent matching dispatches, oldest first",
    render=render_dispatches,
    options=[
        arg("--unit-type", default=None, metavar="T"),
        arg("--unit-id", default=None, metavar="U"),
        arg("--milestone", default=None, metavar="M"),
        arg("--status", choices=DISPATCH_STATUSES, default=None),
        arg("--worker", default=None, metavar="W", help="a worker id"),
        arg(
            "--limit",
            type=_positive,
            default=None,
            metavar="N",
            help="at most N rows (default: 50)",
        ),
    ],
)
def cmd_dispatch_list(client: Client, args: argparse.Namespace) -> Any:
    return client.dispatch_list(
        unit_type=args.unit_type,
        unit_id=args.unit_id,
        milestone_id=args.milestone,
        status=args.status,
        worker_id=args.worker,
        limit=args.limit,
    )


@COMMANDS.command(
    "dispatch", "get", help="one dispatch", options=[arg("dispatch_id", type=int, metavar="ID")]
)
def cmd_dispatch_get(client: Client, args: argparse.Namespace) -> Any:
    return client.dispatch_get(args.dispatch_id)


def render_stuck(result: dict[str, Any]) -> str:
    def line(verdict: dict[str, Any]) -> str:
        return f"{verdict['rule']} {verdict['unit_key']} \u2014 {verdict['reason']}"

    verdict = result["verdict"]
    lines = [f"stuck: {line(verdict)}" if verdict is not None else "not stuck"]
    lines += [f"suppressed (a retry is scheduled): {line(held)}" for held in result["suppressed"]]
    lines.append(f"window: {len(result['window'])} recent dispatches")
    return "\n".join(lines)


@COMMANDS.command(
    "dispatch",
    "stuck",
    help="is a project's dispatch loop stuck? (exit 0 either way: see `stuck` in --json)",
    render=render_stuck,
    options=[
        arg(
            "--project-root",
            default=None,
            metavar="PATH",
            help="the project (default: the current directory, symlinks resolved)",
        ),
        arg(
            "--window",
            type=int,
            default=None,
            metavar="N",
            help="how many recent dispatches to judge, 2-500 (default: 20)",
        ),
    ],
)
def cmd_dispatch_stuck(client: Client, args: argparse.Namespace) -> Any:
    root = os.path.realpath(args.project_root if args.project_root is not None else os.getcwd())
    return client.dispatch_stuck_report(root, window=args.window)


# --- audit -------------------------------------------------------------------------------


def render_audit(result: dict[str, Any]) -> str:
    text = table(
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
    return with_cursor(text, result, "next_before", "more: --before ")


@COMMANDS.command(
    "audit",
    help="audit events of workers, leases and dispatches, newest first",
    render=render_audit,
    options=[
        arg("--category", choices=AUDIT_CATEGORIES, default=None),
        arg("--type", default=None, metavar="T", help="e.g. dispatch-failed"),
        arg("--trace-id", default=None, metavar="ID"),
        arg("--before", type=int, default=None, metavar="SEQ", help="only events before this seq"),
        arg(
            "--limit",
            type=_positive,
            default=50,
            metavar="N",
            help="at most N events (default: 50)",
        ),
    ],
)
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
