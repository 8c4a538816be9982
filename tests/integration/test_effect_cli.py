"""``towerctl run``, ``effect run``, ``lock worktree``, ``effects``, ``leases``: the real CLI
against a real daemon, running real commands.

Commands that must stay running block on a fifo (``gate``) that the test opens when
it is ready; progress is read from files the commands append to, or from towerctl's
stderr pipe. Nothing sleeps to synchronize.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from towerd.client import IdempotencyKeyUnknown
from towerd.client.exactly_once import output_digest
from towerd.protocol.naming import effect_key
from towerd_testing import TOWERCTL, store_query, towerctl, wait_for

pytestmark = pytest.mark.both_backends

TARGET = "refs/heads/main"  # a shared git-push target: takes a lease


def spawn(daemon, *args: str, **popen) -> subprocess.Popen[str]:
    """towerctl in the background (stdout and stderr piped)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOWERD_")}
    popen.setdefault("stdout", subprocess.PIPE)
    popen.setdefault("stderr", subprocess.PIPE)
    return subprocess.Popen(
        [TOWERCTL, "--socket", str(daemon.socket_path), *args], text=True, env=env, **popen
    )


class Gate:
    """A fifo a command blocks on (``read x < gate``) until the test opens it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        os.mkfifo(path)

    def open(self) -> None:
        def writer() -> int | None:
            try:
                return os.open(self.path, os.O_WRONLY | os.O_NONBLOCK)
            except OSError as exc:
                if exc.errno == errno.ENXIO:  # nobody reads it yet
                    return None
                raise

        fd = wait_for(writer, timeout=10, what=f"a reader on {self.path.name}")
        os.write(fd, b"go\n")
        os.close(fd)


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def appears(path: Path, line: str, timeout: float = 10) -> None:
    wait_for(lambda: line in lines(path), timeout=timeout, what=f"{line!r} in {path.name}")


def gone(pid: int) -> bool:
    """No such process, or a zombie nobody reaps (a container's init may not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


# --- towerctl run ---------------------------------------------------------------------------


def test_run_executes_once_and_a_retry_replays_the_stored_outcome(daemon, short_tmp):
    log = short_tmp / "log"
    cmd = ["sh", "-c", f"echo ran >> {log}; echo hello; echo warn >&2"]
    first = towerctl(daemon, "run", "--key", "deploy:42", "--", *cmd)
    assert (first.returncode, first.stdout, first.stderr) == (0, "hello\n", "warn\n")
    assert lines(log) == ["ran"]
    with daemon.client() as client:
        record = client.idem_get("shell", "deploy:42")
    assert record["state"] == "completed"
    assert record["result"] == {
        "exit_status": 0,
        "output_sha256": output_digest(b"hello\n", b"warn\n"),
    }

    retry = towerctl(daemon, "run", "--key", "deploy:42", "--", *cmd)
    assert retry.returncode == 0 and retry.stdout == ""  # stdout stays CMD's: nothing ran
    assert "already ran: exit status 0" in retry.stderr
    assert record["result"]["output_sha256"] in retry.stderr
    assert lines(log) == ["ran"]


@pytest.mark.parametrize("closed", [">&-", "2>&-", "<&- >&- 2>&-"])
def test_run_with_a_standard_descriptor_closed_runs_once_and_records(daemon, short_tmp, closed):
    """`towerctl run ... >&-` (a runner that leaves stdout closed): it crashed after the
    claim (a traceback, exit 1), CMD never ran and the key was left outcome_unknown, so
    every retry was refused (exit 120). Also, the daemon's socket would have taken the
    closed number and CMD's output been copied into it."""
    log = short_tmp / "log"
    cmd = f"sh -c 'echo ran >> {log}; echo out; echo err >&2'"
    line = f"{TOWERCTL} --socket {daemon.socket_path} run --key closed -- {cmd} {closed}"
    first = subprocess.run(["sh", "-c", line], capture_output=True, text=True, timeout=30)
    assert first.returncode == 0, first
    assert lines(log) == ["ran"]
    with daemon.client() as client:
        record = client.idem_get("shell", "closed")
    assert record["state"] == "completed"
    assert record["result"]["output_sha256"] == output_digest(b"out\n", b"err\n")
    script = f"echo ran >> {log}; echo out; echo err >&2"
    retry = towerctl(daemon, "run", "--key", "closed", "--", "sh", "-c", script)
    assert retry.returncode == 0 and lines(log) == ["ran"]


def test_run_passes_the_exit_status_through_and_replays_it(daemon):
    for _ in range(2):
        r = towerctl(daemon, "run", "--key", "k7", "--", "sh", "-c", "exit 7")
        assert r.returncode == 7, r.stderr
    r = towerctl(daemon, "--json", "run", "--key", "k7", "--", "sh", "-c", "exit 7")
    assert r.returncode == 7 and json.loads(r.stdout)["state"] == "replayed"


def test_a_failed_run_is_retried_on_purpose_once_and_logged(daemon, short_tmp):
    """A command that failed replays its failure; --retry-failed runs it again (once,
    even with two retries at once), a run that succeeded is never rerun, and `idem
    reopen` is the same decision by hand. Each reopen is in the operator log."""
    log, flag = short_tmp / "log", short_tmp / "fixed"
    cmd = ["sh", "-c", f"echo ran >> {log}; test -e {flag}"]
    assert towerctl(daemon, "run", "--key", "push:42", "--", *cmd).returncode == 1
    assert towerctl(daemon, "run", "--key", "push:42", "--", *cmd).returncode == 1
    assert lines(log) == ["ran"]  # replayed, not rerun
    flag.touch()  # the remote is back
    retries = [
        subprocess.Popen(
            [
                TOWERCTL,
                "--socket",
                str(daemon.socket_path),
                "run",
                "--retry-failed",
                "--key",
                "push:42",
                "--",
                *cmd,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for _ in range(2)
    ]
    statuses = sorted(proc.wait(30) for proc in retries)
    assert lines(log) == ["ran", "ran"]  # rerun exactly once
    assert statuses[0] == 0 and statuses[1] in (0, 121), statuses
    again = towerctl(daemon, "run", "--retry-failed", "--key", "push:42", "--", *cmd)
    assert again.returncode == 0 and lines(log) == ["ran", "ran"]  # succeeded: never rerun
    flag.unlink()
    assert towerctl(daemon, "run", "--key", "other", "--", *cmd).returncode == 1
    reopened = towerctl(daemon, "--json", "idem", "reopen", "shell", "other", "--reason", "flaky")
    assert reopened.returncode == 0, reopened.stderr
    assert json.loads(reopened.stdout)["previous"]["result"]["exit_status"] == 1
    assert towerctl(daemon, "run", "--key", "other", "--", "true").returncode == 0
    actions = [
        json.loads(detail)
        for action, detail in store_query(daemon, "SELECT action, detail FROM operator_log")
        if action == "idem.reopen"
    ]
    assert [(a["key"], a["reason"]) for a in actions] == [
        ("push:42", "towerctl run --retry-failed"),
        ("other", "flaky"),
    ]


def test_run_another_command_under_the_same_key_is_an_idempotency_conflict(daemon, short_tmp):
    log = short_tmp / "log"
    assert towerctl(daemon, "run", "--key", "k", "--", "true").returncode == 0
    r = towerctl(daemon, "run", "--key", "k", "--", "sh", "-c", f"echo ran >> {log}")
    assert r.returncode == 1
    assert r.stderr.startswith("towerctl: idempotency_conflict: ")
    r = towerctl(daemon, "--json", "run", "--key", "k", "--", "false")
    assert r.returncode == 1 and json.loads(r.stdout)["error"]["code"] == "idempotency_conflict"
    assert not log.exists()


def test_run_json_output(daemon):
    cmd = ["sh", "-c", "printf out; printf err >&2; exit 3"]
    first = towerctl(daemon, "--json", "run", "--key", "j", "--operation", "hook", "--", *cmd)
    assert first.returncode == 3
    # With --json stdout is only the JSON result: CMD's stdout goes to stderr.
    assert first.stderr in ("outerr", "errout")
    ran = json.loads(first.stdout)
    digest = output_digest(b"out", b"err")
    assert ran == {
        "state": "ran",
        "operation": "hook",
        "key": "j",
        "effect_ref": ran["effect_ref"],
        "exit_status": 3,
        "output_sha256": digest,
        "result": {"exit_status": 3, "output_sha256": digest},
    }
    again = towerctl(daemon, "run", "--json", "--key", "j", "--operation", "hook", "--", *cmd)
    assert again.returncode == 3 and again.stderr == ""
    assert json.loads(again.stdout) == {**ran, "state": "replayed"}


def test_run_copies_large_binary_output_exactly(daemon, short_tmp):
    blob = short_tmp / "blob"
    data = os.urandom(1 << 20)
    blob.write_bytes(data)
    r = subprocess.run(
        [TOWERCTL, "--socket", str(daemon.socket_path), "run", "--key", "big", "--",
         "sh", "-c", f"cat {blob}; cat {blob} >&2"],
        capture_output=True, timeout=30,
    )  # fmt: skip
    assert r.returncode == 0 and r.stdout == data and r.stderr == data
    with daemon.client() as client:
        result = client.idem_get("shell", "big")["result"]
    assert result["output_sha256"] == output_digest(data, data)


def test_a_sigkilled_towerctl_leaves_the_key_outcome_unknown(daemon, short_tmp):
    """The claimant dies mid-CMD: the key turns outcome_unknown, a retry exits 120 and
    does not run CMD; a person settles it."""
    log, pid_file = short_tmp / "log", short_tmp / "pid"
    cmd = ["sh", "-c", f"echo ran >> {log}; echo $$ > {pid_file}; exec sleep 600"]
    proc = spawn(daemon, "run", "--key", "k", "--", *cmd)
    appears(log, "ran")
    wait_for(lambda: pid_file.exists() and pid_file.read_text().strip(), what="CMD's pid")
    proc.kill()
    proc.wait(10)
    os.kill(int(pid_file.read_text()), signal.SIGKILL)  # CMD outlived it; stop it
    with daemon.client() as client:
        wait_for(
            lambda: client.idem_get("shell", "k")["state"] == "outcome_unknown",
            what="the dead claimant's key to turn outcome_unknown",
        )
    retry = towerctl(daemon, "run", "--key", "k", "--", *cmd)
    assert retry.returncode == 120
    assert retry.stderr.startswith("towerctl: outcome_unknown: ")
    assert "towerctl idem resolve shell k --outcome completed" in retry.stderr
    r = towerctl(daemon, "--json", "run", "--key", "k", "--", *cmd)
    assert r.returncode == 120 and json.loads(r.stdout)["error"]["code"] == "outcome_unknown"
    assert lines(log) == ["ran"]

    resolved = towerctl(daemon, "idem", "resolve", "shell", "k", "--outcome", "completed",
                        "--result", '{"exit_status": 5}')  # fmt: skip
    assert resolved.returncode == 0, resolved.stderr
    assert towerctl(daemon, "run", "--key", "k", "--", *cmd).returncode == 5
    assert lines(log) == ["ran"]


def test_run_while_another_towerctl_runs_the_key_exits_121(daemon, short_tmp):
    gate, log = Gate(short_tmp / "gate"), short_tmp / "log"
    cmd = ["sh", "-c", f"echo ran >> {log}; read x < {gate.path}"]
    proc = spawn(daemon, "run", "--key", "busy", "--", *cmd)
    appears(log, "ran")
    r = towerctl(daemon, "run", "--key", "busy", "--", *cmd)
    assert r.returncode == 121 and r.stderr.startswith("towerctl: idempotency_in_progress: ")
    assert f"process {proc.pid} is running it" in r.stderr
    gate.open()
    assert proc.wait(10) == 0
    assert lines(log) == ["ran"]


def test_run_forwards_sigterm_and_records_the_signal(daemon, short_tmp):
    log = short_tmp / "log"
    proc = spawn(daemon, "run", "--key", "t", "--", "sh", "-c",
                 f"trap 'echo term >> {log}; exit 143' TERM; echo up >> {log}; "
                 "while :; do sleep 0.05; done")  # fmt: skip
    appears(log, "up")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == 143
    assert lines(log) == ["up", "term"]
    with daemon.client() as client:
        assert client.idem_get("shell", "t")["result"]["exit_status"] == 143


def test_run_a_missing_command_releases_the_key_and_exits_127(daemon):
    r = towerctl(daemon, "run", "--key", "nf", "--", "/nonexistent/towerd-test-cmd")
    assert r.returncode == 127 and r.stderr.startswith("towerctl: command_not_found: ")
    with daemon.client() as client, pytest.raises(IdempotencyKeyUnknown):
        client.idem_get("shell", "nf")
    r = towerctl(daemon, "--json", "run", "--key", "nf", "--", "/nonexistent/towerd-test-cmd")
    assert r.returncode == 127 and json.loads(r.stdout)["error"]["code"] == "command_not_found"


def test_run_usage_errors(daemon):
    assert towerctl(daemon, "run", "--", "true").returncode == 2  # no --key
    r = towerctl(daemon, "run", "--key", "k")
    assert r.returncode == 2 and "after --" in r.stderr


def test_options_after_dash_dash_are_the_commands_own(daemon):
    """`run --json --key k -- echo --json`: the first --json is towerctl's, the one
    after -- is echo's (as are --socket and --help there)."""
    r = towerctl(daemon, "run", "--json", "--key", "echo-json", "--",
                 "echo", "--json", "--socket", "/x", "--help")  # fmt: skip
    assert r.returncode == 0, r
    assert r.stderr == "--json --socket /x --help\n"  # CMD's stdout, moved to stderr by --json
    assert json.loads(r.stdout)["state"] == "ran"
    r = towerctl(daemon, "run", "--key", "echo-text", "--", "echo", "--json")
    assert (r.returncode, r.stdout, r.stderr) == (0, "--json\n", "")


def raw_towerctl(daemon, *args: bytes | str, **popen) -> subprocess.CompletedProcess[bytes]:
    """towerctl with an argv of raw bytes (what a shell passes along unchanged)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOWERD_")}
    argv = [os.fsencode(a) for a in (TOWERCTL, "--socket", str(daemon.socket_path), *args)]
    return subprocess.run(argv, capture_output=True, env=env, check=False, timeout=30, **popen)


def test_run_with_an_argument_that_is_not_utf8_runs_it_exactly_once(daemon):
    """`towerctl run --key k -- printf '\\xff'`: the command gets the byte itself, the key
    records the argv as bytes, a retry replays, another byte is another command."""
    first = raw_towerctl(daemon, "run", "--key", "bytes", "--", "printf", b"\xff")
    assert (first.returncode, first.stdout, first.stderr) == (0, b"\xff", b""), first
    digest = output_digest(b"\xff", b"")
    with daemon.client() as client:
        assert client.idem_get("shell", "bytes")["result"]["output_sha256"] == digest
    retry = raw_towerctl(daemon, "run", "--key", "bytes", "--", "printf", b"\xff")
    assert retry.returncode == 0 and retry.stdout == b"", retry  # replayed, not run
    assert b"already ran: exit status 0" in retry.stderr and digest.encode() in retry.stderr
    other = raw_towerctl(daemon, "--json", "run", "--key", "bytes", "--", "printf", b"\xfe")
    assert other.returncode == 1 and other.stdout.count(b"\n") == 1, other
    assert json.loads(other.stdout)["error"]["code"] == "idempotency_conflict"
    assert b"Traceback" not in first.stderr + retry.stderr + other.stderr


def test_a_command_that_is_not_utf8_and_not_found_exits_127(daemon):
    missing = b"/nonexistent/towerd-\xff"
    for args in (["run", "--key", "nf-bytes"], effect_args("run_bytes")):
        r = raw_towerctl(daemon, *args, "--", missing)
        assert r.returncode == 127 and r.stdout == b"", r
        assert r.stderr.startswith(b"towerctl: command_not_found: cannot run "), r
        assert b"/nonexistent/towerd-\\xff" in r.stderr and b"Traceback" not in r.stderr
        r = raw_towerctl(daemon, "--json", *args, "--", missing)
        error = json.loads(r.stdout)["error"]
        assert r.returncode == 127 and error["code"] == "command_not_found", r
        assert error["data"]["argv"] == ["/nonexistent/towerd-\\xff"]


def test_a_string_option_that_is_not_utf8_is_a_usage_error(daemon):
    """A --key (or any text the daemon would store) that is not UTF-8: exit 2, a typed
    usage error, nothing claimed, nothing run."""
    for args in (["run", "--key", b"k\xff", "--", "true"],
                 ["run", "--key", "k", "--operation", b"op\xfe", "--", "true"],
                 ["message", "send", "s", b"hi \xff"]):  # fmt: skip
        r = raw_towerctl(daemon, *args)
        assert r.returncode == 2 and r.stdout == b"", r
        assert b"not valid UTF-8" in r.stderr and b"Traceback" not in r.stderr, r
        r = raw_towerctl(daemon, "--json", *args)
        assert r.returncode == 2 and r.stderr == b"", r
        error = json.loads(r.stdout)["error"]
        assert error["code"] == "usage" and "not valid UTF-8" in error["message"]
    assert (
        "argument --key: not valid UTF-8 (b'k\\xff')"
        in json.loads(
            raw_towerctl(daemon, "--json", "run", "--key", b"k\xff", "--", "true").stdout
        )["error"]["message"]
    )
    with daemon.client() as client:
        assert client.idem_list(operation="shell")["keys"] == []


# --- towerctl effect run --------------------------------------------------------------------


def effect_args(run_id: str, *extra: str, target: str = TARGET) -> list[str]:
    return ["effect", "run", "--run-id", run_id, "--step", "push", "--kind", "git-push",
            "--target", target, *extra]  # fmt: skip


def test_effect_run_holds_the_lease_while_cmd_runs_and_commits(daemon, short_tmp):
    gate, log = Gate(short_tmp / "gate"), short_tmp / "log"
    proc = spawn(daemon, *effect_args("run_1"), "--", "sh", "-c",
                 f"echo pushed >> {log}; read x < {gate.path}; echo done")  # fmt: skip
    appears(log, "pushed")
    leases = towerctl(daemon, "leases")
    assert leases.returncode == 0 and TARGET in leases.stdout
    (lease,) = json.loads(towerctl(daemon, "--json", "leases").stdout)["leases"]
    assert lease["resource"] == TARGET and lease["holder_pid"] == proc.pid
    gate.open()
    out, err = proc.communicate(timeout=10)
    assert (proc.returncode, out, err) == (0, "done\n", "")
    key = effect_key("run_1", "push", "git-push", TARGET)
    with daemon.client() as client:
        record = client.effect_get(key)
        assert client.lease_list()["leases"] == []
    assert record["status"] == "committed"
    assert record["receipt"] == {"exit_status": 0, "output_sha256": output_digest(b"done\n", b"")}
    listed = towerctl(daemon, "effects", "list", "run_1")
    assert listed.returncode == 0
    assert listed.stdout.splitlines()[0].split() == [
        "EFFECT_KEY", "KIND", "TARGET", "STATUS", "ATTEMPT", "UPDATED", "PROBE"
    ]  # fmt: skip
    assert listed.stdout.splitlines()[1].split()[:5] == [
        key, "git-push", TARGET, "committed", record["attempt_id"]
    ]  # fmt: skip


def test_effect_run_fails_on_a_nonzero_exit_and_a_new_attempt_rearms_it(daemon):
    failed = towerctl(daemon, *effect_args("run_2"), "--attempt", "a-1", "--", "sh", "-c", "exit 3")
    assert failed.returncode == 3
    key = effect_key("run_2", "push", "git-push", TARGET)
    with daemon.client() as client:
        record = client.effect_get(key)
        assert record["status"] == "failed" and record["attempt_id"] == "a-1"
        assert record["receipt"]["error"]["exit_status"] == 3
        assert client.lease_list()["leases"] == []  # fail gave the lease back
    ok = towerctl(daemon, "--json", *effect_args("run_2"), "--", "true")
    assert ok.returncode == 0, ok.stderr
    answer = json.loads(ok.stdout)
    assert answer["state"] == "committed" and answer["exit_status"] == 0
    assert answer["effect"]["attempt_id"] != "a-1" and answer["effect"]["effect_key"] == key


def test_effect_run_after_a_commit_exits_0_without_running(daemon, short_tmp):
    log = short_tmp / "log"
    cmd = ["sh", "-c", f"echo pushed >> {log}"]
    assert towerctl(daemon, *effect_args("run_3"), "--", *cmd).returncode == 0
    again = towerctl(daemon, *effect_args("run_3"), "--", *cmd)
    assert again.returncode == 0 and again.stdout == ""
    assert "already committed" in again.stderr and '"exit_status": 0' in again.stderr
    as_json = towerctl(daemon, "--json", *effect_args("run_3"), "--", *cmd)
    answer = json.loads(as_json.stdout)
    assert as_json.returncode == 0 and answer["state"] == "already_committed"
    assert answer["effect"]["status"] == "committed"
    assert lines(log) == ["pushed"]


def test_effect_run_when_another_run_holds_the_target_exits_121(daemon, short_tmp):
    log = short_tmp / "log"
    with daemon.client(principal="box-b") as other:
        other.lease_acquire(TARGET)
        r = towerctl(daemon, *effect_args("run_4"), "--", "sh", "-c", f"echo x >> {log}")
        assert r.returncode == 121 and r.stderr.startswith("towerctl: effect_lease_held: ")
        r = towerctl(daemon, "--json", *effect_args("run_4"), "--", "true")
        assert r.returncode == 121
        assert json.loads(r.stdout)["error"]["code"] == "effect_lease_held"
    assert not log.exists()


def test_effect_run_in_flight_elsewhere_exits_121(daemon, short_tmp):
    gate, log = Gate(short_tmp / "gate"), short_tmp / "log"
    local = ["--target", "kxm/run-5"]  # the run's own branch: no lease, the ledger decides
    args = ["effect", "run", "--run-id", "run_5", "--step", "b", "--kind", "git-branch", *local]
    proc = spawn(daemon, *args, "--", "sh", "-c", f"echo in >> {log}; read x < {gate.path}")
    appears(log, "in")
    r = towerctl(daemon, *args, "--", "true")
    assert r.returncode == 121 and r.stderr.startswith("towerctl: effect_in_flight: ")
    gate.open()
    assert proc.wait(10) == 0


def test_effect_run_heartbeats_while_cmd_runs(daemon, short_tmp):
    gate, log = Gate(short_tmp / "gate"), short_tmp / "log"
    proc = spawn(daemon, *effect_args("run_6", "--heartbeat", "0.05"), "--", "sh", "-c",
                 f"echo in >> {log}; read x < {gate.path}")  # fmt: skip
    appears(log, "in")
    key = effect_key("run_6", "push", "git-push", TARGET)
    with daemon.client() as client:
        claimed_at = client.effect_get(key)["claimed_at"]
        wait_for(lambda: client.effect_get(key)["heartbeat_at"] > claimed_at, what="a heartbeat")
        beat = client.effect_get(key)["heartbeat_at"]
        wait_for(lambda: client.effect_get(key)["heartbeat_at"] > beat, what="another heartbeat")
    gate.open()
    assert proc.wait(10) == 0


def test_effect_run_records_the_outcome_on_a_new_connection_after_a_daemon_restart(
    daemon, short_tmp
):
    """The daemon restarts while CMD runs, taking towerctl's connection with it: the commit
    is sent again on a new connection, not left in flight for a person to settle."""
    gate, log = Gate(short_tmp / "gate"), short_tmp / "log"
    proc = spawn(daemon, *effect_args("run_r"), "--", "sh", "-c",
                 f"echo in >> {log}; read x < {gate.path}; echo done")  # fmt: skip
    appears(log, "in")
    assert daemon.stop() == 0, daemon.log()
    daemon.start()
    gate.open()
    out, err = proc.communicate(timeout=30)
    assert (proc.returncode, out, err) == (0, "done\n", "")
    with daemon.client() as client:
        record = client.effect_get(effect_key("run_r", "push", "git-push", TARGET))
        assert client.lease_list()["leases"] == []
    assert record["status"] == "committed"
    assert record["receipt"] == {"exit_status": 0, "output_sha256": output_digest(b"done\n", b"")}
    assert lines(log) == ["in"]


def test_effect_run_whose_lease_is_taken_over_exits_120_and_is_resolved(daemon, short_tmp):
    """The lease lapses while CMD runs (no heartbeat in time) and another holder takes the
    target: the effect is not committed, towerctl exits 120; a retry of the same effect
    also exits 120 until a person resolves it."""
    gate, log = Gate(short_tmp / "gate"), short_tmp / "log"
    args = effect_args("run_7", "--lease-ttl", "5000", "--heartbeat", "3600")
    proc = spawn(daemon, *args, "--", "sh", "-c", f"echo in >> {log}; read x < {gate.path}")
    appears(log, "in")
    key = effect_key("run_7", "push", "git-push", TARGET)
    with daemon.client(principal="box-b") as other:
        wait_for(lambda: not other.lease_get(TARGET)["live"], timeout=15, what="the lapse")
        other.lease_acquire(TARGET)
        gate.open()
        _out, err = proc.communicate(timeout=10)
        assert proc.returncode == 120, err
        assert "effect_lease_superseded" in err and f"towerctl effects resolve {key}" in err
        assert other.effect_get(key)["status"] == "uncertain"

    retry = towerctl(daemon, *args, "--", "sh", "-c", f"echo again >> {log}")
    # Said first: a heartbeat this rare lets the lease lapse (what this test wants).
    warning, _, refusal = retry.stderr.partition("\n")
    assert "--heartbeat 3600 s is more than half the effect's lease (5 s)" in warning
    assert retry.returncode == 120 and refusal.startswith("towerctl: effect_uncertain: ")
    assert lines(log) == ["in"]

    bad = towerctl(daemon, "effects", "resolve", key)
    assert bad.returncode == 2
    resolved = towerctl(daemon, "--json", "effects", "resolve", key, "--outcome", "committed",
                        "--receipt", '{"sha": "abc"}')  # fmt: skip
    assert resolved.returncode == 0, resolved.stderr
    assert json.loads(resolved.stdout)["status"] == "committed"
    assert towerctl(daemon, *args, "--", "false").returncode == 0  # committed: not run


def test_effect_run_usage_errors(daemon):
    r = towerctl(daemon, "effect", "run", "--run-id", "r", "--", "true")
    assert r.returncode == 2 and "--step, --kind, --target" in r.stderr
    r = towerctl(daemon, *effect_args("r", "--heartbeat", "0"), "--", "true")
    assert r.returncode == 2
    r = towerctl(daemon, "effect", "run", "--kind", "nope")
    assert r.returncode == 2  # argparse: not an action kind


def test_effect_run_missing_command_aborts_and_exits_127(daemon):
    r = towerctl(daemon, *effect_args("run_8"), "--", "/nonexistent/towerd-test-cmd")
    assert r.returncode == 127
    with daemon.client() as client:
        record = client.effect_get(effect_key("run_8", "push", "git-push", TARGET))
        assert record["status"] == "aborted" and client.lease_list()["leases"] == []


# --- towerctl lock worktree -----------------------------------------------------------------


def git(cwd: Path, *args: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("GIT_")}
    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false", *args],
        cwd=cwd, env=env, capture_output=True, check=True,
    )  # fmt: skip


@pytest.fixture
def repo(short_tmp: Path) -> tuple[Path, Path]:
    """A repository and a linked worktree of it."""
    main = short_tmp / "repo"
    git(short_tmp, "init", "-q", "-b", "main", str(main))
    git(main, "commit", "-q", "--allow-empty", "-m", "init")
    linked = short_tmp / "linked"
    git(main, "worktree", "add", "-q", "-b", "side", str(linked))
    return main, linked


def test_lock_worktree_serializes_a_repository_and_its_linked_worktree(daemon, short_tmp, repo):
    main, linked = repo
    gate, log = Gate(short_tmp / "gate"), short_tmp / "log"
    cmd = ["sh", "-c", f"echo a-in >> {log}; read x < {gate.path}; echo a-out >> {log}"]
    first = spawn(daemon, "lock", "worktree", "--repo", str(main), "--", *cmd)
    appears(log, "a-in")
    # A command run from the linked worktree's own directory contends for the same lease.
    second = spawn(daemon, "lock", "worktree", "--", "sh", "-c", f"echo b-in >> {log}",
                   cwd=linked)  # fmt: skip
    waiting = second.stderr.readline()  # printed once it has been refused
    assert "is locked by" in waiting and f"pid {first.pid}" in waiting
    assert f"worktree:{(main / '.git').resolve()}" in waiting
    assert lines(log) == ["a-in"]
    gate.open()
    assert first.wait(10) == 0
    assert second.wait(10) == 0
    assert lines(log) == ["a-in", "a-out", "b-in"]
    with daemon.client() as client:
        assert client.lease_list()["leases"] == []  # both released


def test_a_sigkilled_lock_holder_frees_the_lock_at_once(daemon, short_tmp, repo):
    main, _linked = repo
    pid_file = short_tmp / "pid"
    # A 10-minute TTL: only the holder's death can free it within the test's timeout.
    holder = spawn(daemon, "lock", "worktree", "--repo", str(main), "--lease-ttl", "600000",
                   "--", "sh", "-c", f"echo $$ > {pid_file}.tmp; mv {pid_file}.tmp {pid_file}; "
                   "exec sleep 600")  # fmt: skip
    wait_for(pid_file.exists, what="the holder's command to start")
    cmd_pid = int(pid_file.read_text())
    holder.kill()
    holder.wait(10)
    started = time.monotonic()
    r = towerctl(daemon, "lock", "worktree", "--repo", str(main), "--timeout", "20", "--", "true")
    assert r.returncode == 0, r.stderr
    assert time.monotonic() - started < 10
    assert not (main / ".git" / "index.lock").exists()
    # The killed holder's command got SIGTERM: it does not run on without the lock.
    wait_for(lambda: gone(cmd_pid), what="the dead holder's command to stop")


@pytest.mark.parametrize("stop", [signal.SIGKILL, signal.SIGTERM])
@pytest.mark.parametrize("kind", ["lock", "git-push", "git-commit"])
def test_what_the_command_started_goes_with_a_stopped_towerctl(daemon, short_tmp, repo, kind, stop):
    """The parent-death signal (SIGKILL of towerctl) and a forwarded SIGTERM reach CMD
    only: a process CMD started (a script's own step) went on, beside the next lock
    holder, the next holder of the push's lease, or the attempt that took the local
    effect over (hostile reviews). It carries CMD's mark and goes too: within seconds
    of a SIGKILL, and before towerctl exits (so before it releases) on a SIGTERM."""
    main, _linked = repo
    grandchild, log = short_tmp / "grandchild", short_tmp / "log"
    step = f"echo $$ > {grandchild}.tmp; mv {grandchild}.tmp {grandchild}; exec sleep 600"
    script = f"sh -c '{step}'; echo after >> {log}"
    if kind == "lock":
        argv = ["lock", "worktree", "--repo", str(main), "--lease-ttl", "600000"]
    else:
        target = "refs/heads/release" if kind == "git-push" else "refs/heads/kxm/run-7"
        argv = ["effect", "run", "--run-id", "7", "--step", "s", "--kind", kind,
                "--target", target, "--heartbeat", "1"]  # fmt: skip
    holder = spawn(daemon, *argv, "--", "sh", "-c", script, cwd=main)
    wait_for(grandchild.exists, what="the command's own child to start")
    pid = int(grandchild.read_text())
    holder.send_signal(stop)  # towerctl alone; CMD's shell gets it (or its death), not its child
    holder.wait(30)
    if stop == signal.SIGTERM:
        assert gone(pid), "towerctl let go while the command's child still ran"
    wait_for(lambda: gone(pid), timeout=15, what="the command's child to stop")
    assert lines(log) == []


def test_lock_worktree_timeout_exits_121_naming_the_holder(daemon, short_tmp, repo):
    main, linked = repo
    gate, log = Gate(short_tmp / "gate"), short_tmp / "log"
    first = spawn(daemon, "lock", "worktree", "--repo", str(linked), "--",
                  "sh", "-c", f"echo a-in >> {log}; read x < {gate.path}; exit 4")  # fmt: skip
    appears(log, "a-in")
    r = towerctl(daemon, "lock", "worktree", "--repo", str(main), "--timeout", "0.2", "--",
                 "sh", "-c", f"echo b-in >> {log}")  # fmt: skip
    assert r.returncode == 121
    *waited, error, hint = r.stderr.splitlines()
    assert [line for line in waited if "waiting up to 0.2s" in line]
    assert error.startswith("towerctl: lease_held: gave up after 0.2s: ")
    assert f"pid {first.pid}" in error and hint == "towerctl: CMD was not run"
    r = towerctl(daemon, "--json", "lock", "worktree", "--repo", str(main), "--timeout", "0",
                 "--", "true")  # fmt: skip
    assert r.returncode == 121
    assert json.loads(r.stdout)["error"]["data"]["lease"]["holder_pid"] == first.pid
    gate.open()
    assert first.wait(10) == 4  # CMD's status
    assert lines(log) == ["a-in"]


def test_lock_worktree_in_a_repository_whose_path_is_not_utf8(daemon, short_tmp):
    """The lease is named after the path, undecodable bytes as \\xNN: it locks, no
    traceback."""
    main = short_tmp / os.fsdecode(b"repo-\xff")
    git(short_tmp, "init", "-q", "-b", "main", str(main))
    r = raw_towerctl(daemon, "lock", "worktree", "--repo", os.fsencode(main), "--",
                     "sh", "-c", "echo locked")  # fmt: skip
    assert (r.returncode, r.stdout, r.stderr) == (0, b"locked\n", b""), r


def test_lock_worktree_outside_a_repository_is_a_usage_error(daemon, short_tmp):
    r = towerctl(daemon, "lock", "worktree", "--repo", str(short_tmp), "--", "true")
    assert r.returncode == 2 and "not a git repository" in r.stderr


def test_leases_and_effects_list_text_and_json(daemon):
    with daemon.client(principal="box-a") as client:
        lease = client.lease_acquire("res/one", ttl_ms=60_000)
        listed = towerctl(daemon, "leases")
        assert listed.returncode == 0
        header, row = listed.stdout.splitlines()
        assert header.split() == ["RESOURCE", "TOKEN", "HOLDER", "SESSION", "ACQUIRED", "EXPIRES"]
        assert row.split()[:2] == ["res/one", str(lease["fencing_token"])]
        assert row.split()[2].startswith("uid:") and row.split()[2].endswith(":box-a")
        as_json = json.loads(towerctl(daemon, "--json", "leases").stdout)
        assert [entry["resource"] for entry in as_json["leases"]] == ["res/one"]
    empty = towerctl(daemon, "--json", "effects", "list", "no-such-run")
    assert empty.returncode == 0 and json.loads(empty.stdout) == {"effects": []}
    assert towerctl(daemon, "effects", "list").returncode == 2


def test_run_json_into_a_reader_that_has_gone_exits_with_the_commands_status(daemon):
    """`towerctl --json run ... | head -0`: the JSON answer met a closed pipe, and a
    BrokenPipeError traceback with exit 1 stood in for CMD's status (recorded all the
    same), on the first run and on the replay."""
    for _ in ("ran", "replayed"):
        proc = spawn(daemon, "--json", "run", "--key", "gone-reader", "--", "sh", "-c", "exit 4")
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()
        assert proc.wait(30) == 4
        assert "Traceback" not in proc.stderr.read()


@pytest.mark.parametrize("command", ["run", "effect run"])
def test_a_signal_while_the_outcome_is_recorded_waits_for_the_record(daemon, short_tmp, command):
    """CMD has ended and towerctl retries recording its outcome while the daemon
    restarts; a SIGTERM then used to stop towerctl at once (exit 143): the known outcome
    was lost (run: the key turned outcome_unknown and every retry was refused 120;
    effect run: the effect was parked uncertain). Now the record comes first, then
    towerctl stops with the signal's status."""
    gate, started, ended = Gate(short_tmp / "gate"), short_tmp / "started", short_tmp / "ended"
    script = f"echo $$ > {started}; read x < {gate.path}; touch {ended}; exit 3"
    if command == "run":
        argv = ["run", "--key", "record-me"]
    else:
        argv = ["effect", "run", "--run-id", "8", "--step", "s", "--kind", "webhook",
                "--target", "hook:deploy", "--heartbeat", "1"]  # fmt: skip
    proc = spawn(daemon, *argv, "--", "sh", "-c", script)
    wait_for(lambda: started.exists() and started.read_text().strip(),
             what="CMD to start (after its claim)")  # fmt: skip
    assert daemon.stop() == 0
    gate.open()
    wait_for(ended.exists, what="CMD to end")
    # Reaped, not only ended: a signal while CMD lives is CMD's (forwarded), and CMD's
    # status is then towerctl's.
    cmd_pid = int(started.read_text())
    wait_for(lambda: not os.path.exists(f"/proc/{cmd_pid}"), what="towerctl to reap CMD")
    proc.send_signal(signal.SIGTERM)  # towerctl is retrying the record meanwhile
    daemon.start()
    assert proc.wait(60) == 128 + signal.SIGTERM
    with daemon.client() as client:
        if command == "run":
            record = client.idem_get("shell", "record-me")
            assert record["state"] == "completed" and record["result"]["exit_status"] == 3
        else:
            record = client.effect_get(effect_key("8", "s", "webhook", "hook:deploy"))
            assert record["status"] == "failed"  # exit 3: recorded, not parked uncertain
