"""What `pip install .` really installs: towerd.* only, working console scripts."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def clean_copy(into: Path) -> Path:
    """The tracked files as they are in the working tree, without build/: setuptools
    reuses build/lib, so a module removed or moved would still ship from there."""
    source = into / "source"
    listed = subprocess.run(
        ["git", "-C", str(REPO), "ls-files", "-co", "--exclude-standard", "-z"],
        capture_output=True, check=True,
    ).stdout.decode().split("\0")  # fmt: skip
    for name in filter(None, listed):
        path = REPO / name
        if path.is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, source / name)
    return source


def build_wheel(out: Path) -> Path:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            str(clean_copy(out)),
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = out.glob("towerd-*.whl")
    return wheel


def test_wheel_installs_only_the_towerd_namespace(short_tmp):
    """No bare `daemon`, `protocol` or `client` (another package owns `daemon`); py.typed,
    the client's typing files, the unit files and both console scripts are shipped."""
    names = zipfile.ZipFile(build_wheel(short_tmp)).namelist()
    top_level = {name.split("/")[0] for name in names}
    assert top_level == {"towerd", "towerd-0.1.0.dist-info"}
    for package in ("daemon", "protocol", "client"):
        assert f"towerd/{package}/__init__.py" in names
        assert f"towerd/{package}/py.typed" in names
    assert "towerd/systemd/towerd.service" in names and "towerd/systemd/towerd.socket" in names
    assert "towerd/client/cli/__init__.py" in names and "towerd/client/cli.py" not in names
    assert "towerd/protocol/schema/fleet.py" in names
    # the typed client API: the answers' TypedDicts and the async client's stub
    assert "towerd/client/results.py" in names and "towerd/client/aio_api.pyi" in names
    entry_points = (
        zipfile.ZipFile(build_wheel(short_tmp / "again"))
        .read("towerd-0.1.0.dist-info/entry_points.txt")
        .decode()
    )
    assert "towerd = towerd.daemon.main:main" in entry_points
    # Entry points, not script files: see the next test and pyproject.toml.
    assert "towerctl = towerd.client.entry:main" in entry_points


def test_non_editable_install_runs(short_tmp):
    """Install the wheel into a fresh environment whose path has a space in it: the
    console scripts start and import the installed copy, not the source tree. (A
    towerctl shipped as a script file, 2ce2aa5, got a bare `#!/path with space/python`
    line from pip and did not start: exit 127.)"""
    wheel = build_wheel(short_tmp / "dist")
    venv = short_tmp / "a venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(venv / "bin" / "python"),
            "install",
            "--no-deps",
            "-q",
            str(wheel),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    # Dependencies come from this environment's site-packages (no .pth processing there,
    # so the editable install of the source tree stays out of the way).
    env = {**os.environ, "PYTHONPATH": sysconfig.get_paths()["purelib"]}
    version = subprocess.run(
        [str(venv / "bin" / "towerd"), "--version"],
        env=env,
        cwd="/",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert version.returncode == 0 and "towerd 0.1.0" in version.stdout, version.stderr
    where = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-c",
            "import towerd.client, towerd.daemon.main, towerd.protocol.methods; "
            "print(towerd.client.__file__)",
        ],
        env=env,
        cwd="/",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert where.returncode == 0, where.stderr
    assert where.stdout.strip().startswith(str(venv))
    usage = subprocess.run(
        [str(venv / "bin" / "towerctl"), "--help"],
        env=env,
        cwd="/",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert usage.returncode == 0 and "idem" in usage.stdout


def test_the_hook_launcher_of_a_wheel_install_runs_the_installed_copy(short_tmp):
    """`<venv python> -I -S <site-packages>/towerd/client/_hook_launch.py` (what hooks
    run): no site, towerd found from the launcher's own place in the installed package;
    `hooks install` through it wires that same launcher, and the wired hook runs (fails
    open: no daemon)."""
    wheel = build_wheel(short_tmp / "dist")
    venv = short_tmp / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120
    )
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install",
         "--no-deps", "-q", str(wheel)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    launcher = venv / "lib" / version / "site-packages" / "towerd" / "client" / "_hook_launch.py"
    runner = [str(venv / "bin" / "python"), "-I", "-S", str(launcher)]
    home = short_tmp / "home"
    home.mkdir()
    env = {"HOME": str(home), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}  # -I: unused
    done = subprocess.run(
        [*runner, "--version"], env=env, cwd="/", capture_output=True, text=True, timeout=60
    )
    assert (done.returncode, done.stdout) == (0, "towerctl 0.1.0\n"), done.stderr
    done = subprocess.run(
        [*runner, "--json", "hooks", "install", "--agent", "claude"],
        env=env, cwd="/", capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    settings = json.loads((home / ".claude" / "settings.json").read_text())
    command = settings["hooks"]["SessionStart"][0]["hooks"][0]["command"]
    assert shlex.split(command) == [*runner, "hook", "--agent", "claude"]
    hook = subprocess.run(
        ["sh", "-c", command],
        input='{"hook_event_name": "SessionStart", "session_id": "s1", "cwd": "/tmp"}',
        env={**env, "TOWERD_SOCKET": str(short_tmp / "no.sock")},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert (hook.returncode, hook.stdout, hook.stderr) == (0, "", "")
