"""The client's result types are true: every TowerdAPI method, called on a real
daemon, answers a map that its TypedDict in towerd.client.results accepts.

The TypedDicts are derived from the result Structs (client/stubgen.py), so this
checks the derivation (NotRequired exactly where the daemon may leave a field out,
the enumerations' values) against what the daemon really sends.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from typing import Any

import msgspec
import pytest

from towerd.client import Unavailable, results, stubgen
from towerd.protocol.methods import METHODS
from towerd_testing import plant_foreign_rows, start_declaring, wait_box_dead, wait_for

pytestmark = pytest.mark.both_backends

PR = "github.com/acme/app#pull/typed"
# A claimant that dies mid-effect: its effect is parked uncertain, for effect.resolve.
CLAIMANT = """
import signal, sys
from towerd.client import Client
with Client(sys.argv[1]) as client:
    client.effect_claim("run_dead", "notify", "a-1", "webhook", "https://hooks.example/x")
print("claimed", flush=True)
signal.pause()
"""


def park_an_uncertain_effect(daemon: Any) -> str:
    proc = subprocess.Popen(
        [sys.executable, "-c", CLAIMANT, str(daemon.socket_path)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "claimed"
    proc.kill()
    proc.wait(10)
    with daemon.client() as client:
        (effect,) = wait_for(
            lambda: [
                e for e in client.effect_list("run_dead")["effects"] if e["status"] == "uncertain"
            ],
            timeout=10,
            what="the dead claimant's effect to park",
        )
    return effect["effect_key"]


def checked_calls(client: Any) -> dict[str, list[Any]]:
    """Record every answer the client receives, by wire method."""
    answers: dict[str, list[Any]] = {}
    call = client.call

    def recording(method: str, params: Any = None) -> Any:
        answer = call(method, params)
        answers.setdefault(method, []).append(answer)
        return answer

    client.call = recording
    return answers


def exercise_every_method(client: Any, short_tmp: Any, uncertain: str, backend: str) -> None:
    """One call of each TowerdAPI method, in an order where each one succeeds."""
    first = client.session_register(cwd="/a", agent="claude", name="one")["session_id"]
    client.session_update(first, pinned=True)
    client.fleet_get(first)
    client.fleet_get(first, daemon_id=client.hello["daemon_id"])
    client.fleet_list(limit=1)
    (foreign,) = client.fleet_list(daemon_id="gone-daemon")["sessions"]
    assert foreign["daemon_id"] == "gone-daemon"
    boxes = client.boxes_list()["boxes"]
    assert {(box["daemon_id"], box["self"]) for box in boxes} == {
        (client.hello["daemon_id"], True),
        ("gone-daemon", False),
    }
    written = str(uuid.uuid4())
    client.fleet_write([{"session_id": written, "cwd": "/w", "agent": "x"}])
    client.fleet_import_legacy([{"agentSessionID": "legacy", "cwd": "/l", "agent": "x"}, "junk"])
    client.session_remove(written)
    client.fleet_adopt("gone-daemon")
    client.idem_claim("deploy", "k1", payload={"n": 1})
    client.idem_complete("deploy", "k1", {"ok": True})
    client.idem_claim("deploy", "k1", payload={"n": 1})  # replayed: the completed shape
    client.idem_claim("deploy", "k2")
    client.idem_release("deploy", "k2")
    client.idem_claim("deploy", "k3")
    client.idem_mark_unknown("deploy", "k3")
    client.idem_resolve("deploy", "k3", "completed", {"ok": 3})
    client.idem_reopen("deploy", "k3", {"ok": 3}, reason="typed test")
    client.idem_get("deploy", "k1")
    client.idem_list(limit=2)
    lease = client.lease_acquire("typed-lease", ttl_ms=60_000)
    client.lease_renew("typed-lease", lease["fencing_token"], ttl_ms=60_000)
    client.lease_get("typed-lease")
    client.lease_list()
    client.lease_release("typed-lease", lease["fencing_token"])
    effect = client.effect_claim("run_t", "open-pr", "a-1", "pr-create", PR, lease_ttl_ms=60_000)
    client.effect_heartbeat(effect["effect_key"], "a-1", lease_ttl_ms=60_000)
    client.effect_commit(effect["effect_key"], "a-1", {"pr": 7})
    for step, end in (("abort", client.effect_abort), ("fail", client.effect_fail)):
        other = client.effect_claim("run_t", step, "a-1", "webhook", f"https://x/{step}")
        end(other["effect_key"], "a-1", "typed test")
    client.doctor()  # while an effect waits for a decision: the report names it
    pushed = client.effect_claim(
        "run_t", "push", "a-1", "git-push", "refs/heads/typed", lease_ttl_ms=60_000,
        git={"repo": "/nonexistent/repo", "remote_url": "/nonexistent/remote.git",
             "commit": "0" * 40, "ref": "refs/heads/typed"},
    )  # fmt: skip
    settled = client.effect_settle(uncertain, pushed["effect_key"])["outcomes"]
    assert [o["verdict"] for o in settled] == ["not_probeable", "holder_alive"]
    client.effect_settle()
    client.effect_commit(pushed["effect_key"], "a-1", {"sha": "0" * 40})
    client.effect_resolve(uncertain, "aborted")
    client.effect_get(effect["effect_key"])
    client.effect_list("run_t")
    worker = client.worker_register("/srv/typed", version="test")["worker_id"]
    client.worker_heartbeat(worker)
    client.worker_list()
    units = {}
    for unit in ("start", "complete", "fail", "stuck", "pause", "cancel"):
        resource = f"worker-lease:{unit}"
        token = client.lease_acquire(resource, ttl_ms=600_000)["fencing_token"]
        claimed = client.dispatch_claim(
            worker, resource, token, "task", unit, "M1", f"trace-{unit}"
        )
        units[unit] = (claimed["dispatch_id"], token)
        client.dispatch_start(claimed["dispatch_id"], worker, token)
    ended = {
        "complete": lambda d, t: client.dispatch_complete(d, worker, t, "done"),
        "fail": lambda d, t: client.dispatch_fail(d, worker, t, "E1", "broke"),
        "stuck": lambda d, t: client.dispatch_stuck(d, worker, t, "loops"),
        "pause": lambda d, t: client.dispatch_pause(d, worker, t),
        "cancel": lambda d, t: client.dispatch_cancel(d, worker, t, "enough"),
    }
    for unit, end in ended.items():
        end(*units[unit])
    client.dispatch_get(units["start"][0])
    client.dispatch_list(limit=10)
    client.dispatch_recent(worker_id=worker)
    client.dispatch_stuck_report("/srv/typed")
    client.worker_stopping(worker)
    client.audit_list(limit=5)
    client.kv_set("global", "k", {"v": 1})
    client.kv_get("global", "k")
    client.kv_list("global")
    client.kv_delete("global", "k")
    client.event_record("Notification", session_id=first, payload={"message": "hi"})
    client.event_list(session_ids=[first])
    # The agent's loop: another session holds b.py (claimed by a person for it, before
    # this process is an agent: an agent acts for its own session only); then this
    # process as an agent session's, whose edit of b.py is denied.
    other = client.session_register(cwd="/srv/typed", agent="codex")["session_id"]
    client.path_claim(["/srv/typed/b.py"], session_id=other)
    started = client.hook_event(
        "SessionStart", "claude", agent_session_id="typed-agent", agent_pid=os.getpid(),
        cwd="/srv/typed", model="opus",
    )  # fmt: skip
    client.hook_event(
        "PreToolUse", "claude", agent_session_id="typed-agent", agent_pid=os.getpid(),
        cwd="/srv/typed", paths=["/srv/typed/a.py"], payload={"tool_name": "Edit"},
    )  # fmt: skip
    denied = client.hook_event(
        "PreToolUse", "claude", agent_session_id="typed-agent", agent_pid=os.getpid(),
        paths=["/srv/typed/b.py"], guard="deny",
    )  # fmt: skip
    assert denied["decision"] == "deny" and started["registered"] is True
    client.path_release(["/srv/typed"], session_id=started["session_id"])
    client.event_last_seen()
    client.session_activity([first])
    client.session_activity(daemon_id="gone-daemon")
    message = client.session_message(first, "ship it")
    client.message_list(first)
    client.message_ack(message["message_id"])
    client.fleet_restore_plan()
    client.fleet_restore_plan(daemon_id=client.hello["daemon_id"])
    if backend == "postgresql":
        # A file backup is SQLite's: on PostgreSQL it is refused, naming pg_dump (README
        # "Several boxes", "Not on PostgreSQL"). Its result shape is checked on [sqlite].
        with pytest.raises(Unavailable) as refused:
            client.backup(str(short_tmp / "typed.db"))
        assert refused.value.data == {"reason": "store_is_postgresql"}
        assert "pg_dump" in refused.value.message
    else:
        client.backup(str(short_tmp / "typed.db"))
    client.doctor()
    client.ping()
    client.status()
    client.shutdown()


def test_every_answer_matches_its_typed_dict(daemon, short_tmp):
    assert daemon.stop() == 0
    plant_foreign_rows(daemon.state_dir, "gone-daemon", store=daemon.store)
    start_declaring(daemon)
    wait_box_dead(daemon, "gone-daemon")  # PostgreSQL: only a dead box is adopted
    uncertain = park_an_uncertain_effect(daemon)
    with daemon.client() as client:
        answers = checked_calls(client)
        exercise_every_method(client, short_tmp, uncertain, daemon.backend)
    assert daemon.proc.wait(15) == 0

    expected = set(stubgen.api_methods().values())
    if daemon.backend == "postgresql":
        expected.discard("backup")  # refused there, above: no answer to check
    assert expected - set(answers) == set(), "a TowerdAPI method was not exercised"
    for method, seen in answers.items():
        shape = getattr(results, METHODS[method].result.__name__)
        for answer in seen:
            msgspec.convert(answer, shape, strict=True)  # raises naming the path on a mismatch
            assert set(answer) <= set(shape.__annotations__), (method, answer)
