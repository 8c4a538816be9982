"""kill -9 of the daemon: every acknowledged write survives, every interrupted key is reconciled.

These are the guarantees towerd exists for, proven on a real daemon process
killed with SIGKILL and restarted on the same state dir.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from towerd.client import OutcomeUnknown
from towerd_testing import wait_for

pytestmark = pytest.mark.both_backends


def test_kill9_reconciles_keys_from_evidence(daemon):
    """After kill -9 with keys in progress: one with a fleet row as evidence completes
    (result rebuilt from the row, with its session id), one without stays
    outcome_unknown and is never run again; epoch +1, daemon id kept, rows kept."""
    with daemon.client(principal="agent-1") as client:
        before = client.status()
        kept = client.session_register(cwd="/repo", agent="claude", name="kept")["session_id"]
        spawned = client.idem_claim("session.spawn", "spawn-with-row")
        client.session_register(
            cwd="/repo",
            agent="claude",
            session_id=spawned["effect_ref"],
            agent_session_id="agent-session-7",
            target="tmux:1",
        )
        client.idem_claim("session.spawn", "spawn-without-row")
        client.idem_claim("git.push", "push-no-probe")
        assert client.idem_get("session.spawn", "spawn-with-row")["state"] == "in_progress"

    daemon.kill9()
    daemon.start()

    with daemon.client(principal="agent-1") as client:
        status = client.status()
        assert status["daemon_id"] == before["daemon_id"]
        assert status["owner_epoch"] == before["owner_epoch"] + 1
        report = status["reconciliation"]
        assert report["marked_unknown"] == 3
        assert report["completed_from_evidence"] == 1
        assert report["still_unknown"] == 2
        assert report["rows_taken"] == 2

        settled = client.idem_get("session.spawn", "spawn-with-row")
        assert settled["state"] == "completed"
        assert settled["result"]["session_id"] == spawned["effect_ref"]
        assert settled["result"]["agent_session_id"] == "agent-session-7"
        replay = client.idem_claim("session.spawn", "spawn-with-row")
        assert replay["state"] == "completed"
        assert replay["result"]["session_id"] == spawned["effect_ref"]

        for operation, key in (
            ("session.spawn", "spawn-without-row"),
            ("git.push", "push-no-probe"),
        ):
            assert client.idem_get(operation, key)["state"] == "outcome_unknown"
            with pytest.raises(OutcomeUnknown) as refused:
                client.idem_claim(operation, key)
            assert refused.value.data["effect_ref"]

        rows = {row["session_id"]: row for row in client.iter_fleet()}
        assert kept in rows and spawned["effect_ref"] in rows
        assert all(row["owner_epoch"] == status["owner_epoch"] for row in rows.values())
        assert client.idem_list(state="in_progress")["keys"] == []


def test_complete_after_restart_is_accepted(daemon):
    """A claimant whose daemon restarted mid-effect still records its outcome: complete is
    accepted from outcome_unknown, and retries then replay it."""
    with daemon.client() as client:
        claim = client.idem_claim("deploy", "release-42", payload={"tag": "v42"})
    daemon.kill9()
    daemon.start()
    with daemon.client() as client:
        assert client.idem_get("deploy", "release-42")["state"] == "outcome_unknown"
        client.idem_complete("deploy", "release-42", {"url": "https://example/42"})
        replay = client.idem_claim("deploy", "release-42", payload={"tag": "v42"})
    assert replay == {
        "state": "completed",
        "effect_ref": claim["effect_ref"],
        "result": {"url": "https://example/42"},
    }


LOAD_CLIENT = textwrap.dedent(
    """
    import sys
    from towerd.client import Client, TowerdError
    socket_path, acked_path, writer = sys.argv[1], sys.argv[2], sys.argv[3]
    with open(acked_path, "a", buffering=1) as acked, Client(socket_path) as client:
        for n in range(100000):
            try:
                session_id = client.session_register(
                    cwd="/load", agent="load", idempotency_key=f"load-{writer}-{n}")["session_id"]
            except TowerdError:
                break
            acked.write(f"load-{writer}-{n} {session_id}\\n")
    """
)


def test_no_acknowledged_write_is_lost_under_kill9(daemon, short_tmp: Path):
    """Writers keep registering sessions; the daemon is killed mid-stream. Every
    registration a client saw acknowledged exists after restart, exactly once."""
    acked_paths = [short_tmp / f"acked-{n}.txt" for n in range(4)]
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", LOAD_CLIENT, str(daemon.socket_path), str(path), str(n)]
        )
        for n, path in enumerate(acked_paths)
    ]

    def acked_lines() -> list[str]:
        return [
            line for path in acked_paths if path.exists() for line in path.read_text().splitlines()
        ]

    wait_for(lambda: len(acked_lines()) >= 400, timeout=30, what="400 acknowledged writes")
    daemon.kill9()
    for writer in writers:
        writer.wait(30)
    acknowledged = dict(line.split() for line in acked_lines() if line.count(" ") == 1)
    assert len(acknowledged) >= 400

    daemon.start()
    with daemon.client() as client:
        rows = list(client.iter_fleet())
        stored = {row["session_id"] for row in rows}
        missing = set(acknowledged.values()) - stored
        assert not missing, f"{len(missing)} acknowledged registrations lost"
        assert len(stored) == len(rows), "a session id appears twice"
        # A retry of every acknowledged key answers the same session id, no new row.
        for key, session_id in list(acknowledged.items())[:50]:
            again = client.session_register(cwd="/load", agent="load", idempotency_key=key)
            assert again["session_id"] == session_id
        assert len(list(client.iter_fleet())) == len(rows)
