"""Fleet rows and their methods: session.register/update/remove, fleet.*."""

from __future__ import annotations

from typing import Any

from msgspec import UNSET, Struct, UnsetType

from towerd.protocol.fields import SESSION_FIELDS
from towerd.protocol.schema.base import (
    DEFAULT_PAGE_LIMIT,
    Cursor,
    DaemonId,
    IdemKey,
    Millis,
    PageLimit,
    SessionId,
    _require_printable,
    _require_shallow,
)

# --- fleet -------------------------------------------------------------------


class SessionRow(Struct):
    """One fleet row as clients see it: the session's fields plus its ownership."""

    session_id: str
    agent_session_id: str | None
    name: str | None
    cwd: str
    agent: str
    pinned: bool
    last_attached_at: Millis | None
    exited: bool
    parent: str | None
    prompt: str | None
    result: str | None
    transcript_path: str | None
    model: str | None
    effort: str | None
    target: str | None
    target_identity: str | None
    daemon_id: str
    owner_epoch: int
    updated_at: Millis
    # The agent process its hooks report from (towerctl hook), and whether it still
    # runs; both None when towerd knows no agent process for the session.
    agent_pid: int | None = None
    live: bool | None = None


class SessionFields(Struct, kw_only=True):
    """The fields a caller sets on a session (``SESSION_FIELDS``), with the defaults a
    new or rewritten session gets: the base of every message that carries a whole
    session (``fleet.write``'s entries, ``session.register``, the legacy importer's
    entries). ``SessionRow`` spells them out in the order every fleet answer encodes,
    and ``SessionUpdateParams`` with ``UNSET`` defaults; both are checked below."""

    agent_session_id: str | None = None
    name: str | None = None
    cwd: str
    agent: str
    pinned: bool = False
    last_attached_at: Millis | None = None
    exited: bool = False
    parent: SessionId | None = None
    prompt: str | None = None
    result: str | None = None
    transcript_path: str | None = None
    model: str | None = None
    effort: str | None = None
    target: str | None = None
    target_identity: str | None = None


class SessionEntry(SessionFields, kw_only=True):
    """A whole session as ``fleet.write`` replaces it (fields left out are cleared)."""

    session_id: SessionId


class SessionRegisterParams(SessionFields, kw_only=True):
    session_id: SessionId | None = None
    idempotency_key: IdemKey | None = None

    def __post_init__(self) -> None:
        _require_printable("idempotency_key", self.idempotency_key)


class SessionRegisterResult(Struct):
    session_id: str


class SessionUpdateParams(Struct):
    """Only the fields present are rewritten; ``null`` clears a nullable field."""

    session_id: SessionId
    agent_session_id: str | None | UnsetType = UNSET
    name: str | None | UnsetType = UNSET
    cwd: str | UnsetType = UNSET
    agent: str | UnsetType = UNSET
    pinned: bool | UnsetType = UNSET
    last_attached_at: Millis | None | UnsetType = UNSET
    exited: bool | UnsetType = UNSET
    parent: SessionId | None | UnsetType = UNSET
    prompt: str | None | UnsetType = UNSET
    result: str | None | UnsetType = UNSET
    transcript_path: str | None | UnsetType = UNSET
    model: str | None | UnsetType = UNSET
    effort: str | None | UnsetType = UNSET
    target: str | None | UnsetType = UNSET
    target_identity: str | None | UnsetType = UNSET

    def given_fields(self) -> dict[str, Any]:
        return {
            name: value for name in SESSION_FIELDS if (value := getattr(self, name)) is not UNSET
        }


class SessionIdParams(Struct):
    session_id: SessionId


class FleetGetParams(Struct):
    """``daemon_id``: only that box's row. By default, on the embedded store, this
    daemon's own rows; on a store several boxes share, the row whatever its box."""

    session_id: SessionId
    daemon_id: DaemonId | None = None


class SessionRemoveResult(Struct):
    session_id: str
    removed: bool


class FleetListParams(Struct):
    """``daemon_id``: only that box's rows. By default, on the embedded store, this
    daemon's own rows; on a store several boxes share, every box's rows."""

    limit: PageLimit = DEFAULT_PAGE_LIMIT
    cursor: Cursor | None = None
    daemon_id: DaemonId | None = None


class FleetListResult(Struct):
    sessions: list[SessionRow]
    next_cursor: int | None = None


class FleetWriteParams(Struct):
    sessions: list[SessionEntry] = []
    removed: list[SessionId] = []


class FleetWriteResult(Struct):
    written: int
    removed: int
    dropped: list[str]
    relinked: int


class LegacyImportParams(Struct):
    """Entries of a legacy fleet file; each is validated on its own."""

    entries: list[Any]

    def __post_init__(self) -> None:
        _require_shallow("entries", self.entries)


class LegacySkip(Struct):
    index: int
    reason: str
    agent_session_id: str | None = None


class LegacyImported(Struct):
    agent_session_id: str
    session_id: str


class LegacyImportResult(Struct):
    imported: int
    skipped: int
    skips: list[LegacySkip]
    sessions: list[LegacyImported]


class FleetAdoptParams(Struct):
    daemon_id: DaemonId


class FleetAdoptResult(Struct):
    adopted: int  # fleet rows moved
    from_daemon_id: str
    daemon_id: str
    owner_epoch: int
    keys_adopted: int = 0  # idempotency keys now reconciled by this daemon
    keys_marked_unknown: int = 0  # of those, in progress and without evidence
    keys_completed_from_evidence: int = 0


# One declaration of the session fields: the Structs that spell them out again agree.
assert SessionFields.__struct_fields__ == SESSION_FIELDS
assert SessionRow.__struct_fields__[1:-5] == SESSION_FIELDS
assert SessionUpdateParams.__struct_fields__[1:] == SESSION_FIELDS
