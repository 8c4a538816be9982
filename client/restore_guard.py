"""What a ``fleet restore`` window runs first: it starts the agent only if the launch's
claim is still the one the run made when it asked tmux for the window.

A run killed while its tmux call was still making the window leaves that call going;
a rerun settles the dead run's claim (after the longest a tmux call may take) and, with
no sign of the agent, launches the session itself. A tmux server stalled for longer
still made the orphan's window afterwards, and the session ran twice. The window now
asks the daemon first (``python -m towerd.client.restore_guard SOCKET PRINCIPAL KEY
REF SESSION -- ARGV``, the run's own socket and principal, "" for none):

* the claim in progress under REF: the run is alive and launching: start;
* settled ``outcome_unknown`` under REF (the run died): this window settles it
  ``completed`` itself, the daemon deciding between it and a rerun settling it
  ``abandoned``: the first wins;
* anything else (released, claimed again, completed): another launch is the
  session's, and this window exits without starting the agent;
* no daemon answering: it does not start the agent either (the run, if alive, sees
  the window gone and releases the claim for a retry).

``TOWERD_SESSION_ID`` is set here, just before the agent is executed: the window's own
process carries none, so a rerun looking for evidence never takes this check for the
agent.
"""

from __future__ import annotations

import os
import sys

from towerd.client import Client
from towerd.protocol.errors import Conflict, IdempotencyKeyUnknown, TowerdError

OPERATION = "fleet.restore"  # the idempotency operation of every launch (client/restore.py)
REFUSED = 3  # exit status of a window that did not start its agent


def may_start(client: Client, key: str, ref: str) -> str | None:
    """None if this window is the launch of the claim ``ref``; else why not."""
    try:
        record = client.idem_get(OPERATION, key)
    except IdempotencyKeyUnknown:
        return "its claim was released: another restore run launches the session"
    if record["effect_ref"] != ref:
        return "the session was claimed again by another restore run"
    if record["state"] == "in_progress":
        return None
    if record["state"] != "outcome_unknown":
        return f"its claim is {record['state']}: the session was settled by another run"
    try:
        client.idem_resolve(
            OPERATION, key, "completed", result={"settled": "window"}, effect_ref=ref
        )
    except (Conflict, IdempotencyKeyUnknown):
        return "another restore run settled the dead run's claim first"
    return None


def main(argv: list[str]) -> int:
    socket_path, principal, key, ref, session_id, separator, *command = argv
    if separator != "--" or not command:
        print("usage: restore_guard SOCKET PRINCIPAL KEY REF SESSION -- ARGV", file=sys.stderr)
        return 2
    try:
        with Client(
            socket_path, client_name="fleet-restore-window", principal=principal or None
        ) as client:
            why = may_start(client, key, ref)
    except (OSError, TowerdError) as exc:
        why = f"the daemon did not answer ({exc})"
    if why is not None:
        print(f"towerd: not starting session {session_id}: {why}", file=sys.stderr)
        return REFUSED
    os.environ["TOWERD_SESSION_ID"] = session_id
    os.execv(command[0], command)
    return 127  # pragma: no cover - execv does not return


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
