"""Answers without a cursor are cut to fit a frame and say so, never ``internal``.

The fuzzer found fleet.restore_plan answering ``internal`` once a fleet of large rows
outgrew the frame; every list answer with no cursor is bounded the same way.
"""

from __future__ import annotations

import os

import pytest

from towerd.client import Client

pytestmark = pytest.mark.both_backends

SMALL_FRAME = 64 * 1024
BIG = "x" * 3000  # each row about 3 KB: 40 of them overflow a 64 KiB frame


@pytest.fixture
def small_daemon(make_daemon):
    return make_daemon().start("--max-frame", str(SMALL_FRAME))


def test_lists_without_cursors_are_cut_to_fit_and_flag_it(small_daemon):
    with small_daemon.client() as c:
        sessions = [
            c.session_register(cwd="/w", agent="claude", name=f"{n}-{BIG}")["session_id"]
            for n in range(40)
        ]
        for session_id in sessions:
            c.session_message(sessions[0], BIG)
            c.event_record("Stop", session_id=session_id)
        plan = c.fleet_restore_plan()
        assert plan["truncated"] is True and 0 < len(plan["sessions"]) < 40
        messages = c.message_list(sessions[0], limit=500)
        assert messages["truncated"] is True and 0 < len(messages["messages"]) < 40
        worker = c.worker_register("/w")["worker_id"]
        token = c.lease_acquire("m")["fencing_token"]
        claimed = []
        for n in range(40):
            claim = c.dispatch_claim(worker, "m", token, "task", f"T{n}", "M", "t")
            claimed.append(claim["dispatch_id"])
            c.dispatch_fail(claim["dispatch_id"], worker, token, "E", BIG)
        listed = c.dispatch_list(limit=500)
        assert listed["truncated"] is True
        ids = [d["dispatch_id"] for d in listed["dispatches"]]
        assert ids == claimed[-len(ids) :]  # the most recent kept, oldest first
        activity = c.session_activity()
        assert "truncated" not in activity and len(activity["sessions"]) == 40
        assert c.ping()["pong"] is True


def test_a_watch_snapshot_of_a_big_fleet_fits_a_frame(small_daemon):
    with small_daemon.client() as c:
        for n in range(40):
            c.session_register(cwd="/w", agent="claude", name=f"{n}-{BIG}")
    with Client(small_daemon.socket_path) as watcher:
        first = next(watcher.watch(["fleet", "events"]))
        fleet = first["snapshot"]["fleet"]
        assert fleet["truncated"] is True and 0 < len(fleet["sessions"]) < 40
        assert {a["session_id"] for a in fleet["activity"]} == {
            s["session_id"] for s in fleet["sessions"]
        }


def test_unbounded_answers_still_fit_at_the_default_frame(daemon):
    """At the default 1 MiB frame the same lists are whole."""
    with daemon.client() as c:
        for n in range(40):
            c.session_register(cwd="/w", agent="claude", name=f"{n}-{BIG}")
        plan = c.fleet_restore_plan()
        assert "truncated" not in plan and len(plan["sessions"]) == 40
        assert os.path.exists(daemon.socket_path)
