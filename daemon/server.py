"""The Unix-socket server: an asyncio Protocol per connection, requests answered by id.

A connection's life: the kernel's peer credentials are checked before any
byte is read (another uid is told ``unauthorized`` and closed); the first
request must be ``hello``; after that, requests may be pipelined. A frame that
cannot be a request (bad msgpack, a length prefix over the limit, a frame left
unfinished) gets one error frame and the connection closes once its requests
in flight are answered; bad params get ``bad_args`` and the connection stays
open.

What one peer may cost is bounded (``Limits``): a connection must finish hello
within ``hello_timeout``; one process may hold ``max_connections_per_process``
of the ``max_connections``. Frames are dispatched one at a time, and the loop
stops at ``max_in_flight`` requests running or as soon as a reply waits in the
write buffer, i.e. the kernel's socket buffer is full (a synchronous answer is
never in flight, so the buffer must stop the loop too): the frames not yet
dispatched stay in the decoder, reading pauses, and dispatching resumes as
answers complete and the buffer drains. Unsent bytes are capped per connection,
a watcher's by its queue bound on every send. A peer's values (a method name)
are cut short when echoed in a message or a log line, and no error reply
exceeds the reply limit.

Why a Protocol and not anyio streams: measured here (bench/reads.py), anyio's
stream receive/send and a task per request cost ~100 us of daemon CPU per
ping, 25x an asyncio Protocol echo. Handlers answer at once when they can
(ping, point reads on the loop's own read connection); writes come back as
futures resolved by the group-commit writer, so no task is created for them
either. Only slow reads and operator methods run as tasks.
"""

from __future__ import annotations

import asyncio
import functools
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
import msgspec
import structlog

from towerd.daemon import stages
from towerd.daemon.bursts import AnswerBursts
from towerd.daemon.handlers import Caller, Handlers
from towerd.daemon.listen import BACKLOG
from towerd.daemon.processes import holder_of, peer_credentials
from towerd.daemon.spin import Spinner
from towerd.daemon.watch import Subscription, WatchHub
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
    Conflict,
    FrameTooLarge,
    Internal,
    ProtocolMismatch,
    TooSlow,
    TowerdError,
    Unauthorized,
    Unavailable,
    UnknownMethod,
)
from towerd.protocol.methods import WatchResult

log = structlog.get_logger("towerd.server")

DEFAULT_PRINCIPAL = "default"
DEFAULT_MAX_CONNECTIONS_PER_PROCESS = 128  # a hook or CLI needs 1-2; a service's pool a few dozen
# Replies wait in our buffer only once the kernel's socket buffer is full: the peer is
# that far behind. Then dispatch stops at once, and resumes when the buffer is empty.
WRITE_BUFFER_HIGH = 0
ECHO_LIMIT = 200  # characters of a peer's value (a method name) echoed in a message or log
LOG_REASON_LIMIT = 1000  # characters of an error message repeated in a log line

_PARAMS_DECODERS = m.PARAMS_DECODERS


@dataclass(frozen=True)
class Limits:
    """What one peer may cost the daemon; see README "Configuration"."""

    max_frame: int = DEFAULT_MAX_FRAME
    max_connections: int = 1024
    frame_timeout: float = 10.0  # a frame that started must be complete within this
    send_timeout: float = 10.0  # a peer that does not read its replies for this long is dropped
    max_in_flight: int = 16  # requests running per connection; then dispatch stops
    max_outbound_bytes: int = 8 * 1024 * 1024  # replies waiting to be sent; then drop the peer
    hello_timeout: float = 10.0  # a connection that has not said hello by then is closed
    max_connections_per_process: int = DEFAULT_MAX_CONNECTIONS_PER_PROCESS


class Server:
    def __init__(
        self,
        handlers: Handlers,
        *,
        limits: Limits = Limits(),
        on_disconnect: Callable[[Caller], None] = lambda caller: None,
        trace_requests: bool = False,
        watch_hub: WatchHub | None = None,
        spin_us: int = 0,
    ) -> None:
        self.handlers = handlers
        self.spinner = Spinner(spin_us)  # --spin-us: poll after an answer (0, the default: off)
        self.bursts = AnswerBursts()  # a pass's answers leave together (daemon/bursts.py)
        self.watch_hub = watch_hub or WatchHub()
        self.limits = limits
        # A debug line per request: its arguments cost ~2 us to build even when the
        # line is filtered out, so it is skipped unless logging at debug.
        self.trace_requests = trace_requests
        self.on_disconnect = on_disconnect
        self.connections: set[Connection] = set()
        self.per_process: dict[int, int] = {}  # peer pid -> its admitted connections
        self.draining = False
        self._all_closed = anyio.Event()
        self._all_closed.set()
        self._server: asyncio.AbstractServer | None = None

    async def serve(
        self, listening: socket.socket, *, task_status: Any = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Accept on ``listening`` until cancelled; :meth:`drain` first for a clean stop."""
        loop = asyncio.get_running_loop()
        # asyncio listens again with its own backlog (100 by default): bursts of
        # hooks connecting at once must not be refused.
        self._server = await loop.create_unix_server(
            lambda: Connection(self), sock=listening, backlog=BACKLOG
        )
        try:
            task_status.started()
            await anyio.sleep_forever()
        finally:
            self._server.close()
            for connection in list(self.connections):
                connection.transport.abort()

    async def drain(self, grace_seconds: float) -> None:
        """Stop accepting and reading; wait (bounded) for in-flight requests to be answered."""
        self.draining = True
        if self._server is not None:
            self._server.close()
        for connection in list(self.connections):
            connection.finish()
        with anyio.move_on_after(grace_seconds):
            await self._all_closed.wait()

    def opened(self, connection: Connection) -> None:
        if not self.connections:
            self._all_closed = anyio.Event()
        self.connections.add(connection)

    def closed(self, connection: Connection) -> None:
        self.connections.discard(connection)
        if not self.connections:
            self._all_closed.set()

    def admit_process(self, pid: int) -> bool:
        """Count one more connection of ``pid``; False (nothing counted) at the cap."""
        held = self.per_process.get(pid, 0)
        if held >= self.limits.max_connections_per_process:
            return False
        self.per_process[pid] = held + 1
        return True

    def release_process(self, pid: int) -> None:
        held = self.per_process.pop(pid, 0) - 1
        if held > 0:
            self.per_process[pid] = held


class Connection(asyncio.Protocol):
    """One peer: frames in, answers out, with the peer's limits enforced."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.limits = server.limits
        self.handlers = server.handlers
        self.transport: asyncio.Transport = None  # type: ignore[assignment]
        self.caller: Caller | None = None
        self.peer_pid: int | None = None  # set once counted against the per-process cap
        self.decoder = FrameDecoder(server.limits.max_frame)  # holds frames not yet dispatched
        self.reply_limit = server.limits.max_frame + RESPONSE_SLACK  # bytes of one answer
        self.in_flight = 0
        self.finishing = False  # no more requests: close once the in-flight ones are answered
        self.reading = True
        self.writing_blocked = False
        self.frame_timer: asyncio.TimerHandle | None = None
        self.send_timer: asyncio.TimerHandle | None = None
        self.hello_timer: asyncio.TimerHandle | None = None
        self.subscription: Subscription | None = None  # set once this peer sent ``watch``
        # None when --spin-us is 0 (the default): then an answer costs no call for it.
        self.spinner = server.spinner if server.spinner.window_s else None
        self.held: bytes | None = None  # an answer waiting for the end of the pass

    # --- asyncio.Protocol --------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.server.opened(self)
        if len(self.server.connections) > self.limits.max_connections:
            limit = self.limits.max_connections
            log.warning(
                "connection_refused", code="unavailable", connections=len(self.server.connections)
            )
            refusal = Unavailable(
                f"towerd already serves {limit} connections (its limit); retry later",
                {"reason": "too_many_connections", "limit": limit},
            )
            self.refuse(refusal)
            return
        try:
            peer = peer_credentials(transport.get_extra_info("socket"))
        except OSError as exc:
            self.refuse_unknown_peer(exc)
            return
        if peer.uid != os.geteuid():
            log.warning("peer_refused", code="unauthorized", peer_uid=peer.uid, peer_pid=peer.pid)
            self.refuse(Unauthorized("towerd serves only its own user"))
            return
        if not self.server.admit_process(peer.pid):
            self.refuse_process_over_cap(peer.pid)
            return
        self.peer_pid = peer.pid
        try:
            holder = holder_of(peer.pid)
        except OSError as exc:  # LivenessUnknown: /proc unreadable (EMFILE, say)
            self.refuse_unknown_peer(exc, peer.pid)
            return
        self.caller = Caller(principal="", pid=peer.pid, holder=holder)
        self.transport.set_write_buffer_limits(high=WRITE_BUFFER_HIGH, low=0)
        loop = asyncio.get_running_loop()
        self.hello_timer = loop.call_later(self.limits.hello_timeout, self.hello_timed_out)
        if self.server.draining:
            self.finish()

    def data_received(self, data: bytes) -> None:
        if self.finishing or self.caller is None:
            return
        trace = stages.TRACE
        if trace is not None:
            trace.last_read = stages.now_ns()
        if self.may_dispatch() and (frame := self.decoder.whole_frame(data)) is not None:
            # The usual case, one whole request (a client waiting for its answer): no
            # buffering. Nothing was held, so no frame timer runs; only reading may change.
            self.handle_frame(frame)
            if not self.finishing and self.reading is not self.may_dispatch():
                self.update_reading()
        else:
            self.decoder.append(data)
            self.dispatch()
        if trace is not None:
            trace.last_read = 0

    def eof_received(self) -> bool:
        # Reading pauses while frames wait undispatched, so every frame before the EOF
        # has been dispatched: answer what is in flight, then close.
        self.finish()
        return True

    def pause_writing(self) -> None:
        """The peer is not reading (the kernel's socket buffer is full): dispatch no more
        of its requests, and drop it if it stays so. A watcher is bounded by its queue
        instead (``too_slow``, daemon/watch.py): a pause in reading under that bound is
        its right."""
        self.writing_blocked = True
        self.update_reading()
        if self.subscription is not None and not self.finishing:
            return
        loop = asyncio.get_running_loop()
        self.send_timer = loop.call_later(self.limits.send_timeout, self.drop_non_reader)

    def resume_writing(self) -> None:
        self.writing_blocked = False
        if self.send_timer is not None:
            self.send_timer.cancel()
            self.send_timer = None
        self.dispatch()

    def connection_lost(self, exc: Exception | None) -> None:
        self.finishing = True  # the frames it sent that were not started never run
        self.held = None
        for timer in (self.frame_timer, self.send_timer, self.hello_timer):
            if timer is not None:
                timer.cancel()
        self.server.closed(self)
        if self.peer_pid is not None:
            self.server.release_process(self.peer_pid)
        if self.subscription is not None:
            self.server.watch_hub.unsubscribe(self.subscription)
        if self.caller is not None:
            self.server.on_disconnect(self.caller)

    # --- refusals on accept --------------------------------------------------------------

    def refuse_unknown_peer(self, exc: OSError, pid: int | None = None) -> None:
        """The kernel or /proc could not tell who connected (out of file descriptors?):
        refuse rather than serve a caller without an identity."""
        log.warning("peer_unknown", code="unavailable", peer_pid=pid, reason=str(exc))
        self.refuse(
            Unavailable(
                "towerd cannot identify your process right now (out of file descriptors?); retry",
                {"reason": "peer_unknown"},
            )
        )

    def refuse_process_over_cap(self, pid: int) -> None:
        limit = self.limits.max_connections_per_process
        log.warning("connection_refused", code="unavailable", peer_pid=pid, per_process=limit)
        self.refuse(
            Unavailable(
                f"process {pid} already has {limit} connections to towerd (the per-process "
                "limit); close some, or retry later",
                {"reason": "too_many_connections_per_process", "limit": limit, "pid": pid},
            )
        )

    def hello_timed_out(self) -> None:
        """A connection that has not said hello within the deadline only holds a slot."""
        self.hello_timer = None
        if self.finishing or self.caller is None or self.caller.hello_done:
            return
        timeout = self.limits.hello_timeout
        log.info("hello_refused", code="unauthorized", reason="no hello", timeout=timeout)
        self.refuse(Unauthorized(f"no hello within {timeout:g} s; reconnect and send hello first"))

    # --- requests ------------------------------------------------------------------------

    def dispatch(self) -> None:
        """Handle the complete frames held, one at a time, while this peer may start
        another request. At the in-flight limit or with replies piling up unsent, the
        rest wait in the decoder and reading pauses, until an answer completes or the
        write buffer drains (both call this again)."""
        started_new = False
        while not self.finishing and self.may_dispatch():
            frame = self.decoder.next_frame()
            if frame is None:
                break
            started_new = True
            self.handle_frame(frame)
        if self.finishing:
            return
        if self.decoder.error is not None:
            assert self.caller is not None
            log.info(
                "frame_refused",
                code="frame_too_large",
                length=self.decoder.error.length,
                peer_pid=self.caller.pid,
            )
            self.refuse(FrameTooLarge(str(self.decoder.error)))
            return
        self.update_reading()
        self.watch_frame_time(started_new=started_new)

    def may_dispatch(self) -> bool:
        """False at the in-flight limit, or with replies waiting unsent; a watcher's
        answers (all ``conflict``) are capped by its queue bound instead (``send``)."""
        if self.in_flight >= self.limits.max_in_flight:
            return False
        return not self.writing_blocked or self.subscription is not None

    def handle_frame(self, frame: bytes) -> None:
        try:
            request = decode_request(frame)
        except MalformedRequest as exc:
            log.info("frame_refused", code=exc.code, reason=clip(exc.message, LOG_REASON_LIMIT))
            self.refuse(exc, exc.request_id)
            return
        assert self.caller is not None
        if not self.caller.hello_done:
            self.hello(request, self.caller)
            return
        started = time.perf_counter()
        if request.method == "watch" or self.subscription is not None:
            self.start_watch(request, started)
            return
        method = request.method
        try:
            handler = self.handlers.table.get(method)
            if handler is None:
                raise UnknownMethod(f"unknown method {quoted(method)}")
            try:
                params = _PARAMS_DECODERS[method].decode(request.params)
            except (msgspec.DecodeError, RecursionError) as exc:
                raise bad_params(method, exc) from None
            outcome = handler(self.caller, params)
        except Exception as exc:  # noqa: BLE001 - every failure becomes an answer
            self.answer_failure(request, exc, started)
            return
        if not hasattr(outcome, "__await__"):  # answered now (inspect.isawaitable: 6x slower)
            self.answer(request, outcome, started, may_hold=True)
            return
        # A write's future as it is (ensure_future's checks cost ~1 us); a coroutine's task.
        future = outcome if isinstance(outcome, asyncio.Future) else asyncio.ensure_future(outcome)
        self.in_flight += 1
        future.add_done_callback(functools.partial(self.finished, request, started))

    def finished(self, request: Request, started: float, future: asyncio.Future[Any]) -> None:
        self.in_flight -= 1
        if future.cancelled():
            self.answer_failure(request, Unavailable("towerd is stopping"), started)
        elif (error := future.exception()) is not None:
            self.answer_failure(request, error, started)
        else:
            self.answer(request, future.result(), started)
        if stages.TRACE is not None and (stamps := stages.TRACE.answering.pop(id(future), None)):
            stages.TRACE.finish(stamps)
        self.after_answer()

    def after_answer(self) -> None:
        """An answer left the in-flight count: close if finishing, else dispatch more."""
        if not self.finishing:
            self.dispatch()
        elif self.in_flight == 0:
            self.release_held()
            self.transport.close()

    def answer(
        self, request: Request, result: Any, started: float, *, may_hold: bool = False
    ) -> None:
        """Encode and send; ``may_hold``: an answer made while reading requests, which may
        wait for the end of the loop's pass (daemon/bursts.py). A write's answers, sent
        from its batch, go out at once: holding them delayed the next batch (64 clients
        9,000-9,300 -> 7,200-7,800 ops/s in alternating runs)."""
        try:
            frame = encode_result(request.id, result)
            if len(frame) > self.reply_limit:
                raise Internal(
                    f"the result of {request.method} is {len(frame)} bytes, over the "
                    f"response limit of {self.reply_limit}"
                )
        except Exception as exc:  # noqa: BLE001
            self.answer_failure(request, exc, started)
            return
        self.send(frame, may_hold=may_hold)
        if self.server.trace_requests:
            log.debug("request", **self.context(request, started), code=None)

    def answer_failure(self, request: Request, exc: BaseException, started: float) -> None:
        code = exc.code if isinstance(exc, TowerdError) else "internal"
        if self.server.trace_requests:
            log.debug("request", **self.context(request, started), code=code)
        if isinstance(exc, TowerdError):
            self.send(self.error_frame(request.id, exc))
            log.info(
                "request_failed",
                **self.context(request, started),
                code=exc.code,
                reason=clip(exc.message, LOG_REASON_LIMIT),
            )
            return
        crash = clip(repr(exc), LOG_REASON_LIMIT)
        self.send(
            self.error_frame(
                request.id, Internal(f"internal error in {clip(request.method)}: {crash}")
            )
        )
        log.error(
            "request_crashed", **self.context(request, started), code="internal", exc_info=exc
        )

    def start_watch(self, request: Request, started: float) -> None:
        """``watch`` turns this connection into a subscription: the snapshot answers the
        request, then every committed change of the chosen topics is pushed."""
        if self.subscription is not None:
            error = Conflict(
                "this connection is a watch subscription: it only receives events; "
                "open another connection for requests"
            )
            self.answer_failure(request, error, started)
            return
        try:
            params = decode_params("watch", request)
        except Exception as exc:  # noqa: BLE001 - every failure becomes an answer
            self.answer_failure(request, exc, started)
            return
        # From here on this connection takes no other request. The snapshot is taken
        # where no write batch is in flight, so it holds exactly the changes published
        # before the subscription starts (a batch in flight delays it by that batch).
        subscription = Subscription(self, request.id, params.topics)
        self.subscription = subscription
        self.in_flight += 1  # answered later: a drain or the peer's EOF waits for it
        self.handlers.store.at_rest(lambda: self.answer_watch(request, subscription, started))

    def answer_watch(self, request: Request, subscription: Subscription, started: float) -> None:
        """Register ``subscription`` and answer with its snapshot, in one loop step."""
        self.in_flight -= 1
        still_wanted = subscription.active and self.subscription is subscription
        if still_wanted and not self.transport.is_closing():
            self.subscribe_and_answer(request, subscription, started)
        self.after_answer()  # the peer half-closed or the daemon drains: answered, done

    def subscribe_and_answer(
        self, request: Request, subscription: Subscription, started: float
    ) -> None:
        hub = self.server.watch_hub
        try:
            snapshot = hub.subscribe(
                subscription, lambda: self.handlers.watch_snapshot(subscription.topics)
            )
            # Encoded in the same loop step: no change can be pushed before the answer.
            frame = encode_result(request.id, WatchResult(snapshot=snapshot, seq=0))
            if len(frame) > self.reply_limit:
                raise Internal(f"the watch snapshot is {len(frame)} bytes, over the frame limit")
        except Exception as exc:  # noqa: BLE001 - every failure becomes an answer
            hub.unsubscribe(subscription)  # an answered error is no subscription
            self.subscription = None
            self.answer_failure(request, exc, started)
            return
        self.send(frame)
        if self.server.trace_requests:
            log.debug("request", **self.context(request, started), code=None)

    # --- the watch outlet (see daemon/watch.py) ------------------------------------------

    def queued_bytes(self) -> int:
        return self.transport.get_write_buffer_size()

    def write(self, frame: bytes) -> None:
        self.send(frame)

    def is_closing(self) -> bool:
        return self.transport.is_closing()

    def close_after(self, frame: bytes) -> None:
        """Send a last frame and close once it is read; a peer that reads nothing for the
        send timeout is cut off (it had time to drain its backlog and see the frame)."""
        self.send(frame)
        self.finish()
        asyncio.get_running_loop().call_later(self.limits.send_timeout, self.transport.abort)

    def watcher_too_slow(self, subscription: Subscription, queued: int) -> None:
        """The watch queue bound, applied to a frame other than a push (an answer to a
        request the watcher sent); the same ``too_slow`` as WatchHub sends for pushes."""
        hub = self.server.watch_hub
        hub.unsubscribe(subscription)
        limit = hub.max_queued_bytes
        log.warning("watcher_too_slow", code="too_slow", queued_bytes=queued, seq=subscription.seq)
        error = TooSlow(
            f"this watcher fell {queued} bytes behind (limit {limit}) at seq "
            f"{subscription.seq}; reconnect and watch again for a fresh snapshot",
            {"seq": subscription.seq, "queued_bytes": queued, "limit": limit},
        )
        self.close_after(encode_error(subscription.request_id, error))

    def context(self, request: Request, started: float) -> dict[str, Any]:
        caller = self.caller
        return {
            "method": clip(request.method),
            "request_id": request.id,
            "principal": caller.principal if caller else None,
            "peer_pid": caller.pid if caller else None,
            "duration_ms": round((time.perf_counter() - started) * 1000, 3),
        }

    def hello(self, request: Request, caller: Caller) -> None:
        """The first request: hello, or the connection closes."""
        if request.method != "hello":
            error: TowerdError = Unauthorized(
                f"the first request on a connection must be hello, not {quoted(request.method)}"
            )
        else:
            try:
                params = decode_params("hello", request)
            except BadArgs as exc:
                error = exc
            else:
                if params.protocol == PROTOCOL_VERSION:
                    caller.principal = f"uid:{os.geteuid()}:{params.principal or DEFAULT_PRINCIPAL}"
                    self.send(encode_result(request.id, self.handlers.hello(caller, params)))
                    caller.hello_done = True
                    if self.hello_timer is not None:
                        self.hello_timer.cancel()
                        self.hello_timer = None
                    return
                error = ProtocolMismatch(
                    f"client speaks protocol {params.protocol}, this daemon speaks protocol "
                    f"{PROTOCOL_VERSION}; restart the daemon (or update the client) so "
                    "both run the same towerd version",
                    {"client_protocol": params.protocol, "daemon_protocol": PROTOCOL_VERSION},
                )
        log.info("hello_refused", code=error.code, reason=clip(error.message, LOG_REASON_LIMIT))
        self.refuse(error, request.id)

    # --- output and flow control ---------------------------------------------------------

    def send(self, frame: bytes, *, may_hold: bool = False) -> None:
        transport = self.transport
        if transport.is_closing():
            return  # the peer left; it retries with its keys if it cares
        subscription = self.subscription
        if subscription is not None and subscription.active:
            self.release_held()
            # A watcher's backlog is bounded by its queue, for every frame it is sent.
            queued = transport.get_write_buffer_size()
            if queued > self.server.watch_hub.max_queued_bytes:
                self.watcher_too_slow(subscription, queued)
                return
            transport.write(frame)
            return
        if may_hold and self.server.bursts.hold(self, frame):
            return
        self.release_held()
        self.write_out(frame)

    def release_held(self) -> None:
        frame, self.held = self.held, None
        if frame is not None and not self.transport.is_closing():
            self.write_out(frame)

    def write_out(self, frame: bytes) -> None:
        transport = self.transport
        transport.write(frame)
        # Not for a peer refused at connect (another uid): it buys no poll.
        if self.spinner is not None and self.caller is not None:
            self.spinner.answered()
        if transport.get_write_buffer_size() > self.limits.max_outbound_bytes:
            self.drop(outbound_bytes=transport.get_write_buffer_size())

    def error_frame(self, request_id: int, error: TowerdError) -> bytes:
        return error_reply(request_id, error, self.reply_limit)

    def refuse(self, error: TowerdError, request_id: int = FRAME_ERROR_ID) -> None:
        """One error frame, then close once the requests in flight are answered."""
        self.send(self.error_frame(request_id, error))
        self.finish()

    def finish(self) -> None:
        """Take no more requests; close when the ones in flight are answered."""
        self.finishing = True
        self.update_reading()
        if self.in_flight == 0:
            self.release_held()
            self.transport.close()

    def update_reading(self) -> None:
        want = not self.finishing and self.may_dispatch()
        if want == self.reading or self.transport.is_closing():
            return
        self.reading = want
        if want:
            self.transport.resume_reading()
        else:
            self.transport.pause_reading()

    def watch_frame_time(self, *, started_new: bool) -> None:
        """A frame that has started must be complete within the frame timeout."""
        if not self.decoder.in_frame:
            if self.frame_timer is not None:
                self.frame_timer.cancel()
                self.frame_timer = None
            return
        if self.frame_timer is None or started_new:
            if self.frame_timer is not None:
                self.frame_timer.cancel()
            loop = asyncio.get_running_loop()
            self.frame_timer = loop.call_later(self.limits.frame_timeout, self.frame_timed_out)

    def frame_timed_out(self) -> None:
        if not self.reading:
            # We stopped reading (backpressure), not the peer: give it its time again.
            self.frame_timer = None
            self.watch_frame_time(started_new=True)
            return
        timeout = self.limits.frame_timeout
        log.info("frame_refused", code="bad_frame", reason="incomplete", timeout=timeout)
        self.refuse(BadFrame(f"a frame was started but not completed within {timeout} s"))

    def drop_non_reader(self) -> None:
        self.drop(send_timeout=self.limits.send_timeout)

    def drop(self, **why: Any) -> None:
        """Cut off a peer that does not read its replies: no error frame (it would not
        read it), and nothing more of what it sent is dispatched."""
        log.warning("peer_not_reading", code="unavailable", **why)
        self.finishing = True
        self.held = None
        self.transport.abort()


class _CutError(TowerdError):
    """An error re-sent with its message cut to fit the reply limit."""

    def __init__(self, code: str, message: str, data: dict[str, Any] | None) -> None:
        super().__init__(message, data)
        self.code = code


def error_reply(request_id: int, error: TowerdError, limit: int) -> bytes:
    """``error`` as a frame of at most ``limit`` bytes: over it, its message is cut to fit
    (the cut marked), and if its data alone is too large, the data is left out."""
    frame = encode_error(request_id, error)
    if len(frame) <= limit:
        return frame
    message = error.message.encode()
    mark = f"… [cut: {len(error.message)} characters, over the reply limit]"
    keep = max(0, len(message) - (len(frame) - limit) - len(mark.encode()) - 8)
    cut = message[:keep].decode("utf-8", "ignore") + mark
    frame = encode_error(request_id, _CutError(error.code, cut, error.data))
    if len(frame) <= limit:
        return frame
    bare = f"{clip(error.message)} [its data was left out: over the reply limit]"
    return encode_error(request_id, _CutError(error.code, bare, None))


def clip(text: str, limit: int = ECHO_LIMIT) -> str:
    """``text`` cut to ``limit`` characters, the cut marked with the original length."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… [cut: {len(text)} characters]"


def quoted(text: str, limit: int = ECHO_LIMIT) -> str:
    """``repr(text)`` for a message, cut to ``limit`` characters with the cut marked."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}… [cut: {len(text)} characters]"


def decode_params(method: str, request: Request) -> Any:
    try:
        return _PARAMS_DECODERS[method].decode(request.params)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise bad_params(method, exc) from None


def bad_params(method: str, exc: BaseException) -> BadArgs:
    """What a request whose params do not decode as its method's is answered."""
    if isinstance(exc, msgspec.ValidationError):
        return BadArgs(f"invalid params for {method}: {exc}")
    if isinstance(exc, RecursionError):
        return BadArgs(f"params for {method} are nested too deeply to decode")
    return BadArgs(f"undecodable params for {method}: {exc}")
