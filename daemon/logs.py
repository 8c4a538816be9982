"""structlog set-up: JSON lines for machines, readable lines for people.

JSON when stderr is not a terminal or goes to the journal (``JOURNAL_STREAM``);
under the journal each line also carries a ``<N>`` priority prefix so
``journalctl -p warning`` works. Each line carries its context as keyword
arguments where it is logged (the server passes a request's method, principal,
peer pid and duration); nothing is bound implicitly.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import structlog

_JOURNAL_PRIORITY = {"critical": 2, "error": 3, "warning": 4, "info": 6, "debug": 7}


def _journal_priority(_logger: Any, method_name: str, line: str) -> str:
    return f"<{_JOURNAL_PRIORITY.get(method_name, 6)}>{line}"


def configure_logging(level: str = "info", *, json_lines: bool | None = None) -> None:
    under_journal = "JOURNAL_STREAM" in os.environ
    if json_lines is None:
        json_lines = under_journal or not sys.stderr.isatty()
    processors: list[Any] = [
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if json_lines:
        processors += [structlog.processors.dict_tracebacks, structlog.processors.JSONRenderer()]
        if under_journal:
            processors.append(_journal_priority)
    else:
        processors.append(structlog.dev.ConsoleRenderer())
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
