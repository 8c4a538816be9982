"""``watch`` subscriptions against a real daemon: snapshots, pushed changes in commit
order, topic filters, the one-request rule, slow subscribers, the async client,
unsubscribing, a daemon killed mid-watch, and bounds under large state and slow
consumers (snapshots that fit a frame, the outbound cap, abandoned iterators).

Watchers are the real ``Client.watch`` / ``AsyncClient.watch``, or a raw socket
speaking the wire protocol through ``towerd.protocol.lite`` where the test must
decide when (and whether) the watcher reads. "No push" is always proved the same
way: a later write's push arrives with the very next ``seq``.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import anyio
import pytest

from towerd.client import (
    AsyncClient,
    BadArgs,
    Conflict,
    IdempotencyKeyUnknown,
    LeaseHeld,
    NotFound,
    StaleLease,
    TooSlow,
    TowerdError,
    Unavailable,
)
from towerd.protocol import DEFAULT_MAX_FRAME, PROTOCOL_VERSION, RESPONSE_SLACK, FrameDecoder, lite
from towerd_testing import Daemon, wait_for

pytestmark = pytest.mark.both_backends

ALL_TOPICS = ["fleet", "events", "idem", "leases", "effects", "dispatch"]
UID = os.geteuid()
PRINCIPAL = f"uid:{UID}:default"
SMALL_QUEUE = 65536  # --watch-max-queue for the slow-subscriber tests
BLOB = {"output": "x" * 4096}  # ~4 KiB per pushed event: a few dozen fill a small queue
WATCH_ID = 7  # the raw watchers' watch request id


def new_id() -> str:
    return str(uuid.uuid4())


# --- watchers ------------------------------------------------------------------------------


class RawWatcher:
    """hello then watch on a bare socket; reads only when the test says so."""

    def __init__(
        self,
        daemon: Daemon,
        topics: list[str] | None,
        watch_id: int = WATCH_ID,
        max_frame: int = DEFAULT_MAX_FRAME + RESPONSE_SLACK,
    ) -> None:
        """Says hello and, given ``topics``, watches them (else call ``watch`` later)."""
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(str(daemon.socket_path))
        self.sock.settimeout(10)
        self.decoder = FrameDecoder(max_frame)
        self.frames: list[bytes] = []
        self.watch_id = watch_id
        self.snapshot: dict[str, Any] = {}
        hello = {"protocol": PROTOCOL_VERSION, "client": "raw-watcher"}
        self.sock.sendall(lite.encode_request(1, "hello", hello))
        greeting = self.next()
        assert greeting is not None and greeting["id"] == 1 and "result" in greeting, greeting
        if topics is not None:
            self.watch(topics)
            self.read_snapshot()

    def watch(self, topics: list[str]) -> None:
        self.sock.sendall(lite.encode_request(self.watch_id, "watch", {"topics": topics}))

    def read_snapshot(self) -> dict[str, Any]:
        answer = self.next()
        assert answer is not None and answer["id"] == self.watch_id, answer
        assert answer["result"]["seq"] == 0, answer
        self.snapshot = answer["result"]["snapshot"]
        return self.snapshot

    def next(self) -> Any:
        """The next frame decoded, or None at end of stream (or a reset)."""
        while not self.frames:
            try:
                data = self.sock.recv(1 << 20)
            except ConnectionResetError:
                return None
            if not data:
                return None
            self.frames.extend(self.decoder.feed(data))
        return lite.decode_frame(self.frames.pop(0))

    def read_to_eof(self) -> list[Any]:
        values = []
        while (value := self.next()) is not None:
            values.append(value)
        return values

    def close(self) -> None:
        self.sock.close()


class Collector:
    """``Client.watch`` drained on a thread, so it keeps up while the test writes."""

    def __init__(self, daemon: Daemon, topics: list[str]) -> None:
        self.client = daemon.client()
        self.stream = self.client.watch(topics, idle_timeout=20)
        self.snapshot = next(self.stream)
        self.pushes: list[dict[str, Any]] = []
        self.error: TowerdError | None = None
        # Ends by itself when the daemon closes the connection (at teardown at the latest).
        self.thread = threading.Thread(target=self._drain, daemon=True)
        self.thread.start()

    def _drain(self) -> None:
        try:
            for push in self.stream:
                self.pushes.append(push)
        except TowerdError as exc:
            self.error = exc

    def wait_count(self, count: int, timeout: float = 15.0) -> list[dict[str, Any]]:
        wait_for(
            lambda: len(self.pushes) >= count or self.error is not None,
            timeout,
            f"{count} pushes (have {len(self.pushes)})",
        )
        assert self.error is None, self.error
        return self.pushes[:count]


def log_entries(daemon: Daemon) -> list[dict[str, Any]]:
    return [json.loads(line) for line in daemon.log().splitlines() if line.startswith("{")]


def assert_no_errors_logged(daemon: Daemon) -> None:
    bad = [e for e in log_entries(daemon) if e.get("level") in ("error", "critical")]
    assert not bad, bad
    assert "Traceback" not in daemon.log()


def too_slow_logged(daemon: Daemon) -> bool:
    return '"watcher_too_slow"' in daemon.log()


def expect(push: dict[str, Any], seq: int, topic: str, **fields: Any) -> dict[str, Any]:
    """``push`` is change ``seq`` of ``topic`` and its data has ``fields``; returns the data."""
    assert (push["event"], push["seq"]) == (topic, seq), push
    data = push["data"]
    for name, value in fields.items():
        assert data[name] == value, (name, push)
    return data


def expect_session(push: dict[str, Any], seq: int, session_id: str, **fields: Any) -> None:
    expect(push, seq, "fleet", op="upsert")
    row = push["data"]["session"]
    assert row["session_id"] == session_id, push
    for name, value in fields.items():
        assert row[name] == value, (name, push)


# --- snapshots -----------------------------------------------------------------------------


def test_snapshot_holds_each_topics_live_state_at_seq_0(daemon):
    """The watch answer is each chosen topic's current state (what needs attention or is
    in motion, not history) and seq 0."""
    c = daemon.client()
    parent = c.session_register(cwd="/repo", agent="claude", name="main")["session_id"]
    child = c.session_register(cwd="/repo", agent="claude", parent=parent)["session_id"]
    recorded = [
        c.event_record(kind, session_id=parent, payload={"n": n})
        for n, kind in enumerate(["SessionStart", "PreToolUse", "heartbeat", "Notification"])
    ]
    c.idem_claim("deploy", "done")
    c.idem_complete("deploy", "done", {"ok": True})
    in_progress = c.idem_claim("deploy", "running")
    unknown = c.idem_claim("deploy", "lost")
    c.idem_mark_unknown("deploy", "lost")
    held = c.lease_acquire("repo:main", ttl_ms=60_000)
    gone = c.lease_acquire("repo:gone", ttl_ms=60_000)
    c.lease_release("repo:gone", gone["fencing_token"])
    flying = c.effect_claim("run-1", "comment", "att-1", "webhook", "https://hooks/1")
    settled = c.effect_claim("run-1", "push", "att-1", "webhook", "https://hooks/2")
    c.effect_commit(settled["effect_key"], "att-1", {"status": 200})
    worker = c.worker_register("/repo", version="t")["worker_id"]
    token = c.lease_acquire("worker-lease:1", ttl_ms=60_000)["fencing_token"]
    dispatch = c.dispatch_claim(worker, "worker-lease:1", token, "task", "T1", "M1", "trace-1")

    answer = next(daemon.client().watch(ALL_TOPICS))
    assert answer["seq"] == 0
    snap = answer["snapshot"]
    assert set(snap) == set(ALL_TOPICS)

    fleet = snap["fleet"]
    assert fleet["truncated"] is False
    rows = {row["session_id"]: row for row in fleet["sessions"]}
    assert set(rows) == {parent, child}
    assert rows[parent]["name"] == "main" and rows[child]["parent"] == parent
    activity = {a["session_id"]: a for a in fleet["activity"]}
    assert activity[parent]["last_activity_at"] == recorded[-1]["at"]
    assert activity[parent]["last_kind"] == "Notification"
    assert activity[parent]["attention"] == "needs_you"

    trail = snap["events"]["events"]  # newest first, heartbeats kept out
    assert [e["event_id"] for e in trail] == [recorded[i]["event_id"] for i in (3, 1, 0)]
    assert [e["kind"] for e in trail] == ["Notification", "PreToolUse", "SessionStart"]
    assert trail[0]["session_id"] == parent and trail[0]["payload"] == {"n": 3}

    idem = snap["idem"]
    keys = {k["key"]: k for k in idem["keys"]}  # unsettled keys only
    assert set(keys) == {"running", "lost"}
    assert keys["running"]["state"] == "in_progress"
    assert keys["running"]["effect_ref"] == in_progress["effect_ref"]
    assert keys["lost"]["state"] == "outcome_unknown"
    assert keys["lost"]["effect_ref"] == unknown["effect_ref"]
    assert all(k["principal"] == PRINCIPAL for k in idem["keys"])
    assert idem["counts"] == {"in_progress": 1, "completed": 1, "outcome_unknown": 1}
    assert idem["truncated"] is False

    leases = {lease["resource"]: lease for lease in snap["leases"]["leases"]}  # live only
    assert set(leases) == {"repo:main", flying["lease_resource"], "worker-lease:1"}
    assert leases["repo:main"]["fencing_token"] == held["fencing_token"]
    assert leases["repo:main"]["holder_pid"] == os.getpid()

    effects = snap["effects"]["effects"]  # in flight or uncertain only
    assert [e["effect_key"] for e in effects] == [flying["effect_key"]]
    assert effects[0]["status"] == "in_flight" and effects[0]["run_id"] == "run-1"

    assert [d["dispatch_id"] for d in snap["dispatch"]["dispatches"]] == [dispatch["dispatch_id"]]
    assert snap["dispatch"]["dispatches"][0]["status"] == "claimed"
    assert [w["worker_id"] for w in snap["dispatch"]["workers"]] == [worker]

    # A subscription to some topics is answered with exactly those.
    only = next(daemon.client().watch(["idem", "leases"]))
    assert only["seq"] == 0 and set(only["snapshot"]) == {"idem", "leases"}
    assert only["snapshot"]["idem"] == idem and only["snapshot"]["leases"] == snap["leases"]


# --- live pushes ---------------------------------------------------------------------------


def test_pushes_arrive_in_commit_order_with_contiguous_seq_and_failed_writes_push_nothing(
    daemon,
):
    """One watcher of every topic sees each committed change once, in commit order, with
    seq 1, 2, 3, ...; a request that fails pushes nothing, even one whose store function
    noted a change before it failed (its savepoint rolled back)."""
    watcher = daemon.client()
    stream = watcher.watch(ALL_TOPICS, idle_timeout=10)
    assert next(stream)["seq"] == 0
    c = daemon.client()
    other = daemon.client(principal="other")  # another holder, for a refused lease
    seq = iter(range(1, 1000))

    sid = c.session_register(cwd="/repo", agent="claude", name="one")["session_id"]
    expect_session(next(stream), next(seq), sid, name="one", parent=None)
    child = c.session_register(cwd="/repo", agent="claude", parent=sid)["session_id"]
    expect_session(next(stream), next(seq), child, parent=sid)
    rival = c.session_register(cwd="/other", agent="codex", agent_session_id="agent-x")
    expect_session(next(stream), next(seq), rival["session_id"], agent_session_id="agent-x")

    with pytest.raises(NotFound):
        c.session_update(new_id(), name="nobody")
    # Rewrites the child's parent (a noted change), then fails on the agent session id.
    with pytest.raises(Conflict):
        c.session_update(sid, parent=rival["session_id"], agent_session_id="agent-x")
    c.session_update(sid, name="two")
    expect_session(next(stream), next(seq), sid, name="two", parent=None)

    event = c.event_record("Notification", session_id=sid, payload={"message": "hi"})
    expect(
        next(stream), next(seq), "events",
        event_id=event["event_id"], session_id=sid, kind="Notification", at=event["at"],
        payload={"message": "hi"},
    )  # fmt: skip

    lease = c.lease_acquire("repo:main", ttl_ms=60_000)
    expect(
        next(stream), next(seq), "leases",
        type="lease-granted", resource="repo:main", fencing_token=lease["fencing_token"],
        holder=lease["holder"], expires_at=lease["expires_at"],
    )  # fmt: skip
    with pytest.raises(LeaseHeld):
        other.lease_acquire("repo:main")

    claimed = c.idem_claim("deploy", "k1")
    expect(
        next(stream), next(seq), "idem",
        principal=PRINCIPAL, operation="deploy", key="k1", state="in_progress",
        effect_ref=claimed["effect_ref"],
    )  # fmt: skip
    c.idem_complete("deploy", "k1", {"ok": 1})
    record = expect(next(stream), next(seq), "idem", principal=PRINCIPAL)["record"]
    assert (record["key"], record["state"], record["result"]) == ("k1", "completed", {"ok": 1})
    with pytest.raises(IdempotencyKeyUnknown):
        c.idem_complete("deploy", "no-such-key")

    fx = c.effect_claim("run-1", "comment", "att-1", "webhook", "https://hooks/1")
    expect(next(stream), next(seq), "leases", type="lease-granted", resource=fx["lease_resource"])
    expect(next(stream), next(seq), "effects", effect_key=fx["effect_key"], status="in_flight")
    c.effect_commit(fx["effect_key"], "att-1", {"status": 200})
    expect(
        next(stream), next(seq), "effects",
        effect_key=fx["effect_key"], status="committed", receipt={"status": 200},
    )  # fmt: skip
    expect(
        next(stream), next(seq), "leases",
        type="lease-released", resource=fx["lease_resource"], reason="effect-settled",
    )  # fmt: skip

    worker = c.worker_register("/repo")["worker_id"]
    expect(next(stream), next(seq), "dispatch", type="worker-registered", worker_id=worker)
    token = c.lease_acquire("worker-lease:1", ttl_ms=60_000)["fencing_token"]
    expect(next(stream), next(seq), "leases", type="lease-granted", resource="worker-lease:1")
    with pytest.raises(StaleLease):
        c.dispatch_claim(worker, "worker-lease:1", token + 5, "task", "T1", "M1", "trace-1")
    dispatch = c.dispatch_claim(worker, "worker-lease:1", token, "task", "T1", "M1", "trace-1")
    expect(
        next(stream), next(seq), "dispatch",
        type="dispatch-claimed", dispatch_id=dispatch["dispatch_id"], unit_key="task/T1",
        worker_id=worker, fencing_token=token,
    )  # fmt: skip

    # A pipelined batch (one group commit) with failures between successes: only the
    # requests that succeeded push, in request order, with no seq skipped.
    record_a = ("event.record", {"kind": "A", "session_id": sid})
    record_b = ("event.record", {"kind": "B", "session_id": sid})
    record_c = ("event.record", {"kind": "C", "session_id": sid})
    outcomes = c.call_many(
        [
            record_a,
            ("session.update", {"session_id": new_id(), "name": "nobody"}),
            ("session.update", {"session_id": sid, "parent": rival["session_id"],
                                "agent_session_id": "agent-x"}),
            record_b,
            ("idem.complete", {"operation": "deploy", "key": "no-such-key"}),
            record_c,
        ]
    )  # fmt: skip
    assert [type(o) for o in outcomes[1:3]] == [NotFound, Conflict]
    assert isinstance(outcomes[4], IdempotencyKeyUnknown)
    for outcome, kind in zip([outcomes[0], outcomes[3], outcomes[5]], "ABC", strict=True):
        expect(next(stream), next(seq), "events", event_id=outcome["event_id"], kind=kind)

    # Nothing else was pushed: the next change is the next seq.
    last = c.event_record("Stop", session_id=sid)
    expect(next(stream), next(seq), "events", event_id=last["event_id"], kind="Stop")


def test_a_topic_filter_keeps_other_topics_away(daemon):
    """A watcher of ["leases"] gets lease changes only: fleet, events, idem, effects and
    dispatch writes in between push nothing to it."""
    stream = daemon.client().watch(["leases"], idle_timeout=10)
    assert set(next(stream)["snapshot"]) == {"leases"}
    c = daemon.client()
    first = c.lease_acquire("a", ttl_ms=60_000)
    sid = c.session_register(cwd="/repo", agent="claude")["session_id"]
    c.session_update(sid, name="renamed")
    c.event_record("Stop", session_id=sid)
    c.idem_claim("op", "k")
    c.idem_complete("op", "k")
    c.worker_register("/repo")
    c.lease_release("a", first["fencing_token"])
    expect(next(stream), 1, "leases", type="lease-granted", resource="a")
    expect(next(stream), 2, "leases", type="lease-released", resource="a")
    c.lease_acquire("b", ttl_ms=60_000)
    expect(next(stream), 3, "leases", type="lease-granted", resource="b")


def test_a_watching_connection_answers_any_other_request_with_conflict(daemon):
    """Once watching, a connection serves no request (another watch included): each is
    answered ``conflict`` and the subscription goes on as it was."""
    watcher = daemon.client()
    stream = watcher.watch(["leases"], idle_timeout=10)
    assert next(stream)["seq"] == 0
    with pytest.raises(Conflict, match="watch subscription"):
        watcher.ping()
    outcomes = watcher.call_many(
        [
            ("fleet.list", None),
            ("watch", {"topics": ["fleet"]}),
            ("lease.acquire", {"resource": "x"}),
        ]
    )
    assert [type(o) for o in outcomes] == [Conflict, Conflict, Conflict]

    c = daemon.client()
    c.session_register(cwd="/repo", agent="claude")  # not pushed: the watch of fleet was refused
    c.lease_acquire("y", ttl_ms=60_000)
    expect(next(stream), 1, "leases", type="lease-granted", resource="y")

    # A watch refused for its params leaves the connection an ordinary one.
    plain = daemon.client()
    with pytest.raises(BadArgs):
        plain.call("watch", {"topics": ["nonsense"]})
    with pytest.raises(BadArgs):
        plain.call("watch", {"topics": []})
    assert plain.ping()["pong"] is True


# --- slow subscribers ----------------------------------------------------------------------


def test_a_slow_watcher_is_sent_too_slow_and_dropped_without_slowing_anyone(make_daemon):
    """A watcher that stops reading is sent ``too_slow`` (with its watch id) once it is
    --watch-max-queue bytes behind, then disconnected; a watcher that reads gets every
    change, the writer stays fast, and the daemon keeps serving."""
    daemon = make_daemon().start("--watch-max-queue", str(SMALL_QUEUE))
    slow = RawWatcher(daemon, ["events"])  # never reads until the end
    normal = Collector(daemon, ["events"])
    writer = daemon.client()
    sid = writer.session_register(cwd="/repo", agent="claude")["session_id"]

    written: list[int] = []
    latencies: list[float] = []

    def write() -> None:
        started = time.perf_counter()
        written.append(writer.event_record("PostToolUse", session_id=sid, payload=BLOB)["event_id"])
        latencies.append(time.perf_counter() - started)

    while not too_slow_logged(daemon):
        assert len(written) < 2000, "the slow watcher was never dropped"
        write()
    dropped_after = len(written)

    # The slow watcher reads at last: what was queued, the error, end of stream.
    frames = slow.read_to_eof()
    *pushes, last = frames
    assert pushes, frames
    assert [p["seq"] for p in pushes] == list(range(1, len(pushes) + 1))
    assert [p["data"]["event_id"] for p in pushes] == written[: len(pushes)]
    assert len(pushes) < dropped_after
    assert last["id"] == WATCH_ID, last
    assert last["error"]["code"] == "too_slow", last
    assert last["error"]["data"]["seq"] == len(pushes)
    assert last["error"]["data"]["limit"] == SMALL_QUEUE
    assert last["error"]["data"]["queued_bytes"] > SMALL_QUEUE

    for _ in range(50):  # the daemon goes on
        write()
    received = normal.wait_count(len(written))
    assert [p["seq"] for p in received] == list(range(1, len(written) + 1))
    assert [p["data"]["event_id"] for p in received] == written
    assert max(latencies) < 1.0, max(latencies)
    assert daemon.client().ping()["pong"] is True
    warnings = [e for e in log_entries(daemon) if e.get("event") == "watcher_too_slow"]
    assert len(warnings) == 1 and warnings[0]["code"] == "too_slow"
    assert_no_errors_logged(daemon)


def test_a_stalled_watcher_under_its_queue_bound_is_kept_or_told_too_slow(make_daemon):
    """The spec bounds a watcher by --watch-max-queue: under it, a stalled watcher keeps
    its subscription; over it, it is told ``too_slow``. Never a silent cut."""
    send_timeout = 0.5
    daemon = make_daemon().start("--send-timeout", str(send_timeout))  # default 1 MiB queue
    slow = RawWatcher(daemon, ["events"])
    writer = daemon.client()
    sid = writer.session_register(cwd="/repo", agent="claude")["session_id"]
    count = 120  # ~500 KB of pushes: past the 256 KiB write buffer, well under 1 MiB
    for _ in range(count):
        writer.event_record("PostToolUse", session_id=sid, payload=BLOB)
    time.sleep(4 * send_timeout)  # the stall is the scenario: the watcher reads nothing
    frames = []
    while len(frames) < count and (value := slow.next()) is not None:
        frames.append(value)
    if len(frames) == count:  # kept: it got every change
        assert [f["seq"] for f in frames] == list(range(1, count + 1))
        return
    assert frames and frames[-1].get("error", {}).get("code") == "too_slow", (
        f"cut off after {len(frames)} of {count} pushes with no too_slow frame"
    )


# --- the async client ----------------------------------------------------------------------


@pytest.mark.anyio
async def test_async_watch_yields_the_snapshot_then_each_push(daemon):
    async with AsyncClient.open(daemon.socket_path) as watcher:
        stream = watcher.watch(["fleet", "events"])
        first = await stream.__anext__()
        assert first["seq"] == 0 and set(first["snapshot"]) == {"fleet", "events"}
        async with AsyncClient.open(daemon.socket_path) as c:
            sid = (await c.session_register(cwd="/repo", agent="claude"))["session_id"]
            event = await c.event_record("Stop", session_id=sid)
            await c.lease_acquire("not-watched", ttl_ms=60_000)
            await c.session_update(sid, name="n")
        expect_session(await stream.__anext__(), 1, sid)
        expect(await stream.__anext__(), 2, "events", event_id=event["event_id"], kind="Stop")
        expect_session(await stream.__anext__(), 3, sid, name="n")


@pytest.mark.anyio
async def test_async_watch_raises_too_slow_when_dropped(make_daemon):
    """While this task's event loop is blocked (the writes below are blocking calls), the
    async watcher reads nothing; once dropped, its iterator yields what was queued and
    then raises ``TooSlow``."""
    daemon = make_daemon().start("--watch-max-queue", str(SMALL_QUEUE))
    writer = daemon.client()
    sid = writer.session_register(cwd="/repo", agent="claude")["session_id"]
    async with AsyncClient.open(daemon.socket_path) as watcher:
        stream = watcher.watch(["events"])
        assert (await stream.__anext__())["seq"] == 0
        written = []
        while not too_slow_logged(daemon):
            assert len(written) < 2000, "the async watcher was never dropped"
            written.append(writer.event_record("Stop", session_id=sid, payload=BLOB)["event_id"])
        pushes = []
        with pytest.raises(TooSlow) as raised:
            async for push in stream:
                pushes.append(push)
        assert [p["seq"] for p in pushes] == list(range(1, len(pushes) + 1))
        assert [p["data"]["event_id"] for p in pushes] == written[: len(pushes)]
        assert 0 < len(pushes) < len(written)
        assert raised.value.data["seq"] == len(pushes)
    assert writer.ping()["pong"] is True


# --- ending a watch ------------------------------------------------------------------------


def open_sockets(pid: int) -> int:
    count = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            count += os.readlink(fd).startswith("socket:")
        except FileNotFoundError:
            pass  # closed while we looked
    return count


def test_closing_a_watcher_unsubscribes_it(daemon):
    """Watchers that close (cleanly, or with changes still unread) are dropped from the
    hub: later writes are answered, the remaining watcher gets each change, no error."""
    c = daemon.client()
    sid = c.session_register(cwd="/repo", agent="claude")["session_id"]
    baseline = open_sockets(daemon.pid)
    keeper = daemon.client().watch(["events"], idle_timeout=10)
    next(keeper)
    quitters = [daemon.client() for _ in range(3)]
    for quitter in quitters:
        next(quitter.watch(ALL_TOPICS))
    unread = RawWatcher(daemon, ["events", "fleet"])
    first = c.event_record("Stop", session_id=sid)
    for quitter in quitters:
        quitter.close()
    unread.close()  # with a push it never read
    wait_for(lambda: open_sockets(daemon.pid) == baseline + 1, what="the closed watchers released")

    ids = [first["event_id"]] + [
        c.event_record("Stop", session_id=sid, payload={"n": n})["event_id"] for n in range(20)
    ]
    c.session_update(sid, name="still fine")
    for n, event_id in enumerate(ids, start=1):
        expect(next(keeper), n, "events", event_id=event_id)
    assert_no_errors_logged(daemon)


def test_killing_the_daemon_ends_a_sync_watch_with_unavailable(daemon):
    watcher = daemon.client()
    stream = watcher.watch(ALL_TOPICS)
    assert next(stream)["seq"] == 0
    daemon.client().session_register(cwd="/repo", agent="claude")
    assert next(stream)["seq"] == 1
    daemon.kill9()
    with pytest.raises(Unavailable) as raised:
        next(stream)
    assert raised.value.data["reason"] in ("closed", "connection")


# --- the snapshot boundary -----------------------------------------------------------------


def test_the_first_push_is_the_change_right_after_the_snapshot(daemon):
    """Subscribing while writers commit: the snapshot plus the pushes hold each change
    exactly once, so each watcher's first pushed event is the one right after the newest
    in its snapshot. Rounds of 4 watchers subscribe at once, for 4 s, so their snapshots
    fall at many points of the writers' commit cycle."""
    sid = daemon.client().session_register(cwd="/repo", agent="claude")["session_id"]
    stop = threading.Event()

    def write() -> None:
        with daemon.client() as w:
            while not stop.is_set():
                w.call_many([("event.record", {"kind": "Stop", "session_id": sid})] * 8)

    writers = [threading.Thread(target=write) for _ in range(2)]
    for thread in writers:
        thread.start()
    try:
        wait_for(lambda: daemon.client().event_list(limit=1)["events"], what="a first event")
        deadline = time.monotonic() + 4
        subscriptions = 0
        while time.monotonic() < deadline:
            watchers = [RawWatcher(daemon, None) for _ in range(4)]
            for watcher in watchers:
                watcher.watch(["events"])
            for watcher in watchers:
                subscriptions += 1
                snapshot = watcher.read_snapshot()["events"]["events"]
                newest = max(e["event_id"] for e in snapshot)
                pushed = watcher.next()["data"]["event_id"]
                assert pushed == newest + 1, (
                    f"subscription {subscriptions}: the snapshot holds events up to "
                    f"{newest}, the first push is event {pushed}"
                )
                watcher.close()
    finally:
        stop.set()
        for thread in writers:
            thread.join(10)


def test_a_snapshot_that_cannot_fit_a_frame_is_refused_and_the_connection_goes_on(make_daemon):
    """A row stored under a larger --max-frame cannot fit the frame of a daemon restarted
    with a smaller one: the watch is answered `internal` naming the size, no subscription
    is left behind, and the same connection then serves a ping and another watch."""
    daemon = make_daemon()
    daemon.start()
    with daemon.client() as client:
        client.session_register(cwd="/big", agent="a", prompt="p" * 300_000)
    assert daemon.stop() == 0
    daemon.start("--max-frame", "65536")
    watcher = RawWatcher(daemon, None)
    try:
        watcher.watch(["fleet"])
        answer = watcher.next()
        assert answer["id"] == WATCH_ID and answer["error"]["code"] == "internal", answer
        assert "over the frame limit" in answer["error"]["message"]
        watcher.sock.sendall(lite.encode_request(8, "ping", {}))
        pong = watcher.next()
        assert pong["id"] == 8 and pong["result"]["pong"] is True, pong
        watcher.watch(["events"])
        assert watcher.read_snapshot() == {"events": {"events": []}}
    finally:
        watcher.close()
    assert daemon.proc.poll() is None


def test_a_watch_sent_with_eof_while_writes_commit_is_answered_before_the_close(daemon):
    """A peer that sends `watch` and at once half-closes its side: the daemon answers
    the snapshot, then closes, even when the watch had to wait for a write batch in
    flight (a waiting watch counts as a request in flight). Writers keep batches in
    flight the whole time; 60 rounds."""
    sid = daemon.client().session_register(cwd="/repo", agent="claude")["session_id"]
    stop = threading.Event()

    def write() -> None:
        with daemon.client() as w:
            while not stop.is_set():
                w.call_many([("event.record", {"kind": "Stop", "session_id": sid})] * 16)

    writers = [threading.Thread(target=write) for _ in range(2)]
    for thread in writers:
        thread.start()
    try:
        wait_for(lambda: daemon.client().event_list(limit=1)["events"], what="a first event")
        for round_ in range(60):
            watcher = RawWatcher(daemon, None)
            try:
                watcher.watch(["events"])
                watcher.sock.shutdown(socket.SHUT_WR)
                frames = watcher.read_to_eof()
                assert frames and frames[0]["id"] == WATCH_ID, (round_, frames[:1])
                assert "events" in frames[0]["result"]["snapshot"], (round_, frames[0])
            finally:
                watcher.close()
    finally:
        stop.set()
        for thread in writers:
            thread.join(10)
    assert_no_errors_logged(daemon)


LONG = "n" * 250  # a valid Name is up to 256 characters
RESOURCE = "r" * 1000  # a valid Resource is up to 1024


def claim_many_long_dispatches(daemon: Daemon, count: int) -> None:
    """``count`` active dispatches, every string field near its maximum length."""
    c = daemon.client()
    worker_id = c.worker_register(str(daemon.root))["worker_id"]
    token = c.lease_acquire(RESOURCE, ttl_ms=600_000)["fencing_token"]
    calls = [
        (
            "dispatch.claim",
            {
                "worker_id": worker_id,
                "lease_resource": RESOURCE,
                "fencing_token": token,
                "unit_type": LONG,
                "unit_id": f"{n:05d}{LONG}",
                "milestone_id": LONG,
                "trace_id": LONG,
                "slice_id": LONG,
                "task_id": LONG,
                "turn_id": LONG,
            },
        )  # fmt: skip
        for n in range(count)
    ]
    for start in range(0, count, 50):
        outcomes = c.call_many(calls[start : start + 50])
        bad = [o for o in outcomes if isinstance(o, TowerdError)]
        assert not bad, bad[:1]
    # The registering process is this test process: it stays alive, so they stay active.


# --- bounded under large state and slow consumers (found by review) ----------------------


def test_dispatch_watch_snapshot_always_fits_a_frame(daemon):
    claim_many_long_dispatches(daemon, 400)
    with daemon.client() as watcher:
        first = next(watcher.watch(["dispatch"]))
    snapshot = first["snapshot"]["dispatch"]
    assert snapshot["dispatches"], snapshot
    assert len(snapshot["dispatches"]) == 400 or snapshot.get("truncated") is True


def test_idem_watch_snapshot_always_fits_a_frame(make_daemon):
    daemon = make_daemon().start("--max-frame", "65536")
    c = daemon.client()
    calls = [
        ("idem.claim", {"operation": "o" * 120, "key": f"{n:05d}" + "k" * 240,
                        "effect_ref": "e" * 250})
        for n in range(500)
    ]  # fmt: skip
    for start in range(0, len(calls), 20):
        outcomes = c.call_many(calls[start : start + 20])
        assert not [o for o in outcomes if isinstance(o, TowerdError)], outcomes[:1]
    with daemon.client() as watcher:
        first = next(watcher.watch(["idem"]))
    assert first["snapshot"]["idem"]["keys"]


# --- the daemon's outbound cap vs --watch-max-queue ----------------------------------------


def test_a_watcher_under_a_large_watch_max_queue_is_never_cut_silently(make_daemon):
    daemon = make_daemon().start("--watch-max-queue", str(32 * 1024 * 1024))
    writer = daemon.client()
    sid = writer.session_register(cwd="/repo", agent="claude")["session_id"]
    raw = RawWatcher(daemon, None, max_frame=4 * (DEFAULT_MAX_FRAME + RESPONSE_SLACK))
    raw.watch(["events"])
    assert raw.next()["result"]["seq"] == 0
    blob = {"output": "x" * 60_000}
    count = 200  # ~12 MB of pushes: above 8 MiB, well under the 32 MiB queue bound
    for _ in range(count):
        writer.event_record("PostToolUse", session_id=sid, payload=blob)
    frames = []
    while len(frames) < count and (value := raw.next()) is not None:
        frames.append(value)
        if "error" in value:
            break
    if len(frames) == count:
        assert [f["seq"] for f in frames] == list(range(1, count + 1))
        return
    cut = [line for line in daemon.log().splitlines() if "peer_not_reading" in line]
    assert frames and frames[-1].get("error", {}).get("code") == "too_slow", (
        f"cut off after {len(frames)} of {count} pushes with no too_slow frame: {cut[:1]}"
    )


# --- the sync client's iterator ------------------------------------------------------------


def test_closing_a_sync_watch_iterator_releases_its_connection(daemon):
    c = daemon.client()
    baseline = open_sockets(daemon.pid)
    watcher = daemon.client()
    stream = watcher.watch(["events"])
    assert next(stream)["seq"] == 0
    stream.close()  # the caller is done watching (e.g. broke out of its loop)
    wait_for(
        lambda: open_sockets(daemon.pid) == baseline,
        timeout=3,
        what="the abandoned watch connection released",
    )
    assert c.ping()["pong"] is True


# --- the async client ----------------------------------------------------------------------


@pytest.mark.anyio
async def test_an_async_watcher_that_stops_consuming_is_bounded(make_daemon):
    queue = 65536
    daemon = make_daemon().start("--watch-max-queue", str(queue))
    blob = {"output": "x" * 4096}
    pushes = 0
    ending: BaseException | None = None
    async with AsyncClient.open(daemon.socket_path) as writer:
        sid = (await writer.session_register(cwd="/repo", agent="claude"))["session_id"]
        async with AsyncClient.open(daemon.socket_path) as watcher:
            stream = watcher.watch(["events"])
            assert (await stream.__anext__())["seq"] == 0
            # The consumer stops reading; the event loop keeps running (other tasks work).
            count = 1000  # ~4 MB of pushes, 60x the queue bound
            for _ in range(0, count, 50):
                with anyio.fail_after(30):
                    async with anyio.create_task_group() as tasks:
                        for _ in range(50):
                            tasks.start_soon(
                                lambda: writer.event_record("Stop", session_id=sid, payload=blob)
                            )
            try:
                with anyio.fail_after(30):
                    async for _push in stream:
                        pushes += 1
                        if pushes == count:
                            break
            except TowerdError as exc:
                ending = exc
    # Assertions outside the clients' task groups (they would wrap a failure in a group).
    assert isinstance(ending, TooSlow), f"got all {pushes} pushes and no too_slow ({ending!r})"
    assert pushes < count


@pytest.mark.anyio
async def test_a_refused_second_async_watch_leaves_the_first_one_working(daemon):
    push: Any = None
    refused: BaseException | None = None
    async with AsyncClient.open(daemon.socket_path) as writer:
        sid = (await writer.session_register(cwd="/repo", agent="claude"))["session_id"]
        async with AsyncClient.open(daemon.socket_path) as watcher:
            first = watcher.watch(["events"])
            assert (await first.__anext__())["seq"] == 0
            second = watcher.watch(["events"])
            try:
                await second.__anext__()
            except TowerdError as exc:  # this connection already watches
                refused = exc
            event = await writer.event_record("Stop", session_id=sid)
            with anyio.move_on_after(5):
                push = await first.__anext__()
    assert isinstance(refused, Conflict), refused
    assert push is not None, "the first watch never saw the change"
    assert push["seq"] == 1 and push["data"]["event_id"] == event["event_id"]
