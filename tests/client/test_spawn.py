"""``towerctl run`` starts CMD with os.posix_spawnp (client/exactly_once.py, Spawned), not
the subprocess module: CMD must see what a subprocess.Popen child saw (default SIGPIPE,
no inherited descriptors beyond 0-2, the errors of a command that cannot be started), and
its outcome must be recorded the same (exit status, 128+N for a signal, the digest)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from towerd.client.exactly_once import Child, Outcome, Spawned, output_digest


def run_child(argv: list[str], **kwargs) -> tuple[Outcome, bytes, bytes]:
    """Child(argv) with its copies of stdout and stderr caught in pipes."""
    out_r, out_w = os.pipe()
    saved = os.dup(2)
    err_r, err_w = os.pipe()
    try:
        os.dup2(err_w, 2)
        child = Child(argv, capture=True, stdout_fd=out_w, **kwargs)
        outcome = child.wait()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(out_w)
        os.close(err_w)
    with os.fdopen(out_r, "rb") as out, os.fdopen(err_r, "rb") as err:
        return outcome, out.read(), err.read()


def test_output_is_copied_and_hashed_and_the_status_recorded():
    outcome, out, err = run_child(["sh", "-c", "printf out; printf err >&2; exit 7"])
    assert (out, err) == (b"out", b"err")
    assert outcome == Outcome(7, output_digest(b"out", b"err"))
    assert outcome.signal is None and outcome.result() == {
        "exit_status": 7, "output_sha256": output_digest(b"out", b"err"),
    }  # fmt: skip
    with pytest.raises(AttributeError):
        outcome.exit_status = 0  # type: ignore[misc]


def test_a_command_killed_by_a_signal_exits_128_plus_n():
    outcome, _out, _err = run_child(["sh", "-c", "kill -TERM $$"])
    assert (outcome.exit_status, outcome.signal) == (128 + signal.SIGTERM, signal.SIGTERM)


def test_the_command_gets_sigpipe_at_its_default_as_popen_gives_it():
    """Python ignores SIGPIPE; an ignored disposition survives exec, so CMD would not die
    of a closed pipe (`yes | head` would spin). Popen resets it; so must the spawn."""
    assert signal.getsignal(signal.SIGPIPE) == signal.SIG_IGN  # what towerctl has too
    mask = "grep SigIgn /proc/self/status"
    _o, spawned, _e = run_child(["sh", "-c", mask])
    popen = subprocess.run(["sh", "-c", mask], capture_output=True, check=True).stdout
    ignored = int(spawned.split()[1], 16)
    assert not ignored & (1 << (signal.SIGPIPE - 1)), spawned
    # glibc's posix_spawn leaves its two internal signals (32, 33: thread cancellation
    # and setxid) ignored in the child; glibc programs reinstall them at start, and no
    # other way of asking for them exists (sigaddset refuses them). Every other
    # disposition is Popen's.
    glibc_internal = (1 << 31) | (1 << 32)
    assert ignored & ~glibc_internal == int(popen.split()[1], 16), (spawned, popen)


def test_the_command_inherits_no_descriptor_beyond_0_1_2():
    inherited_r, inherited_w = os.pipe()
    os.set_inheritable(inherited_w, True)
    try:
        _o, out, _e = run_child(["sh", "-c", "ls /proc/$$/fd"])
    finally:
        os.close(inherited_r)
        os.close(inherited_w)
    assert sorted(int(fd) for fd in out.split()) == [0, 1, 2], out


@pytest.mark.parametrize(
    ("make", "error"),
    [
        (lambda tmp: str(tmp / "missing"), FileNotFoundError),
        (lambda tmp: "no-such-command-towerd-test", FileNotFoundError),
        (lambda tmp: _file(tmp / "plain", b"#!/bin/sh\nexit 0\n", 0o644), PermissionError),
        (lambda tmp: _file(tmp / "noshebang", b"\x7fELFjunk", 0o755), OSError),
    ],
)
def test_a_command_that_cannot_start_raises_as_popen_does_and_runs_nothing(tmp_path, make, error):
    path = make(tmp_path)
    with pytest.raises(OSError) as spawned:
        Spawned([path], capture=True)
    with pytest.raises(OSError) as popen:
        subprocess.Popen([path])
    assert type(spawned.value) is type(popen.value) and isinstance(spawned.value, error)
    assert spawned.value.errno == popen.value.errno


def _file(path, content: bytes, mode: int) -> str:
    path.write_bytes(content)
    path.chmod(mode)
    return str(path)


def test_towerctl_run_imports_neither_subprocess_nor_dataclasses():
    """What each `run --key` pays: the spawn path must not pull them back in."""
    code = (
        "import sys; import towerd.client.exactly_once, towerd.client.cli.lean; "
        "print(sorted(m for m in ('subprocess', 'dataclasses', 'typing', 'argparse', "
        "'hashlib', 'shlex', 'secrets') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
