"""Fleet rows: ``fleet list|get|import-legacy|adopt|restore-plan|restore`` and
``session register|update|remove``."""

from __future__ import annotations

import argparse

from towerd.client.cli.output import UsageError, lazy_json, table, with_cursor
from towerd.client.cli.registry import Commands, arg
from towerd.protocol.fields import SESSION_FIELDS

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs hooks ~3 ms
if TYPE_CHECKING:
    from typing import Any

    from towerd.client.cli.registry import Arg
    from towerd.client.sync import Client

COMMANDS = Commands()

# --- fleet -------------------------------------------------------------------------------

COMMANDS.group("fleet", "fleet rows")

# Which box's rows a fleet read shows (default: this daemon's on its own store, every
# box's on a store several boxes share; `towerctl boxes` lists them).
DAEMON = arg(
    "--daemon",
    dest="daemon_id",
    default=None,
    metavar="ID",
    help="only this box's (daemon id's) rows (default: this daemon's, or on a shared "
    "store every box's)",
)


def _box_column(rows: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """A BOX column when the rows are of more than one box (a shared store's fleet)."""
    return [("daemon_id", "BOX")] if len({row.get("daemon_id") for row in rows}) > 1 else []


def render_fleet(result: dict[str, Any]) -> str:
    text = table(
        result["sessions"],
        [
            *_box_column(result["sessions"]),
            ("session_id", "SESSION"),
            ("name", "NAME"),
            ("agent", "AGENT"),
            ("parent", "PARENT"),
            ("pinned", "PINNED"),
            ("exited", "EXITED"),
            ("live", "LIVE"),
            ("cwd", "CWD"),
            ("updated_at", "UPDATED"),
        ],
    )
    return with_cursor(text, result, "next_cursor", "next cursor: ")


@COMMANDS.command(
    "fleet",
    "list",
    help="fleet rows in stored order",
    render=render_fleet,
    options=[
        arg("--limit", type=int, default=None, help="one page of at most N rows"),
        arg("--cursor", type=int, default=None, help="continue after this cursor"),
        DAEMON,
    ],
)
def cmd_fleet_list(client: Client, args: argparse.Namespace) -> Any:
    if args.limit is not None:
        return client.fleet_list(limit=args.limit, cursor=args.cursor, daemon_id=args.daemon_id)
    return {"sessions": list(client.iter_fleet(daemon_id=args.daemon_id))}


@COMMANDS.command("fleet", "get", help="one row", options=[arg("session_id"), DAEMON])
def cmd_fleet_get(client: Client, args: argparse.Namespace) -> Any:
    return client.fleet_get(args.session_id, daemon_id=args.daemon_id)


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


@COMMANDS.command(
    "fleet",
    "import-legacy",
    help="import a legacy fleet JSON file",
    render=render_import,
    options=[arg("legacy_file", metavar="PATH", local_path=True)],
)
def cmd_fleet_import_legacy(client: Client, args: argparse.Namespace) -> Any:
    path = args.legacy_file
    try:
        with open(path, encoding="utf-8") as legacy:
            entries = lazy_json().loads(legacy.read())
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}") from None
    except ValueError as exc:
        raise UsageError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(entries, list):
        raise UsageError(f"{path} must hold a JSON array of fleet entries")
    return client.fleet_import_legacy(entries)


@COMMANDS.command(
    "fleet",
    "adopt",
    help="take over the rows of a daemon that is gone for good",
    options=[arg("daemon_id")],
)
def cmd_fleet_adopt(client: Client, args: argparse.Namespace) -> Any:
    return client.fleet_adopt(args.daemon_id)


def render_restore_plan(result: dict[str, Any]) -> str:
    return table(
        result["sessions"],
        [*_box_column(result["sessions"]), ("session_id", "SESSION"), ("parent", "PARENT"),
         ("agent", "AGENT"),
         ("agent_session_id", "AGENT_SESSION"), ("cwd", "CWD"),
         ("last_activity_at", "LAST_ACTIVITY")],
    )  # fmt: skip


@COMMANDS.command(
    "fleet",
    "restore-plan",
    help="what to bring back after a restart: sessions that have not exited, newest "
    "activity first, each parent before its sub-sessions",
    render=render_restore_plan,
    options=[DAEMON],
)
def cmd_fleet_restore_plan(client: Client, args: argparse.Namespace) -> Any:
    return client.fleet_restore_plan(daemon_id=args.daemon_id)


def render_restore(result: dict[str, Any]) -> str:
    lines = [
        f"{entry['result']:12} {entry['session_id']}  {entry['name'] or '-'}  {entry['agent']}"
        + (f"  ({entry['reason']})" if entry["reason"] else "")
        for entry in result["sessions"]
    ]
    return "\n".join(lines) or "nothing to restore"


@COMMANDS.command(
    "fleet",
    "restore",
    help="bring back, each exactly once per boot, the sessions of the restore plan whose "
    "agent is gone: each resumed in a tmux window, parents first, waiting for its "
    "SessionStart (--timeout, default 60 s); exit 1 unless all are live at the end",
    render=render_restore,
    options=[
        arg("--dry-run", action="store_true", help="say what would start; start nothing"),
        arg(
            "--session",
            dest="sessions",
            nargs="+",
            metavar="S",
            action="extend",
            help="only these sessions (default: every session of the plan)",
        ),
        arg(
            "--tmux-session",
            default="towerd",
            metavar="NAME",
            help="the tmux session the agents' windows go in (default: towerd)",
        ),
        arg("--tmux-socket", default=None, metavar="NAME", help="tmux's -L socket name"),
        arg(
            "--config",
            default=None,
            metavar="FILE",
            local_path=True,
            help="the launch commands per agent kind (default: "
            "$XDG_CONFIG_HOME/towerd/restore.toml)",
        ),
    ],  # fmt: skip
)
def cmd_fleet_restore(client: Client, args: argparse.Namespace) -> Any:
    from towerd.client.cli.output import LocalFailure, Unhealthy
    from towerd.client.restore import DEFAULT_TIMEOUT, Options, RestoreError, restore

    options = Options(
        sessions=args.sessions,
        dry_run=args.dry_run,
        tmux_session=args.tmux_session,
        tmux_socket=args.tmux_socket,
        timeout=DEFAULT_TIMEOUT if args.timeout is None else args.timeout,
        config=args.config,
    )
    try:
        result = restore(client, options)
    except RestoreError as exc:
        raise LocalFailure("restore_failed", str(exc)) from None
    if not result["ok"]:
        raise Unhealthy(result)
    return result


# --- session -----------------------------------------------------------------------------

COMMANDS.group("session", "one fleet row")

_SESSION_TEXT_FIELDS = [
    name
    for name in SESSION_FIELDS
    if name not in ("pinned", "exited", "last_attached_at", "cwd", "agent")
]


def _session_field_options(*, for_update: bool) -> list[Arg]:
    """An option per settable field (register takes --cwd and --agent as required)."""
    options = [arg(f"--{name.replace('_', '-')}", dest=name, default=None)
               for name in _SESSION_TEXT_FIELDS]  # fmt: skip
    if for_update:
        options += [arg("--cwd", default=None), arg("--agent", default=None)]
    return [
        *options,
        arg(
            "--last-attached-at",
            dest="last_attached_at",
            type=int,
            default=None,
            metavar="MILLIS",
            help="milliseconds since the Unix epoch",
        ),
        arg("--pinned", action=argparse.BooleanOptionalAction, default=None),
        arg("--exited", action=argparse.BooleanOptionalAction, default=None),
    ]


def _session_fields(args: argparse.Namespace) -> dict[str, Any]:
    return {
        name: getattr(args, name)
        for name in SESSION_FIELDS
        if name not in ("cwd", "agent") and getattr(args, name, None) is not None
    }


@COMMANDS.command(
    "session",
    "register",
    help="insert a row; prints its session id",
    options=[
        arg("--cwd", required=True),
        arg("--agent", required=True),
        arg("--session-id", default=None, help="a UUID of your own (default: minted)"),
        arg(
            "--idempotency-key",
            default=None,
            help="a retry with the same key returns the same session id",
        ),
        *_session_field_options(for_update=False),
    ],
)
def cmd_session_register(client: Client, args: argparse.Namespace) -> Any:
    return client.session_register(
        cwd=args.cwd,
        agent=args.agent,
        session_id=args.session_id,
        idempotency_key=args.idempotency_key,
        **_session_fields(args),
    )


@COMMANDS.command(
    "session",
    "update",
    help="rewrite the given fields of a row",
    options=[
        arg("session_id"),
        *_session_field_options(for_update=True),
        arg(
            "--clear",
            action="append",
            default=[],
            choices=[
                name for name in SESSION_FIELDS if name not in ("cwd", "agent", "pinned", "exited")
            ],
            metavar="FIELD",
            help="set FIELD to null (repeatable)",
        ),
    ],
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


@COMMANDS.command("session", "remove", help="delete a row", options=[arg("session_id")])
def cmd_session_remove(client: Client, args: argparse.Namespace) -> Any:
    return client.session_remove(args.session_id)
