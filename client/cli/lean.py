"""The command lines hooks and wrappers run once per agent event, parsed without argparse.

``towerctl idem claim|complete``, ``claim``, ``release``, ``run --key K -- CMD`` and
``ping`` run in short-lived processes, where argparse (with gettext, locale and re) and
building the command's parser cost more than the call itself. :func:`parse` reads those
command lines from the commands' own declarations (the ``arg(...)`` of their group module,
so there is one declaration of each option) into the namespace argparse would have made,
and :func:`main` runs it through :func:`towerd.client.cli.app.run`, the same function the
argparse path uses: same call, output and exit status.

It takes only the plain forms: the exact option names (``--key K`` or ``--key=K``), the
global options anywhere before ``--``, positionals in one run, values that do not start
with ``-``, UTF-8 text. Anything else (an abbreviated option, ``--help``, a missing or
extra argument, a value argparse would convert differently, a non-UTF-8 argument) returns
None, and the caller hands the line to argparse unchanged, so every error and usage
message is argparse's own. tests/client/test_lean_cli.py checks, with hypothesis, that
whatever this accepts argparse parses to the same namespace.
"""

from __future__ import annotations

from towerd.client.cli.output import is_utf8
from towerd.client.cli.seconds import Seconds

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs hooks ~3 ms
if TYPE_CHECKING:
    from typing import Any

    from towerd.client.cli.registry import Arg, Command

# The commands taken here: (words, group module). Others go to argparse.
LEAN_COMMANDS = {
    ("ping",): "ops",
    ("idem", "claim"): "idem",
    ("idem", "complete"): "idem",
    ("claim",): "paths",
    ("release",): "paths",
    ("run",): "effects",
}
# The global options (registry.add_global_options): dest, conversion (None: a flag).
GLOBALS: dict[str, tuple[str, Any]] = {
    "--socket": ("socket", str),
    "--principal": ("principal", str),
    "--timeout": ("timeout", Seconds()),  # registry.add_global_options declares it
    "--json": ("json", None),
}
GLOBAL_DEFAULTS = {"socket": None, "json": False, "principal": None, "timeout": None}
LOCAL_PATHS = frozenset({"socket"})  # registry.Parser.local_paths: need not be UTF-8
REMAINDER = "..."  # argparse.REMAINDER


class Args:
    """The namespace argparse would have made (``vars()`` gives its attributes)."""

    def __init__(self, **values: Any) -> None:
        self.__dict__.update(values)


class LazyParser:
    """Stands for the command's argparse parser where only an error needs it (the usage
    line of a usage error): built then, from the same command line."""

    def __init__(self, argv: list[str], local_paths: frozenset[str]) -> None:
        self.argv = argv
        self.local_paths = local_paths

    def format_usage(self) -> str:
        from towerd.client.cli.app import build_parser, command_path

        parsed, _unknown = build_parser(command_path(self.argv)).parse_known_args(self.argv)
        return str(parsed.parser.format_usage())


class Unsupported(Exception):
    """A declaration this parser does not take (tests/client/test_lean_cli.py keeps the
    commands of LEAN_COMMANDS free of them)."""


def _dest(spec: Arg) -> str:
    if "dest" in spec.options:
        return str(spec.options["dest"])
    if not spec.names[0].startswith("-"):
        return spec.names[0]
    long = [name for name in spec.names if name.startswith("--")] or list(spec.names)
    return long[0].lstrip("-").replace("-", "_")


def _specs(command: Command) -> tuple[dict[str, tuple[str, Any, Arg]], list[Arg]]:
    """(its options: name -> (dest, conversion or None for a flag, spec), its positionals)."""
    options: dict[str, tuple[str, Any, Arg]] = {}
    positionals = []
    declared = command.options() if callable(command.options) else command.options
    for spec in declared:
        known = {"default", "help", "metavar", "type", "action", "nargs", "required", "choices"}
        if set(spec.options) - known:
            raise Unsupported(f"{spec.names}: {sorted(set(spec.options) - known)}")
        if not spec.names[0].startswith("-"):
            if spec.options.get("nargs") not in (None, "+", REMAINDER):
                raise Unsupported(f"{spec.names}: nargs {spec.options['nargs']!r}")
            positionals.append(spec)
            continue
        action = spec.options.get("action")
        if action == "store_true":
            convert = None
        elif action is None and spec.options.get("nargs") is None:
            convert = spec.options.get("type", str)
            if convert not in (str, int, float) and not isinstance(convert, Seconds):
                raise Unsupported(f"{spec.names}: type {convert!r}")
        else:
            raise Unsupported(f"{spec.names}: action {action!r}")
        for name in spec.names:
            options[name] = (_dest(spec), convert, spec)
    return options, positionals


def _convert(convert: Any, value: str, spec: Arg | None) -> Any:
    try:
        converted = convert(value)
    except Exception:  # noqa: BLE001 - ValueError, or a range's refusal: argparse says which
        return _REFUSED
    if spec is not None and "choices" in spec.options and converted not in spec.options["choices"]:
        return _REFUSED
    return converted


_REFUSED = object()


def parse(argv: list[str]) -> Args | None:
    """The namespace argparse would give for ``argv``, or None: leave it to argparse."""
    values: dict[str, Any] = dict(GLOBAL_DEFAULTS)
    words: list[str] = []
    path: tuple[str, ...] | None = None
    command: Command | None = None
    options: dict[str, tuple[str, Any, Arg]] = {}
    given: list[str] = []  # the positionals, in one run
    runs = 0  # runs of positionals seen (argparse splits them differently: leave it)
    after_dashes: list[str] | None = None
    previous_positional = False
    index = 0
    while index < len(argv):
        token = argv[index]
        index += 1
        if token == "--":
            after_dashes = argv[index:]
            break
        if not token.startswith("-"):
            if path is None:
                words.append(token)
                if tuple(words) in LEAN_COMMANDS:
                    path = tuple(words)
                    command = _command(path)
                    options = _specs(command)[0]
                elif not any(known[: len(words)] == tuple(words) for known in LEAN_COMMANDS):
                    return None
            else:
                if not previous_positional:
                    runs += 1
                given.append(token)
                previous_positional = True
                continue
            previous_positional = False
            continue
        previous_positional = False
        name, equals, value = token.partition("=")
        if name in GLOBALS:
            dest, convert = GLOBALS[name]
            spec = None
        elif name in options:
            dest, convert, spec = options[name]
        else:
            return None  # an option not declared here (--help, an abbreviation): argparse
        if convert is None:
            if equals:
                return None
            values[dest] = True
            continue
        if not equals:
            if index == len(argv) or argv[index].startswith("-"):
                return None
            value = argv[index]
            index += 1
        converted = _convert(convert, value, spec)
        if converted is _REFUSED:
            return None
        values[dest] = converted
    if path is None or command is None or runs > 1:
        return None
    return _namespace(argv, path, command, values, given, after_dashes)


def _namespace(
    argv: list[str],
    path: tuple[str, ...],
    command: Command,
    values: dict[str, Any],
    given: list[str],
    after_dashes: list[str] | None,
) -> Args | None:
    options, positionals = _specs(command)
    local = set(LOCAL_PATHS)
    for _dest_name, _convert_fn, spec in options.values():
        if spec.local_path:
            local.add(_dest(spec))
    for dest, convert, spec in options.values():
        if dest not in values:
            if spec.options.get("required"):
                return None
            values[dest] = False if convert is None else spec.options.get("default")
    if positionals and positionals[-1].options.get("nargs") == REMAINDER:
        # run: options, then -- CMD...; the remainder keeps its "--", as argparse's does
        if given or not after_dashes:
            return None
        *fixed, remainder = positionals
        if fixed:
            return None
        values[_dest(remainder)] = ["--", *after_dashes]
        if remainder.local_path:
            local.add(_dest(remainder))
    else:
        if after_dashes is not None:
            return None
        if [spec.options.get("nargs") for spec in positionals] == ["+"]:
            if not given:
                return None
            values[_dest(positionals[0])] = list(given)
            if positionals[0].local_path:
                local.add(_dest(positionals[0]))
        elif all(spec.options.get("nargs") is None for spec in positionals):
            if len(given) != len(positionals):
                return None
            for spec, value in zip(positionals, given, strict=True):
                values[_dest(spec)] = value
        else:
            return None
    for dest, value in values.items():  # app._require_text: text sent must be UTF-8
        if dest in local:
            continue
        for text in value if isinstance(value, list) else [value]:
            if isinstance(text, str) and not is_utf8(text):
                return None
    values["command"] = path[0]
    if len(path) == 2:
        values[f"{path[0]}_command"] = path[1]
    values.update(run=command.run, render=command.render, parser=LazyParser(argv, frozenset(local)))
    if command.offline:
        values["offline"] = True
    if command.raw:
        values["raw"] = True
    return Args(**values)


def _command(path: tuple[str, ...]) -> Command:
    module = LEAN_COMMANDS[path]
    commands = __import__(f"towerd.client.cli.{module}", fromlist=["COMMANDS"]).COMMANDS
    return commands.commands[path]


def main(argv: list[str]) -> None:
    """Run ``argv`` if it is one of the plain command lines taken here (and exit);
    return without doing anything otherwise."""
    args = parse(argv)
    if args is None:
        return
    import sys

    from towerd.client.cli.app import run

    sys.exit(run(args))  # type: ignore[arg-type]
