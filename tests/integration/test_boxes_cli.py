"""``towerctl boxes`` and the fleet commands' ``--daemon`` against a real daemon.

The daemon runs on the embedded store: one box (itself), plus the row of an earlier
daemon id planted in its file (``plant_foreign_rows``), whose presence is set back two
hours (nothing heartbeats on the embedded store), so it is listed as lapsed."""

from __future__ import annotations

import json
import re
import sqlite3
import time
from contextlib import closing

from towerd.daemon.store import DB_FILE
from towerd_testing import plant_foreign_rows, towerctl

GONE = "gone-daemon"
HOURS_AGO = 2


def ok(daemon, *args: str) -> str:
    r = towerctl(daemon, *args)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr)
    assert r.stderr == ""
    return r.stdout


def with_a_gone_box(daemon) -> list[str]:
    """Plant rows of GONE in the stopped daemon's file, its last presence HOURS_AGO
    (by the wall clock, as towerctl shows ages), then start the daemon again."""
    assert daemon.stop() == 0
    planted = plant_foreign_rows(daemon.state_dir, GONE, count=2)
    long_ago = int(time.time() * 1000) - HOURS_AGO * 3_600_000
    with closing(sqlite3.connect(daemon.state_dir / DB_FILE, isolation_level=None)) as conn:
        conn.execute("UPDATE daemons SET presence_at = ? WHERE daemon_id = ?", (long_ago, GONE))
    daemon.start()
    return planted


def test_boxes_json_lists_this_daemon_present_and_self(daemon):
    status = json.loads(ok(daemon, "--json", "status"))
    result = json.loads(ok(daemon, "--json", "boxes"))
    assert set(result) == {"boxes"}  # not truncated
    (box,) = result["boxes"]
    assert set(box) == {
        "daemon_id", "owner_epoch", "host", "pid", "started_at", "presence_at", "dead_at",
        "state", "self",
    }  # fmt: skip
    assert (box["daemon_id"], box["owner_epoch"], box["pid"]) == (
        status["daemon_id"], status["owner_epoch"], status["pid"]
    )  # fmt: skip
    assert (box["state"], box["self"], box["dead_at"]) == ("present", True, None)
    assert isinstance(box["host"], str) and box["host"]
    # Options after the command, as for every command.
    assert json.loads(ok(daemon, "boxes", "--json")) == result


def test_boxes_text_is_a_table_marking_this_daemon(daemon):
    with_a_gone_box(daemon)
    own = json.loads(ok(daemon, "--json", "status"))["daemon_id"]
    boxes = {b["daemon_id"]: b for b in json.loads(ok(daemon, "--json", "boxes"))["boxes"]}
    assert set(boxes) == {own, GONE}
    assert (boxes[GONE]["state"], boxes[GONE]["self"]) == ("lapsed", False)
    assert (boxes[own]["state"], boxes[own]["self"]) == ("present", True)

    header, *lines = ok(daemon, "boxes").splitlines()
    assert header.split() == ["BOX", "HOST", "EPOCH", "STATE", "LAST", "PRESENCE", "STARTED"]
    assert header.startswith("  BOX")
    assert len(lines) == 2
    by_box = {line.split()[1] if line.startswith("*") else line.split()[0]: line for line in lines}
    mine, gone = by_box[own], by_box[GONE]
    assert mine.startswith(f"* {own}  ") and gone.startswith(f"  {GONE}  ")
    assert boxes[own]["host"] in mine and f" {boxes[own]['owner_epoch']} " in mine
    assert " present " in mine and " lapsed " in gone
    # Last presence as an age, then when it started (UTC).
    started = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\dZ$"
    assert re.search(rf" lapsed +{HOURS_AGO}h ago +{started}", gone), gone
    assert re.search(rf" present +(\d+[smhd] ago|-) +{started}", mine), mine
    # started_at order: the planted box started before this daemon's latest start.
    assert [line.startswith("*") for line in lines] == [False, True]


def test_fleet_commands_take_a_box(daemon):
    """``--daemon ID`` shows that box's rows; without it the embedded store shows this
    daemon's own (here none but the one registered)."""
    planted = with_a_gone_box(daemon)
    own = json.loads(ok(daemon, "--json", "status"))["daemon_id"]
    mine = json.loads(ok(daemon, "--json", "session", "register", "--cwd", "/m", "--agent", "a"))

    def ids(*args: str) -> list[str]:
        return [row["session_id"] for row in json.loads(ok(daemon, "--json", *args))["sessions"]]

    assert ids("fleet", "list") == [mine["session_id"]]
    assert ids("fleet", "list", "--daemon", GONE) == planted
    assert ids("fleet", "list", "--daemon", GONE, "--limit", "1") == planted[:1]
    assert ids("fleet", "list", "--daemon", own) == [mine["session_id"]]
    assert sorted(ids("fleet", "restore-plan", "--daemon", GONE)) == sorted(planted)
    assert ids("fleet", "restore-plan") == [mine["session_id"]]

    row = json.loads(ok(daemon, "--json", "fleet", "get", planted[0], "--daemon", GONE))
    assert (row["session_id"], row["daemon_id"]) == (planted[0], GONE)
    r = towerctl(daemon, "--json", "fleet", "get", planted[0])  # not this daemon's row
    assert r.returncode == 1 and json.loads(r.stdout)["error"]["code"] == "not_found"

    # One box's rows in the text table: no BOX column.
    text = ok(daemon, "fleet", "list", "--daemon", GONE)
    assert text.splitlines()[0].split()[0] == "SESSION"
    assert all(session in text for session in planted)
