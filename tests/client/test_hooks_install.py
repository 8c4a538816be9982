"""``towerctl hooks install|uninstall|status`` on real files in a temporary $HOME, run
as the real CLI in a subprocess (no daemon here: status reports the files without one;
tests/integration/test_hooks_status.py asks a real daemon)."""

from __future__ import annotations

import json
import os
import shlex
import stat
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import towerd.client
from towerd.client.agents import AGENT_EVENTS, HOOK_TIMEOUT_SECONDS
from towerd.client.cli.hooks import SCOPES as CLI_SCOPES
from towerd.client.hooks_install import BACKUP_SUFFIX, HAND_WIRED_NOTE, SCOPES
from towerd_testing import TOWERCTL

# The user's own settings: other keys, and hooks of their own on two events.
ORIGINAL = {
    "model": "x",
    "permissions": {"allow": ["Bash(ls:*)"], "deny": ["Read(./.env)"]},
    "hooks": {
        "PreToolUse": [
            {"matcher": "Bash", "hooks": [{"type": "command", "command": "/usr/bin/true"}]}
        ],
        "Stop": [{"hooks": [{"type": "command", "command": "/usr/bin/true", "timeout": 3}]}],
    },
    "env": {"FOO": "bär"},
}
PATH = "/usr/bin:/bin"  # no venv on it: the installed command must name towerctl in full
# What install wires: the venv's Python under -I -S running towerd's launcher (no site, so
# no editable-install finder or script wrapper is paid by a hook), not the towerctl script.
# The venv's interpreter as towerctl's script names it (pip writes bin/python or
# bin/python3 there, after the interpreter pip itself ran on), not the one it links to.
with open(TOWERCTL) as _script:
    PYTHON = _script.readline().removeprefix("#!").strip()
LAUNCHER = str(Path(towerd.client.__file__).parent / "_hook_launch.py")
SESSION_START = {"hook_event_name": "SessionStart", "session_id": "s1", "cwd": "/tmp"}


def towerctl(
    home: Path, *args: str, codex_home: Path | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """The real CLI with ``home`` as $HOME and nothing else of this machine's set up."""
    env = {"HOME": str(home), "PATH": PATH}
    if codex_home is not None:
        env["CODEX_HOME"] = str(codex_home)
    return subprocess.run(
        [TOWERCTL, *args],
        env=env,
        cwd=cwd or home,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def ok(result: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def runs_hook(command: str) -> bool:
    """Whether ``command`` runs ``hook`` through towerd's launcher or a towerctl script."""
    argv = shlex.split(command)
    if os.path.basename(argv[0]) == "towerctl":
        return argv[1:2] == ["hook"]
    return len(argv) > 4 and os.path.basename(argv[3]) == "_hook_launch.py" and argv[4] == "hook"


def towerd_handlers(data: dict, event: str) -> list[dict]:
    """The handlers of ``event`` that run ``towerctl hook`` (the launcher or the script)."""
    return [
        handler
        for group in data["hooks"].get(event, [])
        for handler in group["hooks"]
        if runs_hook(handler["command"])
    ]


def assert_wired(data: dict, agent: str, *extra_args: str) -> None:
    """Every event of ``agent`` runs exactly one towerd handler: this installation's
    Python by absolute path, -I -S, towerd's launcher by absolute path, with a timeout."""
    for event in AGENT_EVENTS[agent]:
        (handler,) = towerd_handlers(data, event)
        argv = shlex.split(handler["command"])
        assert os.path.isabs(argv[0]) and os.access(argv[0], os.X_OK), handler
        assert argv[0] == PYTHON  # the venv's, not the interpreter it links to
        assert argv[1:3] == ["-I", "-S"]
        assert os.path.isabs(argv[3]) and os.path.samefile(argv[3], LAUNCHER)
        assert argv[4:] == ["hook", "--agent", agent, *extra_args]
        assert handler["type"] == "command" and handler["timeout"] == HOOK_TIMEOUT_SECONDS


@pytest.fixture
def home(tmp_path: Path) -> Path:
    path = tmp_path / "home"
    path.mkdir()
    return path


def write_claude_settings(home: Path, data: object) -> Path:
    settings = home / ".claude" / "settings.json"
    settings.parent.mkdir(parents=True, exist_ok=True)
    settings.write_text(json.dumps(data, indent=4, ensure_ascii=False))  # not towerd's style
    return settings


def test_install_keeps_the_users_settings_reinstall_changes_nothing_uninstall_restores(home):
    settings = write_claude_settings(home, ORIGINAL)
    settings.chmod(0o640)
    original_bytes = settings.read_bytes()
    backup = settings.with_name(settings.name + BACKUP_SUFFIX)

    first = ok(towerctl(home, "hooks", "install", "--agent", "claude"))
    assert f"{settings}: installed {len(AGENT_EVENTS['claude'])} events" in first.stdout
    data = json.loads(settings.read_text())
    assert list(data) == list(ORIGINAL)  # every key still there, in order
    assert {key: data[key] for key in ("model", "permissions", "env")} == {
        key: ORIGINAL[key] for key in ("model", "permissions", "env")
    }
    assert list(data["hooks"])[:2] == ["PreToolUse", "Stop"]
    assert data["hooks"]["PreToolUse"][0] == ORIGINAL["hooks"]["PreToolUse"][0]
    assert data["hooks"]["Stop"][0] == ORIGINAL["hooks"]["Stop"][0]
    assert_wired(data, "claude")
    assert stat.S_IMODE(settings.stat().st_mode) == 0o640  # its permission bits are kept
    assert backup.read_bytes() == original_bytes
    installed_bytes = settings.read_bytes()
    assert installed_bytes.endswith(b"}\n") and "bär".encode() in installed_bytes

    again = ok(towerctl(home, "hooks", "install", "--agent", "claude"))
    assert "already installed" in again.stdout
    assert settings.read_bytes() == installed_bytes  # byte for byte
    assert backup.read_bytes() == original_bytes  # no new backup

    removed = ok(towerctl(home, "hooks", "uninstall", "--agent", "claude"))
    assert f"{settings}: removed" in removed.stdout
    assert json.loads(settings.read_text()) == ORIGINAL
    assert backup.read_bytes() == installed_bytes  # the previous bytes, once more
    assert stat.S_IMODE(settings.stat().st_mode) == 0o640

    nothing = ok(towerctl(home, "hooks", "uninstall", "--agent", "claude"))
    assert "not installed" in nothing.stdout
    assert backup.read_bytes() == installed_bytes  # nothing written


def test_install_creates_a_private_file_and_uninstall_of_no_file_is_nothing_to_do(home):
    missing = ok(towerctl(home, "--json", "hooks", "uninstall"))
    assert [f["change"] for f in json.loads(missing.stdout)["files"]] == ["no_file", "no_file"]
    assert not (home / ".claude").exists() and not (home / ".codex").exists()

    result = json.loads(ok(towerctl(home, "hooks", "install", "--json")).stdout)
    assert [(f["agent"], f["change"], f["backup"]) for f in result["files"]] == [
        ("claude", "installed", None),
        ("codex", "installed", None),
    ]
    for path in (home / ".claude" / "settings.json", home / ".codex" / "hooks.json"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        assert not path.with_name(path.name + BACKUP_SUFFIX).exists()
    assert_wired(json.loads((home / ".claude" / "settings.json").read_text()), "claude")
    assert_wired(json.loads((home / ".codex" / "hooks.json").read_text()), "codex")

    ok(towerctl(home, "hooks", "uninstall"))
    assert json.loads((home / ".claude" / "settings.json").read_text()) == {}
    assert json.loads((home / ".codex" / "hooks.json").read_text()) == {}


def test_a_hand_wired_hook_report_is_the_users_and_is_noted(home):
    hand_wired = {"type": "command", "command": "towerctl hook-report"}
    settings = write_claude_settings(home, {"hooks": {"Stop": [{"hooks": [hand_wired]}]}})
    result = ok(towerctl(home, "hooks", "install", "--agent", "claude"))
    assert HAND_WIRED_NOTE in result.stdout
    data = json.loads(settings.read_text())
    assert data["hooks"]["Stop"][0] == {"hooks": [hand_wired]}
    assert_wired(data, "claude")

    status = ok(towerctl(home, "--json", "hooks", "status", "--socket", str(home / "no.sock")))
    notes = json.loads(status.stdout)["agents"]["claude"]["notes"]
    assert f"{settings}: {HAND_WIRED_NOTE}" in notes

    ok(towerctl(home, "hooks", "uninstall", "--agent", "claude"))
    assert json.loads(settings.read_text()) == {"hooks": {"Stop": [{"hooks": [hand_wired]}]}}


def test_a_symlinked_settings_file_stays_a_link_to_the_file_it_names(tmp_path, home):
    """A dotfiles checkout links ~/.claude/settings.json: its target is what changes."""
    dotfiles = tmp_path / "dotfiles" / "settings.json"
    dotfiles.parent.mkdir()
    dotfiles.write_text(json.dumps(ORIGINAL))
    link = home / ".claude" / "settings.json"
    link.parent.mkdir()
    link.symlink_to(dotfiles)
    ok(towerctl(home, "hooks", "install", "--agent", "claude"))
    assert link.is_symlink() and link.resolve() == dotfiles
    assert_wired(json.loads(dotfiles.read_text()), "claude")
    assert json.loads(dotfiles.with_name("settings.json" + BACKUP_SUFFIX).read_text()) == ORIGINAL
    ok(towerctl(home, "hooks", "uninstall", "--agent", "claude"))
    assert link.is_symlink() and json.loads(dotfiles.read_text()) == ORIGINAL


BAD_FILES = [
    (b'{"hooks": [', "not valid JSON"),
    (b'{"a": 1,}', "not valid JSON"),
    (b"[]", "the top level is a list, not an object"),
    (b'{"hooks": []}', '"hooks" is a list, not an object'),
    (b'{"hooks": {"Stop": {"hooks": []}}}', '"hooks"."Stop" is an object, not a list'),
]


@pytest.mark.parametrize("agent", ["claude", "codex"])
@pytest.mark.parametrize(("content", "problem"), BAD_FILES)
def test_a_file_no_agent_can_read_is_refused_and_left_untouched(
    tmp_path, home, agent, content, problem
):
    """Exit 65 naming the file (and, for JSON, where it goes wrong); no byte written, no
    backup, and not the other agent's file either."""
    codex_home = tmp_path / "codex-home"
    codex_home.mkdir()
    path = home / ".claude" / "settings.json" if agent == "claude" else codex_home / "hooks.json"
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(content)
    for command in ("install", "uninstall"):
        result = towerctl(home, "hooks", command, codex_home=codex_home)
        assert result.returncode == 65, result.stdout + result.stderr
        assert str(path) in result.stderr and problem in result.stderr
        if problem == "not valid JSON":
            assert "line 1 column" in result.stderr
        assert path.read_bytes() == content
        assert sorted(os.listdir(path.parent)) == [path.name]  # no backup, no temp file
        other = codex_home / "hooks.json" if agent == "claude" else home / ".claude"
        assert not other.exists()
    refused = towerctl(home, "--json", "hooks", "install", codex_home=codex_home)
    assert refused.returncode == 65
    error = json.loads(refused.stdout)["error"]
    assert error["code"] == "hooks_file_invalid" and error["data"]["path"] == str(path)


def test_codex_goes_to_codex_home_if_set_else_to_dot_codex(tmp_path, home):
    codex_home = tmp_path / "codex-home"
    ok(towerctl(home, "hooks", "install", "--agent", "codex", codex_home=codex_home))
    assert_wired(json.loads((codex_home / "hooks.json").read_text()), "codex")
    assert not (home / ".codex").exists() and not (home / ".claude").exists()

    ok(towerctl(home, "hooks", "install", "--agent", "codex"))
    assert_wired(json.loads((home / ".codex" / "hooks.json").read_text()), "codex")


def test_project_scope_writes_the_projects_files(tmp_path, home):
    project = tmp_path / "project with spaces"
    project.mkdir()
    ok(towerctl(home, "hooks", "install", "--scope", "project", "--project", str(project)))
    assert_wired(json.loads((project / ".claude" / "settings.json").read_text()), "claude")
    assert_wired(json.loads((project / ".codex" / "hooks.json").read_text()), "codex")
    assert not (home / ".claude").exists() and not (home / ".codex").exists()

    # --project defaults to the current directory.
    other = tmp_path / "other"
    other.mkdir()
    ok(towerctl(home, "hooks", "install", "--scope", "project", "--agent", "claude", cwd=other))
    assert_wired(json.loads((other / ".claude" / "settings.json").read_text()), "claude")

    wrong = towerctl(home, "hooks", "install", "--project", str(project))
    assert wrong.returncode == 2 and "--scope project" in wrong.stderr


def test_guard_is_in_the_command_and_a_reinstall_replaces_towerds_handler(home):
    settings = home / ".claude" / "settings.json"
    ok(towerctl(home, "hooks", "install", "--agent", "claude", "--guard", "warn"))
    assert_wired(json.loads(settings.read_text()), "claude", "--guard", "warn")
    ok(towerctl(home, "hooks", "install", "--agent", "claude", "--guard", "off"))
    assert_wired(json.loads(settings.read_text()), "claude", "--guard", "off")  # one each
    ok(towerctl(home, "hooks", "install", "--agent", "claude"))  # deny: the default
    assert_wired(json.loads(settings.read_text()), "claude")


def status(home: Path, *args: str) -> dict:
    result = ok(
        towerctl(home, "--json", "hooks", "status", "--socket", str(home / "no.sock"), *args)
    )
    return json.loads(result.stdout)


def test_status_without_a_daemon_reports_the_files(home):
    report = status(home)
    assert not report["daemon"]["asked"] and report["daemon"]["error"]
    assert {agent: found["state"] for agent, found in report["agents"].items()} == {
        "claude": "not_installed",
        "codex": "not_installed",
    }

    ok(towerctl(home, "hooks", "install", "--agent", "claude", "--guard", "warn"))
    report = status(home)
    claude, codex = report["agents"]["claude"], report["agents"]["codex"]
    assert claude["state"] == "unverified" and claude["installed"]
    (only_user,) = claude["files"]  # at $HOME, the project's file is the user's
    assert only_user["scope"] == "user"
    (user, project) = status(home, "--project", str(home / "p"))["agents"]["claude"]["files"]
    assert user["scope"] == "user" and user["path"] == str(home / ".claude" / "settings.json")
    assert user["wired"] == list(AGENT_EVENTS["claude"]) and user["missing"] == []
    (command,) = user["commands"]
    assert command["guard"] == "warn" and command["executable"] and not command["stale"]
    assert project["scope"] == "project" and not project["exists"]
    assert project["path"] == str(home / "p" / ".claude" / "settings.json")
    assert codex["state"] == "not_installed" and not codex["installed"]
    assert codex["files"][0]["missing"] == list(AGENT_EVENTS["codex"])

    text = ok(towerctl(home, "hooks", "status", "--socket", str(home / "no.sock"))).stdout
    assert "could not be asked" in text and "claude: unverified" in text
    assert "codex: not_installed" in text

    only = status(home, "--agent", "codex")
    assert list(only["agents"]) == ["codex"]


def test_status_names_what_is_wrong_with_the_installed_hooks(tmp_path, home):
    settings = home / ".claude" / "settings.json"
    ok(towerctl(home, "hooks", "install", "--agent", "claude"))
    data = json.loads(settings.read_text())

    del data["hooks"]["PreCompact"]
    settings.write_text(json.dumps(data))
    found = status(home)["agents"]["claude"]
    assert found["state"] == "incomplete" and found["files"][0]["missing"] == ["PreCompact"]

    old = tmp_path / "old venv" / "towerctl"  # another towerctl, of another version
    old.parent.mkdir()
    old.write_text("#!/bin/sh\necho 'towerctl 0.0.1'\n")
    old.chmod(0o755)
    for group in data["hooks"]["Stop"]:
        group["hooks"][0]["command"] = f"{shlex.quote(str(old))} hook --agent claude"
    settings.write_text(json.dumps(data))
    found = status(home)["agents"]["claude"]
    assert found["state"] == "stale_version" and "0.0.1" in found["detail"]

    for group in data["hooks"]["Stop"]:
        group["hooks"][0]["command"] = "/nonexistent/towerctl hook --agent claude"
    settings.write_text(json.dumps(data))
    found = status(home)["agents"]["claude"]
    assert found["state"] == "broken_command" and "/nonexistent/towerctl" in found["detail"]

    settings.write_text('{"hooks": [')
    found = status(home)["agents"]["claude"]
    assert found["state"] == "invalid_file" and "line 1 column" in found["detail"]


def test_the_installed_command_runs_through_sh_and_fails_open_without_a_daemon(tmp_path, home):
    ok(towerctl(home, "hooks", "install"))
    for agent, path in (("claude", ".claude/settings.json"), ("codex", ".codex/hooks.json")):
        data = json.loads((home / path).read_text())
        (handler,) = towerd_handlers(data, "SessionStart")
        result = run_without_a_daemon(handler, home, tmp_path)
        assert (result.returncode, result.stdout) == (0, ""), (agent, result.stderr)


def run_without_a_daemon(
    handler: dict, home: Path, tmp_path: Path
) -> subprocess.CompletedProcess[str]:
    """An installed handler's command run as an agent runs it (through sh, no venv on
    PATH) on a SessionStart, its socket a path nobody listens on."""
    return subprocess.run(
        ["sh", "-c", handler["command"]],
        input=json.dumps(SESSION_START),
        env={"HOME": str(home), "PATH": PATH, "TOWERD_SOCKET": str(tmp_path / "no.sock")},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def test_a_python_without_a_towerctl_script_wires_the_launcher_that_works(tmp_path, home):
    """A Python with no towerctl beside it and none on PATH (a venv of its own that sees
    this one's packages): hooks need no script, they run that Python and the launcher;
    the installed command runs the hook through sh (fails open without a daemon)."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(os.path.realpath(sys.executable))
    (venv / "pyvenv.cfg").write_text(
        f"home = {os.path.dirname(os.path.realpath(sys.executable))}\n"
    )
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    site = venv / "lib" / version / "site-packages"
    site.mkdir(parents=True)
    ours = sysconfig.get_path("purelib")
    (site / "ours.pth").write_text(f"import site; site.addsitedir({ours!r})\n")
    result = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "from towerd.client.entry import main; main()",
         "hooks", "install", "--agent", "claude"],
        env={"HOME": str(home), "PATH": PATH},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads((home / ".claude" / "settings.json").read_text())
    (handler,) = towerd_handlers(data, "SessionStart")
    argv = shlex.split(handler["command"])
    assert argv[:3] == [str(venv / "bin" / "python"), "-I", "-S"]
    assert os.path.samefile(argv[3], LAUNCHER)
    hook = run_without_a_daemon(handler, home, tmp_path)
    assert (hook.returncode, hook.stdout, hook.stderr) == (0, "", "")


def test_an_install_of_the_towerctl_script_form_is_still_towerds(home):
    """Settings written by an earlier towerd (``/venv/bin/towerctl hook --agent claude``):
    status counts them as installed, a reinstall replaces them with the launcher (one
    handler per event), uninstall takes either out."""
    old = {"hooks": {event: [{"hooks": [{"type": "command", "timeout": HOOK_TIMEOUT_SECONDS,
                                          "command": f"{TOWERCTL} hook --agent claude"}]}]
                     for event in AGENT_EVENTS["claude"]}}  # fmt: skip
    settings = write_claude_settings(home, old)
    status = ok(towerctl(home, "--json", "hooks", "status", "--socket", str(home / "no.sock")))
    claude = json.loads(status.stdout)["agents"]["claude"]
    assert claude["installed"] and claude["files"][0]["missing"] == []
    (command,) = claude["files"][0]["commands"]
    assert command["towerctl"] == TOWERCTL and command["problem"] is None
    assert command["version"] is not None and not command["stale"]
    ok(towerctl(home, "hooks", "install", "--agent", "claude"))
    assert_wired(json.loads(settings.read_text()), "claude")
    status = ok(towerctl(home, "--json", "hooks", "status", "--socket", str(home / "no.sock")))
    (command,) = json.loads(status.stdout)["agents"]["claude"]["files"][0]["commands"]
    assert command["towerctl"] == shlex.join([PYTHON, "-I", "-S", LAUNCHER])
    assert command["problem"] is None and command["version"] is not None
    write_claude_settings(home, old)
    ok(towerctl(home, "hooks", "uninstall", "--agent", "claude"))
    assert "SessionStart" not in json.loads(settings.read_text()).get("hooks", {})


def test_a_launcher_that_is_gone_is_a_problem_in_status(home, tmp_path):
    gone = tmp_path / "moved" / "towerd" / "client" / "_hook_launch.py"
    command = f"{shlex.quote(PYTHON)} -I -S {shlex.quote(str(gone))} hook --agent claude"
    write_claude_settings(home, {"hooks": {"SessionStart": [{"hooks": [
        {"type": "command", "command": command}]}]}})  # fmt: skip
    status = ok(towerctl(home, "--json", "hooks", "status", "--socket", str(home / "no.sock")))
    (found,) = json.loads(status.stdout)["agents"]["claude"]["files"][0]["commands"]
    assert found["problem"] == f"{gone} is not a file (towerd moved or uninstalled?)"


def test_the_cli_offers_the_scopes_the_module_knows():
    assert CLI_SCOPES == SCOPES


def test_a_read_only_settings_file_is_refused_and_left_alone(tmp_path):
    home = tmp_path / "home"
    settings = home / ".claude" / "settings.json"
    settings.parent.mkdir(parents=True)
    settings.write_text('{"model": "x"}\n')
    settings.chmod(0o444)
    done = subprocess.run(
        [TOWERCTL, "hooks", "install", "--agent", "claude"],
        env={"HOME": str(home), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 73, done
    assert "read-only" in done.stderr
    assert settings.read_text() == '{"model": "x"}\n'
    assert not (settings.parent / "settings.json.towerd-backup").exists()


def test_an_entry_the_user_prefixed_with_a_variable_is_still_towerds(tmp_path):
    """``TOWERD_SOCKET=/x /…/towerctl hook`` (edited by hand) is recognised: uninstall takes
    it out, a reinstall replaces it rather than adding a second."""
    home = tmp_path / "home"
    env = {"HOME": str(home), "PATH": "/usr/bin:/bin"}
    install = [TOWERCTL, "hooks", "install", "--agent", "claude"]
    assert subprocess.run(install, env=env, capture_output=True).returncode == 0
    settings = home / ".claude" / "settings.json"
    data = json.loads(settings.read_text())
    for groups in data["hooks"].values():
        handler = groups[-1]["hooks"][-1]
        handler["command"] = "TOWERD_SOCKET=/x " + handler["command"]
    settings.write_text(json.dumps(data))
    assert subprocess.run(install, env=env, capture_output=True).returncode == 0
    again = json.loads(settings.read_text())
    assert all(len(groups) == 1 for groups in again["hooks"].values())
    uninstall = [TOWERCTL, "hooks", "uninstall", "--agent", "claude"]
    assert subprocess.run(uninstall, env=env, capture_output=True).returncode == 0
    assert json.loads(settings.read_text()).get("hooks", {}) == {}
