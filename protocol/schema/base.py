"""Shared field types, enumerations and validation helpers of the wire's Structs."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

from msgspec import Meta, Struct

from towerd.protocol import fields, naming

# --- enumerations, from protocol/fields.py (and naming.py) --------------------------
# Declared once there, as tuples a hook can import; each Literal here is built from
# its tuple. mypy cannot read a Literal built at runtime: to it these are plain str.

if TYPE_CHECKING:
    IdemState = str
    IdemOutcome = str
    EffectOutcome = str
    MessageAck = str
    ActionKind = str
    EffectStatus = str
    WorkerStatus = str
    DispatchStatus = str
    AuditCategory = str
    KvScope = str
    Attention = str
    MessageStatus = str
    WatchTopic = str
    Agent = str
    GuardPolicy = str
    HookDecision = str
    BoxState = str
else:
    IdemState = Literal[fields.IDEM_STATES]
    IdemOutcome = Literal[fields.IDEM_OUTCOMES]
    EffectOutcome = Literal[fields.EFFECT_OUTCOMES]
    MessageAck = Literal[fields.MESSAGE_ACKS]
    ActionKind = Literal[naming.ACTION_KINDS]
    EffectStatus = Literal[fields.EFFECT_STATUSES]
    WorkerStatus = Literal[fields.WORKER_STATUSES]
    DispatchStatus = Literal[fields.DISPATCH_STATUSES]
    AuditCategory = Literal[fields.AUDIT_CATEGORIES]
    KvScope = Literal[fields.KV_SCOPES]
    Attention = Literal[fields.ATTENTIONS]
    MessageStatus = Literal[fields.MESSAGE_STATUSES]
    WatchTopic = Literal[fields.WATCH_TOPICS]
    Agent = Literal[fields.AGENTS]
    GuardPolicy = Literal[fields.GUARD_POLICIES]
    HookDecision = Literal[fields.HOOK_DECISIONS]
    BoxState = Literal[fields.BOX_STATES]


# --- shared field types ------------------------------------------------------

UUID_PATTERN = "^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$"

SessionId = Annotated[str, Meta(pattern=UUID_PATTERN, description="lowercase hyphenated UUID")]
INT64_MAX = 2**63 - 1  # SQLite's integers are signed 64-bit
Millis = Annotated[
    int, Meta(ge=0, le=INT64_MAX, description="milliseconds since the Unix epoch, UTC")
]
Operation = Annotated[str, Meta(min_length=1, max_length=128)]
IdemKey = Annotated[str, Meta(min_length=1, max_length=255)]
EffectRef = Annotated[str, Meta(min_length=1, max_length=255)]
Pid = Annotated[int, Meta(ge=1, le=2**31 - 1)]
DaemonId = Annotated[str, Meta(min_length=1, max_length=64)]  # a box of the store
PageLimit = Annotated[int, Meta(ge=1, le=5000)]
Cursor = Annotated[int, Meta(ge=0, le=INT64_MAX)]

DEFAULT_PAGE_LIMIT = 500


MAX_VALUE_DEPTH = 100  # nesting levels of a free-form value (payload, result, entry)


def _require_printable(field: str, value: str | None) -> None:
    if value is not None and not value.isprintable():
        raise ValueError(f"`{field}` must contain printable characters only")


def _require_shallow(field: str, value: Any) -> None:
    """Refuse free-form values nested deeper than MAX_VALUE_DEPTH (checked without recursion)."""
    if not isinstance(value, dict | list | tuple):
        return  # a scalar or None, as most payloads and results are
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = [*item.keys(), *item.values()]
        elif isinstance(item, list | tuple):
            children = list(item)
        else:
            continue
        if depth > MAX_VALUE_DEPTH:
            raise ValueError(f"`{field}` nests deeper than {MAX_VALUE_DEPTH} levels")
        stack.extend((child, depth + 1) for child in children)


class Empty(Struct):
    """Params of a method that takes none (extra fields are ignored)."""
