"""``towerctl``: drive towerd from a shell or a hook.

Global options go before or after the command: ``--socket``, ``--json``,
``--principal``, ``--timeout`` (not after the ``--`` of ``run``, ``effect run`` and
``lock worktree``: what follows is the command's). With ``--json`` the result is
printed as JSON on stdout, and an error, a usage error included (code ``usage``), as
``{"error": {"code", "message", "data"}}`` on stdout; without it, readable text on
stdout and errors on stderr (see :mod:`towerd.client.cli.output`).

Exit status: 0 success, 1 the daemon answered an error, 2 bad usage,
3 the daemon could not be reached. ``run``, ``effect run`` and ``lock worktree``
exit with their command's status, or one of their own (see ``EXIT_EPILOG``):
120 the outcome is unknown or uncertain (a person must decide; CMD was not run),
121 in progress, in flight or held elsewhere (CMD was not run: retry later),
126/127 CMD could not be executed / was not found (nothing ran).

One module per command group declares its commands, each with its options, function
and renderer (:mod:`~towerd.client.cli.registry`): ``fleet`` (fleet, session),
``idem``, ``effects`` (run, effect run, lock worktree, effects, leases), ``dispatch``
(dispatch, kv, workers, audit), ``trail`` (hook-report, events, message, top), ``ops``
(ping, status, shutdown, backup, doctor, install-systemd, branch).
:mod:`~towerd.client.cli.app` imports only the group of the command on the command
line. Runs inside hooks, so nothing here imports more than the blocking client (no
anyio, structlog, aiosqlite or msgspec); this package's own import is the output
helpers alone.
"""

from towerd.client.cli.output import (
    LocalFailure,
    UsageError,
    dumps_json,
    print_json,
    printable,
    say,
)
from towerd.client.entry import main

__all__ = ["LocalFailure", "UsageError", "dumps_json", "main", "print_json", "printable", "say"]
