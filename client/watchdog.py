"""What a command run under a lease started goes when towerctl goes.

Linux's parent-death signal (``PR_SET_PDEATHSIG``) reaches towerctl's direct child only:
a script's own steps (the ``git push`` a script runs) outlived a killed towerctl and
went on after its lease had been released, beside the next holder's (a hostile
tester's reproducer: two pushes; a second ``lock worktree`` writing beside the first's
leftover). So CMD and all it starts carry a mark in their environment (a token in
``TOWERD_RUN_ATTEMPT``, which the evidence probes read too), and a watchdog process,
started beside CMD, waits on a pipe only towerctl can write to: a byte says CMD ended
(it leaves), end of file says towerctl died, and it then signals every process carrying
the mark (``signum``, then SIGKILL after a grace) until none is left. Not reached, as
for the probes: a process that cleared or rewrote its environment. Its scan of
/proc is daemon/processes.py's ``carried_values`` written again on purpose: the
watchdog is a bare ``python -I -S -c`` that imports nothing of towerd (and the client
nothing of the daemon).
"""

from __future__ import annotations

import os
import sys

from towerd.protocol.naming import RUN_ATTEMPT_VARIABLE

GRACE_SECONDS = 2.0  # between the signal and SIGKILL
GIVE_UP_SECONDS = 10.0  # a process SIGKILL does not end (D state) is left to the kernel

_WATCHDOG = r"""
import os, signal, sys, time
variable, mark = sys.argv[1].encode(), sys.argv[2].encode()
signum, grace, give_up = int(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5])
if os.read(0, 1):
    sys.exit(0)  # CMD ended: towerctl said so
prefix, own = variable + b"=", os.getpid()
def marked():
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == own:
            continue
        try:
            with open("/proc/" + name + "/environ", "rb") as environ:
                entries = environ.read().split(b"\0")
        except OSError:
            continue
        for entry in entries:
            if entry.startswith(prefix) and mark in entry[len(prefix):].split():
                found.append(int(name))
    return found
start = time.monotonic()
while (pids := marked()) and time.monotonic() - start < give_up:
    sent = signum if time.monotonic() - start < grace else signal.SIGKILL
    for pid in pids:
        try:
            os.kill(pid, sent)
        except OSError:
            pass
    time.sleep(0.05)
"""


def add_mark(token: str) -> None:
    """Add ``token`` to this process's ``TOWERD_RUN_ATTEMPT`` (what CMD will inherit),
    keeping the tokens already there: a command run inside another marked one carries
    both, and each watcher finds it."""
    tokens = os.environ.get(RUN_ATTEMPT_VARIABLE, "").split()
    if token not in tokens:
        os.environ[RUN_ATTEMPT_VARIABLE] = " ".join([*tokens, token])


class Watchdog:
    """The watchdog of the processes carrying ``mark`` (already in this process's
    environment, so in CMD's): :meth:`stand_down` once CMD has ended."""

    def __init__(self, mark: str, signum: int) -> None:
        import subprocess

        read_end, self._write_end = os.pipe()  # not inheritable: CMD never holds it
        env = {k: v for k, v in os.environ.items() if k != RUN_ATTEMPT_VARIABLE}
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _WATCHDOG, RUN_ATTEMPT_VARIABLE, mark,
                 str(signum), str(GRACE_SECONDS), str(GIVE_UP_SECONDS)],
                stdin=read_end, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                env=env, start_new_session=True,
            )  # fmt: skip
        finally:
            os.close(read_end)

    def stand_down(self, *, end_the_rest: bool = False) -> None:
        """CMD has ended: the watchdog leaves; with ``end_the_rest`` (towerctl was told
        to stop, and passed it on to CMD alone) it first ends every process still
        carrying the mark, as if towerctl had died, and this waits for that."""
        if not end_the_rest:
            try:
                os.write(self._write_end, b"x")
            except OSError:
                pass
        os.close(self._write_end)
        self.proc.wait()
