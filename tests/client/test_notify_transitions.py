"""``towerctl notify``'s transition tracking alone (client/notify.py ``Tracker``): snapshots
and pushes shaped as ``watch`` sends them in, notices out. The real daemon and the real
command run in tests/integration/test_notify.py."""

from __future__ import annotations

import itertools

import pytest

from towerd.client.notify import Tracker
from towerd.client.systemd_units import unit_word
from towerd.protocol.fields import attention

SEQ = itertools.count(1)
EVENT_IDS = itertools.count(1)


def row(sid: str, aid: str | None = None, name: str | None = None, exited: bool = False):
    return {"session_id": sid, "agent_session_id": aid, "name": name, "cwd": f"/src/{sid}",
            "agent": "claude", "exited": exited, "live": None}  # fmt: skip


def snapshot(*sessions, events=(), truncated=False):
    """``sessions``: (row, attention, last_kind, last_activity_at)."""
    return {
        "fleet": {
            "sessions": [s[0] for s in sessions],
            "activity": [
                {
                    "session_id": s[0]["session_id"],
                    "attention": s[1],
                    "last_kind": s[2],
                    "last_activity_at": s[3],
                    "live": None,
                }
                for s in sessions
            ],  # fmt: skip
            "truncated": truncated,
        },
        "events": {"events": list(events)},
    }


def event(kind, sid=None, aid=None, at=1000, payload=None, event_id=None):
    return {"event_id": next(EVENT_IDS) if event_id is None else event_id, "session_id": sid,
            "agent_session_id": aid, "kind": kind, "at": at, "payload": payload}  # fmt: skip


def push(topic, data):
    return {"event": topic, "seq": next(SEQ), "data": data}


def ev(kind, sid=None, aid=None, at=1000, message=None):
    payload = {"message": message} if message is not None else None
    return push("events", event(kind, sid, aid, at, payload))


def upsert(session):
    return push("fleet", {"op": "upsert", "session": session})


def ids(notices):
    return [n.session_id for n in notices]


def test_the_attention_rule_is_declared_once():
    """notify applies events to the attention rule itself: the daemon's, from one place."""
    from towerd.client import notify
    from towerd.daemon.store import events as daemon_events
    from towerd.protocol import fields

    assert notify.attention is fields.attention is daemon_events.attention
    for exited, kind in itertools.product((False, True), [None, "Notification", "Stop"]):
        assert attention(exited, kind) in fields.ATTENTIONS


def test_the_first_snapshot_is_a_baseline():
    tracker = Tracker()
    notices = tracker.baseline(
        snapshot((row("a"), "needs_you", "Notification", 5), (row("b"), "running", "Start", 5))
    )
    assert notices == [] and tracker.needing_you() == 1
    # a already needs you: another Notification is no move.
    assert tracker.apply(ev("Notification", "a", message="again")) == []
    # b moves in: once.
    (notice,) = tracker.apply(ev("Notification", "b", message="Claude needs your permission"))
    assert notice.session_id == "b" and notice.attention == "needs_you"
    assert notice.message == "Claude needs your permission"
    assert notice.event is not None and notice.event["kind"] == "Notification"
    # a moves on and comes back: once more.
    assert tracker.apply(ev("UserPromptSubmit", "a")) == []
    assert ids(tracker.apply(ev("Notification", "a"))) == ["a"]


@pytest.mark.parametrize("leaving", ["UserPromptSubmit", "PostToolUse", "PreToolUse", "Stop",
                                     "SessionStart"])  # fmt: skip
def test_any_event_that_changes_attention_rearms(leaving):
    tracker = Tracker()
    tracker.baseline(snapshot((row("a"), "running", None, None)))
    assert ids(tracker.apply(ev("Notification", "a", at=1))) == ["a"]
    assert tracker.apply(ev("Notification", "a", at=2)) == []
    assert tracker.apply(ev("heartbeat", "a", at=3)) == []  # activity, not attention
    assert tracker.apply(ev("Notification", "a", at=4)) == []
    assert tracker.apply(ev(leaving, "a", at=5)) == []
    assert tracker.sessions["a"].attention != "needs_you"
    assert ids(tracker.apply(ev("Notification", "a", at=6))) == ["a"]
    assert tracker.sessions["a"].last_activity_at == 6


def test_a_heartbeat_never_rearms():
    tracker = Tracker()
    tracker.baseline(snapshot((row("a"), "running", None, None)))
    assert ids(tracker.apply(ev("Notification", "a"))) == ["a"]
    for _ in range(3):
        assert tracker.apply(ev("heartbeat", "a")) == []
        assert tracker.apply(ev("Notification", "a")) == []


def test_events_under_the_agent_session_id_count_for_its_rows():
    """§14: a session's newest event is the newest filed under its id or its agent's."""
    tracker = Tracker()
    tracker.baseline(
        snapshot(
            (row("a", aid="as-1"), "running", None, None),
            (row("b", aid="as-1"), "running", None, None),
            (row("c", aid="as-2"), "running", None, None),
        )  # fmt: skip
    )
    assert sorted(ids(tracker.apply(ev("Notification", None, "as-1")))) == ["a", "b"]
    assert tracker.apply(ev("Notification", "c", "as-2")) != []
    assert tracker.apply(ev("Stop", "a", "as-1")) == []
    assert tracker.sessions["b"].attention == "done"  # b shares a's agent session


def test_an_exited_row_never_needs_you():
    tracker = Tracker()
    tracker.baseline(snapshot((row("a", exited=True), "exited", "SessionEnd", 1)))
    assert tracker.apply(ev("Notification", "a")) == []
    # Un-exited (a resume) with a Notification as its newest event: it needs you now.
    assert ids(tracker.apply(upsert(row("a", exited=False)))) == ["a"]
    assert ids(tracker.apply(upsert(row("a", exited=True)))) == []
    assert tracker.sessions["a"].attention == "exited"


def test_a_new_row_is_a_baseline_too_and_its_agents_events_count():
    tracker = Tracker()
    tracker.baseline(snapshot())
    assert tracker.apply(upsert(row("a", aid="as-a"))) == []
    assert ids(tracker.apply(ev("Notification", "a", "as-a"))) == ["a"]
    # A hook reported before its session was registered: the row needs you at once,
    # which is the state it came with, not a move.
    assert tracker.apply(ev("Notification", None, "as-b", message="early")) == []
    assert tracker.apply(upsert(row("b", aid="as-b"))) == []
    assert tracker.sessions["b"].attention == "needs_you"
    assert tracker.apply(ev("Notification", "b", "as-b")) == []
    assert tracker.apply(ev("UserPromptSubmit", "b", "as-b")) == []
    assert ids(tracker.apply(ev("Notification", "b", "as-b"))) == ["b"]


def test_a_row_relinked_to_another_agent_session_takes_its_state_without_a_notice():
    tracker = Tracker()
    tracker.baseline(snapshot((row("a", aid="as-1"), "running", "PreToolUse", 1)))
    assert tracker.apply(ev("Notification", None, "as-2")) == []  # no row of as-2 yet
    assert tracker.apply(upsert(row("a", aid="as-2"))) == []
    assert tracker.sessions["a"].attention == "needs_you"
    assert tracker.apply(ev("Notification", "a", "as-2")) == []
    assert tracker.apply(ev("PostToolUse", "a", "as-2")) == []
    # Relinked back: as-1's newest event is older than a's own newest: a keeps its state.
    assert tracker.apply(upsert(row("a", aid="as-1"))) == []
    assert tracker.sessions["a"].attention == "running"
    assert ids(tracker.apply(ev("Notification", "a", "as-1"))) == ["a"]


def test_an_upsert_updates_the_fields_a_notice_carries():
    tracker = Tracker()
    tracker.baseline(snapshot((row("a", name="old"), "running", None, None)))
    assert tracker.apply(upsert(row("a", name="main"))) == []
    (notice,) = tracker.apply(ev("Notification", "a"))
    assert notice.row["name"] == "main" and notice.label == "main"


def test_remove_forgets_and_adopt_asks_for_a_fresh_snapshot():
    tracker = Tracker()
    tracker.baseline(snapshot((row("a"), "running", None, None)))
    assert tracker.apply(push("fleet", {"op": "remove", "session_id": "a"})) == []
    assert "a" not in tracker.sessions
    assert tracker.apply(push("fleet", {"op": "adopt", "daemon_id": "d2", "sessions": 3})) == []
    assert tracker.resync
    tracker.baseline(snapshot((row("x"), "needs_you", "Notification", 9)))
    assert not tracker.resync and list(tracker.sessions) == ["x"]


def test_a_session_past_the_snapshots_cut_is_notified_with_its_ids():
    tracker = Tracker()
    tracker.baseline(snapshot((row("a"), "running", None, None), truncated=True))
    (notice,) = tracker.apply(ev("Notification", "z", "as-z", message="hi"))
    assert notice.partial and notice.row == {"session_id": "z", "agent_session_id": "as-z"}
    assert notice.label == "z"
    assert tracker.apply(upsert(row("z", aid="as-z", name="zed"))) == []
    assert not tracker.sessions["z"].partial
    assert tracker.apply(ev("Notification", "z", "as-z")) == []  # still needs you


def test_a_reconnect_snapshot_is_a_new_baseline():
    """After a gap: nothing notified is notified again, nothing that needed you before is
    notified; a session seen elsewhere before, needing you now with newer activity, moved
    during the gap and is notified once."""
    tracker = Tracker()
    tracker.baseline(
        snapshot(
            (row("old"), "needs_you", "Notification", 10),
            (row("told"), "running", None, 10),
            (row("quiet"), "running", "PreToolUse", 10),
            (row("moved"), "running", "PreToolUse", 10),
            (row("stale"), "done", "Stop", 10),
        )  # fmt: skip
    )
    assert ids(tracker.apply(ev("Notification", "told", at=20))) == ["told"]
    asked = event("Notification", "moved", at=30, payload={"message": "may I?"})
    notices = tracker.baseline(
        snapshot(
            (row("old"), "needs_you", "Notification", 10),
            (row("told"), "needs_you", "Notification", 20),
            (row("quiet"), "running", "PreToolUse", 10),
            (row("moved"), "needs_you", "Notification", 30),
            # the daemon says needs_you but nothing happened since: an old state
            (row("stale"), "needs_you", "Notification", 10),
            (row("new"), "needs_you", "Notification", 40),
            events=[event("Notification", "new", at=40), asked],
        )  # fmt: skip
    )
    assert ids(notices) == ["moved"]
    (notice,) = notices
    assert notice.message == "may I?" and notice.event == asked
    # A second reconnect with nothing new: nothing at all.
    assert tracker.baseline(snapshot(*[
        (row(sid), s.attention, s.last_kind, s.last_activity_at)
        for sid, s in tracker.sessions.items()
    ])) == []  # fmt: skip
    # And the armed ones work as before.
    assert tracker.apply(ev("Notification", "quiet", at=50)) != []
    assert tracker.apply(ev("Notification", "moved", at=50)) == []


def test_a_truncated_reconnect_snapshot_keeps_the_rows_past_its_cut():
    tracker = Tracker()
    tracker.baseline(snapshot((row("a"), "running", None, 1), (row("b"), "running", None, 1)))
    tracker.baseline(snapshot((row("a"), "running", None, 1), truncated=True))
    assert ids(tracker.apply(ev("Notification", "b"))) == ["b"]


def test_a_notice_as_stdin_and_environment():
    tracker = Tracker()
    tracker.baseline(snapshot((row("s-1", aid="as-1", name=None), "running", "Start", 3)))
    (notice,) = tracker.apply(ev("Notification", "s-1", "as-1", at=7, message="a\0b"))
    fields = notice.fields()
    assert fields["session_id"] == "s-1" and fields["cwd"] == "/src/s-1"
    assert fields["attention"] == "needs_you" and fields["last_kind"] == "Notification"
    assert fields["last_activity_at"] == 7 and fields["message"] == "a\0b"
    assert fields["event"]["payload"] == {"message": "a\0b"}
    assert notice.environment() == {
        "TOWERD_SESSION_ID": "s-1",
        "TOWERD_SESSION_NAME": "",
        "TOWERD_AGENT": "claude",
        "TOWERD_CWD": "/src/s-1",
        "TOWERD_AGENT_SESSION_ID": "as-1",
        "TOWERD_ATTENTION": "needs_you",
        "TOWERD_MESSAGE": "ab",  # an environment cannot hold NUL
    }


def test_garbage_pushes_change_nothing():
    tracker = Tracker()
    tracker.baseline(snapshot((row("a"), "running", None, None)))
    for junk in ({}, {"event": "events"}, {"event": "events", "data": 3},
                 {"event": "events", "data": {"kind": 5}}, {"event": "fleet", "data": {}},
                 {"event": "fleet", "data": {"op": "upsert", "session": "x"}},
                 {"event": "idem", "data": {"op": "key"}}):  # fmt: skip
        assert tracker.apply(junk) == []
    assert list(tracker.sessions) == ["a"] and tracker.sessions["a"].attention == "running"


@pytest.mark.parametrize(
    ("word", "written"),
    [
        ("/home/me/.venv/bin/towerctl", "/home/me/.venv/bin/towerctl"),
        ("--desktop", "--desktop"),
        ("", '""'),
        ("a b", '"a b"'),
        ('cat >> "$HOME/x" 100%', '"cat >> \\"$$HOME/x\\" 100%%"'),
        ("%h/$USER", '"%%h/$$USER"'),
        ("it's a\\b\nc\td\x01", '"it\'s a\\\\b\\nc\\td\\x01"'),
    ],
)
def test_unit_words_are_written_for_systemd_to_read_back(word, written):
    assert unit_word(word) == written
