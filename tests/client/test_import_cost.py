"""Hooks run towerctl and the blocking client on every agent event. Beyond what a bare
stdlib socket client loads, they may import towerd's own small modules and, for the
CLI, argparse; never msgspec (~40 ms here), typing, anyio, structlog, aiosqlite or
asyncio (50-200 ms each). The figures are in bench/oneshot.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from towerd_testing import TOWERCTL

FORBIDDEN = ("msgspec", "typing", "anyio", "structlog", "aiosqlite", "asyncio", "pathlib")
CLI_EXTRAS = {"argparse", "gettext", "locale", "_locale"}

FLOOR = """
import socket, struct, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(sys.argv[1])
"""


def imported_modules(command: list[str], stdin: str | None = None, **env_vars: str) -> set[str]:
    env = {**os.environ, "PYTHONPROFILEIMPORTTIME": "1", **env_vars}
    result = subprocess.run(
        command, input=stdin, capture_output=True, text=True, env=env, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return {
        line.rsplit("|", 1)[1].strip()
        for line in result.stderr.splitlines()
        if line.startswith("import time:") and "|" in line
    }


def extras_over_floor(daemon, command: list[str], **kwargs: str) -> set[str]:
    floor = imported_modules([sys.executable, "-c", FLOOR, str(daemon.socket_path)])
    return imported_modules(command, **kwargs) - floor


def test_towerctl_imports_only_argparse_and_its_own_modules(daemon):
    extras = extras_over_floor(daemon, [TOWERCTL, "--socket", str(daemon.socket_path), "ping"])
    assert "towerd.client.sync" in extras  # the measurement saw the real import path
    assert {m for m in extras if not m.startswith("towerd")} <= CLI_EXTRAS
    assert not [m for m in extras if m.split(".")[0] in FORBIDDEN]


@pytest.mark.parametrize(
    ("command", "group"),
    [
        (["ping"], "ops"),
        (["fleet", "list"], "fleet"),
        (["idem", "list"], "idem"),
        (["leases"], "effects"),
        (["kv", "list", "global"], "dispatch"),
        (["events", "list"], "trail"),
    ],
)
def test_towerctl_imports_the_module_of_its_command_group_alone(daemon, command, group):
    """Each command line loads the declarations of its own command group, not the others'."""
    from towerd.client.cli.app import COMMAND_GROUPS

    extras = extras_over_floor(daemon, [TOWERCTL, "--socket", str(daemon.socket_path), *command])
    groups = {f"towerd.client.cli.{module}" for module in COMMAND_GROUPS.values()}
    assert extras & groups == {f"towerd.client.cli.{group}"}


def test_sync_client_imports_only_its_own_modules(daemon):
    script = f"from towerd.client import Client; Client({str(daemon.socket_path)!r}).ping()"
    extras = extras_over_floor(daemon, [sys.executable, "-c", script])
    assert "towerd.client.sync" in extras
    assert {m for m in extras if not m.startswith("towerd")} == set()


# hook-report reads the hook's JSON with the C scanner alone, not the json package (~1.5 ms).
HOOK_EXTRAS = CLI_EXTRAS | {"_json"}


def test_hook_report_imports_only_the_json_scanner_beyond_towerctl(daemon):
    """The path every agent hook takes: `towerctl hook-report`, payload on stdin."""
    payload = Path(__file__).parent.parent / "fixtures" / "hooks" / "PostToolUse.json"
    with daemon.client() as client:
        session = client.session_register(cwd="/", agent="claude")["session_id"]
        extras = extras_over_floor(
            daemon,
            [TOWERCTL, "hook-report"],
            stdin=payload.read_text(),
            TOWERD_SOCKET=str(daemon.socket_path),
            TOWERD_SESSION_ID=session,
        )
        (event,) = client.event_list()["events"]  # the measured run did record it
    assert event["kind"] == "PostToolUse" and event["session_id"] == session
    assert {"towerd.client.hook_report", "towerd.client.sync"} <= extras
    assert not [m for m in extras if m.startswith("towerd.client.cli")]  # no parser at all
    assert {m for m in extras if not m.startswith("towerd")} <= HOOK_EXTRAS
    assert not [m for m in extras if m.split(".")[0] in FORBIDDEN]


def test_the_hook_command_imports_no_more_than_hook_report(daemon, tmp_path):
    """`towerctl hook` (what `hooks install` wires), on a PreToolUse Edit that it leases:
    hook-report's modules and towerd's small agent declarations, nothing else."""
    payload = {
        "session_id": "import-cost", "cwd": str(tmp_path), "hook_event_name": "PreToolUse",
        "tool_name": "Edit", "tool_input": {"file_path": "a.py"},
    }  # fmt: skip
    import json

    extras = extras_over_floor(
        daemon,
        [TOWERCTL, "hook", "--agent", "claude"],
        stdin=json.dumps(payload),
        TOWERD_SOCKET=str(daemon.socket_path),
    )
    with daemon.client() as client:
        leased = [lease["resource"] for lease in client.lease_list()["leases"]]
    assert leased == [f"path:{os.path.realpath(tmp_path / 'a.py')}"]  # the run did its work
    assert {"towerd.client.agent_hook", "towerd.client.agents", "towerd.client.sync"} <= extras
    assert not [m for m in extras if m.startswith("towerd.client.cli")]
    assert {m for m in extras if not m.startswith("towerd")} <= HOOK_EXTRAS
    assert not [m for m in extras if m.split(".")[0] in FORBIDDEN]


@pytest.mark.parametrize(
    "command",
    [
        ["ping"],
        ["idem", "claim", "op", "import-cost"],
        ["idem", "complete", "op", "import-cost-2", "--result", "{}"],
        ["run", "--key", "import-cost-run", "--", "true"],
    ],
)
def test_the_hook_path_commands_load_no_parser_nor_socket_py(daemon, command):
    """What hooks and wrappers run per event goes through towerd.client.cli.lean: no
    argparse (with gettext, locale and re), and the client speaks through _socket, not
    socket.py (enum, selectors); `run` starts CMD without subprocess."""
    if command[:2] == ["idem", "complete"]:
        with daemon.client() as client:
            client.idem_claim("op", "import-cost-2")
    modules = imported_modules([TOWERCTL, "--socket", str(daemon.socket_path), *command])
    assert "towerd.client.cli.lean" in modules and "towerd.client.sync" in modules
    loaded = {"argparse", "gettext", "locale", "socket", "subprocess", "typing"} & modules
    assert not loaded, loaded
