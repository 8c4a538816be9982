"""A TCP proxy a test controls, between a daemon and a server (PostgreSQL's TCP port).

``TcpProxy(upstream_host, upstream_port)`` listens on a free port of 127.0.0.1 and
forwards every connection it accepts to the upstream, byte for byte, both ways. The
test steers it:

* ``pause()``: a silent partition. Nothing is forwarded either way, nothing is read
  and nothing is closed: every socket stays open, as when a network drops packets. A
  connection accepted meanwhile is held, unanswered, and connected upstream only at
  ``resume()`` (a client's connect timeout is what ends its wait);
* ``resume()``: forwarding goes on where it stopped (what was sent meanwhile is
  delivered then, as TCP retransmissions would deliver it);
* ``reset()``: every connection is closed now with a TCP reset, both sides (a broken
  link); new connections are accepted as usual;
* ``close()``: the listener and every connection closed, the thread joined.

One thread runs a selector loop; each operation is a command the loop executes
between two steps and acknowledges, so when ``pause()`` returns not one more byte is
forwarded (no sleeps: the caller waits on the acknowledgement, with a deadline).
Buffers are bounded (``BUFFER`` bytes per direction): a side that does not read
stops the proxy reading from the other, as TCP flow control would.
"""

from __future__ import annotations

import contextlib
import queue
import selectors
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

BUFFER = 256 * 1024  # bytes held per direction of a connection before reading stops
CONNECT_TIMEOUT_S = 5.0  # the upstream is on this machine: a connect takes microseconds
COMMAND_TIMEOUT_S = 10.0  # the loop acknowledges a command within this, or it is a bug


@dataclass(eq=False)
class _Side:
    sock: socket.socket
    outgoing: bytearray = field(default_factory=bytearray)  # bytes waiting to be sent to it
    read_open: bool = True  # it has not sent EOF
    write_open: bool = True  # we have not shut its writing side


@dataclass(eq=False)
class _Pair:
    client: _Side
    upstream: _Side

    def other(self, side: _Side) -> _Side:
        return self.upstream if side is self.client else self.client


class TcpProxy:
    """See the module docstring. A context manager: ``close()`` at exit."""

    def __init__(self, upstream_host: str, upstream_port: int) -> None:
        self.upstream = (upstream_host, upstream_port)
        self._listener = socket.create_server(("127.0.0.1", 0), backlog=128)
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._commands: queue.SimpleQueue[tuple[Callable[[], None], threading.Event]] = (
            queue.SimpleQueue()
        )
        self._pairs: set[_Pair] = set()
        self._held: list[socket.socket] = []  # accepted while paused, not yet connected
        self._paused = False
        self._closed = False
        self.accepted = 0  # connections accepted since the start (a reconnect counts)
        self.failed_upstream = 0  # accepted connections whose upstream connect failed
        self.error: BaseException | None = None  # what stopped the loop, if anything did
        self._selector.register(self._listener, selectors.EVENT_READ, "listener")
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread = threading.Thread(target=self._run, name=f"tcp-proxy-{self.port}")
        self._thread.daemon = True
        self._thread.start()

    # --- the test's side ----------------------------------------------------------------

    def dsn(self, dbname: str, user: str) -> str:
        """A PostgreSQL DSN reaching ``dbname`` through this proxy."""
        return f"postgresql://{user}@127.0.0.1:{self.port}/{dbname}"

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def connections(self) -> int:
        """Connections open now (forwarded or held)."""
        return self._call(lambda: None, lambda: len(self._pairs) + len(self._held))

    def pause(self) -> None:
        self._call(self._do_pause)

    def resume(self) -> None:
        self._call(self._do_resume)

    def reset(self) -> None:
        self._call(self._do_reset)

    def close(self) -> None:
        """Close the listener and every connection; idempotent."""
        if self._thread.is_alive():
            if self.error is None:
                self._call(self._do_close)
            self._thread.join(COMMAND_TIMEOUT_S)
            if self._thread.is_alive():
                raise RuntimeError(f"the proxy's thread did not stop within {COMMAND_TIMEOUT_S}s")
        self._wake_w.close()

    def __enter__(self) -> TcpProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, command: Callable[[], None], answer: Callable[[], int] | None = None) -> int:
        """Run ``command`` on the loop's thread, between two steps; wait until it ran."""
        if self.error is not None:
            raise RuntimeError(f"the proxy's loop stopped: {self.error!r}") from self.error
        if not self._thread.is_alive():
            raise RuntimeError("the proxy is closed")
        result: list[int] = []

        def run() -> None:
            command()
            if answer is not None:
                result.append(answer())

        done = threading.Event()
        self._commands.put((run, done))
        with contextlib.suppress(OSError):  # a full wake-up buffer already wakes the loop
            self._wake_w.send(b"x")
        if not done.wait(COMMAND_TIMEOUT_S):
            raise RuntimeError(f"the proxy did not run a command within {COMMAND_TIMEOUT_S}s")
        if self.error is not None:
            raise RuntimeError(f"the proxy's loop stopped: {self.error!r}") from self.error
        return result[0] if result else 0

    # --- the loop -----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._closed:
                for key, events in self._selector.select():
                    if key.data == "wake":
                        self._drain_commands()
                    elif key.data == "listener":
                        self._accept()
                    elif not self._paused:  # a pause in this same round stops it here
                        pair, side = key.data
                        if pair in self._pairs:
                            self._step(pair, side, events)
                    if self._closed:
                        break
        except BaseException as exc:  # noqa: BLE001 - reported to the test by _call
            self.error = exc
        finally:
            self._closed = True
            self._shut_everything()
            self._drain_commands(run=False)  # nobody waits on a command after a failure

    def _drain_commands(self, run: bool = True) -> None:
        with contextlib.suppress(OSError):  # BlockingIOError: drained; or already closed
            while self._wake_r.recv(4096):
                pass
        while True:
            try:
                command, done = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                if run:
                    command()
            finally:
                done.set()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            self.accepted += 1
            if self._paused:
                self._held.append(client)  # silent: nothing answers until resume()
            else:
                self._connect(client)

    def _connect(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.upstream, timeout=CONNECT_TIMEOUT_S)
        except OSError:
            self.failed_upstream += 1
            _abort(client)  # as the server's port would answer: refused
            return
        for sock in (client, upstream):
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        pair = _Pair(_Side(client), _Side(upstream))
        self._pairs.add(pair)
        for side in (pair.client, pair.upstream):
            self._selector.register(side.sock, selectors.EVENT_READ, (pair, side))

    def _watch(self, pair: _Pair) -> None:
        """What the loop waits for on each side of ``pair``: nothing while paused; else
        reading while the other side's buffer has room, writing while this side's buffer
        holds bytes (a socket with nothing to wait for leaves the selector)."""
        for side in (pair.client, pair.upstream):
            events = 0
            if not self._paused:
                if side.read_open and len(pair.other(side).outgoing) < BUFFER:
                    events |= selectors.EVENT_READ
                if side.outgoing and side.write_open:
                    events |= selectors.EVENT_WRITE
            registered = side.sock in self._selector.get_map()
            if events and registered:
                self._selector.modify(side.sock, events, (pair, side))
            elif events:
                self._selector.register(side.sock, events, (pair, side))
            elif registered:
                self._selector.unregister(side.sock)

    def _step(self, pair: _Pair, side: _Side, events: int) -> None:
        other = pair.other(side)
        try:
            if events & selectors.EVENT_READ and side.read_open:
                room = BUFFER - len(other.outgoing)
                if room > 0:
                    try:
                        data = side.sock.recv(min(room, 65536))
                    except (BlockingIOError, InterruptedError):
                        data = None
                    if data == b"":
                        side.read_open = False
                    elif data:
                        other.outgoing += data
                        self._flush(other)
            if events & selectors.EVENT_WRITE:
                self._flush(side)
            # EOF from one side, once everything it sent went out: pass it on.
            for src, dst in ((pair.client, pair.upstream), (pair.upstream, pair.client)):
                if not src.read_open and not dst.outgoing and dst.write_open:
                    dst.write_open = False
                    with contextlib.suppress(OSError):
                        dst.sock.shutdown(socket.SHUT_WR)
        except OSError:  # a reset or a broken pipe on either side: the link is gone
            self._drop(pair, abort=True)
            return
        if not pair.client.read_open and not pair.upstream.read_open:
            self._drop(pair, abort=False)
            return
        self._watch(pair)

    def _flush(self, side: _Side) -> None:
        while side.outgoing and side.write_open:
            try:
                sent = side.sock.send(side.outgoing)
            except (BlockingIOError, InterruptedError):
                return
            del side.outgoing[:sent]

    def _drop(self, pair: _Pair, *, abort: bool) -> None:
        self._pairs.discard(pair)
        for side in (pair.client, pair.upstream):
            if side.sock in self._selector.get_map():
                self._selector.unregister(side.sock)
            if abort:
                _abort(side.sock)
            else:
                side.sock.close()

    # --- commands (on the loop's thread) ----------------------------------------------------

    def _do_pause(self) -> None:
        self._paused = True
        for pair in self._pairs:
            self._watch(pair)

    def _do_resume(self) -> None:
        self._paused = False
        held, self._held = self._held, []
        for client in held:
            self._connect(client)
        for pair in list(self._pairs):
            # Bytes read before the pause and not yet sent go out now.
            try:
                self._flush(pair.client)
                self._flush(pair.upstream)
            except OSError:
                self._drop(pair, abort=True)
                continue
            self._watch(pair)

    def _do_reset(self) -> None:
        for pair in list(self._pairs):
            self._drop(pair, abort=True)
        held, self._held = self._held, []
        for client in held:
            _abort(client)

    def _do_close(self) -> None:
        self._closed = True

    def _shut_everything(self) -> None:
        self._do_reset()
        for sock in (self._listener, self._wake_r):
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(sock)
            sock.close()
        self._selector.close()


def _abort(sock: socket.socket) -> None:
    """Close with a TCP reset (SO_LINGER 0), not a FIN: the peer's next use fails."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()
