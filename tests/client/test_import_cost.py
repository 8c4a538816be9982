"""Hooks run towerctl and the blocking client on every agent event: they must not
import anyio, structlog, aiosqlite or asyncio (50-200 ms each on this machine)."""

from __future__ import annotations

import os
import subprocess
import sys

from towerd_testing import TOWERCTL

HEAVY = ("anyio", "structlog", "aiosqlite", "asyncio")


def imported_modules(command: list[str]) -> set[str]:
    env = {**os.environ, "PYTHONPROFILEIMPORTTIME": "1"}
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=60)
    return {
        line.rsplit("|", 1)[1].strip()
        for line in result.stderr.splitlines()
        if line.startswith("import time:") and "|" in line
    }


def test_towerctl_imports_no_event_loop_or_logging_stack(daemon):
    modules = imported_modules([TOWERCTL, "--socket", str(daemon.socket_path), "ping"])
    assert "towerd.client.sync" in modules  # the measurement saw the real import path
    heavy = sorted(m for m in modules if m.split(".")[0] in HEAVY)
    assert heavy == []


def test_sync_client_imports_no_event_loop_or_logging_stack(daemon):
    script = f"from towerd.client import Client; Client({str(daemon.socket_path)!r}).ping()"
    modules = imported_modules([sys.executable, "-c", script])
    assert "towerd.client.sync" in modules
    assert sorted(m for m in modules if m.split(".")[0] in HEAVY) == []
