"""The real ``towerctl`` against a real daemon: every command, text and --json."""

from __future__ import annotations

import json
import os
import re
import subprocess
import uuid
from pathlib import Path

import pytest

from towerd_testing import TOWERCTL, db_location, plant_foreign_rows, towerctl, wait_for

pytestmark = pytest.mark.both_backends

UUID_RE = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"


def ok_json(daemon, *args: str):
    """Run ``towerctl --json ARGS``: it must succeed with JSON on stdout."""
    r = towerctl(daemon, "--json", *args)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr)
    assert r.stderr == ""
    return json.loads(r.stdout)


def ok_text(daemon, *args: str) -> str:
    """Run ``towerctl ARGS`` (text mode); it must succeed quietly on stderr."""
    r = towerctl(daemon, *args)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr)
    assert r.stderr == ""
    return r.stdout


def pairs(text: str) -> dict[str, str]:
    """The top-level ``key: value`` lines of a text-mode result."""
    return dict(
        line.split(": ", 1)
        for line in text.splitlines()
        if ": " in line and not line.startswith(" ")
    )


def json_error(daemon_or_socket, *args: str, code: str, exit_status: int = 1) -> dict:
    """With --json, an error is one JSON object on stdout and a non-zero exit."""
    r = _run(daemon_or_socket, "--json", *args)
    assert r.returncode == exit_status, (r.returncode, r.stdout, r.stderr)
    assert r.stdout.count("\n") == 1 and r.stdout.endswith("}\n"), r.stdout
    document = json.loads(r.stdout)
    assert set(document) == {"error"}
    error = document["error"]
    assert error["code"] == code
    assert isinstance(error["message"], str) and error["message"]
    assert set(error) <= {"code", "message", "data"}
    return error


def text_error(daemon_or_socket, *args: str, code: str, exit_status: int = 1) -> str:
    """Without --json, an error goes to stderr, nothing to stdout, non-zero exit."""
    r = _run(daemon_or_socket, *args)
    assert r.returncode == exit_status, (r.returncode, r.stdout, r.stderr)
    assert r.stdout == ""
    assert r.stderr.startswith(f"towerctl: {code}: "), r.stderr
    return r.stderr


def _run(daemon_or_socket, *args: str) -> subprocess.CompletedProcess[str]:
    if isinstance(daemon_or_socket, Path):
        env = {k: v for k, v in os.environ.items() if not k.startswith("TOWERD_")}
        return subprocess.run(
            [TOWERCTL, "--socket", str(daemon_or_socket), *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=30,
        )
    return towerctl(daemon_or_socket, *args)


# --- daemon commands ------------------------------------------------------------------


def test_ping(daemon):
    """ping prints 'pong', or {"pong": true, "now": ms} with --json."""
    assert ok_text(daemon, "ping") == "pong\n"
    answer = ok_json(daemon, "ping")
    assert answer["pong"] is True and isinstance(answer["now"], int)


def test_status(daemon):
    """status shows the daemon's identity, pid, paths and counts in both modes."""
    status = ok_json(daemon, "status")
    assert status["pid"] == daemon.pid
    assert status["socket_path"] == str(daemon.socket_path)
    assert status["db_path"] == db_location(daemon)
    assert status["state_dir"] == str(daemon.state_dir)
    assert status["sessions"] == 0
    assert status["keys"] == {"in_progress": 0, "completed": 0, "outcome_unknown": 0}
    text = ok_text(daemon, "status")
    shown = pairs(text)
    assert shown["daemon_id"] == status["daemon_id"]
    assert shown["pid"] == str(daemon.pid)
    assert shown["socket_path"] == str(daemon.socket_path)
    assert shown["sessions"] == "0"
    assert "keys:\n  in_progress: 0\n  completed: 0\n  outcome_unknown: 0\n" in text
    assert "reconciliation:\n" in text


def test_shutdown_text(daemon):
    """shutdown says 'stopping: yes' and the daemon process exits 0."""
    assert ok_text(daemon, "shutdown") == "stopping: yes\n"
    assert daemon.proc.wait(timeout=15) == 0
    text_error(daemon, "ping", code="unavailable", exit_status=3)


def test_shutdown_json(daemon):
    """shutdown --json prints {"stopping": true} and the daemon process exits 0."""
    assert ok_json(daemon, "shutdown") == {"stopping": True}
    assert daemon.proc.wait(timeout=15) == 0
    assert not daemon.socket_path.exists()


# --- sessions and fleet ---------------------------------------------------------------


def test_session_register_update_remove(daemon):
    """register prints a session id (same on a keyed retry); update/remove work."""
    text = ok_text(daemon, "session", "register", "--cwd", "/w", "--agent", "claude", "--name", "t")
    match = re.fullmatch(rf"session_id: ({UUID_RE})\n", text)
    assert match, text
    text_id = match.group(1)
    json_id = ok_json(
        daemon,
        "session",
        "register",
        "--cwd",
        "/j",
        "--agent",
        "codex",
        "--pinned",
        "--model",
        "m",
    )["session_id"]
    assert re.fullmatch(UUID_RE, json_id)

    keyed = [
        "session",
        "register",
        "--cwd",
        "/k",
        "--agent",
        "a",
        "--idempotency-key",
        "retry-1",
    ]
    first = ok_json(daemon, *keyed)
    assert ok_json(daemon, *keyed) == first
    assert ok_text(daemon, *keyed) == f"session_id: {first['session_id']}\n"
    given = str(uuid.uuid4())
    assert ok_json(
        daemon,
        "session",
        "register",
        "--cwd",
        "/g",
        "--agent",
        "a",
        "--session-id",
        given,
    ) == {"session_id": given}

    rows = ok_json(daemon, "fleet", "list")["sessions"]
    assert [r["session_id"] for r in rows] == [
        text_id,
        json_id,
        first["session_id"],
        given,
    ]
    assert (rows[0]["name"], rows[1]["pinned"], rows[1]["model"]) == ("t", True, "m")

    updated = ok_json(
        daemon,
        "session",
        "update",
        json_id,
        "--name",
        "renamed",
        "--no-pinned",
        "--clear",
        "model",
        "--last-attached-at",
        "99",
    )
    assert (
        updated["name"],
        updated["pinned"],
        updated["model"],
        updated["last_attached_at"],
    ) == (
        "renamed",
        False,
        None,
        99,
    )
    shown = pairs(ok_text(daemon, "session", "update", text_id, "--exited", "--cwd", "/moved"))
    assert (shown["session_id"], shown["exited"], shown["cwd"], shown["name"]) == (
        text_id,
        "yes",
        "/moved",
        "t",
    )
    r = towerctl(daemon, "session", "update", text_id)
    assert r.returncode == 2 and "nothing to update" in r.stderr

    assert ok_json(daemon, "session", "remove", json_id) == {
        "session_id": json_id,
        "removed": True,
    }
    assert pairs(ok_text(daemon, "session", "remove", text_id)) == {
        "session_id": text_id,
        "removed": "yes",
    }
    json_error(daemon, "session", "remove", text_id, code="not_found")
    text_error(daemon, "session", "update", text_id, "--name", "x", code="not_found")
    assert ok_json(daemon, "status")["sessions"] == 2


def test_fleet_list_and_get(daemon):
    """fleet list shows all rows in stored order (or a page); get shows one row."""
    ids = [
        ok_json(
            daemon,
            "session",
            "register",
            "--cwd",
            f"/w{i}",
            "--agent",
            "a",
            "--name",
            f"n{i}",
        )["session_id"]
        for i in range(3)
    ]
    listed = ok_json(daemon, "fleet", "list")
    assert list(listed) == ["sessions"]
    assert [r["session_id"] for r in listed["sessions"]] == ids

    page = ok_json(daemon, "fleet", "list", "--limit", "2")
    assert [r["session_id"] for r in page["sessions"]] == ids[:2]
    rest = ok_json(daemon, "fleet", "list", "--limit", "2", "--cursor", str(page["next_cursor"]))
    assert [r["session_id"] for r in rest["sessions"]] == ids[2:]
    assert rest["next_cursor"] is None

    table = ok_text(daemon, "fleet", "list").splitlines()
    assert table[0].split() == [
        "SESSION",
        "NAME",
        "AGENT",
        "PARENT",
        "PINNED",
        "EXITED",
        "LIVE",
        "CWD",
        "UPDATED",
    ]
    assert [line.split()[:2] for line in table[1:]] == [[sid, f"n{i}"] for i, sid in enumerate(ids)]
    paged = ok_text(daemon, "fleet", "list", "--limit", "1").splitlines()
    assert len(paged) == 3 and paged[1].startswith(ids[0])
    first_page = ok_json(daemon, "fleet", "list", "--limit", "1")
    assert paged[2] == f"next cursor: {first_page['next_cursor']}"

    row = ok_json(daemon, "fleet", "get", ids[1])
    assert (row["session_id"], row["name"], row["cwd"]) == (ids[1], "n1", "/w1")
    shown = pairs(ok_text(daemon, "fleet", "get", ids[1]))
    assert (shown["session_id"], shown["name"], shown["cwd"], shown["parent"]) == (
        ids[1],
        "n1",
        "/w1",
        "-",
    )
    missing = str(uuid.uuid4())
    assert json_error(daemon, "fleet", "get", missing, code="not_found")["data"] == {
        "session_id": missing
    }
    text_error(daemon, "fleet", "get", missing, code="not_found")
    assert (
        "`$.session_id`" in json_error(daemon, "fleet", "get", "bogus", code="bad_args")["message"]
    )


def test_fleet_import_legacy(daemon, short_tmp):
    """import-legacy imports good entries and reports skipped ones by index."""
    path = short_tmp / "fleet.json"
    path.write_text(
        json.dumps(
            [
                {"agentSessionID": "L1", "cwd": "/1", "agent": "claude"},
                {
                    "agentSessionID": "L2",
                    "cwd": "/2",
                    "agent": "claude",
                    "parent": "L1",
                },
                {"cwd": "/no-id"},
            ]
        )
    )
    result = ok_json(daemon, "fleet", "import-legacy", str(path))
    assert (result["imported"], result["skipped"]) == (2, 1)
    assert result["skips"][0]["index"] == 2
    one, two = (s["session_id"] for s in result["sessions"])
    assert ok_json(daemon, "fleet", "get", two)["parent"] == one

    assert ok_json(daemon, "status")["sessions"] == 2

    bad = short_tmp / "bad.json"
    bad.write_text("{not json")
    not_list = short_tmp / "obj.json"
    not_list.write_text("{}")
    for target, needle in (
        (bad, "not valid JSON"),
        (not_list, "JSON array"),
        (short_tmp / "missing.json", "cannot read"),
    ):
        r = towerctl(daemon, "fleet", "import-legacy", str(target))
        assert r.returncode == 2, r
        assert needle in r.stderr and r.stdout == ""
        error = json_error(daemon, "fleet", "import-legacy", str(target), code="usage",
                           exit_status=2)  # fmt: skip
        assert needle in error["message"]
    assert ok_json(daemon, "status")["sessions"] == 2


def test_fleet_import_legacy_text_reports_counts_and_skips(daemon, short_tmp):
    """Without --json, import-legacy still shows counts and why entries were skipped."""
    path = short_tmp / "fleet.json"
    path.write_text(json.dumps([{"agentSessionID": "L3", "cwd": "/3", "agent": "codex"}, 5]))
    text = ok_text(daemon, "fleet", "import-legacy", str(path))
    (row,) = ok_json(daemon, "fleet", "list")["sessions"]
    assert row["agent_session_id"] == "L3"
    assert text.splitlines() == [
        "imported 1, skipped 1",
        f"  L3 -> {row['session_id']}",
        "  skipped entry 1: invalid entry: entry is a int, not an object",
    ]


@pytest.mark.sqlite_only  # plants another daemon's rows in the file; PostgreSQL: test_adopt_boxes
def test_fleet_adopt(daemon):
    """adopt refuses own (bad_args) and unknown (not_found) ids; takes gone rows."""
    own = ok_json(daemon, "status")["daemon_id"]
    assert json_error(daemon, "fleet", "adopt", own, code="bad_args")
    text_error(daemon, "fleet", "adopt", own, code="bad_args")
    json_error(daemon, "fleet", "adopt", "nobody", code="not_found")
    text_error(daemon, "fleet", "adopt", "nobody", code="not_found")

    assert daemon.stop() == 0
    foreign = plant_foreign_rows(daemon.state_dir, "old-1")[0]
    plant_foreign_rows(daemon.state_dir, "old-2")
    daemon.start()
    assert ok_json(daemon, "fleet", "adopt", "old-1") == {
        "adopted": 1,
        "from_daemon_id": "old-1",
        "daemon_id": own,
        "owner_epoch": 2,
        "keys_adopted": 0,
        "keys_marked_unknown": 0,
        "keys_completed_from_evidence": 0,
    }
    assert ok_json(daemon, "fleet", "get", foreign)["owner_epoch"] == 2
    shown = pairs(ok_text(daemon, "fleet", "adopt", "old-2"))
    assert (shown["adopted"], shown["from_daemon_id"], shown["daemon_id"]) == (
        "1",
        "old-2",
        own,
    )


# --- idempotency keys -----------------------------------------------------------------


def test_idem_claim_holder_defaults_to_parent(daemon):
    """idem claim without --holder-pid holds the key for the CLI's parent process."""
    claimed = ok_json(daemon, "idem", "claim", "op", "mine")
    assert claimed["state"] == "claimed"
    record = ok_json(daemon, "idem", "get", "op", "mine")
    assert record["holder_pid"] == os.getpid()
    assert record["state"] == "in_progress"

    # A key held by a process that then dies turns outcome_unknown once the holder sweep
    # runs; the same sweep must leave the key of our (live) process alone.
    short_lived = subprocess.Popen(["cat"], stdin=subprocess.PIPE)
    try:
        ok_json(
            daemon,
            "idem",
            "claim",
            "op",
            "theirs",
            "--holder-pid",
            str(short_lived.pid),
        )
    finally:
        short_lived.stdin.close()
        short_lived.wait(10)
    # A connection that claimed for itself pokes the sweep when it closes.
    with daemon.client() as c:
        c.idem_claim("op", "poke")
    wait_for(
        lambda: ok_json(daemon, "idem", "get", "op", "theirs")["state"] == "outcome_unknown",
        timeout=10,
        what="the dead holder's key to turn outcome_unknown",
    )
    assert ok_json(daemon, "idem", "get", "op", "mine")["state"] == "in_progress"
    assert pairs(ok_text(daemon, "idem", "get", "op", "mine"))["holder_pid"] == str(os.getpid())


def test_idem_claim_complete_get(daemon):
    """claim, complete --result and get in both modes; a replay returns the result."""
    text = pairs(ok_text(daemon, "idem", "claim", "deploy", "t1", "--payload", '{"v": 1}'))
    assert text["state"] == "claimed" and re.fullmatch(UUID_RE, text["effect_ref"])
    claimed = ok_json(
        daemon,
        "idem",
        "claim",
        "deploy",
        "j1",
        "--effect-ref",
        "ref-j1",
        "--holder-pid",
        str(os.getpid()),
    )
    assert claimed == {"state": "claimed", "effect_ref": "ref-j1"}

    done = ok_json(daemon, "idem", "complete", "deploy", "j1", "--result", '{"url": "u"}')
    assert (done["state"], done["result"], done["effect_ref"]) == (
        "completed",
        {"url": "u"},
        "ref-j1",
    )
    shown = ok_text(daemon, "idem", "complete", "deploy", "t1", "--result", "[1, 2]")
    assert pairs(shown)["state"] == "completed" and pairs(shown)["result"] == "[1, 2]"

    assert ok_json(daemon, "idem", "claim", "deploy", "j1") == {
        "state": "completed",
        "effect_ref": "ref-j1",
        "result": {"url": "u"},
    }
    replay = ok_json(
        daemon,
        "idem",
        "claim",
        "deploy",
        "t1",
        "--payload",
        '{"v": 1}',
        "--replay-only",
    )
    assert replay["state"] == "completed" and replay["result"] == [1, 2]
    got = ok_json(daemon, "idem", "get", "deploy", "j1")
    assert (got["operation"], got["key"], got["state"]) == ("deploy", "j1", "completed")
    assert pairs(ok_text(daemon, "idem", "get", "deploy", "j1"))["state"] == "completed"

    err = json_error(
        daemon,
        "idem",
        "claim",
        "deploy",
        "t1",
        "--payload",
        '{"v": 2}',
        code="idempotency_conflict",
    )
    assert err["data"] == {"operation": "deploy", "key": "t1", "state": "completed"}
    text_error(daemon, "idem", "get", "deploy", "nope", code="idempotency_key_unknown")
    json_error(
        daemon,
        "idem",
        "claim",
        "deploy",
        "nope",
        "--replay-only",
        code="idempotency_key_unknown",
    )


def test_idem_in_progress_error(daemon):
    """A second claim of a held key fails with idempotency_in_progress in both modes."""
    first = ok_json(daemon, "idem", "claim", "op", "busy")
    err = json_error(daemon, "idem", "claim", "op", "busy", code="idempotency_in_progress")
    assert err["data"]["effect_ref"] == first["effect_ref"]
    assert err["data"]["holder_pid"] == os.getpid()
    stderr = text_error(daemon, "idem", "claim", "op", "busy", code="idempotency_in_progress")
    assert "in progress" in stderr


def test_idem_release_and_mark_unknown(daemon):
    """release drops an in-progress key; mark-unknown makes claims outcome_unknown."""
    ok_json(daemon, "idem", "claim", "op", "r1")
    assert ok_json(daemon, "idem", "release", "op", "r1") == {
        "operation": "op",
        "key": "r1",
        "released": True,
    }
    ok_json(daemon, "idem", "claim", "op", "r2")
    assert pairs(ok_text(daemon, "idem", "release", "op", "r2")) == {
        "operation": "op",
        "key": "r2",
        "released": "yes",
    }
    json_error(daemon, "idem", "get", "op", "r2", code="idempotency_key_unknown")
    json_error(daemon, "idem", "release", "op", "r2", code="idempotency_key_unknown")

    ok_json(daemon, "idem", "claim", "op", "u1")
    assert ok_json(daemon, "idem", "mark-unknown", "op", "u1")["state"] == "outcome_unknown"
    ok_json(daemon, "idem", "claim", "op", "u2")
    assert pairs(ok_text(daemon, "idem", "mark-unknown", "op", "u2"))["state"] == "outcome_unknown"
    json_error(daemon, "idem", "claim", "op", "u1", code="outcome_unknown")
    text_error(daemon, "idem", "release", "op", "u2", code="outcome_unknown")


def test_idem_resolve(daemon):
    """resolve: completed records, abandoned frees the key, other states conflict."""
    for key in ("a", "b", "c", "d"):
        ok_json(daemon, "idem", "claim", "op", key)
        ok_json(daemon, "idem", "mark-unknown", "op", key)
    done = ok_json(
        daemon,
        "idem",
        "resolve",
        "op",
        "a",
        "--outcome",
        "completed",
        "--result",
        '"ok"',
    )
    assert (done["outcome"], done["record"]["state"], done["record"]["result"]) == (
        "completed",
        "completed",
        "ok",
    )
    assert ok_json(daemon, "idem", "resolve", "op", "b", "--outcome", "abandoned") == {
        "operation": "op",
        "key": "b",
        "outcome": "abandoned",
        "record": None,
    }
    assert ok_json(daemon, "idem", "claim", "op", "b")["state"] == "claimed"
    text = ok_text(daemon, "idem", "resolve", "op", "c", "--outcome", "completed", "--result", "5")
    assert pairs(text)["outcome"] == "completed" and "  state: completed" in text
    assert pairs(ok_text(daemon, "idem", "resolve", "op", "d", "--outcome", "abandoned")) == {
        "operation": "op",
        "key": "d",
        "outcome": "abandoned",
        "record": "-",
    }
    err = json_error(
        daemon, "idem", "resolve", "op", "a", "--outcome", "abandoned", code="conflict"
    )
    assert err["data"]["state"] == "completed"
    text_error(daemon, "idem", "resolve", "op", "b", "--outcome", "completed", code="conflict")
    r = towerctl(daemon, "idem", "resolve", "op", "a", "--outcome", "maybe")
    assert r.returncode == 2 and r.stdout == ""
    r = towerctl(daemon, "idem", "resolve", "op", "a")
    assert r.returncode == 2 and "--outcome" in r.stderr


def test_idem_list(daemon):
    """idem list shows this principal's keys, all pages, filtered, or one page."""
    for i in range(4):
        ok_json(daemon, "idem", "claim", "build" if i % 2 else "test", f"k{i}")
    ok_json(daemon, "idem", "complete", "test", "k0")
    listed = ok_json(daemon, "idem", "list")
    assert list(listed) == ["keys"]
    assert [k["key"] for k in listed["keys"]] == ["k0", "k1", "k2", "k3"]
    assert [k["key"] for k in ok_json(daemon, "idem", "list", "--state", "completed")["keys"]] == [
        "k0"
    ]
    assert [k["key"] for k in ok_json(daemon, "idem", "list", "--operation", "build")["keys"]] == [
        "k1",
        "k3",
    ]
    page = ok_json(daemon, "idem", "list", "--limit", "3")
    assert len(page["keys"]) == 3 and page["next_cursor"] is not None
    rest = ok_json(daemon, "idem", "list", "--limit", "3", "--cursor", str(page["next_cursor"]))
    assert [k["key"] for k in rest["keys"]] == ["k3"] and rest["next_cursor"] is None
    assert ok_json(daemon, "--principal", "other", "idem", "list") == {"keys": []}

    table = ok_text(daemon, "idem", "list", "--state", "in_progress").splitlines()
    assert table[0].split() == ["OPERATION", "KEY", "STATE", "EFFECT_REF", "UPDATED"]
    assert [line.split()[:3] for line in table[1:]] == [
        ["build", "k1", "in_progress"],
        ["test", "k2", "in_progress"],
        ["build", "k3", "in_progress"],
    ]
    r = towerctl(daemon, "idem", "list", "--state", "bogus")
    assert r.returncode == 2 and r.stdout == ""


def test_principal_option(daemon):
    """--principal scopes keys: another principal does not see them."""
    ok_json(daemon, "--principal", "alice", "idem", "claim", "op", "k")
    assert (
        ok_json(daemon, "--principal", "alice", "idem", "get", "op", "k")["state"] == "in_progress"
    )
    json_error(
        daemon,
        "--principal",
        "bob",
        "idem",
        "get",
        "op",
        "k",
        code="idempotency_key_unknown",
    )
    json_error(daemon, "idem", "get", "op", "k", code="idempotency_key_unknown")


# --- usage and availability errors ----------------------------------------------------


def test_invalid_payload_json_is_usage_error(daemon):
    """An invalid --payload (or --result) JSON exits 2 without touching the key: on
    stderr, or with --json as a `usage` error on stdout."""
    r = towerctl(daemon, "idem", "claim", "op", "p", "--payload", "{oops")
    assert r.returncode == 2, r
    assert "--payload is not valid JSON" in r.stderr and r.stdout == ""
    error = json_error(daemon, "idem", "claim", "op", "p", "--payload", "{oops", code="usage",
                       exit_status=2)  # fmt: skip
    assert error["message"].startswith("--payload is not valid JSON")
    assert error["data"]["usage"].startswith("usage: towerctl idem claim ")
    json_error(daemon, "idem", "get", "op", "p", code="idempotency_key_unknown")
    ok_json(daemon, "idem", "claim", "op", "p")
    r = towerctl(daemon, "idem", "complete", "op", "p", "--result", "nope")
    assert r.returncode == 2 and "--result is not valid JSON" in r.stderr
    assert ok_json(daemon, "idem", "get", "op", "p")["state"] == "in_progress"


def test_argparse_usage_errors(daemon):
    """A missing argument or unknown command exits 2 with usage on stderr."""
    for args in (
        ("idem", "claim", "op"),
        ("frobnicate",),
        ("session", "register", "--cwd", "/x"),
    ):
        r = towerctl(daemon, *args)
        assert r.returncode == 2, r
        assert "usage:" in r.stderr and r.stdout == ""


def test_usage_errors_under_json_are_json(daemon):
    """With --json (before or after the command), what argparse refuses is a `usage`
    error on stdout, with the command's usage, exit 2; stderr stays empty."""
    for args, usage in (
        (("fleet", "list", "--bogus"), "usage: towerctl fleet list "),
        (("fleet", "list", "--limit", "x"), "usage: towerctl fleet list "),
        (("idem", "claim", "op"), "usage: towerctl idem claim "),
        (("frobnicate",), "usage: towerctl "),
    ):
        for placed in (("--json", *args), (*args, "--json")):
            r = _run(daemon, *placed)
            assert r.returncode == 2 and r.stderr == "", r
            (line,) = r.stdout.splitlines()
            error = json.loads(line)["error"]
            assert error["code"] == "usage" and error["message"], error
            assert error["data"]["usage"].startswith(usage), error
            assert "\n" not in error["data"]["usage"]
    error = json.loads(_run(daemon, "--json", "fleet", "list", "--bogus").stdout)["error"]
    assert error["message"] == "unrecognized arguments: --bogus"


def test_global_options_after_the_command(daemon, short_tmp):
    """The README writes `fleet restore-plan --json` and `status --json`: global options
    are taken after the command as well as before it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOWERD_")}

    def bare(*args: str) -> subprocess.CompletedProcess[str]:  # no --socket put first
        return subprocess.run([TOWERCTL, *args], capture_output=True, text=True, env=env,
                              check=False, timeout=30)  # fmt: skip

    sock = str(daemon.socket_path)
    with daemon.client() as client:
        session = client.session_register(cwd="/srv/app", agent="claude")["session_id"]
    status = json.loads(bare("status", "--json", "--socket", sock).stdout)
    assert status["pid"] == daemon.pid
    plan = json.loads(bare("fleet", "restore-plan", "--socket", sock, "--json").stdout)
    assert [s["session_id"] for s in plan["sessions"]] == [session]
    listed = bare("fleet", "list", "--json", "--socket", sock, "--timeout", "5")
    assert listed.returncode == 0 and listed.stderr == "", listed
    assert [s["session_id"] for s in json.loads(listed.stdout)["sessions"]] == [session]
    # --principal after the command picks whose keys are read.
    bare("--socket", sock, "idem", "claim", "op", "k", "--principal", "ci")
    mine = json.loads(bare("idem", "list", "--json", "--socket=" + sock).stdout)["keys"]
    theirs = bare("idem", "list", "--principal=ci", "--json", "--socket", sock).stdout
    assert mine == [] and [k["key"] for k in json.loads(theirs)["keys"]] == ["k"]
    # A socket given after the command is the one used (nobody listens here).
    gone = bare("ping", "--json", "--socket", str(short_tmp / "nobody.sock"))
    assert gone.returncode == 3 and json.loads(gone.stdout)["error"]["code"] == "unavailable"


def test_version():
    from towerd.protocol import VERSION

    r = subprocess.run(
        [TOWERCTL, "--version"], capture_output=True, text=True, check=False, timeout=30
    )
    assert (r.returncode, r.stdout, r.stderr) == (0, f"towerctl {VERSION}\n", "")


def test_hook_report_help_prints_help_but_a_hook_run_prints_nothing(daemon):
    """`hook-report --help` is for a person; run as a hook it stays silent."""
    for placed in (("hook-report", "--help"), ("--json", "hook-report", "-h")):
        r = towerctl(daemon, *placed)
        assert r.returncode == 0 and r.stderr == "", r
        assert r.stdout.startswith("usage: towerctl hook-report")
        assert "record an agent hook's JSON" in r.stdout
    sock = str(daemon.socket_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOWERD_")}
    with daemon.client() as client:
        session = client.session_register(cwd="/srv/app", agent="claude")["session_id"]
        env["TOWERD_SESSION_ID"] = session
        payload = json.dumps({"hook_event_name": "Stop", "session_id": session})
        # The socket before the command, after it, and after it with --json.
        for argv in (("--socket", sock, "hook-report"), ("hook-report", "--socket", sock),
                     ("hook-report", "--json", f"--socket={sock}")):  # fmt: skip
            r = subprocess.run([TOWERCTL, *argv], input=payload, capture_output=True,
                               text=True, env=env, check=False, timeout=30)  # fmt: skip
            assert (r.returncode, r.stdout, r.stderr) == (0, "", ""), r
        kinds = [e["kind"] for e in client.event_list(session_ids=[session])["events"]]
    assert kinds == ["Stop", "Stop", "Stop"]


def test_install_systemd_enable_without_a_user_bus_is_one_clear_line(short_tmp):
    """--enable where systemctl cannot reach a user manager: the units are written, one
    line says what failed and what to run instead, exit 1; with --json a JSON error."""
    runtime = short_tmp / "runtime"
    runtime.mkdir(mode=0o700)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOWERD_")}
    env.update(DBUS_SESSION_BUS_ADDRESS=f"unix:path={short_tmp}/no-bus",
               XDG_RUNTIME_DIR=str(runtime))  # fmt: skip
    units = short_tmp / "units"
    command = [TOWERCTL, "install-systemd", "--dir", str(units), "--enable"]
    r = subprocess.run(command, capture_output=True, text=True, env=env, check=False, timeout=60)
    assert r.returncode == 1 and r.stdout == "", r
    assert "Traceback" not in r.stderr
    (line,) = r.stderr.splitlines()
    assert line.startswith("towerctl: systemctl_failed: the units are written to "), line
    assert "`systemctl --user daemon-reload` failed: " in line
    assert "systemctl --user enable --now towerd.socket" in line
    assert "loginctl enable-linger" in line
    assert sorted(p.name for p in units.iterdir()) == ["towerd.service", "towerd.socket"]
    r = subprocess.run([*command, "--json"], capture_output=True, text=True, env=env,
                       check=False, timeout=60)  # fmt: skip
    assert r.returncode == 1 and r.stderr == "", r
    error = json.loads(r.stdout)["error"]
    assert error["code"] == "systemctl_failed"
    assert error["data"]["command"] == ["systemctl", "--user", "daemon-reload"]
    assert error["data"]["installed"] == [str(units / "towerd.socket"),
                                          str(units / "towerd.service")]  # fmt: skip


def test_daemon_not_running_is_exit_3(short_tmp):
    """With no daemon on the socket, every command exits 3 with code 'unavailable'."""
    sock = short_tmp / "none" / "towerd.sock"
    for args in (("ping",), ("status",), ("idem", "list"), ("fleet", "list")):
        error = json_error(sock, *args, code="unavailable", exit_status=3)
        assert error["data"] == {"socket": str(sock), "reason": "connect"}
        stderr = text_error(sock, *args, code="unavailable", exit_status=3)
        assert str(sock) in stderr


def test_install_systemd(short_tmp):
    """install-systemd --dir writes both units, ExecStart an absolute towerd path."""
    no_daemon = short_tmp / "none.sock"
    for mode, unit_dir in (
        ((), short_tmp / "text-units"),
        (("--json",), short_tmp / "json-units"),
    ):
        r = _run(no_daemon, *mode, "install-systemd", "--dir", str(unit_dir))
        assert r.returncode == 0, r
        assert r.stderr == ""
        assert sorted(p.name for p in unit_dir.iterdir()) == [
            "towerd.service",
            "towerd.socket",
        ]
        service = (unit_dir / "towerd.service").read_text()
        socket_unit = (unit_dir / "towerd.socket").read_text()
        assert "@TOWERD@" not in service and "@TOWERD@" not in socket_unit
        (exec_start,) = [line for line in service.splitlines() if line.startswith("ExecStart=")]
        executable = Path(exec_start.removeprefix("ExecStart=").split()[0])
        assert executable.is_absolute()
        assert executable.name == "towerd"
        assert executable.is_file() and os.access(executable, os.X_OK)
        assert "ListenStream=%t/towerd/towerd.sock" in socket_unit
        if mode:
            result = json.loads(r.stdout)
            assert result["installed"] == [
                str(unit_dir / "towerd.socket"),
                str(unit_dir / "towerd.service"),
            ]
            assert result["towerd"] == str(executable)
            assert result["enabled"] is False
            assert "systemctl --user daemon-reload" in result["next"]
        else:
            assert pairs(r.stdout)["towerd"] == str(executable)
