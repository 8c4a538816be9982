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
* ``towerctl hook-report`` (the hook reporter), if ``towerctl hook-report
  --help`` works: a Claude Code-style SessionStart event on stdin (extra
  arguments with ``--hook-report-args``).

Prints median, p90 and min, the ratio of each median to the floor's, the
target (the hook process within 1.25x the floor), and for towerctl and the
python -c client the imports that cost the most (one ``-X importtime`` run).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from benchlib import Daemon, machine, percentile

PYTHON = sys.executable  # the venv's interpreter: run this as .venv/bin/python bench/oneshot.py
TOWERCTL = str(Path(PYTHON).parent / "towerctl")
TARGET = 1.25  # the one-shot hook process: wall time at most this many times the floor's

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
s.sendall({ping!r})
if b"\\xa4pong" not in answer():
    raise SystemExit("ping was not answered with pong")
"""

# What Claude Code hands a hook on stdin (SessionStart); for hook-report, if present.
HOOK_EVENT = {
    "session_id": "00000000-0000-4000-8000-00000000beef",
    "transcript_path": "/tmp/transcript.jsonl",
    "cwd": "/home/dev/src/app",
    "hook_event_name": "SessionStart",
    "source": "startup",
}


def frame(value: object) -> bytes:
    payload = msgspec.msgpack.encode(value)
    return len(payload).to_bytes(4, "big") + payload


@dataclass
class Command:
    name: str
    argv: list[str]
    stdin: bytes | None = None
    walls: list[float] = field(default_factory=list)  # ms

    def run(self, env: dict[str, str]) -> float:
        """One fresh process; wall ms from spawn to exit."""
        stdin = subprocess.PIPE if self.stdin is not None else subprocess.DEVNULL
        started = time.perf_counter_ns()
        proc = subprocess.Popen(
            self.argv, stdin=stdin, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env
        )
        if self.stdin is not None:
            proc.communicate(self.stdin)
        status = proc.wait()
        wall = (time.perf_counter_ns() - started) / 1e6
        if status != 0:
            again = subprocess.run(self.argv, input=self.stdin, capture_output=True, env=env)
            raise SystemExit(
                f"{self.name}: exit status {status}: {shlex.join(self.argv)}\n"
                f"{again.stdout.decode()[-2000:]}{again.stderr.decode()[-2000:]}"
            )
        return wall

    @property
    def median(self) -> float:
        return percentile(self.walls, 0.5)


def import_costs(argv: list[str], env: dict[str, str], top: int = 8) -> list[str]:
    """The ``top`` imports by cumulative time, from one ``-X importtime`` run."""
    done = subprocess.run(
        [PYTHON, "-X", "importtime", *argv], capture_output=True, text=True, env=env
    )
    rows = []
    for line in done.stderr.splitlines():
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a ~20 s smoke run")
    parser.add_argument("--runs", type=int, help="measured runs per command (default 100)")
    parser.add_argument("--warmups", type=int, help="unrecorded runs per command (default 5)")
    parser.add_argument(
        "--hook-report-args", default="", help="extra arguments for towerctl hook-report"
    )
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
        hello = frame({"id": 1, "method": "hello", "params": {"protocol": 1, "client": "floor"}})
        ping = frame({"id": 2, "method": "ping", "params": {}})
        floor_script = workdir / "floor.py"
        floor_script.write_text(FLOOR_SCRIPT.format(path=sock, hello=hello, ping=ping))
        client_code = f"from towerd.client import Client; Client({sock!r}).ping()"

        floor = Command("floor: stdlib script", [PYTHON, str(floor_script)])
        commands = [
            floor,
            Command("floor, python -I -S", [PYTHON, "-I", "-S", str(floor_script)]),
            Command("python -c pass", [PYTHON, "-c", "pass"]),
            Command("towerctl ping", [TOWERCTL, "--socket", sock, "ping"]),
            Command("python -c Client().ping()", [PYTHON, "-c", client_code]),
        ]
        help_run = subprocess.run([TOWERCTL, "hook-report", "--help"], capture_output=True, env=env)
        hook: Command | None = None
        if help_run.returncode == 0:
            hook = Command(
                "towerctl hook-report",
                [TOWERCTL, "--socket", sock, "hook-report", *shlex.split(args.hook_report_args)],
                stdin=json.dumps(HOOK_EVENT).encode(),
            )
            commands.append(hook)
        for command in commands:
            for _ in range(warmups):
                command.run(env)
        order = list(commands)
        shuffle = random.Random(0).shuffle
        for _ in range(runs):
            shuffle(order)
            for command in order:
                command.walls.append(command.run(env))

        print()
        print(f"one-shot processes: {runs} runs each after {warmups} warm-ups, shuffled rounds")
        print(f"{'command':28} {'median ms':>9} {'p90 ms':>8} {'min ms':>8} {'x floor':>8}")
        for command in commands:
            print(
                f"{command.name:28} {command.median:9.1f} {percentile(command.walls, 0.9):8.1f} "
                f"{min(command.walls):8.1f} {command.median / floor.median:8.2f}"
            )
        if hook is None:
            print("hook-report: not implemented yet (`towerctl hook-report --help` failed)")

        print()
        print("where the time goes (one -X importtime run each; ms, noisy):")
        print("floor (stdlib script; what site and the venv's .pth files cost every hook):")
        print("\n".join(import_costs([str(floor_script)], env, top=4)))
        print("towerctl ping:")
        print("\n".join(import_costs([TOWERCTL, "--socket", sock, "ping"], env)))
        print("python -c Client().ping():")
        print("\n".join(import_costs(["-c", client_code], env)))

        print()
        for command in commands[3:]:
            ratio = command.median / floor.median
            bar = "the hook process" if command is hook else "same bar, for reference"
            print(
                f"target: one-shot {command.name} ({bar}) median <= {TARGET}x the stdlib floor: "
                f"measured {ratio:.2f}x ({command.median:.1f} / {floor.median:.1f} ms) -> "
                f"{'met' if ratio <= TARGET else 'NOT met'}"
            )
        if hook is None:
            print(
                f"target: one-shot hook process (towerctl hook-report) <= {TARGET}x the stdlib "
                "floor: not measured, hook-report: not implemented yet -> NOT met"
            )
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
