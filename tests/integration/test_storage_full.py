"""A full disk: writes answer storage_full, nothing partial is stored, reads and the
daemon keep going, and writes succeed again once space is freed.

The daemon runs in its own mount namespace with its state dir on a small tmpfs
(``unshare -m`` + ``mount -t tmpfs``, as root); the test reaches that tmpfs
through ``/proc/<pid>/root`` to fill and free it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid

import pytest

from towerd.client import StorageFull
from towerd_testing import fill_filesystem

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("nsenter") is None,
    reason="needs root, unshare(1) and nsenter(1) to mount a size-capped tmpfs",
)


def test_storage_full_refuses_writes_and_recovers(make_daemon, short_tmp):
    daemon = make_daemon()
    mountpoint = short_tmp / "smallfs"
    mountpoint.mkdir(mode=0o700)
    daemon.state_dir = mountpoint / "state"
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"the kernel refuses mount namespaces here: {probe.stderr.decode().strip()}")
    command = daemon.command()
    daemon.proc = subprocess.Popen(
        [
            "unshare",
            "-m",
            "sh",
            "-c",
            'mount -t tmpfs -o size=4m,mode=0700 tmpfs "$0" && exec "$@"',
            str(mountpoint),
            *command,
        ],
        env=daemon.env(),
        stdout=open(daemon.log_path, "ab"),
        stderr=subprocess.STDOUT,
    )
    proc = daemon.proc
    daemon.notify.wait_for("READY=1", timeout=20, alive=lambda: proc.poll() is None)
    inside = f"/proc/{daemon.pid}/root{mountpoint}"

    with daemon.client() as client:
        kept = client.session_register(cwd="/r", agent="claude", name="before")["session_id"]
        filler = fill_filesystem(inside)
        refused_id = None
        for _ in range(200):
            attempt = str(uuid.uuid4())
            try:
                client.session_register(
                    cwd="/r", agent="claude", session_id=attempt, prompt="x" * 65536
                )
            except StorageFull:
                refused_id = attempt
                break
        assert refused_id is not None, "the disk never filled up"

        # Reads keep working, the refused row is not there, not even partly.
        assert client.ping()["pong"]
        assert client.fleet_get(kept)["name"] == "before"
        assert refused_id not in {row["session_id"] for row in client.iter_fleet()}

        os.unlink(filler)
        # SQLite resolves /proc/<pid>/root; check from inside the daemon's mount namespace.
        check = subprocess.run(
            [
                "nsenter",
                "--target",
                str(daemon.pid),
                "--mount",
                sys.executable,
                "-c",
                "import sqlite3, sys; print(sqlite3.connect(sys.argv[1])"
                ".execute('PRAGMA quick_check').fetchone()[0])",
                f"{mountpoint}/state/towerd.db",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert check.stdout.strip() == "ok", check.stderr
        written = client.session_register(cwd="/r", agent="claude", session_id=refused_id)
        assert written["session_id"] == refused_id
        assert client.fleet_get(refused_id)["prompt"] is None
    assert daemon.proc.poll() is None
    assert daemon.stop() == 0
