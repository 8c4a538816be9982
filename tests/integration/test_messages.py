"""Session messages through a real daemon: idempotent sends, forward-only acks, and
keys that survive a SIGKILL of the daemon.

A message id is minted by the daemon, so a client's own ``idem.claim`` under
operation ``session.message`` can only name a message that already exists; the
reconciliation tests claim such a key (effect_ref = that message id, payload =
the send's params) and leave it in progress across a kill -9 of the daemon or of
the claimant. The crash-point tests kill the daemon inside ``session.message``
itself (TOWERD_CRASH_AT), before and after its commit.
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Callable, Iterator

import pytest

from towerd.client import (
    BadArgs,
    Client,
    Conflict,
    IdempotencyConflict,
    NotFound,
    OutcomeUnknown,
    Unavailable,
)
from towerd_testing import Daemon, start_crashing_at, wait_for

pytestmark = pytest.mark.both_backends

NO_SESSION = "00000000-0000-4000-8000-000000000000"


def register(client: Client, **fields: object) -> str:
    return client.session_register(cwd="/src/app", agent="claude", **fields)["session_id"]


def messages(client: Client, session_id: str, **kwargs: object) -> list[dict]:
    return client.message_list(session_id, **kwargs)["messages"]


def died_by_sigkill(daemon: Daemon) -> bool:
    assert daemon.proc is not None
    return daemon.proc.wait(20) == -signal.SIGKILL


@pytest.fixture
def sleeper() -> Iterator[Callable[[], subprocess.Popen[bytes]]]:
    """Start a live ``sleep`` child (a claimant to kill); all are reaped at teardown."""
    started: list[subprocess.Popen[bytes]] = []

    def start() -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(["sleep", "300"])
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.kill()
        proc.wait()


def test_session_message_is_idempotent_under_a_key(daemon: Daemon) -> None:
    """A retry under the key answers the same message id and stores one message, with
    its current status; other text under the key is idempotency_conflict; the key is
    completed under operation session.message with effect_ref = the message id; another
    principal's same key is its own message; no key: each send is a new message."""
    with daemon.client() as client:
        session = register(client, agent_session_id="as-1")
        sent = client.session_message(session, "ship it", idempotency_key="k1")
        assert sent["status"] == "queued"
        assert client.session_message(session, "ship it", idempotency_key="k1") == sent
        with pytest.raises(IdempotencyConflict) as conflict:
            client.session_message(session, "ship it now", idempotency_key="k1")
        assert conflict.value.data == {
            "operation": "session.message",
            "key": "k1",
            "state": "completed",
        }
        key = client.idem_get("session.message", "k1")
        assert (key["state"], key["effect_ref"], key["result"]) == (
            "completed",
            sent["message_id"],
            {"message_id": sent["message_id"], "status": "queued"},
        )
        client.message_ack(sent["message_id"], "delivered")
        again = client.session_message(session, "ship it", idempotency_key="k1")
        assert again == {"message_id": sent["message_id"], "status": "delivered"}

        with daemon.client(principal="other") as other:
            theirs = other.session_message(session, "ship it", idempotency_key="k1")
        assert theirs["message_id"] != sent["message_id"]
        plain = [client.session_message(session, "no key")["message_id"] for _ in range(2)]
        assert len(set(plain)) == 2
        stored = messages(client, session)
        assert [m["message_id"] for m in stored] == [
            sent["message_id"],
            theirs["message_id"],
            *plain,
        ]
        assert stored[0] == {
            "message_id": sent["message_id"],
            "session_id": session,
            "agent_session_id": "as-1",
            "text": "ship it",
            "status": "delivered",
            "created_at": stored[0]["created_at"],
            "updated_at": stored[0]["updated_at"],
        }
        assert stored[0]["updated_at"] >= stored[0]["created_at"]


def test_message_refusals(daemon: Daemon) -> None:
    """An unknown session is not_found (with or without a key, and no key is kept);
    empty text and an unknown status are bad_args."""
    with daemon.client() as client:
        session = register(client)
        for key in (None, "k-missing"):
            with pytest.raises(NotFound) as missing:
                client.session_message(NO_SESSION, "hello", idempotency_key=key)
            assert missing.value.data == {"session_id": NO_SESSION}
        assert client.idem_list(operation="session.message")["keys"] == []
        with pytest.raises(BadArgs):
            client.session_message(session, "")
        with pytest.raises(BadArgs):
            client.message_ack("m-1", "queued")
        with pytest.raises(BadArgs):
            client.message_list(session, status="lost")
        assert messages(client, session) == []


def test_message_list_and_ack_through_the_client(daemon: Daemon) -> None:
    """Acks move a message forward only (queued -> delivered -> read; the same status
    again answers the record unchanged; backwards is conflict naming the status);
    message.list is oldest first, filtered by status, cut by limit; an unknown
    message is not_found and an unknown session lists nothing."""
    with daemon.client() as client:
        session = register(client)
        other = register(client)
        ids = [client.session_message(session, f"m{n}")["message_id"] for n in range(3)]
        client.session_message(other, "elsewhere")
        delivered = client.message_ack(ids[0], "delivered")
        assert (delivered["message_id"], delivered["status"]) == (ids[0], "delivered")
        assert client.message_ack(ids[0], "delivered") == delivered
        read = client.message_ack(ids[0], "read")
        assert read["status"] == "read" and read["updated_at"] >= delivered["updated_at"]
        assert client.message_ack(ids[0]) == read  # the client's default status is read
        with pytest.raises(Conflict) as backwards:
            client.message_ack(ids[0], "delivered")
        assert backwards.value.data == {"message_id": ids[0], "status": "read"}
        client.message_ack(ids[2], "delivered")

        assert [m["message_id"] for m in messages(client, session)] == ids
        assert [m["text"] for m in messages(client, session)] == ["m0", "m1", "m2"]
        assert [m["message_id"] for m in messages(client, session, limit=2)] == ids[:2]
        assert [m["message_id"] for m in messages(client, session, status="queued")] == [ids[1]]
        assert [m["message_id"] for m in messages(client, session, status="delivered")] == [ids[2]]
        assert [m["message_id"] for m in messages(client, session, status="read")] == [ids[0]]
        assert messages(client, NO_SESSION) == []
        with pytest.raises(NotFound) as unknown:
            client.message_ack("no-such-message", "read")
        assert unknown.value.data == {"message_id": "no-such-message"}


def test_a_crash_before_the_commit_loses_the_message_and_the_key(make_daemon) -> None:
    """SIGKILL with session.message's batch run but not committed: no message and no
    key survive, and the retry under the key sends it once."""
    daemon = make_daemon().start()
    with daemon.client() as client:
        session = register(client)
    assert daemon.stop() == 0
    start_crashing_at(daemon, "batch.before_commit")
    with daemon.client() as client, pytest.raises(Unavailable):
        client.session_message(session, "hello", idempotency_key="lost")
    assert died_by_sigkill(daemon)
    daemon.start()
    with daemon.client() as client:
        assert messages(client, session) == []
        assert client.idem_list(operation="session.message")["keys"] == []
        sent = client.session_message(session, "hello", idempotency_key="lost")
        assert [m["message_id"] for m in messages(client, session)] == [sent["message_id"]]
    assert daemon.stop() == 0


def test_a_crash_after_the_commit_is_answered_by_the_retry(make_daemon) -> None:
    """SIGKILL after session.message committed but before its reply: the retry under the
    same key answers the committed message id, and there is one message."""
    daemon = make_daemon().start()
    with daemon.client() as client:
        session = register(client)
    assert daemon.stop() == 0
    start_crashing_at(daemon, "batch.after_commit")
    with daemon.client() as client, pytest.raises(Unavailable):
        client.session_message(session, "hello", idempotency_key="lost-reply")
    assert died_by_sigkill(daemon)
    daemon.start()
    with daemon.client() as client:
        (stored,) = messages(client, session)
        retried = client.session_message(session, "hello", idempotency_key="lost-reply")
        assert retried == {"message_id": stored["message_id"], "status": "queued"}
        assert [m["message_id"] for m in messages(client, session)] == [stored["message_id"]]
        assert client.idem_get("session.message", "lost-reply")["state"] == "completed"
    assert daemon.stop() == 0


def test_reconciliation_after_kill9_completes_a_message_key_from_its_message(
    make_daemon,
) -> None:
    """Keys claimed under session.message and in progress when the daemon is SIGKILLed:
    at the next start the one whose effect_ref is a stored message completes with
    {message_id, status} (so a session.message retry under it answers that message),
    the one naming no message stays outcome_unknown and a retry under it is refused."""
    daemon = make_daemon().start()
    with daemon.client() as client:
        session = register(client)
        sent = client.session_message(session, "deploy done")
        client.message_ack(sent["message_id"], "delivered")
        payload = {"session_id": session, "text": "deploy done"}  # session.message's params
        client.idem_claim(
            "session.message", "k-evidence", payload=payload, effect_ref=sent["message_id"]
        )
        client.idem_claim("session.message", "k-none", payload=payload, effect_ref="never-sent")
    daemon.kill9()
    daemon.start()
    with daemon.client() as client:
        report = client.status()["reconciliation"]
        assert (
            report["marked_unknown"],
            report["completed_from_evidence"],
            report["still_unknown"],
        ) == (2, 1, 1)
        done = client.idem_get("session.message", "k-evidence")
        assert (done["state"], done["result"]) == (
            "completed",
            {"message_id": sent["message_id"], "status": "delivered"},
        )
        retried = client.session_message(session, "deploy done", idempotency_key="k-evidence")
        assert retried == {"message_id": sent["message_id"], "status": "delivered"}
        assert client.idem_get("session.message", "k-none")["state"] == "outcome_unknown"
        with pytest.raises(OutcomeUnknown) as refused:
            client.session_message(session, "deploy done", idempotency_key="k-none")
        assert refused.value.data["effect_ref"] == "never-sent"
        assert [m["message_id"] for m in messages(client, session)] == [sent["message_id"]]
    assert daemon.stop() == 0


def test_a_killed_claimants_message_key_completes_while_the_daemon_runs(
    daemon: Daemon, sleeper: Callable[[], subprocess.Popen[bytes]]
) -> None:
    """The claimant (a process named by holder_pid) is SIGKILLed: the liveness sweep
    settles its session.message key from the message row, without a restart."""
    claimant = sleeper()
    with daemon.client() as client:
        session = register(client)
        sent = client.session_message(session, "hello")
        client.idem_claim(
            "session.message",
            "k-dead",
            payload={"session_id": session, "text": "hello"},
            effect_ref=sent["message_id"],
            holder_pid=claimant.pid,
        )
        claimant.kill()
        claimant.wait()
        done = wait_for(
            lambda: (
                (key := client.idem_get("session.message", "k-dead"))["state"] == "completed"
                and key
            ),
            timeout=10,
            what="the dead claimant's key to settle",
        )
        assert done["result"] == {"message_id": sent["message_id"], "status": "queued"}
        again = client.session_message(session, "hello", idempotency_key="k-dead")
        assert again == {"message_id": sent["message_id"], "status": "queued"}
        assert len(messages(client, session)) == 1
