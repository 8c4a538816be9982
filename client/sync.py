"""The blocking client, for hooks and scripts that make a call or two and exit.

It imports the standard library and the stdlib-only parts of
``towerd.protocol`` (its own msgpack codec, ``lite``): not msgspec (about
40 ms to import here), and never anyio, structlog or aiosqlite (50-180 ms
each); tests/client/test_import_cost.py keeps it that way. Any failure to
reach or hear from the daemon raises
``Unavailable``; after a timeout the connection is closed, since a late reply
would otherwise answer the next request. ``timeout`` bounds each whole call (the
send and every receive of its answers) and connect plus hello together, so a
peer that trickles bytes cannot stretch a call. Before anything is sent, the
server is verified to be this user's own (:mod:`towerd.client.trust`).
"""

from __future__ import annotations

import _socket  # the C module: socket.py imports enum, selectors, collections (~4 ms a hook)
import os
import select
import sys
import time

from towerd.client.api import TowerdAPI
from towerd.client.trust import check_peer, check_socket_dir
from towerd.protocol import (
    DEFAULT_MAX_FRAME,
    PROTOCOL_VERSION,
    RESPONSE_SLACK,
    FrameDecoder,
    fields,
    lite,
)
from towerd.protocol.errors import TowerdError, Unavailable
from towerd.protocol.framing import FRAME_ERROR_ID
from towerd.protocol.paths import default_socket_path

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs hooks ~3 ms
if TYPE_CHECKING:
    from collections.abc import Generator, Iterator, Mapping, Sequence
    from typing import Any

    from towerd.client.effect import EffectContext
    from towerd.client.results import IdemRecord, SessionRow

DEFAULT_TIMEOUT = fields.CALL_TIMEOUT_S
# The largest response frame a client accepts, whatever hello.max_frame announces
# (docs/protocol.md §2 Limits): a peer cannot make a client buffer more than this.
MAX_RESPONSE_FRAME = 64 * 1024 * 1024


def response_limit(hello: Mapping[str, Any]) -> int:
    """The largest answer frame accepted on a connection: the announced ``max_frame``
    plus ``RESPONSE_SLACK``, never less than the default's, never over the ceiling."""
    return min(request_limit(hello) + RESPONSE_SLACK, MAX_RESPONSE_FRAME)


def request_limit(hello: Mapping[str, Any]) -> int:
    """The largest request payload to send: what hello announced (the default if it
    announced nothing usable), capped so that its echo still fits the ceiling."""
    announced = hello.get("max_frame")
    if type(announced) is not int:
        announced = DEFAULT_MAX_FRAME
    return min(max(DEFAULT_MAX_FRAME, announced), MAX_RESPONSE_FRAME - RESPONSE_SLACK)


def deadline_after(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def time_left(deadline: float | None) -> float | None:
    """Seconds until ``deadline`` (None: no deadline); ``TimeoutError`` once it passed."""
    if deadline is None:
        return None
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("timed out")
    return left


def wait_for(poller: select.poll, deadline: float | None) -> None:
    """Wait until ``poller``'s socket is ready, by ``deadline``; ``TimeoutError`` if not."""
    left = time_left(deadline)
    if not poller.poll(None if left is None else max(1, int(left * 1000 + 0.999))):
        raise TimeoutError("timed out")


def hello_params(client_name: str, principal: str | None) -> dict[str, Any]:
    params: dict[str, Any] = {"protocol": PROTOCOL_VERSION, "client": client_name}
    if principal is not None:
        params["principal"] = principal
    return params


def default_client_name() -> str:
    return f"{os.path.basename(sys.argv[0]) or 'python'}/{os.getpid()}"


def _codec(name: str) -> Any:
    """The msgpack codec: ``lite`` (stdlib, ~0.5 ms to import), ``msgspec`` (C, ~40 ms to
    import, several times faster per call), or ``auto``: msgspec when this process has
    already loaded it (a service, a benchmark), else lite (a hook)."""
    if name == "auto":
        name = "msgspec" if "msgspec" in sys.modules else "lite"
    if name == "lite":
        return lite
    if name == "msgspec":
        from towerd.protocol import envelope

        return envelope
    raise ValueError(f"unknown codec {name!r} (lite, msgspec or auto)")


class Client(TowerdAPI):
    """One connection to the daemon. Use as a context manager, or call :meth:`close`.

    ``principal`` names the agent or user whose idempotency keys this client
    sees (default ``default``); the daemon prefixes it with the peer's uid.
    ``codec`` picks the msgpack implementation (see :func:`_codec`); both speak
    exactly the same bytes.
    """

    def __init__(
        self,
        socket_path: str | os.PathLike[str] | None = None,
        *,
        timeout: float | None = DEFAULT_TIMEOUT,
        client_name: str | None = None,
        principal: str | None = None,
        codec: str = "auto",
    ) -> None:
        self._codec = _codec(codec)
        self.socket_path = os.fspath(socket_path or default_socket_path())
        self.timeout = timeout
        self.client_name = client_name or default_client_name()
        self.principal = principal
        self.hello: dict[str, Any] = {}
        self._sock: _socket.socket | None = None
        # The socket is non-blocking once connected: a call sends at once (there is room,
        # as a rule) and waits for its answer in poll, three system calls a request (a
        # timeout on the socket itself cost six: two to set it, a poll before each send
        # and receive).
        self._readable = select.poll()
        self._writable = select.poll()
        self._decoder = FrameDecoder(DEFAULT_MAX_FRAME + RESPONSE_SLACK)
        self._frames: list[bytes] = []
        self._next_id = 0
        self.connect()

    # --- connection ------------------------------------------------------------------------

    def connect(self) -> None:
        """(Re)connect and say hello, both within ``timeout``; raises ``Unavailable`` if
        no daemon answers, ``Unauthorized`` if the server is not this user's own."""
        self.close()
        deadline = deadline_after(self.timeout)
        self._sock = self._open_verified(deadline)
        self._sock.setblocking(False)
        self._readable, self._writable = select.poll(), select.poll()
        self._readable.register(self._sock, select.POLLIN)
        self._writable.register(self._sock, select.POLLOUT)
        self._decoder = FrameDecoder(DEFAULT_MAX_FRAME + RESPONSE_SLACK)
        self._frames = []
        self.hello = {}
        try:
            (hello,) = self._exchange(
                [("hello", hello_params(self.client_name, self.principal))], deadline
            )
            if isinstance(hello, TowerdError):
                raise hello
        except TowerdError:
            self.close()
            raise
        self.hello = hello
        self._decoder.max_frame = response_limit(hello)

    def _open_verified(self, deadline: float | None) -> _socket.socket:
        """A socket connected to this user's own daemon, nothing sent yet."""
        sock = None
        try:
            check_socket_dir(self.socket_path)
            sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM | _socket.SOCK_CLOEXEC)
            sock.settimeout(time_left(deadline))
            sock.connect(self.socket_path)
            check_peer(sock, self.socket_path)
        except OSError as exc:
            if sock is not None:
                sock.close()
            raise Unavailable(
                f"cannot connect to towerd at {self.socket_path}: {exc.strerror or exc}; "
                "is the daemon running? (start it: `systemctl --user start towerd.socket` once "
                "installed with `towerctl install-systemd`, else `setsid towerd >>towerd.log "
                "2>&1 &` from the venv's bin)",
                {"socket": str(self.socket_path), "reason": "connect"},
            ) from None
        except TowerdError:
            if sock is not None:
                sock.close()
            raise
        return sock

    @property
    def max_request(self) -> int:
        """Largest request payload the daemon accepts (learnt from hello)."""
        return request_limit(self.hello)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- calls -------------------------------------------------------------------------------

    def call(self, method: str, params: Mapping[str, Any] | None = None) -> Any:
        """Send one request and wait for its answer; a daemon error raises its class."""
        (outcome,) = self.call_many([(method, params)])
        if isinstance(outcome, TowerdError):
            raise outcome
        return outcome

    def call_many(
        self, calls: Sequence[tuple[str, Mapping[str, Any] | None]]
    ) -> list[Any | TowerdError]:
        """Pipeline several requests in one write; outcomes in the same order.

        A daemon error is returned in its slot (not raised); losing the daemon, or
        ``timeout`` passing before every answer is in, raises ``Unavailable`` for the
        whole batch.
        """
        return self._exchange(calls, deadline_after(self.timeout))

    def _exchange(
        self, calls: Sequence[tuple[str, Mapping[str, Any] | None]], deadline: float | None
    ) -> list[Any | TowerdError]:
        sock = self._require_socket()
        ids = []
        frames = []
        for method, params in calls:
            self._next_id += 1
            ids.append(self._next_id)
            frames.append(
                self._codec.encode_request(
                    self._next_id, method, dict(params or {}), self.max_request
                )
            )
        try:
            self._send_all(sock, frames[0] if len(frames) == 1 else b"".join(frames), deadline)
            answers: dict[int, Any] = {}
            while len(answers) < len(ids):
                frame = self._read_frame(sock, deadline)
                request_id, result, error = self._codec.decode_response(frame)
                if request_id == FRAME_ERROR_ID and error is not None:
                    raise error  # about the connection itself; the daemon closes it
                answers[request_id] = error if error is not None else result
        except TowerdError:
            self.close()
            raise
        except OSError as exc:
            self.close()
            reason = "timeout" if isinstance(exc, TimeoutError) else "connection"
            raise Unavailable(
                f"lost towerd at {self.socket_path} ({reason}: {exc}); the request may or may "
                "not have been applied: retry it with the same idempotency key",
                {"socket": str(self.socket_path), "reason": reason},
            ) from None
        return [answers.get(request_id) for request_id in ids]

    def _send_all(self, sock: _socket.socket, data: bytes, deadline: float | None) -> None:
        """Send all of ``data`` by ``deadline``, waiting for room only when there is none."""
        view = memoryview(data)
        while view:
            try:
                sent = sock.send(view)
            except BlockingIOError:
                wait_for(self._writable, deadline)
                continue
            view = view[sent:]

    def _read_frame(self, sock: _socket.socket, deadline: float | None) -> bytes:
        """The next whole frame, by ``deadline`` however slowly its bytes come."""
        while not self._frames:
            wait_for(self._readable, deadline)
            try:
                data = sock.recv(65536)
            except BlockingIOError:
                continue  # woken for nothing: wait again
            if not data:
                raise Unavailable(
                    f"towerd at {self.socket_path} closed the connection",
                    {"socket": str(self.socket_path), "reason": "closed"},
                )
            frame = self._decoder.whole_frame(data)  # the usual answer: one whole frame
            if frame is not None:
                return frame
            self._frames.extend(self._decoder.feed(data))
            if not self._frames and self._decoder.error is not None:
                raise Unavailable(
                    f"towerd at {self.socket_path} sent an oversized frame: "
                    f"{self._decoder.error}; the connection was closed",
                    {"socket": str(self.socket_path), "reason": "connection"},
                )
        return self._frames.pop(0)

    def _require_socket(self) -> _socket.socket:
        if self._sock is None:
            raise Unavailable(
                "this client is closed; call connect() to reconnect",
                {"socket": str(self.socket_path), "reason": "closed"},
            )
        return self._sock

    # --- effects -------------------------------------------------------------------------------

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
        git: Mapping[str, str] | None = None,
    ) -> EffectContext:
        """``with client.effect(...) as fx:`` claim an external effect, heartbeat it in
        the background (on a connection of its own), commit ``fx.receipt`` at exit.

        ``EffectNotStarted`` from the body aborts it; any other exception leaves it in
        flight for recovery. See :mod:`towerd.client.effect`.
        """
        from towerd.client.effect import EffectContext, EffectSpec

        return EffectContext(self, EffectSpec(
            run_id, step_id, action_kind, target_ref, payload, attempt_id, heartbeat_interval,
            lease_ttl_ms, timeout_ms, None if git is None else dict(git),
        ))  # fmt: skip

    # --- watch ---------------------------------------------------------------------------------

    def watch(
        self, topics: Sequence[str], *, idle_timeout: float | None = None
    ) -> Generator[dict[str, Any], None, None]:
        """Turn this connection into a subscription to ``topics`` (fleet, events, idem,
        leases, effects, dispatch).

        Yields ``{"snapshot": {topic: ...}, "seq": 0}`` first, then every committed
        change as ``{"event": topic, "seq": n, "data": ...}`` with ``seq`` +1 each time.
        A watcher the daemon dropped for falling behind gets ``TooSlow`` (watch again
        for a fresh snapshot); a lost daemon, or ``idle_timeout`` seconds without a
        change, ``Unavailable``. The connection serves no other request afterwards.
        """
        answer = self.call("watch", {"topics": list(topics)})
        try:
            yield answer
            yield from self._pushes(idle_timeout)
        finally:
            self.close()  # a subscription serves nothing else: closing the iterator ends it

    def _pushes(self, idle_timeout: float | None) -> Iterator[dict[str, Any]]:
        sock = self._require_socket()
        while True:
            try:
                value = self._codec.decode_frame(
                    self._read_frame(sock, deadline_after(idle_timeout))
                )
            except OSError as exc:
                self.close()
                reason = "timeout" if isinstance(exc, TimeoutError) else "connection"
                raise Unavailable(
                    f"watch on towerd at {self.socket_path} ended ({reason}: {exc})",
                    {"socket": str(self.socket_path), "reason": reason},
                ) from None
            except TowerdError:
                self.close()
                raise
            if lite.is_push(value):
                yield value
                continue
            _request_id, _result, error = lite.response_parts(value)
            if error is not None:
                self.close()
                raise error

    # --- paging --------------------------------------------------------------------------------

    def iter_fleet(
        self, page_size: int | None = None, *, daemon_id: str | None = None
    ) -> Iterator[SessionRow]:
        """Every fleet row shown (``fleet_list``'s ``daemon_id``), fetching page after page."""
        cursor = None
        while True:
            page = self.fleet_list(limit=page_size, cursor=cursor, daemon_id=daemon_id)
            yield from page["sessions"]
            cursor = page.get("next_cursor")
            if cursor is None:
                return

    def iter_keys(
        self, state: str | None = None, page_size: int | None = None
    ) -> Iterator[IdemRecord]:
        cursor = None
        while True:
            page = self.idem_list(state=state, limit=page_size, cursor=cursor)
            yield from page["keys"]
            cursor = page.get("next_cursor")
            if cursor is None:
                return
