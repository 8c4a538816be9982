"""``towerctl kv``, ``workers``, ``dispatch`` and ``audit``: the real CLI against a real
daemon, over state made through the Python client (the test process is a worker; a
second worker is a real process that exits and is reaped as crashed)."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import pytest

from towerd_testing import Daemon, towerctl, wait_for

pytestmark = pytest.mark.both_backends

KV_MAX = 64 * 1024  # the daemon's default --kv-max-value
DASH = "\u2014"


def ok_json(daemon, *args: str, **kwargs):
    r = towerctl(daemon, "--json", *args, **kwargs)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr)
    assert r.stderr == ""
    return json.loads(r.stdout)


def ok_text(daemon, *args: str, **kwargs) -> str:
    r = towerctl(daemon, *args, **kwargs)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr)
    assert r.stderr == ""
    return r.stdout


def json_error(daemon, *args: str, code: str, **kwargs) -> dict:
    """Exit 1, and the error alone as JSON on stdout."""
    r = towerctl(daemon, "--json", *args, **kwargs)
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    document = json.loads(r.stdout)
    assert set(document) == {"error"} and document["error"]["code"] == code, document
    return document["error"]


def text_error(daemon, *args: str, code: str) -> str:
    r = towerctl(daemon, *args)
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    assert r.stdout == "" and r.stderr.startswith(f"towerctl: {code}: "), r.stderr
    return r.stderr


def usage_error(daemon, *args: str) -> str:
    r = towerctl(daemon, *args)
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert r.stdout == ""
    return r.stderr


def table(text: str) -> tuple[list[str], list[list[str]]]:
    """A text table's header and rows (cells are separated by two or more spaces)."""
    lines = text.rstrip("\n").split("\n")
    header, *rows = (re.split(r" {2,}", line) for line in lines)
    return header, rows


def when(millis: int | None) -> str:
    """How the CLI shows a millisecond timestamp."""
    return (
        "-" if millis is None else time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(millis / 1000))
    )


def pairs(text: str) -> dict[str, str]:
    return dict(line.split(": ", 1) for line in text.splitlines() if ": " in line)


# --- kv --------------------------------------------------------------------------------


def test_kv_round_trip_text_and_json(daemon):
    """set/get/list/delete in both modes; scope ids are separate namespaces; the Python
    client sees what the CLI wrote."""
    text = ok_text(daemon, "kv", "set", "global", "greeting", '"hello"')
    shown = pairs(text)
    assert (shown["scope"], shown["key"], shown["value"]) == ("global", "greeting", '"hello"')
    assert ok_text(daemon, "kv", "get", "global", "greeting") == '"hello"\n'

    value = {"n": 1, "tags": ["a", "b"], "nested": {"ok": True, "none": None}}
    entry = ok_json(daemon, "kv", "set", "worker", "cfg", json.dumps(value), "--scope-id", "w1")
    assert set(entry) == {"scope", "scope_id", "key", "value", "updated_at"}
    assert (entry["scope"], entry["scope_id"], entry["key"], entry["value"]) == (
        "worker", "w1", "cfg", value,
    )  # fmt: skip
    assert ok_json(daemon, "kv", "get", "worker", "cfg", "--scope-id", "w1") == entry
    assert ok_text(daemon, "kv", "get", "worker", "cfg", "--scope-id", "w1") == (
        json.dumps(value, sort_keys=True) + "\n"
    )
    with daemon.client() as client:
        assert client.kv_get("worker", "cfg", scope_id="w1")["value"] == value
        client.kv_set("worker", "aaa", [1, 2, 3], scope_id="w1")
        client.kv_set("worker", "other", 7, scope_id="w2")

    # Another scope id, or another scope, is another namespace.
    error = json_error(daemon, "kv", "get", "worker", "cfg", code="not_found")
    assert error["data"] == {"scope": "worker", "scope_id": "", "key": "cfg"}
    text_error(daemon, "kv", "get", "milestone", "cfg", "--scope-id", "w1", code="not_found")

    listed = ok_json(daemon, "kv", "list", "worker", "--scope-id", "w1")
    expected = [("aaa", [1, 2, 3]), ("cfg", value)]
    assert [(e["key"], e["value"]) for e in listed["entries"]] == expected
    header, rows = table(ok_text(daemon, "kv", "list", "worker", "--scope-id", "w1"))
    assert header == ["KEY", "UPDATED", "VALUE"]
    assert rows == [
        ["aaa", when(listed["entries"][0]["updated_at"]), "[1, 2, 3]"],
        ["cfg", when(entry["updated_at"]), json.dumps(value, sort_keys=True)[:57] + "..."],
    ]
    assert table(ok_text(daemon, "kv", "list", "milestone"))[1] == []

    # set replaces; delete says whether there was a value.
    ok_text(daemon, "kv", "set", "worker", "cfg", "2", "--scope-id", "w1")
    assert ok_text(daemon, "kv", "get", "worker", "cfg", "--scope-id", "w1") == "2\n"
    assert ok_text(daemon, "kv", "delete", "worker", "cfg", "--scope-id", "w1") == "deleted: yes\n"
    assert ok_json(daemon, "kv", "delete", "worker", "cfg", "--scope-id", "w1") == {
        "deleted": False
    }
    json_error(daemon, "kv", "get", "worker", "cfg", "--scope-id", "w1", code="not_found")
    assert ok_json(daemon, "kv", "get", "worker", "other", "--scope-id", "w2")["value"] == 7


def test_kv_set_invalid_json_is_a_usage_error(daemon):
    """A VALUE_JSON that is not JSON exits 2 (with or without --json) and stores nothing."""
    stderr = usage_error(daemon, "kv", "set", "global", "k", "{oops")
    assert stderr.startswith("towerctl: VALUE_JSON is not valid JSON: "), stderr
    r = towerctl(daemon, "--json", "kv", "set", "global", "k", "{oops")
    assert r.returncode == 2 and r.stderr == "", r
    error = json.loads(r.stdout)["error"]
    assert error["code"] == "usage"
    assert error["message"].startswith("VALUE_JSON is not valid JSON: "), error
    assert "invalid choice: 'local'" in usage_error(daemon, "kv", "set", "local", "k", "1")
    with daemon.client() as client:
        assert client.kv_list("global")["entries"] == []


def test_kv_value_over_the_limit_is_bad_args(daemon):
    """A value of exactly --kv-max-value bytes (as msgpack) is stored; one byte more is
    refused bad_args (exit 1) and leaves the old value."""
    # A msgpack str of n < 65536 bytes has a 3-byte header.
    fits = json.dumps("x" * (KV_MAX - 3))
    assert ok_json(daemon, "kv", "set", "global", "big", fits)["value"] == "x" * (KV_MAX - 3)
    too_big = json.dumps("y" * (KV_MAX - 2))
    error = json_error(daemon, "kv", "set", "global", "big", too_big, code="bad_args")
    assert error["data"] == {"bytes": KV_MAX + 1, "max_bytes": KV_MAX}
    text_error(daemon, "kv", "set", "global", "big", too_big, code="bad_args")
    with daemon.client() as client:
        assert client.kv_get("global", "big")["value"] == "x" * (KV_MAX - 3)


def test_listings_follow_every_page(make_daemon):
    """With pages of ~2 KiB, `kv list` still prints every entry and `audit --limit N`
    gathers N events across pages, handing on the cursor for --before."""
    daemon = make_daemon().start("--max-frame", "4096")
    with daemon.client() as client:
        for n in range(30):
            client.kv_set("milestone", f"k{n:02}", "v" * 100, scope_id="m1")
        for n in range(15):
            lease = client.lease_acquire(f"res-{n}")
            client.lease_release(f"res-{n}", lease["fencing_token"])
        first_page = client.kv_list("milestone", scope_id="m1")
        assert first_page["next_after"] is not None  # more than one page
        events = []
        page = client.audit_list(limit=500)
        while True:
            events += page["events"]
            if page["next_before"] is None:
                break
            page = client.audit_list(limit=500, before=page["next_before"])
    assert len(first_page["entries"]) < 30 and len(events) == 30

    listed = ok_json(daemon, "kv", "list", "milestone", "--scope-id", "m1")
    assert [e["key"] for e in listed["entries"]] == [f"k{n:02}" for n in range(30)]
    _, rows = table(ok_text(daemon, "kv", "list", "milestone", "--scope-id", "m1"))
    assert [row[0] for row in rows] == [f"k{n:02}" for n in range(30)]
    assert {row[2] for row in rows} == {'"' + "v" * 56 + "..."}

    assert ok_json(daemon, "audit", "--limit", "600") == {"events": events, "next_before": None}
    newest = ok_json(daemon, "audit", "--limit", "20")
    assert newest == {"events": events[:20], "next_before": events[19]["seq"]}
    text = ok_text(daemon, "audit", "--limit", "20")
    assert text.endswith(f"\nmore: --before {events[19]['seq']}\n")
    rest = ok_json(daemon, "audit", "--before", str(events[19]["seq"]))
    assert rest == {"events": events[20:], "next_before": None}


# --- workers, dispatches, audit --------------------------------------------------------

WORKER_B = """
import sys
from towerd.client import Client

with Client(sys.argv[1]) as client:
    worker = client.worker_register(sys.argv[2])["worker_id"]
    token = client.lease_acquire("repo:other")["fencing_token"]
    claim = client.dispatch_claim(worker, "repo:other", token, "task", "X1", "M9", "tr-x1")
    print(worker, claim["dispatch_id"], flush=True)
"""


@pytest.fixture(scope="module")
def ledger():
    """One daemon holding a small history, read by the tests below (they only read).

    Worker B (project q) is a child process that claims task/X1 and exits: the daemon
    reaps it as crashed and cancels its dispatch. Then worker A (this test process,
    project p) fails task/T1 twice and task/T2 once with the same error, cancels task/T3
    and leaves task/T4 claimed."""
    root = Path(tempfile.mkdtemp(prefix="td-", dir="/tmp"))
    daemon = Daemon(root, "ledger")
    try:
        # A TTL well past the module's run: worker A must not be reaped between tests.
        daemon.start("--holder-check-interval", "0.2", "--worker-ttl", "3600")
        (root / "p").mkdir()
        (root / "q").mkdir()
        project_a, project_b = os.path.realpath(root / "p"), os.path.realpath(root / "q")
        child = subprocess.run(
            [sys.executable, "-c", WORKER_B, str(daemon.socket_path), project_b],
            capture_output=True, text=True, timeout=30, check=True,
        )  # fmt: skip
        worker_b, dispatch_b = child.stdout.split()
        with daemon.client() as client:
            wait_for(
                lambda: client.worker_list(status="crashed")["workers"],
                timeout=10,
                what="worker B to be reaped",
            )
            worker_a = client.worker_register(project_a)["worker_id"]
            token = client.lease_acquire("repo:main")["fencing_token"]

            def claim(unit_id: str, trace_id: str, milestone: str = "M1") -> int:
                return client.dispatch_claim(
                    worker_a, "repo:main", token, "task", unit_id, milestone, trace_id
                )["dispatch_id"]

            d1 = claim("T1", "tr-d1")
            client.dispatch_start(d1, worker_a, token)
            client.dispatch_fail(d1, worker_a, token, "E_TEST", "tests failed\n  badly")
            d2 = claim("T1", "tr-d2")
            client.dispatch_fail(d2, worker_a, token, "E_TEST", "again", retry_after_ms=600_000)
            d3 = claim("T2", "tr-d3")
            client.dispatch_fail(d3, worker_a, token, "E_TEST", "still red")
            d4 = claim("T3", "tr-d4")
            client.dispatch_cancel(d4, worker_a, token, "superseded by plan B")
            d5 = claim("T4", "tr-d5", milestone="M2")
            yield types.SimpleNamespace(
                daemon=daemon, project_a=project_a, project_b=project_b,
                worker_a=worker_a, worker_b=worker_b,
                ids=[int(dispatch_b), d1, d2, d3, d4, d5],
                workers={w["worker_id"]: w for w in client.worker_list()["workers"]},
                dispatches=client.dispatch_list()["dispatches"],
                events=client.audit_list(limit=500)["events"],
            )  # fmt: skip
        assert daemon.stop() == 0, daemon.log()
    finally:
        daemon.close()
        shutil.rmtree(root, ignore_errors=True)


def test_workers_table_shows_live_and_reaped_workers(ledger):
    daemon, a, b = ledger.daemon, ledger.workers[ledger.worker_a], ledger.workers[ledger.worker_b]
    assert (a["status"], a["pid"], a["project_root"]) == ("active", os.getpid(), ledger.project_a)
    assert (b["status"], b["end_reason"], b["project_root"]) == (
        "crashed", "process-gone", ledger.project_b,
    )  # fmt: skip
    host = socket.gethostname()
    row_a = [a["worker_id"], "active", str(os.getpid()), host, ledger.project_a,
             when(a["heartbeat_at"]), "-"]  # fmt: skip
    row_b = [b["worker_id"], "crashed", str(b["pid"]), host, ledger.project_b,
             when(b["heartbeat_at"]), "process-gone"]  # fmt: skip

    header, rows = table(ok_text(daemon, "workers"))
    assert header == ["WORKER", "STATUS", "PID", "HOST", "PROJECT", "HEARTBEAT", "ENDED_REASON"]
    assert sorted(rows) == sorted([row_a, row_b])
    assert table(ok_text(daemon, "workers", "--status", "crashed"))[1] == [row_b]
    assert table(ok_text(daemon, "workers", "--status", "stopping"))[1] == []
    # A relative --project-root is taken from the current directory.
    parent = os.path.dirname(ledger.project_a)
    assert table(ok_text(daemon, "workers", "--project-root", "p", cwd=parent))[1] == [row_a]
    assert ok_json(daemon, "workers", "--project-root", ledger.project_b) == {"workers": [b]}
    assert sorted(ok_json(daemon, "workers")["workers"], key=lambda w: w["worker_id"]) == sorted(
        ledger.workers.values(), key=lambda w: w["worker_id"]
    )


def test_dispatch_list_rows_and_filters(ledger):
    daemon, a, b = ledger.daemon, ledger.worker_a, ledger.worker_b
    db, d1, d2, d3, d4, d5 = ledger.ids
    claimed = {row["dispatch_id"]: when(row["claimed_at"]) for row in ledger.dispatches}
    expected = {
        db: [str(db), "task/X1", "canceled", "1/3", b, claimed[db], "worker-crashed"],
        d1: [str(d1), "task/T1", "failed", "1/3", a, claimed[d1], "E_TEST: tests failed badly"],
        d2: [str(d2), "task/T1", "failed", "2/3", a, claimed[d2], "E_TEST: again"],
        d3: [str(d3), "task/T2", "failed", "1/3", a, claimed[d3], "E_TEST: still red"],
        d4: [str(d4), "task/T3", "canceled", "1/3", a, claimed[d4], "superseded by plan B"],
        d5: [str(d5), "task/T4", "claimed", "1/3", a, claimed[d5], "-"],
    }

    header, rows = table(ok_text(daemon, "dispatch", "list"))
    assert header == ["ID", "UNIT", "STATUS", "ATTEMPT", "WORKER", "CLAIMED", "EXIT_REASON/ERROR"]
    assert rows == [expected[i] for i in ledger.ids]  # oldest first
    assert ok_json(daemon, "dispatch", "list") == {"dispatches": ledger.dispatches}

    for filters, ids in [
        (["--status", "failed"], [d1, d2, d3]),
        (["--status", "canceled"], [db, d4]),
        (["--unit-type", "task", "--unit-id", "T1"], [d1, d2]),
        (["--unit-type", "story"], []),
        (["--milestone", "M2"], [d5]),
        (["--worker", b], [db]),
        (["--worker", a, "--status", "failed", "--unit-id", "T2"], [d3]),
        (["--limit", "2"], [d4, d5]),  # the most recent two, oldest first
    ]:
        assert table(ok_text(daemon, "dispatch", "list", *filters))[1] == [
            expected[i] for i in ids
        ], filters
        listed = ok_json(daemon, "dispatch", "list", *filters)["dispatches"]
        assert [row["dispatch_id"] for row in listed] == ids, filters


def test_dispatch_get(ledger):
    daemon, d2 = ledger.daemon, ledger.ids[2]
    row = next(r for r in ledger.dispatches if r["dispatch_id"] == d2)
    assert ok_json(daemon, "dispatch", "get", str(d2)) == row
    assert (row["status"], row["attempt_n"], row["error_code"]) == ("failed", 2, "E_TEST")
    assert row["next_run_at"] == row["ended_at"] + 600_000
    shown = pairs(ok_text(daemon, "dispatch", "get", str(d2)))
    assert shown["dispatch_id"] == str(d2) and shown["unit_key"] == "task/T1"
    assert (shown["status"], shown["attempt_n"], shown["max_attempts"]) == ("failed", "2", "3")
    assert (shown["error_code"], shown["error_summary"]) == ("E_TEST", "again")
    assert shown["next_run_at"] == when(row["next_run_at"])
    assert (shown["started_at"], shown["exit_reason"]) == ("-", "-")

    missing = max(ledger.ids) + 1000
    error = json_error(daemon, "dispatch", "get", str(missing), code="not_found")
    assert error["data"] == {"dispatch_id": missing}
    assert text_error(daemon, "dispatch", "get", str(missing), code="not_found") == (
        f"towerctl: not_found: no dispatch {missing}\n"
    )
    json_error(daemon, "dispatch", "get", "0", code="bad_args")
    assert "invalid int value: 'x'" in usage_error(daemon, "dispatch", "get", "x")


def test_audit_lists_events_newest_first_with_filters(ledger):
    daemon, events = ledger.daemon, ledger.events
    assert ok_json(daemon, "audit", "--limit", "500") == {"events": events, "next_before": None}
    header, rows = table(ok_text(daemon, "audit", "--limit", "500"))
    assert header == ["SEQ", "TS", "CATEGORY", "TYPE", "ACTOR", "TRACE"]
    assert rows == [
        [str(e["seq"]), when(e["ts"]), e["category"], e["type"], e["actor"], e["trace_id"]]
        for e in events
    ]
    assert [int(row[0]) for row in rows] == sorted((e["seq"] for e in events), reverse=True)

    # One dispatch's story, by its trace id; the actor is the worker's process.
    d1 = ok_json(daemon, "audit", "--trace-id", "tr-d1")["events"]
    assert [e["type"] for e in d1] == ["dispatch-failed", "dispatch-running", "dispatch-claimed"]
    assert all(e["actor"].endswith(f" pid {os.getpid()}") for e in d1), d1
    _, rows = table(ok_text(daemon, "audit", "--trace-id", "tr-d1"))
    assert [row[3] for row in rows] == [e["type"] for e in d1]

    # Worker B's crash: the reap is the daemon's, and it caused the release and cancel.
    workers = ok_json(daemon, "audit", "--category", "worker")["events"]
    assert [(e["type"], e["trace_id"]) for e in workers] == [
        ("worker-registered", ledger.worker_a),
        ("worker-crashed", ledger.worker_b),
        ("worker-registered", ledger.worker_b),
    ]
    crash = workers[1]
    assert crash["actor"] == "daemon"
    _, rows = table(ok_text(daemon, "audit", "--type", "worker-crashed"))
    assert rows == [[str(crash["seq"]), when(crash["ts"]), "worker", "worker-crashed", "daemon",
                     ledger.worker_b]]  # fmt: skip
    canceled = ok_json(daemon, "audit", "--type", "dispatch-canceled", "--trace-id", "tr-x1")
    assert [e["caused_by"] for e in canceled["events"]] == [crash["event_id"]]
    released = ok_json(daemon, "audit", "--category", "lease", "--type", "lease-released")
    assert [(e["trace_id"], e["caused_by"]) for e in released["events"]] == [
        ("repo:other", crash["event_id"])
    ]
    assert ok_json(daemon, "audit", "--type", "dispatch-stuck")["events"] == []
    assert "invalid choice: 'kv'" in usage_error(daemon, "audit", "--category", "kv")


# --- stuck -----------------------------------------------------------------------------


def test_dispatch_stuck_reports_verdicts_and_suppressed_ones(daemon, short_tmp):
    """Exit 0 whether stuck or not; `stuck` says which in --json. A same-error verdict on
    a unit with a retry scheduled is suppressed; the same error on another unit is not."""
    project = short_tmp / "proj"
    project.mkdir()
    (short_tmp / "other").mkdir()
    stuck = ("dispatch", "stuck")
    assert ok_text(daemon, *stuck, cwd=project) == "not stuck\nwindow: 0 recent dispatches\n"

    with daemon.client() as client:
        worker = client.worker_register(str(project))["worker_id"]
        token = client.lease_acquire("repo:main")["fencing_token"]

        def failed(unit_id: str, **retry: int) -> None:
            claimed = client.dispatch_claim(
                worker, "repo:main", token, "task", unit_id, "M1", f"tr-{unit_id}"
            )
            client.dispatch_fail(
                claimed["dispatch_id"], worker, token, "E_TEST", "tests failed", **retry
            )

        failed("T1")
        failed("T1", retry_after_ms=600_000)
        same_t1 = "Same error repeated on the last 2 attempts, last on task/T1: E_TEST"
        assert ok_text(daemon, *stuck, cwd=project) == (
            "not stuck\n"
            f"suppressed (a retry is scheduled): same-error task/T1 {DASH} {same_t1}\n"
            "window: 2 recent dispatches\n"
        )
        assert ok_json(daemon, *stuck, "--project-root", "proj", cwd=short_tmp) == {
            "stuck": False,
            "verdict": None,
            "suppressed": [{"rule": "same-error", "unit_key": "task/T1", "reason": same_t1}],
            "window": ["task/T1", "task/T1"],
        }

        failed("T2")
        same_t2 = "Same error repeated on the last 2 attempts, last on task/T2: E_TEST"
        assert ok_text(daemon, *stuck, "--project-root", str(project)) == (
            f"stuck: same-error task/T2 {DASH} {same_t2}\nwindow: 3 recent dispatches\n"
        )
        assert ok_json(daemon, *stuck, "--window", "2", cwd=project) == {
            "stuck": True,
            "verdict": {"rule": "same-error", "unit_key": "task/T2", "reason": same_t2},
            "suppressed": [],
            "window": ["task/T1", "task/T2"],
        }
    # Another project has its own (empty) window; a window below 2 is the daemon's bad_args.
    assert ok_json(daemon, *stuck, "--project-root", str(short_tmp / "other"))["stuck"] is False
    json_error(daemon, *stuck, "--window", "1", cwd=project, code="bad_args")
