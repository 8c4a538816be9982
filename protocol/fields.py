"""Field names shared by the typed messages and the light clients (stdlib only)."""

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
