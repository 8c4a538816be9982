"""What towerctl prints, and how it reports a failure: one module for every command group
and for the modules behind the commands (exactly_once, locks, trail, top).

Text for a terminal goes through :func:`printable`: a stored name, cwd or message may
hold escape sequences, and printing them raw would let whoever wrote them move the
cursor, retitle the window or break a table. JSON output is exact (``json.dumps``
escapes every control character).

Stdlib only, and no argparse: the modules that import this one are imported without the
parser, and importing this one never imports them (no import cycle to dodge).
"""

from __future__ import annotations

import sys
import time

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs hooks ~3 ms
if TYPE_CHECKING:
    import argparse
    from collections.abc import Sequence
    from types import ModuleType
    from typing import Any

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


class UsageError(Exception):
    """Bad command-line input that argparse cannot see (invalid JSON, unreadable file)."""


class LocalFailure(Exception):
    """An offline command failed on this machine (no daemon involved): reported like a
    daemon error, ``code``, ``message``, ``data``; exit ``exit_status`` (default 1)."""

    def __init__(
        self,
        code: str,
        message: str,
        data: dict[str, Any] | None = None,
        exit_status: int = EXIT_ERROR,
    ) -> None:
        super().__init__(message)
        self.code, self.message, self.data = code, message, data or {}
        self.exit_status = exit_status

    def to_wire(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "data": self.data}


class Unhealthy(Exception):
    """An offline command's report says something failed (doctor found a problem, a
    branch cleanup step failed): print the report as usual, exit 1."""

    def __init__(self, result: dict[str, Any]) -> None:
        super().__init__("the report says something failed")
        self.result = result


# --- input that is text or JSON ----------------------------------------------------------


def lazy_json() -> ModuleType:
    """json on demand: it pulls in re, which a plain `towerctl ping` does not need."""
    import json

    return json


def json_arg(text: str | None, what: str) -> Any:
    """A JSON option's value (``None`` if not given); invalid JSON is a usage error."""
    if text is None:
        return None
    try:
        return lazy_json().loads(text)
    except ValueError as exc:
        raise UsageError(f"{what} is not valid JSON: {exc}") from None


def is_utf8(text: str) -> bool:
    """Whether ``text`` is UTF-8 text (Python hands undecodable argv bytes over as lone
    surrogates, which no wire string can carry)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


# --- text for a person -------------------------------------------------------------------


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
    emit(printable_lines(text), sys.stderr if to_stderr else sys.stdout)


def emit(text: str, stream: Any) -> None:
    """One line to ``stream``, now. A reader that has gone (a closed pipe) loses the
    rest of the output, not the command: the stream goes to /dev/null and towerctl
    goes on to its exit status (a `run`'s is CMD's, already recorded), where a
    BrokenPipeError traceback and exit 1 stood in for it."""
    if stream is None:  # started with that descriptor closed
        return
    try:
        print(text, file=stream)
        stream.flush()
    except BrokenPipeError:
        import os

        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, stream.fileno())
        os.close(null)


# --- JSON for a program ------------------------------------------------------------------


def dumps_json(value: Any, **options: Any) -> str:
    """JSON for stdout: exact, and safe for a terminal as it is (with ``ensure_ascii``,
    json.dumps escapes every character outside printable ASCII, controls included)."""
    return lazy_json().dumps(value, default=_jsonable, **options)


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes | bytearray):
        import base64

        return base64.b64encode(value).decode()
    raise TypeError(f"cannot show {type(value).__name__} as JSON")


def print_json(result: Any) -> None:
    """A command's result under ``--json``."""
    emit(dumps_json(result, indent=2, sort_keys=True), sys.stdout)


# --- errors ------------------------------------------------------------------------------


def print_error(error: Any, *, as_json: bool) -> None:
    """A daemon's error, or a :class:`LocalFailure`, as towerctl reports every error:
    ``{"error": {"code", "message", "data"}}`` on stdout with ``--json``, else one
    ``towerctl: CODE: MESSAGE`` line on stderr."""
    if as_json:
        emit(dumps_json({"error": error.to_wire()}), sys.stdout)
    else:
        say(f"towerctl: {error.code}: {error.message}", to_stderr=True)


def usage_error(
    message: str, parser: argparse.ArgumentParser | None, *, as_json: bool, refused: bool
) -> int:
    """Report bad usage, exit 2. With --json, ``{"error": {"code": "usage", "message",
    "data": {"usage"}}}`` on stdout; else on stderr, as argparse does when argparse
    ``refused`` the line, or one ``towerctl: message`` line when a command did."""
    usage = parser.format_usage().strip() if parser is not None else None
    if as_json:
        data = {"usage": " ".join(usage.split())} if usage is not None else {}
        emit(dumps_json({"error": {"code": "usage", "message": message, "data": data}}), sys.stdout)
    elif refused and parser is not None:
        say(f"{usage}\n{parser.prog}: error: {message}", to_stderr=True)
    else:
        say(f"towerctl: {message}", to_stderr=True)
    return EXIT_USAGE


# --- tables and key: value lines ---------------------------------------------------------


def is_time(key: str) -> bool:
    """Fields holding milliseconds since the epoch, shown as UTC times."""
    return isinstance(key, str) and (key.endswith("_at") or key in ("ts", "at"))


def when(millis: Any) -> str:
    if not isinstance(millis, int):
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(millis / 1000))


def cell(value: Any) -> str:
    """A value as one line of a table or of ``key: value`` lines (a stored newline is
    shown as ``\\n``, so it cannot start a row of its own)."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, dict | list):
        return dumps_json(value, sort_keys=True)
    return printable(str(value))


def clip(text: str, width: int = 60) -> str:
    """One line of at most ``width`` characters (whitespace runs become one space)."""
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


def table(rows: list[dict[str, Any]], columns: Sequence[tuple[str, str]]) -> str:
    """Rows as aligned columns, ``columns`` being (key, TITLE) pairs."""
    cells = [[title for _key, title in columns]]
    for row in rows:
        cells.append(
            [when(row.get(key)) if is_time(key) else cell(row.get(key)) for key, _ in columns]
        )
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    return "\n".join(
        "  ".join(text.ljust(width) for text, width in zip(line, widths, strict=True)).rstrip()
        for line in cells
    )


def pairs(mapping: dict[str, Any], indent: str = "") -> str:
    """Nested ``key: value`` lines."""
    lines = []
    for key, value in mapping.items():
        name = cell(key)
        if isinstance(value, dict) and value:
            lines.append(f"{indent}{name}:")
            lines.append(pairs(value, indent + "  "))
        else:
            shown = when(value) if is_time(key) else cell(value)
            lines.append(f"{indent}{name}: {shown}")
    return "\n".join(lines)


def render(result: Any) -> str:
    """The default renderer: nested ``key: value`` lines."""
    return pairs(result) if isinstance(result, dict) else cell(result)


def with_cursor(text: str, result: dict[str, Any], key: str, label: str) -> str:
    """A rendered page, then how to ask for the next one if ``result[key]`` says so."""
    cursor = result.get(key)
    return text + (f"\n{label}{cursor}" if cursor is not None else "")
