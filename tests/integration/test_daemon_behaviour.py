"""Daemon-wide behaviour: configuration by environment, periodic expiry, request logs,
and a fault inside a handler."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from towerd.client import Client, IdempotencyKeyUnknown, Internal
from towerd_testing import TOWERCTL, store_execute, wait_for

pytestmark = pytest.mark.both_backends


def test_environment_configures_daemon_and_clients(make_daemon, short_tmp):
    """TOWERD_SOCKET and TOWERD_STATE_DIR replace --socket/--state-dir for towerd, the
    Python client and towerctl alike; the missing socket directory is created."""
    daemon = make_daemon()
    socket_path = short_tmp / "from-env" / "t.sock"
    state_dir = short_tmp / "state-from-env"
    env = daemon.env(TOWERD_SOCKET=str(socket_path), TOWERD_STATE_DIR=str(state_dir))
    daemon.extra_args = []
    daemon.proc = subprocess.Popen(
        [str(daemon.command()[0]), "--log-format", "json"],
        env=env,
        stdout=open(daemon.log_path, "ab"),
        stderr=subprocess.STDOUT,
    )
    proc = daemon.proc
    daemon.notify.wait_for("READY=1", timeout=20, alive=lambda: proc.poll() is None)
    assert (state_dir / "towerd.db").exists()
    ping = subprocess.run([TOWERCTL, "ping"], env=env, capture_output=True, text=True, timeout=30)
    assert (ping.returncode, ping.stdout.strip()) == (0, "pong")
    os.environ["TOWERD_SOCKET"] = str(socket_path)
    try:
        with Client() as client:
            assert client.status()["db_path"] == str(state_dir / "towerd.db")
    finally:
        del os.environ["TOWERD_SOCKET"]
    assert daemon.stop() == 0


def test_completed_keys_expire_periodically_and_unknown_ones_never(make_daemon):
    """With a short TTL, a completed key disappears while the daemon runs; an
    outcome_unknown key of the same age stays."""
    daemon = make_daemon()
    daemon.extra_args = ["--completed-ttl", "0.2", "--expiry-interval", "0.2"]
    daemon.start()
    with daemon.client() as client:
        client.idem_claim("op", "unknown")
        client.idem_mark_unknown("op", "unknown")
        client.idem_claim("op", "done")
        client.idem_complete("op", "done", "ok")

        def expired() -> bool:
            try:
                client.idem_get("op", "done")
            except IdempotencyKeyUnknown:
                return True
            return False

        wait_for(expired, timeout=10, what="the completed key to expire")
        assert client.idem_get("op", "unknown")["state"] == "outcome_unknown"
    assert daemon.stop() == 0


def log_lines(daemon) -> list[dict]:
    return [json.loads(line) for line in daemon.log().splitlines() if line.startswith("{")]


def test_each_request_is_logged_with_its_context(daemon):
    """JSON log lines (stderr is not a terminal) carry method, principal, duration and
    the error code of each request."""
    with daemon.client(principal="agent-9") as client:
        client.ping()
        with pytest.raises(IdempotencyKeyUnknown):
            client.idem_get("op", "missing")
    lines = wait_for(
        lambda: [
            line
            for line in log_lines(daemon)
            if line.get("event") == "request" and line.get("method") == "idem.get"
        ],
        timeout=10,
        what="the request log line",
    )
    line = lines[-1]
    assert line["principal"] == f"uid:{os.geteuid()}:agent-9"
    assert line["code"] == "idempotency_key_unknown"
    assert isinstance(line["duration_ms"], float)
    assert line["level"] == "debug" and "timestamp" in line


def test_a_fault_inside_a_handler_is_internal_logged_and_survived(daemon):
    """A stored result that no longer decodes (a damaged row) makes idem.get fail inside
    the handler: the caller gets `internal`, the log has the traceback, other requests
    and other connections keep being served."""
    with daemon.client() as client:
        client.idem_claim("op", "damaged")
        client.idem_complete("op", "damaged", {"fine": True})
    store_execute(daemon, "UPDATE idempotency SET result = ? WHERE key = 'damaged'", (b"\xc1",))
    with daemon.client() as client:
        with pytest.raises(Internal) as failure:
            client.idem_get("op", "damaged")
        assert "idem.get" in failure.value.message
        assert client.ping()["pong"]
    crashed = wait_for(
        lambda: [line for line in log_lines(daemon) if line.get("event") == "request_crashed"],
        timeout=10,
        what="the crash log line",
    )
    assert crashed[-1]["code"] == "internal" and crashed[-1]["method"] == "idem.get"
    assert "exception" in crashed[-1]  # structured traceback
    with daemon.client() as other:
        assert other.ping()["pong"]


@pytest.mark.parametrize("codec", ["lite", "msgspec", "auto"])
def test_blocking_client_codecs_speak_the_same_wire(daemon, codec):
    """The stdlib codec (hooks) and msgspec's (services) give identical results."""
    with daemon.client(codec=codec) as client:
        session = client.session_register(cwd="/r", agent="a", name="ünïcödé", prompt="x" * 70000)
        row = client.fleet_get(session["session_id"])
        assert row["name"] == "ünïcödé" and len(row["prompt"]) == 70000
        client.idem_claim("op", f"k-{codec}", payload={"b": [1, 2.5, None, True, b"\x00"]})
        done = client.idem_complete("op", f"k-{codec}", {"bytes": b"\xff" * 300, "n": -(2**40)})
        assert done["result"] == {"bytes": b"\xff" * 300, "n": -(2**40)}


def test_daemon_serves_on_the_plain_asyncio_loop_too(make_daemon):
    """uvloop is optional (the `fast` extra): without it the same daemon serves the same
    protocol on asyncio's own loop."""
    daemon = make_daemon()
    daemon.start(env=daemon.env(TOWERD_NO_UVLOOP="1"))
    with daemon.client() as client:
        session = client.session_register(cwd="/r", agent="a")["session_id"]
        assert client.fleet_get(session)["session_id"] == session
        assert client.call_many([("ping", None)] * 20)[-1]["pong"] is True
    assert daemon.stop() == 0


def test_a_hang_up_stops_the_daemon_cleanly_and_says_why(daemon):
    """SIGHUP (the terminal a daemon was started from in the background closed) killed
    it without a line in its log, and every hook then failed open unseen: it now stops
    as for SIGTERM, exit 0, and its log says why and how to keep it running."""
    import signal

    with daemon.client() as client:
        assert client.idem_claim("deploy", "before-hup")["state"] == "claimed"
    daemon.proc.send_signal(signal.SIGHUP)
    assert daemon.proc.wait(15) == 0
    assert "SIGHUP (the terminal that started towerd closed?" in daemon.log()


def test_a_daemon_started_ignoring_hang_ups_keeps_ignoring_them(make_daemon):
    """`nohup towerd &` kept the daemon through a closed terminal before it handled
    SIGHUP; a hang-up it was started ignoring stays ignored (a review's finding)."""
    import signal

    daemon = make_daemon()
    daemon.prefix = ["nohup"]
    daemon.start()
    daemon.proc.send_signal(signal.SIGHUP)  # nohup's own process is the daemon (exec)
    with daemon.client() as client:
        assert client.idem_claim("deploy", "after-hup")["state"] == "claimed"
    assert daemon.proc.poll() is None
    assert "SIGHUP" not in daemon.log()
