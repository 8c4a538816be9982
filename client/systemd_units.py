"""``towerctl install-systemd``: write the user units, pointing at this install's towerd."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from importlib import resources
from pathlib import Path
from typing import Any

UNITS = ("towerd.socket", "towerd.service")
PLACEHOLDER = "@TOWERD@"


def towerd_executable() -> Path:
    """The ``towerd`` script installed beside this interpreter, else the one on PATH."""
    beside = Path(sys.executable).parent / "towerd"
    if beside.exists():
        return beside.absolute()
    found = shutil.which("towerd")
    if found is None:
        raise FileNotFoundError("cannot find the towerd executable; is towerd installed?")
    return Path(found).absolute()


def render_unit(name: str, towerd: Path) -> str:
    template = resources.files("towerd.systemd").joinpath(name).read_text()
    return template.replace(PLACEHOLDER, str(towerd))


def default_unit_dir() -> Path:
    config_home = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config_home) / "systemd" / "user"


def install_units(target_dir: Path | None = None, *, enable: bool = False) -> dict[str, Any]:
    target_dir = target_dir or default_unit_dir()
    target_dir.mkdir(parents=True, exist_ok=True)
    towerd = towerd_executable()
    installed = []
    for name in UNITS:
        path = target_dir / name
        path.write_text(render_unit(name, towerd))
        installed.append(str(path))
    commands = [
        ["systemctl", "--user", "daemon-reload"],
        ["systemctl", "--user", "enable", "--now", "towerd.socket"],
    ]
    if enable:
        for command in commands:
            subprocess.run(command, check=True)
    return {
        "installed": installed,
        "towerd": str(towerd),
        "enabled": enable,
        "next": None if enable else " && ".join(" ".join(c) for c in commands),
    }
