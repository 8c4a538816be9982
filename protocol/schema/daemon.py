"""The handshake and the daemon's own methods: hello, ping, status, shutdown, boxes.list."""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta, Struct

from towerd.protocol.schema.base import (
    BoxState,
    Millis,
    _require_printable,
)

# --- handshake and daemon ----------------------------------------------------


class HelloParams(Struct):
    protocol: int
    client: Annotated[str, Meta(max_length=256)]
    principal: Annotated[str, Meta(min_length=1, max_length=128)] | None = None

    def __post_init__(self) -> None:
        _require_printable("principal", self.principal)


class ServerInfo(Struct):
    name: str
    version: str


class HelloResult(Struct):
    daemon_id: str
    owner_epoch: int
    protocol: int
    server: ServerInfo
    max_frame: int
    features: list[str]
    principal: str


class PingResult(Struct):
    pong: bool
    now: Millis
    store: str = "reachable"  # the state store as this daemon last found it: or "unreachable"


class StoreState(Struct):
    """Where the state store is and whether it answers (``status``; PostgreSQL may not).

    ``outbox_*``: hook events kept in the state dir while the store is unreachable,
    forwarded in order when it returns (daemon/outbox.py); dropped past the bound."""

    backend: str  # "sqlite" or "postgresql"
    location: str  # the database file, or the DSN without its password
    reachable: bool
    error: str | None = None  # why not, when it is not
    outbox_queued: int = 0
    outbox_dropped: int = 0
    outbox_forwarded: int = 0
    # PostgreSQL: the server's clock minus the fleet's when more than a second apart (the
    # server's was stepped; the fleet's follows elapsed time and comes back to it at 1%)
    clock_offset_ms: int = 0


class KeyCounts(Struct):
    in_progress: int = 0
    completed: int = 0
    outcome_unknown: int = 0


class ReconcileReport(Struct):
    """What startup reconciliation did, as logged and reported by ``status``."""

    at: Millis
    owner_epoch: int
    rows_taken: int = 0
    marked_unknown: int = 0
    completed_from_evidence: int = 0
    still_unknown: int = 0
    expired: int = 0


class ClockReport(Struct):
    """towerd's clock against the wall clock (docs/protocol.md, "Time")."""

    now: Millis  # towerd's time: real elapsed time since its anchor
    wall: Millis  # the wall clock at the same moment
    offset_ms: int  # wall - now: the wall-clock steps since the anchor
    steps_detected: int  # wall-clock steps noticed since this daemon started


class UpkeepTask(Struct):
    """One background task: how its runs went (a failing task retries with backoff)."""

    name: str
    runs: int
    failures: int  # consecutive failures; 0 when the last run succeeded
    last_error_code: str | None = None
    last_error: str | None = None
    last_failed_at: Millis | None = None


class StatusResult(Struct):
    daemon_id: str
    owner_epoch: int
    pid: int
    version: str
    protocol: int
    started_at: Millis
    uptime_ms: int
    db_path: str
    socket_path: str
    sessions: int
    keys: KeyCounts
    reconciliation: ReconcileReport
    clock: ClockReport | None = None
    upkeep: list[UpkeepTask] = []
    store: StoreState | None = None
    # The daemon's state dir (its daemon id, lock, outbox): on PostgreSQL db_path names
    # no file in it, so tools find it here (None from a daemon before this field).
    state_dir: str | None = None


class ShutdownResult(Struct):
    stopping: bool


class BoxRecord(Struct):
    """One box of the store: a daemon id that ever registered in it, and its state.

    Its ``daemons`` row, with the state derived from its presence at the daemon's clock
    reading (``boxes.list``, daemon/store/boxes.py)."""

    daemon_id: str
    owner_epoch: int
    host: str
    pid: int
    started_at: Millis
    presence_at: Millis  # its last heartbeat (0: none recorded, as on the embedded store)
    dead_at: Millis | None  # when a live box declared it dead (None: not declared)
    state: BoxState  # present, lapsed (silent past the presence TTL), dead
    self: bool  # the daemon answering (always present)


class BoxListResult(Struct, omit_defaults=True):
    boxes: list[BoxRecord]  # by started_at
    truncated: bool = False  # sent (true) only when the list was cut to fit one frame
