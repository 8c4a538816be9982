"""``towerctl``'s entry point. Every agent hook runs ``towerctl hook-report``, so that
command is recognised here and run without loading the CLI module (argparse and the
command table cost about 3 ms a hook); everything else goes to ``towerd.client.cli``.
"""

from __future__ import annotations

import sys

_GLOBAL_OPTIONS_WITH_VALUES = ("--socket", "--principal", "--timeout")


def hook_report_socket(argv: list[str]) -> tuple[bool, str | None]:
    """(is this ``hook-report``?, the ``--socket`` given before it, if any)."""
    socket_path = None
    index = 0
    while index < len(argv):
        arg = argv[index]
        if arg in _GLOBAL_OPTIONS_WITH_VALUES:
            if arg == "--socket" and index + 1 < len(argv):
                socket_path = argv[index + 1]
            index += 2
        elif arg.startswith("--socket="):
            socket_path = arg.partition("=")[2]
            index += 1
        elif arg == "--json" or arg.startswith(("--principal=", "--timeout=")):
            index += 1
        else:
            return arg == "hook-report", socket_path
    return False, None


def main() -> None:
    argv = sys.argv[1:]
    is_hook, socket_path = hook_report_socket(argv)
    if is_hook:
        # Silent and exit 0 whatever follows on the command line: it runs inside agents.
        from towerd.client.hook_report import report

        sys.exit(report(socket_path=socket_path))
    from towerd.client.cli import main as cli_main

    cli_main(argv)
