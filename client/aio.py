"""The async client (anyio), for long-running services.

One connection, many concurrent callers: requests are pipelined and a reader
task routes each answer to its caller by id. Open it with
``async with AsyncClient.open(...) as client``. Not imported by
``towerd.client`` until first used, so hooks never pay for anyio.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
from anyio.abc import SocketStream

from towerd.client.api import TowerdAPI
from towerd.client.idempotent import RunEffect, idempotent_steps, retry_delay
from towerd.client.sync import DEFAULT_TIMEOUT, default_client_name, hello_params
from towerd.protocol import DEFAULT_MAX_FRAME, RESPONSE_SLACK, FrameDecoder, FrameTooLargeError
from towerd.protocol.envelope import FRAME_ERROR_ID, decode_frame, encode_request
from towerd.protocol.errors import Conflict, TowerdError, Unavailable
from towerd.protocol.lite import is_push, response_parts
from towerd.protocol.paths import default_socket_path

if TYPE_CHECKING:
    from towerd.client.effect import ClaimedEffect


MAX_QUEUED_PUSHES = 256  # unread changes held here; beyond, the daemon's queue fills


@dataclass(eq=False)
class _Pending:
    done: anyio.Event = field(default_factory=anyio.Event)
    result: Any = None
    error: TowerdError | None = None


class AsyncClient(TowerdAPI):
    def __init__(self, stream: SocketStream, socket_path: Path, timeout: float | None) -> None:
        self.socket_path = socket_path
        self.timeout = timeout
        self.hello: dict[str, Any] = {}
        self._stream = stream
        self._send_lock = anyio.Lock()
        self._pending: dict[int, _Pending] = {}
        self._next_id = 0
        self._lost: TowerdError | None = None
        self._decoder = FrameDecoder(DEFAULT_MAX_FRAME + RESPONSE_SLACK)
        # Pushed watch frames (and the error that ends a watch) go here once watching.
        self._pushes: Any = None
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
        try:
            stream = await anyio.connect_unix(path)
        except OSError as exc:
            raise Unavailable(
                f"cannot connect to towerd at {path}: {exc.strerror or exc}; "
                "is the daemon running?",
                {"socket": str(path), "reason": "connect"},
            ) from None
        failure: Exception | None = None
        async with stream, anyio.create_task_group() as tasks:
            client = cls(stream, path, timeout)
            tasks.start_soon(client._read_answers)
            try:
                client.hello = await client.call(
                    "hello", hello_params(client_name or default_client_name(), principal)
                )
                client._decoder.max_frame = (
                    max(DEFAULT_MAX_FRAME, int(client.hello["max_frame"])) + RESPONSE_SLACK
                )
                yield client
            except Exception as exc:  # noqa: BLE001 - re-raised below, unwrapped
                failure = exc
            finally:
                tasks.cancel_scope.cancel()
        if failure is not None:
            # Raised outside the task group, so callers catch the error itself, not
            # an ExceptionGroup around it.
            raise failure

    async def call(self, method: str, params: Mapping[str, Any] | None = None) -> Any:
        if self._lost is not None:
            raise self._lost
        self._next_id += 1
        request_id = self._next_id
        max_request = int(self.hello.get("max_frame", DEFAULT_MAX_FRAME))
        frame = encode_request(request_id, method, dict(params or {}), max_request)
        pending = self._pending[request_id] = _Pending()
        try:
            async with self._send_lock:
                await self._stream.send(frame)
            with anyio.fail_after(self.timeout):
                await pending.done.wait()
        except (OSError, anyio.BrokenResourceError, anyio.ClosedResourceError) as exc:
            raise self._lose(
                Unavailable(
                    f"lost towerd at {self.socket_path}: {exc!r}; the request may or may not "
                    "have been applied: retry it with the same idempotency key",
                    {"socket": str(self.socket_path), "reason": "connection"},
                )
            ) from None
        except TimeoutError:
            raise Unavailable(
                f"no answer from towerd within {self.timeout}s to {method}; the request may or "
                "may not have been applied: retry it with the same idempotency key",
                {"socket": str(self.socket_path), "reason": "timeout"},
            ) from None
        finally:
            self._pending.pop(request_id, None)
        if pending.error is not None:
            raise pending.error
        return pending.result

    async def _read_answers(self) -> None:
        reason = "towerd closed the connection"
        try:
            while True:
                data = await self._stream.receive(65536)
                for frame in self._decoder.feed(data):
                    value = decode_frame(frame)
                    if self._is_watch_frame(value):
                        if not await self._queue_push(value):
                            return  # the watch is over; so is this connection
                        continue
                    request_id, result, error = response_parts(value)
                    if request_id == FRAME_ERROR_ID and error is not None:
                        self._lose(error)  # about the connection itself; the daemon closes it
                        return
                    pending = self._pending.get(request_id)
                    if pending is None:
                        continue
                    pending.result, pending.error = result, error
                    pending.done.set()
                if self._decoder.error is not None:
                    raise self._decoder.error
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            pass
        except (FrameTooLargeError, TowerdError) as exc:
            reason = f"towerd sent a bad frame: {exc}"
        self._lose(Unavailable(reason, {"socket": str(self.socket_path), "reason": "closed"}))

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

    async def _queue_push(self, value: Any) -> bool:
        """Hand a watch frame to the watcher, waiting while ``MAX_QUEUED_PUSHES`` are
        unread: this connection then stops reading, so a consumer that falls behind is
        told ``too_slow`` by the daemon, as any watcher is. False once the consumer closed
        its iterator."""
        item = value if is_push(value) else response_parts(value)[2]
        try:
            await self._pushes.send(item)
            return True
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            self._lose(Unavailable("the watch was closed", {"reason": "closed"}))
            return False

    async def watch(self, topics: Sequence[str]) -> AsyncIterator[dict[str, Any]]:
        """The async twin of ``Client.watch``: the snapshot, then each pushed change.
        The connection serves no other request afterwards. A consumer that falls behind
        is dropped by the daemon and gets ``TooSlow`` after the changes already sent."""
        if self._pushes is not None:
            raise Conflict("this connection is already a watch subscription")
        send, receive = anyio.create_memory_object_stream[Any](max_buffer_size=MAX_QUEUED_PUSHES)
        self._pushes, self._watch_id = send, self._next_id + 1
        try:
            answer = await self.call("watch", {"topics": list(topics)})
        except BaseException:
            self._pushes = None
            send.close()
            receive.close()
            raise
        yield answer
        async with receive:
            while True:
                try:
                    value = await receive.receive()
                except (anyio.EndOfStream, anyio.ClosedResourceError):
                    raise self._lost or Unavailable("the watch ended") from None
                if isinstance(value, TowerdError):
                    raise value
                yield value

    def _lose(self, error: TowerdError) -> TowerdError:
        """The connection is over: every pending and later call fails with ``error``."""
        if self._lost is None:
            self._lost = error
            for pending in self._pending.values():
                pending.error = error
                pending.done.set()
            if self._pushes is not None:
                self._pushes.close()
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
        from towerd.client.effect import effect_async

        return effect_async(
            self, run_id, step_id, action_kind, target_ref,
            payload=payload, attempt_id=attempt_id, heartbeat_interval=heartbeat_interval,
            lease_ttl_ms=lease_ttl_ms, timeout_ms=timeout_ms,
        )  # fmt: skip

    async def iter_fleet(self, page_size: int | None = None) -> AsyncIterator[dict[str, Any]]:
        cursor = None
        while True:
            page = await self.fleet_list(limit=page_size, cursor=cursor)
            for row in page["sessions"]:
                yield row
            cursor = page.get("next_cursor")
            if cursor is None:
                return


async def run_once_async(
    operation: str,
    key: str,
    effect: Callable[[str], Any],
    *,
    payload: Any = None,
    socket_path: str | None = None,
    principal: str | None = None,
    attempts: int = 20,
    backoff: float = 0.1,
    max_backoff: float = 2.0,
    timeout: float | None = DEFAULT_TIMEOUT,
) -> Any:
    """The async twin of :func:`towerd.client.run_once`; ``effect`` may be sync or async."""
    steps = idempotent_steps(operation, key, payload)
    to_send: Any = None
    to_throw: BaseException | None = None
    failures = 0
    async with AsyncExitStack() as connection:
        client: AsyncClient | None = None
        while True:
            try:
                step = steps.throw(to_throw) if to_throw else steps.send(to_send)
            except StopIteration as finished:
                return finished.value
            to_send, to_throw = None, None
            if isinstance(step, RunEffect):
                try:
                    to_send = effect(step.effect_ref)
                    if inspect.isawaitable(to_send):
                        to_send = await to_send
                except BaseException as exc:  # noqa: BLE001 - handed to the protocol
                    to_throw = exc
                continue
            try:
                if client is None:
                    client = await connection.enter_async_context(
                        AsyncClient.open(socket_path, timeout=timeout, principal=principal)
                    )
                to_send = await client.call(step.method, step.params)
                failures = 0
            except Unavailable as exc:
                client = None
                await connection.aclose()
                failures += 1
                if failures >= attempts:
                    raise
                await anyio.sleep(retry_delay(failures, backoff, max_backoff))
                to_throw = exc
            except TowerdError as exc:
                to_throw = exc
