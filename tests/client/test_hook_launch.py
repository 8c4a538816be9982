"""client/_hook_launch.py, what `hooks install` wires: `<venv python> -I -S <launcher>
COMMAND ...` is towerctl without site (no .pth files: an editable install's import
finder; no console-script wrapper), run here from the checkout (the editable layout);
tests/test_packaging.py runs it from a wheel install."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import towerd.client
from towerd_testing import TOWERCTL

PYTHON = os.path.join(os.path.dirname(TOWERCTL), "python")
LAUNCHER = str(Path(towerd.client.__file__).parent / "_hook_launch.py")


def launch(*args: str, stdin: str | None = None, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PYTHON, "-I", "-S", LAUNCHER, *args],
        input=stdin, capture_output=True, text=True, timeout=60, cwd="/",
        env={"PATH": "/usr/bin:/bin", "PYTHONPROFILEIMPORTTIME": "1", **env},
    )  # fmt: skip


def imported(done: subprocess.CompletedProcess) -> set[str]:
    """The modules a run imported (-X importtime; PYTHONPROFILEIMPORTTIME is an
    environment variable -I ignores, so launch() passes it only as a guard: see below)."""
    return {
        line.rsplit("|", 1)[1].strip()
        for line in done.stderr.splitlines()
        if line.startswith("import time:") and "|" in line
    }


def test_the_launcher_is_towerctl_on_the_same_command_line(daemon):
    socket = str(daemon.socket_path)
    done = launch("--version")
    assert (done.returncode, done.stdout) == (0, f"towerctl {towerd.protocol.VERSION}\n")
    assert imported(done) == set()  # -I: PYTHON* variables are not read
    claim = launch("--socket", socket, "--json", "idem", "claim", "op", "k1", "--payload", "[1]")
    assert claim.returncode == 0, claim.stderr
    assert json.loads(claim.stdout)["state"] == "claimed"
    with daemon.client() as client:
        assert client.idem_get("op", "k1")["state"] == "in_progress"
    usage = launch("--json", "idem", "claim", "op")  # argparse's error, as towerctl's
    via_script = subprocess.run([TOWERCTL, "--json", "idem", "claim", "op"], capture_output=True,
                                text=True)  # fmt: skip
    assert (usage.returncode, usage.stdout) == (via_script.returncode, via_script.stdout) == (
        2, via_script.stdout,
    )  # fmt: skip


def test_the_launcher_runs_without_site_or_the_editable_finder(daemon):
    """The point of it: neither site nor the editable install's finder (pathlib, fnmatch,
    re) is imported, nor argparse for a hook-path command."""
    argv = [PYTHON, "-X", "importtime", "-I", "-S", LAUNCHER, "--socket",
            str(daemon.socket_path), "idem", "claim", "op", "k2"]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd="/")
    assert done.returncode == 0, done.stderr
    modules = imported(done)
    assert "towerd.client.sync" in modules and "towerd.client.cli.lean" in modules
    finders = {m for m in modules if m.startswith("__editable__")}
    assert not finders and not {"site", "pathlib", "fnmatch", "re", "argparse"} & modules
    # The console script pays them: what the launcher saves.
    script = subprocess.run(
        [PYTHON, "-X", "importtime", TOWERCTL, "--socket", str(daemon.socket_path), "ping"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert "site" in imported(script)


def test_a_hook_through_the_launcher_records_its_event(daemon):
    with daemon.client() as client:
        session = client.session_register(cwd="/", agent="claude")["session_id"]
    payload = (Path(__file__).parent.parent / "fixtures" / "hooks" / "PostToolUse.json").read_text()
    done = launch(
        "hook-report", stdin=payload, TOWERD_SOCKET=str(daemon.socket_path),
        TOWERD_SESSION_ID=session,
    )  # fmt: skip
    assert (done.returncode, done.stdout) == (0, ""), done.stderr
    with daemon.client() as client:
        (event,) = client.event_list()["events"]
    assert event["kind"] == "PostToolUse" and event["session_id"] == session


def test_the_launcher_finds_towerd_from_its_own_place(monkeypatch):
    """Both layouts: the checkout (root = the repo, protocol/ client/ at its top) and an
    installed package (root = site-packages/towerd); a relative path from the cwd."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("launch", LAUNCHER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module._towerd_root("/x/site-packages/towerd/client/_hook_launch.py") == (
        "/x/site-packages/towerd"
    )
    assert module._towerd_root(LAUNCHER) == str(Path(LAUNCHER).parent.parent)
    monkeypatch.chdir("/tmp")
    assert module._towerd_root("a/client/_hook_launch.py") == "/tmp/a"


def test_the_launcher_puts_the_venvs_dependencies_on_the_path():
    """Without site, sys.prefix is the base interpreter's: the launcher must still find
    the venv's site-packages (msgspec, rich: commands other than the hook path)."""
    code = (
        f"import runpy, sys; launcher = runpy.run_path({LAUNCHER!r}, run_name='launcher'); "
        f"launcher['_prepare']({LAUNCHER!r}); import msgspec, rich; "
        "print(msgspec.__file__); print('site' in sys.modules)"
    )
    done = subprocess.run([PYTHON, "-I", "-S", "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    where, site_loaded = done.stdout.split()
    venv = os.path.dirname(os.path.dirname(PYTHON))
    assert where.startswith(venv + "/lib/") and site_loaded == "False"
