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
