"""``towerctl``'s entry point. Every agent hook runs ``towerctl hook`` (or the older
``towerctl hook-report``), so those commands are recognised here and run without loading
the CLI (argparse and the command
declarations cost about 3 ms a hook); the other commands hooks and wrappers run per
event (``idem claim|complete``, ``claim``, ``release``, ``run``, ``ping``) go to
``towerd.client.cli.lean``, which runs their plain command lines without argparse;
everything else goes to the parser of ``towerd.client.cli.app``. Hooks run this through
``client/_hook_launch.py`` (``python -I -S``: no site), which ``hooks install`` wires.

:func:`scan` reads the command words and global options short of argparse (lean.py
reads the whole line of the commands it takes, from their declarations): this module
uses it to spot the hook commands, the CLI to build only the parser of the command named
and to know, when argparse refuses the line, whether the error is to be JSON.
"""

from __future__ import annotations

import sys

GLOBAL_OPTIONS_WITH_VALUES = ("--socket", "--principal", "--timeout")
HELP_OPTIONS = ("-h", "--help")


def scan(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """(the leading command words, the global options given).

    The words are the arguments that are not options, up to the first option that is not
    a global one (``fleet list`` in ``--json fleet list --limit 2``). The global options
    (``--json``, ``--socket``, ``--principal``, ``--timeout``; ``-h``/``--help`` noted as
    ``--help``) are taken before or after the command, up to ``--``: what follows ``--``
    is a command's own (``run``, ``effect run``, ``lock worktree``). The last value of an
    option wins, as with argparse; ``--json`` and ``--help`` map to "".
    """
    words: list[str] = []
    given: dict[str, str] = {}
    leading = True
    index = 0
    while index < len(argv):
        arg = argv[index]
        index += 1
        if arg == "--":
            break
        name, equals, value = arg.partition("=")
        if name in GLOBAL_OPTIONS_WITH_VALUES:
            if not equals:
                if index == len(argv):
                    break  # its value is missing: argparse says so
                value = argv[index]
                index += 1
            given[name] = value
        elif arg == "--json":
            given["--json"] = ""
        elif arg.startswith("-"):
            if arg in HELP_OPTIONS:
                given["--help"] = ""
            leading = False
        elif leading:
            words.append(arg)
    return words, given


HOOK_COMMANDS = ("hook", "hook-report")  # run inside agents, without the CLI


def hook_command(argv: list[str]) -> tuple[str | None, str | None]:
    """(``hook`` or ``hook-report`` when run as a hook, i.e. without ``--help``, else
    None; its ``--socket``)."""
    words, given = scan(argv)
    if words[:1] and words[0] in HOOK_COMMANDS and "--help" not in given:
        return words[0], given.get("--socket")
    return None, None


def standard_descriptors_opened() -> None:
    """Open /dev/null on a descriptor 0-2 that towerctl started without (``>&-``, ``2>&-``):
    else the first socket or pipe it opens takes that number, and CMD's output, which
    ``run`` and ``effect run`` copy to descriptor 1 or 2, would go into the daemon's
    connection or CMD's own pipe. (Python then has ``sys.stdout`` None: prints are lost.)"""
    import os

    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)  # the lowest free number: this one
            if null != fd:
                os.dup2(null, fd)
                os.close(null)


def main(argv: list[str] | None = None) -> None:
    """Run towerctl on ``argv`` (default: the process's arguments) and exit."""
    argv = sys.argv[1:] if argv is None else argv
    command, socket_path = hook_command(argv)
    # Silent and exit 0 whatever follows on the command line: they run inside agents.
    if command == "hook":
        from towerd.client.agent_hook import run

        sys.exit(run(argv))
    if command == "hook-report":
        from towerd.client.hook_report import report

        sys.exit(report(socket_path=socket_path))
    standard_descriptors_opened()
    # The other commands hooks and wrappers run per event (idem claim, run --key, ...):
    # parsed without argparse when plain enough, else by argparse below.
    from towerd.client.cli.lean import main as lean_main

    lean_main(argv)
    from towerd.client.cli.app import parse_and_run

    parse_and_run(argv)
