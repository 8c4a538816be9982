"""Review findings against a real daemon (watch path, clients), and one on a real store
(retention of the dispatch ledger; kept here, not in tests/store, because test module
basenames must be unique in this suite's import mode). Each test asserts the guarantee
that should hold and is marked ``xfail(strict=True)`` while the bug stands:
once fixed, the test passes and strict xfail turns it red, so the mark is removed."""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from towerd.client import AsyncClient, Conflict, TooSlow, TowerdError
from towerd.daemon.processes import holder_of
from towerd.daemon.store import StoreConfig, dispatches, leases, open_store, retention, workers
from towerd.daemon.store.tx import Caller, Tx
from towerd.protocol import DEFAULT_MAX_FRAME, PROTOCOL_VERSION, RESPONSE_SLACK, FrameDecoder, lite
from towerd.protocol.errors import NotBefore
from towerd.protocol.methods import (
    DispatchClaimParams,
    DispatchFailParams,
    LeaseAcquireParams,
    WorkerIdParams,
    WorkerRegisterParams,
)
from towerd_testing import Daemon, wait_for

LONG = "n" * 250  # a valid Name is up to 256 characters
RESOURCE = "r" * 1000  # a valid Resource is up to 1024


class Raw:
    """hello, then raw frames; reads only when the test says so."""

    def __init__(self, daemon: Daemon) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(str(daemon.socket_path))
        self.sock.settimeout(10)
        self.decoder = FrameDecoder(4 * (DEFAULT_MAX_FRAME + RESPONSE_SLACK))
        self.frames: list[bytes] = []
        hello = {"protocol": PROTOCOL_VERSION, "client": "review"}
        self.send(1, "hello", hello)
        assert "result" in self.next(), "hello refused"

    def send(self, request_id: int, method: str, params: dict[str, Any]) -> None:
        self.sock.sendall(lite.encode_request(request_id, method, params))

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


def open_sockets(pid: int) -> int:
    count = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            count += os.readlink(fd).startswith("socket:")
        except FileNotFoundError:
            pass
    return count


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


# --- snapshot bounds -----------------------------------------------------------------------


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
    raw = Raw(daemon)
    raw.send(2, "watch", {"topics": ["events"]})
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


# --- the dispatch ledger on a real store (no daemon needed) ---------------------------------

ME = "alice"
DAY = 86_400_000


def at(shift_ms: int, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run on a Tx whose clock reads ``shift_ms`` later than the writer's."""

    def run(tx: Tx, *args: Any) -> Any:
        return fn(dataclasses.replace(tx, now=tx.now + shift_ms), *args)

    return run


@pytest.mark.anyio
async def test_retention_keeps_a_failed_dispatch_whose_retry_time_is_still_ahead(
    short_tmp: Path,
) -> None:
    live = holder_of(os.getpid())
    assert live is not None
    me = Caller(principal=ME, pid=live.pid, holder=live)
    lease = LeaseAcquireParams(RESOURCE, 600_000)
    async with open_store(StoreConfig(short_tmp / "state")) as store:
        registered = await store.write(
            workers.register, me, WorkerRegisterParams(project_root=str(short_tmp))
        )
        worker_id = registered.worker_id
        token = (await store.write(leases.acquire, me, lease)).fencing_token
        params = DispatchClaimParams(
            worker_id=worker_id, lease_resource=RESOURCE, fencing_token=token,
            unit_type="execute-task", unit_id="T01", milestone_id="M001", trace_id="t",
        )  # fmt: skip
        claimed = await store.write(dispatches.claim, me, params)
        failure = DispatchFailParams(
            dispatch_id=claimed.dispatch_id, worker_id=worker_id, fencing_token=token,
            error_code="E_RATE", error_summary="rate limited", retry_after_ms=10 * DAY,
        )  # fmt: skip
        failed = await store.write(dispatches.fail, me, failure)
        assert failed.next_run_at is not None

        # Two days later (retention 1 day): the retry is still 8 days away.
        later = 2 * DAY
        await store.write(at(later, retention.prune_history), DAY)
        await store.write(at(later, workers.heartbeat), me, WorkerIdParams(worker_id))
        new_token = (await store.write(at(later, leases.acquire), me, lease)).fencing_token
        again = msgspec.structs.replace(params, fencing_token=new_token)
        try:
            outcome: Any = await store.write(at(later, dispatches.claim), me, again)
        except TowerdError as exc:
            outcome = exc
    # Asserted outside the store's task group (it would wrap a failure in a group).
    assert isinstance(outcome, NotBefore), f"claimed 8 days early: {outcome!r}"
    assert outcome.data["next_run_at"] == failed.next_run_at
