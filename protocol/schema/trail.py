"""The hook event trail, session messages, watch and the restore plan."""

from __future__ import annotations

from typing import Annotated, Any

from msgspec import Meta, Struct

from towerd.protocol import fields
from towerd.protocol.schema.base import (
    Attention,
    Cursor,
    DaemonId,
    IdemKey,
    MessageAck,
    MessageStatus,
    Millis,
    SessionId,
    WatchTopic,
    _require_printable,
    _require_shallow,
)

# --- the event trail, messages, watch, restore plan ------------------------------------------

EventKind = Annotated[str, Meta(min_length=1, max_length=fields.MAX_EVENT_KIND)]
AgentSessionId = Annotated[str, Meta(min_length=1, max_length=fields.MAX_AGENT_SESSION_ID)]
DEFAULT_EVENT_PAGE, MAX_EVENT_PAGE = 50, 200
MAX_SCOPE_IDS = 1000  # ids (or kinds) in one list of event.list / session.activity
DEFAULT_EVENT_MAX_PAYLOAD = 64 * 1024


class EventRecordParams(Struct):
    kind: EventKind  # a hook's hook_event_name verbatim: Notification, Stop, ...
    session_id: SessionId | None = None
    agent_session_id: AgentSessionId | None = None
    payload: Any = None

    def __post_init__(self) -> None:
        _require_shallow("payload", self.payload)


class EventRecordResult(Struct):
    event_id: int
    at: Millis
    session_id: str | None  # the fleet session the event was filed under, if known


class TrailEvent(Struct):
    event_id: int
    session_id: str | None
    agent_session_id: str | None
    kind: str
    at: Millis
    payload: Any


class EventListParams(Struct):
    """An absent id list does not filter; an empty one matches nothing; the two combine
    with OR."""

    session_ids: Annotated[list[SessionId], Meta(max_length=MAX_SCOPE_IDS)] | None = None
    agent_session_ids: Annotated[list[AgentSessionId], Meta(max_length=MAX_SCOPE_IDS)] | None = None
    kinds: Annotated[list[EventKind], Meta(max_length=MAX_SCOPE_IDS)] | None = None
    before: Cursor | None = None
    limit: Annotated[int, Meta(ge=1, le=MAX_EVENT_PAGE)] = DEFAULT_EVENT_PAGE


class EventListResult(Struct):
    events: list[TrailEvent]  # newest first; heartbeats left out
    next_before: int | None = None


class SessionActivityParams(Struct):
    # default: every session of the boxes shown (daemon_id: that box's; else, on the
    # embedded store, this daemon's own; on a store several boxes share, every box's)
    session_ids: Annotated[list[SessionId], Meta(max_length=MAX_SCOPE_IDS)] | None = None
    daemon_id: DaemonId | None = None


class SessionActivity(Struct):
    session_id: str
    last_activity_at: Millis | None  # newest event, heartbeats included
    last_kind: str | None  # newest event that is not a heartbeat
    attention: Attention
    daemon_id: str  # the box whose fleet row it is
    live: bool | None = None  # its agent process runs (None: towerd knows no agent process)


class SessionActivityResult(Struct, omit_defaults=True):
    sessions: list[SessionActivity]
    truncated: bool = False  # sent (true) only when the list was cut to fit one frame


class SessionMessageParams(Struct):
    session_id: SessionId
    text: Annotated[str, Meta(min_length=1, max_length=65536)]
    idempotency_key: IdemKey | None = None

    def __post_init__(self) -> None:
        _require_printable("idempotency_key", self.idempotency_key)


class SessionMessageResult(Struct):
    message_id: str
    status: MessageStatus


class MessageRecord(Struct):
    message_id: str
    session_id: str
    agent_session_id: str | None
    text: str
    status: MessageStatus
    created_at: Millis
    updated_at: Millis


class MessageListParams(Struct):
    session_id: SessionId
    status: MessageStatus | None = None
    limit: Annotated[int, Meta(ge=1, le=500)] = 100


class MessageListResult(Struct, omit_defaults=True):
    messages: list[MessageRecord]  # oldest first
    truncated: bool = False  # sent (true) only when the list was cut to fit one frame


class MessageAckParams(Struct):
    message_id: Annotated[str, Meta(min_length=1, max_length=64)]
    status: MessageAck


WATCH_TOPICS = fields.WATCH_TOPICS


class WatchParams(Struct):
    topics: Annotated[list[WatchTopic], Meta(min_length=1)]


class WatchResult(Struct):
    """The snapshot of each chosen topic; then pushed ``{event, seq, data}`` frames."""

    snapshot: dict[str, Any]
    seq: int


class RestorePlanParams(Struct):
    """``daemon_id``: only that box's sessions. By default, on the embedded store, this
    daemon's own; on a store several boxes share, every box's (a box restoring its own
    sessions names itself: client/restore.py)."""

    daemon_id: DaemonId | None = None


class RestorePlanEntry(Struct):
    session_id: str
    daemon_id: str  # the box whose fleet row it is
    parent: str | None
    agent: str
    agent_session_id: str | None
    cwd: str
    name: str | None
    model: str | None
    effort: str | None
    target: str | None
    target_identity: str | None
    transcript_path: str | None
    last_activity_at: Millis | None


class RestorePlanResult(Struct, omit_defaults=True):
    sessions: list[RestorePlanEntry]  # newest activity first; a parent before its children
    truncated: bool = False  # sent (true) only when the list was cut to fit one frame
