"""towerctl builds only the parser of the command on its command line; these tests keep
that shortcut honest against the full parser."""

from __future__ import annotations

import argparse

import pytest

from towerd.client.cli import COMMAND_PATHS, build_parser, command_path


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
    }  # fmt: skip
    argv = ["--json", *path, *samples.get(path, ["o", "k"] if path[0] == "idem" else [])]
    if path == ("idem", "list"):
        argv = ["--json", "idem", "list"]
    full = vars(build_parser().parse_args(argv))
    lean = vars(build_parser(command_path(argv)).parse_args(argv))
    assert command_path(argv) == path
    assert {k: v for k, v in lean.items() if k not in ("run", "render")} == {
        k: v for k, v in full.items() if k not in ("run", "render")
    }


def test_cli_enumerations_match_the_protocol():
    """The CLI spells the wire's Literals out (importing them costs hooks msgspec)."""
    from typing import get_args

    import msgspec

    from towerd.client import cli
    from towerd.protocol import methods

    assert cli.KV_SCOPES == get_args(methods.KvScope)
    assert cli.WORKER_STATUSES == get_args(methods.WorkerStatus)
    assert cli.DISPATCH_STATUSES == get_args(methods.DispatchStatus)
    assert cli.AUDIT_CATEGORIES == get_args(methods.AuditCategory)
    msgspec.convert({"limit": cli.AUDIT_PAGE}, methods.AuditListParams)  # the largest page
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"limit": cli.AUDIT_PAGE + 1}, methods.AuditListParams)


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
        build_parser(command_path(argv)).parse_args(argv)
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
    ],
)
def test_the_entry_point_spots_hook_report_before_loading_the_cli(argv, expected):
    from towerd.client.entry import hook_report_socket

    is_hook, socket_path = hook_report_socket(argv)
    assert (is_hook, socket_path if is_hook else None) == (
        expected[0],
        expected[1] if expected[0] else None,
    )
