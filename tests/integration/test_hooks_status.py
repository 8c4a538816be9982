"""``towerctl hooks status`` and ``towerctl doctor`` against a real daemon: hooks
installed in a temporary $HOME have never fired until the installed command itself,
run through ``sh -c`` as the agent runs it, sends an event; then its arrival shows."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from towerd.client.agents import AGENT_EVENTS
from towerd.client.hooks_install import CODEX_TRUST_HINT
from towerd_testing import TOWERCTL, wait_for

pytestmark = pytest.mark.both_backends

PATH = "/usr/bin:/bin"  # no venv on it, as in an agent's hook


def towerctl(daemon, home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [TOWERCTL, "--socket", str(daemon.socket_path), *args],
        env={"HOME": str(home), "PATH": PATH},
        cwd=home,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def hooks_status(daemon, home: Path) -> dict:
    result = towerctl(daemon, home, "--json", "hooks", "status")
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout)


def doctor_hooks(daemon, home: Path) -> tuple[int, dict]:
    result = towerctl(daemon, home, "--json", "doctor")
    report = json.loads(result.stdout)
    return result.returncode, {
        f["check"]: f for f in report["findings"] if f["check"].startswith("hooks")
    }


def installed_command(home: Path, event: str) -> str:
    data = json.loads((home / ".claude" / "settings.json").read_text())
    (group,) = [g for g in data["hooks"][event] if " hook --agent " in g["hooks"][0]["command"]]
    return group["hooks"][0]["command"]


def test_status_shows_hooks_that_never_fired_then_the_first_arrival(daemon, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    code, findings = doctor_hooks(daemon, home)
    assert code == 0, findings  # hooks not installed: information, not a failure
    assert findings["hooks claude"]["status"] == "ok"
    assert "not_installed" in findings["hooks claude"]["detail"]

    installed = towerctl(daemon, home, "hooks", "install")
    assert installed.returncode == 0, installed.stderr
    report = hooks_status(daemon, home)
    assert report["daemon"]["asked"] and report["daemon"]["error"] is None
    claude, codex = report["agents"]["claude"], report["agents"]["codex"]
    assert claude["state"] == codex["state"] == "installed_never_fired"
    assert claude["never_fired"] and all(e["last_at"] is None for e in claude["events"])
    assert codex["hint"] == CODEX_TRUST_HINT and claude["hint"] is None
    text = towerctl(daemon, home, "hooks", "status").stdout
    assert "installed but never fired" in text and "/hooks, then trust" in text
    code, findings = doctor_hooks(daemon, home)
    assert code == 1 and findings["hooks claude"]["status"] == "warning"

    # The agent runs the installed command: the socket comes from the environment.
    payload = {"hook_event_name": "SessionStart", "session_id": "s1", "cwd": "/tmp"}
    hook = subprocess.run(
        ["sh", "-c", installed_command(home, "SessionStart")],
        input=json.dumps(payload),
        env={"HOME": str(home), "PATH": PATH, "TOWERD_SOCKET": str(daemon.socket_path)},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert (hook.returncode, hook.stdout, hook.stderr) == (0, "", "")

    def arrived() -> dict | None:
        claude = hooks_status(daemon, home)["agents"]["claude"]
        return claude if claude["state"] == "ok" else None

    claude = wait_for(arrived, what="SessionStart to arrive")
    events = {e["event"]: e for e in claude["events"]}
    assert isinstance(events["SessionStart"]["last_at"], int)
    assert events["SessionStart"]["count"] == 1
    assert [e for e in AGENT_EVENTS["claude"] if events[e]["last_at"] is not None] == [
        "SessionStart"
    ]
    assert "SessionStart" in claude["detail"] and not claude["never_fired"]
    text = towerctl(daemon, home, "hooks", "status").stdout
    assert "claude: ok" in text and "last 2" in text  # a UTC time, 20xx-...
    _code, findings = doctor_hooks(daemon, home)
    assert findings["hooks claude"]["status"] == "ok"
    assert findings["hooks codex"]["status"] == "warning"  # still never fired
