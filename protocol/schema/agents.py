"""The agent's own loop: hook.event (a hook's event, its session and its path leases),
path.claim / path.release, and event.last_seen (what ``hooks status`` shows)."""

from __future__ import annotations

from typing import Annotated, Any

from msgspec import Meta, Struct

from towerd.protocol.schema.base import (
    Agent,
    GuardPolicy,
    HookDecision,
    Millis,
    Pid,
    SessionId,
    _require_shallow,
)
from towerd.protocol.schema.effects import Resource
from towerd.protocol.schema.trail import AgentSessionId, EventKind

MAX_PATHS = 256  # paths in one hook.event, path.claim or path.release
# Linux's PATH_MAX (4096 bytes) less its NUL: no tool opens a longer path, and each
# shorter one (its characters no more than its bytes) is guarded. It was 4000, and a
# path of 4001-4095 characters below a leased directory went unguarded.
MAX_PATH_CHARS = 4095
AbsolutePath = Annotated[str, Meta(min_length=1, max_length=MAX_PATH_CHARS, pattern="^/")]
ShortText = Annotated[str, Meta(max_length=4096)]
PathLeaseTtl = Annotated[int, Meta(ge=5_000, le=7 * 24 * 3600 * 1000)]
DEFAULT_PATH_LEASE_TTL_MS = 30 * 60 * 1000  # idle time after the last edit of a path


def _require_real_paths(field: str, paths: list[str]) -> None:
    """A path lease is matched by name (``path:<path>`` and the names above it), so a
    leased path must be the one name a real path has: ``/a/b/`` or ``/a/../a/b`` would
    be a lease that covers nothing. The clients send ``realpath``'s answer; anything
    else is refused rather than guessed at (the daemon cannot resolve a caller's
    symbolic links)."""
    for path in paths:
        if path == "/":
            continue
        if "\0" in path or any(part in ("", ".", "..") for part in path.split("/")[1:]):
            raise ValueError(
                f"`{field}` holds {path[:200]!r}, which is not a real path: give it absolute, "
                "without '.' or '..' components, '//', a trailing '/' or NUL (as realpath "
                "prints it)"
            )


class HookEventParams(Struct):
    """One agent hook event. The daemon files it as ``event.record`` does; a session it
    does not know is registered (from ``cwd``, ``transcript_path``, ``model``), the
    session's agent process becomes ``agent_pid`` (the hook's nearest non-shell
    ancestor), and ``paths`` (real paths a PreToolUse is about to write) are leased to
    the session as ``path:<path>`` unless another live session holds them."""

    kind: EventKind
    agent: Agent
    session_id: SessionId | None = None  # TOWERD_SESSION_ID, when a wrapper set it
    agent_session_id: AgentSessionId | None = None
    payload: Any = None
    agent_pid: Pid | None = None
    cwd: AbsolutePath | None = None
    transcript_path: ShortText | None = None
    model: ShortText | None = None
    paths: Annotated[list[AbsolutePath], Meta(max_length=MAX_PATHS)] = []
    guard: GuardPolicy = "deny"

    def __post_init__(self) -> None:
        _require_shallow("payload", self.payload)
        _require_real_paths("paths", self.paths)


class PathHolder(Struct):
    """A live path lease that stands in a caller's way."""

    path: str  # the path leased (a target itself, or a directory above or below it)
    target: str  # the path asked for
    session_id: str | None  # the holding session, when the lease has one
    name: str | None
    agent: str | None
    cwd: str | None
    holder: str  # principal and pid, as lease.list says it
    holder_pid: int | None
    since: Millis  # when the lease was granted
    expires_at: Millis


class HookEventResult(Struct, omit_defaults=True):
    event_id: int
    at: Millis
    session_id: str | None  # the fleet session the event was filed under
    decision: HookDecision = "allow"
    reason: str | None = None  # for the agent: who holds what, and what to do
    conflicts: list[PathHolder] = []
    leased: list[str] = []  # the paths now leased to the session
    registered: bool = False  # the event registered its session
    # The principal's events quota (--quota) was full: the event is not in the trail
    # (event_id 0); the session and the guard were kept as ever.
    unfiled: bool = False
    # Paths allowed but not leased: the principal's lease quota (--quota) was full.
    unleased: list[str] = []
    # The shared store was unreachable: the event waits in the daemon's outbox and is
    # filed when the store returns (event_id 0 until then); nothing was decided.
    queued: bool = False


class PathClaimParams(Struct):
    """Lease paths (files or directories) to a session: ``session_id``, or the session
    whose agent process is ``agent_pid`` (the caller's nearest non-shell ancestor)."""

    paths: Annotated[list[AbsolutePath], Meta(min_length=1, max_length=MAX_PATHS)]
    session_id: SessionId | None = None
    agent_pid: Pid | None = None
    ttl_ms: PathLeaseTtl | None = None  # default: the daemon's --path-lease-ttl

    def __post_init__(self) -> None:
        _require_real_paths("paths", self.paths)


class PathLease(Struct):
    path: str
    resource: Resource
    fencing_token: int
    expires_at: Millis


class PathClaimResult(Struct):
    session_id: str
    leases: list[PathLease]


class PathReleaseParams(Struct):
    """Release the path leases on these paths and below them: the given session's, the
    caller's agent session's, or, from a process that is no session's, whoever's."""

    paths: Annotated[list[AbsolutePath], Meta(min_length=1, max_length=MAX_PATHS)]
    session_id: SessionId | None = None
    agent_pid: Pid | None = None

    def __post_init__(self) -> None:
        _require_real_paths("paths", self.paths)


class PathReleaseResult(Struct):
    released: list[str]  # the paths whose leases went
    session_id: str | None  # whose (None: released for whoever held them)


class EventKindSeen(Struct):
    agent: str | None  # the agent of the session it was filed under (None: no session)
    kind: str
    last_at: Millis
    count: int


class EventLastSeenResult(Struct):
    kinds: list[EventKindSeen]  # by agent, then kind
