"""daemon/store/pg_changes.py's listener: other boxes' notes reach this box's watchers.

``ChangeListener.start`` returns only once it listens: the daemon serves (and a watcher
can take its snapshot) after that, so a note committed by another box from then on is
heard, however soon. Before, it returned at once and LISTEN followed a few milliseconds
later: every note committed meanwhile was lost, silently (20 of 20 sent right after
``start`` on this machine; tests/integration/test_two_boxes.py's watch test failed once
in a few runs once writes got faster).
"""

from __future__ import annotations

import threading
from typing import Any

import psycopg
import pytest

from towerd.daemon.store import pg_changes

pytestmark = pytest.mark.no_backend_param


def test_a_note_committed_right_after_start_is_heard(pg_dsn: str) -> None:
    heard: list[list[tuple[str, Any]]] = []
    gaps: list[str] = []
    done = threading.Event()

    def publish(changes: list[tuple[str, Any]]) -> None:
        heard.append(changes)
        done.set()

    listener = pg_changes.ChangeListener(
        pg_dsn, "this-box", lambda fn, *args: fn(*args), publish, gaps.append
    )
    with psycopg.connect(pg_dsn, autocommit=True) as other:
        listener.start()
        try:
            (listening,) = other.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND query = %s AND state = 'idle'",
                (f"LISTEN {pg_changes.CHANNEL}",),
            ).fetchone()  # type: ignore[misc]
            assert listening == 1, "start() returned before its thread listened"
            for payload in pg_changes._payloads("other-box", [("fleet", {"n": 1})]):
                other.execute("SELECT pg_notify(%s, %s)", (pg_changes.CHANNEL, payload))
            assert done.wait(5), "the note committed right after start() was not heard"
        finally:
            listener.stop()
    assert heard == [[("fleet", {"n": 1})]]
    assert gaps == []


def test_a_listener_that_could_not_listen_before_serving_ends_the_watchers_once_it_does(
    pg_dsn: str,
) -> None:
    """Its first attempt fails (no such database here: start() returns, the daemon
    serves); once it listens, whatever was committed meanwhile is unknown: a gap."""
    gaps: list[str] = []
    gap = threading.Event()
    listener = pg_changes.ChangeListener(
        psycopg.conninfo.make_conninfo(pg_dsn, dbname="no_such_database"), "this-box",
        lambda fn, *args: fn(*args), lambda _: None,
        lambda why: (gaps.append(why), gap.set()),
    )  # fmt: skip
    listener.start()
    try:
        assert not gap.is_set()
        listener.dsn = pg_dsn  # the server answers again: the next attempt listens
        assert gap.wait(10), "no gap once the late listener listened"
    finally:
        listener.stop()
    assert gaps == ["the change listener started late"]
