"""Everything a store function may need to know about this daemon's settings: one
frozen record, carried by every ``Tx`` (``tx.config``), so no setting is passed
along from handler to function argument by argument."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from pathlib import Path

from towerd.protocol.framing import DEFAULT_MAX_FRAME
from towerd.protocol.methods import (
    DEFAULT_EVENT_MAX_PAYLOAD,
    DEFAULT_KV_MAX_VALUE,
    DEFAULT_PATH_LEASE_TTL_MS,
    DEFAULT_WORKER_TTL_MS,
)
from towerd.protocol.naming import DEFAULT_PREFIX as DEFAULT_BRANCH_PREFIX

DAY_MS = 24 * 60 * 60 * 1000
DEFAULT_BUSY_TIMEOUT_MS = 5000


@dataclass(frozen=True)
class StoreConfig:
    state_dir: Path = Path()
    completed_ttl_ms: int = DAY_MS
    worker_ttl_ms: int = DEFAULT_WORKER_TTL_MS  # a worker silent this long is reaped
    path_lease_ttl_ms: int = DEFAULT_PATH_LEASE_TTL_MS  # idle time before a path lease lapses
    retention_ms: int = 30 * DAY_MS  # audit events, settled dispatches, ended workers
    event_retention_ms: int = 30 * DAY_MS  # hook events
    events_per_session: int = 5000  # hook events kept per session, newest first
    events_per_principal: int = 100_000  # hook events kept per principal, newest first
    message_retention_ms: int = 30 * DAY_MS  # messages, by when they were sent
    effect_retention_ms: int = 30 * DAY_MS  # committed, failed and aborted effects
    quota_rows: int = 1_000_000  # rows per principal and table (daemon/store/quota.py)
    max_batch: int = 256
    # SQLite: how long a write batch waits for a write lock another connection holds (a
    # truncating checkpoint, a process outside towerd) before its callers are refused.
    busy_timeout_ms: int = DEFAULT_BUSY_TIMEOUT_MS
    # SQLite: how long the next batch may wait for the client processes the last one
    # answered (a commit delay: Store._hold; 0: never), and up to how many of them.
    commit_hold_us: int = 300
    commit_hold_max_writers: int = 16
    # Open the store as this daemon id instead of the state dir's own (several
    # daemons sharing one store; tests of ownership between daemons).
    daemon_id: str | None = None
    # Start an empty store (or adopt a foreign one) where a previous store's signs
    # are found (daemon/store/identity.py).
    new_store: bool = False
    # What requests are held to (see README "Configuration").
    max_frame: int = DEFAULT_MAX_FRAME  # a listing page is half of it (``page_bytes``)
    branch_prefix: str = DEFAULT_BRANCH_PREFIX  # a push to the run's own branch is unfenced
    kv_max_value: int = DEFAULT_KV_MAX_VALUE  # bytes of one soft-state value, as msgpack
    event_max_payload: int = DEFAULT_EVENT_MAX_PAYLOAD  # bytes of one hook event's payload
    host: str = field(default_factory=socket.gethostname)  # recorded with each worker
    # Where the store lives: None is SQLite in the state dir; a postgresql:// DSN is a
    # database several boxes' daemons share (daemon/store/pg_store.py).
    store: str | None = None
    presence_interval_ms: int = 5000  # PostgreSQL: how often this box heartbeats
    presence_ttl_ms: int = 30_000  # PostgreSQL: a box silent this long is dead

    @property
    def page_bytes(self) -> int:
        """Byte budget of one page of a listing: half a frame leaves room for the envelope."""
        return self.max_frame // 2


DEFAULT_CONFIG = StoreConfig()  # what a Tx carries when nobody gave it one (tools, tests)
