"""The loop stays awake for a window after an answer (daemon/spin.py), and only then.

What must hold: after the last answer the loop polls for at least the window (else the
lever does nothing) and then stops (else an idle daemon burns a CPU); never on one CPU;
``--spin-us 0`` is off. In-process on a real loop, then the real daemon's CPU time."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from towerd.daemon.spin import Spinner, cpus_available
from towerd_testing import Daemon

TWO_CPUS = pytest.mark.skipif(cpus_available() < 2, reason="the spin is off on one CPU")


async def wait_until_still(spinner: Spinner, timeout: float = 5.0) -> float:
    """When the spin ended (perf_counter), polled from the loop it runs on."""
    deadline = time.perf_counter() + timeout
    while spinner.spinning:
        assert time.perf_counter() < deadline, "the loop is still spinning"
        await asyncio.sleep(0.0005)
    return time.perf_counter()


@TWO_CPUS
@pytest.mark.anyio
async def test_the_loop_polls_for_the_window_after_the_last_answer_then_sleeps() -> None:
    spinner = Spinner(20_000)  # 20 ms: long against the loop's pace, short for a test
    spinner.answered()
    answered_at = time.perf_counter()
    assert spinner.spinning
    ended = await wait_until_still(spinner)
    assert ended - answered_at >= 0.02
    # Stopped for good: the loop now sleeps, so this thread spends ~no CPU while it waits.
    cpu_before = time.thread_time()
    await asyncio.sleep(0.2)
    assert time.thread_time() - cpu_before < 0.05
    assert not spinner.spinning


@TWO_CPUS
@pytest.mark.anyio
async def test_answers_keep_it_polling_and_the_window_counts_from_the_last() -> None:
    spinner = Spinner(20_000)
    started = time.perf_counter()
    while time.perf_counter() - started < 0.06:  # three windows of answers
        spinner.answered()
        await asyncio.sleep(0.001)
        assert spinner.spinning
    last = time.perf_counter()
    ended = await wait_until_still(spinner)
    assert ended - last >= 0.015  # a window after the last answer (less one pass's slack)


@pytest.mark.anyio
async def test_zero_turns_it_off() -> None:
    spinner = Spinner(0)
    spinner.answered()
    assert not spinner.spinning


@pytest.mark.anyio
async def test_it_is_off_on_one_cpu() -> None:
    """The poll would hold the very CPU the client needs to send its next request."""
    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(allowed)})
    try:
        spinner = Spinner(20_000)
        spinner.answered()
        assert not spinner.spinning
    finally:
        os.sched_setaffinity(0, allowed)


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def daemon_cpu_over(daemon: Daemon, seconds: float) -> float:
    before = cpu_seconds(daemon.pid)
    time.sleep(seconds)  # a measuring window, not a wait for anything
    return cpu_seconds(daemon.pid) - before


def test_the_daemon_idles_after_answers_and_spin_us_is_its_window(make_daemon) -> None:
    """The default window ends: a daemon idle after 300 pings spends (nearly) no CPU.
    A long window (--spin-us 400000) keeps it busy right after an answer: the option
    reaches the server."""
    daemon = make_daemon().start()
    with daemon.client() as client:
        for _ in range(300):
            client.ping()
    assert daemon_cpu_over(daemon, 0.5) < 0.1
    daemon.stop()
    if cpus_available() < 2:
        return
    spinning = make_daemon("long").start("--spin-us", "400000")
    with spinning.client() as client:
        client.ping()
        busy = daemon_cpu_over(spinning, 0.3)
    assert busy > 0.15, f"{busy:.3f} s of CPU in 0.3 s after an answer with a 0.4 s window"
    assert daemon_cpu_over(spinning, 0.6) < 0.3  # and it ends (~0.1 s of it left)
