"""How a command group declares its commands, and how their argparse parsers are built.

argparse itself is imported only when a parser is built (towerd.client.cli.parsers): a
command that towerd.client.cli.lean parses runs its declared function without it.

Each group module holds one :class:`Commands` and declares every command in one place:
its words, help and options in the ``@COMMANDS.command(...)`` decorator, its function
under it, its renderer just above. Nothing is built at import: :mod:`towerd.client.cli.app`
asks a group for the parsers of the command on the command line only (building all ~45
costs ~4 ms of a hook's budget).
"""

from __future__ import annotations

from towerd.client.cli.output import render
from towerd.client.cli.seconds import Seconds
from towerd.protocol import fields

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs hooks ~3 ms
if TYPE_CHECKING:
    import argparse
    from collections.abc import Callable, Iterable, Sequence
    from typing import Any, TypeVar

    from towerd.client.cli.parsers import Parser
    from towerd.client.sync import Client

    Run = Callable[[Client, argparse.Namespace], Any]
    Render = Callable[[Any], str]
    Options = Sequence["Arg"] | Callable[[], Sequence["Arg"]]
    RunT = TypeVar("RunT", bound=Callable[..., Any])


class BadCommandLine(Exception):
    """argparse refused the command line: ``parser`` (the command's) says how to call it."""

    def __init__(self, parser: argparse.ArgumentParser, message: str) -> None:
        super().__init__(message)
        self.parser = parser
        self.message = message


def add_global_options(parser: argparse.ArgumentParser, *, defaults: bool) -> None:
    """--socket, --json, --principal, --timeout: on towerctl's parser with their defaults;
    on each command's parser too (defaults=False: given there, they override), so that
    they are taken after the command as well as before it."""
    import argparse

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
        "--timeout",
        type=Seconds(),
        default=default(None),
        help=f"seconds to wait for an answer (default {DEFAULT_TIMEOUT:g}; `fleet restore`: "
        "for each session's SessionStart, default 60)",
    )


DEFAULT_TIMEOUT = fields.CALL_TIMEOUT_S  # seconds towerctl waits when --timeout is not given


def call_timeout(args: argparse.Namespace) -> float:
    """The seconds to wait for the daemon's answer: --timeout, else the default."""
    return DEFAULT_TIMEOUT if args.timeout is None else float(args.timeout)


class Arg:
    """One ``add_argument`` call, declared before any parser exists."""

    __slots__ = ("local_path", "names", "options")

    def __init__(self, names: tuple[str, ...], options: dict[str, Any], local_path: bool) -> None:
        self.names, self.options, self.local_path = names, options, local_path


def arg(*names: str, local_path: bool = False, **options: Any) -> Arg:
    """``parser.add_argument(*names, **options)``, to come. ``local_path``: the argument
    names a file on this machine, so it need not be UTF-8 text."""
    return Arg(names, options, local_path)


# Options more than one group's commands take.
REPO = arg(
    "--repo",
    default=".",
    metavar="PATH",
    help="any path in the repository (default: .)",
    local_path=True,
)


class Command:
    """One command: the words that name it, its help, options, function and renderer.
    ``offline``: it runs without a client (``run`` gets None); ``raw``: it prints its own
    output and returns its exit status."""

    __slots__ = ("epilog", "help", "offline", "options", "path", "raw", "render", "run")

    def __init__(
        self,
        path: tuple[str, ...],
        run: Run,
        help: str,
        render: Render,
        options: Options,
        *,
        offline: bool,
        raw: bool,
        epilog: str | None,
    ) -> None:
        self.path, self.run, self.help, self.render = path, run, help, render
        self.options, self.offline, self.raw, self.epilog = options, offline, raw, epilog

    def build(self, subparsers: Any) -> argparse.ArgumentParser:
        """Its parser, added to ``subparsers`` (towerctl's, or its group word's)."""
        extra = {"epilog": self.epilog} if self.epilog is not None else {}
        p = add_subparser(subparsers, self.path[-1], self.help, **extra)
        p.set_defaults(run=self.run, render=self.render, parser=p)
        local = set(p.local_paths)
        for spec in self.options() if callable(self.options) else self.options:
            action = p.add_argument(*spec.names, **spec.options)
            if spec.local_path:
                local.add(action.dest)
        p.local_paths = frozenset(local)
        if self.offline:
            p.set_defaults(offline=True)
        if self.raw:
            p.set_defaults(raw=True)
        return p


def add_subparser(subparsers: Any, name: str, help: str, **extra: Any) -> Parser:
    """A command's or a group word's parser, global options included."""
    from towerd.client.cli.parsers import Formatter

    # "resolve": an option of the command's own (lock worktree's --timeout) replaces
    # the global option of that name after the command.
    p = subparsers.add_parser(
        name, help=help, description=help, formatter_class=Formatter,
        conflict_handler="resolve", **extra,
    )  # fmt: skip
    add_global_options(p, defaults=False)
    return p


class Commands:
    """The commands of one group module, in declaration order (the order of --help)."""

    def __init__(self) -> None:
        self.words: dict[str, str] = {}  # a word that only groups subcommands: its help
        self.commands: dict[tuple[str, ...], Command] = {}

    def group(self, word: str, help: str) -> None:
        """Declare ``word`` (``fleet``) as the first word of the two-word commands that
        follow (``fleet list``)."""
        self.words[word] = help

    def command(
        self,
        *path: str,
        help: str,
        render: Render = render,
        options: Options = (),
        offline: bool = False,
        raw: bool = False,
        epilog: str | None = None,
    ) -> Callable[[RunT], RunT]:
        """Declare the command ``path`` (``"ping"`` or ``"fleet", "list"``) run by the
        decorated function, ``function(client, args) -> result``."""
        if len(path) != (2 if path[0] in self.words else 1):
            raise ValueError(f"{' '.join(path)}: a command is one word, or a group and one")

        def register(run: RunT) -> RunT:
            self.commands[path] = Command(
                path, run, help, render, options, offline=offline, raw=raw, epilog=epilog
            )
            return run

        return register

    def top_words(self) -> list[str]:
        """The first words of its commands, in declaration order."""
        return list(dict.fromkeys(path[0] for path in self.commands))

    def paths(self) -> Iterable[tuple[str, ...]]:
        return self.commands.keys()

    def build(self, subparsers: Any, word: str, only: tuple[str, ...] | None) -> None:
        """Add the parsers of ``word`` to towerctl's ``subparsers``: with ``only`` (the
        command on the command line), just those on its path."""
        if word not in self.words:
            self.commands[(word,)].build(subparsers)
            return
        p = add_subparser(subparsers, word, self.words[word])
        p.set_defaults(run=None, render=render, parser=p)
        sub = p.add_subparsers(dest=f"{word}_command", required=True, metavar="SUBCOMMAND")
        for path, command in self.commands.items():
            if path[0] == word and (only is None or only[:2] == path):
                command.build(sub)
