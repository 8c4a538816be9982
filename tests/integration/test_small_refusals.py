"""Small holes a hostile or careless client found, each closed with a typed refusal:
unbounded id lists in event.list, a holder_pid that would pin a key for good, and a
path lease on a name that is not a real path."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from towerd.client import BadArgs
from towerd.protocol.methods import MAX_SCOPE_IDS
from towerd_testing import TOWERCTL, wait_for

pytestmark = pytest.mark.both_backends


def test_event_list_with_260000_ids_is_bad_args_and_duplicates_are_folded(daemon):
    """260,000 ids used to reach SQLite as 260,000 variables (internal error); past the
    documented maximum it is bad_args, and duplicates within it cost one variable."""
    with daemon.client() as client:
        client.session_register(cwd="/r", agent="claude", agent_session_id="a")
        client.event_record("Stop", agent_session_id="a")
        with pytest.raises(BadArgs) as refused:
            client.event_list(agent_session_ids=["a"] * 260_000)
        assert str(MAX_SCOPE_IDS) in refused.value.message
        page = client.event_list(agent_session_ids=["a"] * MAX_SCOPE_IDS)
        assert [event["kind"] for event in page["events"]] == ["Stop"]
        with pytest.raises(BadArgs):
            client.session_activity(session_ids=[client.status()["daemon_id"]] * 1001)
        assert client.ping()["pong"]


def test_a_path_claim_that_is_not_a_real_path_is_bad_args_and_leases_nothing(daemon):
    """``/w/src/`` or ``/w/src/../src`` through the Python client (towerctl claim
    resolves paths first) used to be granted as a lease that covered nothing: another
    session's edit below it was allowed. Now refused, and nothing is leased."""
    with daemon.client() as client:
        session = client.session_register(cwd="/w", agent="claude")["session_id"]
        for path in ("/w/src/", "/w/src/../src", "/w//src"):
            with pytest.raises(BadArgs) as refused:
                client.path_claim([path], session_id=session)
            assert "not a real path" in refused.value.message
        assert client.lease_list()["leases"] == []
        claimed = client.path_claim(["/w/src"], session_id=session)
        assert [lease["path"] for lease in claimed["leases"]] == ["/w/src"]
        assert client.ping()["pong"]


def _orphan() -> int:
    """A process of ours that is no relative of this one (its parent shell exited)."""
    started = subprocess.run(
        ["sh", "-c", "sleep 60 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True
    )
    return int(started.stdout)


def test_holder_pid_must_be_a_relative(daemon):
    """pid 1 and an unrelated process are refused (bad_args naming the pid); the caller's
    own child is accepted."""
    orphan = _orphan()
    child = subprocess.Popen(["sleep", "60"])
    try:
        with daemon.client() as client:
            for pid in (1, orphan):
                with pytest.raises(BadArgs) as refused:
                    client.idem_claim("op", f"pinned-{pid}", holder_pid=pid)
                assert f"holder_pid {pid}" in refused.value.message
            assert client.idem_claim("op", "mine", holder_pid=child.pid)["state"] == "claimed"
    finally:
        os.kill(orphan, 9)
        child.kill()
        child.wait()


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root")
def test_holder_pid_of_another_user_is_refused(daemon):
    """A child of ours running as another uid (setpriv) could never be checked or reaped
    as ours: refused."""
    other = subprocess.Popen(
        ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "sleep", "60"]
    )
    try:
        wait_for(lambda: os.stat(f"/proc/{other.pid}").st_uid != 0, what="the uid switch")
        with daemon.client() as client, pytest.raises(BadArgs):
            client.idem_claim("op", "theirs", holder_pid=other.pid)
    finally:
        other.kill()
        other.wait()


def test_a_shell_may_name_itself_or_its_background_job(daemon):
    """The documented shell forms: `--holder-pid $$` (towerctl's parent) and `$!` (a
    job of that shell, towerctl's sibling)."""
    towerctl = f'"{TOWERCTL}" --socket "{daemon.socket_path}"'
    script = (
        f"{towerctl} idem claim op shell --holder-pid $$ || exit 1\n"
        "sleep 30 & job=$!\n"
        f"{towerctl} idem claim op job --holder-pid $job; status=$?\n"
        "kill $job; exit $status\n"
    )
    run = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=30)
    assert run.returncode == 0, run.stderr
    with daemon.client() as client:
        for key in ("shell", "job"):
            assert client.idem_get("op", key)["state"] in ("in_progress", "outcome_unknown")
