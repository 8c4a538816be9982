"""Process identity: pid + start time, so a reused pid or a zombie is not the holder."""

from __future__ import annotations

import os
import subprocess
import sys

from towerd.daemon.processes import holder_of, is_alive, process_start_time
from towerd.daemon.store.idempotency import Holder


def test_live_process_is_its_own_holder():
    me = holder_of(os.getpid())
    assert me is not None and is_alive(me)


def test_same_pid_with_another_start_time_is_not_alive():
    """A reused pid has a different start time: the original holder counts as dead."""
    me = holder_of(os.getpid())
    assert not is_alive(Holder(me.pid, me.start + 1))


def test_exited_and_zombie_processes_are_dead():
    child = subprocess.Popen(["true"])
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped: a zombie
    assert process_start_time(child.pid) is None
    child.wait()
    assert process_start_time(child.pid) is None
    assert holder_of(child.pid) is None


OUT_OF_FDS = """
import os, resource, sys
from towerd.daemon.processes import Holder, LivenessUnknown, holder_of, is_alive
me = holder_of(os.getpid())
gone = Holder(me.pid, me.start + 1)
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
hoard = []
try:
    while True:
        hoard.append(os.open("/dev/null", os.O_RDONLY))
except OSError:
    pass
try:
    holder_of(os.getppid())
except LivenessUnknown:
    unknown = "raised"
else:
    unknown = "returned"
print(is_alive(me), is_alive(gone), unknown)
"""


def test_out_of_file_descriptors_is_unknown_never_dead():
    """With every fd in use (EMFILE), /proc cannot be read: any holder counts as alive
    (nothing is reaped on a guess), and holder_of says it cannot tell."""
    run = subprocess.run(
        [sys.executable, "-c", OUT_OF_FDS], capture_output=True, text=True, timeout=30
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["True", "True", "raised"]
