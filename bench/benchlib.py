"""Shared by the benchmarks and the torture: a real towerd subprocess, the echo server
(the least a server can do per frame), the machine's description, and percentiles."""

from __future__ import annotations

import os
import platform
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

TOWERD = str(Path(sys.executable).parent / "towerd")
HERE = Path(__file__).resolve().parent


class Daemon:
    """A towerd on ``workdir``; ``start`` returns once it sent READY=1."""

    def __init__(
        self,
        workdir: Path,
        extra_args: list[str] | None = None,
        *,
        state_dir: Path | None = None,
        env: dict[str, str] | None = None,
        prefix: list[str] | None = None,
    ) -> None:
        self.socket_path = workdir / "run" / "towerd.sock"
        self.state_dir = state_dir or workdir / "state"
        self.extra_args = extra_args or []
        self.extra_env = env or {}  # e.g. libfaketime for a stepped wall clock
        self.prefix = prefix or []  # e.g. nsenter into a mount namespace
        self.log = open(workdir / "daemon.log", "ab")  # noqa: SIM115 - lives as long as we do
        self.notify_path = workdir / "notify"
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notify.bind(str(self.notify_path))
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, crash_at: str | None = None) -> bool:
        """Start; True once READY, False if it died first (an armed start-up crash)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TOWERD_", "LISTEN_"))}
        env["NOTIFY_SOCKET"] = str(self.notify_path)
        env.update(self.extra_env)
        if crash_at:
            env["TOWERD_CRASH_AT"] = crash_at
        command = [
            *self.prefix,
            TOWERD, "--socket", str(self.socket_path), "--state-dir", str(self.state_dir),
            "--log-format", "json", "--log-level", "warning", *self.extra_args,
        ]  # fmt: skip
        self.proc = subprocess.Popen(command, env=env, stdout=self.log, stderr=self.log)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            self.notify.settimeout(0.05)
            try:
                if b"READY=1" in self.notify.recv(4096):
                    return True
            except TimeoutError:
                if self.proc.poll() is not None:
                    return False
        raise RuntimeError("the daemon did not become ready within 60 s")

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def kill(self) -> None:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def died_by_itself(self, timeout: float) -> bool:
        assert self.proc is not None
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        return True

    def stop(self) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(30)

    def rss_mib(self) -> float:
        for line in open(f"/proc/{self.pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")


def start_echo(
    path: Path, replies: Path | None = None, uvloop: bool = True
) -> subprocess.Popen[str]:
    """bench/echo_server.py on ``path``, returned once it listens."""
    command = [sys.executable, str(HERE / "echo_server.py"), "--socket", str(path)]
    command += (["--replies", str(replies)] if replies else []) + (
        [] if uvloop else ["--no-uvloop"]
    )
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()  # blocks until it listens (or dies: EOF)
    if not line.startswith("READY"):
        raise RuntimeError(f"the echo server did not start (exit status {proc.wait()})")
    return proc


def machine() -> str:
    """One line describing where the figures were measured."""
    return (
        f"machine: {os.cpu_count()} cores, {platform.machine()}, Python "
        f"{platform.python_version()}, SQLite {sqlite3.sqlite_version}, {platform.system()} "
        f"{platform.release()}"
    )


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]
