"""Operator tools: backup and doctor."""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta, Struct

from towerd.protocol.schema.base import (
    Millis,
)
from towerd.protocol.schema.daemon import (
    KeyCounts,
)

# --- operator tools --------------------------------------------------------------


class BackupParams(Struct):
    path: Annotated[str, Meta(min_length=1, max_length=4096)]  # absolute, on the daemon's host
    overwrite: bool = False

    def __post_init__(self) -> None:
        if "\0" in self.path or not self.path.startswith("/"):
            raise ValueError("`path` must be an absolute path without NUL bytes")


class BackupResult(Struct):
    path: str
    bytes: int
    pages: int
    integrity: list[str]  # PRAGMA integrity_check of the copy: ["ok"]
    duration_ms: int


class DoctorParams(Struct):
    full: bool = False  # integrity_check (slow, thorough) instead of quick_check


class UnknownKey(Struct):
    principal: str
    operation: str
    key: str
    effect_ref: str
    updated_at: Millis


class UncertainEffect(Struct):
    effect_key: str
    run_id: str
    action_kind: str
    target_ref: str
    attempt_id: str
    heartbeat_at: Millis


class DoctorResult(Struct):
    check: str
    integrity: list[str]  # ["ok"] or the problems found
    schema_version: int
    supported_schema_version: int
    db_path: str
    db_bytes: int
    wal_bytes: int
    keys: KeyCounts
    unknown_keys: list[UnknownKey]  # the oldest outcome_unknown keys, all principals
    oldest_in_progress_at: Millis | None
    uncertain_effects: list[UncertainEffect] = []  # effects waiting for effect.resolve
    live_leases: int = 0
