"""Stored text reaches a terminal as text: the real CLI and ``towerctl top`` (in tmux)
against a real daemon holding names, cwds, keys, events and messages made of rich
markup and terminal escape sequences.

Whoever can register a session (any hook, any local process of the user) chooses these
strings; printed raw, ``\\x1b]0;...\\x07`` retitles the window, ``\\x1b[2J`` clears the
screen, ``\\x9b`` starts a CSI on terminals that take C1 controls, a newline forges a
table row, and ``[link=...]`` is a clickable hyperlink in rich. Expected: each control
character shown as its escape (``\\x1b``), markup shown as written, JSON exact.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from towerd_testing import TOWERCTL, towerctl, wait_for

# (what is stored, how a terminal must show it)
EVIL = [
    ("[/]", "[/]"),
    ("[link=https://evil.example]click[/link]", "[link=https://evil.example]click[/link]"),
    ("\x1b]0;pwned\x07", r"\x1b]0;pwned\x07"),
    ("\x1b[2J\x1b[H", r"\x1b[2J\x1b[H"),
    ("a\nb", r"a\nb"),
    ("\x9b31m", r"\x9b31m"),
    ("bs\x08del\x7fcr\r", r"bs\x08del\x7fcr\r"),
]
STORED = [stored for stored, _shown in EVIL]
SHOWN = [shown for _stored, shown in EVIL]
MARKUP_KEYS = ["[/]", "[link=https://evil.example]click[/link]"]  # keys must be printable


def raw_controls(text: str) -> list[str]:
    """Characters a terminal would act on: C0 but newline, DEL, C1."""
    return [c for c in text if (c < " " and c != "\n") or "\x7f" <= c <= "\x9f"]


def ok(daemon, *args: str) -> str:
    r = towerctl(daemon, *args)
    assert r.returncode == 0 and r.stderr == "", r
    return r.stdout


def column(table: str, title: str) -> list[str]:
    """A text table's column (cells are separated by two or more spaces); every row must
    have as many cells as the header: no row was forged or broken."""
    header, *rows = [re.split(r" {2,}", line) for line in table.splitlines()]
    assert all(len(row) == len(header) for row in rows), table
    return [row[header.index(title)] for row in rows]


def rows_holding(text: str, needle: str) -> list[str]:
    return [line for line in text.splitlines() if needle in line]


def on_screen(shown: str) -> str:
    """What a dashboard column of 32 shows of it (a longer one ends in an ellipsis)."""
    return shown if len(shown) <= 32 else shown[:31]


@pytest.fixture
def stored(daemon) -> dict[str, str]:
    """Sessions named and placed (cwd) by each string; keys whose effect_ref is one and
    keys named in markup; events whose kind and agent session id are one; messages."""
    with daemon.client() as client:
        sessions = [
            client.session_register(cwd=text, agent="claude", name=text)["session_id"]
            for text in STORED
        ]
        for i, text in enumerate(STORED):
            client.idem_claim("op", f"key-{i}", effect_ref=text)
        for key in MARKUP_KEYS:
            client.idem_claim("op", key)
        for text in STORED:
            client.event_record(text, session_id=sessions[0], agent_session_id=text)
            client.session_message(sessions[0], text)
    return {"session": sessions[0]}


def test_text_tables_show_stored_escapes_visibly_and_stay_tables(daemon, stored):
    fleet = ok(daemon, "fleet", "list")
    keys = ok(daemon, "idem", "list")
    events = ok(daemon, "events", "list")
    messages = ok(daemon, "message", "list", stored["session"])
    for text in (fleet, keys, events, messages):
        assert raw_controls(text) == [], text
    assert sorted(column(fleet, "NAME")) == sorted(column(fleet, "CWD")) == sorted(SHOWN)
    assert sorted(column(events, "KIND")) == sorted(column(events, "AGENT_SESSION"))
    assert sorted(column(events, "KIND")) == sorted(SHOWN)
    assert column(messages, "TEXT") == SHOWN  # oldest first
    by_key = dict(zip(column(keys, "KEY"), column(keys, "EFFECT_REF"), strict=True))
    assert [by_key[f"key-{i}"] for i in range(len(SHOWN))] == SHOWN
    assert set(MARKUP_KEYS) <= set(by_key)
    # One row's `key: value` lines: a newline in the name does not start a line of its own.
    with daemon.client() as client:
        forged = next(s for s in client.fleet_list()["sessions"] if s["name"] == "a\nb")
    record = ok(daemon, "fleet", "get", forged["session_id"])
    assert raw_controls(record) == []
    assert "name: a\\nb\n" in record and "\nb\n" not in record


def test_json_output_is_exact_and_escaped(daemon, stored):
    """--json round-trips the exact strings; json.dumps escapes every control character
    (C0, DEL, C1), so nothing raw reaches a terminal there either. (A guard: this held
    before the text renderers were fixed, and must go on holding.)"""
    outputs = {
        "fleet": ok(daemon, "--json", "fleet", "list"),
        "events": ok(daemon, "--json", "events", "list"),
        "messages": ok(daemon, "--json", "message", "list", stored["session"]),
        "keys": ok(daemon, "--json", "idem", "list"),
        "top": ok(daemon, "--json", "top"),
    }
    for what, text in outputs.items():
        assert raw_controls(text) == [], (what, text)
    fleet = json.loads(outputs["fleet"])["sessions"]
    assert sorted(s["name"] for s in fleet) == sorted(STORED)
    assert all(s["cwd"] == s["name"] for s in fleet)
    events = json.loads(outputs["events"])["events"]
    assert sorted(e["kind"] for e in events) == sorted(STORED)
    assert all(e["agent_session_id"] == e["kind"] for e in events)
    messages = json.loads(outputs["messages"])["messages"]
    assert [m["text"] for m in messages] == STORED
    keys = json.loads(outputs["keys"])["keys"]
    assert sorted(k["effect_ref"] for k in keys if k["key"].startswith("key-")) == sorted(STORED)
    assert sorted(k["key"] for k in keys if not k["key"].startswith("key-")) == sorted(MARKUP_KEYS)
    top = json.loads(outputs["top"])
    assert sorted(s["name"] for s in top["fleet"]["sessions"]) == sorted(STORED)


def test_messages_quoting_another_process_are_escaped(daemon, short_tmp):
    """lock worktree names the lock's holder with its command line, which its owner
    chose: the refusal shows it escaped."""
    repo = short_tmp / "repo"
    subprocess.run(["git", "init", "-q", str(repo)], check=True, capture_output=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOWERD_")}
    holder = subprocess.Popen(
        [TOWERCTL, "--socket", str(daemon.socket_path), "lock", "worktree", "--repo", str(repo),
         "--", "sh", "-c", "echo holding; exec cat", "\x1b]0;pwned\x07"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "holding\n"
        r = towerctl(daemon, "lock", "worktree", "--repo", str(repo), "--timeout", "0", "--",
                     "true")  # fmt: skip
        assert r.returncode == 121 and r.stdout == "", r
        assert raw_controls(r.stderr) == [], r.stderr
        assert r"exec cat \x1b]0;pwned\x07)" in r.stderr, r.stderr
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        assert holder.wait(10) == 0


def test_top_without_a_terminal_shows_markup_and_escapes_as_text(daemon, stored):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOWERD_")}
    env["COLUMNS"] = "200"
    frame = subprocess.run(
        [TOWERCTL, "--socket", str(daemon.socket_path), "top"],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, env=env, check=False,
        timeout=30,
    )  # fmt: skip
    assert frame.returncode == 0 and frame.stderr == "", frame
    assert raw_controls(frame.stdout) == [] and "\x1b" not in frame.stdout
    for shown in SHOWN:
        assert rows_holding(frame.stdout, on_screen(shown)), (shown, frame.stdout)


# --- towerctl top in a real terminal ----------------------------------------------------------

needs_tmux = pytest.mark.skipif(
    shutil.which("tmux") is None,
    reason="tmux is not installed: the dashboard is tested in a real terminal inside tmux",
)

CLAIMANT = textwrap.dedent(
    """
    import signal, sys
    from towerd.client import Client
    with Client(sys.argv[1], principal="ci") as client:
        client.idem_claim("op", sys.argv[2], effect_ref=sys.argv[3])
        print("claimed", flush=True)
        signal.pause()
    """
)


class Terminal:
    """A tmux server of the test's own; everything the program writes to its pane is
    also copied, raw, to ``raw`` (pipe-pane), from before its first byte."""

    def __init__(self, root: Path) -> None:
        self.socket = str(root / "tmux.sock")
        self.raw = root / "raw"
        # The pane's size is tmux's, not COLUMNS/LINES (pytest-xdist's workers set 80x24).
        inherited = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
        self.env = {**inherited, "TERM": os.environ.get("TERM") or "xterm-256color"}

    def tmux(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["tmux", "-S", self.socket, *args], capture_output=True,
                              text=True, env=self.env, check=check, timeout=10)  # fmt: skip

    def start(self, command: str) -> None:
        self.tmux("new-session", "-d", "-s", "t", "-x", "200", "-y", "50",
                  f"sh -c 'read go; {command}'")  # fmt: skip
        self.tmux("pipe-pane", "-o", "-t", "t", f"cat > {self.raw}")
        self.tmux("send-keys", "-t", "t", "Enter")

    def screen(self, *options: str) -> str:
        captured = self.tmux("capture-pane", "-p", *options, "-t", "t", check=False)
        return captured.stdout if captured.returncode == 0 else ""

    def title(self) -> str:
        return self.tmux("display-message", "-p", "-t", "t", "#{pane_title}").stdout.strip()


@needs_tmux
def test_top_in_a_terminal_draws_stored_text_literally(make_daemon, short_tmp):
    """No crash on `[/]`, no hyperlink, no new window title, no cleared screen, no forged
    row: each string is on screen as its visible form; the selected key's prompt too."""
    daemon = make_daemon().start("--holder-check-interval", "0.2")
    with daemon.client() as client:
        for text in STORED:
            client.session_register(cwd="/srv/app", agent="claude", name=text)
        client.session_register(cwd="\x1b[2J\x1b[H", agent="claude", name="in-a-forged-cwd")
        # An outcome_unknown key named in markup, whose effect_ref holds escapes.
        claimant = subprocess.Popen(
            [sys.executable, "-c", CLAIMANT, str(daemon.socket_path), "[/]", "\x1b]0;pwned\x07"],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert claimant.stdout is not None and claimant.stdout.readline() == "claimed\n"
        claimant.kill()
        claimant.wait(10)
    with daemon.client(principal="ci") as ci:
        wait_for(lambda: ci.idem_get("op", "[/]")["state"] == "outcome_unknown", timeout=10,
                 what="the dead claimant's key to turn outcome_unknown")  # fmt: skip

    terminal = Terminal(short_tmp)
    exit_file = short_tmp / "exit"
    title = None
    try:
        terminal.start(f"{TOWERCTL} --socket {daemon.socket_path} top --refresh 0.2; "
                       f"echo EXIT=$? > {exit_file}")  # fmt: skip
        seen = [""]

        def drawn() -> bool:
            seen[0] = terminal.screen()
            return "in-a-forged-cwd" in seen[0] and "outcome unknown: 1 key" in seen[0]

        try:
            wait_for(drawn, timeout=10, what="the dashboard's first frame")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n--- screen ---\n{seen[0]}\n--- raw ---\n"
                                 f"{terminal.raw.read_bytes()!r}") from None  # fmt: skip
        screen = seen[0]
        for shown in SHOWN:
            assert rows_holding(screen, on_screen(shown)), (shown, screen)
        assert rows_holding(screen, r"\x1b[2J\x1b[H")  # the forged cwd, as a repository
        # The keys panel: the key [/] with its effect_ref.
        assert [r for r in rows_holding(screen, r"\x1b]0;pwned\x07") if " [/] " in r], screen
        terminal.tmux("send-keys", "-t", "t", "Tab")
        terminal.tmux("send-keys", "-t", "t", "r")
        wait_for(lambda: "Resolve op [/] as (c)ompleted" in terminal.screen(), timeout=10,
                 what="the resolve prompt naming the key as written")  # fmt: skip
        terminal.tmux("send-keys", "-t", "t", "Escape")
        title = terminal.title()
        styled = terminal.screen("-e")  # with the escapes tmux keeps: colours, no OSC
        terminal.tmux("send-keys", "-t", "t", "q")
        wait_for(lambda: exit_file.exists() and exit_file.read_text(), timeout=10,
                 what="top to exit")  # fmt: skip
        assert exit_file.read_text() == "EXIT=0\n"
    finally:
        terminal.tmux("kill-server", check=False)
    assert "pwned" not in (title or "")
    assert "\x1b]" not in styled
    raw = terminal.raw.read_bytes()
    assert b"\x1b]8;" not in raw, "a hyperlink was drawn"
    assert b"\x1b]0;" not in raw and b"\x1b]2;" not in raw, "the window title was set"
    assert b"\xc2\x9b" not in raw and b"\x07" not in raw
    assert b"\x1b[2J" not in raw, "the screen was cleared"
