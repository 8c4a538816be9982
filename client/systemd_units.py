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


ENABLE_COMMANDS = (
    ("systemctl", "--user", "daemon-reload"),
    ("systemctl", "--user", "enable", "--now", "towerd.socket"),
)


def manual_commands() -> str:
    return " && ".join(" ".join(command) for command in ENABLE_COMMANDS)


class SystemctlFailed(Exception):
    """``--enable`` could not run a systemctl command (no user bus is the usual cause: a
    shell outside a login session, ``su``, ``sudo``, a container). The units are written."""

    def __init__(self, command: tuple[str, ...], why: str, installed: list[str]) -> None:
        self.command, self.why, self.installed = command, why, installed
        where = os.path.dirname(installed[0]) if installed else "the unit directory"
        super().__init__(
            f"the units are written to {where}, but `{' '.join(command)}` failed: {why}; "
            f"run `{manual_commands()}` from a login session of this user (to keep towerd "
            "running without one, `loginctl enable-linger $USER` first)"
        )

    def data(self) -> dict[str, Any]:
        return {"command": list(self.command), "reason": self.why, "installed": self.installed}


def _run_systemctl(command: tuple[str, ...], installed: list[str]) -> None:
    try:
        done = subprocess.run(
            command, check=False, capture_output=True, text=True, errors="replace"
        )
    except OSError as exc:  # no systemctl on this machine
        raise SystemctlFailed(command, exc.strerror or str(exc), installed) from None
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        why = lines[-1] if lines else f"exit status {done.returncode}"
        raise SystemctlFailed(command, why, installed)


def install_units(target_dir: Path | None = None, *, enable: bool = False) -> dict[str, Any]:
    """Write the units; with ``enable``, also reload and enable the socket (raises
    :class:`SystemctlFailed` if systemctl cannot)."""
    target_dir = target_dir or default_unit_dir()
    target_dir.mkdir(parents=True, exist_ok=True)
    towerd = towerd_executable()
    installed = []
    for name in UNITS:
        path = target_dir / name
        path.write_text(render_unit(name, towerd))
        installed.append(str(path))
    if enable:
        for command in ENABLE_COMMANDS:
            _run_systemctl(command, installed)
    return {
        "installed": installed,
        "towerd": str(towerd),
        "enabled": enable,
        "next": None if enable else manual_commands(),
    }
