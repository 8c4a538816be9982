"""The blocking client, for hooks and scripts that make a call or two and exit.

It imports the standard library and the stdlib-only parts of
``towerd.protocol`` (its own msgpack codec, ``lite``): not msgspec (about
40 ms to import here), and never anyio, structlog or aiosqlite (50-180 ms
each); tests/client/test_import_cost.py keeps it that way. Any failure to
reach or hear from the daemon raises
``Unavailable``; after a timeout the connection is closed, since a late reply
would otherwise answer the next request.
"""

from __future__ import annotations

import os
import socket
import sys

from towerd.client.api import TowerdAPI
from towerd.protocol import DEFAULT_MAX_FRAME, PROTOCOL_VERSION, RESPONSE_SLACK, FrameDecoder, lite
from towerd.protocol.errors import TowerdError, Unavailable
from towerd.protocol.framing import FRAME_ERROR_ID
from towerd.protocol.paths import default_socket_path

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs hooks ~3 ms
if TYPE_CHECKING:
    from collections.abc import Iterator, Mapping, Sequence
    from typing import Any

    from towerd.client.effect import EffectContext

DEFAULT_TIMEOUT = 10.0


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
        self._sock: socket.socket | None = None
        self._decoder = FrameDecoder(DEFAULT_MAX_FRAME + RESPONSE_SLACK)
        self._frames: list[bytes] = []
        self._next_id = 0
        self.connect()

    # --- connection ------------------------------------------------------------------------

    def connect(self) -> None:
        """(Re)connect and say hello; raises ``Unavailable`` if no daemon answers."""
        self.close()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.socket_path)
        except OSError as exc:
            sock.close()
            raise Unavailable(
                f"cannot connect to towerd at {self.socket_path}: {exc.strerror or exc}; "
                "is the daemon running? (start it with `towerd`)",
                {"socket": str(self.socket_path), "reason": "connect"},
            ) from None
        self._sock = sock
        self._decoder = FrameDecoder(DEFAULT_MAX_FRAME + RESPONSE_SLACK)
        self._frames = []
        try:
            self.hello = self.call("hello", hello_params(self.client_name, self.principal))
        except TowerdError:
            self.close()
            raise
        self._decoder.max_frame = (
            max(DEFAULT_MAX_FRAME, int(self.hello.get("max_frame", 0))) + RESPONSE_SLACK
        )

    @property
    def max_request(self) -> int:
        """Largest request payload the daemon accepts (learnt from hello)."""
        return int(self.hello.get("max_frame", DEFAULT_MAX_FRAME))

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

        A daemon error is returned in its slot (not raised); losing the daemon
        raises ``Unavailable`` for the whole batch.
        """
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
            sock.sendall(b"".join(frames))
            answers: dict[int, Any] = {}
            while len(answers) < len(ids):
                request_id, result, error = self._codec.decode_response(self._read_frame(sock))
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

    def _read_frame(self, sock: socket.socket) -> bytes:
        while not self._frames:
            data = sock.recv(65536)
            if not data:
                raise Unavailable(
                    f"towerd at {self.socket_path} closed the connection",
                    {"socket": str(self.socket_path), "reason": "closed"},
                )
            self._frames.extend(self._decoder.feed(data))
            if not self._frames and self._decoder.error is not None:
                raise Unavailable(f"towerd sent an oversized frame: {self._decoder.error}")
        return self._frames.pop(0)

    def _require_socket(self) -> socket.socket:
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
    ) -> EffectContext:
        """``with client.effect(...) as fx:`` claim an external effect, heartbeat it in
        the background (on a connection of its own), commit ``fx.receipt`` at exit.

        ``EffectNotStarted`` from the body aborts it; any other exception leaves it in
        flight for recovery. See :mod:`towerd.client.effect`.
        """
        from towerd.client.effect import EffectContext

        return EffectContext(
            self, run_id, step_id, action_kind, target_ref,
            payload=payload, attempt_id=attempt_id, heartbeat_interval=heartbeat_interval,
            lease_ttl_ms=lease_ttl_ms, timeout_ms=timeout_ms,
        )  # fmt: skip

    # --- watch ---------------------------------------------------------------------------------

    def watch(
        self, topics: Sequence[str], *, idle_timeout: float | None = None
    ) -> Iterator[dict[str, Any]]:
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
        sock.settimeout(idle_timeout)
        while True:
            try:
                value = self._codec.decode_frame(self._read_frame(sock))
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

    def iter_fleet(self, page_size: int | None = None) -> Iterator[dict[str, Any]]:
        """Every row of this daemon's fleet, fetching page after page."""
        cursor = None
        while True:
            page = self.fleet_list(limit=page_size, cursor=cursor)
            yield from page["sessions"]
            cursor = page.get("next_cursor")
            if cursor is None:
                return

    def iter_keys(
        self, state: str | None = None, page_size: int | None = None
    ) -> Iterator[dict[str, Any]]:
        cursor = None
        while True:
            page = self.idem_list(state=state, limit=page_size, cursor=cursor)
            yield from page["keys"]
            cursor = page.get("next_cursor")
            if cursor is None:
                return
