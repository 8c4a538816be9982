"""Process identity: pid + start time, so a reused pid or a zombie is not the holder."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from towerd.daemon.processes import holder_of, is_alive, process_start_time
from towerd.daemon.store.idempotency import Holder
from towerd_testing import wait_for


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


AS_NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
NOT_DUMPABLE = r"""
import ctypes, sys, time
ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: its /proc files are root's
open(sys.argv[1], "w").close()
time.sleep(120)
"""
SCAN = r"""
import json
from towerd.daemon.processes import carried_values, process_start_time
found = carried_values("TOWERD_RUN_ATTEMPT")
print(json.dumps({
    "values": found.values,
    "unreadable": {h.pid: h.start for h in found.unreadable},
    "before": found.may_carry("hidden", 0),
    "after": found.may_carry("hidden", 2**62),
}))
"""


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root and setpriv(1) to act as another user")  # fmt: skip
def test_a_process_of_ours_whose_environment_cannot_be_read_may_carry_any_value():
    """A daemon that is not root cannot read the environment of its own user's setuid
    or non-dumpable processes: it took them for carrying nothing, so a probe said "not
    done" while such a command (run --probe) still ran and a retry ran it again (a
    hostile tester's reproducer). They are listed apart, and may carry any value of a
    process that started before them. Real processes of a real other uid (nobody)."""
    tmp_path = Path(tempfile.mkdtemp(dir="/tmp"))  # pytest's own is not open to nobody
    tmp_path.chmod(0o777)
    ready = tmp_path / "ready"
    env = {**os.environ, "TOWERD_RUN_ATTEMPT": "hidden"}
    hidden = subprocess.Popen([*AS_NOBODY, sys.executable, "-c", NOT_DUMPABLE, str(ready)], env=env)
    seen = subprocess.Popen(
        [*AS_NOBODY, sys.executable, "-c", "import time; time.sleep(120)"],
        env={**os.environ, "TOWERD_RUN_ATTEMPT": "seen"},
    )
    try:
        wait_for(lambda: ready.exists(), what="the non-dumpable process")
        done = subprocess.run(
            [*AS_NOBODY, sys.executable, "-c", SCAN], capture_output=True, text=True,
            cwd=tmp_path, env={k: v for k, v in os.environ.items() if k != "TOWERD_RUN_ATTEMPT"},
            check=True,
        )  # fmt: skip
        found = json.loads(done.stdout)
        assert found["values"].get("seen") == seen.pid and "hidden" not in found["values"]
        assert str(hidden.pid) in found["unreadable"]
        assert found["before"][0] == "command_may_run"
        assert found["after"] is None  # it started before the value was set: not its own
    finally:
        for proc in (hidden, seen):
            proc.kill()
            proc.wait(10)
        shutil.rmtree(tmp_path)
