"""``towerctl hook-report``: file an agent hook's JSON (stdin) as a trail event.

Every agent hook runs this, and agents feed a hook's output to the model, so it
prints nothing on stdout or stderr and exits 0 whatever happens: no daemon, a
stale socket, a hung daemon, garbage on stdin, an event of no known session, a
server that is not this user's own towerd (it is sent nothing, not even hello).
The whole run, stdin, connect and hello included, has a deadline of ``DEADLINE``
seconds, however slowly a server answers.

The event's kind is the hook's ``hook_event_name`` verbatim. It is filed under
the fleet session in ``TOWERD_SESSION_ID`` (which the wrapper sets) together
with the payload's ``session_id`` as the agent session id; without that
variable, or when the daemon does not know that session, under the agent session
id alone (the daemon files it under the session registered with it, if any).

The payload is the hook's JSON with every string longer than ``MAX_STRING``
characters cut (the cut is marked); if that is still over ``MAX_PAYLOAD`` bytes
as msgpack, only the top-level scalar fields are kept.

Imports are kept to what ``towerctl ping`` loads (JSON is read by the C scanner
that the json package wraps, without the package): it runs on every agent event
(tests/client/test_import_cost.py, bench/oneshot.py).
"""

from __future__ import annotations

import os
import sys
import time

from towerd.protocol import fields

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs hooks ~3 ms
if TYPE_CHECKING:
    from typing import Any

DEADLINE = 2.0  # seconds for the whole run: read stdin, connect, hello, record
MAX_INPUT = 64 * 1024 * 1024  # bytes of stdin read at most; a larger input is dropped
MAX_STRING = 4096  # characters of one string kept in the payload
MAX_PAYLOAD = 60 * 1024  # msgpack bytes of the payload (the daemon's default limit is 64 KiB)
SMALL_STRING = 512  # characters of a top-level string kept when only those are kept
MAX_NESTING = 64  # deeper values are replaced by a marker (the daemon refuses > 100)
MAX_KIND = fields.MAX_EVENT_KIND  # the daemon's limit on an event kind
MAX_AGENT_SESSION_ID = fields.MAX_AGENT_SESSION_ID  # and on an agent session id
TRUNCATED_KEY = "towerd_truncated"  # added when only the top-level scalars were kept


class _Null:
    """Stands in for sys.stdout and sys.stderr while reporting: stray output vanishes."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


def report(socket_path: str | None = None) -> int:
    """Record the hook event on stdin; always returns 0, never prints."""
    saved = sys.stdout, sys.stderr
    sys.stdout = sys.stderr = _Null()
    try:
        _report(socket_path, time.monotonic() + DEADLINE)
    except BaseException:  # noqa: BLE001, S110 - a hook must never fail, not even on Ctrl-C
        pass
    finally:
        sys.stdout, sys.stderr = saved
    return 0


def _report(socket_path: str | None, deadline: float) -> None:
    data = _read_stdin(deadline)
    if not data:
        return
    try:
        hook = parse_json(data)
    except (ValueError, StopIteration, RecursionError):  # not JSON or UTF-8; absurdly deep
        return
    if not isinstance(hook, dict):
        return
    kind = hook.get("hook_event_name")
    if not isinstance(kind, str) or not 0 < len(kind) <= MAX_KIND:
        return
    agent_session_id = hook.get("session_id")
    if not isinstance(agent_session_id, str) or not (
        0 < len(agent_session_id) <= MAX_AGENT_SESSION_ID
    ):
        agent_session_id = None
    session_id = _session_from_env()
    if session_id is None and agent_session_id is None:
        return  # the daemon could file it under nothing

    from towerd.client.sync import Client
    from towerd.protocol import lite
    from towerd.protocol.errors import BadArgs, NotFound

    payload = compact(hook, lite.packb)
    # Connect and hello within what is left; nothing is sent unless the server is this
    # user's own (Unauthorized, swallowed like any failure: the payload stays here).
    client = Client(
        socket_path, timeout=_left(deadline), client_name=f"hook-report/{os.getpid()}", codec="lite"
    )
    try:
        tries: list[tuple[str | None, str | None]] = (
            [(session_id, agent_session_id)] if session_id is not None else []
        )
        if agent_session_id is not None:
            tries.append((None, agent_session_id))  # the daemon may not know session_id
        for sid, aid in tries:
            try:
                try:
                    _record(client, deadline, kind, sid, aid, payload)
                except BadArgs:
                    # Something in the payload the daemon refuses (a lower
                    # --event-max-payload, say): once more with the top-level scalars.
                    small = top_level_scalars(hook, len(lite.packb(payload)), lite.packb)
                    if small == payload:
                        return
                    payload = small
                    _record(client, deadline, kind, sid, aid, payload)
                return
            except NotFound:
                continue  # no such session: file it by the agent session id alone
    finally:
        client.close()


def _record(
    client: Any, deadline: float, kind: str, sid: str | None, aid: str | None, payload: Any
) -> None:
    client.timeout = _left(deadline)  # bounds the whole call, however slow the answer
    client.event_record(kind, session_id=sid, agent_session_id=aid, payload=payload)


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("hook-report ran out of time")
    return left


def _read_stdin(deadline: float) -> bytes | None:
    """All of stdin, or None if it does not end by the deadline or is absurdly large."""
    import select

    chunks: list[bytes] = []
    size = 0
    while True:
        ready, _, _ = select.select([0], [], [], _left(deadline))
        if not ready:
            return None
        chunk = os.read(0, 1 << 20)
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > MAX_INPUT:
            return None
        chunks.append(chunk)


class _Decoding:
    """What CPython's C JSON scanner reads its settings from (json.JSONDecoder's)."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int

    @staticmethod
    def parse_constant(name: str) -> float:
        return float(name.lower().replace("infinity", "inf"))  # NaN, Infinity, -Infinity


def parse_json(data: bytes) -> Any:
    """``json.loads`` of UTF-8 bytes, through the C scanner alone when there is one:
    importing the json package (its regexes compiled at import) costs a hook ~1.5 ms.
    Raises ValueError (or StopIteration) on anything but one JSON value."""
    try:
        from _json import make_scanner
    except ImportError:  # not CPython
        import json

        return json.loads(data.decode("utf-8"))
    text = data.decode("utf-8").lstrip("\ufeff").strip(" \t\n\r")
    value, end = make_scanner(_Decoding())(text, 0)  # type: ignore[arg-type]  # duck-typed
    if end != len(text):
        raise ValueError(f"extra data after the JSON value at {end}")
    return value


def _session_from_env() -> str | None:
    """TOWERD_SESSION_ID if it is a towerd session id (a hyphenated UUID)."""
    text = os.environ.get("TOWERD_SESSION_ID", "").strip().lower()
    parts = text.split("-")
    if [len(part) for part in parts] != [8, 4, 4, 4, 12]:
        return None
    if not all(char in "0123456789abcdef" for char in text.replace("-", "")):
        return None
    return text


# --- the payload -------------------------------------------------------------------------


def cut(text: str, limit: int = MAX_STRING) -> str:
    """``text`` with at most ``limit`` characters kept and the cut marked; also made
    encodable as UTF-8 (JSON may carry lone surrogates)."""
    if not text.isascii():
        text = text.encode("utf-8", "replace").decode("utf-8")
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... [towerd: {len(text) - limit} chars cut]"


def _shrink(value: Any, depth: int) -> Any:
    if isinstance(value, str):
        return cut(value)
    if isinstance(value, dict):
        if depth >= MAX_NESTING:
            return "[towerd: nested too deep, dropped]"
        return {
            (cut(key) if isinstance(key, str) else key): _shrink(item, depth + 1)
            for key, item in value.items()
        }
    if isinstance(value, list):
        if depth >= MAX_NESTING:
            return "[towerd: nested too deep, dropped]"
        return [_shrink(item, depth + 1) for item in value]
    if type(value) is int and not -(2**63) <= value < 2**64:
        return str(value)  # msgpack has no bigger integers
    return value


def top_level_scalars(hook: dict[str, Any], size: int, packb: Any) -> dict[str, Any]:
    """The hook's top-level strings (cut short), numbers, booleans and nulls that fit in
    ``MAX_PAYLOAD``, in order, and a note of what was dropped."""
    kept: dict[str, Any] = {}
    dropped: list[str] = []
    used = 256  # room for the note
    for key, value in hook.items():
        if not isinstance(key, str) or isinstance(value, dict | list):
            dropped.append(cut(str(key), 128))
            continue
        value = cut(value, SMALL_STRING) if isinstance(value, str) else _shrink(value, 0)
        cost = len(packb({key: value}))
        if used + cost > MAX_PAYLOAD:
            dropped.append(cut(key, 128))
            continue
        kept[key] = value
        used += cost
    note = {"bytes": size, "dropped": dropped}
    while len(packb(note)) > 256 and dropped:
        dropped.pop()
        note["more_dropped"] = True
    kept[TRUNCATED_KEY] = note
    return kept


def compact(hook: dict[str, Any], packb: Any) -> dict[str, Any]:
    """The payload to record: the hook's JSON with long strings cut; if that is still
    over ``MAX_PAYLOAD`` bytes, its top-level scalar fields only."""
    payload = _shrink(hook, 0)
    size = len(packb(payload))
    if size <= MAX_PAYLOAD:
        return payload
    return top_level_scalars(hook, size, packb)
