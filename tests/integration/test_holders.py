"""A key's holder is a process: when it dies mid-effect the key turns outcome_unknown
while the daemon keeps running; a closed connection alone changes nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from towerd_testing import towerctl, wait_for

pytestmark = pytest.mark.both_backends

CLAIMANT = textwrap.dedent(
    """
    import signal, sys
    from towerd.client import Client
    socket_path, key = sys.argv[1], sys.argv[2]
    with Client(socket_path) as client:
        client.idem_claim("session.spawn", key)
    print("claimed", flush=True)   # connection closed; the process lives on
    signal.pause()
    """
)


def start_claimant(daemon, key: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", CLAIMANT, str(daemon.socket_path), key],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "claimed"
    return proc


def state_of(daemon, key: str) -> str:
    with daemon.client() as client:
        return client.idem_get("session.spawn", key)["state"]


def test_dead_claimant_key_turns_unknown_and_live_one_stays(daemon):
    """kill -9 of a claimant makes its key outcome_unknown within seconds; another
    claimant whose connection closed but whose process lives keeps its key in_progress."""
    living = start_claimant(daemon, "held-by-living")
    doomed = start_claimant(daemon, "held-by-doomed")
    try:
        doomed.send_signal(signal.SIGKILL)
        doomed.wait(10)
        wait_for(
            lambda: state_of(daemon, "held-by-doomed") == "outcome_unknown",
            timeout=10,
            what="the dead claimant's key to turn outcome_unknown",
        )
        # That sweep ran after the living claimant's connection had closed.
        assert state_of(daemon, "held-by-living") == "in_progress"
        assert daemon.proc.poll() is None
    finally:
        living.kill()
        living.wait(10)
    wait_for(
        lambda: state_of(daemon, "held-by-living") == "outcome_unknown",
        timeout=10,
        what="the second claimant's key after its death",
    )


def test_holder_pid_of_a_shell_wrapper(daemon):
    """`idem claim --holder-pid PID` makes that process the holder: the key lives as long
    as it does, across separate CLI invocations."""
    wrapper = subprocess.Popen(["sleep", "600"])
    try:
        claimed = towerctl(
            daemon,
            "--json",
            "idem",
            "claim",
            "git.push",
            "wrapped",
            "--holder-pid",
            str(wrapper.pid),
        )
        assert claimed.returncode == 0, claimed.stderr
        with daemon.client() as client:
            record = client.idem_get("git.push", "wrapped")
        assert record["holder_pid"] == wrapper.pid and record["state"] == "in_progress"
    finally:
        wrapper.kill()
        wrapper.wait(10)

    def state() -> str:
        with daemon.client() as client:
            return client.idem_get("git.push", "wrapped")["state"]

    wait_for(lambda: state() == "outcome_unknown", timeout=10, what="the wrapper's key")


def test_holder_pid_must_be_a_running_process(daemon):
    """A holder that does not exist is refused bad_args and records nothing."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    result = towerctl(daemon, "--json", "idem", "claim", "op", "k", "--holder-pid", str(dead.pid))
    assert result.returncode == 1
    assert '"bad_args"' in result.stdout
    with daemon.client() as client:
        assert client.idem_list()["keys"] == []


def test_key_of_a_living_holder_stays_in_progress(daemon):
    """A key claimed by this (living) test process survives liveness sweeps untouched."""
    with daemon.client() as client:
        client.idem_claim("op", "mine")
        assert client.idem_get("op", "mine")["holder_pid"] == os.getpid()
    # A sweep with us alive leaves it in progress; prove a sweep ran with a witness.
    witness = start_claimant(daemon, "witness")
    witness.kill()
    witness.wait(10)
    wait_for(lambda: state_of(daemon, "witness") == "outcome_unknown", timeout=10, what="witness")
    with daemon.client() as client:
        assert client.idem_get("op", "mine")["state"] == "in_progress"


SPAWNER_DIES_AFTER_EFFECT = textwrap.dedent(
    """
    import signal, sys
    from towerd.client import Client
    with Client(sys.argv[1]) as client:
        claim = client.idem_claim("session.spawn", "spawned-then-died")
        client.session_register(cwd="/r", agent="claude", session_id=claim["effect_ref"])
    print(claim["effect_ref"], flush=True)
    signal.pause()   # killed before idem.complete
    """
)


def test_dead_claimant_with_evidence_completes_without_restart(daemon):
    """A spawner killed after registering its row but before idem.complete: the daemon
    notices the death and settles the key from the row, completed, with its session id."""
    proc = subprocess.Popen(
        [sys.executable, "-c", SPAWNER_DIES_AFTER_EFFECT, str(daemon.socket_path)],
        stdout=subprocess.PIPE,
        text=True,
    )
    session_id = proc.stdout.readline().strip()
    proc.kill()
    proc.wait(10)
    wait_for(
        lambda: state_of(daemon, "spawned-then-died") == "completed",
        timeout=10,
        what="the key to settle from evidence",
    )
    with daemon.client() as client:
        record = client.idem_get("session.spawn", "spawned-then-died")
        assert record["result"]["session_id"] == session_id
        assert client.status()["reconciliation"]["completed_from_evidence"] == 0  # no restart
