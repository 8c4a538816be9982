"""towerctl's argparse classes: imported only when a parser is built (a command line that
towerd.client.cli.lean parses never imports argparse)."""

from __future__ import annotations

import argparse
import os
import sys

from towerd.client.cli.registry import BadCommandLine

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs hooks ~3 ms
if TYPE_CHECKING:
    from typing import NoReturn


class Parser(argparse.ArgumentParser):
    """argparse's parser, raising :class:`BadCommandLine` instead of printing and exiting,
    so that main() can report the error as JSON under ``--json``.

    ``local_paths``: the destinations of its arguments that name files on this machine
    (any bytes the OS takes are fine there; everything else sent to the daemon must be
    UTF-8 text).
    """

    local_paths: frozenset[str] = frozenset({"socket"})

    def error(self, message: str) -> NoReturn:
        raise BadCommandLine(self, message)


class Formatter(argparse.HelpFormatter):
    """argparse's formatter, minus its `import shutil` (bz2, lzma, ...: ~2 ms per hook):
    argparse builds a formatter for every add_argument, and the default one imports
    shutil to measure the terminal."""

    def __init__(self, prog: str) -> None:
        try:
            columns = os.get_terminal_size(sys.stderr.fileno()).columns
        except (OSError, ValueError):
            columns = int(os.environ.get("COLUMNS", "80") or 80)
        super().__init__(prog, width=max(columns - 2, 40))
