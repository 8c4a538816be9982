"""``towerctl install-systemd``: write the user units, pointing at this install's towerd
(and, with ``--notify``, ``towerd-notify.service`` running this install's ``towerctl
notify``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from importlib import resources
from pathlib import Path
from typing import Any

UNITS = ("towerd.socket", "towerd.service")
NOTIFY_UNIT = "towerd-notify.service"
PLACEHOLDER = "@TOWERD@"
TOWERCTL_PLACEHOLDER = "@TOWERCTL@"
NOTIFY_ARGS_PLACEHOLDER = "@NOTIFY_ARGS@"


def towerd_executable(name: str = "towerd") -> Path:
    """The ``towerd`` (or ``towerctl``) script installed beside this interpreter, else the
    one on PATH."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return beside.absolute()
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"cannot find the {name} executable; is towerd installed?")
    return Path(found).absolute()


def render_unit(name: str, towerd: Path) -> str:
    """The unit ``name`` with ``towerd``'s path as one word of its command line (quoted
    when it has a space, e.g. a venv under "~/My Projects": unquoted, systemd took the
    path's first word for the program and the unit could not start)."""
    template = resources.files("towerd.systemd").joinpath(name).read_text()
    return template.replace(PLACEHOLDER, unit_word(str(towerd)))


_SAFE_WORD = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_+-=:,./@")
_C_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\t": "\\t", "\r": "\\r"}


def unit_word(word: str) -> str:
    """``word`` as one word of an ``ExecStart=`` line that systemd reads back as exactly
    ``word``: ``%%`` and ``$$`` for a literal percent sign and dollar (no specifier, no
    variable is expanded), and, unless it is plain, in double quotes with C escapes for
    backslashes, quotes and control characters (systemd.service(5), "Command lines")."""
    text = word.replace("%", "%%").replace("$", "$$")
    if word and all(char in _SAFE_WORD for char in word):
        return text
    return '"' + "".join(_escaped(char) for char in text) + '"'


def _escaped(char: str) -> str:
    if char in _C_ESCAPES:
        return _C_ESCAPES[char]
    if ord(char) < 0x20 or ord(char) == 0x7F:
        return f"\\x{ord(char):02x}"
    return char


def render_notify_unit(towerctl: Path, notify_args: list[str]) -> str:
    """towerd-notify.service running ``towerctl notify NOTIFY_ARGS``."""
    template = resources.files("towerd.systemd").joinpath(NOTIFY_UNIT).read_text()
    return template.replace(TOWERCTL_PLACEHOLDER, unit_word(str(towerctl))).replace(
        NOTIFY_ARGS_PLACEHOLDER, " ".join(unit_word(arg) for arg in notify_args)
    )


def default_unit_dir() -> Path:
    config_home = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config_home) / "systemd" / "user"


ENABLE_COMMANDS = (
    ("systemctl", "--user", "daemon-reload"),
    ("systemctl", "--user", "enable", "--now", "towerd.socket"),
)
ENABLE_NOTIFY = ("systemctl", "--user", "enable", "--now", NOTIFY_UNIT)


def enable_commands(notify: bool = False) -> tuple[tuple[str, ...], ...]:
    return (*ENABLE_COMMANDS, ENABLE_NOTIFY) if notify else ENABLE_COMMANDS


def manual_commands(notify: bool = False) -> str:
    return " && ".join(" ".join(command) for command in enable_commands(notify))


class SystemctlFailed(Exception):
    """``--enable`` could not run a systemctl command (no user bus is the usual cause: a
    shell outside a login session, ``su``, ``sudo``, a container). The units are written."""

    def __init__(
        self, command: tuple[str, ...], why: str, installed: list[str], notify: bool = False
    ) -> None:
        self.command, self.why, self.installed = command, why, installed
        where = os.path.dirname(installed[0]) if installed else "the unit directory"
        super().__init__(
            f"the units are written to {where}, but `{' '.join(command)}` failed: {why}; "
            f"run `{manual_commands(notify)}` from a login session of this user (to keep "
            "towerd running without one, `loginctl enable-linger $USER` first)"
        )

    def data(self) -> dict[str, Any]:
        return {"command": list(self.command), "reason": self.why, "installed": self.installed}


def _run_systemctl(command: tuple[str, ...], installed: list[str], notify: bool) -> None:
    try:
        done = subprocess.run(
            command, check=False, capture_output=True, text=True, errors="replace"
        )
    except OSError as exc:  # no systemctl on this machine
        raise SystemctlFailed(command, exc.strerror or str(exc), installed, notify) from None
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        why = lines[-1] if lines else f"exit status {done.returncode}"
        raise SystemctlFailed(command, why, installed, notify)


def install_units(
    target_dir: Path | None = None,
    *,
    enable: bool = False,
    notify_args: list[str] | None = None,
) -> dict[str, Any]:
    """Write the units; with ``notify_args`` (``["--exec", CMD]`` or ``["--desktop"]``)
    also towerd-notify.service, running ``towerctl notify`` with them. With ``enable``,
    also reload and enable the socket (and the notify service); raises
    :class:`SystemctlFailed` if systemctl cannot."""
    target_dir = target_dir or default_unit_dir()
    target_dir.mkdir(parents=True, exist_ok=True)
    towerd = towerd_executable()
    towerctl = towerd_executable("towerctl") if notify_args is not None else None
    units = [(name, render_unit(name, towerd)) for name in UNITS]
    if towerctl is not None and notify_args is not None:
        units.append((NOTIFY_UNIT, render_notify_unit(towerctl, notify_args)))
    installed = []
    for name, text in units:
        path = target_dir / name
        path.write_text(text)
        installed.append(str(path))
    notify = towerctl is not None
    if enable:
        for command in enable_commands(notify):
            _run_systemctl(command, installed, notify)
    result: dict[str, Any] = {
        "installed": installed,
        "towerd": str(towerd),
        "enabled": enable,
        "next": None if enable else manual_commands(notify),
    }
    if towerctl is not None:
        result["towerctl"] = str(towerctl)
    return result
