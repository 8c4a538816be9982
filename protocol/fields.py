"""The wire's names, enumerations and limits, each declared once (stdlib only).

protocol/methods.py derives its msgspec types from these (``Literal[...]`` of a
tuple here, ``Meta`` bounds from a limit here); the CLI's ``choices``, the hook
reporter's checks and the dashboard's topics import them from here. A hook may
import this module: it costs nothing.
"""

# Fields a caller may set on a fleet session, in storage order (ownership excluded).
SESSION_FIELDS = (
    "agent_session_id",
    "name",
    "cwd",
    "agent",
    "pinned",
    "last_attached_at",
    "exited",
    "parent",
    "prompt",
    "result",
    "transcript_path",
    "model",
    "effort",
    "target",
    "target_identity",
)

IDEM_STATES = ("in_progress", "completed", "outcome_unknown")
IDEM_OUTCOMES = ("completed", "abandoned")  # what a person decides for an unknown key
EFFECT_OUTCOMES = ("committed", "aborted")  # what a person decides for an uncertain effect
# Idempotency operations whose keys towerd settles from evidence after a crash
# (daemon/store/reconcile.py): a fleet row registered, a session spawned, a message sent.
REGISTER_OPERATION = "session.register"
SPAWN_OPERATION = "session.spawn"
MESSAGE_OPERATION = "session.message"
STORE_DEADLINE_S = 5.0  # every call that needs the store answers within this (issue 16)
# How long a client waits for an answer unless told: above STORE_DEADLINE_S, so that a
# stalled store's typed answer (unavailable, retry with the same key) arrives first.
CALL_TIMEOUT_S = 10.0
HEARTBEAT_KIND = "heartbeat"  # the event kind of a session's liveness beat, not activity
KV_SCOPES = ("global", "worker", "milestone")
WORKER_STATUSES = ("active", "stopping", "crashed")
DISPATCH_STATUSES = ("claimed", "running", "completed", "failed", "stuck", "canceled", "paused")
AUDIT_CATEGORIES = ("worker", "lease", "dispatch")
MESSAGE_STATUSES = ("queued", "delivered", "read")  # in the order a message goes through
MESSAGE_ACKS = MESSAGE_STATUSES[1:]  # what a reader may mark a message
ATTENTIONS = ("running", "needs_you", "done", "exited")
# The attention rule (docs/protocol.md §14): the kinds of a session's newest event that
# say it needs you, is done or ended; any other kind is running; an exited row exited.
ATTENTION_BY_KIND = {"Notification": "needs_you", "Stop": "done", "SessionEnd": "exited"}


def attention(exited: bool, last_kind: str | None) -> str:
    """A session's attention from its row's ``exited`` and its newest event's kind (the
    daemon's session.activity and towerctl notify both decide by this)."""
    if exited:
        return "exited"
    return ATTENTION_BY_KIND.get(last_kind or "", "running")


# A box (a daemon id) of the store, as ``boxes.list`` derives it: present (it answers, or
# its presence is within the TTL), lapsed (silent past the TTL, not yet declared dead),
# dead (declared dead by a live box).
BOX_STATES = ("present", "lapsed", "dead")

WATCH_TOPICS = ("fleet", "events", "idem", "leases", "effects", "dispatch")
AGENTS = ("claude", "codex")  # the agents whose hooks ``towerctl hook`` reads
GUARD_POLICIES = ("deny", "warn", "off")  # what a hook does when another session holds a path
HOOK_DECISIONS = ("allow", "deny", "warn")  # what ``hook.event`` answers a guarded tool call
PATH_LEASE_PREFIX = "path:"  # a path lease's resource is this and the real path
EFFECT_STATUSES = ("in_flight", "committed", "failed", "aborted", "uncertain")

# What an evidence probe concluded (``effect.settle``, an effect's ``probe.verdict``):
# committed (it happened), aborted (positive evidence it did not), unknown (cannot tell:
# tried again later), not_probeable (nothing recorded to probe with), holder_alive (its
# holder still runs: never probed), not_unsettled (not in flight or uncertain).
PROBE_VERDICTS = (
    "committed",
    "aborted",
    "unknown",
    "not_probeable",
    "holder_alive",
    "not_unsettled",
)

MAX_EVENT_KIND = 64  # characters of an event kind (a hook's hook_event_name)
MAX_AGENT_SESSION_ID = 256  # characters of an agent session id
