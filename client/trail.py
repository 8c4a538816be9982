"""``towerctl events tail [SESSION] [--kind K]...``: print hook events as they arrive.

It first prints the last ``CONTEXT`` matching events (oldest first), then every new
one, one line each (``--json``: one JSON object per line, the event as the daemon
sent it). The scope is that of ``event.list``: the given id lists combine with OR,
an empty list matches nothing; without ``--kind``, heartbeats are left out.

Exit status: 0 on Ctrl-C (or when the reader of stdout goes away), 1 the daemon
answered an error, 3 it could not be reached or went away. A watch the daemon
dropped for falling behind (``too_slow``) is renewed: a notice on stderr, then the
events recorded in between (up to a page of them), then tailing goes on.
"""

from __future__ import annotations

import json
import os
import sys
import time

from towerd.client.cli.output import printable, say
from towerd.client.cli.registry import call_timeout
from towerd.client.sync import Client
from towerd.protocol import fields
from towerd.protocol.errors import TooSlow, TowerdError, Unavailable

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable
    from typing import Any

    from towerd.client.results import TrailEvent

CONTEXT = 10  # events shown before tailing
CATCH_UP = 200  # events fetched after a renewed watch (the daemon's largest page)
HEARTBEAT = fields.HEARTBEAT_KIND
SUMMARY_WIDTH = 60
EXIT_OK, EXIT_ERROR, EXIT_UNAVAILABLE = 0, 1, 3


def tail_events(args: Any, scope: dict[str, Any]) -> int:
    """Print the trail's recent events, then each new one, until Ctrl-C."""
    tail = _Tail(args, scope)
    try:
        return tail.run()
    except KeyboardInterrupt:
        return EXIT_OK
    except BrokenPipeError:
        # Whoever read our output is gone (`| head`): stop quietly, and keep Python from
        # complaining when it flushes stdout at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK
    except Unavailable as exc:
        say(f"towerctl: {exc.code}: {exc.message}", to_stderr=True)
        return EXIT_UNAVAILABLE
    except TowerdError as exc:
        say(f"towerctl: {exc.code}: {exc.message}", to_stderr=True)
        return EXIT_ERROR


class _Tail:
    def __init__(self, args: Any, scope: dict[str, Any]) -> None:
        self.args = args
        self.scope = scope
        self.kinds: list[str] | None = args.kinds
        self.last_seen: int | None = None  # the newest event id printed

    def client(self) -> Client:
        return Client(
            self.args.socket,
            timeout=call_timeout(self.args),
            principal=self.args.principal,
            client_name="towerctl",
        )

    def run(self) -> int:
        limit = CONTEXT
        while True:
            watcher = self.client()
            try:
                frames = watcher.watch(["events"])
                next(frames)  # subscribed: every event from now on is pushed
                # What came before: read after subscribing, so no event falls between
                # the two; one in both is printed once (by id).
                self.catch_up(limit)
                for frame in frames:
                    if frame.get("event") == "events":
                        self.show(frame["data"])
            except TooSlow as exc:
                print(
                    f"towerctl: {exc.code}: the daemon dropped this watch for falling behind "
                    "(is the terminal slow?); watching again",
                    file=sys.stderr,
                    flush=True,
                )
                limit = CATCH_UP
            finally:
                watcher.close()

    def catch_up(self, limit: int) -> None:
        """Print the newest ``limit`` matching events not printed yet, oldest first."""
        events: list[TrailEvent] = []  # newest first
        before = None
        more = False
        with self.client() as client:
            while len(events) < limit:
                # A page may hold fewer than asked for (the daemon caps its bytes).
                page = client.event_list(
                    **self.scope, kinds=self.kinds, before=before, limit=limit - len(events)
                )
                for event in page["events"]:
                    if self.last_seen is not None and event["event_id"] <= self.last_seen:
                        break
                    events.append(event)
                else:
                    before = page.get("next_before")
                    more = before is not None
                    if more:
                        continue
                more = False
                break
        if more and self.last_seen is not None:
            print(
                f"towerctl: more than {limit} events came in meanwhile; only the newest "
                f"{limit} are shown",
                file=sys.stderr,
                flush=True,
            )
        for event in reversed(events):
            self.show(event)

    def show(self, event: dict[str, Any]) -> None:
        event_id = event.get("event_id")
        if not isinstance(event_id, int):
            return
        if self.last_seen is not None and event_id <= self.last_seen:
            return  # printed already (it was in the catch-up page too)
        if not matches(event, self.scope, self.kinds):
            return
        self.last_seen = event_id
        if self.args.json:
            line = json.dumps(event, default=_jsonable)
        else:
            line = printable(format_event(event))
        print(line, flush=True)


def matches(event: dict[str, Any], scope: dict[str, Any], kinds: Iterable[str] | None) -> bool:
    """``event.list``'s filter: given id lists OR-combined (an empty one matches nothing,
    an absent one does not filter); heartbeats only when asked for by kind."""
    if kinds is None:
        if event.get("kind") == HEARTBEAT:
            return False
    elif event.get("kind") not in set(kinds):
        return False
    lists = {
        column: ids
        for column, ids in (
            ("session_id", scope.get("session_ids")),
            ("agent_session_id", scope.get("agent_session_ids")),
        )
        if ids is not None
    }
    if not lists:
        return True
    return any(event.get(column) in ids for column, ids in lists.items())


# --- one line per event -------------------------------------------------------------------


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes | bytearray):
        import base64

        return base64.b64encode(value).decode()
    raise TypeError(f"cannot show {type(value).__name__} as JSON")


def _clip(text: str, width: int = SUMMARY_WIDTH) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


def clock(millis: Any) -> str:
    """UTC HH:MM:SS.mmm."""
    if not isinstance(millis, int):
        return "--:--:--.---"
    return time.strftime("%H:%M:%S", time.gmtime(millis // 1000)) + f".{millis % 1000:03d}"


# What a payload's summary shows, in order: top-level fields, then fields of tool_input.
_SUMMARY_FIELDS = (
    "tool_name", "agent_type", "message", "prompt", "source", "reason", "trigger", "error",
)  # fmt: skip
_TOOL_INPUT_FIELDS = ("command", "file_path", "path", "pattern", "url", "query", "description")


def summary(payload: Any) -> str:
    """A few words about what happened: tool and its target, message, prompt..."""
    if payload is None:
        return ""
    if not isinstance(payload, dict):
        return _clip(json.dumps(payload, default=_jsonable))
    parts = []
    for name in _SUMMARY_FIELDS:
        value = payload.get(name)
        if isinstance(value, str) and value.strip():
            parts.append(_clip(value) if name in ("message", "prompt", "error") else value)
        if name == "tool_name":
            tool_input = payload.get("tool_input")
            if isinstance(tool_input, dict):
                for field in _TOOL_INPUT_FIELDS:
                    target = tool_input.get(field)
                    if isinstance(target, str) and target.strip():
                        parts.append(_clip(target))
                        break
    return _clip(" ".join(parts), 2 * SUMMARY_WIDTH)


def _short(session_id: Any) -> str:
    return session_id[:8] if isinstance(session_id, str) and session_id else "-"


def format_event(event: dict[str, Any]) -> str:
    """``HH:MM:SS.mmm  KIND  SESSION(8)  AGENT_SESSION  summary``."""
    agent = event.get("agent_session_id")
    line = (
        f"{clock(event.get('at'))}  {str(event.get('kind')):<16}  "
        f"{_short(event.get('session_id')):<8}  {agent if isinstance(agent, str) else '-'}"
    )
    about = summary(event.get("payload"))
    return f"{line}  {about}" if about else line
