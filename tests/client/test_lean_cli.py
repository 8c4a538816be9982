"""towerd.client.cli.lean parses the hook-path command lines without argparse: whatever
it accepts, argparse parses to the same namespace (hypothesis, over command lines built
from the commands' own options and awkward values); the plain forms hooks use are
accepted (or the fast path would silently be lost); and run end to end they print and
exit as the argparse path does."""

from __future__ import annotations

import subprocess

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from towerd.client.cli.app import build_parser, command_path
from towerd.client.cli.lean import GLOBALS, LEAN_COMMANDS, _command, _specs, parse
from towerd.client.cli.registry import BadCommandLine
from towerd_testing import TOWERCTL

FUNCTIONS = ("run", "render", "parser")


def argparse_namespace(argv: list[str]) -> dict[str, object] | None:
    """What the argparse path makes of ``argv`` (None: it refuses the line)."""
    from towerd.client.cli.app import _require_text

    try:
        parsed, unknown = build_parser(command_path(argv)).parse_known_args(argv)
        if unknown:
            return None
        _require_text(parsed)
    except (BadCommandLine, SystemExit):
        return None
    return vars(parsed)


def assert_same(argv: list[str]) -> bool:
    """Lean's namespace is argparse's, if lean takes the line; whether it took it."""
    lean = parse(argv)
    if lean is None:
        return False
    full = argparse_namespace(argv)
    assert full is not None, f"lean took a line argparse refuses: {argv!r}"
    mine = vars(lean)
    assert {k: v for k, v in mine.items() if k not in FUNCTIONS} == {
        k: v for k, v in full.items() if k not in FUNCTIONS
    }, argv
    assert mine["run"] is full["run"] and mine["render"] is full["render"]
    return True


def test_every_lean_command_is_declared_in_a_form_the_lean_parser_reads():
    for path in LEAN_COMMANDS:
        assert command_path(list(path) + (["a", "b"] if path[0] == "idem" else [])) in (
            path,
            None,
        )
        _specs(_command(path))  # raises Unsupported for a declaration it cannot read


PLAIN = [
    ["ping"],
    ["--socket", "/s", "ping"],
    ["--json", "idem", "claim", "session.spawn", "spawn:app#42", "--payload", '{"issue": 42}',
     "--holder-pid", "123"],
    ["idem", "claim", "op", "k", "--effect-ref=r", "--replay-only", "--attempt", "t", "--json"],
    ["--socket", "/s", "idem", "complete", "op", "k", "--result", '{"session_id": "x"}'],
    ["idem", "complete", "op", "k"],
    ["claim", "src/a.py", "src/b.py", "--ttl", "10m", "--json"],
    ["--json", "claim", "--session", "S", "a.py"],
    ["release", "a.py"],
    ["run", "--key", "push:app#42", "--", "git", "push", "origin", "--force"],
    ["--json", "run", "--key=k", "--operation", "op", "--retry-failed", "--probe", "true",
     "--", "true"],
    ["run", "--timeout", "2.5", "--principal", "p", "--key", "k", "--", "sh", "-c", "exit 7"],
]  # fmt: skip


@pytest.mark.parametrize("argv", PLAIN)
def test_the_plain_hook_path_lines_are_taken_and_parse_as_argparse_does(argv):
    assert assert_same(argv), f"the lean parser left a plain line to argparse: {argv!r}"


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"], ["idem", "claim", "--help"], ["idem", "claim", "a"],
        ["idem", "claim", "a", "b", "c"], ["idem", "claim", "a", "b", "--pay", "{}"],
        ["idem", "claim", "a", "b", "--holder-pid", "x"], ["idem", "list"], ["status"],
        ["run", "--key", "k"], ["run", "--key", "k", "--"], ["run", "--key", "k", "true"],
        ["claim", "a", "--json", "b"], ["idem", "claim", "a", "b", "--payload", "-1"],
        ["idem", "claim", "a", "b\udcff"], ["--json=1", "ping"], ["ping", "--", "x"],
        ["idem", "claim", "a", "b", "--replay-only=yes"], ["--socket"],
    ],
)  # fmt: skip
def test_anything_else_is_left_to_argparse(argv):
    assert parse(argv) is None


def options_of(path: tuple[str, ...]) -> list[str]:
    return sorted(_specs(_command(path))[0])


VALUES = st.one_of(
    st.sampled_from(["", "x", "-", "-1", "5", " 7", "1e3", "inf", "a b", "--json", "-x y",
                     "b\udcff", "{}", '{"a": 1}', "=", "a=b", "é", "10m", "shell"]),
    st.text(max_size=6),
)  # fmt: skip


@st.composite
def command_lines(draw: st.DrawFn) -> list[str]:
    path = draw(st.sampled_from(sorted(LEAN_COMMANDS)))
    options = options_of(path) + list(GLOBALS)
    extras = ["--help", "-h", "--pay", "--js", "--version", "--", "idem", "claim"]
    tokens: list[str] = []
    for _ in range(draw(st.integers(0, 3))):  # global options before the command
        name = draw(st.sampled_from(list(GLOBALS)))
        tokens += [name] if name == "--json" else [name, draw(VALUES)]
    tokens += list(path)
    for _ in range(draw(st.integers(0, 7))):
        kind = draw(st.sampled_from(["option", "option=", "value", "positional", "extra"]))
        if kind == "option":
            tokens.append(draw(st.sampled_from(options)))
        elif kind == "option=":
            tokens.append(f"{draw(st.sampled_from(options))}={draw(VALUES)}")
        elif kind in ("value", "positional"):
            tokens.append(draw(VALUES))
        else:
            tokens.append(draw(st.sampled_from(extras)))
    if path == ("run",) and draw(st.booleans()):
        tokens += ["--", *draw(st.lists(VALUES, max_size=3))]
    return tokens


PLAIN_VALUES = st.one_of(
    st.sampled_from(["", "x", "5", " 7", "1e3", "a b", "=", "a=b", "é", "{}", "10m", "b\udcff"]),
    st.text(alphabet=st.characters(blacklist_characters="-", blacklist_categories=["Cs"]),
            max_size=5),
)  # fmt: skip


@st.composite
def well_formed_lines(draw: st.DrawFn) -> list[str]:
    """Lines of the shape hooks write: the command's options (each in either form, in any
    order, global ones among them), its positionals in one run, run's CMD after --."""
    path = draw(st.sampled_from(sorted(LEAN_COMMANDS)))
    options, positionals = _specs(_command(path))
    pieces: list[list[str]] = []
    for name in draw(st.lists(st.sampled_from(sorted(options) + list(GLOBALS)), max_size=5)):
        flag = name == "--json" or (name in options and options[name][1] is None)
        value = draw(PLAIN_VALUES)
        if name in ("--holder-pid", "--timeout"):
            value = draw(st.sampled_from(["1", "42", " 3", "2.5", "x", "1e3"]))
        if flag:
            pieces.append([name])
        elif draw(st.booleans()):
            pieces.append([f"{name}={value}"])
        else:
            pieces.append([name, value])
    nargs = [spec.options.get("nargs") for spec in positionals]
    if nargs == ["+"]:
        pieces.append(draw(st.lists(PLAIN_VALUES, min_size=1, max_size=3)))
    elif nargs and nargs[-1] != "...":
        pieces.append([draw(PLAIN_VALUES) for _ in nargs])
    order = draw(st.permutations(range(len(pieces))))
    before = draw(st.integers(0, len(pieces)))  # some go before the command words
    tokens = [t for i in order[:before] for t in pieces[i]]
    tokens += list(path) + [t for i in order[before:] for t in pieces[i]]
    if nargs[-1:] == ["..."]:
        tokens += ["--", *draw(st.lists(PLAIN_VALUES, min_size=1, max_size=3))]
    return tokens


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(command_lines(), well_formed_lines()))
@example(["idem", "claim", "op", "--json", "key"])
@example(["claim", "a", "b", "--session=", "c"])
@example(["idem", "claim", "a", "b", "--payload="])
@example(["run", "--key", "k", "--probe", "", "--", "--"])
@example(["idem", "--json", "claim", "a", "b"])
def test_whatever_the_lean_parser_takes_argparse_parses_the_same(argv):
    assert_same(argv)


def run(argv: list[str], lean: bool, **kwargs) -> subprocess.CompletedProcess[str]:
    """towerctl on ``argv``, through the lean parser or (an option only argparse takes,
    an abbreviation of --json, forces it there) through argparse."""
    if not lean:
        argv = ["--js", *argv]
        assert parse(argv) is None
    else:
        assert parse(argv) is not None
    return subprocess.run(
        [TOWERCTL, *argv], capture_output=True, text=True, timeout=60, check=False, **kwargs
    )


@pytest.mark.parametrize(
    "tail",
    [
        ["idem", "claim", "op", "{key}", "--payload", '{"n": 1}'],
        ["idem", "claim", "op", "{key}", "--payload", "{nope"],
        ["idem", "complete", "op", "{key}", "--result", "{}"],
        ["idem", "complete", "op", "never-claimed-{key}", "--result", "{}"],
        ["run", "--key", "{key}", "--", "sh", "-c", "echo out; echo err >&2; exit 3"],
        ["run", "--key", "{key}", "--", "/nonexistent/cmd"],
        ["claim", "--session", "no-such-session", "a.py"],
        ["claim", "--ttl", "forever", "a.py"],
        ["ping"],
    ],
)
def test_both_paths_print_and_exit_alike(daemon, tail, tmp_path):
    """Each line run twice, the lean way then argparse's, on fresh keys: same exit
    status, same output (--json: the same JSON, ids aside)."""
    import json

    outputs = []
    for lean, key in ((True, "lean"), (False, "full")):
        argv = ["--socket", str(daemon.socket_path), "--json"]
        argv += [part.replace("{key}", key) for part in tail]
        done = run(argv, lean, cwd=tmp_path)
        outputs.append(done)
    (a, b) = outputs
    assert a.returncode == b.returncode, (a, b)
    assert a.stderr.replace("lean", "full") == b.stderr
    if a.stdout.strip():
        left = json.loads(a.stdout.replace("lean", "full"))
        right = json.loads(b.stdout)
        for value in (left, right):
            for name in ("effect_ref", "now"):  # minted per claim; the daemon's clock
                value.pop(name, None)
        assert left == right
    else:
        assert b.stdout == ""


def test_the_three_spellings_of_the_global_options_agree() -> None:
    """towerctl's parser declares the global options; the lean parser and the entry's
    scan name them again, for start-up time. One missing from the entry's list of those
    taking a value would have its value read as a command word."""
    import argparse

    from towerd.client.cli.registry import add_global_options
    from towerd.client.entry import GLOBAL_OPTIONS_WITH_VALUES

    parser = argparse.ArgumentParser(add_help=False)
    add_global_options(parser, defaults=True)
    declared = {
        option: action.nargs != 0
        for action in parser._actions
        for option in action.option_strings
        if option.startswith("--")
    }
    assert set(GLOBALS) == set(declared)
    assert (
        {name for name, (_, convert) in GLOBALS.items() if convert}
        == {name for name, takes_value in declared.items() if takes_value}
        == set(GLOBAL_OPTIONS_WITH_VALUES)
    )
