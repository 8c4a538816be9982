"""Optionally keep the event loop awake for a moment after an answer (``--spin-us``).

Why: a client writing in turn (a service, an agent loop; bench/writes.py at 1 client)
sends its next request tens of microseconds after its answer. If the loop went to sleep
in ``epoll_wait`` meanwhile, that request pays for waking it: on this project's VMs the
idle vCPU halts and an interrupt must bring it back. With a window, after each answer
the loop goes on polling (``epoll_wait`` with a zero timeout) until the window has
passed with no answer, as Go's scheduler spins a little before it parks a thread.

Off by default, because it helps one pattern and hurts others (bench/README.md, "The
loop kept awake after an answer"): on an otherwise idle 2-core VM, 200 us gave 1-client
writes +10%, 8 clients +9%, back-to-back reads a round trip of ~25 us instead of ~85;
but a client pausing ~150 us between requests got slower answers at 7-10x the daemon's
CPU, and with the CPUs busy with other work the poll cost clients up to 10x (a hostile
test). It is off when this process may use less than two CPUs, by its affinity or by
its cgroup's CPU quota (a container's ``--cpus``, a unit's ``CPUQuota=``: the poll
would spend a quota whose end stalls the daemon until the next period), and a poll
ends after a bounded number of idle passes even if the clock does not move.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from pathlib import Path

DEFAULT_SPIN_US = 0  # off; see above
BUDGET_RECHECK_S = 1.0  # how long the CPUs this process may use are taken as known
# Idle passes a poll may make per microsecond of its window, whatever the clock says: an
# idle pass (a system call and a callback) takes well over a quarter of a microsecond, so
# only a clock that does not advance (libfaketime's frozen time) meets this bound.
MAX_IDLE_PASSES_PER_US = 4


def cpus_available() -> int:
    """How many CPUs this process may run on (its affinity, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not on Linux
        return os.cpu_count() or 1


def cpu_budget() -> float:
    """The CPUs this process may use: its affinity, capped by its cgroup's CPU quota."""
    quota = cgroup_cpu_quota()
    cpus = float(cpus_available())
    return cpus if quota is None else min(cpus, quota)


def cgroup_cpu_quota(proc: Path = Path("/proc/self")) -> float | None:
    """CPUs a period that this process's cgroups allow (the smallest quota on the way up
    to each hierarchy's root, v2 ``cpu.max`` or v1 ``cpu.cfs_quota_us``), or None when
    none is set or none can be read. Quotas above a cgroup namespace's root are not
    visible from inside it."""
    try:
        memberships = _read_lines(proc / "cgroup")
        mounts = _read_lines(proc / "mountinfo")
    except OSError:
        return None
    mounts_of = {version: _cgroup_mounts(mounts, version) for version in (1, 2)}
    quotas: list[float] = []
    for membership in memberships:
        _, _, rest = membership.partition(":")
        controllers, _, path = rest.partition(":")
        version = 2 if controllers == "" else 1 if "cpu" in controllers.split(",") else 0
        for root, mount_point in mounts_of.get(version, []):
            if path == root or path.startswith(root.rstrip("/") + "/"):
                top = Path(mount_point)
                quotas.extend(_quotas_up_to(top / path[len(root) :].strip("/"), top, version))
    return min(quotas) if quotas else None


def _read_lines(path: Path) -> list[str]:
    """A /proc file's lines; bytes that are not UTF-8 (a mount point's name) kept as
    surrogates, as os.fsdecode does, so they still name the same path."""
    return path.read_bytes().decode("utf-8", "surrogateescape").splitlines()


_ESCAPE = re.compile(r"\\([0-7]{3})")


def _unescape(field: str) -> str:
    """A mountinfo field as the path it names: the kernel writes space, tab, newline
    and backslash as octal escapes (\\040 ...)."""
    return _ESCAPE.sub(lambda match: chr(int(match.group(1), 8)), field)


def _cgroup_mounts(mountinfo: list[str], version: int) -> list[tuple[str, str]]:
    """(root within the hierarchy, mount point) of each mount of that cgroup version
    (v1: the hierarchies with the ``cpu`` controller)."""
    found = []
    for line in mountinfo:
        fields, _, after = line.partition(" - ")
        parts, tail = fields.split(), after.split()
        if len(parts) < 5 or len(tail) < 3:
            continue
        fstype, options = tail[0], tail[2].split(",")
        if (version == 2 and fstype == "cgroup2") or (
            version == 1 and fstype == "cgroup" and "cpu" in options
        ):
            found.append((_unescape(parts[3]), _unescape(parts[4])))
    return found


def _quotas_up_to(directory: Path, top: Path, version: int) -> list[float]:
    quotas = []
    while True:
        try:
            if version == 2:
                limit, period = (directory / "cpu.max").read_text().split()[:2]
            else:
                limit = (directory / "cpu.cfs_quota_us").read_text().strip()
                period = (directory / "cpu.cfs_period_us").read_text().strip()
            if limit not in ("max", "-1") and int(period) > 0:
                quotas.append(int(limit) / int(period))
        except (OSError, ValueError):
            pass  # not a cgroup directory we may read (or no quota file at the root)
        if directory == top or top not in directory.parents:
            return quotas
        directory = directory.parent


class Spinner:
    """Call ``answered()`` after each answer: the loop keeps polling until ``window_us``
    has passed without one. ``spinning`` says whether it does now."""

    def __init__(self, window_us: int) -> None:
        self.window_s = max(window_us, 0) / 1e6
        self.spinning = False
        self.answers = 0  # answers so far: a pass that sees a new one knows the loop is busy
        self._seen = 0
        self._quiet_since = 0.0
        self._idle_passes = 0
        self._max_idle_passes = max(int(window_us * MAX_IDLE_PASSES_PER_US), 100)
        self._budget_known_until = 0.0  # perf_counter until which _budget_allows stands
        self._budget_allows = False
        self._loop: asyncio.AbstractEventLoop | None = None

    def answered(self) -> None:
        # Per answer only a count: the clock is read once a pass, in _poll.
        self.answers += 1
        if not self.spinning and self.window_s:
            self._start()

    def _start(self) -> None:
        now = time.perf_counter()
        if now >= self._budget_known_until:
            # Asked when a spin starts, at most once a second: it costs system calls and
            # file reads, and the affinity (taskset) or the quota (systemctl
            # set-property) can change. A failure to tell means no spin: an answer
            # never fails for it.
            self._budget_known_until = now + BUDGET_RECHECK_S
            try:
                self._budget_allows = cpu_budget() >= 2
            except Exception:  # noqa: BLE001 - the poll is an optimisation, never a fault
                self._budget_allows = False
        if not self._budget_allows:
            return
        self._loop = asyncio.get_running_loop()
        self._seen, self._quiet_since, self._idle_passes = self.answers, now, 0
        self._loop.call_soon(self._poll)
        self.spinning = True

    def _poll(self) -> None:
        """One pass of the loop. While a callback is ready the loop polls for I/O without
        sleeping, so this one queues itself again until the window is over."""
        now = time.perf_counter()
        if self.answers != self._seen:  # answered since the last pass: busy, go on
            self._seen, self._quiet_since, self._idle_passes = self.answers, now, 0
        else:
            self._idle_passes += 1
            if (
                now - self._quiet_since >= self.window_s
                or self._idle_passes > self._max_idle_passes
            ):
                self.spinning = False
                return
        # No sched_yield on idle passes: on Linux 6.18 (EEVDF) it put the daemon behind
        # a CPU-bound process for a whole slice, ~4 ms an answer (bench/README.md).
        assert self._loop is not None
        self._loop.call_soon(self._poll)
