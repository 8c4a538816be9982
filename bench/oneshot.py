"""Wall time of one-shot processes: connect, hello, one call, exit; against a stdlib floor.

    .venv/bin/python bench/oneshot.py [--quick] [--runs N]

Starts its own towerd (benchlib.Daemon, temp dir). Each command below is spawned
fresh, ``--warmups`` times unrecorded then ``--runs`` times, the commands
shuffled within each round so drift hits them alike; wall time is from spawn to
exit as seen by this process (stdout and stderr to /dev/null; exit status 0
checked on every run):

* floor: a stdlib-only script run by the venv's python, the interpreter and
  flags a hook would use: connect, send a pre-encoded hello frame, read its
  answer, send a pre-encoded ping frame, read its answer, exit (no msgpack
  library: the frames are bytes literals);
* the same floor script under ``-I -S`` (no site, no venv .pth files);
* ``python -c pass``: the interpreter alone, for reference;
* ``towerctl --socket S ping``;
* ``python -c 'from towerd.client import Client; Client(S).ping()'``;
* the write floor: the floor script sending a pre-encoded ``event.record`` of
  the hook event below instead of the ping (what hook-report asks of the daemon:
  one durable write, group commit and fsync included);
* ``towerctl hook-report`` as an agent hook runs it: TOWERD_SOCKET and
  TOWERD_SESSION_ID (a session registered with the daemon) in the environment,
  a Claude Code PostToolUse event (a Bash call with ~2 KB of output) on stdin;
  it records one event per run;
* the same with no daemon: TOWERD_SOCKET names a socket path nobody listens on
  (hook-report must then be quick and silent);
* ``towerctl hook --agent claude`` (what ``hooks install`` wires) fed a Claude Code
  PreToolUse of an Edit: allowed (the file is free: its path lease is taken, then
  renewed by every run) and denied (another live session, whose agent process is
  another process, holds the file: the deny decision is printed);
* for reference, the same hook-report run as ``python -c 'from
  towerd.client.hook_report import report; report()'``: without towerctl's CLI
  module (argparse and the rest), what a dedicated entry point would cost.

The hook path, for two installs (issue 17): *editable* is this venv (``pip install
-e``: its ``.pth`` import finder runs in every process that starts with ``site``);
*wheel* is a regular install, built here (``pip wheel --no-deps``) into a fresh venv
(``--without-pip``, the wheel installed ``--no-deps --no-index``, the dependencies
found through a ``.pth`` naming this venv's site-packages). For each: its floor (the
floor script run by that venv's python, site and all) and the same under ``-I -S``;
then every command a hook or a wrapper runs per agent event (``hook`` allowed and
denied, ``hook-report``, ``idem claim``, ``idem complete``, ``claim PATH``, ``run --key
K -- true``, ``ping``), each through the launcher ``hooks install`` wires
(``<python> -I -S <towerd>/client/_hook_launch.py``: no site) and through the
``towerctl`` console script (pip's wrapper, with site); and the step floor.

Prints median, p90, p95 and min, the ratio of each median to its install's floor,
the targets (the hook process within 1.25x the floor, on each install, through what
hooks run: the launcher; against the write floor too; the guard's allowed path
within 1.3x hook-report's; ``run --key`` within 1.1x the step floor),
and for towerctl, the python -c client and hook-report the imports that cost
the most (one ``-X importtime`` run).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import shutil
import sqlite3
import subprocess
import sys
import sysconfig
import tempfile
import time
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from benchlib import Daemon, machine, percentile
from towerd.client import Client

PYTHON = sys.executable  # the venv's interpreter: run this as .venv/bin/python bench/oneshot.py
TOWERCTL = str(Path(PYTHON).parent / "towerctl")
TARGET = 1.25  # the one-shot hook process: wall time at most this many times the floor's
GUARD_TARGET = 1.3  # towerctl hook's allowed edit: at most this many times hook-report's
STEP_TARGET = 1.1  # towerctl run --key: at most this many times the same step by hand
ROOT = Path(__file__).resolve().parent.parent  # the checkout: protocol/, client/
LAUNCHER = "_hook_launch.py"  # towerd/client/: what `towerctl hooks install` wires

FLOOR_SCRIPT = """\
import socket
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect({path!r})
def answer():
    data = b""
    while len(data) < 4 or len(data) < 4 + int.from_bytes(data[:4], "big"):
        chunk = s.recv(65536)
        if not chunk:
            raise SystemExit("towerd closed the connection")
        data += chunk
    return data
s.sendall({hello!r})
if b"\\xa6result" not in answer():
    raise SystemExit("hello was refused")
s.sendall({request!r})
if {needle!r} not in answer():
    raise SystemExit("the request was not answered as expected")
"""

AGENT_SESSION = "3f6a1c52-8d0e-4b7a-9c21-5e4f7d2b9a10"
PYTEST_OUTPUT = (
    "".join(
        f"tests/test_parser.py::test_case_{n:02} PASSED{' ' * 20}[{n * 100 // 40:3}%]\n"
        for n in range(1, 41)
    )
    + "\n============================== 40 passed in 0.42s ==============================\n"
)
# What Claude Code hands a PostToolUse hook on stdin after a Bash call (~3 KB).
HOOK_EVENT = {
    "session_id": AGENT_SESSION,
    "transcript_path": f"/home/dev/.claude/projects/-home-dev-src-app/{AGENT_SESSION}.jsonl",
    "cwd": "/home/dev/src/app",
    "permission_mode": "default",
    "hook_event_name": "PostToolUse",
    "tool_name": "Bash",
    "tool_input": {
        "command": "pytest -v tests/test_parser.py",
        "description": "Run the parser tests verbosely",
    },
    "tool_response": {
        "stdout": PYTEST_OUTPUT,
        "stderr": "",
        "interrupted": False,
        "isImage": False,
    },
    "tool_use_id": "toolu_01Fz7cPq2RkLw9nV5tYb3Ah6",
}


EDITOR_SESSION = "9b2e4f10-6c3d-4a8e-b7f1-2d5c8e0a4b63"  # the agent whose edits are guarded
HOLDER_SESSION = "5d1c7a2e-3f4b-4e6a-8c9d-0b1a2f3e4d5c"  # the one holding the denied file


def edit_event(path: str) -> dict[str, object]:
    """What Claude Code hands a PreToolUse hook before an Edit of ``path``."""
    return {
        "session_id": EDITOR_SESSION,
        "transcript_path": f"/home/dev/.claude/projects/-home-dev-src-app/{EDITOR_SESSION}.jsonl",
        "cwd": str(Path(path).parent),
        "permission_mode": "default",
        "hook_event_name": "PreToolUse",
        "tool_name": "Edit",
        "tool_input": {
            "file_path": path,
            "old_string": "def parse(text):\n    return text.split()\n",
            "new_string": "def parse(text: str) -> list[str]:\n    return text.split()\n",
        },
        "tool_use_id": "toolu_01Hq8dRr3SlMx0oW6uZc4Bi7",
    }


# What an idempotent step costs done by hand, the baseline of `towerctl run --key K --
# true`: one process opens the SQLite file itself (WAL, synchronous=FULL: the daemon's
# durability), claims the key in one transaction, runs the effect, completes it in another.
STEP_FLOOR_SCRIPT = """\
import sqlite3, subprocess, sys
db = sqlite3.connect(sys.argv[1], isolation_level=None, timeout=30)
db.execute("PRAGMA synchronous = FULL")
db.execute("BEGIN IMMEDIATE")
db.execute("INSERT INTO keys (key, state) VALUES (?, 'in_progress')", (sys.argv[2],))
db.execute("COMMIT")
subprocess.run(["true"], check=True)
db.execute("BEGIN IMMEDIATE")
db.execute("UPDATE keys SET state = 'completed', result = ? WHERE key = ?", ("0", sys.argv[2]))
db.execute("COMMIT")
"""
# hook-report without the editable install's import finder (its .pth hook costs every
# venv process pathlib, fnmatch and re): no site, towerd found through a directory of
# links laid out as the installed package is (what a regular install gives).
NO_FINDER_CODE = (
    "import sys; sys.path.insert(0, sys.argv.pop(1)); "
    "from towerd.client.hook_report import report; report()"
)


def frame(value: object) -> bytes:
    payload = msgspec.msgpack.encode(value)
    return len(payload).to_bytes(4, "big") + payload


@dataclass
class Command:
    name: str
    argv: list[str]
    stdin: bytes | None = None
    env: dict[str, str] = field(default_factory=dict)  # added to the run's environment
    walls: list[float] = field(default_factory=list)  # ms
    runs: int = 0  # "{n}" in argv is this run's number (warm-ups included): a fresh key

    def run(self, env: dict[str, str]) -> float:
        """One fresh process; wall ms from spawn to exit."""
        env = {**env, **self.env}
        argv = [part.replace("{n}", str(self.runs)) for part in self.argv]
        self.runs += 1
        stdin = subprocess.PIPE if self.stdin is not None else subprocess.DEVNULL
        started = time.perf_counter_ns()
        proc = subprocess.Popen(
            argv, stdin=stdin, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env
        )
        if self.stdin is not None:
            proc.communicate(self.stdin)
        status = proc.wait()
        wall = (time.perf_counter_ns() - started) / 1e6
        if status != 0:
            again = subprocess.run(argv, input=self.stdin, capture_output=True, env=env)
            raise SystemExit(
                f"{self.name}: exit status {status}: {shlex.join(argv)}\n"
                f"{again.stdout.decode()[-2000:]}{again.stderr.decode()[-2000:]}"
            )
        return wall

    @property
    def median(self) -> float:
        return percentile(self.walls, 0.5)


def import_costs(
    argv: list[str], env: dict[str, str], top: int = 8, stdin: bytes | None = None
) -> list[str]:
    """The ``top`` imports by cumulative time, from one ``-X importtime`` run."""
    done = subprocess.run(
        [PYTHON, "-X", "importtime", *argv], input=stdin, capture_output=True, env=env
    )
    rows = []
    for line in done.stderr.decode().splitlines():
        if not line.startswith("import time:") or "cumulative" in line:
            continue
        self_us, cumulative_us, name = line[len("import time:") :].split("|", 2)
        depth = (len(name) - len(name.lstrip(" ")) - 1) // 2
        rows.append((int(cumulative_us), int(self_us), depth, name.strip()))
    total = sum(cumulative for cumulative, _, depth, _ in rows if depth == 0)
    lines = [
        f"  all imports {total / 1000:.1f} ms in {len(rows)} modules; top {top} by cumulative:"
    ]
    lines.append(f"  {'cumulative ms':>13} {'self ms':>8} {'depth':>5}  module")
    for cumulative, self_us, depth, name in sorted(rows, reverse=True)[:top]:
        lines.append(f"  {cumulative / 1000:13.1f} {self_us / 1000:8.1f} {depth:5}  {name}")
    by_self = sorted(rows, key=lambda row: row[1], reverse=True)[:top]
    lines.append(
        "  largest self times: "
        + ", ".join(f"{name} {self_us / 1000:.1f}" for _, self_us, _, name in by_self)
    )
    return lines


def wheel_install(workdir: Path) -> Path:
    """A regular install of this checkout in a fresh venv (its root): the wheel built
    from the tracked files, installed without dependencies or an index; a .pth names
    this venv's site-packages for the dependencies (a plain path line: its own .pth
    files, the editable finder among them, are not run)."""
    source = workdir / "source"
    listed = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-co", "--exclude-standard", "-z"],
        capture_output=True, check=True,
    ).stdout.decode().split("\0")  # fmt: skip
    for name in filter(None, listed):
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    dist = workdir / "dist"
    subprocess.run(
        [PYTHON, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation", "-q",
         "-w", str(dist)],
        check=True, capture_output=True,
    )  # fmt: skip
    (wheel,) = dist.glob("towerd-*.whl")
    venv = workdir / "wheel-venv"
    subprocess.run([PYTHON, "-m", "venv", "--without-pip", str(venv)], check=True)
    subprocess.run(
        [PYTHON, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "--no-deps",
         "--no-index", "-q", str(wheel)],
        check=True, capture_output=True,
    )  # fmt: skip
    (venv / "lib" / VERSION_DIR / "site-packages" / "towerd-deps.pth").write_text(
        sysconfig.get_paths()["purelib"] + "\n"
    )
    return venv


VERSION_DIR = f"python{sys.version_info.major}.{sys.version_info.minor}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a ~20 s smoke run")
    parser.add_argument("--runs", type=int, help="measured runs per command (default 100)")
    parser.add_argument("--warmups", type=int, help="unrecorded runs per command (default 5)")
    args = parser.parse_args()
    runs = args.runs or (20 if args.quick else 100)
    warmups = args.warmups if args.warmups is not None else (2 if args.quick else 5)

    print(machine())
    print(
        f"interpreter: {PYTHON}; each run a fresh process spawned by this one (subprocess), "
        "wall from spawn to exit; the machine is shared with the daemon (2 processes, "
        f"{os.cpu_count()} cores)"
    )
    workdir = Path(tempfile.mkdtemp(prefix="bench-oneshot-", dir="/tmp"))
    daemon = Daemon(workdir)
    ok = False
    try:
        if not daemon.start():
            raise SystemExit(f"towerd did not start; see {workdir / 'daemon.log'}")
        sock = str(daemon.socket_path)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TOWERD_", "PYTHON"))}
        with Client(sock) as client:
            session = client.session_register(
                cwd=HOOK_EVENT["cwd"], agent="claude", agent_session_id=AGENT_SESSION
            )["session_id"]
        hello = frame({"id": 1, "method": "hello", "params": {"protocol": 1, "client": "floor"}})
        ping = frame({"id": 2, "method": "ping", "params": {}})
        record = frame(
            {
                "id": 2,
                "method": "event.record",
                "params": {
                    "kind": "PostToolUse",
                    "session_id": session,
                    "agent_session_id": AGENT_SESSION,
                    "payload": HOOK_EVENT,
                },
            }
        )
        floor_script = workdir / "floor.py"
        floor_script.write_text(
            FLOOR_SCRIPT.format(path=sock, hello=hello, request=ping, needle=b"\xa4pong")
        )
        write_floor_script = workdir / "write_floor.py"
        write_floor_script.write_text(
            FLOOR_SCRIPT.format(path=sock, hello=hello, request=record, needle=b"\xa8event_id")
        )
        # The guard: a file nobody holds, and one another session's agent (a child of
        # this process, so that it may be named) holds.
        free_file, held_file = workdir / "free.py", workdir / "held.py"
        holder_agent = subprocess.Popen(["sleep", "3600"], stdout=subprocess.DEVNULL)
        with Client(sock) as client:
            client.hook_event(
                "SessionStart", "claude", agent_session_id=HOLDER_SESSION,
                agent_pid=holder_agent.pid, cwd=str(workdir),
            )  # fmt: skip
            holder = client.fleet_list()["sessions"][-1]["session_id"]
            client.path_claim([str(held_file)], session_id=holder)
        guard_env = {"TOWERD_SOCKET": sock}
        allowed_stdin = json.dumps(edit_event(str(free_file))).encode()
        denied_stdin = json.dumps(edit_event(str(held_file))).encode()
        guard_argv = [TOWERCTL, "hook", "--agent", "claude"]
        denied_output = subprocess.run(
            guard_argv, input=denied_stdin, capture_output=True, env={**os.environ, **guard_env}
        ).stdout
        if b'"permissionDecision": "deny"' not in denied_output:
            raise SystemExit(f"towerctl hook did not deny the held file: {denied_output!r}")
        client_code = f"from towerd.client import Client; Client({sock!r}).ping()"
        hook_stdin = json.dumps(HOOK_EVENT).encode()
        hook_env = {"TOWERD_SOCKET": sock, "TOWERD_SESSION_ID": session}

        floor = Command("floor: stdlib script", [PYTHON, str(floor_script)])
        bare_floor = Command("floor, python -I -S", [PYTHON, "-I", "-S", str(floor_script)])
        write_floor = Command("write floor: event.record", [PYTHON, str(write_floor_script)])
        no_daemon = Command(
            "hook-report, no daemon",
            [TOWERCTL, "hook-report"],
            hook_stdin,
            {"TOWERD_SOCKET": str(workdir / "nobody.sock"), "TOWERD_SESSION_ID": session},
        )
        # What hook-report costs without towerctl's CLI module (argparse and the rest):
        # for reference, the figure a dedicated entry point would get.
        lean = Command(
            "hook-report, no CLI module",
            [PYTHON, "-c", "from towerd.client.hook_report import report; report()"],
            hook_stdin,
            hook_env,
        )
        step_db = workdir / "step.db"
        with closing(sqlite3.connect(step_db)) as db:
            db.execute("PRAGMA journal_mode = WAL")
            db.execute("CREATE TABLE keys (key TEXT PRIMARY KEY, state TEXT, result TEXT)")
        step_script = workdir / "step_floor.py"
        step_script.write_text(STEP_FLOOR_SCRIPT)
        step_floor = Command(
            "step floor: sqlite3 by hand", [PYTHON, str(step_script), str(step_db), "s-{n}"]
        )
        lean_root = workdir / "lean"
        (lean_root / "towerd").mkdir(parents=True)
        for package in ("protocol", "client"):
            (lean_root / "towerd" / package).symlink_to(ROOT / package)
        no_finder = Command(
            "hook-report, no import finder",
            [PYTHON, "-S", "-c", NO_FINDER_CODE, str(lean_root)],
            hook_stdin,
            hook_env,
        )

        def hook_path(install: str, python: str, script: str, launcher: str) -> dict:
            """Every command a hook or a wrapper runs per agent event, through the
            launcher (what `hooks install` wires) and through the console script."""
            rows: dict[str, dict[str, Command]] = {}
            forms = (("towerctl", [script]), ("launcher", [python, "-I", "-S", launcher]))
            for form, prefix in forms:
                name, tag = f"{install}: {form}", f"{install[0]}{form[0]}"
                with Client(sock) as client:
                    for n in range(warmups + runs):  # what each `idem complete` run completes
                        client.idem_claim("bench", f"pre-{tag}-{n}")
                ctl = [*prefix, "--socket", sock]
                hook = [*prefix, "hook", "--agent", "claude"]
                rows[form] = {
                    "hook allowed": Command(
                        f"{name} hook, Edit allowed", hook, allowed_stdin, guard_env
                    ),
                    "hook denied": Command(
                        f"{name} hook, Edit denied", hook, denied_stdin, guard_env
                    ),
                    "hook-report": Command(
                        f"{name} hook-report", [*prefix, "hook-report"], hook_stdin, hook_env
                    ),
                    "idem claim": Command(
                        f"{name} idem claim", [*ctl, "idem", "claim", "bench", f"c-{tag}-{{n}}"]
                    ),
                    "idem complete": Command(
                        f"{name} idem complete",
                        [*ctl, "idem", "complete", "bench", f"pre-{tag}-{{n}}"],
                    ),
                    # From an agent's shell (this process is EDITOR_SESSION's agent by now).
                    "claim PATH": Command(
                        f"{name} claim PATH", [*ctl, "claim", str(workdir / "c.py")]
                    ),
                    "run --key": Command(
                        f"{name} run --key K -- true",
                        [*ctl, "run", "--key", f"s-{tag}-{{n}}", "--", "true"],
                    ),
                    "ping": Command(f"{name} ping", [*ctl, "ping"]),
                }
            return rows

        editable = hook_path("editable", PYTHON, TOWERCTL, str(ROOT / "client" / LAUNCHER))
        wheel_venv = wheel_install(workdir / "wheel")
        wheel_python = str(wheel_venv / "bin" / "python")
        wheel_launcher = wheel_venv / "lib" / VERSION_DIR / "site-packages" / "towerd" / "client"
        wheel = hook_path(
            "wheel", wheel_python, str(wheel_venv / "bin" / "towerctl"),
            str(wheel_launcher / LAUNCHER),
        )  # fmt: skip
        wheel_floor = Command("wheel: floor: stdlib script", [wheel_python, str(floor_script)])
        wheel_bare_floor = Command(
            "wheel: floor, python -I -S", [wheel_python, "-I", "-S", str(floor_script)]
        )
        wheel_step_floor = Command(
            "wheel: step floor: sqlite3 by hand",
            [wheel_python, str(step_script), str(step_db), "w-{n}"],
        )
        floors = {"editable": (floor, bare_floor), "wheel": (wheel_floor, wheel_bare_floor)}
        commands = [
            floor,
            bare_floor,
            Command("python -c pass", [PYTHON, "-c", "pass"]),
            Command("python -c Client().ping()", [PYTHON, "-c", client_code]),
            write_floor,
            no_daemon,
            lean,
            no_finder,
            step_floor,
            *editable["towerctl"].values(),
            *editable["launcher"].values(),
            wheel_floor,
            wheel_bare_floor,
            wheel_step_floor,
            *wheel["towerctl"].values(),
            *wheel["launcher"].values(),
        ]
        for command in commands:
            for _ in range(warmups):
                command.run(env)
        order = list(commands)
        shuffle = random.Random(0).shuffle
        for _ in range(runs):
            shuffle(order)
            for command in order:
                command.walls.append(command.run(env))
        with Client(sock) as client:
            recorded = client.session_activity([session])["sessions"][0]
        if recorded["last_kind"] != "PostToolUse":
            raise SystemExit(f"hook-report recorded nothing: {recorded}")

        def install_of(command: Command) -> str:
            return "wheel" if command.name.startswith("wheel:") else "editable"

        print()
        print(f"one-shot processes: {runs} runs each after {warmups} warm-ups, shuffled rounds")
        print(
            "x floor: the median over its install's floor (the stdlib script run by that "
            "venv's python); x -I -S: over the same floor under -I -S"
        )
        print(
            f"{'command':46} {'median ms':>9} {'p90 ms':>8} {'p95 ms':>8} {'min ms':>8} "
            f"{'x floor':>8} {'x -I -S':>8}"
        )
        for command in commands:
            base, bare = floors[install_of(command)]
            print(
                f"{command.name:46} {command.median:9.1f} {percentile(command.walls, 0.9):8.1f} "
                f"{percentile(command.walls, 0.95):8.1f} {min(command.walls):8.1f} "
                f"{command.median / base.median:8.2f} {command.median / bare.median:8.2f}"
            )
        hook = editable["launcher"]["hook-report"]
        print(
            f"hook-report payload: {len(hook_stdin)} bytes of JSON on stdin; "
            f"hook-report (editable, launcher) vs write floor: "
            f"{hook.median / write_floor.median:.2f}x"
        )

        print()
        print("where the time goes (one -X importtime run each; ms, noisy):")
        print("floor (stdlib script; what site and the venv's .pth files cost every hook):")
        print("\n".join(import_costs([str(floor_script)], env, top=4)))
        print("towerctl ping (editable, console script):")
        print("\n".join(import_costs([TOWERCTL, "--socket", sock, "ping"], env)))
        print("python -c Client().ping():")
        print("\n".join(import_costs(["-c", client_code], env)))
        launcher_argv = ["-I", "-S", str(ROOT / "client" / LAUNCHER)]
        print("idem claim (editable, launcher):")
        print(
            "\n".join(
                import_costs(
                    [*launcher_argv, "--socket", sock, "idem", "claim", "bench", "imp"], env
                )  # fmt: skip
            )
        )
        print("run --key K -- true (editable, launcher):")
        print(
            "\n".join(
                import_costs(
                    [*launcher_argv, "--socket", sock, "run", "--key", "imp", "--", "true"], env
                )
            )
        )
        print("towerctl hook, Edit allowed (editable, launcher):")
        print(
            "\n".join(
                import_costs([*launcher_argv, "hook"], {**env, **guard_env}, stdin=allowed_stdin)
            )
        )

        print()
        labels = {
            "launcher": "the hook path: what hooks install wires",
            "towerctl": "the console script, for reference",
        }
        for install, rows in (("editable", editable), ("wheel", wheel)):
            base, _bare = floors[install]
            for form in ("launcher", "towerctl"):
                for what, command in rows[form].items():
                    if what == "run --key":
                        continue  # against the step floor, below
                    ratio = command.median / base.median
                    print(
                        f"target: one-shot {command.name} ({labels[form]}) median <= {TARGET}x "
                        f"its install's stdlib floor: measured {ratio:.2f}x "
                        f"({command.median:.1f} / {base.median:.1f} ms) -> "
                        f"{'met' if ratio <= TARGET else 'NOT met'}"
                    )
        for command in (no_daemon, lean, no_finder):
            ratio = command.median / floor.median
            print(
                f"target: one-shot {command.name} (same bar, for reference) median <= {TARGET}x "
                f"the stdlib floor: measured {ratio:.2f}x ({command.median:.1f} / "
                f"{floor.median:.1f} ms) -> {'met' if ratio <= TARGET else 'NOT met'}"
            )
        ratio = hook.median / write_floor.median
        print(
            f"target: hook-report (editable, launcher) median <= {TARGET}x the write floor (the "
            f"same event.record from a stdlib script): measured {ratio:.2f}x ({hook.median:.1f} "
            f"/ {write_floor.median:.1f} ms) -> {'met' if ratio <= TARGET else 'NOT met'}"
        )
        for install, rows in (("editable", editable), ("wheel", wheel)):
            allowed, report = rows["launcher"]["hook allowed"], rows["launcher"]["hook-report"]
            ratio = allowed.median / report.median
            print(
                f"target: {install}: launcher hook, Edit allowed, median <= {GUARD_TARGET}x "
                f"hook-report's: measured {ratio:.2f}x ({allowed.median:.1f} / "
                f"{report.median:.1f} ms) -> {'met' if ratio <= GUARD_TARGET else 'NOT met'}"
            )
        steps = (("editable", editable, step_floor), ("wheel", wheel, wheel_step_floor))
        for install, rows, base in steps:
            for form in ("launcher", "towerctl"):
                run_step = rows[form]["run --key"]
                ratio = run_step.median / base.median
                print(
                    f"target: {install}: an idempotent step (claim, `true`, complete) through "
                    f"{form} run ({labels[form]}) median <= {STEP_TARGET}x the same by hand "
                    f"against a SQLite file: measured {ratio:.2f}x ({run_step.median:.1f} / "
                    f"{base.median:.1f} ms) -> {'met' if ratio <= STEP_TARGET else 'NOT met'}"
                )
        script_report = editable["towerctl"]["hook-report"]
        print(
            f"the editable install's import finder costs hook-report "
            f"{script_report.median - no_finder.median:.1f} ms ({script_report.median:.1f} vs "
            f"{no_finder.median:.1f} ms without it); the launcher pays neither it nor site "
            f"({hook.median:.1f} ms)"
        )
        holder_agent.kill()
        ok = True
    finally:
        if daemon.proc is not None and daemon.proc.poll() is None:
            daemon.stop()
        if ok:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"kept {workdir} (daemon.log) for a look", file=sys.stderr)


if __name__ == "__main__":
    main()
