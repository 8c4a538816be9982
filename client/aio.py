"""The async client, for long-running services on asyncio (or anyio on asyncio).

One connection, many concurrent callers: requests are pipelined, and answers are
routed to their callers by id straight from the connection's ``asyncio.Protocol``
(no reader task, no lock: ``transport.write`` never interleaves two frames). Open
it with ``async with AsyncClient.open(...) as client``. Not imported by
``towerd.client`` until first used, so hooks never pay for asyncio or anyio.

Why a Protocol and not anyio's socket stream: the stream registered and
unregistered the socket with the selector on every receive and took a lock and a
cancel scope per call, ~90 us of client CPU per request (py-spy, 64 tasks doing
claim + complete, bench/writes.py); the Protocol path costs a fraction of that.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import os
from asyncio import FIRST_COMPLETED
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

import anyio

from towerd.client.api import TowerdAPI
from towerd.client.idempotent import Call, Done, Outcome, idempotent_steps, next_step
from towerd.client.retry import PATIENT, UNREACHABLE, RetryPolicy
from towerd.client.sync import (
    DEFAULT_TIMEOUT,
    default_client_name,
    hello_params,
    request_limit,
    response_limit,
)
from towerd.client.trust import check_peer, check_socket_dir
from towerd.protocol import DEFAULT_MAX_FRAME, RESPONSE_SLACK, FrameDecoder
from towerd.protocol.envelope import FRAME_ERROR_ID, decode_frame, encode_request
from towerd.protocol.errors import Conflict, TowerdError, Unavailable
from towerd.protocol.lite import is_push, response_parts
from towerd.protocol.paths import default_socket_path

if TYPE_CHECKING:
    from collections.abc import Awaitable, Generator

    from towerd.client.effect import ClaimedEffect


MAX_QUEUED_PUSHES = 256  # unread changes held here; beyond, the daemon's queue fills

Answer = tuple[Any, TowerdError | None]  # (result, error) of one request


class _Link(asyncio.Protocol):
    """The socket on the loop: bytes in, each frame handed to the client at once."""

    def __init__(self, client: AsyncClient) -> None:
        self.client = client
        self.transport: asyncio.Transport | None = None
        self.drained: asyncio.Future[None] | None = None  # set while writing is paused

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.client._bytes_received(data)

    def eof_received(self) -> bool:
        return False  # close our side too: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        client = self.client
        if exc is None:
            error = Unavailable(
                f"towerd at {client.socket_path} closed the connection; a request in flight "
                "may or may not have been applied: retry it with the same idempotency key",
                {"socket": str(client.socket_path), "reason": "closed"},
            )
        else:
            error = Unavailable(
                f"lost towerd at {client.socket_path}: {exc!r}; the request may or may not "
                "have been applied: retry it with the same idempotency key",
                {"socket": str(client.socket_path), "reason": "connection"},
            )
        client._lose(error)

    def pause_writing(self) -> None:
        self.drained = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self.drained is not None and not self.drained.done():
            self.drained.set_result(None)
        self.drained = None


class AsyncClient(TowerdAPI):
    def __init__(
        self,
        socket_path: Path,
        timeout: float | None,
        client_name: str | None = None,
        principal: str | None = None,
    ) -> None:
        self.socket_path = socket_path
        self.timeout = timeout
        self.client_name = client_name or default_client_name()
        self.principal = principal
        self.hello: dict[str, Any] = {}
        self._link = _Link(self)
        self._loop = asyncio.get_running_loop()
        self._pending: dict[int, asyncio.Future[Answer]] = {}
        self._next_id = 0
        self._lost: TowerdError | None = None
        self._decoder = FrameDecoder(DEFAULT_MAX_FRAME + RESPONSE_SLACK)
        # Once watching: pushed frames (and the error that ends the watch) wait here.
        self._pushes: collections.deque[Any] | None = None
        self._push_arrived: asyncio.Future[None] | None = None
        self._reading_paused = False
        self._watch_id = 0

    @classmethod
    @asynccontextmanager
    async def open(
        cls,
        socket_path: str | os.PathLike[str] | None = None,
        *,
        timeout: float | None = DEFAULT_TIMEOUT,
        client_name: str | None = None,
        principal: str | None = None,
    ) -> AsyncIterator[AsyncClient]:
        path = Path(socket_path or default_socket_path())
        client = cls(path, timeout, client_name, principal)
        deadline = None if timeout is None else client._loop.time() + timeout
        await client._connect_verified(deadline)
        try:
            params = hello_params(client.client_name, principal)
            client.hello = await client._call("hello", params, _left(client._loop, deadline))
            client._decoder.max_frame = response_limit(client.hello)
            yield client
        finally:
            client._close()

    async def _connect_verified(self, deadline: float | None) -> None:
        """Connect, by ``deadline``, to this user's own daemon; nothing is sent yet."""
        path = str(self.socket_path)
        try:
            check_socket_dir(path)
            async with asyncio.timeout_at(deadline):
                await self._loop.create_unix_connection(lambda: self._link, path)
            assert self._link.transport is not None
            check_peer(self._link.transport.get_extra_info("socket"), path)
        except OSError as exc:  # TimeoutError included
            self._close()
            why = "timed out" if isinstance(exc, TimeoutError) else exc.strerror or exc
            raise Unavailable(
                f"cannot connect to towerd at {path}: {why}; is the daemon running?",
                {"socket": path, "reason": "connect"},
            ) from None
        except BaseException:
            self._close()
            raise

    def _close(self) -> None:
        """Fail whatever is pending and drop the socket at once (unsent bytes included:
        with a daemon that stopped reading, a graceful close would wait on it forever)."""
        self._lose(self._closed_error("this client is closed"))
        transport = self._link.transport
        if transport is not None:
            transport.abort()

    def _closed_error(self, why: str) -> Unavailable:
        return Unavailable(why, {"socket": str(self.socket_path), "reason": "closed"})

    async def call(self, method: str, params: Mapping[str, Any] | None = None) -> Any:
        """Send one request and wait for its answer, all within ``timeout``."""
        return await self._call(method, params, self.timeout)

    async def _call(
        self, method: str, params: Mapping[str, Any] | None, timeout: float | None
    ) -> Any:
        if self._lost is not None:
            raise self._lost
        self._next_id += 1
        request_id = self._next_id
        frame = encode_request(request_id, method, dict(params or {}), request_limit(self.hello))
        answer = self._pending[request_id] = self._loop.create_future()
        timer = None
        if timeout is not None:  # the whole call, a wait for a full socket included
            timer = self._loop.call_later(timeout, _time_out, answer)
        try:
            assert self._link.transport is not None
            self._link.transport.write(frame)
            while self._link.drained is not None and not answer.done():
                # The daemon is not reading: wait for the socket to drain, the answer, the
                # timeout or the end of the connection, whichever comes first.
                await asyncio.wait((self._link.drained, answer), return_when=FIRST_COMPLETED)
            result, error = await answer
        finally:
            if timer is not None:
                timer.cancel()
            self._pending.pop(request_id, None)
        if error is _TIMED_OUT:
            raise Unavailable(
                f"no answer from towerd within {timeout}s to {method}; the request may or "
                "may not have been applied: retry it with the same idempotency key",
                {"socket": str(self.socket_path), "reason": "timeout"},
            )
        if error is not None:
            raise error
        return result

    # --- answers (called by _Link on the loop) --------------------------------------------

    def _bytes_received(self, data: bytes) -> None:
        try:
            for frame in self._decoder.feed(data):
                self._frame_received(decode_frame(frame))
            if self._decoder.error is not None:
                raise self._decoder.error
        except Exception as exc:  # noqa: BLE001 - a bad frame ends the connection
            self._lose(self._closed_error(f"towerd sent a bad frame: {exc}"))
            if self._link.transport is not None:
                self._link.transport.abort()

    def _frame_received(self, value: Any) -> None:
        if self._is_watch_frame(value):
            self._queue_push(value if is_push(value) else response_parts(value)[2])
            return
        request_id, result, error = response_parts(value)
        if request_id == FRAME_ERROR_ID and error is not None:
            self._lose(error)  # about the connection itself; the daemon closes it
            return
        answer = self._pending.get(request_id)
        if answer is not None and not answer.done():
            answer.set_result((result, error))

    def _is_watch_frame(self, value: Any) -> bool:
        """A pushed change, or the error that ends the watch (``too_slow``), once the
        watch's own answer (the snapshot) has been delivered."""
        if self._pushes is None:
            return False
        return is_push(value) or (
            isinstance(value, dict)
            and value.get("id") == self._watch_id
            and self._watch_id not in self._pending
        )

    def _queue_push(self, item: Any) -> None:
        """Hold a watch frame for the watcher. With ``MAX_QUEUED_PUSHES`` unread, stop
        reading the socket: a consumer that falls behind is then told ``too_slow`` by the
        daemon, as any watcher is."""
        assert self._pushes is not None
        self._pushes.append(item)
        self._wake_watcher()
        if len(self._pushes) >= MAX_QUEUED_PUSHES and not self._reading_paused:
            self._reading_paused = True
            assert self._link.transport is not None
            self._link.transport.pause_reading()

    def _wake_watcher(self) -> None:
        if self._push_arrived is not None and not self._push_arrived.done():
            self._push_arrived.set_result(None)

    async def watch(self, topics: Sequence[str]) -> AsyncIterator[dict[str, Any]]:
        """The async twin of ``Client.watch``: the snapshot, then each pushed change.
        The connection serves no other request afterwards. A consumer that falls behind
        is dropped by the daemon and gets ``TooSlow`` after the changes already sent."""
        if self._pushes is not None:
            raise Conflict("this connection is already a watch subscription")
        pushes: collections.deque[Any] = collections.deque()
        self._pushes, self._watch_id = pushes, self._next_id + 1
        try:
            answer = await self.call("watch", {"topics": list(topics)})
        except BaseException:
            self._pushes = None
            raise
        try:
            yield answer
            while True:
                if not pushes:
                    if self._lost is not None:
                        raise self._lost
                    self._push_arrived = self._loop.create_future()
                    await self._push_arrived
                    continue
                value = pushes.popleft()
                if self._reading_paused and len(pushes) < MAX_QUEUED_PUSHES // 2:
                    self._reading_paused = False
                    if self._link.transport is not None:
                        self._link.transport.resume_reading()
                if isinstance(value, TowerdError):
                    raise value
                yield value
        finally:
            self._lose(self._closed_error("the watch was closed"))
            if self._link.transport is not None:
                self._link.transport.abort()

    def _lose(self, error: TowerdError) -> TowerdError:
        """The connection is over: every pending and later call fails with ``error``."""
        if self._lost is None:
            self._lost = error
            for answer in self._pending.values():
                if not answer.done():
                    answer.set_result((None, error))
            self._link.resume_writing()  # no caller waits on a socket that is gone
            self._wake_watcher()
        return self._lost

    def effect(
        self,
        run_id: str,
        step_id: str,
        action_kind: str,
        target_ref: str,
        *,
        payload: Any = None,
        attempt_id: str | None = None,
        heartbeat_interval: float | None = 30.0,
        lease_ttl_ms: int | None = None,
        timeout_ms: int | None = None,
    ) -> AbstractAsyncContextManager[ClaimedEffect]:
        """``async with client.effect(...) as fx:`` the async twin of ``Client.effect``;
        heartbeats run as a task on this connection."""
        from towerd.client.effect import EffectSpec, effect_async

        return effect_async(self, EffectSpec(
            run_id, step_id, action_kind, target_ref, payload, attempt_id, heartbeat_interval,
            lease_ttl_ms, timeout_ms,
        ))  # fmt: skip

    def reopened(self) -> AbstractAsyncContextManager[AsyncClient]:
        """A new connection like this one: same socket, timeout, name and principal."""
        return AsyncClient.open(
            self.socket_path,
            timeout=self.timeout,
            client_name=self.client_name,
            principal=self.principal,
        )

    async def iter_fleet(self, page_size: int | None = None) -> AsyncIterator[dict[str, Any]]:
        cursor = None
        while True:
            page = await self.fleet_list(limit=page_size, cursor=cursor)
            for row in page["sessions"]:
                yield row
            cursor = page.get("next_cursor")
            if cursor is None:
                return


class _TimedOut(TowerdError):
    code = "internal"


_TIMED_OUT = _TimedOut("timed out")


def _left(loop: asyncio.AbstractEventLoop, deadline: float | None) -> float | None:
    """Seconds left until ``deadline`` on ``loop``'s clock (at least 0: a timer fires)."""
    return None if deadline is None else max(0.0, deadline - loop.time())


def _time_out(answer: asyncio.Future[Answer]) -> None:
    if not answer.done():
        answer.set_result((None, _TIMED_OUT))


class AsyncDriver:
    """The async twin of :class:`~towerd.client.idempotent.SyncDriver`: carries out steps
    on the ``client`` given until it is lost, then on connections of its own (made by
    ``connect``, by default like the client given; closed with the driver): an
    ``AsyncClient`` cannot reconnect in place."""

    def __init__(
        self,
        policy: RetryPolicy = PATIENT,
        *,
        client: AsyncClient | None = None,
        connect: Callable[[], AbstractAsyncContextManager[AsyncClient]] | None = None,
    ) -> None:
        self.policy = policy
        self._client = client
        self._connect = connect or (client.reopened if client is not None else None)
        self._own = AsyncExitStack()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._own.aclose()

    async def connected(self) -> AsyncClient:
        if self._client is not None and self._client._lost is not None:
            await self._drop()
        if self._client is None:
            assert self._connect is not None, "a driver needs a client or a way to connect"
            self._client = await self._own.enter_async_context(self._connect())
        return self._client

    async def _drop(self) -> None:
        self._client = None
        await self._own.aclose()  # ours only: a client given is its owner's to close

    async def request(
        self,
        send: Callable[[AsyncClient], Awaitable[Any]],
        retried: tuple[type[TowerdError], ...] = UNREACHABLE,
        policy: RetryPolicy | None = None,
    ) -> Any:
        """``await send(client)``, sent again after a refusal in ``retried`` as the policy
        allows; a connection that answered ``Unavailable`` is not used again."""
        pauses = (policy or self.policy).pauses()
        while True:
            try:
                return await send(await self.connected())
            except TowerdError as exc:
                if isinstance(exc, Unavailable):
                    await self._drop()
                pause = next(pauses, None) if isinstance(exc, retried) else None
                if pause is None:
                    raise
                await anyio.sleep(pause)

    async def send(self, call: Call, policy: RetryPolicy | None = None) -> Any:
        return await self.request(
            lambda client: client.call(call.method, call.params), call.retried, policy
        )

    async def advance(
        self,
        steps: Generator[Any, Any, Any],
        value: Any = None,
        error: BaseException | None = None,
        *,
        policy: RetryPolicy | None = None,
    ) -> Any:
        """As ``SyncDriver.advance``: carry out calls until a hand-over or ``Done``."""
        while isinstance(step := next_step(steps, value, error), Call):
            value, error = await self._answer(step, policy)
        return step

    async def _answer(self, call: Call, policy: RetryPolicy | None) -> Outcome:
        try:
            return await self.send(call, policy), None
        except call.retried:
            raise  # the policy is spent
        except TowerdError as exc:
            return None, exc  # for the steps to handle

    async def drive(
        self, steps: Generator[Any, Any, Any], hand_over: Callable[[Any], Awaitable[Any]]
    ) -> Any:
        """Run ``steps`` to the end, answering each hand-over with ``await hand_over(step)``."""
        step = await self.advance(steps)
        while not isinstance(step, Done):
            try:
                value, error = await hand_over(step), None
            except BaseException as exc:  # noqa: BLE001 - handed to the protocol
                value, error = None, exc
            step = await self.advance(steps, value, error)
        return step.value


async def run_once_async(
    operation: str,
    key: str,
    effect: Callable[[str], Any],
    *,
    payload: Any = None,
    socket_path: str | None = None,
    principal: str | None = None,
    attempts: int | None = PATIENT.attempts,
    backoff: float = PATIENT.backoff,
    max_backoff: float = PATIENT.max_backoff,
    timeout: float | None = DEFAULT_TIMEOUT,
) -> Any:
    """The async twin of :func:`towerd.client.run_once`; ``effect`` may be sync or async."""

    async def run(step: Any) -> Any:
        result = effect(step.effect_ref)
        return await result if inspect.isawaitable(result) else result

    async with AsyncDriver(
        RetryPolicy(attempts, backoff, max_backoff),
        connect=lambda: AsyncClient.open(socket_path, timeout=timeout, principal=principal),
    ) as driver:
        return await driver.drive(idempotent_steps(operation, key, payload), run)
