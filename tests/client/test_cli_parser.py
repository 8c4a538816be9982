"""towerctl imports only the group module and builds only the parser of the command on
its command line; these tests keep that shortcut honest against the full parser."""

from __future__ import annotations

import argparse
import importlib
import pkgutil

import pytest

import towerd.client.cli
from towerd.client.cli import main
from towerd.client.cli.app import COMMAND_GROUPS, build_parser, command_path, command_paths

COMMAND_PATHS = command_paths()
cli_package = towerd.client.cli.__name__


def leaf_paths(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> set:
    paths = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                paths |= leaf_paths(sub, (*prefix, name))
            return paths
    return {prefix}


def test_command_paths_list_every_command_of_the_full_parser():
    assert leaf_paths(build_parser()) == COMMAND_PATHS


def test_each_first_word_is_routed_to_the_module_that_declares_it():
    """COMMAND_GROUPS, read before any group module is imported, names for each first word
    the one module of towerd.client.cli whose declarations hold it."""
    declared = []
    for module in pkgutil.iter_modules(towerd.client.cli.__path__):
        if module.name == "__main__":  # importing it runs towerctl
            continue
        commands = getattr(
            importlib.import_module(f"{cli_package}.{module.name}"), "COMMANDS", None
        )
        if commands is not None:
            declared += [(word, module.name) for word in commands.top_words()]
    assert sorted(declared) == sorted(COMMAND_GROUPS.items())


@pytest.mark.parametrize(
    ("argv", "path"),
    [
        (["ping"], ("ping",)),
        (["--socket", "/s", "--json", "idem", "claim", "op", "k"], ("idem", "claim")),
        (["--timeout=3", "fleet", "list", "--limit", "2"], ("fleet", "list")),
        (["--help"], None),
        (["fleet"], None),
        (["fleet", "nope"], None),
        (["nope"], None),
        (["--json", "kv", "set", "global", "k", "1"], ("kv", "set")),
        (["workers", "--status", "active"], ("workers",)),
        (["dispatch", "get", "7"], ("dispatch", "get")),
        (["--socket=/s", "audit", "--limit", "3"], ("audit",)),
        (["dispatch"], None),
        # Global options after the command: the command is still found.
        (["status", "--json"], ("status",)),
        (["fleet", "restore-plan", "--json", "--socket", "/s"], ("fleet", "restore-plan")),
        (["fleet", "--timeout", "3", "list"], ("fleet", "list")),
        (["--version"], None),
    ],
)
def test_command_path_is_found_or_left_to_argparse(argv, path):
    assert command_path(argv) == path


@pytest.mark.parametrize("path", sorted(COMMAND_PATHS))
def test_the_lean_parser_parses_like_the_full_one(path):
    """For each command, the parser built for it alone accepts its --help-free form and
    yields the same namespace as the full parser."""
    samples = {
        ("fleet", "get"): ["x"], ("fleet", "import-legacy"): ["f.json"],
        ("fleet", "adopt"): ["d"], ("session", "update"): ["s", "--name", "n"],
        ("session", "remove"): ["s"], ("session", "register"): ["--cwd", "/", "--agent", "a"],
        ("idem", "resolve"): ["o", "k", "--outcome", "abandoned"], ("backup",): ["/tmp/b.db"],
        ("kv", "get"): ["worker", "k", "--scope-id", "w1"], ("kv", "set"): ["global", "k", "-1"],
        ("kv", "delete"): ["milestone", "k"], ("kv", "list"): ["global"],
        ("workers",): ["--status", "crashed", "--project-root", "/p"],
        ("dispatch", "list"): ["--unit-type", "task", "--status", "failed", "--limit", "5"],
        ("dispatch", "get"): ["7"],
        ("dispatch", "stuck"): ["--project-root", "/p", "--window", "4"],
        ("audit",): ["--category", "lease", "--type", "lease-granted", "--limit", "600"],
        ("events", "list"): ["agent-1", "--kind", "Stop", "--limit", "5"],
        ("events", "tail"): ["--kind", "Notification"],
        ("message", "send"): ["s", "hello", "--key", "k1"], ("message", "list"): ["s"],
        ("message", "ack"): ["m", "--status", "delivered"], ("top",): ["--refresh", "0.5"],
        ("claim",): ["src", "a.py", "--ttl", "2h"], ("release",): ["a.py", "--session", "s"],
    }  # fmt: skip
    argv = ["--json", *path, *samples.get(path, ["o", "k"] if path[0] == "idem" else [])]
    if path == ("idem", "list"):
        argv = ["--json", "idem", "list"]
    full = vars(build_parser().parse_args(argv))
    lean = vars(build_parser(command_path(argv)).parse_args(argv))
    assert command_path(argv) == path
    made_here = ("run", "render", "parser")  # functions and parser objects of each build
    assert {k: v for k, v in lean.items() if k not in made_here} == {
        k: v for k, v in full.items() if k not in made_here
    }
    assert lean["parser"].prog == full["parser"].prog == " ".join(("towerctl", *path))


def test_cli_enumerations_are_the_protocols():
    """The wire's Literals and the CLI's choices come from one declaration
    (protocol/fields.py: importing methods.py would cost a hook msgspec)."""
    from typing import get_args

    import msgspec

    from towerd.client.cli import dispatch
    from towerd.protocol import methods

    assert dispatch.KV_SCOPES == get_args(methods.KvScope)
    assert dispatch.WORKER_STATUSES == get_args(methods.WorkerStatus)
    assert dispatch.DISPATCH_STATUSES == get_args(methods.DispatchStatus)
    assert dispatch.AUDIT_CATEGORIES == get_args(methods.AuditCategory)
    msgspec.convert({"limit": dispatch.AUDIT_PAGE}, methods.AuditListParams)  # the largest page
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"limit": dispatch.AUDIT_PAGE + 1}, methods.AuditListParams)


@pytest.mark.parametrize(
    "argv",
    [
        ["kv", "get", "local", "k"],  # not a scope
        ["kv", "set", "global", "k"],  # no value
        ["kv", "list"],  # no scope
        ["workers", "--status", "gone"],
        ["dispatch", "list", "--status", "done"],
        ["dispatch", "list", "--limit", "0"],
        ["dispatch", "get", "seven"],
        ["dispatch", "get"],
        ["audit", "--category", "kv"],
        ["audit", "--limit", "-1"],
    ],
)
def test_bad_new_command_lines_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert "usage: towerctl" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["hook-report"], (True, None)),
        (["--socket", "/s", "hook-report"], (True, "/s")),
        (["--socket=/t", "--json", "--timeout", "3", "hook-report", "extra"], (True, "/t")),
        (["--principal=p", "hook-report"], (True, None)),
        (["ping"], (False, None)),
        (["--socket", "/s", "events", "tail"], (False, "/s")),
        ([], (False, None)),
        # Global options after it count too; --help is for a person: the CLI prints it.
        (["hook-report", "--socket", "/u", "--json"], (True, "/u")),
        (["hook-report", "--socket=/u"], (True, "/u")),
        (["hook-report", "--help"], (False, None)),
        (["--json", "hook-report", "-h"], (False, None)),
        (["run", "--key", "k", "--", "hook-report"], (False, None)),
        # towerctl hook, with its own options, likewise.
        (["hook", "--agent", "codex", "--guard", "warn"], ("hook", None)),
        (["hook", "--agent=claude", "--socket", "/v"], ("hook", "/v")),
        (["hook", "--help"], (False, None)),
        (["hooks", "status"], (False, None)),
    ],
)
def test_the_entry_point_spots_the_hook_commands_before_loading_the_cli(argv, expected):
    from towerd.client.entry import hook_command

    command, socket_path = hook_command(argv)
    is_hook = expected[0] is not False
    want = ("hook-report" if expected[0] is True else expected[0]) if is_hook else None
    assert (command, socket_path if command else None) == (want, expected[1] if is_hook else None)


@pytest.mark.parametrize(
    ("argv", "words", "given"),
    [
        (["--json", "fleet", "list", "--limit", "2"], ["fleet", "list"], {"--json": ""}),
        (["fleet", "list", "--socket", "/s", "--json"], ["fleet", "list"],
         {"--socket": "/s", "--json": ""}),
        (["--timeout=3", "status", "--principal", "p"], ["status"],
         {"--timeout": "3", "--principal": "p"}),
        # After --, everything is the command's own: never towerctl's options.
        (["run", "--key", "k", "--", "echo", "--json", "--socket", "x"], ["run"], {}),
        (["run", "--json", "--key", "k", "--", "echo", "--help"], ["run"], {"--json": ""}),
        (["lock", "worktree", "--timeout", "60", "--", "git", "gc"], ["lock", "worktree"],
         {"--timeout": "60"}),
        (["ping", "--help"], ["ping"], {"--help": ""}),
        (["--socket"], [], {}),  # the value is missing: left to argparse
    ],
)  # fmt: skip
def test_the_one_scanner_reads_global_options_before_and_after_the_command(argv, words, given):
    from towerd.client.entry import scan

    assert scan(argv) == (words, given)


@pytest.mark.parametrize(
    "argv",
    [
        ["status", "--json"],
        ["fleet", "restore-plan", "--json"],
        ["fleet", "list", "--json", "--socket", "/s", "--principal", "p", "--timeout", "4"],
        ["--json", "fleet", "list", "--socket=/s", "--principal=p", "--timeout=4"],
        ["fleet", "--json", "--socket", "/s", "list", "--principal", "p", "--timeout", "4"],
    ],
)
def test_global_options_parse_the_same_after_the_command(argv):
    args = build_parser(command_path(argv)).parse_args(argv)
    assert args.json is True
    if "fleet" in argv and "list" in argv:
        assert (args.socket, args.principal, args.timeout) == ("/s", "p", 4.0)


def test_after_dash_dash_nothing_is_parsed_as_a_towerctl_option():
    argv = ["run", "--json", "--key", "k", "--", "echo", "--json", "--socket", "x", "--help"]
    args = build_parser(command_path(argv)).parse_args(argv)
    assert args.json is True and args.socket is None and args.key == "k"
    assert [a for a in args.argv if a != "--"] == ["echo", "--json", "--socket", "x", "--help"]
    argv = ["run", "--key", "k", "--", "echo", "--json"]
    args = build_parser(command_path(argv)).parse_args(argv)
    assert args.json is False


def test_lock_worktree_keeps_its_own_timeout_after_the_command():
    """``lock worktree --timeout S`` is the wait for the lock, as documented; the global
    --timeout (answers) still goes before the command."""
    argv = ["--timeout", "4", "lock", "worktree", "--timeout", "60", "--", "true"]
    args = build_parser(command_path(argv)).parse_args(argv)
    assert (args.timeout, args.wait_timeout) == (4.0, 60.0)
