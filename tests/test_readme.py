"""The README works as pasted: the Quick start's two lines, its Python examples (in
order, as one script, against a real daemon), and the hook configuration.

The install line runs for real under ``bash -c``, with a ``python3`` stand-in first
on PATH whose venv holds a stub ``pip`` (slow, records that it finished) and a stub
``towerd`` (records that it started, then runs until the test ends): a pasted line
must come back only once the install is done, leaving the daemon in the background.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from towerd_testing import wait_for

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
CI_RUN = ROOT / ".ci" / "run"

# Python examples of sections another change still has to make runnable as pasted:
# each heading here must still have a Python block, so the list cannot go stale.
# What the README's stand-in effect, start_agent_in_tmux, prints each time it runs.
STAND_IN_SAYS = "starting the agent of session "

PYTHON3_STAND_IN = textwrap.dedent(
    """\
    #!/bin/sh
    # Stands in for python3: `python3 -m venv .venv` makes a venv of stubs.
    [ "$*" = "-m venv .venv" ] || { echo "unexpected: python3 $*" >&2; exit 64; }
    mkdir -p .venv/bin
    cat > .venv/bin/pip <<'PIP'
    #!/bin/sh
    sleep 0.3  # an install takes a while
    echo "pip-finished $*" >> "$EVENTS"
    PIP
    cat > .venv/bin/towerd <<'TOWERD'
    #!/bin/sh
    echo "towerd logs this"; echo "towerd logs this too" >&2
    echo $$ > towerd.pid
    echo towerd-started >> "$EVENTS"
    exec tail --pid="$TEST_PID" -f /dev/null  # runs, like a daemon, until the test ends
    TOWERD
    chmod +x .venv/bin/pip .venv/bin/towerd
    """
)


def fenced_blocks() -> list[tuple[str, str, str]]:
    """Every fenced block of the README as (the heading above it, language, body)."""
    blocks, heading, language, body = [], "", None, []
    for line in README.read_text().splitlines():
        if language is None and line.startswith("#"):
            heading = line.strip()
        elif language is None and line.startswith("```"):
            language, body = line[3:].strip(), []
        elif language is not None and line.startswith("```"):
            blocks.append((heading, language, "\n".join(body) + "\n"))
            language = None
        elif language is not None:
            body.append(line)
    return blocks


def quick_start_lines() -> tuple[str, str]:
    block = next(body for heading, _, body in fenced_blocks() if heading == "## Quick start")
    install, tests = [line for line in block.splitlines() if line.strip()]
    return install, tests


def test_quick_start_tests_line_is_what_ci_runs():
    """The README's test command is, word for word, the command .ci/run ends with."""
    _, tests_line = quick_start_lines()
    script = CI_RUN.read_text().replace("\\\n", " ")  # join continued lines
    ci_commands = [shlex.split(line, comments=True) for line in script.splitlines()]
    assert shlex.split(tests_line, comments=True) == [c for c in ci_commands if c][-1]


def test_quick_start_install_line_waits_for_the_install_then_backgrounds_the_daemon(tmp_path):
    """Pasted into a fresh shell, the install line returns only after pip finished,
    with towerd started and still running in the background, its output not on the
    terminal."""
    install_line, _ = quick_start_lines()
    stand_ins, clone, events = tmp_path / "bin", tmp_path / "clone", tmp_path / "events"
    stand_ins.mkdir()
    clone.mkdir()
    (stand_ins / "python3").write_text(PYTHON3_STAND_IN)
    (stand_ins / "python3").chmod(0o755)
    env = os.environ | {
        "PATH": f"{stand_ins}:{os.environ['PATH']}",
        "EVENTS": str(events),
        "TEST_PID": str(os.getpid()),
    }
    terminal = tmp_path / "terminal"
    try:
        with terminal.open("wb") as out:
            shell = subprocess.run(
                ["bash", "-c", install_line],
                check=False,
                cwd=clone,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                timeout=30,
            )
        seen_when_it_returned = events.read_text().splitlines() if events.exists() else []
        assert shell.returncode == 0, terminal.read_text()
        assert "pip-finished install -e .[fast,test,postgresql]" in seen_when_it_returned, (
            f"the line returned before the install finished: {seen_when_it_returned}"
        )
        towerd = int(wait_for(lambda: _pid(clone), what="towerd started"))
        os.kill(towerd, 0)  # still running
        assert events.read_text().splitlines()[-1] == "towerd-started"
        assert "towerd logs" not in terminal.read_text()
    finally:
        _stop_stub_daemon(clone)


def _pid(clone: Path) -> str:
    pid_file = clone / "towerd.pid"
    return pid_file.read_text().strip() if pid_file.exists() else ""


def _stop_stub_daemon(clone: Path) -> None:
    """The stub towerd (a tail bound to this test's lifetime) is ours to end, if it ran."""
    if pid := _pid(clone):
        try:
            os.kill(int(pid), signal.SIGTERM)
        except ProcessLookupError:
            pass


def test_python_examples_run_in_order_and_spawn_once(daemon, tmp_path):
    """The README's Python examples, one script in README order against a real daemon:
    they run, and the stand-in effect runs exactly once across all of them (the retry
    and run_once replay it), leaving one fleet row, the effect's session."""
    blocks = fenced_blocks()
    python = [body for _heading, lang, body in blocks if lang == "python"]
    assert len(python) >= 4
    script = tmp_path / "readme_examples.py"
    script.write_text("\n\n".join(python))
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOWERD_")}
    env["TOWERD_SOCKET"] = str(daemon.socket_path)
    work, remote = _repository_with_a_remote(tmp_path, env)
    ran = subprocess.run(
        [sys.executable, str(script)],
        check=False,
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ran.returncode == 0, ran.stdout + ran.stderr
    effects = [line for line in ran.stdout.splitlines() if line.startswith(STAND_IN_SAYS)]
    assert len(effects) == 1, ran.stdout
    with daemon.client() as client:
        fleet = [row["session_id"] for row in client.iter_fleet()]
    assert fleet == [effects[0].removeprefix(STAND_IN_SAYS)]
    # The effect example pushed for real, once, and the ledger holds its receipt.
    head = _git(work, env, "rev-parse", "HEAD")
    assert _git(remote, env, "rev-parse", "refs/heads/main") == head
    assert "running M001/S01/T03" in ran.stdout


def _git(where: Path, env: dict[str, str], *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(where), *args], env=env, capture_output=True, text=True, check=True
    ).stdout.strip()


def _repository_with_a_remote(root: Path, env: dict[str, str]) -> tuple[Path, Path]:
    """A work tree with one commit whose origin is a bare repository: the README's
    effect example pushes there."""
    env.update(GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@example.invalid",
               GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@example.invalid")  # fmt: skip
    work, remote = root / "work", root / "remote.git"
    subprocess.run(["git", "init", "-q", "--bare", str(remote)], env=env, check=True)
    subprocess.run(["git", "init", "-q", "-b", "main", str(work)], env=env, check=True)
    (work / "README").write_text("a run's work\n")
    _git(work, env, "add", "README")
    _git(work, env, "commit", "-q", "-m", "work")
    _git(work, env, "remote", "add", "origin", str(remote))
    return work, remote


def test_the_agent_section_starts_with_hooks_install_and_its_commands_work(tmp_path: Path):
    """ "Use with Claude Code and Codex" opens with ``towerctl hooks install``; pasted into a
    fresh shell (a fresh $HOME, no daemon), its commands succeed and wire towerd's hook by
    an absolute path: hooks run with the agent's PATH, where a venv's towerctl is not."""
    (heading, lang, snippet), *_ = [
        block for block in fenced_blocks() if block[0] == "## Use with Claude Code and Codex"
    ]
    commands = [line.split("#")[0].strip() for line in snippet.splitlines() if line.strip()]
    assert lang == "sh" and shlex.split(commands[0])[1:3] == ["hooks", "install"], commands
    home = tmp_path / "home"
    home.mkdir()
    env = {"HOME": str(home), "PATH": "/usr/bin:/bin", "TOWERD_SOCKET": str(tmp_path / "no.sock")}
    for command in commands:
        done = subprocess.run(command, shell=True, cwd=ROOT, env=env, capture_output=True)
        assert done.returncode == 0, (command, done)
    settings = json.loads((home / ".claude" / "settings.json").read_text())
    wired = [
        hook["command"]
        for entries in settings["hooks"].values()
        for entry in entries
        for hook in entry["hooks"]
    ]
    assert len(wired) >= 9
    for command in wired:
        # the venv's Python running towerd's launcher without site (README: "through this
        # installation's launcher")
        program, *flags, launcher, hook = shlex.split(command)[:5]
        assert os.path.isabs(program) and os.path.basename(program).startswith("python"), command
        assert flags == ["-I", "-S"], command
        assert os.path.isabs(launcher) and launcher.endswith("/client/_hook_launch.py"), command
        assert hook == "hook", command


FIGURE = re.compile(r"(\d[\d,]*(?:\.\d+)?)(?:x| ms| MiB| s\b| ops/s| req/s)")


def test_performance_figures_are_quoted_from_the_benchmark_results():
    """Every ratio, latency, size and duration in the README's Performance section
    appears verbatim in bench/results/*.txt (the raw output of the last runs): a
    figure is re-measured, never hand-edited and left to go stale."""
    readme = README.read_text()
    section = readme[readme.index("## Performance") : readme.index("## Why these dependencies")]
    results = " ".join(path.read_text() for path in (ROOT / "bench" / "results").glob("*.txt"))
    figures = FIGURE.findall(section)
    assert len(figures) > 20, figures
    missing = [
        figure
        for figure in figures
        if not re.search(rf"(?<![\d.]){re.escape(figure.replace(',', ''))}(?![\d])", results)
    ]
    assert not missing, f"README figures not in bench/results: {missing}"


def test_the_configuration_table_lists_every_daemon_option_with_its_default():
    """Each option is declared once (daemon/config.py); the README's table names every
    one of them, nothing else, and a numeric default as the option's own."""
    from towerd.daemon.config import options

    readme = README.read_text()
    table = readme[readme.index("## Configuration") :].split("\n\n")[1]
    rows = [line for line in table.splitlines() if line.startswith("| `--")]
    documented: dict[str, str] = {}
    for row in rows:
        first, _env, default = (cell.strip() for cell in row.strip("|").split("|")[:3])
        for flag in re.findall(r"--[a-z][a-z-]*", first):
            documented[flag] = default
    declared = {spec.metadata["flag"]: spec.default for _name, spec in options()}
    assert documented.keys() == declared.keys()
    for flag, default in declared.items():
        if isinstance(default, int | float) and not isinstance(default, bool):
            shown = f"{default:g}" if isinstance(default, float) else str(default)
            assert documented[flag].startswith(shown), (flag, shown, documented[flag])
