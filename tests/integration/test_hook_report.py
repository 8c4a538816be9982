"""``towerctl hook-report``, ``events tail`` and ``events list``: the real CLI against a
real daemon, fed Claude Code's hook payloads (tests/fixtures/hooks/, one per hook event
kind). hook-report runs as a hook does: ``towerctl hook-report`` with the payload on
stdin and the socket in TOWERD_SOCKET; whatever happens it exits 0 and prints nothing."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest

from towerd.client.hook_report import (
    DEADLINE,
    MAX_PAYLOAD,
    MAX_STRING,
    TRUNCATED_KEY,
    parse_json,
)
from towerd.client.trail import CONTEXT
from towerd_testing import TOWERCTL, towerctl

pytestmark = pytest.mark.both_backends

FIXTURES = Path(__file__).parent.parent / "fixtures" / "hooks"
KINDS = [
    "SessionStart", "UserPromptSubmit", "PreToolUse", "PostToolUse", "Notification",
    "Stop", "SubagentStop", "PreCompact", "SessionEnd",
]  # fmt: skip
AGENT_SESSION = "3f6a1c52-8d0e-4b7a-9c21-5e4f7d2b9a10"  # the fixtures' session_id
# No daemon to reach is found out at connect: far quicker than DEADLINE (2 s), which a
# hook-report that waited for something would hit. Generous for a loaded CI machine.
FAST = 1.5


def fixture(kind: str, **changes) -> dict:
    payload = json.loads((FIXTURES / f"{kind}.json").read_text())
    return {**payload, **changes}


def test_fixtures_are_claude_code_hook_payloads():
    """One per kind, each with the common fields and hook_event_name matching its name."""
    assert sorted(path.stem for path in FIXTURES.glob("*.json")) == sorted(KINDS)
    for kind in KINDS:
        payload = fixture(kind)
        assert payload["hook_event_name"] == kind
        assert payload["session_id"] == AGENT_SESSION
        assert {"transcript_path", "cwd"} <= set(payload)


JSON_TEXTS = [
    *((FIXTURES / f"{kind}.json").read_bytes() for kind in KINDS),
    b'{"a": [1, -2.5e-3, "x\\u00e9\\ud800", null, true, false, NaN, Infinity, -Infinity]}',
    b' \r\n\t{"big": 123456789012345678901234567890, "e": 1e400, "z": -0.0} \n',
    "\ufeff{\"bom\": \"caf\u00e9\"}".encode(),
    b"[]", b'"s"', b"0", b"null",
]  # fmt: skip
NOT_JSON = [b"", b" ", b"{", b'{"a": 1} x', b'{"a": 1}{"b": 2}', b"nul", b"\xff{}", b"{'a': 1}",
            b'{"a": 01}', b'["\t"]', b"[" * 100_000]  # fmt: skip


def test_parse_json_reads_what_json_loads_reads():
    """hook-report's JSON reader (the C scanner without the json package) agrees with
    json.loads, and refuses what it refuses."""
    for text in JSON_TEXTS:
        expected = json.loads(text)
        parsed = parse_json(text)
        assert repr(parsed) == repr(expected), text  # repr: NaN != NaN
    for text in NOT_JSON:
        with pytest.raises((ValueError, StopIteration, RecursionError)):
            json.loads(text)
        with pytest.raises((ValueError, StopIteration, RecursionError)):
            parse_json(text)


def hook_env(socket_path, session_id: str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOWERD_")}
    env["TOWERD_SOCKET"] = str(socket_path)
    if session_id is not None:
        env["TOWERD_SESSION_ID"] = session_id
    return env


def hook_report(
    socket_path, stdin: bytes | dict, session_id: str | None = None, *, argv=("hook-report",)
) -> float:
    """Run the hook as an agent would; assert exit 0 and no output; return its wall time."""
    data = json.dumps(stdin).encode() if isinstance(stdin, dict) else stdin
    started = time.monotonic()
    done = subprocess.run(
        [TOWERCTL, *argv],
        input=data,
        capture_output=True,
        env=hook_env(socket_path, session_id),
        timeout=30,
    )
    wall = time.monotonic() - started
    assert (done.returncode, done.stdout, done.stderr) == (0, b"", b""), done
    return wall


def register(client, agent_session_id: str | None = AGENT_SESSION) -> str:
    fields = {"agent_session_id": agent_session_id} if agent_session_id else {}
    return client.session_register(cwd="/home/dev/src/app", agent="claude", **fields)["session_id"]


def trail(client, **scope) -> list[dict]:
    """Every event of the scope, oldest first (heartbeats included when asked by kind)."""
    events: list[dict] = []
    before = None
    while True:
        page = client.event_list(**scope, before=before, limit=200)
        events += page["events"]
        before = page["next_before"]
        if before is None:
            return list(reversed(events))


# --- hook-report ----------------------------------------------------------------------


@pytest.mark.parametrize("via", ["TOWERD_SESSION_ID", "payload session_id"])
def test_every_hook_kind_is_recorded_verbatim_under_its_session(daemon, via):
    """Each kind is filed with kind = hook_event_name and the payload as sent, under the
    wrapper's session (TOWERD_SESSION_ID) or the session registered with the payload's
    agent session id."""
    with daemon.client() as client:
        other = register(client, "some-other-agent-session")
        if via == "TOWERD_SESSION_ID":
            # The wrapper's session wins over the one the agent session id would pick.
            session = register(client, None)
            register(client)
            env_session = session
        else:
            session = register(client)
            env_session = None
        for kind in KINDS:
            hook_report(daemon.socket_path, (FIXTURES / f"{kind}.json").read_bytes(), env_session)
        events = trail(client, session_ids=[session])
        assert trail(client, session_ids=[other]) == []
    assert [event["kind"] for event in events] == KINDS
    for event, kind in zip(events, KINDS, strict=True):
        assert event["session_id"] == session
        assert event["agent_session_id"] == AGENT_SESSION
        assert event["payload"] == fixture(kind)
    assert [e["event_id"] for e in events] == sorted(e["event_id"] for e in events)


def test_the_argparse_path_records_too(daemon):
    """`towerctl --socket S hook-report` (options first, so no fast path) does the same."""
    with daemon.client() as client:
        session = register(client)
        hook_report(
            "/nonexistent/socket",
            (FIXTURES / "Stop.json").read_bytes(),
            argv=("--socket", str(daemon.socket_path), "hook-report"),
        )
        (event,) = trail(client, session_ids=[session])
    assert (event["kind"], event["payload"]) == ("Stop", fixture("Stop"))


def test_unknown_wrapper_session_falls_back_to_the_agent_session(daemon):
    """A TOWERD_SESSION_ID the daemon does not know (or not a UUID at all) files the event
    by the payload's agent session id instead; with no agent session id either, nothing
    is filed. Silent and exit 0 throughout."""
    with daemon.client() as client:
        session = register(client)
        hook_report(daemon.socket_path, fixture("Notification"), str(uuid.uuid4()))
        hook_report(daemon.socket_path, fixture("Stop"), "not-a-uuid")
        hook_report(daemon.socket_path, fixture("Stop"), "  " + session.upper() + "\n")
        events = trail(client, session_ids=[session])
        assert [(e["kind"], e["session_id"]) for e in events] == [
            ("Notification", session), ("Stop", session), ("Stop", session),
        ]  # fmt: skip
        nameless = {k: v for k, v in fixture("Stop").items() if k != "session_id"}
        hook_report(daemon.socket_path, nameless, str(uuid.uuid4()))
        hook_report(daemon.socket_path, nameless)
        assert client.event_list()["events"] == list(reversed(events))


def test_an_event_of_no_known_session_is_kept_under_its_agent_session_id(daemon):
    """Nothing registered: still exit 0, silent, and the event is filed under the agent
    session id alone, so a session registered later (or a trail by agent id) finds it."""
    hook_report(daemon.socket_path, fixture("SessionStart"))
    with daemon.client() as client:
        (event,) = client.event_list(agent_session_ids=[AGENT_SESSION])["events"]
    assert (event["kind"], event["session_id"], event["agent_session_id"]) == (
        "SessionStart", None, AGENT_SESSION,
    )  # fmt: skip


GARBAGE = {
    "empty": b"",
    "whitespace": b" \n\t",
    "not JSON": b"hook_event_name: Stop",
    "truncated JSON": (FIXTURES / "Stop.json").read_bytes()[:40],
    "not UTF-8": b'{"hook_event_name": "Stop", "session_id": "\xff\xfe"}',
    "a list": b'[{"hook_event_name": "Stop", "session_id": "x"}]',
    "a string": b'"Stop"',
    "null": b"null",
    "no hook_event_name": json.dumps({"session_id": AGENT_SESSION}).encode(),
    "hook_event_name not a string": json.dumps(fixture("Stop", hook_event_name=7)).encode(),
    "hook_event_name empty": json.dumps(fixture("Stop", hook_event_name="")).encode(),
    "hook_event_name too long": json.dumps(fixture("Stop", hook_event_name="K" * 65)).encode(),
    "nested 100000 deep": b"[" * 100_000 + b"]" * 100_000,
    "binary": bytes(range(256)) * 64,
}


def test_garbage_on_stdin_is_ignored_silently(daemon):
    """Whatever stdin holds, exit 0 with no output, and nothing is filed."""
    with daemon.client() as client:
        session = register(client)
        for name, data in GARBAGE.items():
            try:
                hook_report(daemon.socket_path, data, session)
            except AssertionError as exc:
                raise AssertionError(f"stdin {name}: {exc}") from None
        assert client.event_list()["events"] == []
        hook_report(daemon.socket_path, fixture("Stop"), session)  # and it still works
        assert [e["kind"] for e in client.event_list()["events"]] == ["Stop"]


def test_no_daemon_stale_socket_and_closed_stdin_are_silent_and_fast(short_tmp):
    """No socket file, a socket file nobody listens on, a path that is not a socket, and
    stdin closed: exit 0, no output, each well within FAST seconds (measured here)."""
    stale = short_tmp / "stale.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(stale))
    listener.close()  # the file stays; connecting is refused
    not_a_socket = short_tmp / "file"
    not_a_socket.write_text("")
    payload = (FIXTURES / "PostToolUse.json").read_bytes()
    session = str(uuid.uuid4())
    for path in (short_tmp / "missing.sock", stale, not_a_socket, short_tmp):
        for argv in (("hook-report",), ("--socket", str(path), "hook-report")):
            wall = hook_report(path, payload, session, argv=argv)
            assert wall < FAST, (path, argv, wall)
    # stdin closed altogether (no fd 0)
    started = time.monotonic()
    done = subprocess.run(
        ["sh", "-c", 'exec "$0" hook-report <&-', TOWERCTL],
        capture_output=True,
        env=hook_env(stale),
        timeout=30,
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, b"", b"")
    assert time.monotonic() - started < FAST


def test_a_hung_daemon_costs_the_hook_at_most_the_deadline(daemon):
    """A stopped daemon accepts the connection but never answers: hook-report gives up at
    its deadline, silently, exit 0; the daemon works on once resumed."""
    with daemon.client() as client:
        session = register(client)
    os.kill(daemon.pid, signal.SIGSTOP)
    try:
        wall = hook_report(daemon.socket_path, fixture("PostToolUse"), session)
    finally:
        os.kill(daemon.pid, signal.SIGCONT)
    assert DEADLINE - 0.1 < wall < DEADLINE + FAST, wall
    hook_report(daemon.socket_path, fixture("Stop"), session)
    with daemon.client() as client:
        assert trail(client, session_ids=[session])[-1]["kind"] == "Stop"


def test_a_stdin_that_never_ends_costs_at_most_the_deadline(daemon):
    """An agent that never closes stdin: hook-report gives up at its deadline."""
    read_end, write_end = os.pipe()
    try:
        os.write(write_end, b'{"hook_event_name": "Stop", ')
        started = time.monotonic()
        done = subprocess.run(
            [TOWERCTL, "hook-report"],
            stdin=read_end,
            capture_output=True,
            env=hook_env(daemon.socket_path),
            timeout=30,
        )
        wall = time.monotonic() - started
    finally:
        os.close(read_end)
        os.close(write_end)
    assert (done.returncode, done.stdout, done.stderr) == (0, b"", b"")
    assert DEADLINE - 0.1 < wall < DEADLINE + FAST, wall
    with daemon.client() as client:
        assert client.event_list()["events"] == []


def cut(text: str) -> str:
    return f"{text[:MAX_STRING]}... [towerd: {len(text) - MAX_STRING} chars cut]"


def test_a_huge_payload_is_recorded_with_long_strings_cut(daemon):
    """A 1 MB tool_response: filed, with that string cut to MAX_STRING characters and the
    cut marked; every other field as sent. Strings of exactly MAX_STRING stay whole; text
    outside ASCII is kept; a lone surrogate (valid JSON) becomes '?'."""
    big = "".join(chr(ord("a") + n % 26) for n in range(1_000_000))
    exact = "e" * MAX_STRING
    payload = fixture(
        "PostToolUse",
        tool_name="Bash",
        tool_input={"command": "cat big.log", "description": "Show the log"},
        tool_response={"stdout": big, "stderr": exact, "interrupted": False, "isImage": False},
    )
    payload["tool_input"]["note"] = "caf\u00e9 \u2603 \U0001f600"
    data = json.dumps(payload).replace("Show the log", "Show\\ud800 log").encode()
    assert len(data) > 1_000_000
    with daemon.client() as client:
        session = register(client)
        hook_report(daemon.socket_path, data, session)
        (event,) = trail(client, session_ids=[session])
    recorded = event["payload"]
    assert recorded["tool_response"]["stdout"] == cut(big)
    assert recorded["tool_response"]["stdout"].endswith("... [towerd: 995904 chars cut]")
    assert recorded["tool_response"]["stderr"] == exact
    assert recorded["tool_input"]["description"] == "Show? log"
    expected = json.loads(json.dumps(payload))
    expected["tool_response"]["stdout"] = cut(big)
    expected["tool_input"]["description"] = "Show? log"
    assert recorded == expected


def test_a_payload_still_too_big_keeps_its_top_level_scalars(daemon):
    """Cut strings that still add up to more than MAX_PAYLOAD bytes: the top-level scalar
    fields are kept (long ones cut short) and a note says what was dropped."""
    lines = [f"line {n}: " + "x" * 5000 for n in range(40)]
    payload = fixture(
        "PostToolUse",
        tool_name="Read",
        tool_input={"file_path": "/home/dev/src/app/big.txt"},
        tool_response={"type": "text", "file": {"lines": lines}},
    )
    size = len(json.dumps(payload))
    with daemon.client() as client:
        session = register(client)
        hook_report(daemon.socket_path, payload, session)
        (event,) = trail(client, session_ids=[session])
    recorded = event["payload"]
    note = recorded.pop(TRUNCATED_KEY)
    assert note["dropped"] == ["tool_input", "tool_response"]
    assert MAX_PAYLOAD < note["bytes"] < size
    assert recorded == {
        k: v for k, v in payload.items() if k not in ("tool_input", "tool_response")
    }
    assert event["kind"] == "PostToolUse"


def test_a_payload_the_daemon_refuses_is_sent_again_with_its_top_level_scalars(make_daemon):
    """A daemon with a lower --event-max-payload refuses the cut payload (bad_args):
    hook-report sends the top-level scalars alone, and that is filed."""
    daemon = make_daemon().start("--event-max-payload", "1024")
    payload = fixture("PostToolUse")
    payload["tool_response"]["originalFile"] = "x = 1\n" * 500
    with daemon.client() as client:
        session = register(client)
        hook_report(daemon.socket_path, payload, str(uuid.uuid4()))  # via the fallback too
        (event,) = trail(client, session_ids=[session])
    recorded = event["payload"]
    note = recorded.pop(TRUNCATED_KEY)
    assert note["dropped"] == ["tool_input", "tool_response"] and note["bytes"] > 1024
    assert recorded == {
        k: v for k, v in payload.items() if k not in ("tool_input", "tool_response")
    }


# --- attention ------------------------------------------------------------------------


def test_attention_follows_the_hook_sequence(daemon):
    """UserPromptSubmit -> running, Notification -> needs_you, a heartbeat changes nothing
    but the last activity time, Stop -> done, UserPromptSubmit -> running again,
    SessionEnd -> exited."""
    with daemon.client() as client:
        session = register(client)
        quiet = register(client, "another-agent")

        def state() -> tuple:
            (row,) = client.session_activity([session])["sessions"]
            return row["attention"], row["last_kind"], row["last_activity_at"]

        assert state() == ("running", None, None)
        steps = [
            ("UserPromptSubmit", "running"),
            ("Notification", "needs_you"),
            ("heartbeat", "needs_you"),
            ("Stop", "done"),
            ("UserPromptSubmit", "running"),
            ("SessionEnd", "exited"),
        ]
        last_kind = None
        for kind, attention in steps:
            if kind == "heartbeat":
                at = client.event_record("heartbeat", session_id=session)["at"]
            else:
                hook_report(daemon.socket_path, fixture(kind), session)
                at = trail(client, session_ids=[session])[-1]["at"]
                last_kind = kind
            assert state() == (attention, last_kind, at), kind
        # The heartbeat is left out of the trail; the other session saw nothing.
        assert [e["kind"] for e in trail(client, session_ids=[session])] == [
            kind for kind, _ in steps if kind != "heartbeat"
        ]
        assert client.session_activity([quiet])["sessions"] == [
            {"session_id": quiet, "last_activity_at": None, "last_kind": None,
             "attention": "running", "daemon_id": client.status()["daemon_id"],
             "live": None},
        ]  # fmt: skip


# --- events tail ----------------------------------------------------------------------

LINE = re.compile(
    r"^(\d\d:\d\d:\d\d\.\d{3})  (\S+) *  (\S{8}|-)  (\S+)(?:  (.*))?$"
)  # time, kind, session (short), agent session, summary


def clock(millis: int) -> str:
    return time.strftime("%H:%M:%S", time.gmtime(millis // 1000)) + f".{millis % 1000:03d}"


class Tail:
    """`towerctl events tail` as a subprocess; its stdout lines read by a thread."""

    def __init__(self, daemon, *args: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TOWERD_")}
        self.proc = subprocess.Popen(
            [TOWERCTL, "--socket", str(daemon.socket_path), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            # Ctrl-C is what ends a tail: give it the default SIGINT even when pytest
            # itself runs with SIGINT ignored (a background job of a script), which a
            # child would otherwise inherit.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.reading = threading.Event()
        self.reading.set()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        while True:
            self.reading.wait()
            line = self.proc.stdout.readline()
            if not line:
                self.lines.put(None)
                return
            self.lines.put(line.rstrip("\n"))

    def take(self, count: int, timeout: float = 10.0) -> list[str]:
        deadline = time.monotonic() + timeout
        taken: list[str] = []
        while len(taken) < count:
            try:
                line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.001))
            except queue.Empty:
                raise AssertionError(
                    f"tail printed {len(taken)} of {count} lines in {timeout}s: {taken}"
                ) from None
            if line is None:
                raise AssertionError(f"tail ended after {taken}: {self.finish()}")
            taken.append(line)
        return taken

    def interrupt(self) -> tuple[int, str]:
        self.proc.send_signal(signal.SIGINT)
        return self.finish()

    def finish(self) -> tuple[int, str]:
        assert self.proc.stderr is not None
        status = self.proc.wait(15)
        return status, self.proc.stderr.read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.reading.set()


@pytest.fixture
def tails():
    started: list[Tail] = []

    def start(daemon, *args: str) -> Tail:
        tail = Tail(daemon, *args)
        started.append(tail)
        return tail

    yield start
    for tail in started:
        tail.close()


def test_events_tail_prints_context_then_new_events_of_its_session(daemon, tails):
    """The last CONTEXT events of the session first (oldest first), then each new one as
    it is recorded, in order, one line each; other sessions' events and heartbeats are not
    shown. By agent session id too. Ctrl-C ends it: exit 0, nothing on stderr."""
    with daemon.client() as client:
        session = register(client)
        other = register(client, "other-agent")
        before = [
            client.event_record("PreToolUse", session_id=session, payload=fixture("PreToolUse"))
            for _ in range(CONTEXT + 2)
        ]
        client.event_record("Stop", session_id=other)
        tail = tails(daemon, "events", "tail", session)
        by_agent = tails(daemon, "events", "tail", AGENT_SESSION)

        for lines in (tail.take(CONTEXT), by_agent.take(CONTEXT)):
            assert [LINE.match(line).groups() for line in lines] == [
                (clock(r["at"]), "PreToolUse", session[:8], AGENT_SESSION,
                 "Bash pytest -q tests/test_parser.py")
                for r in before[2:]
            ]  # fmt: skip

        recorded = []
        for kind in KINDS:
            client.event_record("Stop", session_id=other, payload=fixture("Stop"))
            client.event_record("heartbeat", session_id=session)
            if kind == "SessionEnd":
                hook_report(daemon.socket_path, fixture(kind), session)
                recorded.append(trail(client, session_ids=[session])[-1])
            else:
                result = client.event_record(kind, session_id=session, payload=fixture(kind))
                recorded.append({"kind": kind, "at": result["at"]})
        summaries = {
            "SessionStart": "startup",
            "UserPromptSubmit": "Run the test suite and fix whatever fails in the parser; ...",
            "PreToolUse": "Bash pytest -q tests/test_parser.py",
            "PostToolUse": "Edit /home/dev/src/app/parser.py",
            "Notification": "Claude needs your permission to use Bash",
            "Stop": None,
            "SubagentStop": "Explore",
            "PreCompact": "manual",
            "SessionEnd": "prompt_input_exit",
        }
        expected = [
            (clock(r["at"]), r["kind"], session[:8], AGENT_SESSION, summaries[r["kind"]])
            for r in recorded
        ]
        for each in (tail, by_agent):
            assert [LINE.match(line).groups() for line in each.take(len(KINDS))] == expected
            # The other session's events and the heartbeats came in between: none shown.
            assert each.lines.empty()
            assert each.interrupt() == (0, "")


def test_events_tail_json_and_kind_filter(daemon, tails):
    """--json prints each event as the daemon sent it, one object a line; --kind keeps
    only those kinds (heartbeats too when asked for by kind); no SESSION: every session."""
    with daemon.client() as client:
        first = register(client)
        second = register(client, "other-agent")
        client.event_record("Notification", session_id=first, payload=fixture("Notification"))
        tail = tails(daemon, "--json", "events", "tail", "--kind", "Stop", "--kind", "heartbeat")
        by_other = tails(daemon, "--json", "events", "tail", "--kind", "Notification")
        assert json.loads(by_other.take(1)[0]) == client.event_list()["events"][0]
        client.event_record("Stop", session_id=first, payload=fixture("Stop"))
        client.event_record("Notification", session_id=second, payload={"message": "hi"})
        client.event_record("heartbeat", agent_session_id="unregistered")
        client.event_record("Stop", session_id=second, payload=[1, "two", None])
        newest = client.event_list(kinds=["Stop", "heartbeat"])["events"]
        assert [json.loads(line) for line in tail.take(3)] == list(reversed(newest))
        notifications = client.event_list(kinds=["Notification"])["events"]
        assert json.loads(by_other.take(1)[0]) == notifications[0]
        assert tail.interrupt() == (0, "") and by_other.interrupt() == (0, "")


def test_events_tail_exits_3_when_the_daemon_goes_away(daemon, tails):
    with daemon.client() as client:
        session = register(client)
        client.event_record("Stop", session_id=session)
    tail = tails(daemon, "events", "tail")
    tail.take(1)
    daemon.kill9()
    status, stderr = tail.finish()
    assert status == 3
    assert stderr.startswith("towerctl: unavailable: ") and stderr.count("\n") == 1, stderr


def test_events_tail_with_no_daemon_exits_3(short_tmp):
    done = subprocess.run(
        [TOWERCTL, "--socket", str(short_tmp / "missing.sock"), "events", "tail"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 3 and done.stdout == ""
    assert done.stderr.startswith("towerctl: unavailable: cannot connect"), done.stderr


def test_events_tail_watches_again_after_too_slow(make_daemon, tails):
    """A tail whose stdout is not read falls behind; the daemon drops its watch with
    too_slow; it says so on stderr, watches again, prints what it missed, and goes on:
    every event exactly once, in order."""
    daemon = make_daemon().start("--watch-max-queue", "65536")
    with daemon.client() as client:
        client.event_record("Stop", agent_session_id="agent")
        tail = tails(daemon, "--json", "events", "tail")
        tail.take(1)
        tail.reading.clear()  # the reader stops after (at most) one more line
        blob = "b" * 16_000
        for _ in range(200):
            for _ in range(5):
                client.event_record("PostToolUse", agent_session_id="agent", payload=blob)
            if "watcher_too_slow" in daemon.log():
                break
        else:
            raise AssertionError("the daemon never dropped the stalled watcher")
        tail.reading.set()
        ids = [event["event_id"] for event in trail(client, agent_session_ids=["agent"])]
        assert len(ids) < 200  # what the tail missed fits in its catch-up
        seen = [json.loads(line)["event_id"] for line in tail.take(len(ids) - 1, timeout=30)]
        assert seen == ids[1:]
        last = client.event_record("Stop", agent_session_id="agent")
        assert json.loads(tail.take(1)[0])["event_id"] == last["event_id"]
    status, stderr = tail.interrupt()
    assert status == 0
    assert stderr.startswith("towerctl: too_slow: the daemon dropped this watch"), stderr


# --- events list ----------------------------------------------------------------------


def test_events_list_text_and_json(daemon):
    """`events list [SESSION] [--kind K] [--limit N]`: newest first; SESSION is a towerd
    or an agent session id."""
    with daemon.client() as client:
        session = register(client)
        other = register(client, "other-agent")
        for kind in KINDS:
            hook_report(daemon.socket_path, fixture(kind), session)
        client.event_record("Stop", session_id=other)
        client.event_record("heartbeat", session_id=session)
        everything = client.event_list()["events"]
        mine = client.event_list(session_ids=[session])["events"]

    def ok(*args: str) -> str:
        done = towerctl(daemon, *args)
        assert (done.returncode, done.stderr) == (0, ""), done
        return done.stdout

    assert json.loads(ok("--json", "events", "list")) == {
        "events": everything, "next_before": None,
    }  # fmt: skip
    assert len(everything) == len(KINDS) + 1  # no heartbeat
    for scope in (session, AGENT_SESSION):
        assert json.loads(ok("--json", "events", "list", scope))["events"] == mine
    stops = json.loads(ok("--json", "events", "list", "--kind", "Stop", "--kind", "heartbeat"))
    assert [(e["kind"], e["session_id"]) for e in stops["events"]] == [
        ("heartbeat", session), ("Stop", other), ("Stop", session),
    ]  # fmt: skip
    limited = json.loads(ok("--json", "events", "list", session, "--limit", "2"))
    assert limited == {"events": mine[:2], "next_before": mine[1]["event_id"]}

    header, *rows = ok("events", "list", session).rstrip("\n").split("\n")
    assert re.split(r" {2,}", header) == ["ID", "AT", "KIND", "SESSION", "AGENT_SESSION"]
    cells = [re.split(r" {2,}", row) for row in rows]
    assert [[c[0], c[2], c[3], c[4]] for c in cells] == [
        [str(e["event_id"]), e["kind"], session, AGENT_SESSION] for e in mine
    ]
    assert ok("events", "list", "no-such-agent") == "ID  AT  KIND  SESSION  AGENT_SESSION\n"
