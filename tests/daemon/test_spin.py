"""The loop stays awake for a window after an answer (daemon/spin.py), and only then.

What must hold: after the last answer the loop polls for at least the window (else the
lever does nothing) and then stops (else an idle daemon burns a CPU); never on one CPU;
``--spin-us 0`` is off. In-process on a real loop, then the real daemon's CPU time."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from towerd.daemon.spin import Spinner, cgroup_cpu_quota, cpu_budget
from towerd_testing import wait_for

TWO_CPUS = pytest.mark.skipif(
    cpu_budget() < 2, reason="the spin is off with less than two CPUs (affinity or quota)"
)


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
    answered_at = time.perf_counter()
    spinner.answered()
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
        last = time.perf_counter()
        spinner.answered()
        await asyncio.sleep(0.001)
    assert spinner.spinning or time.perf_counter() - last >= 0.02  # a stall may end it
    ended = await wait_until_still(spinner)
    assert ended - last >= 0.02


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


def running_share(pid: int, seconds: float) -> float:
    """The share of samples (one a millisecond) in which ``pid``'s main thread was
    running or waiting for a CPU (state R) rather than asleep: a spinning loop is R
    however little CPU a loaded machine gives it, a sleeping one S."""
    samples = running = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        with open(f"/proc/{pid}/stat") as stat:
            running += stat.read().rsplit(")", 1)[1].split()[0] == "R"
        samples += 1
        time.sleep(0.001)  # a sampling period, not a wait for anything
    return running / samples


@TWO_CPUS
def test_the_daemon_sleeps_after_its_window_and_spin_us_is_that_window(make_daemon) -> None:
    """By default (off) a daemon after 300 pings is asleep. A long window (--spin-us
    400000) keeps it running right after an answer, then it sleeps: the option reaches
    the server."""
    daemon = make_daemon().start()
    with daemon.client() as client:
        for _ in range(300):
            client.ping()
    assert running_share(daemon.pid, 0.3) < 0.2
    daemon.stop()
    spinning = make_daemon("long").start("--spin-us", "400000")
    with spinning.client() as client:
        client.ping()
        assert running_share(spinning.pid, 0.2) > 0.6
        wait_for(lambda: running_share(spinning.pid, 0.05) < 0.2, what="the window's end")


FAKETIME = next(iter(sorted(Path("/usr/lib").glob("*/faketime/libfaketimeMT.so.1"))), None)


@TWO_CPUS
@pytest.mark.skipif(FAKETIME is None, reason="needs libfaketime (Debian package faketime)")
def test_a_frozen_clock_does_not_keep_it_polling(make_daemon) -> None:
    """libfaketime with an absolute time freezes every clock, perf_counter's too: the
    window never passes, and only the bound on idle passes ends the poll."""
    daemon = make_daemon()
    frozen = daemon.env(
        LD_PRELOAD=str(FAKETIME), FAKETIME="2030-01-01 00:00:00", FAKETIME_DONT_RESET="1"
    )
    daemon.start("--spin-us", "200", env=frozen)
    with daemon.client() as client:
        client.ping()
        wait_for(lambda: running_share(daemon.pid, 0.05) < 0.2, what="the poll's end")


ANOTHER_UID_CLIENT = """
import socket, sys
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.connect(sys.argv[1])
while sock.recv(65536):
    pass
"""


@TWO_CPUS
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another uid")
def test_a_peer_refused_at_connect_does_not_make_it_poll(make_daemon, short_tmp: Path) -> None:
    """Another uid's connection is refused before any request: it buys no poll (a
    hostile user could otherwise keep a CPU busy with connects alone)."""
    daemon = make_daemon().start("--spin-us", "400000")
    for path in (short_tmp, daemon.socket_path.parent):
        path.chmod(0o755)
    daemon.socket_path.chmod(0o777)
    for _ in range(3):
        subprocess.run(
            ["/usr/bin/python3", "-I", "-c", ANOTHER_UID_CLIENT, str(daemon.socket_path)],
            user=65534, group=65534, check=True, timeout=30,
        )  # fmt: skip
        assert running_share(daemon.pid, 0.1) < 0.2
    daemon.socket_path.parent.chmod(0o700)


# --- a CPU quota (a container's --cpus, a unit's CPUQuota=) turns the poll off ---------


def writable_cpu_hierarchy() -> tuple[Path, int] | None:
    """Where this machine lets us make a cgroup with a CPU quota: the mount point of a
    hierarchy with the cpu controller, and its cgroup version."""
    v1 = Path("/sys/fs/cgroup/cpu")
    if (v1 / "cpu.cfs_quota_us").exists() and os.access(v1, os.W_OK):
        return v1, 1
    v2 = Path("/sys/fs/cgroup")
    controllers = v2 / "cgroup.subtree_control"
    if controllers.exists() and "cpu" in controllers.read_text().split() and os.access(v2, os.W_OK):
        return v2, 2
    return None


def own_cgroup(top: Path, version: int) -> Path:
    """This process's cgroup in the hierarchy mounted at ``top``."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if (version == 2 and controllers == "") or (
            version == 1 and "cpu" in controllers.split(",")
        ):
            return top / path.lstrip("/")
    return top


@pytest.fixture
def half_a_cpu() -> Iterator[Path]:
    """A real cgroup allowed half a CPU a period; its ``cgroup.procs``. Whatever is left
    in it at the end goes back to this process's own cgroup."""
    found = writable_cpu_hierarchy()
    if found is None:
        pytest.skip("no CPU cgroup this user may create (needs root, cgroup v1 cpu or v2)")
    top, version = found
    origin = own_cgroup(top, version)
    group = top / f"towerd-test-{os.getpid()}-{time.monotonic_ns()}"
    group.mkdir()
    try:
        if version == 1:
            (group / "cpu.cfs_period_us").write_text("100000")
            (group / "cpu.cfs_quota_us").write_text("50000")
        else:
            (group / "cpu.max").write_text("50000 100000")
        yield group / "cgroup.procs"
    finally:
        for pid in (group / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                (origin / "cgroup.procs").write_text(pid)
        wait_for(lambda: not (group / "cgroup.procs").read_text().split(), what="group empty")
        group.rmdir()


@TWO_CPUS
def test_a_cpu_quota_under_two_cpus_turns_the_poll_off(make_daemon, half_a_cpu: Path) -> None:
    """A daemon in a cgroup with half a CPU a period does not poll, even with a long
    window (which the test above shows running outside it)."""
    daemon = make_daemon().start("--spin-us", "400000")
    try:
        half_a_cpu.write_text(str(daemon.pid))  # before its first answer asks the quota
        with daemon.client() as client:
            client.ping()
            assert running_share(daemon.pid, 0.2) < 0.2
    finally:
        daemon.stop()


# --- reading the quota: this machine's own layout runs above; others from their files --


def fake_proc(tmp_path: Path, cgroup: str, mountinfo: str | bytes) -> Path:
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "cgroup").write_text(cgroup)
    data = mountinfo if isinstance(mountinfo, bytes) else mountinfo.encode()
    (proc / "mountinfo").write_bytes(data)
    return proc


def test_a_v2_quota_is_the_smallest_on_the_way_up(tmp_path: Path) -> None:
    """cgroup v2 (this machine lends its cpu controller to v1, so v2's files are plain
    files here): the leaf has none, a parent 1.5 CPUs, the hierarchy's root none."""
    sysfs = tmp_path / "sys fs"  # a space: mountinfo writes it \040
    leaf = sysfs / "user.slice" / "towerd.service"
    leaf.mkdir(parents=True)
    (sysfs / "cpu.max").write_text("max 100000\n")
    (sysfs / "user.slice" / "cpu.max").write_text("150000 100000\n")
    (leaf / "cpu.max").write_text("max 100000\n")
    mount = str(sysfs).replace(" ", "\\040")
    mountinfo = (
        f"24 1 0:22 / / rw - ext4 /dev/vda rw\n"
        f"31 24 0:28 / {mount} rw,relatime shared:9 - cgroup2 cgroup2 rw,nsdelegate\n"
    )
    proc = fake_proc(tmp_path, "0::/user.slice/towerd.service\n", mountinfo)
    assert cgroup_cpu_quota(proc) == 1.5
    (leaf / "cpu.max").write_text("25000 50000\n")
    assert cgroup_cpu_quota(proc) == 0.5


def test_a_namespaced_v1_mount_and_odd_bytes(tmp_path: Path) -> None:
    """A container's view: the hierarchy mounted from its own root (root field not /),
    a mount point whose name is not UTF-8 elsewhere in mountinfo, hierarchies without
    the cpu controller; no quota anywhere reads as None, and nothing raises."""
    sysfs = tmp_path / "cpu"
    (sysfs / "job").mkdir(parents=True)
    (sysfs / "cpu.cfs_quota_us").write_text("-1\n")
    (sysfs / "cpu.cfs_period_us").write_text("100000\n")
    mountinfo = (
        b"24 1 0:22 / / rw - ext4 /dev/vda rw\n"
        b"25 24 0:40 / /media/caf\xe9 rw - vfat /dev/sdb1 rw\n"
        b"32 24 0:29 /docker/abc " + str(sysfs).encode() + b" rw - cgroup cgroup rw,cpu,cpuacct\n"
        b"33 24 0:30 /docker/abc /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
    )
    proc = fake_proc(tmp_path, "4:memory:/docker/abc\n2:cpu,cpuacct:/docker/abc/job\n", mountinfo)
    assert cgroup_cpu_quota(proc) is None
    (sysfs / "job" / "cpu.cfs_quota_us").write_text("150000\n")
    (sysfs / "job" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_quota(proc) == 1.5
