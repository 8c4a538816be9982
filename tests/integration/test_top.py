"""``towerctl top`` in a real terminal: the real CLI runs inside tmux against a real daemon;
the test reads the screen with ``capture-pane`` and types with ``send-keys``.

State is made through the Python client. The unknown key and the uncertain effect belong
to a claimant process (principal ``ci``) that is killed with -9: the daemon's holder sweep
turns its key ``outcome_unknown`` and parks its shared effect ``uncertain``.
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

from towerd.protocol.naming import effect_key
from towerd_testing import TOWERCTL, wait_for

pytestmark = [
    pytest.mark.skipif(
        shutil.which("tmux") is None,
        reason="tmux is not installed: the dashboard is tested in a real terminal inside tmux",
    ),
    pytest.mark.both_backends,
]

FAST_SWEEP = ("--holder-check-interval", "0.2")
APP, API, WEB = "/srv/repos/app", "/srv/repos/api", "/srv/repos/web"
MARK = "\u203a"
KEY_PROMPT = "Resolve git.push release-7 as (c)ompleted / (a)bandoned? (Esc cancels)"
EFFECT = effect_key("run_7", "open-issue", "tracker-issue", "JIRA-7")
EFFECT_PROMPT = (
    f"Resolve effect {EFFECT} (tracker-issue JIRA-7) as (c)ommitted / (a)borted? (Esc cancels)"
)

CLAIMANT = textwrap.dedent(
    """
    import signal, sys
    from towerd.client import Client
    with Client(sys.argv[1], principal="ci") as client:
        client.idem_claim("git.push", "release-7", effect_ref="refs/heads/release-7")
        client.effect_claim("run_7", "open-issue", "a-1", "tracker-issue", "JIRA-7")
        print("claimed", flush=True)
        signal.pause()
    """
)


class Screen:
    """A tmux server of the test's own (``-S`` socket in the temp dir) with one session."""

    def __init__(self, root: Path, name: str = "top") -> None:
        self.socket = str(root / "tmux.sock")
        self.name = name
        # The pane's size is tmux's: COLUMNS and LINES (pytest-xdist's workers set 80x24)
        # would make rich draw for a terminal of that size instead.
        inherited = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
        self.env = {**inherited, "TERM": os.environ.get("TERM") or "xterm-256color"}

    def tmux(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["tmux", "-S", self.socket, *args],
            capture_output=True,
            text=True,
            env=self.env,
            check=check,
            timeout=10,
        )

    def start(self, command: str, width: int = 160, height: int = 50) -> None:
        self.tmux("new-session", "-d", "-s", self.name, "-x", str(width), "-y", str(height),
                  command)  # fmt: skip

    def text(self) -> str:
        captured = self.tmux("capture-pane", "-p", "-t", self.name, check=False)
        return captured.stdout if captured.returncode == 0 else ""

    def wait_for(self, predicate, what: str, timeout: float = 8.0) -> str:
        seen = [""]

        def check() -> bool:
            seen[0] = self.text()
            return bool(predicate(seen[0]))

        try:
            wait_for(check, timeout=timeout, what=what)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n--- the screen ---\n{seen[0]}") from None
        return seen[0]

    def keys(self, *keys: str) -> None:
        self.tmux("send-keys", "-t", self.name, *keys)

    def kill(self) -> None:
        self.tmux("kill-server", check=False)


def panel_rows(screen: str, title: str) -> list[list[str]]:
    """The cells of the panel whose title starts with ``title`` (header row first); a
    blank first cell (a repository's continuation row) is kept as ""."""
    lines = screen.splitlines()
    start = next((i for i, line in enumerate(lines) if f"\u256d\u2500 {title}" in line), None)
    if start is None:
        return []
    rows = []
    for line in lines[start + 1 :]:
        if line.startswith("\u2570"):
            break
        body = line.strip().removeprefix("\u2502").removesuffix("\u2502")
        rows.append(re.split(r" {2,}", body[1:].rstrip()))
    return rows


def fleet(screen: str) -> list[list[str]]:
    """REPOSITORY, SESSION, AGENT, STATE of each fleet row."""
    return [row[:4] for row in panel_rows(screen, "fleet:")[1:]]


def selected_row(screen: str) -> str | None:
    return next((line for line in screen.splitlines() if f"\u2502 {MARK}" in line), None)


def register(client, cwd: str, agent: str, name: str, kind: str) -> str:
    session_id = client.session_register(cwd=cwd, agent=agent, name=name)["session_id"]
    client.event_record(kind, session_id=session_id)
    return session_id


def test_top_follows_the_fleet_and_resolves_in_a_real_terminal(make_daemon, short_tmp):
    daemon = make_daemon().start(*FAST_SWEEP)
    with daemon.client() as client, daemon.client(principal="ci") as ci:
        register(client, APP, "claude", "fix-login", "Notification")
        refactor = register(client, APP, "codex", "refactor", "PreToolUse")
        register(client, API, "claude", "bump-deps", "Stop")
        claimant = subprocess.Popen(
            [sys.executable, "-c", CLAIMANT, str(daemon.socket_path)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert claimant.stdout is not None and claimant.stdout.readline().strip() == "claimed"
        claimant.kill()
        claimant.wait(10)
        wait_for(lambda: ci.idem_get("git.push", "release-7")["state"] == "outcome_unknown",
                 timeout=10, what="the dead claimant's key to turn outcome_unknown")  # fmt: skip
        wait_for(lambda: client.effect_get(EFFECT)["status"] == "uncertain",
                 timeout=10, what="the dead claimant's shared effect to park")  # fmt: skip

        exit_file, stty_file = short_tmp / "exit", short_tmp / "stty"
        screen = Screen(short_tmp)
        try:
            screen.start(
                f"sh -c '{TOWERCTL} --socket {daemon.socket_path} top --refresh 0.2; "
                f"echo EXIT=$? > {exit_file}; stty -a > {stty_file}'"
            )
            # The fleet by repository (sorted), needs-you first within one; both panels.
            # The key's panel is waited for whole: its columns are sized to what they hold,
            # and a refresh under load can show a cell cut while the probe's cell changes.
            key_row = ["", f"uid:{os.geteuid()}:ci", "git.push", "release-7",
                       "refs/heads/release-7"]  # fmt: skip
            text = screen.wait_for(
                lambda s: (
                    len(fleet(s)) == 3
                    and EFFECT in s
                    and panel_rows(s, "outcome unknown: 1 key")[1:2] != []
                    and panel_rows(s, "outcome unknown: 1 key")[1][:5] == key_row
                ),
                "the fleet, the unknown key and the uncertain effect",
            )
            assert fleet(text) == [
                [API, "bump-deps", "claude", "done"],
                [APP, "fix-login", "claude", "needs you"],
                ["", "refactor", "codex", "running"],
            ]
            keys = panel_rows(text, "outcome unknown: 1 key")
            assert keys[1][:5] == key_row
            effects = panel_rows(text, "uncertain effects: 1")
            assert effects[1][:5] == ["", EFFECT, "tracker-issue", "JIRA-7", "run_7 / open-issue"]
            assert selected_row(text) is None

            # It reacts to changes: a session needs the user, a new one in a new repository.
            client.event_record("Notification", session_id=refactor)
            register(client, WEB, "claude", "new-session", "SessionStart")
            after = [
                [API, "bump-deps", "claude", "done"],
                [APP, "refactor", "codex", "needs you"],  # needs you, newest activity first
                ["", "fix-login", "claude", "needs you"],
                [WEB, "new-session", "claude", "running"],
            ]
            screen.wait_for(lambda s: fleet(s) == after, "the fleet to show both changes")

            # Select the key, resolve it completed: resolved under its principal (ci).
            screen.keys("Tab")
            screen.wait_for(lambda s: "release-7" in (selected_row(s) or ""), "the key selected")
            screen.keys("r")
            screen.wait_for(lambda s: KEY_PROMPT in s, "the resolve prompt")
            assert ci.idem_get("git.push", "release-7")["state"] == "outcome_unknown"
            screen.keys("c")
            text = screen.wait_for(
                lambda s: (
                    "resolved key git.push release-7 as completed" in s
                    and not panel_rows(s, "outcome unknown")
                ),
                "the key resolved and its panel gone",
            )
            record = ci.idem_get("git.push", "release-7")
            assert record["state"] == "completed"
            assert record["result"] == {"resolved_by": "towerctl top"}

            # The selection moved to the effect; Esc cancels, then a aborts it.
            assert EFFECT in (selected_row(text) or "")
            screen.keys("r")
            screen.wait_for(lambda s: EFFECT_PROMPT in s, "the effect prompt")
            screen.keys("Escape")
            screen.wait_for(lambda s: "cancelled: nothing was resolved" in s, "the cancel")
            assert client.effect_get(EFFECT)["status"] == "uncertain"
            screen.keys("r")
            screen.wait_for(lambda s: EFFECT_PROMPT in s, "the effect prompt again")
            screen.keys("a")
            screen.wait_for(
                lambda s: (
                    f"resolved effect {EFFECT} as aborted" in s
                    and not panel_rows(s, "uncertain effects")
                ),
                "the effect resolved and its panel gone",
            )
            assert client.effect_get(EFFECT)["status"] == "aborted"

            # The daemon goes away: a banner; it comes back: the dashboard follows again.
            daemon.kill9()
            screen.wait_for(lambda s: "daemon unreachable, retrying" in s, "the banner")
            daemon.start(*FAST_SWEEP)
            screen.wait_for(lambda s: "daemon unreachable" not in s and "epoch 2" in s,
                            "the dashboard to reconnect", timeout=10)  # fmt: skip
            with daemon.client() as again:
                register(again, WEB, "claude", "after-restart", "Stop")
            screen.wait_for(lambda s: len(fleet(s)) == 5, "a change after the reconnect")

            screen.keys("q")
            wait_for(lambda: stty_file.exists() and stty_file.read_text(), what="top to exit")
            assert exit_file.read_text() == "EXIT=0\n"
            modes = stty_file.read_text().split()
            assert "icanon" in modes and "echo" in modes, "the terminal was not restored"
        finally:
            screen.kill()
    assert daemon.stop() == 0, daemon.log()


def test_a_long_refresh_still_shows_a_change_at_once(make_daemon, short_tmp):
    """--refresh is how often the screen is redrawn at least, not how long a change may
    wait: with --refresh 3600, a session registered after the first frame shows within
    seconds (the re-read throttle was --refresh itself, and held it back an hour)."""
    daemon = make_daemon().start()
    with daemon.client() as client:
        register(client, APP, "claude", "first", "SessionStart")
        screen = Screen(short_tmp)
        try:
            screen.start(f"{TOWERCTL} --socket {daemon.socket_path} top --refresh 3600")
            screen.wait_for(lambda s: len(fleet(s)) == 1, "the first frame")
            register(client, WEB, "claude", "second", "SessionStart")
            screen.wait_for(lambda s: len(fleet(s)) == 2, "the new session, without a key press")
        finally:
            screen.kill()


def test_without_a_terminal_top_prints_one_frame_or_the_snapshot(daemon):
    with daemon.client() as client:
        register(client, APP, "claude", "fix-login", "Notification")
        client.lease_acquire("deploy/staging", ttl_ms=60_000)
        env = {k: v for k, v in os.environ.items() if not k.startswith("TOWERD_")}
        env["COLUMNS"] = "140"
        command = [TOWERCTL, "--socket", str(daemon.socket_path), "top"]
        frame = subprocess.run(command, stdin=subprocess.DEVNULL, capture_output=True,
                               text=True, env=env, timeout=30)  # fmt: skip
        assert frame.returncode == 0 and frame.stderr == "", frame
        assert fleet(frame.stdout) == [[APP, "fix-login", "claude", "needs you"]]
        lease = panel_rows(frame.stdout, "leases: 1 held")[1]
        assert lease[:2] == ["deploy/staging", "1"]
        assert not panel_rows(frame.stdout, "outcome unknown")
        assert "\x1b" not in frame.stdout  # no colours or cursor moves into a pipe

        snapshot = subprocess.run([*command[:3], "--json", "top"], stdin=subprocess.DEVNULL,
                                  capture_output=True, text=True, env=env, timeout=30)  # fmt: skip
        assert snapshot.returncode == 0 and snapshot.stderr == "", snapshot
        document = json.loads(snapshot.stdout)
        assert sorted(document) == ["dispatch", "effects", "events", "fleet", "idem", "leases"]
        assert [s["name"] for s in document["fleet"]["sessions"]] == ["fix-login"]
        assert [a["attention"] for a in document["fleet"]["activity"]] == ["needs_you"]
        assert [le["resource"] for le in document["leases"]["leases"]] == ["deploy/staging"]
