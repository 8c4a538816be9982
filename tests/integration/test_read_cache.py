"""fleet.get and idem.get are answered from a cache; they must never differ from the
store. Each read below is compared with the same row read through an uncached path
(fleet.list, idem.list) after every kind of write that can change it, including the
daemon's own: a dead holder's key turning outcome_unknown, expiry, adoption."""

from __future__ import annotations

import random
import subprocess
import sys

from towerd.client import IdempotencyKeyUnknown, NotFound
from towerd_testing import wait_for


def listed_row(client, session_id):
    return next((r for r in client.iter_fleet() if r["session_id"] == session_id), None)


def listed_key(client, operation, key):
    return next(
        (r for r in client.iter_keys() if (r["operation"], r["key"]) == (operation, key)), None
    )


def fleet_get(client, session_id):
    try:
        return client.fleet_get(session_id)
    except NotFound:
        return None


def idem_get(client, operation, key):
    try:
        return client.idem_get(operation, key)
    except IdempotencyKeyUnknown:
        return None


def test_cached_point_reads_match_the_store_through_random_writes(make_daemon):
    daemon = make_daemon().start("--completed-ttl", "0.3", "--expiry-interval", "0.2")
    rng = random.Random(20261129)
    with daemon.client() as c:
        sessions: list[str] = []
        keys: list[tuple[str, str]] = []
        for step in range(300):
            action = rng.choice(["register", "update", "remove", "parent", "claim",
                                 "complete", "release", "unknown", "resolve", "write"])  # fmt: skip
            try:
                if action == "register" or not sessions:
                    sessions.append(c.session_register(cwd="/w", agent="a")["session_id"])
                elif action == "update":
                    c.session_update(rng.choice(sessions), name=f"n{step}", pinned=step % 2 == 0)
                elif action == "remove":
                    c.session_remove(sessions.pop(rng.randrange(len(sessions))))
                elif action == "parent" and len(sessions) > 1:
                    child, parent = rng.sample(sessions, 2)
                    c.session_update(child, parent=parent)
                elif action == "write":
                    chosen = rng.sample(sessions, min(2, len(sessions)))
                    c.fleet_write([{"session_id": s, "cwd": "/x", "agent": "b"} for s in chosen])
                elif action == "claim" or not keys:
                    key = ("op", f"k{step}")
                    c.idem_claim(*key)
                    keys.append(key)
                else:
                    key = rng.choice(keys)
                    if action == "complete":
                        c.idem_complete(*key, {"step": step})
                    elif action == "release":
                        c.idem_release(*key)
                    elif action == "unknown":
                        c.idem_mark_unknown(*key)
                    elif action == "resolve":
                        c.idem_resolve(*key, "completed", {"resolved": step})
            except Exception as exc:  # noqa: BLE001 - refusals are part of the walk
                assert getattr(exc, "code", None) not in (None, "internal"), exc
            for session_id in rng.sample(sessions, min(3, len(sessions))):
                assert fleet_get(c, session_id) == listed_row(c, session_id), step
            for key in rng.sample(keys, min(3, len(keys))):
                assert_cached_key_matches(c, key, step)


def assert_cached_key_matches(client, key, step):
    """idem.get agrees with the listing read around it. The daemon's own expiry may
    delete the key between two calls (the listing then changes under the get): ask
    again until both listings agree, so only a stale cache fails."""
    for _ in range(10):
        before = listed_key(client, *key)
        cached = idem_get(client, *key)
        after = listed_key(client, *key)
        if before == after:
            assert cached == after, (step, key)
            return
    raise AssertionError(f"step {step}: {key} changed under every attempt")


def test_a_dead_holders_key_and_expiry_reach_cached_reads(make_daemon):
    daemon = make_daemon().start(
        "--holder-check-interval", "0.1", "--completed-ttl", "0.5", "--expiry-interval", "0.2"
    )
    with daemon.client() as c:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        try:
            c.idem_claim("op", "held", holder_pid=child.pid)
            assert c.idem_get("op", "held")["state"] == "in_progress"  # now cached
        finally:
            child.kill()
            child.wait()
        wait_for(lambda: listed_key(c, "op", "held")["state"] == "outcome_unknown",
                 what="the dead holder's key to turn outcome_unknown")  # fmt: skip
        assert c.idem_get("op", "held")["state"] == "outcome_unknown"
        c.idem_claim("op", "done")
        c.idem_complete("op", "done", {"ok": True})
        assert c.idem_get("op", "done")["state"] == "completed"  # cached
        wait_for(lambda: listed_key(c, "op", "done") is None, what="the key to expire")
        assert idem_get(c, "op", "done") is None
