"""No failure of a background task stops the daemon: a full disk under the holder sweep
and the expiry pass, /proc unreadable for lack of file descriptors, and a start on a
full disk is a clean refusal rather than a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from towerd.client import OutcomeUnknown
from towerd_testing import can_mount_tmpfs, fill_filesystem, spawn_on_small_disk, towerctl, wait_for

EXIT_REFUSED = 78

CLAIMANT = textwrap.dedent(
    """
    import sys
    from towerd.client import Client
    with Client(sys.argv[1]) as client:
        client.idem_claim("push", "held")
    print("claimed", flush=True)
    sys.stdin.read()  # hold the key until killed
    """
)


def _refused_full(daemon, method: str) -> bool:
    """The daemon's log shows ``method`` answered storage_full."""
    for line in daemon.log().splitlines():
        if '"request_failed"' in line and '"storage_full"' in line:
            if json.loads(line).get("method") == method:
                return True
    return False


def _upkeep(daemon) -> dict[str, dict]:
    with daemon.client() as client:
        return {task["name"]: task for task in client.status()["upkeep"]}


def _claim_from_a_child(daemon) -> subprocess.Popen[str]:
    child = subprocess.Popen(
        [sys.executable, "-c", CLAIMANT, str(daemon.socket_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None and child.stdout.readline() == "claimed\n"
    return child


@pytest.mark.skipif(can_mount_tmpfs() is not None, reason=str(can_mount_tmpfs()))
def test_a_full_disk_under_the_holder_sweep_is_survived(make_daemon, short_tmp):
    """The claimant dies while the disk is full: settling its key fails storage_full
    (the expiry pass runs meanwhile, every 0.1 s); the daemon logs it, keeps serving,
    `doctor` names it, and once space is freed the key is settled (outcome_unknown)
    without a restart."""
    daemon = make_daemon()
    mountpoint = short_tmp / "smallfs"
    mountpoint.mkdir(mode=0o700)
    daemon.state_dir = mountpoint / "state"
    spawn_on_small_disk(
        daemon, mountpoint, "--holder-check-interval", "0.1", "--expiry-interval", "0.1"
    )
    daemon.notify.wait_for("READY=1", 20, alive=lambda: daemon.proc.poll() is None)
    inside = f"/proc/{daemon.pid}/root{mountpoint}"
    child = _claim_from_a_child(daemon)
    filler = fill_filesystem(inside)
    child.kill()
    child.wait()
    wait_for(
        lambda: _upkeep(daemon).get("holder_sweep", {}).get("failures", 0) >= 1,
        what="the sweep failing on the full disk",
    )
    assert daemon.proc.poll() is None
    sweep = _upkeep(daemon)["holder_sweep"]
    assert sweep["last_error_code"] == "storage_full", sweep
    doctor = towerctl(daemon, "--json", "doctor")
    assert doctor.returncode == 1 and "holder_sweep" in doctor.stdout, doctor.stdout
    with daemon.client() as client:
        assert client.ping()["pong"]
        assert client.idem_get("push", "held")["state"] == "in_progress"
    os.unlink(filler)
    wait_for(lambda: _upkeep(daemon)["holder_sweep"]["failures"] == 0, timeout=20, what="retry")
    with daemon.client() as client, pytest.raises(OutcomeUnknown):
        client.idem_claim("push", "held")
    assert '"upkeep_failed"' in daemon.log() and '"upkeep_recovered"' in daemon.log()
    assert daemon.stop() == 0


@pytest.mark.skipif(can_mount_tmpfs() is not None, reason=str(can_mount_tmpfs()))
def test_a_start_on_a_full_disk_is_a_clean_refusal(make_daemon, short_tmp):
    """A state dir copied onto a tmpfs that is then filled: the start exits 78 with one
    clear line (no traceback), and the database is left intact."""
    seed = make_daemon("seed").start()
    with seed.client() as client:
        client.idem_claim("push", "k")
        client.idem_complete("push", "k", {})
    assert seed.stop() == 0
    daemon = make_daemon()
    mountpoint = short_tmp / "smallfs"
    mountpoint.mkdir(mode=0o700)
    daemon.state_dir = mountpoint / "state"
    proc = spawn_on_small_disk(
        daemon,
        mountpoint,
        before_exec=(
            f'cp -a "{seed.state_dir}" "$M/state"; '
            'dd if=/dev/zero of="$M/filler" bs=4096 2>/dev/null'
        ),
    )
    assert proc.wait(30) == EXIT_REFUSED, daemon.log()
    log = daemon.log()
    assert "is full" in log and "Traceback" not in log, log


RUN_ONCE_ON_A_FILLING_DISK = textwrap.dedent(
    """
    import json, os, sys
    from towerd.client import run_once
    socket_path, fill_dir, mode = sys.argv[1], sys.argv[2], sys.argv[3]

    def effect(effect_ref):
        # The effect fills the daemon's disk: recording its outcome meets storage_full.
        with open(os.path.join(fill_dir, "filler"), "wb") as filler:
            try:
                while True:
                    filler.write(b"\\0" * 65536)
                    filler.flush()
            except OSError:
                pass
        return {"ref": effect_ref}

    if mode == "async":
        import anyio
        from towerd.client import run_once_async
        result = anyio.run(lambda: run_once_async("op", "k", effect, socket_path=socket_path,
                                                   backoff=0.05, max_backoff=0.2))
    else:
        result = run_once("op", "k", effect, socket_path=socket_path, backoff=0.05,
                          max_backoff=0.2)
    print(json.dumps(result), flush=True)
    """
)


@pytest.mark.skipif(can_mount_tmpfs() is not None, reason=str(can_mount_tmpfs()))
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_run_once_keeps_recording_the_outcome_until_space_is_freed(make_daemon, short_tmp, mode):
    """The effect ran; recording it fails storage_full: run_once (and run_once_async)
    sends the completion again, with backoff, until the disk has room, instead of
    giving up with the key left in progress."""
    daemon = make_daemon()
    mountpoint = short_tmp / "smallfs"
    mountpoint.mkdir(mode=0o700)
    daemon.state_dir = mountpoint / "state"
    spawn_on_small_disk(daemon, mountpoint)
    daemon.notify.wait_for("READY=1", 20, alive=lambda: daemon.proc.poll() is None)
    inside = f"/proc/{daemon.pid}/root{mountpoint}"
    runner = subprocess.Popen(
        [sys.executable, "-c", RUN_ONCE_ON_A_FILLING_DISK, str(daemon.socket_path), inside, mode],
        stdout=subprocess.PIPE,
        text=True,
    )
    wait_for(
        lambda: _refused_full(daemon, "idem.complete") or runner.poll() is not None,
        what="the completion refused storage_full",
    )
    assert runner.poll() is None, "run_once gave up on a full disk"
    os.unlink(os.path.join(inside, "filler"))
    out, _ = runner.communicate(timeout=30)
    assert runner.returncode == 0
    with daemon.client() as client:
        record = client.idem_get("op", "k")
    assert record["state"] == "completed" and record["result"] == json.loads(out)
