"""What a ``fleet restore`` window runs first: it starts the agent only if the launch's
claim is still the one the run made when it asked tmux for the window.

A run killed while its tmux call was still making the window leaves that call going;
a rerun settles the dead run's claim (after the longest a tmux call may take) and, with
no sign of the agent, launches the session itself. A tmux server stalled for longer
still made the orphan's window afterwards, and the session ran twice. The window now
asks the daemon first (``python -P -m towerd.client.restore_guard SOCKET PRINCIPAL KEY
REF SESSION -- ARGV``, the run's own socket and principal, "" for none):

* the claim in progress under REF: the run is alive and launching: this window settles
  it ``completed`` (under REF) before it starts the agent, so a window that stalls
  between its check and the agent's start is on the record as launched, and a rerun
  after its run's death finds the launch done instead of making another;
* completed under REF by its own run (a result naming the window: the run stopped
  waiting for the agent's SessionStart while this check was still starting): start;
* settled ``outcome_unknown`` under REF (the run died): this window settles it
  ``completed`` itself, the daemon deciding between it and a rerun settling it
  ``abandoned``: the first wins;
* anything else (released, claimed again, completed from evidence): another launch is
  the session's, and this window exits without starting the agent;
* no daemon answering for DECIDE_S before this window sent a write: it does not start
  the agent either (the run, if alive, sees the window gone and releases the claim for
  a retry); once it sent one, it asks until the daemon answers (the same write sent
  twice is applied once, and the answer to the last is final);
* the agent cannot be executed after all: the window forgets the launch it recorded
  (``idem.reopen`` under REF), so a rerun starts the mended agent.

``TOWERD_SESSION_ID`` is set here, just before the agent is executed: the window's own
process carries none (the window blanks one the tmux server may have inherited), so a
rerun looking for evidence never takes this check for the agent. It carries
``TOWERD_RESTORE_GUARD=<session>`` instead, dropped before the agent starts: a rerun
waits while a check of the session is still deciding.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any

from towerd.client import Client
from towerd.protocol import fields
from towerd.protocol.errors import (
    Conflict,
    IdempotencyKeyUnknown,
    Internal,
    TowerdError,
    Unavailable,
)

OPERATION = "fleet.restore"  # the idempotency operation of every launch (client/restore.py)
GUARD_ENV = "TOWERD_RESTORE_GUARD"  # in a window's environment until its agent starts
# In the result of a launch its run completed (client/restore.py): the window's pane.
RUN_MARK = "pane_id"


def own_pane() -> str:
    """This window's tmux pane (``%N``, unique in its server); outside tmux, this process."""
    return os.environ.get("TMUX_PANE") or f"pid {os.getpid()}"


def settled_by_window() -> dict[str, str]:
    """The result of a launch this window settled. Both marks name a pane, since one claim
    may get two windows (tmux failing after it made the first, the run then asking for
    another), and only the window named starts its agent."""
    return {"settled": "window", "pane": own_pane()}


REFUSED = 3  # exit status of a window that did not start its agent
CALL_TIMEOUT_S = fields.CALL_TIMEOUT_S  # each call to the daemon
# How long a window that has sent no write asks the daemon before it gives up without
# starting its agent, and so about how long a rerun waits for a window still deciding
# (client/restore.py; a window whose write is unanswered asks longer, and a rerun that
# stops waiting then only races it at the daemon, where the first to be applied wins).
DECIDE_S = 60.0


def may_start(
    client: Client, key: str, ref: str, on_write: Callable[[], None] = lambda: None
) -> str | None:
    """None if this window is the launch of the claim ``ref``; else why not. Asked again
    after a lost answer, it finds its own decision (``_decided_by_this_window``) or makes
    it again: a write sent twice is applied once, in order, behind the first. A write
    refused because the claim moved meanwhile (its run completed it, this window's own
    earlier write landed first, a rerun settled or claimed it) looks again; a claim
    never goes back to a state this writes from, so that ends. ``on_write`` is called
    before each write is sent."""
    try:
        record = client.idem_get(OPERATION, key)
    except IdempotencyKeyUnknown:
        return "its claim was released: another restore run launches the session"
    if record["effect_ref"] != ref:
        return "the session was claimed again by another restore run"
    if _completed_by_its_run(record) or _decided_by_this_window(record):
        return None
    if record["state"] == "in_progress":
        # Recorded before the agent starts: a window that then stalls (a stopped
        # process, a swapped-out machine) past a rerun's wait has its launch on the
        # record, and the rerun, which settles only an unknown claim, finds it done
        # instead of launching the session beside it.
        try:
            on_write()
            client.idem_complete(OPERATION, key, result=settled_by_window(), effect_ref=ref)
        except (Conflict, IdempotencyKeyUnknown):
            return may_start(client, key, ref, on_write)  # moved meanwhile: look again
        return None
    if record["state"] != "outcome_unknown":
        return f"its claim is {record['state']}: the session was settled by another run"
    try:
        on_write()
        client.idem_resolve(OPERATION, key, "completed", result=settled_by_window(), effect_ref=ref)
    except (Conflict, IdempotencyKeyUnknown):
        return may_start(client, key, ref, on_write)  # settled meanwhile: look again
    return None


def _completed_by_its_run(record: Any) -> bool:
    """Completed by its run for this window: the run names the pane it made."""
    result = record.get("result")
    return (
        record["state"] == "completed"
        and isinstance(result, dict)
        and result.get(RUN_MARK) == own_pane()
    )


def _decided_by_this_window(record: Any) -> bool:
    """Settled by this window (its result names this window's pane; the caller compared
    the claim's effect_ref)."""
    return record["state"] == "completed" and record.get("result") == settled_by_window()


def decide(socket_path: str, principal: str, key: str, ref: str) -> str | None:
    """``may_start`` until the daemon answers it, on a new connection each time. A lost
    answer to this window's write leaves it applied or still queued behind the daemon's
    writer: asked again, the window finds it or sends it again, and the answer to that is
    final. So once a write was sent the window asks until it is answered, however long
    the daemon takes: a window that gave up (after one look, then after 60 s) left its
    write to be applied later with no agent started, a launch on the record that nothing
    launched. Before any write, it gives up after DECIDE_S. An answer that asking again
    would not change (a daemon of another protocol, a refusal) ends it at once."""
    deadline = time.monotonic() + DECIDE_S
    wrote = False
    said_waiting = False

    def on_write() -> None:
        nonlocal wrote
        wrote = True

    while True:
        try:
            with _client(socket_path, principal) as client:
                return may_start(client, key, ref, on_write)
        # No answer, or a failure that may pass (a locked database): a write sent may yet
        # be applied, and asking again may be answered.
        except (OSError, Unavailable, Internal) as exc:
            late = time.monotonic() >= deadline
            if late and not wrote:
                return f"the daemon did not answer for {DECIDE_S:g} s ({exc})"
            if late and not said_waiting:
                print(f"towerd: waiting for the daemon to answer this window's record of its "
                      f"launch ({exc}): it may have been applied", file=sys.stderr)  # fmt: skip
                said_waiting = True
            time.sleep(1.0 if late else 0.2)
        except TowerdError as exc:  # an answer that asking again will not change
            advice = f"; if it was applied: towerctl idem reopen {OPERATION} {key}"
            return f"the daemon refused ({exc.code}: {exc.message}){advice if wrote else ''}"


def undo_own_launch(socket_path: str, principal: str, key: str, ref: str) -> str:
    """The agent could not be executed after the launch was recorded: forget the launch
    (``idem.reopen`` of the outcome as read, under this claim), so that a rerun, once
    the agent is mended, starts it; asked again on a lost answer for up to DECIDE_S (a
    reopen applied late forgets a launch that never ran: harmless). Says what became of
    the launch."""
    deadline = time.monotonic() + DECIDE_S
    while True:
        try:
            with _client(socket_path, principal) as client:
                record = client.idem_get(OPERATION, key)
                mine = _decided_by_this_window(record) or _completed_by_its_run(record)
                if record["effect_ref"] != ref or not mine:
                    return "its launch is not this window's record any more"
                why = "fleet restore: the agent could not be executed"
                client.idem_reopen(OPERATION, key, record["result"], effect_ref=ref, reason=why)
        except IdempotencyKeyUnknown:
            pass  # forgotten already (its lost answer's reopen was applied)
        except (OSError, TowerdError) as exc:
            if time.monotonic() < deadline:
                time.sleep(0.2)
                continue
            return (
                f"its launch stays recorded ({exc}); to launch it again this boot: towerctl "
                f"idem reopen {OPERATION} {key}"
            )
        return "its launch was forgotten: towerctl fleet restore again launches it"


def _client(socket_path: str, principal: str) -> Client:
    return Client(
        socket_path,
        timeout=CALL_TIMEOUT_S,
        client_name="fleet-restore-window",
        principal=principal or None,
    )


def main(argv: list[str]) -> int:
    try:
        socket_path, principal, key, ref, session_id, separator, *command = argv
    except ValueError:
        separator, command = "", []
    if separator != "--" or not command:
        print("usage: restore_guard SOCKET PRINCIPAL KEY REF SESSION -- ARGV", file=sys.stderr)
        return 2
    if not os.access(command[0], os.X_OK):  # before the claim is settled for it
        print(f"towerd: not starting session {session_id}: {command[0]} cannot be run",
              file=sys.stderr)  # fmt: skip
        return REFUSED
    why = decide(socket_path, principal, key, ref)
    if why is not None:
        print(f"towerd: not starting session {session_id}: {why}", file=sys.stderr)
        return REFUSED
    os.environ.pop(GUARD_ENV, None)
    os.environ["TOWERD_SESSION_ID"] = session_id
    try:
        os.execv(command[0], command)
    except OSError as exc:  # after the launch was recorded: nothing started, undo it
        print(f"towerd: cannot start {command[0]}: {exc.strerror or exc}; "
              f"{undo_own_launch(socket_path, principal, key, ref)}", file=sys.stderr)  # fmt: skip
    return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
