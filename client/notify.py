"""``towerctl notify``: run a command (or ``notify-send``) each time a session starts to
need you.

How it works, and why this way:

* One ``watch`` of the ``fleet`` and ``events`` topics. Its snapshot is the baseline:
  each session's attention as the daemon computed it (the snapshot's ``activity``, as
  ``towerctl top`` shows it). A session that already needs you then is not notified.
* The pushes after it are applied to the attention rule of docs/protocol.md §14 (an
  event filed under a session, or under its agent session id, is its newest; a heartbeat
  changes nothing; an exited row is ``exited``), so that every transition into
  ``needs_you`` is seen, a short one included: a ``Notification``, answered at once
  and asked again, is two transitions, which a re-read of the state could merge into
  none. A transition into ``needs_you`` notifies once; the session stays quiet while
  it stays there, and any event that moves it elsewhere (``UserPromptSubmit``,
  ``PostToolUse``, ``Stop``, ...) arms it again.
* Losing the daemon (a restart, a crash, ``too_slow``) is a reconnect with backoff
  (0.2 s doubling to 5 s, forever, logged on stderr), and the fresh snapshot is a new
  baseline: nothing notified already, nor anything that needed you before, is notified
  again. One case is a transition all the same: a session seen in another state before
  the gap, shown ``needs_you`` with newer activity after it, came to need you while
  notify was away, and is notified once. A ``fleet.adopt`` (rows moved to this daemon,
  which its push does not list) is read the same way, by watching again.
* Commands run on a thread of their own, one at a time, in order: the watch reader only
  queues them (up to :data:`QUEUE_LIMIT`; beyond that a notification is dropped and
  said so), so a slow command never makes the daemon drop the watch. A command runs in
  a session of its own; one that outlives ``--exec-timeout`` is killed with its whole
  process group, one that fails is logged, and notify goes on.

:class:`Tracker` is the pure part (snapshots and pushes in, :class:`Notice` out), and
tests/client/test_notify_transitions.py tests it alone. Only the standard library and
the blocking client are imported here: no msgspec, anyio or structlog.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time

from towerd.protocol import fields
from towerd.protocol.fields import attention

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: the CLI avoids importing typing
if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Mapping
    from typing import Any

NEEDS_YOU = "needs_you"
HEARTBEAT = fields.HEARTBEAT_KIND
NOTIFICATION = "Notification"
TOPICS = ("events", "fleet")
CLIENT_NAME = "towerctl-notify"
QUEUE_LIMIT = 256  # notifications waiting for their command
STOP_GRACE = 2.0  # seconds a running command is given to finish when notify stops
KILL_GRACE = 2.0  # seconds between SIGTERM and SIGKILL of a command's process group
AGENT_KINDS_KEPT = 4096  # agent session ids whose newest event kind is remembered
LOG_REPEAT_S = 30.0  # the same connection failure is logged again at most this often


# The TOWERD_* variables a command gets, and the field of the notice each one holds.
ENV_FIELDS = (
    ("TOWERD_SESSION_ID", "session_id"),
    ("TOWERD_SESSION_NAME", "name"),
    ("TOWERD_AGENT", "agent"),
    ("TOWERD_CWD", "cwd"),
    ("TOWERD_AGENT_SESSION_ID", "agent_session_id"),
    ("TOWERD_ATTENTION", "attention"),
    ("TOWERD_MESSAGE", "message"),
)


def message_of(payload: Any) -> str | None:
    """The text an agent's Notification carries (Claude Code's ``message``), if any."""
    if isinstance(payload, dict):
        message = payload.get("message")
        if isinstance(message, str):
            return message
    return None


# --- transition tracking (pure) ------------------------------------------------------------


class Notice:
    """A session that came to need you: its fleet row, its attention and newest activity
    as notify sees them, the Notification's message, and the event that moved it (None
    when the move was seen in a fresh snapshot). ``partial``: the row is not known (the
    snapshot was cut), only its ids."""

    __slots__ = ("attention", "event", "last_activity_at", "last_kind", "message", "partial", "row")

    def __init__(
        self,
        row: dict[str, Any],
        attention: str,
        last_kind: str | None,
        last_activity_at: int | None,
        message: str | None,
        event: dict[str, Any] | None,
        partial: bool,
    ) -> None:
        self.row, self.attention, self.last_kind = row, attention, last_kind
        self.last_activity_at, self.message, self.event = last_activity_at, message, event
        self.partial = partial

    @property
    def session_id(self) -> str:
        return str(self.row["session_id"])

    @property
    def label(self) -> str:
        """The session's name, else its id."""
        name = self.row.get("name")
        return name if isinstance(name, str) and name else self.session_id

    def fields(self) -> dict[str, Any]:
        """What a command reads on stdin: the fleet row, then attention, last_kind,
        last_activity_at, message and the trail event."""
        return {
            **self.row,
            "attention": self.attention,
            "last_kind": self.last_kind,
            "last_activity_at": self.last_activity_at,
            "message": self.message,
            "event": self.event,
        }

    def environment(self) -> dict[str, str]:
        """The TOWERD_* variables: strings, empty for null (an environment cannot hold
        a NUL character: any is dropped)."""
        fields = self.fields()
        env = {}
        for variable, field in ENV_FIELDS:
            value = fields.get(field)
            text = "" if value is None else str(value)
            env[variable] = text.replace("\0", "")
        return env


class _Session:
    __slots__ = (
        "attention", "last_activity_at", "last_event_id", "last_kind", "message", "partial", "row"
    )  # fmt: skip

    def __init__(
        self,
        row: dict[str, Any],
        attention: str | None,
        last_kind: str | None,
        last_activity_at: int | None,
        message: str | None = None,
        partial: bool = False,
    ) -> None:
        self.row, self.attention, self.last_kind = row, attention, last_kind
        self.last_activity_at, self.message, self.partial = last_activity_at, message, partial
        self.last_event_id: int | None = None  # of its newest event seen pushed

    @property
    def agent_session_id(self) -> Any:
        return self.row.get("agent_session_id")

    @property
    def exited(self) -> bool:
        return bool(self.row.get("exited"))

    def notice(self, event: dict[str, Any] | None) -> Notice:
        return Notice(
            dict(self.row), self.attention or "running", self.last_kind,
            self.last_activity_at, self.message, event, self.partial,
        )  # fmt: skip


class Tracker:
    """Each session's attention, from a ``watch`` of ``fleet`` and ``events``:
    :meth:`baseline` takes each snapshot, :meth:`apply` each push; both return the
    notices due (a session that moved into ``needs_you``). After a ``FleetAdopted``
    push, :attr:`resync` asks for a fresh snapshot (watch again)."""

    def __init__(self) -> None:
        self.sessions: dict[str, _Session] = {}
        self.baselined = False  # a snapshot was taken: the next one follows a gap
        self.resync = False
        # The newest (event_id, kind) of each agent session id, for a row registered
        # after its agent's events (its attention comes from them).
        self._agent_kinds: dict[str, tuple[int, str]] = {}

    def needing_you(self) -> int:
        return sum(1 for s in self.sessions.values() if s.attention == NEEDS_YOU)

    # --- snapshots ---------------------------------------------------------------------

    def baseline(self, snapshot: Mapping[str, Any]) -> list[Notice]:
        """Take a snapshot as the state. The first one notifies nothing; a later one (after
        a reconnect) notifies only a session seen in another state before, now
        ``needs_you`` with newer activity than notify last saw."""
        fleet = snapshot.get("fleet") or {}
        events = [e for e in (snapshot.get("events") or {}).get("events") or [] if _is_event(e)]
        for event in reversed(events):  # newest first: remember oldest to newest
            self._remember(event)
        activity = {
            a.get("session_id"): a for a in fleet.get("activity") or [] if isinstance(a, dict)
        }
        previous = self.sessions if self.baselined else {}
        sessions: dict[str, _Session] = {}
        notices = []
        for row in fleet.get("sessions") or []:
            if not isinstance(row, dict) or not isinstance(row.get("session_id"), str):
                continue
            sid = row["session_id"]
            act = activity.get(sid)
            if act is not None:
                state = _Session(
                    dict(row), str(act.get("attention")), act.get("last_kind"),
                    act.get("last_activity_at"),
                )  # fmt: skip
            else:  # as towerctl top reads a row without activity
                state = _Session(dict(row), attention(bool(row.get("exited")), None), None, None)
            sessions[sid] = state
            if state.attention != NEEDS_YOU:
                continue
            asked = _newest_notification(events, sid, state.agent_session_id)
            old = previous.get(sid)
            state.message = message_of(asked.get("payload")) if asked else None
            if asked is None and old is not None:
                state.message = old.message
            if (
                old is not None
                and old.attention != NEEDS_YOU
                and (state.last_activity_at or 0) > (old.last_activity_at or 0)
            ):
                notices.append(state.notice(asked))
        if fleet.get("truncated"):
            # Rows past the cut are not in this snapshot: keep what was known of them.
            for sid, old in previous.items():
                sessions.setdefault(sid, old)
        self.sessions = sessions
        self.baselined = True
        self.resync = False
        return notices

    # --- pushes --------------------------------------------------------------------------

    def apply(self, push: Mapping[str, Any]) -> list[Notice]:
        """One pushed change, ``{"event": topic, "seq": n, "data": ...}``."""
        data = push.get("data")
        if not isinstance(data, dict):
            return []
        topic = push.get("event")
        if topic == "events":
            return self._on_event(data)
        if topic == "fleet":
            return self._on_fleet(data)
        return []

    def _on_event(self, event: dict[str, Any]) -> list[Notice]:
        if not _is_event(event):
            return []
        kind, sid, aid, at = (
            event["kind"], event.get("session_id"), event.get("agent_session_id"), event.get("at")
        )  # fmt: skip
        self._remember(event)
        # Its sessions (§14): the one it is filed under, and each row of its agent session.
        targets = [
            s
            for key, s in self.sessions.items()
            if key == sid or (aid is not None and s.agent_session_id == aid)
        ]
        if isinstance(sid, str) and sid not in self.sessions:
            # A row past the snapshot's cut (or one whose upsert is still to come): its
            # attention before is unknown, so a Notification counts as a move.
            placeholder = _Session(
                {"session_id": sid, "agent_session_id": aid}, None, None, None, partial=True
            )
            self.sessions[sid] = placeholder
            targets.append(placeholder)
        notices = []
        for state in targets:
            if isinstance(at, int):
                state.last_activity_at = max(state.last_activity_at or 0, at)
            if kind == HEARTBEAT:
                continue  # activity only: never attention
            state.last_kind = kind
            if isinstance(event.get("event_id"), int):
                state.last_event_id = event["event_id"]
            state.message = message_of(event.get("payload")) if kind == NOTIFICATION else None
            if self._move(state, attention(state.exited, kind)):
                notices.append(state.notice(event))
        return notices

    def _on_fleet(self, data: dict[str, Any]) -> list[Notice]:
        op = data.get("op")
        if op == "remove":
            self.sessions.pop(str(data.get("session_id")), None)
            return []
        if op == "adopt":
            self.resync = True  # the moved rows are not in the push: read them afresh
            return []
        row = data.get("session")
        if (
            op != "upsert"
            or not isinstance(row, dict)
            or not isinstance(row.get("session_id"), str)
        ):
            return []
        sid = row["session_id"]
        state = self.sessions.get(sid)
        if state is None:
            # A new row: its attention comes from what its agent session already did; a
            # row is not a move (only an event is).
            known = self._agent_kinds.get(row.get("agent_session_id") or "")
            last_kind = known[1] if known else None
            self.sessions[sid] = _Session(
                dict(row), attention(bool(row.get("exited")), last_kind), last_kind, None
            )
            return []
        was_exited, old_agent = state.exited, state.agent_session_id
        state.row, state.partial = dict(row), False
        if state.agent_session_id != old_agent:
            # Relinked to another agent session: its newest event may now be one of that
            # agent session's (the newer of the two, by event id). An old state either
            # way: no notice.
            known = self._agent_kinds.get(state.agent_session_id or "")
            if known is not None and known[0] > (state.last_event_id or 0):
                state.last_event_id, state.last_kind = known
            state.attention = attention(state.exited, state.last_kind)
            return []
        if state.exited != was_exited and self._move(
            state, attention(state.exited, state.last_kind)
        ):
            return [state.notice(None)]
        return []

    def _move(self, state: _Session, new: str) -> bool:
        """Set the session's attention; True when it moved into ``needs_you``."""
        old, state.attention = state.attention, new
        return new == NEEDS_YOU and old != NEEDS_YOU

    def _remember(self, event: dict[str, Any]) -> None:
        aid, event_id, kind = event.get("agent_session_id"), event.get("event_id"), event["kind"]
        if not isinstance(aid, str) or kind == HEARTBEAT or not isinstance(event_id, int):
            return
        known = self._agent_kinds.get(aid)
        if known is not None and known[0] >= event_id:
            return
        self._agent_kinds.pop(aid, None)  # re-insert: the dict's order is recency
        self._agent_kinds[aid] = (event_id, kind)
        while len(self._agent_kinds) > AGENT_KINDS_KEPT:
            del self._agent_kinds[next(iter(self._agent_kinds))]


def _is_event(event: Any) -> bool:
    return isinstance(event, dict) and isinstance(event.get("kind"), str)


def _newest_notification(
    events: Iterable[dict[str, Any]], session_id: str, agent_session_id: Any
) -> dict[str, Any] | None:
    """The newest Notification of a session among snapshot events (newest first)."""
    for event in events:
        if event["kind"] == HEARTBEAT:
            continue
        mine = event.get("session_id") == session_id or (
            agent_session_id is not None and event.get("agent_session_id") == agent_session_id
        )
        if mine:
            return event if event["kind"] == NOTIFICATION else None
    return None


# --- running the commands ----------------------------------------------------------------


def log(message: str) -> None:
    """One line on stderr, safe for a terminal (stored names may hold control characters)."""
    from towerd.client.cli.output import printable

    print(f"towerctl notify: {printable(message)}", file=sys.stderr, flush=True)


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes | bytearray):
        import base64

        return base64.b64encode(value).decode()
    raise TypeError(f"cannot send {type(value).__name__} as JSON")


class Job:
    """One command to run for a notice: its argv, its stdin (None: /dev/null), the
    variables added to notify's own environment."""

    __slots__ = ("argv", "env", "stdin")

    def __init__(self, argv: list[str], stdin: bytes | None, env: dict[str, str]) -> None:
        self.argv, self.stdin, self.env = argv, stdin, env


def exec_job(command: str, socket_path: str) -> Callable[[Notice], Job]:
    """``--exec CMD``: ``sh -c CMD``, the notice's fields as one line of JSON on stdin and
    as TOWERD_* variables (TOWERD_SOCKET: the daemon notify watches)."""

    def job(notice: Notice) -> Job:
        data = json.dumps(notice.fields(), default=_jsonable, ensure_ascii=False) + "\n"
        env = {**notice.environment(), "TOWERD_SOCKET": socket_path}
        return Job(["sh", "-c", command], data.encode("utf-8", "replace"), env)

    return job


def desktop_job(notify_send: str) -> Callable[[Notice], Job]:
    """``--desktop``: ``notify-send "towerd: NAME needs you" "MESSAGE"``."""

    def job(notice: Notice) -> Job:
        argv = [notify_send, f"towerd: {notice.label} needs you", notice.message or ""]
        return Job([arg.replace("\0", "") for arg in argv], None, {})

    return job


def find_notify_send() -> str:
    """The notify-send executable, or a LocalFailure saying it is missing."""
    found = shutil.which("notify-send")
    if found is None:
        from towerd.client.cli.output import LocalFailure

        raise LocalFailure(
            "notify_send_missing",
            "--desktop runs notify-send, which is not on PATH (Debian and Ubuntu: apt install "
            "libnotify-bin); or give --exec CMD instead",
            {"path": os.environ.get("PATH", "")},
        )
    return found


class Runner(threading.Thread):
    """Runs the notices' commands one at a time, in order, each within ``timeout`` s."""

    def __init__(
        self,
        make_job: Callable[[Notice], Job],
        timeout: float,
        lookup: Callable[[str], dict[str, Any] | None] | None = None,
    ) -> None:
        super().__init__(name="towerctl-notify-exec", daemon=True)
        self.make_job, self.timeout, self.lookup = make_job, timeout, lookup
        self.jobs: queue.Queue[Notice | None] = queue.Queue(QUEUE_LIMIT)
        self._stopping = threading.Event()
        self._current: subprocess.Popen[bytes] | None = None

    def submit(self, notice: Notice) -> None:
        """Queue a notice without ever waiting: a full queue drops it (and says so)."""
        try:
            self.jobs.put_nowait(notice)
        except queue.Full:
            log(
                f"{notice.label} needs you, but {QUEUE_LIMIT} notifications are already "
                "waiting for their command: this one is dropped"
            )

    def run(self) -> None:
        # SIGTERM and SIGINT go to the main thread, whose handler ends notify: delivered
        # to this thread (the kernel picks any thread not blocking them), they left the
        # main thread asleep in its watch until the daemon's next push, and notify did not
        # stop (a flaky test; systemd would wait out TimeoutStopSec). Commands get them
        # unblocked again (``_unblock_stop_signals``).
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        while True:
            notice = self.jobs.get()
            if notice is None or self._stopping.is_set():
                return
            try:
                self._notify(notice)
            except Exception as exc:  # noqa: BLE001 - one bad notice must not end notify
                log(f"could not notify for {notice.label}: {type(exc).__name__}: {exc}")

    def _notify(self, notice: Notice) -> None:
        if notice.partial and self.lookup is not None:
            row = self.lookup(notice.session_id)
            if row is not None:
                notice.row = {**row}
        job = self.make_job(notice)
        failure = self.execute(job)
        what = f"{notice.label} ({notice.session_id}) needs you"
        if failure is None:
            log(f"{what}: notified")
        elif self._stopping.is_set():
            log(f"{what}: notify is stopping, so the command was ended ({failure})")
        else:
            log(f"{what}: the command {failure}")

    def execute(self, job: Job) -> str | None:
        """Run one job; None if it exited 0, else what went wrong."""
        try:
            proc = subprocess.Popen(
                job.argv,
                stdin=subprocess.PIPE if job.stdin is not None else subprocess.DEVNULL,
                env={**os.environ, **job.env},
                start_new_session=True,  # its own process group: a timeout kills all of it
                preexec_fn=_unblock_stop_signals,  # noqa: PLW1509 - one system call, no locks
            )
        except OSError as exc:
            return f"could not be started: {exc.strerror or exc}"
        self._current = proc
        try:
            proc.communicate(job.stdin, timeout=self.timeout)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            return f"did not finish within {self.timeout:g} s and was killed"
        finally:
            self._current = None
        if proc.returncode < 0:
            return f"was killed by signal {-proc.returncode}"
        if proc.returncode != 0:
            return f"exited with status {proc.returncode}"
        return None

    def stop(self, grace: float = STOP_GRACE) -> None:
        """Run nothing more; give the running command ``grace`` s, then kill it."""
        self._stopping.set()
        dropped = 0
        while True:
            try:
                dropped += self.jobs.get_nowait() is not None
            except queue.Empty:
                break
        if dropped:
            log(f"stopping: {dropped} notification(s) not run")
        self.jobs.put_nowait(None)
        self.join(grace)
        proc = self._current
        if proc is not None and proc.poll() is None:
            kill_group(proc)
        self.join(KILL_GRACE)


STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}


def _unblock_stop_signals() -> None:
    """In a command's process, before it runs: the signal mask the runner thread set is
    not the command's."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the command's process group, then, after a grace, SIGKILL to whatever
    of it is left (what the command started goes with it)."""
    _signal_group(proc, signal.SIGTERM)
    try:
        proc.wait(KILL_GRACE)
    except subprocess.TimeoutExpired:
        pass
    _signal_group(proc, signal.SIGKILL)
    proc.wait()
    if proc.stdin is not None:
        try:
            proc.stdin.close()
        except OSError:
            pass


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone already


# --- the watch loop ------------------------------------------------------------------------


class _Stop(BaseException):
    """SIGTERM or SIGINT: end notify, exit 0."""


def run_notify(args: Any) -> int:
    """``towerctl notify``: until SIGTERM or SIGINT (exit 0)."""
    from towerd.client.cli.output import UsageError
    from towerd.protocol.paths import default_socket_path

    command: str | None = getattr(args, "exec_command", None)
    if (command is None) == (not args.desktop):
        raise UsageError("give one of --exec CMD or --desktop")
    timeout = args.exec_timeout  # in range: its type (client/cli/seconds.py) refused others
    socket_path = os.fspath(args.socket or default_socket_path())
    if command is None:
        make_job = desktop_job(find_notify_send())
    elif not command.strip():
        raise UsageError("--exec needs a command")
    else:
        make_job = exec_job(command, socket_path)

    def lookup(session_id: str) -> dict[str, Any] | None:
        from towerd.client.sync import Client

        try:
            with Client(socket_path, timeout=2.0, client_name=CLIENT_NAME) as client:
                return dict(client.fleet_get(session_id))
        except Exception:  # noqa: BLE001 - the ids alone will do
            return None

    runner = Runner(make_job, timeout, lookup)
    runner.start()

    def stop(*_: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise _Stop

    saved = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        watch_forever(socket_path, args, runner.submit)
    except _Stop:
        pass
    finally:
        try:
            runner.stop()
        except _Stop:
            pass
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    return 0


def watch_forever(socket_path: str, args: Any, submit: Callable[[Notice], None]) -> None:
    """Watch, hand each notice to ``submit``; reconnect with backoff after any loss."""
    from towerd.client.retry import RECONNECT_WATCH
    from towerd.client.sync import DEFAULT_TIMEOUT, Client
    from towerd.protocol.errors import TooSlow, TowerdError

    # --timeout bounds connect, hello and the snapshot; the pushes have no deadline.
    timeout = DEFAULT_TIMEOUT if getattr(args, "timeout", None) is None else float(args.timeout)
    tracker = Tracker()
    pauses = RECONNECT_WATCH.pauses()
    last_problem: tuple[str, float] | None = None
    while True:
        try:
            client = Client(
                socket_path, timeout=timeout, principal=args.principal, client_name=CLIENT_NAME
            )  # fmt: skip
            try:
                for item in client.watch(TOPICS):
                    if "snapshot" in item:
                        again = tracker.baselined
                        notices = tracker.baseline(item["snapshot"])
                        pauses = RECONNECT_WATCH.pauses()
                        last_problem = None
                        log(
                            f"watching towerd at {socket_path}{' again' if again else ''}: "
                            f"{len(tracker.sessions)} session(s), {tracker.needing_you()} "
                            "needing you already"
                        )
                    else:
                        notices = tracker.apply(item)
                    for notice in notices:
                        submit(notice)
                    if tracker.resync:
                        log("sessions were adopted from another daemon: watching again")
                        break
            finally:
                client.close()
        except TooSlow:
            log("the daemon dropped this watch for falling behind: watching again")
        except Exception as exc:  # noqa: BLE001 - whatever it was: log it, retry
            # The daemon went away, or something unforeseen in what it sent: never exit
            # for it (under systemd, exit 1 means a --desktop without notify-send).
            problem = (
                f"{exc.code}: {exc}"
                if isinstance(exc, TowerdError)
                else (f"{type(exc).__name__}: {exc}")
            )
            now = time.monotonic()
            if (
                last_problem is None
                or last_problem[0] != problem
                or now - last_problem[1] > (LOG_REPEAT_S)
            ):
                log(f"{problem}; trying again")
                last_problem = (problem, now)
            time.sleep(next(pauses))
