"""towerctl's options that are seconds refuse nan, infinities and values out of range
by the option's name (exit 2, argparse's usage error, JSON with --json), on the lean
path hooks take as on argparse's. Before, ``towerctl --timeout nan ping`` died with a
traceback from ``socket.settimeout`` and ``--timeout 0`` failed every call as "timed
out"."""

from __future__ import annotations

import json
import subprocess

import pytest

from towerd.client.cli.app import COMMAND_GROUPS, build_parser, group_commands
from towerd.client.cli.seconds import Seconds
from towerd_testing import TOWERCTL, Daemon


def declared_options() -> list[tuple[tuple[str, ...], tuple[str, ...], object]]:
    """(command path, option names, its type) of every option declared with a type."""
    found = []
    for module in dict.fromkeys(COMMAND_GROUPS.values()):
        for path, command in group_commands(module).commands.items():
            options = command.options() if callable(command.options) else command.options
            for spec in options:
                if "type" in spec.options:
                    found.append((path, spec.names, spec.options["type"]))
    return found


def test_no_option_is_a_bare_float() -> None:
    """A seconds option declares its range (Seconds); a bare float would take nan."""
    floats = [(path, names) for path, names, kind in declared_options() if kind is float]
    assert not floats, floats
    seconds = [names for _path, names, kind in declared_options() if isinstance(kind, Seconds)]
    assert len(seconds) >= 4, seconds
    global_timeout = next(
        action for action in build_parser()._actions if "--timeout" in action.option_strings
    )
    assert isinstance(global_timeout.type, Seconds)


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "0", "1e-9", "2147484", "1e12"])
@pytest.mark.parametrize("where", ["before", "after"])
def test_a_bad_timeout_is_a_usage_error_not_a_traceback(
    daemon: Daemon, value: str, where: str
) -> None:
    option = [f"--timeout={value}"]
    argv = [*option, "ping"] if where == "before" else ["ping", *option]
    done = subprocess.run(
        [TOWERCTL, "--socket", str(daemon.socket_path), *argv],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, done
    assert f"argument --timeout: '{value}' is out of range: seconds >= 0.001" in done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""


def test_a_bad_timeout_on_the_hook_path_with_json(daemon: Daemon) -> None:
    """`idem claim` goes through the lean parser: the refusal is argparse's, as JSON."""
    done = subprocess.run(
        [TOWERCTL, "--socket", str(daemon.socket_path), "--json", "idem", "claim", "op", "k",
         "--timeout", "nan"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, done
    error = json.loads(done.stdout)["error"]
    assert error["code"] == "usage" and "'nan' is out of range" in error["message"]
    with daemon.client() as client:  # nothing was claimed
        assert client.call("idem.list", {})["keys"] == []


@pytest.mark.parametrize(
    "argv",
    [
        ["top", "--refresh", "nan"],
        ["notify", "--exec-timeout", "0"],
        [
            "effect",
            "run",
            "--run-id",
            "r",
            "--step",
            "s",
            "--kind",
            "git-push",
            "--target",
            "t",
            "--heartbeat",
            "inf",
            "--",
            "true",
        ],  # fmt: skip
        ["lock", "worktree", "--timeout=-1", "--", "true"],
    ],
)
def test_each_seconds_option_refuses_by_name(daemon: Daemon, argv: list[str]) -> None:
    done = subprocess.run(
        [TOWERCTL, "--socket", str(daemon.socket_path), *argv],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, done
    assert "is out of range: seconds" in done.stderr and "Traceback" not in done.stderr


def test_the_lean_parser_takes_a_good_timeout(daemon: Daemon) -> None:
    done = subprocess.run(
        [TOWERCTL, "--socket", str(daemon.socket_path), "ping", "--timeout", "2.5"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "pong", done
    assert Seconds(zero=True)("0") == 0.0
    # The longest wait poll() can make (milliseconds in a C int), answered, not a traceback.
    done = subprocess.run(
        [TOWERCTL, "--socket", str(daemon.socket_path), "ping", "--timeout", "2147483"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "pong", done
