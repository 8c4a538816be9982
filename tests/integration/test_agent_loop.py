"""towerd in the agent's own loop, end to end: ``towerctl hooks install`` writes the
hooks into a temporary $HOME, and fake agents (tests/fixtures/fake_agent.py: long-lived
processes that, like Claude Code, run the exact command string from settings.json
through ``sh -c`` with the hook's JSON on stdin) work in one git worktree against a
real daemon. The agents' PATH does not hold the venv: the installed command must be
absolute."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from towerd.client import QuotaExceeded
from towerd_testing import TOWERCTL, Daemon, towerctl, wait_for

pytestmark = pytest.mark.both_backends

FAKE_AGENT = Path(__file__).parent.parent / "fixtures" / "fake_agent.py"
PLAIN_PATH = "/usr/local/bin:/usr/bin:/bin"  # no venv: hooks run without it


def install(home: Path, *extra: str) -> dict[str, str]:
    """``towerctl hooks install`` into ``home``; the command wired for each event."""
    env = {"HOME": str(home), "PATH": PLAIN_PATH, "CODEX_HOME": str(home / ".codex")}
    done = subprocess.run(
        [TOWERCTL, "hooks", "install", *extra], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done
    settings = json.loads((home / ".claude" / "settings.json").read_text())
    return {
        event: groups[-1]["hooks"][-1]["command"] for event, groups in settings["hooks"].items()
    }


def codex_commands(home: Path) -> dict[str, str]:
    hooks = json.loads((home / ".codex" / "hooks.json").read_text())["hooks"]
    return {event: groups[-1]["hooks"][-1]["command"] for event, groups in hooks.items()}


class FakeAgent:
    """One agent process, its session id, and the hooks it runs."""

    def __init__(self, commands: dict[str, str], worktree: Path, socket_path: Path, home: Path):
        self.commands = commands
        self.worktree = worktree
        self.agent_session_id = str(uuid.uuid4())
        env = {
            "HOME": str(home),
            "PATH": PLAIN_PATH,
            "TOWERD_SOCKET": str(socket_path),
            "CODEX_HOME": str(home / ".codex"),
        }
        self.proc = subprocess.Popen(
            [sys.executable, str(FAKE_AGENT)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            cwd=worktree,
            text=True,
        )
        self._lock = threading.Lock()

    def run(self, command: str, stdin: str = "") -> dict:
        with self._lock:
            assert self.proc.stdin is not None and self.proc.stdout is not None
            self.proc.stdin.write(json.dumps({"command": command, "stdin": stdin}) + "\n")
            self.proc.stdin.flush()
            return json.loads(self.proc.stdout.readline())

    def hook(self, event: str, **fields) -> dict:
        """Run the installed command for ``event``; it must exit 0 and keep stderr empty."""
        payload = {
            "session_id": self.agent_session_id,
            "transcript_path": f"{self.worktree}/.t/{self.agent_session_id}.jsonl",
            "cwd": str(self.worktree),
            "hook_event_name": event,
            **fields,
        }
        done = self.run(self.commands[event], json.dumps(payload))
        assert (done["rc"], done["stderr"]) == (0, ""), done
        return done

    def edit(self, path: str, tool: str = "Edit") -> dict | None:
        """A PreToolUse of ``tool`` on ``path``: None when allowed (nothing printed), else
        the decision the hook printed."""
        field = "notebook_path" if tool == "NotebookEdit" else "file_path"
        done = self.hook("PreToolUse", tool_name=tool, tool_input={field: path})
        return json.loads(done["stdout"]) if done["stdout"] else None

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def worktree(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    root.mkdir()
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    (root / "a.py").write_text("a = 1\n")
    (root / "b.py").write_text("b = 1\n")
    (root / "src").mkdir()
    return root


@pytest.fixture
def agents(tmp_path: Path, worktree: Path, daemon: Daemon):
    home = tmp_path / "home"
    home.mkdir()
    commands = install(home)
    made: list[FakeAgent] = []

    def make(commands_for: dict[str, str] | None = None) -> FakeAgent:
        agent = FakeAgent(commands_for or commands, worktree, daemon.socket_path, home)
        made.append(agent)
        return agent

    make.home = home  # type: ignore[attr-defined]
    make.commands = commands  # type: ignore[attr-defined]
    yield make
    for agent in made:
        agent.close()


def session_of(daemon: Daemon, agent: FakeAgent) -> dict:
    with daemon.client() as client:
        rows = client.fleet_list()["sessions"]
    (row,) = [row for row in rows if row["agent_session_id"] == agent.agent_session_id]
    return row


def deny_reason(decision: dict) -> str:
    output = decision["hookSpecificOutput"]
    assert output["hookEventName"] == "PreToolUse"
    assert output["permissionDecision"] == "deny"
    return output["permissionDecisionReason"]


def test_the_installed_command_is_absolute_and_wired_to_every_event(agents) -> None:
    commands = agents.commands
    assert set(commands) >= {
        "SessionStart", "UserPromptSubmit", "PreToolUse", "PostToolUse", "Notification",
        "Stop", "SubagentStop", "PreCompact", "SessionEnd",
    }  # fmt: skip
    for command in commands.values():
        program = command.split()[0]
        assert os.path.isabs(program) and os.access(program, os.X_OK), command
        assert " hook --agent claude" in command


def test_two_agents_one_worktree_one_file_at_a_time(agents, worktree: Path, daemon: Daemon):
    a, b = agents(), agents()
    a.hook("SessionStart", source="startup")
    b.hook("SessionStart", source="startup")
    row_a = session_of(daemon, a)
    assert row_a["agent_pid"] == a.proc.pid and row_a["live"] is True
    assert row_a["agent"] == "claude" and row_a["cwd"] == str(worktree)

    assert a.edit("a.py") is None  # allowed: nothing printed, not even "allow"
    reason = deny_reason(b.edit(str(worktree / "a.py")))
    assert str(worktree / "a.py") in reason and row_a["session_id"] in reason
    assert "towerctl release" in reason
    assert b.edit("b.py") is None  # another file is fine
    assert a.edit("a.py") is None  # the holder renews its own lease
    assert deny_reason(b.edit("a.py", tool="Write"))

    with daemon.client() as client:
        paths = {
            lease["resource"]: lease["session_id"]
            for lease in client.lease_list()["leases"]
            if lease["resource"].startswith("path:")
        }
    assert paths == {
        f"path:{worktree / 'a.py'}": row_a["session_id"],
        f"path:{worktree / 'b.py'}": session_of(daemon, b)["session_id"],
    }

    a.hook("SessionEnd", reason="exit")
    assert b.edit("a.py") is None  # released in the SessionEnd's own transaction
    ended = session_of(daemon, a)
    assert ended["exited"] is True
    with daemon.client() as client:
        plan = client.fleet_restore_plan()["sessions"]
    assert ended["session_id"] not in {entry["session_id"] for entry in plan}


def test_a_killed_agent_lets_go_within_two_seconds(agents, daemon: Daemon):
    a, b = agents(), agents()
    a.hook("SessionStart", source="startup")
    b.hook("SessionStart", source="startup")
    assert a.edit("a.py") is None
    assert deny_reason(b.edit("a.py"))
    a.kill9()
    killed_at = time.monotonic()
    wait_for(lambda: b.edit("a.py") is None, timeout=2.0, what="a.py free after kill -9")
    row = wait_for(
        lambda: (r := session_of(daemon, a))["live"] is False and r,
        timeout=max(0.1, 2.0 - (time.monotonic() - killed_at)) + 1.0,
        what="the killed agent's session not live",
    )
    assert row["exited"] is False  # died without ending: what a restore brings back
    with daemon.client() as client:
        plan = client.fleet_restore_plan()["sessions"]
        activity = client.session_activity(session_ids=[row["session_id"]])["sessions"]
    assert row["session_id"] in {entry["session_id"] for entry in plan}
    assert activity[0]["live"] is False


def test_a_daemon_started_after_its_agents_died_shows_none_live_from_its_first_answer(
    agents, daemon: Daemon
):
    """A reboot: the daemon stopped, then its agents gone. A `fleet restore` run as soon
    as the daemon answered found every session still live (the first liveness sweep came
    about a second later), launched nothing and exited 0 (a hostile tester's
    reproducer). The first sweep now runs before the daemon answers anyone."""
    a = agents()
    a.hook("SessionStart", source="startup")
    assert session_of(daemon, a)["live"] is True
    assert daemon.stop() == 0
    a.kill9()
    daemon.start()
    row = session_of(daemon, a)  # the first answer after READY
    assert row["live"] is False and row["exited"] is False
    with daemon.client() as client:
        plan = client.fleet_restore_plan()["sessions"]
    assert row["session_id"] in {entry["session_id"] for entry in plan}


def test_a_directory_claim_from_the_agents_shell_covers_what_is_below(agents, worktree: Path):
    a, b = agents(), agents()
    a.hook("SessionStart", source="startup")
    b.hook("SessionStart", source="startup")
    towerctl_path = agents.commands["PreToolUse"].split(" hook --agent")[0]
    # The agent's shell tool runs towerctl: its nearest non-shell ancestor is agent A.
    claimed = a.run(f"{towerctl_path} --json claim src --ttl 10m")
    assert claimed["rc"] == 0, claimed
    assert json.loads(claimed["stdout"])["leases"][0]["path"] == str(worktree / "src")
    assert deny_reason(b.edit(str(worktree / "src" / "new.py"), tool="Write"))
    assert a.edit("src/new.py", tool="Write") is None  # its own claim
    # B cannot claim the directory's file, nor a directory above the claim.
    refused = b.run(f"{towerctl_path} --json claim src/x.py")
    assert refused["rc"] == 1 and json.loads(refused["stdout"])["error"]["code"] == "lease_held"
    refused = b.run(f"{towerctl_path} --json claim .")
    assert refused["rc"] == 1 and json.loads(refused["stdout"])["error"]["code"] == "lease_held"
    released = a.run(f"{towerctl_path} --json release src")
    # The directory's lease and the file lease A's own Write took below it.
    assert sorted(json.loads(released["stdout"])["released"]) == [
        str(worktree / "src"), str(worktree / "src" / "new.py"),
    ]  # fmt: skip
    assert b.edit("src/new.py", tool="Write") is None


def test_a_person_frees_a_path_an_agent_holds(agents, worktree: Path, daemon: Daemon):
    a, b = agents(), agents()
    a.hook("SessionStart", source="startup")
    b.hook("SessionStart", source="startup")
    assert a.edit("a.py") is None
    assert deny_reason(b.edit("a.py"))
    done = towerctl(daemon, "--json", "release", str(worktree / "a.py"))
    assert done.returncode == 0, done
    assert json.loads(done.stdout) == {"released": [str(worktree / "a.py")], "session_id": None}
    assert b.edit("a.py") is None


def test_warn_allows_and_tells_the_agent(tmp_path: Path, agents, worktree: Path):
    home = tmp_path / "warn-home"
    home.mkdir()
    warned = install(home, "--guard", "warn")
    a, b = agents(), agents(warned)
    a.hook("SessionStart", source="startup")
    b.hook("SessionStart", source="startup")
    assert a.edit("a.py") is None
    output = b.edit("a.py")["hookSpecificOutput"]
    assert "permissionDecision" not in output
    assert "a.py" in output["additionalContext"]


def test_codex_apply_patch_is_guarded_too(agents, worktree: Path):
    codex = codex_commands(agents.home)
    assert " hook --agent codex" in codex["PreToolUse"]
    a, b = agents(), agents(codex)
    a.hook("SessionStart", source="startup")
    b.hook("SessionStart", source="startup")
    assert a.edit("a.py") is None
    patch = "*** Begin Patch\n*** Update File: a.py\n@@\n-a = 1\n+a = 2\n*** End Patch\n"
    done = b.hook("PreToolUse", tool_name="apply_patch", tool_input={"command": patch})
    assert deny_reason(json.loads(done["stdout"]))
    other = "*** Begin Patch\n*** Add File: c.py\n+c = 1\n*** End Patch\n"
    done = b.hook("PreToolUse", tool_name="apply_patch", tool_input={"command": other})
    assert done["stdout"] == ""


@pytest.mark.parametrize("ending", ["", "\x0c", "\r\r", "\u2028"])
def test_a_codex_move_onto_a_held_file_is_denied_whatever_the_line_ending(
    agents, worktree: Path, ending: str
):
    """Codex splits a patch at \\n only and trims Unicode whitespace; a header line ending
    in a form feed, a stray \\r or U+2028 is still followed by its Move line. The first
    reader of this patch (Python's splitlines) lost that line: the move onto b.py, held by
    another session, was allowed."""
    codex = codex_commands(agents.home)
    a, b = agents(), agents(codex)
    a.hook("SessionStart", source="startup")
    b.hook("SessionStart", source="startup")
    assert a.edit("b.py") is None
    patch = (
        f"*** Begin Patch\n*** Update File: a.py{ending}\n*** Move to: b.py\n@@\n-a = 1\n"
        "+a = 2\n*** End Patch\n"
    )
    done = b.hook("PreToolUse", tool_name="apply_patch", tool_input={"command": patch})
    assert done["stdout"] and "b.py" in deny_reason(json.loads(done["stdout"]))


def test_no_daemon_both_allowed_silently(tmp_path: Path, worktree: Path):
    home = tmp_path / "home"
    home.mkdir()
    commands = install(home)
    gone = tmp_path / "nowhere" / "towerd.sock"
    a, b = (FakeAgent(commands, worktree, gone, home) for _ in range(2))
    try:
        for agent in (a, b):
            agent.hook("SessionStart", source="startup")
            started = time.monotonic()
            assert agent.edit("a.py") is None
            assert time.monotonic() - started < 2.0
    finally:
        a.close()
        b.close()


def test_a_fleet_from_hooks_alone(agents, daemon: Daemon):
    """SessionStart twice (and eight at once) from one agent session make one row;
    SessionEnd marks it exited; the restore plan leaves it out."""
    a = agents()
    a.hook("SessionStart", source="startup", model="claude-opus-4")
    a.hook("SessionStart", source="startup")
    # The fake agent runs one command at a time; concurrent SessionStarts come from
    # separate hook processes: run eight at once.
    payload = json.dumps(
        {"session_id": a.agent_session_id, "cwd": str(a.worktree),
         "hook_event_name": "SessionStart"}
    )  # fmt: skip
    env = {"PATH": PLAIN_PATH, "TOWERD_SOCKET": str(daemon.socket_path)}
    procs = [
        subprocess.Popen(["sh", "-c", a.commands["SessionStart"]], stdin=subprocess.PIPE, env=env)
        for _ in range(8)
    ]
    for proc in procs:
        proc.communicate(payload.encode(), timeout=30)
        assert proc.returncode == 0
    with daemon.client() as client:
        rows = [
            row for row in client.fleet_list()["sessions"]
            if row["agent_session_id"] == a.agent_session_id
        ]  # fmt: skip
    assert len(rows) == 1
    assert rows[0]["model"] == "claude-opus-4" and rows[0]["exited"] is False
    a.hook("SessionEnd", reason="exit")
    row = session_of(daemon, a)
    assert row["exited"] is True
    with daemon.client() as client:
        plan = client.fleet_restore_plan()["sessions"]
    assert row["session_id"] not in {entry["session_id"] for entry in plan}


def test_the_newest_session_start_of_a_process_names_its_session(agents, worktree, daemon):
    """After /clear one agent process reports a new agent session id: towerctl claim from
    its shell is the new session's, and the old session's leases do not stand in its way."""
    a = agents()
    a.hook("SessionStart", source="startup")
    assert a.edit("a.py") is None
    first = session_of(daemon, a)
    a.agent_session_id = str(uuid.uuid4())
    a.hook("SessionStart", source="clear")
    second = session_of(daemon, a)
    assert second["session_id"] != first["session_id"]
    assert a.edit("a.py") is None  # one agent: its own lease passes to the new session
    towerctl_path = a.commands["PreToolUse"].split(" hook --agent")[0]
    claimed = json.loads(a.run(f"{towerctl_path} --json claim b.py")["stdout"])
    assert claimed["session_id"] == second["session_id"]


def test_a_hung_daemon_a_stale_socket_and_garbage_all_fail_open(
    agents, tmp_path: Path, daemon: Daemon
):
    """The guard never breaks its agent: a stopped daemon (it accepts, never answers)
    costs at most hook-report's 2 s budget; a stale socket file, input that is not a
    hook, and an unknown tool are allowed at once; every time exit 0, nothing printed."""
    a = agents()
    a.hook("SessionStart", source="startup")
    os.kill(daemon.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        assert a.edit("a.py") is None
        assert time.monotonic() - started < 2.0 + 1.5
    finally:
        os.kill(daemon.pid, signal.SIGCONT)
    stale = tmp_path / "stale" / "towerd.sock"
    stale.parent.mkdir(mode=0o700)
    import socket

    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(stale))  # bound, never listened on, then closed: a stale file
    orphan = FakeAgent(a.commands, a.worktree, stale, agents.home)
    try:
        started = time.monotonic()
        assert orphan.edit("a.py") is None
        assert time.monotonic() - started < 1.5
    finally:
        orphan.close()
    for garbage in ("", "not json", "[1, 2]", '{"hook_event_name": 7}', "\udcff"):
        done = a.run(a.commands["PreToolUse"], garbage)
        assert (done["rc"], done["stdout"], done["stderr"]) == (0, "", ""), garbage
    odd = a.hook("PreToolUse", tool_name="Teleport", tool_input={"file_path": "a.py"})
    assert odd["stdout"] == ""


def test_a_path_outside_any_worktree_is_guarded_the_same(agents, tmp_path: Path):
    outside = tmp_path / "notes.txt"
    outside.write_text("x\n")
    a, b = agents(), agents()
    a.hook("SessionStart", source="startup")
    b.hook("SessionStart", source="startup")
    assert a.edit(str(outside)) is None
    assert deny_reason(b.edit(str(outside), tool="Write"))
    # The same file through a symlink and a detour is the same real path.
    (tmp_path / "link.txt").symlink_to(outside)
    assert deny_reason(b.edit(str(tmp_path / "repo" / ".." / "link.txt")))


def test_an_agent_cannot_free_what_another_holds(agents, worktree: Path, daemon: Daemon):
    """The deny reason names the holder; naming it back from the denied agent's shell, or
    running towerctl under a wrapper process that hides the agent, frees nothing: the
    daemon finds the agent among the caller's ancestors, and it acts for itself only."""
    a, b = agents(), agents()
    a.hook("SessionStart", source="startup")
    b.hook("SessionStart", source="startup")
    assert a.edit("a.py") is None
    holder = session_of(daemon, a)["session_id"]
    towerctl_path = a.commands["PreToolUse"].split(" hook --agent")[0]
    named = b.run(f"{towerctl_path} --json release --session {holder} a.py")
    assert named["rc"] == 1 and json.loads(named["stdout"])["error"]["code"] == "conflict"
    wrapper = f"{sys.executable} -c 'import subprocess, sys; subprocess.run(sys.argv[1:])'"
    hidden = b.run(f"{wrapper} {towerctl_path} --json release a.py")
    assert hidden["rc"] == 0 and json.loads(hidden["stdout"])["released"] == []
    assert deny_reason(b.edit("a.py"))


def test_an_edit_of_a_directory_leases_nothing(agents, worktree: Path):
    """A Write whose file_path is a directory fails in the agent: it must not lock the
    tree below it."""
    a, b = agents(), agents()
    a.hook("SessionStart", source="startup")
    b.hook("SessionStart", source="startup")
    assert a.edit(str(worktree / "src"), tool="Write") is None
    assert b.edit("src/new.py", tool="Write") is None


def test_one_of_two_processes_sharing_a_session_ending_keeps_the_others_leases(agents):
    """Two agent processes report one session (`claude --resume X` in two terminals):
    they are two agents, and one's SessionEnd frees its own leases, not the other's,
    which stays in a third agent's way (the end used to release the whole session's)."""
    p1, p2, third = agents(), agents(), agents()
    p2.agent_session_id = p1.agent_session_id
    for agent in (p1, p2, third):
        agent.hook("SessionStart", source="resume")
    assert p1.edit("a.py") is None
    assert deny_reason(p2.edit("a.py"))
    assert p2.edit("b.py") is None
    p2.hook("SessionEnd", reason="exit")
    assert deny_reason(third.edit("a.py"))  # p1 still edits it
    assert third.edit("b.py") is None  # p2's own lease went with its end
    assert p1.edit("a.py") is None


def test_a_full_quota_stops_neither_the_guard_nor_the_session_end(agents, daemon: Daemon):
    """`--quota` below the events kept per principal: once the principal's events fill
    it, hooks used to fail whole (the guard off: another agent edited a held file).
    Now the event is not filed (`unfiled: true`), the guard and the session are kept;
    past the lease quota an allowed path is left unleased (`unleased`), not refused."""
    assert daemon.stop() == 0
    daemon.start("--quota", "12")
    a, b = agents(), agents()
    a.hook("SessionStart", source="startup")
    b.hook("SessionStart", source="startup")
    assert a.edit("a.py") is None
    for _ in range(12):
        a.hook("Notification", message="waiting")
    with daemon.client() as client:
        with pytest.raises(QuotaExceeded):  # the quota is full for events
            client.event_record("Notification", agent_session_id=a.agent_session_id)
        direct = client.hook_event(
            "PreToolUse", "claude", agent_session_id=b.agent_session_id, cwd=str(b.worktree),
            paths=[str(b.worktree / "a.py")],
        )  # fmt: skip
    assert direct["event_id"] == 0 and direct["unfiled"] is True
    assert direct["decision"] == "deny"
    assert deny_reason(b.edit("a.py"))  # through the installed hook
    granted = []
    for n in range(15):  # lease tokens count toward the quota too
        path = str(b.worktree / f"new{n}.py")
        assert b.edit(path, tool="Write") is None  # allowed, leased or not
        granted.append(path)
    with daemon.client() as client:
        held = {lease["resource"] for lease in client.lease_list()["leases"]}
        last = client.hook_event(
            "PreToolUse", "claude", agent_session_id=b.agent_session_id, cwd=str(b.worktree),
            paths=[granted[-1]],
        )  # fmt: skip
    assert f"path:{granted[-1]}" not in held and last["unleased"] == [granted[-1]]
    a.hook("SessionEnd", reason="exit")
    assert session_of(daemon, a)["exited"] is True  # its end is kept, unfiled
    assert b.edit("a.py") is None  # and released a's lease


def test_a_path_of_up_to_path_max_below_a_leased_directory_is_guarded(agents, worktree: Path):
    """Linux opens paths of up to 4095 bytes; the hook dropped paths over 4000
    characters unguarded, so a Write that deep below a claimed directory was allowed."""
    a, b = agents(), agents()
    a.hook("SessionStart", source="startup")
    b.hook("SessionStart", source="startup")
    towerctl_path = agents.commands["PreToolUse"].split(" hook --agent")[0]
    assert a.run(f"{towerctl_path} --json claim src")["rc"] == 0
    deep = worktree / "src"
    while len(str(deep)) < 4095 - 255:
        deep = deep / ("d" * min(250, 4095 - 255 - len(str(deep))))
    target = str(deep / ("f" * (4095 - len(str(deep)) - 1)))
    assert len(target) == 4095
    assert deny_reason(b.edit(target, tool="Write"))


def test_a_name_that_is_not_utf8_or_half_a_utf16_pair_is_guarded(agents, worktree: Path):
    """A real directory named in Latin-1 inside a claimed one, reached through an ASCII
    symlink, and a patch naming a held file beside a path with a lone surrogate: each
    used to fail the whole hook open (the path could not be sent), every path of the
    call unguarded. `towerctl claim` of such a path exited with a traceback."""
    a, b = agents(), agents(codex_commands(agents.home))
    a.hook("SessionStart", source="startup")
    b.hook("SessionStart", source="startup")
    towerctl_path = agents.commands["PreToolUse"].split(" hook --agent")[0]
    latin1 = os.fsencode(worktree / "src") + b"/caf\xe9"
    os.mkdir(latin1)
    (worktree / "cafe").symlink_to(os.fsdecode(latin1))
    assert a.run(f"{towerctl_path} --json claim src")["rc"] == 0
    assert deny_reason(b.edit(str(worktree / "cafe" / "x.py"), tool="Write"))
    assert a.edit(str(worktree / "cafe" / "x.py"), tool="Write") is None
    # The claim of the Latin-1 directory itself, from B's shell: held by A's src.
    refused = b.run(f"{towerctl_path} --json claim cafe")
    assert refused["rc"] == 1 and json.loads(refused["stdout"])["error"]["code"] == "lease_held"
    assert a.edit("a.py") is None
    patch = (
        "*** Begin Patch\n*** Add File: \ud800.py\n+x = 1\n"
        "*** Update File: a.py\n@@\n-a = 1\n+a = 2\n*** End Patch\n"
    )
    done = b.hook("PreToolUse", tool_name="apply_patch", tool_input={"command": patch})
    assert deny_reason(json.loads(done["stdout"]))


def test_each_of_two_processes_sharing_a_session_acts_for_itself(agents, worktree, daemon):
    """The session's row names the process that hooked it last; the other one is still
    that session's agent: its shell's claim is its own (it was the other process's,
    and went when that one exited), and a plain `towerctl release` from it frees only
    its own leases (it was taken for a person's, and freed a third agent's path)."""
    p1, p2, third = agents(), agents(), agents()
    p2.agent_session_id = p1.agent_session_id  # one session resumed in two terminals
    for agent in (p1, p2, third):
        agent.hook("SessionStart", source="resume")
    towerctl_path = agents.commands["PreToolUse"].split(" hook --agent")[0]
    assert p1.run(f"{towerctl_path} --json claim notes.md --ttl 1h")["rc"] == 0
    with daemon.client() as client:
        (lease,) = [
            lease
            for lease in client.lease_list()["leases"]
            if lease["resource"] == f"path:{worktree / 'notes.md'}"
        ]
    assert lease["holder_pid"] == p1.proc.pid
    assert third.edit("other.py") is None
    assert deny_reason(p1.edit("other.py"))
    p2.hook("UserPromptSubmit", prompt="go on")  # the row names p2 again
    freed = p1.run(f"env -u TOWERD_SESSION_ID {towerctl_path} --json release other.py")
    assert freed["rc"] == 0 and json.loads(freed["stdout"])["released"] == []
    assert deny_reason(p1.edit("other.py"))
    p2.kill9()
    wait_for(lambda: session_of(daemon, p1)["agent_pid"] == p1.proc.pid, what="p1 named")
    assert session_of(daemon, p1)["live"] is True
    assert deny_reason(third.edit("notes.md"))  # p1's claim outlived p2
