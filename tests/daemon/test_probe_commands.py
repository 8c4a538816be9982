"""run_command, the runner of every evidence probe, on real processes: a command that
leaves a detached descendant holding its output pipes still ends when the command
itself ends (or at the timeout), so four such probes cannot take every probe slot."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from towerd.daemon.probes import MAX_SHOWN, run_command
from towerd_testing import wait_for

# A regression would wait for the detached `sleep 30`: the watchdog kills it first, so
# such a run fails on its timing assertion in ~10 s instead of hanging for 30.
WATCHDOG_S = 10.0


def detached_sleeper(pidfile: Path) -> str:
    """Shell text starting `sleep 30` in a session of its own (out of the probe's process
    group, so the timeout's killpg misses it) that inherits the probe's stdout/stderr
    and records its pid in ``pidfile``."""
    return f"setsid sh -c 'echo $$ >> {pidfile}; exec sleep 30' &"


def kill_recorded(pidfile: Path) -> None:
    """SIGKILL every pid in ``pidfile`` that is still a `sleep`."""
    text = pidfile.read_text() if pidfile.exists() else ""
    for pid in (int(line) for line in text.split()):
        try:
            if b"sleep" in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGKILL)
        except (FileNotFoundError, ProcessLookupError):
            pass


@pytest.fixture
def pidfile(tmp_path: Path) -> Iterator[Path]:
    """Where the test's detached sleepers record their pids; each is killed at the end
    (and by the watchdog, should run_command wait for it)."""
    path = tmp_path / "sleepers"
    watchdog = threading.Timer(WATCHDOG_S, kill_recorded, (path,))
    watchdog.start()
    try:
        yield path
    finally:
        watchdog.cancel()
        wait_for(lambda: path.exists() and path.read_text().endswith("\n"), what="sleeper pid")
        kill_recorded(path)


def run_sh(script: str, timeout: float):
    return run_command(["/bin/sh", "-c", script], "/", dict(os.environ), timeout)


def test_the_commands_exit_status_decides_even_if_a_detached_child_holds_its_output(pidfile):
    """The probe exits 0 at once but leaves a detached child on its pipes (as an ssh
    ControlPersist master does): its status and what it wrote come back within the
    short grace, not when the child exits nor at the timeout."""
    started = time.monotonic()
    ran = run_sh(f"echo before; {detached_sleeper(pidfile)} exit 0", timeout=5)
    elapsed = time.monotonic() - started
    assert elapsed < 3, f"run_command took {elapsed:.1f} s"
    assert (ran.status, ran.stdout, ran.error) == (0, "before\n", None), ran


def test_a_command_still_running_at_the_timeout_is_killed_without_waiting_for_its_pipes(
    pidfile,
):
    """A probe still running at the timeout, with a detached child on its pipes: killed
    and reported timed out promptly, not once the detached child lets go of the pipes."""
    started = time.monotonic()
    ran = run_sh(f"{detached_sleeper(pidfile)} sleep 30", timeout=1)
    elapsed = time.monotonic() - started
    assert elapsed < 4, f"run_command took {elapsed:.1f} s"
    assert ran.status is None and "timed out" in (ran.error or ""), ran


def test_a_plain_command_gives_its_status_and_output():
    """Without any descendant the status and the output are returned as they were."""
    ran = run_sh("echo hi; echo oops >&2; exit 3", timeout=5)
    assert (ran.status, ran.stdout, ran.stderr, ran.error) == (3, "hi\n", "oops\n", None)


def test_a_flood_of_output_is_read_and_dropped_past_what_is_kept():
    """`head -c 64M /dev/zero` as a probe: its status comes back with the first
    characters only, and what run_command holds stays small (it once kept all of it:
    a tester's `cat /dev/zero` probe grew the daemon by ~1.9 GB)."""
    import tracemalloc

    tracemalloc.start()
    try:
        ran = run_sh("head -c 67108864 /dev/zero; echo err >&2; exit 0", timeout=30)
        _current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert (ran.status, ran.stderr, ran.error) == (0, "err\n", None), ran.error
    assert ran.stdout == "\0" * MAX_SHOWN
    assert peak < 4 * 1024 * 1024, f"peak {peak} bytes held while reading 64 MiB"
