"""What agents leave behind and what is left for them: ``hook``, ``hook-report``, ``events
list|tail``, ``message send|list|ack``, and the ``top`` dashboard.

``hook`` and ``hook-report`` are declared here for ``towerctl --help`` and their
``--help``: run as a hook, neither gets here (towerd.client.entry runs it without a parser).
``events tail`` and ``top`` import their modules when run (``top`` pulls in rich).
"""

from __future__ import annotations

from towerd.client.agents import DEFAULT_GUARD
from towerd.client.cli.output import table
from towerd.client.cli.registry import Commands, arg
from towerd.client.cli.seconds import Seconds
from towerd.protocol import fields
from towerd.protocol.fields import AGENTS, GUARD_POLICIES, MESSAGE_STATUSES

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs hooks ~3 ms
if TYPE_CHECKING:
    import argparse
    from typing import Any

    from towerd.client.sync import Client

COMMANDS = Commands()


@COMMANDS.command(
    "hook-report",
    help="record an agent hook's JSON (stdin) as an event; run as a hook (without --help) "
    "it always exits 0 and prints nothing",
    offline=True,
    raw=True,
)
def cmd_hook_report(_client: None, args: argparse.Namespace) -> int:
    from towerd.client.hook_report import report

    return report(socket_path=args.socket)


@COMMANDS.command(
    "hook",
    help="what `towerctl hooks install` wires into an agent: record the hook's JSON (stdin), "
    "keep the fleet, guard edits with path leases; run as a hook (without --help) it always "
    "exits 0 and prints nothing but a deny decision",
    offline=True,
    raw=True,
    options=[
        arg("--agent", choices=AGENTS, default="claude", help="whose hook this is"),
        arg(
            "--guard",
            choices=GUARD_POLICIES,
            default=DEFAULT_GUARD,
            help="another session holds the path: deny the edit (default), warn, or off",
        ),
    ],  # fmt: skip
)
def cmd_hook(_client: None, args: argparse.Namespace) -> int:
    from towerd.client.agent_hook import run

    socket = ["--socket", args.socket] if args.socket else []
    return run(["--agent", args.agent, "--guard", args.guard, *socket])


# --- events ------------------------------------------------------------------------------

COMMANDS.group("events", "the hook event trail")

SESSION = arg(
    "session",
    nargs="?",
    default=None,
    metavar="SESSION",
    help="a session id or agent session id (default: every session)",
)
KINDS = arg(
    "--kind",
    action="append",
    dest="kinds",
    metavar="KIND",
    help="only events of this kind (repeatable)",
)


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


def render_events(result: dict[str, Any]) -> str:
    return table(
        result["events"],
        [("event_id", "ID"), ("at", "AT"), ("kind", "KIND"), ("session_id", "SESSION"),
         ("agent_session_id", "AGENT_SESSION")],
    )  # fmt: skip


@COMMANDS.command(
    "events",
    "list",
    help="a trail, newest first",
    render=render_events,
    options=[
        SESSION,
        KINDS,
        arg("--limit", type=int, default=None, help="at most N events (1-200)"),
    ],
)
def cmd_events_list(client: Client, args: argparse.Namespace) -> Any:
    ids = _scope_ids(args.session)
    return client.event_list(**ids, kinds=args.kinds, limit=args.limit)


@COMMANDS.command(
    "events",
    "tail",
    help="print events as they arrive (Ctrl-C ends)",
    options=[SESSION, KINDS],
    offline=True,
    raw=True,
)
def cmd_events_tail(_client: None, args: argparse.Namespace) -> int:
    from towerd.client.trail import tail_events

    return tail_events(args, _scope_ids(args.session))


# --- message -----------------------------------------------------------------------------

COMMANDS.group("message", "messages left for sessions")


@COMMANDS.command(
    "message",
    "send",
    help="leave a message for a session",
    options=[
        arg("session_id"),
        arg("text"),
        arg("--key", default=None, help="idempotency key: a retry sends it once"),
    ],
)
def cmd_message_send(client: Client, args: argparse.Namespace) -> Any:
    return client.session_message(args.session_id, args.text, idempotency_key=args.key)


def render_messages(result: dict[str, Any]) -> str:
    return table(
        result["messages"],
        [("message_id", "MESSAGE"), ("status", "STATUS"), ("created_at", "CREATED"),
         ("text", "TEXT")],
    )  # fmt: skip


@COMMANDS.command(
    "message",
    "list",
    help="a session's messages, oldest first",
    render=render_messages,
    options=[
        arg("session_id"),
        arg("--status", choices=MESSAGE_STATUSES, default=None),
    ],
)
def cmd_message_list(client: Client, args: argparse.Namespace) -> Any:
    return client.message_list(args.session_id, status=args.status)


@COMMANDS.command(
    "message",
    "ack",
    help="mark a message delivered or read",
    options=[
        arg("message_id"),
        arg("--status", choices=fields.MESSAGE_ACKS, default="read"),
    ],
)
def cmd_message_ack(client: Client, args: argparse.Namespace) -> Any:
    return client.message_ack(args.message_id, args.status)


# --- top ---------------------------------------------------------------------------------


@COMMANDS.command(
    "top",
    help="live dashboard: the fleet and what needs a decision",
    options=[
        arg(
            "--refresh",
            type=Seconds(),
            default=1.0,
            metavar="SECONDS",
            help="redraw at least this often (default 1)",
        ),
    ],
    offline=True,
    raw=True,
)
def cmd_top(_client: None, args: argparse.Namespace) -> int:
    from towerd.client.top import run_top

    return run_top(args)
