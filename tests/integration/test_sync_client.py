"""Every RPC through the blocking ``towerd.client.Client`` against a real daemon."""

from __future__ import annotations

import os
import time
import uuid

import pytest

import towerd.client as client_module
from towerd.client import (
    BadArgs,
    Client,
    Conflict,
    EffectNotStarted,
    FrameTooLarge,
    IdempotencyConflict,
    IdempotencyInProgress,
    IdempotencyKeyUnknown,
    Internal,
    NotFound,
    OutcomeUnknown,
    StaleEpoch,
    TowerdError,
    Unavailable,
    UnknownMethod,
    run_once,
)
from towerd.protocol import ERROR_CODES, error_for_code
from towerd_testing import db_location, plant_foreign_rows, start_declaring, wait_box_dead

pytestmark = pytest.mark.both_backends

UID = os.geteuid()
SESSION_KEYS = {
    "session_id",
    "agent_session_id",
    "name",
    "cwd",
    "agent",
    "pinned",
    "last_attached_at",
    "exited",
    "parent",
    "prompt",
    "result",
    "transcript_path",
    "model",
    "effort",
    "target",
    "target_identity",
    "agent_pid",
    "live",
    "daemon_id",
    "owner_epoch",
    "updated_at",
}
RECORD_KEYS = {
    "operation",
    "key",
    "state",
    "effect_ref",
    "result",
    "created_at",
    "updated_at",
    "holder_pid",
}


def new_id() -> str:
    return str(uuid.uuid4())


def entry(session_id: str, **fields):
    return {"session_id": session_id, "cwd": "/w", "agent": "claude", **fields}


# --- hello, ping, status --------------------------------------------------------------


def test_hello_result_fields(daemon):
    """hello answers identity, protocol 1, limits, features, the default principal."""
    with daemon.client() as c:
        hello = c.hello
        status = c.status()
    assert set(hello) == {
        "daemon_id",
        "owner_epoch",
        "protocol",
        "server",
        "max_frame",
        "features",
        "principal",
    }
    assert hello["daemon_id"] == status["daemon_id"]
    uuid.UUID(hello["daemon_id"])
    assert hello["owner_epoch"] == status["owner_epoch"] == 1
    assert hello["protocol"] == 1
    assert hello["server"] == {"name": "towerd", "version": "0.1.0"}
    assert hello["max_frame"] == 1024 * 1024
    assert {"fleet", "idempotency", "pipelining", "paging", "leases", "effects"} <= set(
        hello["features"]
    )
    assert hello["principal"] == f"uid:{UID}:default"


def test_hello_with_principal(daemon):
    """A named principal is reported back prefixed with the peer's uid."""
    with daemon.client(principal="agent-7") as c:
        assert c.hello["principal"] == f"uid:{UID}:agent-7"


def test_hello_principal_invalid_is_bad_args(daemon):
    """An empty or non-printable principal is refused at hello with bad_args."""
    for principal in ("", "a\nb", "x" * 129):
        with pytest.raises(BadArgs) as info:
            Client(daemon.socket_path, principal=principal)
        assert "principal" in info.value.message
    with daemon.client() as c:
        assert c.ping()["pong"] is True


def test_ping(daemon):
    """ping answers pong with the daemon's clock in epoch milliseconds."""
    with daemon.client() as c:
        before = time.time_ns() // 1_000_000
        answer = c.ping()
        after = time.time_ns() // 1_000_000
    assert set(answer) == {"pong", "now", "store"} and answer["store"] == "reachable"
    assert answer["pong"] is True
    assert before - 1000 <= answer["now"] <= after + 1000


def test_status_fields_and_counts(daemon):
    """status reports identity, pid, paths, session count, keys and reconciliation."""
    with daemon.client() as c:
        empty = c.status()
        assert empty["sessions"] == 0
        assert empty["keys"] == {"in_progress": 0, "completed": 0, "outcome_unknown": 0}
        c.session_register(cwd="/a", agent="claude")
        c.session_register(cwd="/b", agent="codex")
        c.idem_claim("op", "running")
        c.idem_claim("op", "done")
        c.idem_complete("op", "done", {"ok": 1})
        c.idem_claim("op", "lost")
        c.idem_mark_unknown("op", "lost")
        with daemon.client(principal="other") as other:
            other.idem_claim("op", "done")
            other.idem_complete("op", "done")
        status = c.status()
    assert status["daemon_id"] == c.hello["daemon_id"]
    assert status["owner_epoch"] == 1
    assert status["pid"] == daemon.pid
    assert status["version"] == "0.1.0"
    assert status["protocol"] == 1
    assert status["db_path"] == db_location(daemon)  # the file, or the DSN on PostgreSQL
    assert status["socket_path"] == str(daemon.socket_path)
    assert status["sessions"] == 2
    # Keys are counted daemon-wide, across principals.
    assert status["keys"] == {"in_progress": 1, "completed": 2, "outcome_unknown": 1}
    assert status["uptime_ms"] >= 0
    assert status["started_at"] <= time.time_ns() // 1_000_000
    reconciliation = status["reconciliation"]
    assert reconciliation["owner_epoch"] == 1
    assert {k: v for k, v in reconciliation.items() if k not in ("at", "owner_epoch")} == {
        "rows_taken": 0,
        "marked_unknown": 0,
        "completed_from_evidence": 0,
        "still_unknown": 0,
        "expired": 0,
    }


# --- sessions -------------------------------------------------------------------------


def test_session_register_update_remove(daemon):
    """register inserts (minted or given id), update rewrites fields, remove deletes."""
    with daemon.client() as c:
        minted = c.session_register(cwd="/w", agent="claude", name="first")
        assert set(minted) == {"session_id"}
        sid = minted["session_id"]
        assert str(uuid.UUID(sid)) == sid
        row = c.fleet_get(sid)
        assert set(row) == SESSION_KEYS
        assert (
            row["cwd"],
            row["agent"],
            row["name"],
            row["pinned"],
            row["exited"],
        ) == (
            "/w",
            "claude",
            "first",
            False,
            False,
        )
        assert row["daemon_id"] == c.hello["daemon_id"]
        assert row["owner_epoch"] == 1

        mine = new_id()
        assert c.session_register(cwd="/x", agent="codex", session_id=mine, model="m1") == {
            "session_id": mine
        }
        updated = c.session_update(mine, name="renamed", pinned=True, last_attached_at=1234)
        assert updated["session_id"] == mine
        assert (updated["name"], updated["pinned"], updated["last_attached_at"]) == (
            "renamed",
            True,
            1234,
        )
        assert updated["model"] == "m1"  # fields not given are kept
        cleared = c.session_update(mine, model=None)
        assert cleared["model"] is None and cleared["name"] == "renamed"
        assert c.fleet_get(mine) == cleared

        assert c.session_remove(mine) == {"session_id": mine, "removed": True}
        with pytest.raises(NotFound) as info:
            c.fleet_get(mine)
        assert info.value.data == {"session_id": mine}
        with pytest.raises(NotFound):
            c.session_remove(mine)
        with pytest.raises(NotFound):
            c.session_update(mine, name="ghost")
        assert [row["session_id"] for row in c.iter_fleet()] == [sid]


def test_session_register_errors(daemon):
    """A duplicate id is conflict; a malformed id is bad_args naming the field path."""
    with daemon.client() as c:
        sid = new_id()
        c.session_register(cwd="/w", agent="a", session_id=sid)
        with pytest.raises(Conflict) as info:
            c.session_register(cwd="/w", agent="a", session_id=sid)
        assert info.value.data == {"session_id": sid}
        with pytest.raises(BadArgs) as bad:
            c.session_register(cwd="/w", agent="a", session_id="not-a-uuid")
        assert "`$.session_id`" in bad.value.message
        with pytest.raises(BadArgs) as missing:
            c.call("session.register", {"agent": "a"})
        assert "cwd" in missing.value.message
        with pytest.raises(NotFound):
            c.session_register(cwd="/w", agent="a", parent=new_id())
        assert c.status()["sessions"] == 1


def test_session_register_idempotency_key(daemon):
    """A retry with the same idempotency key returns the same id and inserts once."""
    with daemon.client() as c:
        first = c.session_register(cwd="/w", agent="a", idempotency_key="reg-1")
        again = c.session_register(cwd="/w", agent="a", idempotency_key="reg-1")
        assert again == first
        with pytest.raises(IdempotencyConflict):
            c.session_register(cwd="/other", agent="a", idempotency_key="reg-1")
        assert [row["session_id"] for row in c.iter_fleet()] == [first["session_id"]]


def test_session_parents_stay_one_level(daemon):
    """A link to a sub-session points at its top row; removal promotes children."""
    with daemon.client() as c:
        top = c.session_register(cwd="/w", agent="a")["session_id"]
        child = c.session_register(cwd="/w", agent="a", parent=top)["session_id"]
        grandchild = c.session_register(cwd="/w", agent="a", parent=child)["session_id"]
        assert c.fleet_get(grandchild)["parent"] == top
        with pytest.raises(Conflict):
            c.session_update(top, parent=child)
        assert c.session_remove(top)["removed"] is True
        assert c.fleet_get(child)["parent"] is None
        assert c.fleet_get(grandchild)["parent"] is None


# --- fleet ----------------------------------------------------------------------------


def test_fleet_list_stored_order_and_paging(daemon):
    """fleet.list keeps stored order; limit/cursor pages cover every row once."""
    with daemon.client() as c:
        ids = [c.session_register(cwd=f"/w{i}", agent="a")["session_id"] for i in range(7)]
        whole = c.fleet_list()
        assert [row["session_id"] for row in whole["sessions"]] == ids
        assert whole["next_cursor"] is None

        seen = []
        cursor = None
        pages = 0
        while True:
            page = c.fleet_list(limit=3, cursor=cursor)
            assert len(page["sessions"]) <= 3
            seen += [row["session_id"] for row in page["sessions"]]
            pages += 1
            cursor = page["next_cursor"]
            if cursor is None:
                break
        assert seen == ids and pages == 3
        assert [row["session_id"] for row in c.iter_fleet(page_size=2)] == ids
        assert [row["session_id"] for row in c.iter_fleet(page_size=7)] == ids

        # An updated row keeps its place in stored order.
        c.session_update(ids[0], name="touched")
        assert [row["session_id"] for row in c.fleet_list()["sessions"]] == ids

        with pytest.raises(BadArgs) as info:
            c.fleet_list(limit=0)
        assert "`$.limit`" in info.value.message
        with pytest.raises(BadArgs):
            c.fleet_list(limit=5001)
        with pytest.raises(BadArgs) as cur:
            c.fleet_list(cursor=-1)
        assert "`$.cursor`" in cur.value.message


def test_fleet_get_unknown_is_not_found(daemon):
    """fleet.get of an unknown session id raises NotFound with the id in data."""
    missing = new_id()
    with daemon.client() as c:
        with pytest.raises(NotFound) as info:
            c.fleet_get(missing)
        assert info.value.code == "not_found"
        assert info.value.data == {"session_id": missing}
        with pytest.raises(BadArgs):
            c.fleet_get("nope")


def test_fleet_write_counts_and_dedup(daemon):
    """fleet.write keeps the last entry per id and agent session; exact counts."""
    with daemon.client() as c:
        old = c.session_register(cwd="/old", agent="a", agent_session_id="ag-0")["session_id"]
        keep = c.session_register(cwd="/keep", agent="a")["session_id"]
        s1, s2, s3 = new_id(), new_id(), new_id()
        result = c.fleet_write(
            [
                entry(s1, agent_session_id="ag-1", name="early"),
                entry(s2, agent_session_id="ag-2"),
                entry(s1, agent_session_id="ag-1", name="late"),
                entry(s3, agent_session_id="ag-2"),
            ],
            removed=[old, new_id()],
        )
        assert result == {"written": 2, "removed": 1, "dropped": [s2], "relinked": 0}
        rows = c.fleet_list()["sessions"]
        assert [row["session_id"] for row in rows] == [keep, s1, s3]
        assert rows[1]["name"] == "late"
        with pytest.raises(NotFound):
            c.fleet_get(s2)

        # A write replaces the whole row: fields left out are cleared.
        assert c.fleet_write([entry(keep, cwd="/new")]) == {
            "written": 1,
            "removed": 0,
            "dropped": [],
            "relinked": 0,
        }
        assert c.fleet_get(keep)["cwd"] == "/new"

        # Parent chains are flattened to one level.
        a, b, d = new_id(), new_id(), new_id()
        linked = c.fleet_write([entry(a), entry(b, parent=a), entry(d, parent=b)])
        assert linked == {"written": 3, "removed": 0, "dropped": [], "relinked": 1}
        assert c.fleet_get(d)["parent"] == a

        # A stored row holding an agent session id that the write does not mention:
        # conflict.
        with pytest.raises(Conflict) as info:
            c.fleet_write([entry(new_id(), agent_session_id="ag-1")])
        assert info.value.data == {"agent_session_id": "ag-1", "session_id": s1}
        with pytest.raises(BadArgs):
            c.fleet_write([entry(a)], removed=[a])
        assert c.status()["sessions"] == 6


def test_fleet_import_legacy(daemon):
    """Legacy entries get minted ids and mapped parents; bad ones skipped by index."""
    with daemon.client() as c:
        existing = c.session_register(cwd="/e", agent="a", agent_session_id="legacy-0")
        result = c.fleet_import_legacy(
            [
                {
                    "agentSessionID": "legacy-1",
                    "cwd": "/one",
                    "agent": "claude",
                    "pinned": True,
                },
                {
                    "agentSessionID": "legacy-2",
                    "cwd": "/two",
                    "agent": "claude",
                    "parent": "legacy-1",
                    "lastAttachedAt": 42,
                },
                7,
                {"cwd": "/no-id", "agent": "claude"},
                {"agentSessionID": "legacy-0", "cwd": "/dup", "agent": "claude"},
            ]
        )
        assert result["imported"] == 2
        assert result["skipped"] == 3
        assert [skip["index"] for skip in result["skips"]] == [2, 3, 4]
        assert result["skips"][2]["agent_session_id"] == "legacy-0"
        assert existing["session_id"] in result["skips"][2]["reason"]
        assert [s["agent_session_id"] for s in result["sessions"]] == [
            "legacy-1",
            "legacy-2",
        ]
        one, two = (s["session_id"] for s in result["sessions"])
        row_one, row_two = c.fleet_get(one), c.fleet_get(two)
        assert (row_one["cwd"], row_one["pinned"], row_one["agent_session_id"]) == (
            "/one",
            True,
            "legacy-1",
        )
        assert (row_two["parent"], row_two["last_attached_at"]) == (one, 42)

        # Importing the same file again imports nothing new.
        again = c.fleet_import_legacy([{"agentSessionID": "legacy-1", "cwd": "/1", "agent": "a"}])
        assert again["imported"] == 0 and again["skipped"] == 1
        assert c.status()["sessions"] == 3
        with pytest.raises(BadArgs):
            c.call("fleet.import_legacy", {"entries": "not a list"})


def test_fleet_adopt_refusals(daemon):
    """fleet.adopt of the own id is bad_args; of an unrecorded id, not_found."""
    with daemon.client() as c:
        with pytest.raises(BadArgs) as own:
            c.fleet_adopt(c.hello["daemon_id"])
        assert own.value.code == "bad_args"
        with pytest.raises(NotFound) as unknown:
            c.fleet_adopt("no-such-daemon")
        assert "no-such-daemon" in unknown.value.message
        assert unknown.value.data == {"daemon_id": "no-such-daemon"}
        with pytest.raises(BadArgs):
            c.fleet_adopt("")


def test_fleet_adopt_takes_over_foreign_rows(daemon):
    """Another daemon's rows are stale_epoch until adopted, then ours; on the embedded
    store they are also invisible until then."""
    with daemon.client() as c:
        ours = c.session_register(cwd="/ours", agent="a")["session_id"]
    assert daemon.stop() == 0
    foreign = plant_foreign_rows(daemon.state_dir, "gone-daemon", 2, store=daemon.store)
    start_declaring(daemon)
    with daemon.client() as c:
        assert c.hello["owner_epoch"] == 2
        own = c.hello["daemon_id"]
        assert [row["session_id"] for row in c.iter_fleet(daemon_id=own)] == [ours]
        if daemon.backend == "postgresql":
            # A store several boxes share shows every box's rows by default (README
            # "Several boxes", "One fleet"), each with its daemon id.
            assert [row["session_id"] for row in c.iter_fleet()] == [ours, *foreign]
            assert c.fleet_get(foreign[0])["daemon_id"] == "gone-daemon"
        else:
            assert [row["session_id"] for row in c.iter_fleet()] == [ours]
            with pytest.raises(NotFound):
                c.fleet_get(foreign[0])
        with pytest.raises(StaleEpoch) as stale:
            c.session_update(foreign[0], name="mine now")
        assert stale.value.data["owner_daemon_id"] == "gone-daemon"
        assert stale.value.data["daemon_id"] == c.hello["daemon_id"]

        wait_box_dead(daemon, "gone-daemon")  # PostgreSQL: only a dead box is adopted
        adopted = c.fleet_adopt("gone-daemon")
        assert adopted == {
            "adopted": 2,
            "from_daemon_id": "gone-daemon",
            "daemon_id": c.hello["daemon_id"],
            "owner_epoch": 2,
            "keys_adopted": 0,
            "keys_marked_unknown": 0,
            "keys_completed_from_evidence": 0,
        }
        assert [row["session_id"] for row in c.iter_fleet()] == [ours, *foreign]
        assert c.fleet_get(foreign[1])["owner_epoch"] == 2
        assert c.session_update(foreign[0], name="mine now")["name"] == "mine now"
        assert c.fleet_adopt("gone-daemon")["adopted"] == 0


# --- idempotency keys -----------------------------------------------------------------


def test_idem_claim_and_complete(daemon):
    """claim -> claimed; complete records; a later claim replays the stored result."""
    with daemon.client() as c:
        claimed = c.idem_claim("deploy", "k1", payload={"v": 1})
        assert claimed["state"] == "claimed"
        assert set(claimed) == {"state", "effect_ref"}
        record = c.idem_complete("deploy", "k1", {"url": "https://x"})
        assert set(record) == RECORD_KEYS
        assert (record["state"], record["result"], record["effect_ref"]) == (
            "completed",
            {"url": "https://x"},
            claimed["effect_ref"],
        )
        assert record["holder_pid"] == os.getpid()
        replay = c.idem_claim("deploy", "k1", payload={"v": 1})
        assert replay == {
            "state": "completed",
            "effect_ref": claimed["effect_ref"],
            "result": {"url": "https://x"},
        }
        # A repeat completion with the same result is a no-op; a different result is a
        # conflict.
        assert c.idem_complete("deploy", "k1", {"url": "https://x"}) == record
        with pytest.raises(Conflict):
            c.idem_complete("deploy", "k1", {"url": "https://y"})
        with pytest.raises(IdempotencyConflict) as conflict:
            c.idem_claim("deploy", "k1", payload={"v": 2})
        assert conflict.value.data == {
            "operation": "deploy",
            "key": "k1",
            "state": "completed",
        }
        with pytest.raises(IdempotencyKeyUnknown):
            c.idem_complete("deploy", "never-claimed", 1)


def test_idem_claim_variants(daemon):
    """A held key is in_progress; effect_ref, holder_pid and replay_only behave."""
    with daemon.client() as c:
        claimed = c.idem_claim("op", "held", effect_ref="ref-1", holder_pid=os.getpid())
        assert claimed == {"state": "claimed", "effect_ref": "ref-1"}
        with pytest.raises(IdempotencyInProgress) as info:
            c.idem_claim("op", "held")
        assert info.value.data == {
            "effect_ref": "ref-1",
            "holder_pid": os.getpid(),
            "held_by_caller": True,
        }
        with pytest.raises(IdempotencyKeyUnknown) as replay:
            c.idem_claim("op", "fresh", replay_only=True)
        assert replay.value.data == {"operation": "op", "key": "fresh"}
        with pytest.raises(IdempotencyKeyUnknown):
            c.idem_get("op", "fresh")  # replay_only recorded nothing
        with pytest.raises(BadArgs) as dead:
            c.idem_claim("op", "k", holder_pid=2**31 - 1)
        assert "holder_pid" in dead.value.message
        with pytest.raises(BadArgs) as bad_key:
            c.idem_claim("op", "")
        assert "`$.key`" in bad_key.value.message
        with pytest.raises(BadArgs) as bad_op:
            c.idem_claim("", "k")
        assert "`$.operation`" in bad_op.value.message
        with pytest.raises(BadArgs):
            c.idem_claim("op", "tab\there")


def test_idem_release(daemon):
    """release drops in_progress keys; completed never released, unknown refused."""
    with daemon.client() as c:
        c.idem_claim("op", "r")
        assert c.idem_release("op", "r") == {
            "operation": "op",
            "key": "r",
            "released": True,
        }
        with pytest.raises(IdempotencyKeyUnknown):
            c.idem_get("op", "r")
        assert c.idem_claim("op", "r")["state"] == "claimed"
        c.idem_complete("op", "r", 1)
        with pytest.raises(Conflict):
            c.idem_release("op", "r")
        c.idem_claim("op", "u")
        c.idem_mark_unknown("op", "u")
        with pytest.raises(OutcomeUnknown):
            c.idem_release("op", "u")
        with pytest.raises(IdempotencyKeyUnknown):
            c.idem_release("op", "nothing")


def test_idem_mark_unknown(daemon):
    """mark_unknown moves in_progress to outcome_unknown; claims then refuse."""
    with daemon.client() as c:
        claimed = c.idem_claim("op", "m")
        record = c.idem_mark_unknown("op", "m")
        assert (record["state"], record["effect_ref"]) == (
            "outcome_unknown",
            claimed["effect_ref"],
        )
        assert c.idem_mark_unknown("op", "m")["state"] == "outcome_unknown"
        with pytest.raises(OutcomeUnknown) as info:
            c.idem_claim("op", "m")
        assert info.value.data == {"effect_ref": claimed["effect_ref"]}
        # The claimant knows after all: completing from outcome_unknown is accepted.
        assert c.idem_complete("op", "m", "done")["state"] == "completed"
        with pytest.raises(Conflict):
            c.idem_mark_unknown("op", "m")
        with pytest.raises(IdempotencyKeyUnknown):
            c.idem_mark_unknown("op", "absent")


def test_idem_get(daemon):
    """get returns the full record; an unknown key is idempotency_key_unknown."""
    with daemon.client() as c:
        claimed = c.idem_claim("op", "g", payload=[1, 2])
        record = c.idem_get("op", "g")
        assert set(record) == RECORD_KEYS
        assert record["operation"] == "op" and record["key"] == "g"
        assert record["state"] == "in_progress"
        assert record["effect_ref"] == claimed["effect_ref"]
        assert record["result"] is None
        assert record["holder_pid"] == os.getpid()
        assert record["created_at"] == record["updated_at"]
        with pytest.raises(IdempotencyKeyUnknown) as info:
            c.idem_get("op", "missing")
        assert info.value.code == "idempotency_key_unknown"
        assert info.value.data == {"operation": "op", "key": "missing"}


def test_idem_list_filters_and_paging(daemon):
    """list filters by state/operation and pages with limit/cursor, in order."""
    with daemon.client() as c:
        for i in range(6):
            c.idem_claim("build" if i % 2 else "test", f"k{i}")
        c.idem_complete("test", "k0", 0)
        c.idem_complete("build", "k1", 1)
        c.idem_mark_unknown("test", "k2")
        keys = c.idem_list()
        assert [k["key"] for k in keys["keys"]] == [f"k{i}" for i in range(6)]
        assert keys["next_cursor"] is None
        assert [k["key"] for k in c.idem_list(state="completed")["keys"]] == [
            "k0",
            "k1",
        ]
        assert [k["key"] for k in c.idem_list(state="outcome_unknown")["keys"]] == ["k2"]
        assert [k["key"] for k in c.idem_list(state="in_progress")["keys"]] == [
            "k3",
            "k4",
            "k5",
        ]
        assert [k["key"] for k in c.idem_list(operation="build")["keys"]] == [
            "k1",
            "k3",
            "k5",
        ]
        assert [k["key"] for k in c.idem_list(operation="build", state="in_progress")["keys"]] == [
            "k3",
            "k5",
        ]

        first = c.idem_list(limit=4)
        assert [k["key"] for k in first["keys"]] == ["k0", "k1", "k2", "k3"]
        assert isinstance(first["next_cursor"], int)
        second = c.idem_list(limit=4, cursor=first["next_cursor"])
        assert [k["key"] for k in second["keys"]] == ["k4", "k5"]
        assert second["next_cursor"] is None
        assert [k["key"] for k in c.iter_keys(state="in_progress", page_size=1)] == [
            "k3",
            "k4",
            "k5",
        ]
        with pytest.raises(BadArgs) as info:
            c.idem_list(state="bogus")
        assert "`$.state`" in info.value.message


def test_idem_resolve(daemon):
    """resolve settles outcome_unknown keys only: completed records, abandoned frees."""
    with daemon.client() as c:
        c.idem_claim("op", "done")
        with pytest.raises(Conflict) as not_unknown:
            c.idem_resolve("op", "done", "completed")
        assert not_unknown.value.data == {
            "operation": "op",
            "key": "done",
            "state": "in_progress",
        }
        c.idem_mark_unknown("op", "done")
        resolved = c.idem_resolve("op", "done", "completed", {"checked": True})
        assert resolved["operation"] == "op" and resolved["key"] == "done"
        assert resolved["outcome"] == "completed"
        assert resolved["record"]["state"] == "completed"
        assert resolved["record"]["result"] == {"checked": True}
        assert c.idem_claim("op", "done")["result"] == {"checked": True}

        first = c.idem_claim("op", "gone")
        c.idem_mark_unknown("op", "gone")
        abandoned = c.idem_resolve("op", "gone", "abandoned")
        assert abandoned == {
            "operation": "op",
            "key": "gone",
            "outcome": "abandoned",
            "record": None,
        }
        with pytest.raises(IdempotencyKeyUnknown):
            c.idem_get("op", "gone")
        again = c.idem_claim("op", "gone")
        assert again["state"] == "claimed" and again["effect_ref"] != first["effect_ref"]

        with pytest.raises(BadArgs) as bad:
            c.idem_resolve("op", "gone", "maybe")
        assert "`$.outcome`" in bad.value.message
        with pytest.raises(IdempotencyKeyUnknown):
            c.idem_resolve("op", "never", "abandoned")


def test_principals_are_isolated(daemon):
    """Keys of principal 'a' are invisible to principal 'b' and vice versa."""
    with daemon.client(principal="a") as a, daemon.client(principal="b") as b:
        assert a.hello["principal"] == f"uid:{UID}:a"
        assert b.hello["principal"] == f"uid:{UID}:b"
        claim_a = a.idem_claim("op", "shared", payload="A")
        with pytest.raises(IdempotencyKeyUnknown):
            b.idem_get("op", "shared")
        assert b.idem_list()["keys"] == []
        claim_b = b.idem_claim("op", "shared", payload="B")  # no conflict: another scope
        assert claim_b["state"] == "claimed"
        assert claim_b["effect_ref"] != claim_a["effect_ref"]
        b.idem_complete("op", "shared", "b-result")
        assert a.idem_get("op", "shared")["state"] == "in_progress"
        a.idem_claim("op", "only-a")
        with pytest.raises(IdempotencyKeyUnknown):
            b.idem_release("op", "only-a")
        assert [k["key"] for k in a.idem_list()["keys"]] == ["shared", "only-a"]
        assert [(k["key"], k["state"]) for k in b.idem_list()["keys"]] == [("shared", "completed")]
        with daemon.client() as default:
            assert default.idem_list()["keys"] == []


# --- the client itself ----------------------------------------------------------------


def test_call_many_pipelines_in_order(daemon):
    """call_many answers each request in its slot, errors returned (not raised)."""
    with daemon.client() as c:
        outcomes = c.call_many(
            [
                ("ping", None),
                ("fleet.get", {"session_id": "00000000-0000-0000-0000-000000000000"}),
                ("no.such.method", {}),
                ("idem.list", {"limit": "ten"}),
                ("idem.claim", {"operation": "op", "key": "pipelined"}),
                ("idem.claim", {"operation": "op", "key": "pipelined"}),
                ("status", None),
            ]
        )
        assert len(outcomes) == 7
        assert outcomes[0]["pong"] is True
        assert type(outcomes[1]) is NotFound
        assert type(outcomes[2]) is UnknownMethod
        assert type(outcomes[3]) is BadArgs and "`$.limit`" in outcomes[3].message
        claims = outcomes[4:6]
        assert sorted(type(x).__name__ for x in claims) == [
            "IdempotencyInProgress",
            "dict",
        ]
        assert outcomes[6]["pid"] == daemon.pid
        big = c.call_many(
            [("idem.claim", {"operation": "many", "key": str(i)}) for i in range(200)]
        )
        assert [x["state"] for x in big] == ["claimed"] * 200
        assert len({x["effect_ref"] for x in big}) == 200
        assert c.ping()["pong"] is True


def test_one_exception_class_per_code():
    """Every wire code has its own TowerdError subclass in towerd.client."""
    classes = {}
    for code in ERROR_CODES:
        error = error_for_code(code, "msg", {"detail": code})
        assert error.code == code
        assert error.message == "msg" and error.data == {"detail": code}
        assert isinstance(error, TowerdError)
        assert getattr(client_module, type(error).__name__) is type(error)
        classes[code] = type(error)
    assert len(set(classes.values())) == len(ERROR_CODES) == 33
    unknown = error_for_code("from_the_future", "newer daemon", {"x": 1})
    assert type(unknown) is Internal
    assert unknown.data == {"x": 1, "code": "from_the_future"}


def test_daemon_errors_raise_their_class(daemon):
    """Errors the daemon sends arrive as the class of their code, with code and data."""
    with daemon.client() as c:
        with pytest.raises(UnknownMethod) as unknown:
            c.call("idem.explode")
        assert unknown.value.code == "unknown_method" and unknown.value.data is None
        with pytest.raises(Conflict) as again:
            c.call("hello", {"protocol": 1, "client": "again"})
        assert again.value.code == "conflict"
        with pytest.raises(BadArgs) as bad:
            c.call("fleet.list", {"limit": "x"})
        assert bad.value.message.endswith("at `$.limit`")
        assert c.ping()["pong"] is True  # the connection survived all of them


def test_unavailable_when_no_daemon(short_tmp):
    """A client at a socket nobody listens on raises Unavailable(reason=connect)."""
    path = short_tmp / "nobody.sock"
    with pytest.raises(Unavailable) as info:
        Client(path, timeout=2.0)
    assert info.value.code == "unavailable"
    assert info.value.data == {"socket": str(path), "reason": "connect"}


def test_closed_client_and_reconnect(daemon):
    """A closed client raises Unavailable(reason=closed); connect() says hello again."""
    c = daemon.client()
    c.close()
    with pytest.raises(Unavailable) as info:
        c.ping()
    assert info.value.data["reason"] == "closed"
    c.connect()
    try:
        assert c.ping()["pong"] is True
        assert c.hello["principal"] == f"uid:{UID}:default"
    finally:
        c.close()


def test_unavailable_after_daemon_stops(daemon):
    """A call on a connection whose daemon stopped raises Unavailable, not a hang."""
    c = daemon.client(timeout=5.0)
    try:
        assert daemon.stop() == 0
        with pytest.raises(Unavailable) as info:
            c.ping()
        assert info.value.data["reason"] in ("closed", "connection")
    finally:
        c.close()


def test_request_over_the_daemons_frame_limit_is_an_error(make_daemon):
    """A request refused as frame_too_large raises FrameTooLarge, never returns None."""
    small = make_daemon("small")
    small.extra_args = ["--max-frame", "4096"]
    small.start()
    with small.client() as c:
        assert c.hello["max_frame"] == 4096
        outcome: object = "not called"
        try:
            outcome = c.session_register(cwd="/w", agent="a", prompt="p" * 8000)
        except TowerdError as exc:
            outcome = exc
    with small.client() as c:
        assert c.status()["sessions"] == 0
    assert isinstance(outcome, FrameTooLarge), f"session_register returned {outcome!r}"


def test_request_over_the_default_frame_limit_is_frame_too_large(daemon):
    """An oversized request raises FrameTooLarge, not Unavailable ('retry it')."""
    with daemon.client() as c:
        with pytest.raises(TowerdError) as info:
            c.session_register(cwd="/w", agent="a", prompt="p" * (1024 * 1024))
    with daemon.client() as c:
        assert c.status()["sessions"] == 0
    assert type(info.value) is FrameTooLarge, repr(info.value)


def test_iter_fleet_of_rows_larger_than_one_frame(daemon):
    """iter_fleet yields every row even when a default page would exceed the limit."""
    with daemon.client() as c:
        ids = [
            c.session_register(cwd="/w", agent="a", result="r" * (100 * 1024))["session_id"]
            for _ in range(12)
        ]
        # 12 rows of 100 KiB exceed one frame: a page stops short, with a cursor.
        page = c.fleet_list()
        shown = [row["session_id"] for row in page["sessions"]]
        assert 0 < len(shown) < 12 and shown == ids[: len(shown)]
        assert page["next_cursor"] is not None
        assert [row["session_id"] for row in c.iter_fleet(page_size=5)] == ids
        assert c.ping()["pong"] is True
        assert [row["session_id"] for row in c.iter_fleet()] == ids


# --- run_once -------------------------------------------------------------------------


def test_run_once_runs_effect_once(daemon):
    """The first run_once runs the effect and returns its result; a repeat replays."""
    calls: list[str] = []

    def effect(effect_ref: str) -> dict:
        calls.append(effect_ref)
        return {"made": effect_ref}

    sock = str(daemon.socket_path)
    first = run_once("create", "job-1", effect, socket_path=sock, payload={"n": 1})
    assert len(calls) == 1
    assert first == {"made": calls[0]}
    second = run_once("create", "job-1", effect, socket_path=sock, payload={"n": 1})
    assert second == first
    assert len(calls) == 1
    with daemon.client() as c:
        record = c.idem_get("create", "job-1")
    assert (record["state"], record["effect_ref"], record["result"]) == (
        "completed",
        calls[0],
        first,
    )


def test_run_once_effect_not_started_releases(daemon):
    """EffectNotStarted releases the key, so a later run_once runs the effect afresh."""
    calls: list[str] = []
    sock = str(daemon.socket_path)

    def refuse(effect_ref: str) -> None:
        calls.append(effect_ref)
        raise EffectNotStarted("not now")

    with pytest.raises(EffectNotStarted):
        run_once("op", "later", refuse, socket_path=sock)
    assert len(calls) == 1
    with daemon.client() as c, pytest.raises(IdempotencyKeyUnknown):
        c.idem_get("op", "later")

    def work(effect_ref: str) -> str:
        calls.append(effect_ref)
        return "done"

    assert run_once("op", "later", work, socket_path=sock) == "done"
    assert len(calls) == 2
    assert run_once("op", "later", work, socket_path=sock) == "done"
    assert len(calls) == 2


def test_run_once_failed_effect_is_outcome_unknown(daemon):
    """An effect that raises leaves the key outcome_unknown; it never runs again."""
    calls: list[str] = []
    sock = str(daemon.socket_path)

    def crash(effect_ref: str) -> None:
        calls.append(effect_ref)
        raise RuntimeError("half done")

    with pytest.raises(RuntimeError, match="half done"):
        run_once("op", "risky", crash, socket_path=sock)
    assert len(calls) == 1
    with daemon.client() as c:
        assert c.idem_get("op", "risky")["state"] == "outcome_unknown"
    with pytest.raises(OutcomeUnknown) as info:
        run_once("op", "risky", crash, socket_path=sock)
    assert info.value.data == {"effect_ref": calls[0]}
    assert len(calls) == 1


def test_run_once_principal_scope(daemon):
    """run_once keys live in the given principal's scope."""
    sock = str(daemon.socket_path)
    assert run_once("op", "p", lambda ref: "a", socket_path=sock, principal="a") == "a"
    assert run_once("op", "p", lambda ref: "b", socket_path=sock, principal="b") == "b"
    assert run_once("op", "p", lambda ref: "again", socket_path=sock, principal="a") == "a"


def test_run_once_unavailable_without_daemon(short_tmp):
    """run_once gives up with Unavailable(reason=connect) without running the effect."""
    calls: list[str] = []
    with pytest.raises(Unavailable) as info:
        run_once(
            "op",
            "k",
            calls.append,
            socket_path=str(short_tmp / "none.sock"),
            attempts=2,
            backoff=0.01,
        )
    assert info.value.data["reason"] == "connect"
    assert calls == []
