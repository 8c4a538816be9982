"""What other boxes changed, told to this box's watchers: PostgreSQL's LISTEN/NOTIFY.

A batch that changed something sends its change notes with ``pg_notify`` in the same
transaction (so they go out if and only if it commits, in commit order: writers are
serial across boxes), split over as many notifications as the 8000-byte limit needs.
Every daemon listens on a connection of its own and publishes the notes of other boxes
to its watchers. A single note too big for a notification is sent as a gap instead,
and a listener that lost its connection may have missed some: in both cases every
watcher is ended with ``too_slow`` and reconnects for a fresh snapshot, so no watcher
ever misses a change silently. A change committed just before a watch snapshot may
also arrive after it (at least once, never lost).

The listener hears this box's own notes too, once they committed: they are not
published again (the writer did), but they are what logs a box this box declared dead
(daemon/store/presence.py), whether or not the heartbeat's caller was still waiting.
"""

from __future__ import annotations

import base64
import threading
from collections.abc import Callable
from typing import Any

import msgspec
import psycopg
import structlog

from towerd.daemon.store import presence
from towerd.daemon.store.pg import connect

log = structlog.get_logger("towerd.store")

CHANNEL = "towerd_changes"
MAX_PAYLOAD = 7900  # PostgreSQL's limit is 8000 bytes
GAP = "gap"

_encoder = msgspec.msgpack.Encoder()


def notify(conn: Any, daemon_id: str, changes: list[tuple[str, Any]]) -> None:
    """In the batch's transaction: tell every box what it changed (committed or never),
    in as few notifications as fit the limit, in order; only a single note over the limit
    is sent as a gap (a busy batch's many small notes are not). The ``pg_notify`` calls
    go in the same message as the COMMIT (``PgConnection.notify_at_commit``): no round
    trip of their own, and still in the transaction."""
    for payload in _payloads(daemon_id, changes):
        conn.notify_at_commit(CHANNEL, payload)


def _encoded(daemon_id: str, changes: list[tuple[str, Any]]) -> str:
    return base64.b64encode(_encoder.encode([daemon_id, changes])).decode()


def _payloads(daemon_id: str, changes: list[tuple[str, Any]]) -> list[str]:
    """Each change encoded once; chunks kept under the limit by their encoded sizes (an
    array header and base64's 4/3 on top, with room to spare)."""
    whole = _encoded(daemon_id, changes)
    if len(whole) <= MAX_PAYLOAD:
        return [whole]
    budget = MAX_PAYLOAD * 3 // 4 - len(daemon_id) - 32
    payloads: list[str] = []
    chunk: list[tuple[str, Any]] = []
    size = 0
    for change in changes:
        cost = len(_encoder.encode(change))
        if cost > budget:
            if chunk:
                payloads.append(_encoded(daemon_id, chunk))
                chunk, size = [], 0
            payloads.append(f"{GAP} {daemon_id}")
            continue
        if chunk and size + cost > budget:
            payloads.append(_encoded(daemon_id, chunk))
            chunk, size = [], 0
        chunk.append(change)
        size += cost
    if chunk:
        payloads.append(_encoded(daemon_id, chunk))
    return payloads


LISTENING_WAIT_S = 5.0  # start() waits this long at most for the first LISTEN


class ChangeListener:
    """A thread listening for other boxes' notes; ``publish`` and ``gap`` are called on
    the event loop (via ``call``, e.g. ``loop.call_soon_threadsafe``).

    ``start`` returns once the thread listens (or its first attempt failed): the daemon
    serves, and a watcher can subscribe, only after that, so no note committed after a
    watcher's snapshot goes unheard. Started later than that (the server did not answer
    in time), or listening again after a break, it ends every watcher (``gap``): what
    was committed meanwhile is unknown."""

    def __init__(
        self,
        dsn: str,
        daemon_id: str,
        call: Callable[..., Any],
        publish: Callable[[list[tuple[str, Any]]], None],
        gap: Callable[[str], None],
    ) -> None:
        self.dsn, self.daemon_id, self._call = dsn, daemon_id, call
        self._publish, self._gap = publish, gap
        self._stop = threading.Event()
        self._conn: Any = None
        self._thread = threading.Thread(target=self._run, name="towerd-changes", daemon=True)
        self._first_try = threading.Event()  # the first LISTEN was sent, or failed
        self._lock = threading.Lock()
        self._serving = False  # start() returned: watchers may be subscribed

    def start(self) -> None:
        """Start the thread and wait (at most LISTENING_WAIT_S) until it listens."""
        self._thread.start()
        self._first_try.wait(LISTENING_WAIT_S)
        with self._lock:
            self._serving = True

    def stop(self) -> None:
        """Stop now: the thread's wait for a notification is cut short (its socket shut
        down) rather than waited out, so a daemon on PostgreSQL stops as fast as one on
        SQLite (the 0.5 s wait cost every stop up to that; the tests stop hundreds)."""
        self._stop.set()
        conn = self._conn
        if conn is not None:
            conn.interrupt()
        self._thread.join(timeout=3)

    def _run(self) -> None:
        missed = False  # a reconnect after a break: what happened meanwhile is unknown
        while not self._stop.is_set():
            try:
                self._conn = connect(self.dsn)
                self._conn.raw.execute(f"LISTEN {CHANNEL}")
                with self._lock:
                    late = self._serving  # the daemon served before this LISTEN
                    self._first_try.set()
                if missed:
                    self._call(self._gap, "the change listener reconnected")
                elif late:
                    self._call(self._gap, "the change listener started late")
                missed = True
                while not self._stop.is_set():
                    for note in self._conn.raw.notifies(timeout=0.5, stop_after=64):
                        self._deliver(note.payload)
            except psycopg.Error as exc:
                self._first_try.set()
                if self._stop.is_set():
                    return  # stop() cut the wait short
                log.warning("change_listener_lost", code="unavailable", error=str(exc))
                self._stop.wait(1.0)
            finally:
                if self._conn is not None:
                    self._conn.close()
                    self._conn = None

    def _deliver(self, payload: str) -> None:
        if payload.startswith(GAP + " "):
            if payload[len(GAP) + 1 :] != self.daemon_id:
                self._call(self._gap, "another box's change was too big to relay")
            return
        daemon_id, changes = msgspec.msgpack.decode(base64.b64decode(payload))
        if daemon_id != self.daemon_id:
            self._call(self._publish, [(topic, data) for topic, data in changes])
        else:  # this box's own batch, committed: what only its commit may log
            self._call(presence.log_declared, [(topic, data) for topic, data in changes])
