"""towerctl's command line: which group module holds each command, the parser, and the
run of one command with its output and exit status.

A command line imports only the module of the group it names and builds only the
parsers on its command's path (every module and every parser only for ``--help``, a
bad command, or a group word alone).
"""

from __future__ import annotations

import os
import sys

from towerd.client.cli.output import (
    EXIT_EPILOG,
    EXIT_ERROR,
    EXIT_OK,
    EXIT_UNAVAILABLE,
    LocalFailure,
    Unhealthy,
    UsageError,
    dumps_json,
    emit,
    is_utf8,
    print_error,
    print_json,
    say,
    usage_error,
)
from towerd.client.cli.registry import (
    BadCommandLine,
    Commands,
    add_global_options,
    call_timeout,
)
from towerd.client.entry import scan
from towerd.client.sync import Client
from towerd.protocol import VERSION
from towerd.protocol.errors import TowerdError, Unavailable

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs hooks ~3 ms
if TYPE_CHECKING:
    import argparse
    from collections.abc import Sequence

# Each first word of a command, in the order of `towerctl --help`, and the module of
# towerd.client.cli that declares its commands. Only this table is read before a
# module is imported; tests/client/test_cli_parser.py checks it against the modules'
# declarations. A new command group adds its module's words here.
COMMAND_GROUPS = {
    "ping": "ops", "status": "ops", "shutdown": "ops", "boxes": "ops",
    "fleet": "fleet", "session": "fleet",
    "idem": "idem",
    "backup": "ops", "doctor": "ops", "install-systemd": "ops", "branch": "ops",
    "run": "effects", "effect": "effects", "lock": "effects", "effects": "effects",
    "leases": "effects", "claim": "paths", "release": "paths",
    "kv": "dispatch", "workers": "dispatch", "dispatch": "dispatch", "audit": "dispatch",
    "hook": "trail", "hook-report": "trail", "events": "trail", "message": "trail", "top": "trail",
    "hooks": "hooks",
    "notify": "notify",
}  # fmt: skip


def group_commands(module: str) -> Commands:
    """The declarations of one group module (importing it). Imported as an import
    statement imports, so that -X importtime sees it (importlib.import_module does not
    go through that path)."""
    return __import__(f"towerd.client.cli.{module}", fromlist=["COMMANDS"]).COMMANDS


def command_paths() -> frozenset[tuple[str, ...]]:
    """Every command's words, from every group module's declarations."""
    return frozenset(
        path for module in dict.fromkeys(COMMAND_GROUPS.values())
        for path in group_commands(module).paths()
    )  # fmt: skip


def command_path(argv: Sequence[str]) -> tuple[str, ...] | None:
    """The command the arguments name, if plain enough to tell without argparse (an
    option other than a global one before the command, such as --help, leaves it to
    the full parser). Imports the module of that command's group only."""
    words, _given = scan(list(argv))
    module = COMMAND_GROUPS.get(words[0]) if words else None
    if module is None:
        return None
    paths = group_commands(module).paths()
    for length in (1, 2):
        if tuple(words[:length]) in paths:
            return tuple(words[:length])
    return None


def build_parser(only: tuple[str, ...] | None = None) -> argparse.ArgumentParser:
    """The CLI's parser; with ``only``, just the parsers on that command's path."""
    from towerd.client.cli.parsers import Formatter, Parser

    parser = Parser(
        formatter_class=Formatter,
        prog="towerctl",
        description="Talk to the towerd daemon.",
        epilog=EXIT_EPILOG,
    )
    add_global_options(parser, defaults=True)
    parser.add_argument(
        "--version", action="version", version=f"towerctl {VERSION}", help="print the version"
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for word, module in COMMAND_GROUPS.items():
        if only is None or only[0] == word:
            group_commands(module).build(commands, word, only)
    return parser


def parse_and_run(argv: list[str]) -> None:
    """Parse the command line, run the command, exit with its status (hook-report run as
    a hook never gets here: towerd.client.entry.main runs it without a parser)."""
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


def _require_text(args: argparse.Namespace) -> None:
    """Every string argument sent to the daemon must be UTF-8 text (the wire's strings
    are; Python hands undecodable argv bytes over as lone surrogates)."""
    for dest, value in vars(args).items():
        if dest in args.parser.local_paths:
            continue
        for text in value if isinstance(value, list) else [value]:
            if isinstance(text, str) and not is_utf8(text):
                raise BadCommandLine(
                    args.parser,
                    f"argument {_option_name(args.parser, dest)}: not valid UTF-8 "
                    f"({os.fsencode(text)!r}); towerd keeps text: give it in UTF-8",
                )


def _option_name(parser: argparse.ArgumentParser, dest: str) -> str:
    """How the command line spells the argument stored under ``dest`` (--key, SESSION)."""
    for action in parser._actions:
        if action.dest == dest:
            if action.option_strings:
                return action.option_strings[-1]
            return str(action.metavar or dest.upper())
    return dest


def run(args: argparse.Namespace) -> int:
    """Run the parsed command; print its result (or error) as text or JSON."""
    try:
        if getattr(args, "offline", False):
            result = args.run(None, args)
        else:
            with Client(
                args.socket,
                timeout=call_timeout(args),
                principal=args.principal,
                client_name="towerctl",
            ) as client:
                result = args.run(client, args)
        if getattr(args, "raw", False):
            return result  # it printed its own output; this is its exit status
    except UsageError as exc:
        parser = getattr(args, "parser", None)
        return usage_error(str(exc), parser, as_json=args.json, refused=False)
    except Unhealthy as exc:
        if args.json:
            emit(dumps_json(exc.result, indent=2), sys.stdout)
        else:
            say(args.render(exc.result))
        return EXIT_ERROR
    except (TowerdError, LocalFailure) as exc:
        print_error(exc, as_json=args.json)
        if isinstance(exc, LocalFailure):
            return exc.exit_status
        return EXIT_UNAVAILABLE if isinstance(exc, Unavailable) else EXIT_ERROR
    if args.json:
        print_json(result)
    else:
        say(args.render(result))
        if isinstance(result, dict) and result.get("truncated"):
            say("towerctl: the list was cut to fit one answer; narrow it", to_stderr=True)
    return EXIT_OK
