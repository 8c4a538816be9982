"""The Unix-socket server: one task per connection, requests answered by id.

A connection's life: the kernel's peer credentials are checked before any
byte is read (another uid is told ``unauthorized`` and closed); the first
request must be ``hello``; after that, requests may be pipelined and each runs
in its own task, so one connection's writes share group commits. A frame
that cannot be a request (bad msgpack, a length prefix over the limit) gets
one error frame and the connection closes; bad params get ``bad_args`` and
the connection stays open.
"""

from __future__ import annotations

import os
import socket
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import msgspec
import structlog
from anyio.abc import SocketListener, SocketStream

from towerd.daemon.handlers import Caller, Handlers
from towerd.daemon.private_paths import StartRefused, ensure_private_dir
from towerd.daemon.processes import holder_of, peer_credentials
from towerd.protocol import DEFAULT_MAX_FRAME, PROTOCOL_VERSION, RESPONSE_SLACK, FrameDecoder
from towerd.protocol import methods as m
from towerd.protocol.envelope import (
    FRAME_ERROR_ID,
    MalformedRequest,
    Request,
    decode_request,
    encode_error,
    encode_result,
)
from towerd.protocol.errors import (
    BadArgs,
    BadFrame,
    FrameTooLarge,
    Internal,
    ProtocolMismatch,
    TowerdError,
    Unauthorized,
    Unavailable,
    UnknownMethod,
)

log = structlog.get_logger("towerd.server")

RECEIVE_SIZE = 65536
MAX_SOCKET_PATH = 107  # sun_path is 108 bytes including the terminating NUL
DEFAULT_PRINCIPAL = "default"

_PARAMS_DECODERS = {name: msgspec.msgpack.Decoder(spec.params) for name, spec in m.METHODS.items()}


def bind_private_socket(path: Path) -> socket.socket:
    """Listen on ``path`` inside a private directory, mode 0600 from the first instant.

    The caller holds the instance lock, so a socket file already there was
    left by a dead daemon and is replaced.
    """
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        raise StartRefused(
            f"socket path {path} is longer than {MAX_SOCKET_PATH} bytes; choose a shorter --socket"
        )
    ensure_private_dir(path.parent, "socket dir")
    try:
        info = path.lstat()
    except FileNotFoundError:
        pass
    else:
        if not stat.S_ISSOCK(info.st_mode):
            raise StartRefused(f"{path} exists and is not a socket; refusing to replace it")
        path.unlink()
        log.info("stale_socket_replaced", socket=str(path))
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    previous = os.umask(0o177)  # the socket is born 0600: no window where it is wider
    try:
        sock.bind(os.fspath(path))
    except OSError as exc:
        sock.close()
        raise StartRefused(f"cannot listen on {path}: {exc.strerror}") from None
    finally:
        os.umask(previous)
    sock.listen(1024)
    return sock


@dataclass(frozen=True)
class Limits:
    """What one peer may cost the daemon; see README "Configuration"."""

    max_frame: int = DEFAULT_MAX_FRAME
    max_connections: int = 1024
    frame_timeout: float = 10.0  # a frame that started must be complete within this
    send_timeout: float = 10.0  # a peer that does not read its replies for this long is dropped
    max_in_flight: int = 16  # requests per connection; then the daemon stops reading
    max_outbound_bytes: int = 8 * 1024 * 1024  # replies waiting to be sent; then drop the peer


class Server:
    def __init__(
        self,
        handlers: Handlers,
        *,
        limits: Limits = Limits(),
        on_disconnect: Callable[[Caller], None] = lambda caller: None,
    ) -> None:
        self.handlers = handlers
        self.limits = limits
        self._on_disconnect = on_disconnect
        self._readers: set[anyio.CancelScope] = set()
        self._connections = 0
        self._all_closed = anyio.Event()
        self._all_closed.set()
        self._stopping = False
        self._accepting: anyio.CancelScope | None = None

    @property
    def connections(self) -> int:
        return self._connections

    async def serve(
        self, listener: SocketListener, *, task_status: Any = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Accept until :meth:`drain`; each connection is handled in its own task."""
        async with anyio.create_task_group() as connections:
            with anyio.CancelScope() as self._accepting:
                async with listener:
                    task_status.started()
                    while True:
                        stream = await listener.accept()
                        connections.start_soon(self._connection, stream)

    async def drain(self, grace_seconds: float) -> None:
        """Stop accepting and reading; wait (bounded) for in-flight requests to be answered."""
        self._stopping = True
        if self._accepting is not None:
            self._accepting.cancel()
        for reader in list(self._readers):
            reader.cancel()
        with anyio.move_on_after(grace_seconds):
            await self._all_closed.wait()

    # --- one connection -----------------------------------------------------------------

    async def _connection(self, stream: SocketStream) -> None:
        self._connections += 1
        if self._connections == 1:
            self._all_closed = anyio.Event()
        try:
            async with stream:
                if self._connections > self.limits.max_connections:
                    await self._refuse_over_cap(stream)
                    return
                await self._serve_peer(stream)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            pass
        except Exception:  # a bug must cost one connection, never the daemon
            log.exception("connection_crashed", code="internal")
        finally:
            self._connections -= 1
            if self._connections == 0:
                self._all_closed.set()

    async def _refuse_over_cap(self, stream: SocketStream) -> None:
        limit = self.limits.max_connections
        log.warning("connection_refused", code="unavailable", connections=self._connections)
        refusal = Unavailable(
            f"towerd already serves {limit} connections (its limit); retry later",
            {"reason": "too_many_connections", "limit": limit},
        )
        with anyio.move_on_after(1.0):
            await stream.send(encode_error(FRAME_ERROR_ID, refusal))

    async def _serve_peer(self, stream: SocketStream) -> None:
        raw = stream.extra(anyio.abc.SocketAttribute.raw_socket)
        peer = peer_credentials(raw)
        if peer.uid != os.geteuid():
            log.warning("peer_refused", code="unauthorized", peer_uid=peer.uid, peer_pid=peer.pid)
            with anyio.move_on_after(1.0):
                await stream.send(
                    encode_error(FRAME_ERROR_ID, Unauthorized("towerd serves only its own user"))
                )
            return
        caller = Caller(principal="", pid=peer.pid, holder=holder_of(peer.pid))
        try:
            with structlog.contextvars.bound_contextvars(peer_pid=peer.pid):
                await self._serve_requests(stream, caller)
        finally:
            self._on_disconnect(caller)

    async def _serve_requests(self, stream: SocketStream, caller: Caller) -> None:
        limits = self.limits
        send_lock = anyio.Lock()
        in_flight = anyio.Semaphore(limits.max_in_flight)

        outbound = 0  # bytes of replies encoded but not yet sent

        async def send(frame: bytes) -> None:
            """Send one frame; a peer that stops reading is dropped, not buffered for."""
            nonlocal outbound
            if outbound + len(frame) > limits.max_outbound_bytes:
                log.warning(
                    "peer_not_reading", code="unavailable", outbound_bytes=outbound + len(frame)
                )
                connection.cancel()
                return
            outbound += len(frame)
            try:
                await _send_in_turn(frame)
            finally:
                outbound -= len(frame)

        async def _send_in_turn(frame: bytes) -> None:
            async with send_lock:
                with anyio.move_on_after(limits.send_timeout) as timer:
                    try:
                        await stream.send(frame)
                    except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                        connection.cancel()  # the peer left; it retries with its keys
                        return
                if timer.cancelled_caught:
                    log.warning(
                        "peer_not_reading", code="unavailable", send_timeout=limits.send_timeout
                    )
                    connection.cancel()

        decoder = FrameDecoder(limits.max_frame)
        with anyio.CancelScope() as connection:
            async with anyio.create_task_group() as requests:
                with anyio.CancelScope() as reader:
                    self._readers.add(reader)
                    if self._stopping:
                        reader.cancel()
                    try:
                        await self._read_requests(
                            stream, decoder, caller, send, requests, in_flight
                        )
                    finally:
                        self._readers.discard(reader)

    async def _read_requests(
        self,
        stream: SocketStream,
        decoder: FrameDecoder,
        caller: Caller,
        send: Callable[[bytes], Any],
        requests: anyio.abc.TaskGroup,
        in_flight: anyio.Semaphore,
    ) -> None:
        """Read frames until the peer leaves or must be closed; start a task per request."""
        frame_deadline: float | None = None
        while True:
            try:
                if frame_deadline is None:
                    data = await stream.receive(RECEIVE_SIZE)
                else:
                    with anyio.fail_after(max(0.0, frame_deadline - anyio.current_time())):
                        data = await stream.receive(RECEIVE_SIZE)
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                return
            except TimeoutError:
                timeout = self.limits.frame_timeout
                log.info("frame_refused", code="bad_frame", reason="incomplete", timeout=timeout)
                await send(
                    encode_error(
                        FRAME_ERROR_ID,
                        BadFrame(f"a frame was started but not completed within {timeout} s"),
                    )
                )
                return
            frames = decoder.feed(data)
            for frame in frames:
                try:
                    request = decode_request(frame)
                except MalformedRequest as exc:
                    log.info("frame_refused", code=exc.code, reason=exc.message)
                    await send(encode_error(exc.request_id, exc))
                    return
                if not caller.hello_done:
                    if not await self._hello(request, caller, send):
                        return
                    continue
                await in_flight.acquire()
                requests.start_soon(self._answer, request, caller, send, in_flight)
            if decoder.error is not None:
                log.info("frame_refused", code="frame_too_large", length=decoder.error.length)
                await send(encode_error(FRAME_ERROR_ID, FrameTooLarge(str(decoder.error))))
                return
            if not decoder.in_frame:
                frame_deadline = None
            elif frame_deadline is None or frames:
                frame_deadline = anyio.current_time() + self.limits.frame_timeout

    async def _hello(self, request: Request, caller: Caller, send: Callable[[bytes], Any]) -> bool:
        """Handle the first request; False closes the connection."""
        if request.method != "hello":
            error: TowerdError = Unauthorized(
                f"the first request on a connection must be hello, not {request.method!r}"
            )
        else:
            try:
                params = _decode_params("hello", request)
            except BadArgs as exc:
                error = exc
            else:
                if params.protocol != PROTOCOL_VERSION:
                    error = ProtocolMismatch(
                        f"client speaks protocol {params.protocol}, this daemon speaks protocol "
                        f"{PROTOCOL_VERSION}; restart the daemon (or update the client) so "
                        "both run the same towerd version",
                        {"client_protocol": params.protocol, "daemon_protocol": PROTOCOL_VERSION},
                    )
                else:
                    caller.principal = f"uid:{os.geteuid()}:{params.principal or DEFAULT_PRINCIPAL}"
                    result = await self.handlers.hello(caller, params)
                    caller.hello_done = True
                    structlog.contextvars.bind_contextvars(principal=caller.principal)
                    await send(encode_result(request.id, result))
                    return True
        log.info("hello_refused", code=error.code, reason=error.message)
        await send(encode_error(request.id, error))
        return False

    async def _answer(
        self,
        request: Request,
        caller: Caller,
        send: Callable[[bytes], Any],
        in_flight: anyio.Semaphore,
    ) -> None:
        started = time.perf_counter()
        code = None
        try:
            with structlog.contextvars.bound_contextvars(
                method=request.method, request_id=request.id
            ):
                try:
                    handler = self.handlers.table.get(request.method)
                    if handler is None:
                        raise UnknownMethod(f"unknown method {request.method!r}")
                    result = await handler(caller, _decode_params(request.method, request))
                    frame = encode_result(request.id, result)
                    if len(frame) > self.limits.max_frame + RESPONSE_SLACK:
                        raise Internal(
                            f"the result of {request.method} is {len(frame)} bytes, over the "
                            f"response limit of {self.limits.max_frame + RESPONSE_SLACK}"
                        )
                except TowerdError as exc:
                    code = exc.code
                    frame = encode_error(request.id, exc)
                    log.info("request_failed", code=code, reason=exc.message)
                except Exception as exc:  # a bug: answer, log, keep serving
                    code = "internal"
                    frame = encode_error(
                        request.id, Internal(f"internal error in {request.method}: {exc!r}")
                    )
                    log.exception("request_crashed", code=code)
                await send(frame)
                log.debug(
                    "request",
                    duration_ms=round((time.perf_counter() - started) * 1000, 3),
                    code=code,
                )
        finally:
            in_flight.release()


def _decode_params(method: str, request: Request) -> Any:
    try:
        return _PARAMS_DECODERS[method].decode(request.params)
    except msgspec.ValidationError as exc:
        raise BadArgs(f"invalid params for {method}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise BadArgs(f"undecodable params for {method}: {exc}") from None
    except RecursionError:
        raise BadArgs(f"params for {method} are nested too deeply to decode") from None
