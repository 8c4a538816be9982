"""What every store function receives: the transaction (the connection, this daemon,
its clock reading, its settings) and who is asking.

One calling convention for the functions that serve requests: ``fn(tx, caller,
params)``, ``params`` the method's validated Struct (protocol/methods.py); the
route table in daemon/handlers.py maps each method to its function."""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec

from towerd.daemon.clock import DaemonClock
from towerd.daemon.processes import Holder, RemoteHolder
from towerd.daemon.store.config import DEFAULT_CONFIG, StoreConfig
from towerd.protocol.errors import STORE_UNREACHABLE as REASON_STORE_UNREACHABLE
from towerd.protocol.errors import Conflict, Internal, StorageFull, TowerdError, Unavailable
from towerd.protocol.framing import DEFAULT_MAX_FRAME

_packer = msgspec.msgpack.Encoder()
_unpacker = msgspec.msgpack.Decoder()


class Tx(msgspec.Struct, frozen=True):
    """A store function's context; ``now`` is one clock reading per transaction.

    A frozen Struct, not a frozen dataclass: one is made per point read and per write
    batch, and a frozen dataclass's ``__init__`` (``object.__setattr__`` per field) took
    ~0.9 us of a cold read's ~8, the Struct ~0.1 us.

    ``changes`` collects what a write changed, as ``(topic, data)`` notes, for the
    ``watch`` subscribers; the writer publishes the notes of committed requests
    only. Reads and start-up have none.
    """

    conn: sqlite3.Connection
    daemon_id: str
    owner_epoch: int
    now: int
    changes: list[tuple[str, Any]] | None = None
    config: StoreConfig = DEFAULT_CONFIG
    # Every holder process in the store runs on this machine (the embedded store); False
    # on a store several boxes share, where this daemon checks its own box's pids only.
    one_box: bool = True
    # A live daemon settling what a dead box held, as that box (daemon/store/presence.py):
    # nothing on this machine is evidence about that box's processes.
    as_dead_box: bool = False


@dataclass(slots=True)
class Caller:
    """Who is asking: fixed per connection once ``hello`` succeeded (daemon/server.py).
    Store functions read the principal (whose keys), the holder (the process that
    holds what it claims) and ``actor`` (who audit events name)."""

    principal: str
    pid: int
    holder: Holder | None  # the peer process, as a key holder
    hello_done: bool = False
    claimed: bool = False  # this connection's process took a key, lease or effect
    # The peer process and its ancestors, nearest first, when a method needs to know
    # whether it runs inside an agent session (path.claim, path.release).
    lineage: tuple[Holder, ...] = ()

    @property
    def actor(self) -> str:
        return f"{self.principal} pid {self.pid}"


def own_box(tx: Tx, column: str = "daemon_id") -> tuple[str, tuple[Any, ...]]:
    """``AND column = ?`` and its argument when the store is shared by several boxes: the
    rows whose holder pids this daemon may check (or whose silence it may act on) are its
    own box's; another box's holders are trusted while that box is present
    (daemon/store/presence.py settles a dead box's rows as that box). Empty on one box."""
    if tx.one_box:
        return "", ()
    return f" AND {column} = ?", (tx.daemon_id,)


def holder_at(tx: Tx, pid: int | None, start: int | None, box: str) -> Holder | None:
    """The holder a row names (its pid, start time and the box that granted it): this
    box's own process, or a RemoteHolder whose liveness its box's presence vouches for."""
    if pid is None or start is None:
        return None
    if tx.one_box or box == tx.daemon_id:
        return Holder(pid, start)
    return RemoteHolder(pid, start, box)


def note(tx: Tx, topic: str, data: Any) -> None:
    """Tell watchers of ``topic`` about a change this write makes (sent after commit)."""
    if tx.changes is not None:
        tx.changes.append((topic, data))


@dataclass(frozen=True, slots=True)
class Refused:
    """Returned (not raised) by a store function whose writes must commit although
    its caller is answered an error: parking an effect ``uncertain`` is such a write.
    A raised error would roll the request's writes back."""

    error: TowerdError


_clock = DaemonClock.at_wall_clock()  # until a store is opened and resumes its own


def now_ms() -> int:
    """towerd's time (daemon/clock.py): real elapsed time, whatever the wall clock does."""
    return _clock.now_ms()


def use_clock(clock: DaemonClock) -> None:
    """Make ``clock`` the one every store function reads (set when a store opens)."""
    global _clock
    _clock = clock


def current_clock() -> DaemonClock:
    return _clock


def pack(value: Any) -> bytes:
    return _packer.encode(value)


def pack_canonical(value: Any) -> bytes:
    """msgpack with every map's keys sorted, so equal values encode to equal bytes
    whatever the key order. String keys sort as strings; keys of other types (ints,
    bytes, ... are valid msgpack) follow them, ordered by their encoding."""
    return _packer.encode(_canonical(value))


def _key_order(key: Any) -> tuple[int, Any]:
    return (0, key) if isinstance(key, str) else (1, _packer.encode(key))


def _canonical(value: Any, *, as_key: bool = False) -> Any:
    if isinstance(value, dict):
        items = [(_canonical(key, as_key=True), _canonical(item)) for key, item in value.items()]
        items.sort(key=lambda pair: _key_order(pair[0]))
        return dict(items)
    if isinstance(value, list | tuple):
        items = [_canonical(item, as_key=as_key) for item in value]
        return tuple(items) if as_key else items  # an array used as a map key stays hashable
    return value


def unpack(data: bytes | None) -> Any:
    return None if data is None else _unpacker.decode(data)


T = TypeVar("T")


def where(*conditions: tuple[str, Any], **equal: Any) -> tuple[str, list[Any]]:
    """A listing's ``WHERE`` clause and its arguments: each ``(condition, argument)``
    pair, then ``column = ?`` for each keyword filter the request gave (not None).
    Column names come from the code, never from a request. ``""`` when nothing filters."""
    clauses = [condition for condition, _ in conditions]
    args = [argument for _, argument in conditions]
    for column, value in equal.items():
        if value is not None:
            clauses.append(f"{column} = ?")
            args.append(value)
    return (f"WHERE {' AND '.join(clauses)}" if clauses else ""), args


PAGE_BYTES = DEFAULT_MAX_FRAME // 2  # default byte budget of one listing page


def take_page(
    rows: list[tuple[int, T]], limit: int, byte_budget: int
) -> tuple[list[T], int | None]:
    """One page of ``(rowid, item)`` rows fetched with ``LIMIT limit + 1``.

    Stops early once the items' encoded size would pass ``byte_budget`` (at least
    one item is always returned), so a page always fits in a frame. Returns the
    items and the cursor to continue from (None when nothing is left).
    """
    items: list[T] = []
    size = 0
    last_rowid = 0
    for rowid, item in rows[:limit]:
        size += len(_packer.encode(item))
        if items and size > byte_budget:
            return items, last_rowid
        items.append(item)
        last_rowid = rowid
    return items, (last_rowid if len(rows) > limit else None)


def fit(items: list[T], byte_budget: int, *, keep: str = "first") -> tuple[list[T], bool]:
    """As many items as fit in ``byte_budget`` encoded bytes (at least one), keeping the
    first ones or the last ones; and whether any were left out. For results with no
    cursor, so an answer always fits in a frame."""
    order = items if keep == "first" else list(reversed(items))
    kept: list[T] = []
    size = 0
    for item in order:
        size += len(_packer.encode(item))
        if kept and size > byte_budget:
            break
        kept.append(item)
    truncated = len(kept) < len(items)
    return (kept if keep == "first" else list(reversed(kept))), truncated


R = TypeVar("R")


def fitted(result: R, byte_budget: int, *, keep: str = "first") -> R:
    """``result`` with its one list cut to fit ``byte_budget``, flagging ``truncated``:
    for answers with no cursor, which over the frame limit would be ``internal``."""
    (name,) = (f for f in result.__struct_fields__ if f != "truncated")  # type: ignore[attr-defined]
    items, truncated = fit(getattr(result, name), byte_budget, keep=keep)
    if not truncated:
        return result
    return msgspec.structs.replace(result, **{name: items, "truncated": True})  # type: ignore[type-var]


DAEMON = Caller(principal="", pid=0, holder=None)  # the daemon itself, reading for its own ends


SQLITE_BUSY = 5
SQLITE_FULL = 13


def translate_sqlite_error(exc: sqlite3.Error) -> TowerdError | None:
    """The wire error a SQLite failure means to a client, or None for a bug."""
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None and code & 0xFF == SQLITE_FULL:
        return StorageFull("the disk holding the state database is full; nothing was written")
    if isinstance(exc, sqlite3.IntegrityError):
        return Conflict(f"the write violates a constraint of the store: {exc}")
    if isinstance(exc, sqlite3.OperationalError) and "database is locked" in str(exc):
        return Internal(f"the state database is locked by another process: {exc}")
    return None


STORE_UNREACHABLE = (
    "the state store (PostgreSQL) is unreachable{why}; a write sent before the break may "
    "or may not have been applied: retry with the same key once towerd reconnects"
)


def translate_pg_error(exc: BaseException) -> TowerdError | None:
    """The wire error a PostgreSQL (psycopg) failure means to a client, or None for a bug.
    Read from the SQLSTATE alone, so the SQLite path never imports psycopg."""
    state = getattr(exc, "sqlstate", None) or ""
    name = type(exc).__name__
    if state == "53100":
        return StorageFull("the disk holding the PostgreSQL store is full; nothing was written")
    if state.startswith("23"):
        return Conflict(f"the write violates a constraint of the store: {exc}")
    unreachable = (
        state.startswith(("08", "57P", "53"))  # connection, shutdown, resources
        or state in ("57014", "55P03", "40001", "40P01")  # timeout, lock, retry
        or (not state and name in ("OperationalError", "InterfaceError"))
    )
    if unreachable:
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else name
        return Unavailable(
            STORE_UNREACHABLE.format(why=f" ({detail})"),
            {"reason": REASON_STORE_UNREACHABLE, "retry": "same_key"},
        )
    return None
