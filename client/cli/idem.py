"""Idempotency keys by hand: ``idem claim|complete|release|mark-unknown|get|resolve|
reopen|list``. (``run`` claims and completes keys for a shell command: see effects.)"""

from __future__ import annotations

import os

from towerd.client.cli.output import json_arg, table, with_cursor
from towerd.client.cli.registry import Commands, arg
from towerd.protocol import fields
from towerd.protocol.fields import IDEM_STATES

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs hooks ~3 ms
if TYPE_CHECKING:
    import argparse
    from typing import Any

    from towerd.client.sync import Client

COMMANDS = Commands()
COMMANDS.group("idem", "idempotency keys")

KEYED = (arg("operation"), arg("key"))  # every idem command but list names one key
RESULT = arg("--result", default=None, metavar="JSON")


@COMMANDS.command(
    "idem",
    "claim",
    help="claim a key before running its effect",
    options=[
        *KEYED,
        arg(
            "--payload",
            default=None,
            metavar="JSON",
            help="the request's payload; a retry must send the same",
        ),
        arg(
            "--effect-ref",
            default=None,
            metavar="REF",
            help="what the effect will create (default: a minted UUID)",
        ),
        arg(
            "--holder-pid",
            type=int,
            default=None,
            metavar="PID",
            help="the process doing the effect (default: this command's parent)",
        ),
        arg("--replay-only", action="store_true", help="only report a stored outcome; never claim"),
        arg(
            "--attempt",
            default=None,
            metavar="TOKEN",
            help="a token for this claim; repeat it to retry a claim whose answer was lost",
        ),
    ],
)
def cmd_idem_claim(client: Client, args: argparse.Namespace) -> Any:
    return client.idem_claim(
        args.operation,
        args.key,
        payload=json_arg(args.payload, "--payload"),
        effect_ref=args.effect_ref,
        # A CLI process exits right after claiming: by default the key is held by
        # the shell (or program) that ran us, which does the effect.
        holder_pid=args.holder_pid if args.holder_pid is not None else os.getppid(),
        replay_only=args.replay_only,
        attempt=args.attempt,
    )


@COMMANDS.command("idem", "complete", help="record the effect's result", options=[*KEYED, RESULT])
def cmd_idem_complete(client: Client, args: argparse.Namespace) -> Any:
    return client.idem_complete(args.operation, args.key, json_arg(args.result, "--result"))


@COMMANDS.command("idem", "release", help="drop a key whose effect never started", options=KEYED)
def cmd_idem_release(client: Client, args: argparse.Namespace) -> Any:
    return client.idem_release(args.operation, args.key)


@COMMANDS.command(
    "idem",
    "mark-unknown",
    help="declare that the effect's outcome cannot be known",
    options=KEYED,
)
def cmd_idem_mark_unknown(client: Client, args: argparse.Namespace) -> Any:
    return client.idem_mark_unknown(args.operation, args.key)


@COMMANDS.command("idem", "get", help="one key", options=KEYED)
def cmd_idem_get(client: Client, args: argparse.Namespace) -> Any:
    return client.idem_get(args.operation, args.key)


@COMMANDS.command(
    "idem",
    "resolve",
    help="settle an outcome_unknown key after checking the effect by hand",
    options=[
        *KEYED,
        arg(
            "--outcome",
            required=True,
            choices=fields.IDEM_OUTCOMES,
            help="completed: it happened (give --result); abandoned: it did not, "
            "a retry runs it afresh",
        ),
        RESULT,
    ],
)
def cmd_idem_resolve(client: Client, args: argparse.Namespace) -> Any:
    return client.idem_resolve(
        args.operation, args.key, args.outcome, json_arg(args.result, "--result")
    )


@COMMANDS.command(
    "idem",
    "reopen",
    help="forget a completed outcome (e.g. a run whose command failed) so that the next "
    "claim runs it again; written to the operator log",
    options=[*KEYED, arg("--reason", default=None, help="why, for the operator log")],
)
def cmd_idem_reopen(client: Client, args: argparse.Namespace) -> Any:
    """Reopen the outcome as it is now: the daemon refuses if it changed meanwhile."""
    record = client.idem_get(args.operation, args.key)
    return client.idem_reopen(
        args.operation, args.key, record.get("result"), reason=args.reason,
        effect_ref=record.get("effect_ref"),
    )  # fmt: skip


def render_keys(result: dict[str, Any]) -> str:
    text = table(
        result["keys"],
        [
            ("operation", "OPERATION"),
            ("key", "KEY"),
            ("state", "STATE"),
            ("effect_ref", "EFFECT_REF"),
            ("updated_at", "UPDATED"),
        ],
    )
    return with_cursor(text, result, "next_cursor", "next cursor: ")


@COMMANDS.command(
    "idem",
    "list",
    help="this principal's keys",
    render=render_keys,
    options=[
        arg("--state", choices=IDEM_STATES, default=None),
        arg("--operation", default=None),
        arg("--limit", type=int, default=None),
        arg("--cursor", type=int, default=None),
    ],
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
