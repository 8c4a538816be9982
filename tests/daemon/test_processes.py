"""Process identity: pid + start time, so a reused pid or a zombie is not the holder."""

from __future__ import annotations

import os
import subprocess

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
