"""``towerctl top``: a live terminal dashboard of the fleet and of what needs a decision.

How it stays live, and why this way:

* A background thread holds one ``watch`` subscription to every topic. Its first
  answer, the snapshot, is the state shown. The changes pushed after it are used
  only as a signal: each marks its topic dirty (an ``events`` push marks the fleet,
  whose attention and activity come from events) and wakes the main loop through a
  pipe.
* The main loop re-reads the dirty topics by opening a short-lived connection,
  asking ``watch`` for just those topics and closing it: the answer's snapshot has
  exactly the shape the first one had, taken by the daemon in one step. The notes
  are typed (protocol/changes.py), but applying them would still mean re-deriving
  the daemon's views in the client: the per-state key counts (a key's note does not
  say which state it left), attention from the newest event, which leases still
  live (lease and dispatch notes are audit events, not records); a re-read cannot
  drift from them, and costs one short read per refresh. Re-reads are coalesced, at
  most one per ``--refresh`` seconds or per second, whichever is shorter (a burst of hook
  events costs one read, a lone change shows at once: a long ``--refresh`` once held
  every change back that long), and everything is re-read every 30 s as a safety net. The screen is
  redrawn at least every ``--refresh`` seconds (relative times, lease countdowns).
* A watcher the daemon drops as ``too_slow`` watches again (a fresh snapshot). A
  lost daemon shows a red banner over the last state read while the thread
  reconnects with backoff (0.2 s doubling to 5 s); the daemon must answer at start.
* Resolving opens a short connection of its own. ``idem.resolve`` is per principal,
  so a key of principal ``uid:N:NAME`` is resolved by a client whose principal is
  NAME; ``effect.resolve`` is not.

The terminal is in cbreak mode (keys arrive one by one, Ctrl-C still interrupts)
and is restored on every exit. Without a terminal on stdin and stdout it prints one
frame and exits 0; with ``--json`` it prints the snapshot once. Drawing lives in
:mod:`towerd.client.top_view`.
"""

from __future__ import annotations

import contextlib
import os
import queue
import select
import signal
import socket
import sys
import termios
import threading
import time
import tty
from typing import Any

from rich.console import Console
from rich.live import Live

from towerd.client import top_view
from towerd.client.cli.output import dumps_json
from towerd.client.cli.registry import call_timeout
from towerd.client.sync import Client
from towerd.protocol.errors import TooSlow, TowerdError
from towerd.protocol.fields import WATCH_TOPICS

TOPICS = WATCH_TOPICS  # every topic: the dashboard shows them all
SHOWN = frozenset({"fleet", "idem", "leases", "effects", "dispatch"})  # events only mark fleet
STUCK = "stuck"  # a pseudo-topic: the stuck-loop reports of the open workers' projects
CLIENT_NAME = "towerctl-top"
FULL_REREAD_S = 30.0
COALESCE_S = 1.0  # changes within this long (or --refresh, if shorter) cost one read
RESOLVED_BY = {"resolved_by": "towerctl top"}
CHOICES = {
    "key": {"c": "completed", "a": "abandoned"},
    "effect": {"c": "committed", "a": "aborted"},
}


def run_top(args: Any) -> int:
    refresh = max(0.05, float(getattr(args, "refresh", 1.0) or 1.0))
    source = Source(args.socket, call_timeout(args))
    if args.json:
        snapshot, _hello = source.read(TOPICS)
        print(dumps_json(snapshot, indent=2, sort_keys=True))
        return 0
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        dashboard = Dashboard(source, refresh)
        dashboard.load()
        console = Console(highlight=False)
        console.print(top_view.frame(dashboard.view(), console.size.width))
        return 0
    return Dashboard(source, refresh).run()


def describe(exc: BaseException) -> str:
    if isinstance(exc, TowerdError):
        return f"{exc.code}: {exc}"
    return f"{type(exc).__name__}: {exc}"


def principal_name(principal: str) -> str:
    """``uid:1000:ci`` -> ``ci``: the name a client gives; the daemon adds the uid."""
    if principal.startswith("uid:") and principal.count(":") >= 2:
        return principal.split(":", 2)[2]
    return principal


class Source:
    """Short-lived connections: state re-reads and actions."""

    def __init__(self, socket_path: str | None, timeout: float | None) -> None:
        self.socket_path = socket_path
        self.timeout = timeout

    def client(self, principal: str | None = None) -> Client:
        return Client(
            self.socket_path, timeout=self.timeout, principal=principal, client_name=CLIENT_NAME
        )

    def read(self, topics: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        """The snapshot of ``topics`` (one ``watch`` answer) and the daemon's hello."""
        with self.client() as client:
            watch = client.watch(sorted(topics))
            try:
                reply = next(watch)
            finally:
                watch.close()
            return reply["snapshot"], client.hello

    def stuck(self, dispatch: dict[str, Any]) -> list[dict[str, Any]]:
        """A stuck report with a verdict for each project an open worker serves."""
        roots = sorted({w["project_root"] for w in dispatch.get("workers", [])})
        if not roots:
            return []
        with self.client() as client:
            reports = client.call_many(
                [("dispatch.stuck_report", {"project_root": root}) for root in roots]
            )
        return [
            {"project_root": root, **report}
            for root, report in zip(roots, reports, strict=True)
            if isinstance(report, dict) and report.get("stuck") and report.get("verdict")
        ]

    def resolve(self, item: top_view.Item, outcome: str) -> Any:
        record = item.record
        if item.kind == "key":
            with self.client(principal_name(record["principal"])) as client:
                result = RESOLVED_BY if outcome == "completed" else None
                return client.idem_resolve(record["operation"], record["key"], outcome, result)
        with self.client() as client:
            return client.effect_resolve(record["effect_key"], outcome)


class Watcher(threading.Thread):
    """The one long-lived ``watch``: posts ("snapshot", snapshot, hello), ("change",
    topic), ("lost", why) to ``inbox`` and pokes ``wake`` after each."""

    def __init__(self, source: Source, wake: Any) -> None:
        super().__init__(name="towerctl-top-watch", daemon=True)
        self.source = source
        self.inbox: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self._wake = wake
        self._stopping = threading.Event()
        self._client: Client | None = None

    def post(self, *message: Any) -> None:
        self.inbox.put(message)
        self._wake()

    def run(self) -> None:
        from towerd.client.retry import RECONNECT_WATCH

        pauses = RECONNECT_WATCH.pauses()
        while not self._stopping.is_set():
            try:
                self._client = self.source.client()
                if self._stopping.is_set():
                    return
                for item in self._client.watch(TOPICS):
                    if "snapshot" in item:
                        self.post("snapshot", item["snapshot"], self._client.hello)
                        pauses = RECONNECT_WATCH.pauses()  # watching again: back off afresh
                    else:
                        self.post("change", item["event"])
            except TooSlow:
                continue  # fell behind: watch again for a fresh snapshot
            except Exception as exc:  # noqa: BLE001 - the daemon may be gone: show it, retry
                if self._stopping.is_set():
                    return
                self.post("lost", describe(exc))
                self._stopping.wait(next(pauses))
            finally:
                if self._client is not None:
                    self._client.close()
                    self._client = None

    def stop(self) -> None:
        """End the subscription: shutting the socket down wakes the blocked read."""
        self._stopping.set()
        client = self._client
        sock = getattr(client, "_sock", None) if client is not None else None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self.join(timeout=2)


def parse_keys(data: bytes) -> list[str]:
    """Raw terminal bytes -> key names: letters as themselves, "tab", "backtab", "up",
    "down", "left", "right", "enter", "esc"; other escape sequences as "other"."""
    names = {b"A": "up", b"B": "down", b"C": "right", b"D": "left", b"Z": "backtab"}
    keys, i = [], 0
    while i < len(data):
        byte = data[i : i + 1]
        if byte == b"\x1b" and data[i + 1 : i + 2] in (b"[", b"O") and i + 2 < len(data):
            j = i + 2
            if data[i + 1 : i + 2] == b"[":
                while j < len(data) and 0x20 <= data[j] <= 0x3F:  # parameters, intermediates
                    j += 1
            final = data[j : j + 1]
            keys.append(names.get(final, "other") if j == i + 2 else "other")
            i = j + 1
            continue
        if byte == b"\x1b":
            keys.append("esc")
        elif byte == b"\t":
            keys.append("tab")
        elif byte in (b"\r", b"\n"):
            keys.append("enter")
        else:
            keys.append(chr(data[i]))
        i += 1
    return keys


class Dashboard:
    def __init__(self, source: Source, refresh: float) -> None:
        self.source = source
        self.refresh = refresh
        self.snapshot: dict[str, Any] = {}
        self.hello: dict[str, Any] = {}
        self.stuck: list[dict[str, Any]] = []
        self.dirty: set[str] = set()
        self.watching = False  # the watcher holds a subscription
        self.watch_problem: str | None = None
        self.read_problem: str | None = None
        self.last_read = 0.0
        self.last_full = time.monotonic()
        self.updated: str | None = None
        self.selected: tuple[str, ...] | None = None
        self.selected_index = 0
        self.prompt: tuple[top_view.Item, str] | None = None
        self.message: tuple[str, str] | None = None

    # --- state -------------------------------------------------------------------------------

    def load(self) -> None:
        """The first read, on the caller's thread: no daemon here fails ``towerctl top``."""
        snapshot, self.hello = self.source.read(SHOWN)
        self.snapshot.update(snapshot)
        self.stuck = self.source.stuck(self.snapshot.get("dispatch", {}))
        self._mark_read()

    def _mark_read(self) -> None:
        self.updated = time.strftime("%H:%M:%S")
        self.last_read = time.monotonic()

    def take(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "snapshot":
            self.snapshot.update(message[1])
            self.hello = message[2]
            self.watching, self.watch_problem = True, None
            self.dirty = {STUCK}
            self.last_full = time.monotonic()
            self._mark_read()
        elif kind == "change":
            self.dirty.add("fleet" if message[1] == "events" else message[1])
        elif kind == "lost":
            self.watching, self.watch_problem = False, message[1]

    def reread(self, force: bool = False) -> None:
        now = time.monotonic()
        if self.watching and now - self.last_full >= FULL_REREAD_S:
            self.dirty |= SHOWN
            self.last_full = now
        if not self.dirty or not self.watching:
            return
        if not force and now - self.last_read < self._coalesce():
            return
        topics = self.dirty & SHOWN
        try:
            if topics:
                snapshot, self.hello = self.source.read(topics)
                self.snapshot.update(snapshot)
            if "dispatch" in self.dirty or STUCK in self.dirty:
                self.stuck = self.source.stuck(self.snapshot.get("dispatch", {}))
        except TowerdError as exc:
            self.read_problem = describe(exc)
            self.last_read = now
            return
        self.read_problem = None
        self.dirty.clear()
        self._mark_read()

    def _coalesce(self) -> float:
        return min(self.refresh, COALESCE_S)

    def wait_time(self) -> float:
        """How long to wait for input or a change: until the screen's next redraw, the
        coalesced re-read of a change, or the safety net's full re-read, the soonest."""
        now = time.monotonic()
        wait = self.refresh
        if self.watching:
            wait = min(wait, max(0.0, self.last_full + FULL_REREAD_S - now))
            if self.dirty:
                wait = min(wait, max(0.0, self.last_read + self._coalesce() - now))
        return wait

    # --- the screen --------------------------------------------------------------------------

    def items(self) -> list[top_view.Item]:
        """The selectable rows; keeps the selection on its row, or its place if it went."""
        items = top_view.selectable(self.snapshot)
        identities = [item.identity for item in items]
        if self.selected is not None:
            if self.selected in identities:
                self.selected_index = identities.index(self.selected)
            elif items:
                self.selected_index = min(self.selected_index, len(items) - 1)
                self.selected = identities[self.selected_index]
            else:
                self.selected = None
        return items

    def view(self) -> top_view.View:
        self.items()
        problem = self.watch_problem if not self.watching else self.read_problem
        prompt = self.prompt[1] if self.prompt is not None else None
        return top_view.View(
            snapshot=self.snapshot,
            now_ms=int(time.time() * 1000),
            clock=time.strftime("%H:%M:%S"),
            daemon=self.hello,
            stuck=self.stuck,
            selected=self.selected,
            problem=problem,
            updated=self.updated,
            prompt=prompt,
            message=self.message,
        )

    # --- keys --------------------------------------------------------------------------------

    def on_key(self, key: str) -> bool:
        """Handle one key; True means quit."""
        if self.prompt is not None:
            self._answer(key)
            return False
        if key == "q":
            return True
        items = self.items()
        if key in ("tab", "n", "down", "j", "backtab", "up", "k"):
            self._move(items, key)
        elif key == "esc":
            self.selected, self.message = None, None
        elif key == "r":
            self._ask(items)
        return False

    def _move(self, items: list[top_view.Item], key: str) -> None:
        if not items:
            self.message = ("dim", "nothing to select: no outcome_unknown key, no uncertain effect")
            return
        step = -1 if key in ("backtab", "up", "k") else 1
        if self.selected is None:
            index = 0 if step > 0 else len(items) - 1
        elif key in ("tab", "n", "backtab"):
            index = (self.selected_index + step) % len(items)
        else:
            index = max(0, min(len(items) - 1, self.selected_index + step))
        self.selected, self.selected_index = items[index].identity, index
        self.message = None

    def _ask(self, items: list[top_view.Item]) -> None:
        item = next((i for i in items if i.identity == self.selected), None)
        if item is None:
            self.message = (
                "yellow",
                "select an outcome_unknown key or uncertain effect first (Tab)",
            )
            return
        record = item.record
        if item.kind == "key":
            question = (
                f"Resolve {record['operation']} {record['key']} as (c)ompleted / "
                "(a)bandoned? (Esc cancels)"
            )
        else:
            question = (
                f"Resolve effect {record['effect_key']} ({record['action_kind']} "
                f"{record['target_ref']}) as (c)ommitted / (a)borted? (Esc cancels)"
            )
        self.prompt = (item, question)
        self.message = None

    def _answer(self, key: str) -> None:
        assert self.prompt is not None
        item, _question = self.prompt
        self.prompt = None
        outcome = CHOICES[item.kind].get(key)
        if outcome is None:
            self.message = ("dim", "cancelled: nothing was resolved")
            return
        record = item.record
        what = (
            f"key {record['operation']} {record['key']}"
            if item.kind == "key"
            else f"effect {record['effect_key']}"
        )
        try:
            self.source.resolve(item, outcome)
        except TowerdError as exc:
            self.message = ("bold red", f"could not resolve {what}: {exc.code}: {exc}")
        else:
            self.message = ("bold green", f"resolved {what} as {outcome}")
        self.dirty.add("idem" if item.kind == "key" else "effects")
        self.reread(force=True)

    # --- the loop ----------------------------------------------------------------------------

    def run(self) -> int:
        self.load()
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        os.set_blocking(wake_w, False)

        def wake(*_: Any) -> None:
            with contextlib.suppress(BlockingIOError, OSError):
                os.write(wake_w, b"!")

        watcher = Watcher(self.source, wake)
        fd = sys.stdin.fileno()
        saved = termios.tcgetattr(fd)
        old_winch = signal.signal(signal.SIGWINCH, wake)
        try:
            tty.setcbreak(fd)
            console = Console(highlight=False)
            with Live(
                console=console,
                screen=True,
                auto_refresh=False,
                redirect_stdout=False,
                redirect_stderr=False,
            ) as live:
                watcher.start()
                return self._loop(live, console, fd, wake_r, watcher)
        except KeyboardInterrupt:
            return 130
        finally:
            if watcher.is_alive():
                watcher.stop()
            termios.tcsetattr(fd, termios.TCSADRAIN, saved)
            signal.signal(signal.SIGWINCH, old_winch)
            os.close(wake_r)
            os.close(wake_w)

    def _loop(self, live: Live, console: Console, fd: int, wake_r: int, watcher: Watcher) -> int:
        while True:
            while True:
                try:
                    self.take(watcher.inbox.get_nowait())
                except queue.Empty:
                    break
            self.reread()
            width, height = console.size
            live.update(top_view.frame(self.view(), width, height), refresh=True)
            ready, _, _ = select.select([fd, wake_r], [], [], self.wait_time())
            if wake_r in ready:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 4096)
            if fd in ready:
                data = os.read(fd, 1024)
                if not data:
                    return 0  # stdin closed
                for key in parse_keys(data):
                    if self.on_key(key):
                        return 0
