"""Every RPC through the ``AsyncClient`` against a real daemon; pipelining; the
connection under a stopped, killed or slow daemon and cancelled callers."""

from __future__ import annotations

import os
import signal
import uuid

import anyio
import pytest

from towerd.client import (
    AsyncClient,
    BadArgs,
    Conflict,
    EffectNotStarted,
    FrameTooLarge,
    IdempotencyInProgress,
    IdempotencyKeyUnknown,
    NotFound,
    OutcomeUnknown,
    TowerdError,
    Unavailable,
    UnknownMethod,
    run_once_async,
)
from towerd_testing import db_location

pytestmark = [pytest.mark.anyio, pytest.mark.both_backends]
UID = os.geteuid()


def new_id() -> str:
    return str(uuid.uuid4())


async def test_hello_ping_status(daemon):
    """The async client says hello on open; ping and status answer as documented."""
    async with AsyncClient.open(daemon.socket_path, principal="svc") as c:
        assert c.hello["protocol"] == 1
        assert c.hello["principal"] == f"uid:{UID}:svc"
        assert c.hello["server"] == {"name": "towerd", "version": "0.1.0"}
        assert {"fleet", "idempotency", "leases", "effects"} <= set(c.hello["features"])
        assert c.hello["max_frame"] == 1024 * 1024
        pong = await c.ping()
        assert pong["pong"] is True and isinstance(pong["now"], int)
        status = await c.status()
        assert status["pid"] == daemon.pid
        assert status["daemon_id"] == c.hello["daemon_id"]
        assert status["owner_epoch"] == c.hello["owner_epoch"] == 1
        assert status["socket_path"] == str(daemon.socket_path)
        assert status["db_path"] == db_location(daemon)
        assert status["sessions"] == 0
        assert status["keys"] == {
            "in_progress": 0,
            "completed": 0,
            "outcome_unknown": 0,
        }


async def test_sessions_and_fleet(daemon):
    """Session and fleet methods (register..adopt) through the async client."""
    async with AsyncClient.open(daemon.socket_path) as c:
        first = (await c.session_register(cwd="/a", agent="claude", name="one"))["session_id"]
        again = await c.session_register(cwd="/b", agent="codex", idempotency_key="reg")
        assert await c.session_register(cwd="/b", agent="codex", idempotency_key="reg") == again
        second = again["session_id"]
        row = await c.session_update(first, name="uno", pinned=True)
        assert (row["name"], row["pinned"], row["cwd"]) == ("uno", True, "/a")
        assert await c.fleet_get(first) == row

        written_id = new_id()
        assert await c.fleet_write(
            [{"session_id": written_id, "cwd": "/w", "agent": "x", "parent": first}]
        ) == {"written": 1, "removed": 0, "dropped": [], "relinked": 0}
        imported = await c.fleet_import_legacy(
            [{"agentSessionID": "legacy", "cwd": "/l", "agent": "x"}, "junk"]
        )
        assert imported["imported"] == 1 and imported["skipped"] == 1
        legacy_id = imported["sessions"][0]["session_id"]

        page = await c.fleet_list(limit=2)
        assert [r["session_id"] for r in page["sessions"]] == [first, second]
        assert page["next_cursor"] is not None
        rows = [r["session_id"] async for r in c.iter_fleet(page_size=3)]
        assert rows == [first, second, written_id, legacy_id]

        assert await c.session_remove(second) == {"session_id": second, "removed": True}
        with pytest.raises(NotFound):
            await c.fleet_get(second)
        with pytest.raises(BadArgs):
            await c.fleet_adopt(c.hello["daemon_id"])
        with pytest.raises(NotFound):
            await c.fleet_adopt("never-seen")
        assert (await c.status())["sessions"] == 3


async def test_idempotency_methods(daemon):
    """idem.claim/complete/release/mark_unknown/get/list/resolve over async."""
    async with AsyncClient.open(daemon.socket_path) as c:
        claimed = await c.idem_claim("op", "a", payload={"x": 1})
        assert claimed["state"] == "claimed"
        with pytest.raises(IdempotencyInProgress) as held:
            await c.idem_claim("op", "a", payload={"x": 1})
        assert held.value.data["effect_ref"] == claimed["effect_ref"]
        done = await c.idem_complete("op", "a", [1, 2, 3])
        assert (done["state"], done["result"]) == ("completed", [1, 2, 3])
        assert await c.idem_claim("op", "a", payload={"x": 1}) == {
            "state": "completed",
            "effect_ref": claimed["effect_ref"],
            "result": [1, 2, 3],
        }

        await c.idem_claim("op", "b")
        assert await c.idem_release("op", "b") == {
            "operation": "op",
            "key": "b",
            "released": True,
        }
        with pytest.raises(IdempotencyKeyUnknown):
            await c.idem_get("op", "b")

        await c.idem_claim("op", "c")
        assert (await c.idem_mark_unknown("op", "c"))["state"] == "outcome_unknown"
        with pytest.raises(OutcomeUnknown):
            await c.idem_claim("op", "c")
        resolved = await c.idem_resolve("op", "c", "completed", "checked")
        assert resolved["record"]["result"] == "checked"
        assert (await c.idem_get("op", "c"))["state"] == "completed"

        await c.idem_claim("op", "d")
        listed = await c.idem_list()
        assert [(k["key"], k["state"]) for k in listed["keys"]] == [
            ("a", "completed"),
            ("c", "completed"),
            ("d", "in_progress"),
        ]
        assert [k["key"] for k in (await c.idem_list(state="in_progress"))["keys"]] == ["d"]
        paged = await c.idem_list(limit=2)
        rest = await c.idem_list(limit=2, cursor=paged["next_cursor"])
        assert [k["key"] for k in paged["keys"] + rest["keys"]] == ["a", "c", "d"]
        assert rest["next_cursor"] is None


async def test_daemon_errors_raise_their_class(daemon):
    """Daemon errors arrive as their class; the connection keeps serving afterwards."""
    async with AsyncClient.open(daemon.socket_path) as c:
        with pytest.raises(UnknownMethod) as unknown:
            await c.call("__class__")
        assert unknown.value.code == "unknown_method"
        with pytest.raises(BadArgs) as bad:
            await c.call("idem.list", {"limit": "many"})
        assert "`$.limit`" in bad.value.message
        with pytest.raises(NotFound) as missing:
            await c.fleet_get(new_id())
        assert missing.value.data is not None and "session_id" in missing.value.data
        with pytest.raises(Conflict):
            await c.call("hello", {"protocol": 1, "client": "twice"})
        assert (await c.ping())["pong"] is True


async def test_unavailable_without_daemon(short_tmp):
    """AsyncClient.open where nobody listens raises Unavailable(reason=connect)."""
    path = short_tmp / "absent.sock"
    with pytest.raises(Unavailable) as info:
        async with AsyncClient.open(path):
            pass
    assert info.value.data == {"socket": str(path), "reason": "connect"}


async def test_hundred_concurrent_calls_on_one_connection(daemon):
    """100 concurrent calls pipelined on one connection each get their own answer."""
    results: dict[int, object] = {}
    async with AsyncClient.open(daemon.socket_path) as c:

        async def one(i: int) -> None:
            if i % 4 == 0:
                results[i] = await c.ping()
            elif i % 4 == 1:
                results[i] = await c.idem_claim("pipe", f"k{i}", effect_ref=f"ref-{i}")
            elif i % 4 == 2:
                results[i] = await c.session_register(cwd=f"/p{i}", agent="a", name=f"n{i}")
            else:
                try:
                    await c.idem_get("pipe", f"missing-{i}")
                except IdempotencyKeyUnknown as exc:
                    results[i] = exc

        async with anyio.create_task_group() as tg:
            for i in range(100):
                tg.start_soon(one, i)

        assert len(results) == 100
        for i, result in results.items():
            if i % 4 == 0:
                assert result["pong"] is True
            elif i % 4 == 1:
                assert result == {"state": "claimed", "effect_ref": f"ref-{i}"}
            elif i % 4 == 2:
                assert (await c.fleet_get(result["session_id"]))["name"] == f"n{i}"
            else:
                assert result.data == {"operation": "pipe", "key": f"missing-{i}"}
        assert (await c.status())["sessions"] == 25


async def test_fifty_concurrent_claims_one_winner(daemon):
    """50 concurrent claims of one key from 50 connections: exactly one is 'claimed'."""
    outcomes: list[object] = []

    async def claimant() -> None:
        async with AsyncClient.open(daemon.socket_path) as c:
            try:
                outcomes.append(await c.idem_claim("race", "the-key", payload={"p": 1}))
            except TowerdError as exc:
                outcomes.append(exc)

    async with anyio.create_task_group() as tg:
        for _ in range(50):
            tg.start_soon(claimant)

    assert len(outcomes) == 50
    winners = [o for o in outcomes if isinstance(o, dict)]
    assert len(winners) == 1 and winners[0]["state"] == "claimed"
    losers = [o for o in outcomes if not isinstance(o, dict)]
    assert all(type(o) is IdempotencyInProgress for o in losers), losers
    assert {o.data["effect_ref"] for o in losers} == {winners[0]["effect_ref"]}


async def test_fifty_concurrent_claims_one_connection(daemon):
    """50 concurrent claims of one key on one connection: exactly one 'claimed'."""
    outcomes: list[object] = []
    async with AsyncClient.open(daemon.socket_path) as c:

        async def claim() -> None:
            try:
                outcomes.append(await c.idem_claim("race1", "k"))
            except TowerdError as exc:
                outcomes.append(exc)

        async with anyio.create_task_group() as tg:
            for _ in range(50):
                tg.start_soon(claim)
        assert len(outcomes) == 50
        assert sum(isinstance(o, dict) for o in outcomes) == 1
        assert sum(type(o) is IdempotencyInProgress for o in outcomes) == 49
        assert (await c.idem_get("race1", "k"))["state"] == "in_progress"


async def test_run_once_async_sync_and_async_effects(daemon):
    """run_once_async runs a sync or async effect once, then replays its result."""
    calls: list[str] = []
    sock = str(daemon.socket_path)

    def sync_effect(ref: str) -> str:
        calls.append(ref)
        return f"sync:{ref}"

    async def async_effect(ref: str) -> dict:
        await anyio.lowlevel.checkpoint()
        calls.append(ref)
        return {"async": ref}

    first = await run_once_async("op", "sync", sync_effect, socket_path=sock)
    assert first == f"sync:{calls[0]}"
    assert await run_once_async("op", "sync", sync_effect, socket_path=sock) == first
    assert len(calls) == 1

    second = await run_once_async("op", "async", async_effect, socket_path=sock, payload=[1])
    assert second == {"async": calls[1]}
    assert (
        await run_once_async("op", "async", async_effect, socket_path=sock, payload=[1]) == second
    )
    assert len(calls) == 2


async def raised_by(awaitable) -> BaseException | None:
    """The exception ``awaitable`` raised, if any (so state can be checked first)."""
    try:
        await awaitable
    except BaseException as exc:  # noqa: BLE001 - inspected by the caller
        return exc
    return None


async def test_run_once_async_effect_not_started_releases(daemon):
    """EffectNotStarted releases the key and reaches the caller as itself."""
    calls: list[str] = []
    sock = str(daemon.socket_path)

    async def not_started(ref: str) -> None:
        calls.append(ref)
        raise EffectNotStarted("later")

    raised = await raised_by(run_once_async("op", "k", not_started, socket_path=sock))
    async with AsyncClient.open(daemon.socket_path) as c:
        with pytest.raises(IdempotencyKeyUnknown):
            await c.idem_get("op", "k")
    assert (
        await run_once_async("op", "k", lambda ref: calls.append(ref) or "ok", socket_path=sock)
        == "ok"
    )
    assert len(calls) == 2
    assert type(raised) is EffectNotStarted, f"run_once_async raised {raised!r}"


async def test_run_once_async_failed_effect_is_outcome_unknown(daemon):
    """An effect's exception reaches the caller as itself; the key stays unknown."""
    calls: list[str] = []
    sock = str(daemon.socket_path)

    async def boom(ref: str) -> None:
        calls.append(ref)
        raise ValueError("boom")

    first = await raised_by(run_once_async("op", "bad", boom, socket_path=sock))
    async with AsyncClient.open(daemon.socket_path) as c:
        assert (await c.idem_get("op", "bad"))["state"] == "outcome_unknown"
    second = await raised_by(run_once_async("op", "bad", boom, socket_path=sock))
    assert len(calls) == 1  # never run again under the key
    assert type(first) is ValueError, f"run_once_async raised {first!r}"
    assert type(second) is OutcomeUnknown, f"run_once_async raised {second!r}"


async def test_error_leaving_the_client_block_is_not_wrapped(daemon):
    """A daemon error that escapes ``async with AsyncClient.open()`` keeps its class."""
    raised = None
    try:
        async with AsyncClient.open(daemon.socket_path) as c:
            await c.fleet_get(new_id())
    except BaseException as exc:  # noqa: BLE001 - inspected below
        raised = exc
    assert type(raised) is NotFound, f"escaped as {raised!r}"


async def test_hello_refusal_raises_its_class(daemon):
    """A hello refused for a bad principal raises BadArgs from AsyncClient.open."""
    raised = None
    try:
        async with AsyncClient.open(daemon.socket_path, principal=""):
            pass
    except BaseException as exc:  # noqa: BLE001 - inspected below
        raised = exc
    assert type(raised) is BadArgs, f"open raised {raised!r}"


async def test_oversized_request_is_frame_too_large(daemon):
    """An oversized request raises FrameTooLarge, never Unavailable ('retry it')."""
    # Whether the send fails first or the daemon's error frame is read first is a
    # race, so try it on twenty fresh connections: every one must say frame_too_large.
    outcomes = []
    for _ in range(20):
        async with AsyncClient.open(daemon.socket_path) as c:
            big = c.session_register(cwd="/w", agent="a", prompt="p" * (1024 * 1024))
            outcomes.append(await raised_by(big))
    async with AsyncClient.open(daemon.socket_path) as c:
        assert (await c.status())["sessions"] == 0
    wrong = [exc for exc in outcomes if type(exc) is not FrameTooLarge]
    assert not wrong, f"{len(wrong)} of 20 raised {wrong[0]!r}"


# --- the connection itself: timeouts, a lost daemon, cancelled callers, a full socket ---------


async def test_a_call_with_no_answer_times_out_and_the_connection_goes_on(daemon):
    """The daemon stopped (SIGSTOP): the call fails with Unavailable(reason=timeout)
    after the client's timeout; once the daemon runs again the same connection answers
    the next call (the late answer to the first is dropped, not given to anyone)."""
    async with AsyncClient.open(daemon.socket_path, timeout=0.3) as c:
        os.kill(daemon.pid, signal.SIGSTOP)
        try:
            with pytest.raises(Unavailable) as info:
                await c.idem_claim("timeout", "k1")
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
        assert info.value.data["reason"] == "timeout"
        assert (await c.idem_claim("timeout", "k2"))["state"] == "claimed"
        assert (await c.idem_get("timeout", "k1"))["state"] == "in_progress"  # it was applied


async def test_a_daemon_killed_mid_call_fails_every_pending_call_and_later_ones(daemon):
    async with AsyncClient.open(daemon.socket_path, timeout=30) as c:
        os.kill(daemon.pid, signal.SIGSTOP)
        outcomes: list[BaseException] = []

        async def call(i: int) -> None:
            try:
                await c.idem_claim("killed", f"k{i}")
            except Unavailable as exc:
                outcomes.append(exc)

        async with anyio.create_task_group() as tg:
            for i in range(5):
                tg.start_soon(call, i)
            await anyio.wait_all_tasks_blocked()
            daemon.kill9()
        # EOF or a reset, as the kernel closes the killed daemon's socket.
        assert len(outcomes) == 5
        assert {exc.data["reason"] for exc in outcomes} <= {"closed", "connection"}
        with pytest.raises(Unavailable):
            await c.ping()


async def test_a_cancelled_caller_leaves_the_connection_working(daemon):
    """A caller that gives up (cancel scope) while its request is in flight: its answer
    arrives later and goes nowhere; callers after it get their own answers."""
    async with AsyncClient.open(daemon.socket_path) as c:
        os.kill(daemon.pid, signal.SIGSTOP)
        try:
            with anyio.move_on_after(0.2) as scope:
                await c.idem_claim("cancelled", "k1")
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
        assert scope.cancelled_caught
        answers = [await c.idem_claim("cancelled", f"k{i}") for i in range(2, 6)]
        assert [a["state"] for a in answers] == ["claimed"] * 4
        assert (await c.ping())["pong"] is True


async def test_callers_wait_while_the_daemon_does_not_read_then_all_are_answered(daemon):
    """The daemon stopped: 64 concurrent ~200 KiB requests fill the socket and the
    transport's buffer, so callers wait for it to drain; once the daemon runs, every
    one is answered, each with its own result."""
    blob = "x" * 200_000
    async with AsyncClient.open(daemon.socket_path, timeout=60) as c:
        results: dict[int, dict] = {}

        async def claim(i: int) -> None:
            results[i] = await c.idem_claim("big", f"k{i}", payload=blob, effect_ref=f"r{i}")

        os.kill(daemon.pid, signal.SIGSTOP)
        try:
            async with anyio.create_task_group() as tg:
                for i in range(64):
                    tg.start_soon(claim, i)
                await anyio.wait_all_tasks_blocked()
                assert c._link.drained is not None, "the transport never paused writing"
                os.kill(daemon.pid, signal.SIGCONT)
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
        assert results == {i: {"state": "claimed", "effect_ref": f"r{i}"} for i in range(64)}


async def test_leaving_the_client_releases_callers_waiting_on_a_full_socket(daemon):
    """The daemon stopped; callers in an outer task group wait for the socket to drain
    when the `async with` block ends: each fails at once with Unavailable(closed)."""
    blob = "x" * 200_000
    reasons: list[str] = []

    async def claim(c: AsyncClient, i: int) -> None:
        try:
            await c.idem_claim("left", f"k{i}", payload=blob)
        except Unavailable as exc:
            reasons.append(exc.data["reason"])

    try:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                async with AsyncClient.open(daemon.socket_path, timeout=60) as c:
                    os.kill(daemon.pid, signal.SIGSTOP)
                    for i in range(64):
                        tg.start_soon(claim, c, i)
                    await anyio.wait_all_tasks_blocked()
                    assert c._link.drained is not None, "the transport never paused writing"
    finally:
        os.kill(daemon.pid, signal.SIGCONT)
    assert reasons == ["closed"] * 64


async def test_the_timeout_covers_a_call_waiting_on_a_full_socket(daemon):
    """With the daemon stopped, a call stuck behind a full socket still ends with
    Unavailable(timeout) after the client's timeout."""
    blob = "x" * 200_000
    reasons: list[str] = []
    async with AsyncClient.open(daemon.socket_path, timeout=0.5) as c:

        async def claim(i: int) -> None:
            try:
                await c.idem_claim("stuck", f"k{i}", payload=blob)
            except Unavailable as exc:
                reasons.append(exc.data["reason"])

        os.kill(daemon.pid, signal.SIGSTOP)
        try:
            with anyio.fail_after(10):
                async with anyio.create_task_group() as tg:
                    for i in range(64):
                        tg.start_soon(claim, i)
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
    assert reasons == ["timeout"] * 64
