"""Evidence probes end to end: a real daemon, the real towerctl killed with SIGKILL at a
chosen moment, real git pushing to a real local bare repository whose post-receive hook
counts the pushes it received.

Moments are chosen with files the command creates (``pushed``, ``started``), never with
sleeps; outcomes are waited for with a deadline (``wait_for``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from towerd.client.exactly_once import NotProbeable, parse_git_push
from towerd.protocol.naming import effect_key, run_branch
from towerd_testing import TOWERCTL, store_query, towerctl, wait_for

pytestmark = pytest.mark.both_backends

REF = "refs/heads/release"  # a shared git-push target (not the run's branch): leased
RUN, STEP = "run_9", "publish"
KEY = effect_key(RUN, STEP, "git-push", REF)


def git(cwd: Path, *args: str) -> str:
    done = subprocess.run(["git", "-C", str(cwd), *args], capture_output=True, text=True,
                          check=True)  # fmt: skip
    return done.stdout.strip()


@pytest.fixture
def repos(short_tmp: Path) -> tuple[Path, Path, Path]:
    """(work repository, its bare remote ``origin``, the file the remote's post-receive
    hook appends a line to per push it received)."""
    remote, work, pushes = short_tmp / "remote.git", short_tmp / "work", short_tmp / "pushes"
    subprocess.run(["git", "init", "-q", "--bare", str(remote)], check=True)
    hook = remote / "hooks" / "post-receive"
    hook.write_text(f"#!/bin/sh\ncat >> {pushes}\n")
    hook.chmod(0o755)
    subprocess.run(["git", "init", "-q", "-b", "main", str(work)], check=True)
    git(work, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty",
        "-m", "release me")  # fmt: skip
    git(work, "remote", "add", "origin", str(remote))
    return work, remote, pushes


def pushes_of(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def effect_run(daemon, work: Path, *cmd: str, extra: tuple[str, ...] = ()) -> list[str]:
    return [TOWERCTL, "--socket", str(daemon.socket_path), "effect", "run", "--run-id", RUN,
            "--step", STEP, "--kind", "git-push", "--target", REF, "--heartbeat", "1",
            *extra, "--", *cmd]  # fmt: skip


def spawn(argv: list[str], cwd: Path) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TOWERD_", "GIT_"))}
    return subprocess.Popen(argv, cwd=cwd, text=True, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)  # fmt: skip


def kill9(proc: subprocess.Popen[str]) -> None:
    """SIGKILL towerctl and its CMD (its whole session: sh, and what sh runs)."""
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(10)


def effect(daemon) -> dict:
    with daemon.client() as client:
        return client.effect_get(KEY)


# The explicit target flags: CMD is a script, not `git push ...`.
TARGET_FLAGS = ("--repo", ".", "--remote", "origin", "--ref", REF)


def test_a_push_killed_after_it_completed_is_settled_committed_at_reconciliation(
    make_daemon, repos, short_tmp
):
    work, _remote, pushes = repos
    daemon = make_daemon().start()
    head = git(work, "rev-parse", "HEAD")
    script = f"git push -q origin HEAD:{REF} && touch {short_tmp}/pushed && exec sleep 1000"
    proc = spawn(effect_run(daemon, work, "sh", "-c", script, extra=TARGET_FLAGS), work)
    wait_for(lambda: (short_tmp / "pushed").exists(), what="the push to complete")
    kill9(proc)
    assert effect(daemon)["git"] == {"repo": str(work), "remote_url": str(repos[1]),
                                     "commit": head, "ref": REF}  # fmt: skip
    # The next start-up's probe pass settles it; no person involved.
    assert daemon.stop() == 0
    daemon.start()
    record = wait_for(lambda: (r := effect(daemon))["status"] == "committed" and r,
                      what="the probe to settle the push committed")  # fmt: skip
    assert record["receipt"]["settled_by"] == "evidence probe"
    assert record["receipt"]["evidence"]["remote_tip"] == head
    assert record["probe"]["verdict"] == "committed"
    assert len(pushes_of(pushes)) == 1
    # A retry does not push again: the ledger says committed.
    retry = spawn(effect_run(daemon, work, "git", "push", "-q", "origin", f"HEAD:{REF}"), work)
    assert retry.wait(30) == 0, retry.stderr.read() if retry.stderr else ""
    assert len(pushes_of(pushes)) == 1
    logged = query_log(daemon)
    assert ("towerd:probe", "effect.probe", "committed") in logged
    assert daemon.stop() == 0


def test_an_effect_is_not_probed_while_its_command_still_runs(daemon, repos, short_tmp):
    """A push to the run's own branch (no lease, so CMD is not tied to towerctl): only
    towerctl is killed, and the script it ran goes on to push. The probe used to find
    nothing pushed yet, settle the effect aborted, and a retry ran CMD beside the first
    (two starts; a hostile tester's reproducer). Now it waits while any process
    carries the attempt; once the script has pushed, it settles committed."""
    work, _remote, pushes = repos
    own = f"refs/heads/{run_branch(RUN)}"  # the run's own branch: no lease
    key = effect_key(RUN, STEP, "git-push", own)
    gate, runs = short_tmp / "gate", short_tmp / "runs"
    script = (f"echo started >> {runs}; while [ ! -e {gate} ]; do sleep 0.01; done; "
              f"git push -q origin HEAD:{own}")  # fmt: skip
    argv = [TOWERCTL, "--socket", str(daemon.socket_path), "effect", "run", "--run-id", RUN,
            "--step", STEP, "--kind", "git-push", "--target", own, "--heartbeat", "1",
            "--repo", ".", "--remote", "origin", "--ref", own,
            "--", "sh", "-c", script]  # fmt: skip
    proc = spawn(argv, work)
    wait_for(lambda: runs.exists(), what="CMD to start")
    os.kill(proc.pid, signal.SIGKILL)  # towerctl alone, as a hook runner's timeout may
    proc.wait(10)
    with daemon.client() as client:
        wait_for(lambda: client.effect_get(key)["status"] == "uncertain",
                 what="the holder sweep to park the effect")  # fmt: skip
    settled = towerctl(daemon, "--json", "effects", "settle", key, check=True)
    [outcome] = json.loads(settled.stdout)["outcomes"]
    assert outcome["verdict"] == "holder_alive", outcome
    assert outcome["evidence"]["command_running"] > 0
    retry = subprocess.run(argv, cwd=work, capture_output=True, text=True, timeout=60)
    assert retry.returncode == 120, retry.stderr
    assert runs.read_text().splitlines() == ["started"]
    gate.touch()
    with daemon.client() as client:
        wait_for(lambda: towerctl(daemon, "effects", "settle", key).returncode == 0
                 and client.effect_get(key)["status"] == "committed",
                 what="the probe to settle the push once the script ended")  # fmt: skip
    replay = subprocess.run(argv, cwd=work, capture_output=True, text=True, timeout=60)
    assert replay.returncode == 0, replay.stderr
    assert runs.read_text().splitlines() == ["started"] and len(pushes_of(pushes)) == 1


def query_log(daemon) -> list[tuple[str, str, str]]:
    rows = store_query(daemon, "SELECT principal, action, detail FROM operator_log")
    return [(p, a, json.loads(d).get("outcome")) for p, a, d in rows]


def test_a_push_killed_before_it_started_is_aborted_and_a_retry_pushes_once(
    daemon, repos, short_tmp
):
    work, remote, pushes = repos
    script = f"touch {short_tmp}/started && sleep 1000 && git push -q origin HEAD:{REF}"
    proc = spawn(effect_run(daemon, work, "sh", "-c", script, extra=TARGET_FLAGS), work)
    wait_for(lambda: (short_tmp / "started").exists(), what="CMD to start")
    kill9(proc)
    settled = towerctl(daemon, "--json", "effects", "settle", KEY, check=True)
    [outcome] = json.loads(settled.stdout)["outcomes"]
    assert (outcome["verdict"], outcome["status"]) == ("aborted", "aborted"), outcome
    assert outcome["evidence"]["remote_tip"] is None
    assert pushes_of(pushes) == []
    # A retry under the same effect key runs it afresh: it pushes, once.
    retry = spawn(effect_run(daemon, work, "git", "push", "-q", "origin", f"HEAD:{REF}"), work)
    assert retry.wait(30) == 0, retry.stderr.read() if retry.stderr else ""
    assert len(pushes_of(pushes)) == 1
    assert git(remote, "rev-parse", REF) == git(work, "rev-parse", "HEAD")
    record = effect(daemon)
    assert record["status"] == "committed" and record["receipt"]["exit_status"] == 0
    # Derived from CMD (`git push origin HEAD:REF`), not given: the same target.
    assert record["git"]["ref"] == REF and record["git"]["remote_url"] == str(remote)


def test_with_its_remote_gone_a_push_stays_uncertain_and_is_probed_again(
    make_daemon, repos, short_tmp
):
    work, remote, _pushes = repos
    daemon = make_daemon().start("--probe-interval", "0.2")
    script = f"git push -q origin HEAD:{REF} && touch {short_tmp}/pushed && exec sleep 1000"
    proc = spawn(effect_run(daemon, work, "sh", "-c", script, extra=TARGET_FLAGS), work)
    wait_for(lambda: (short_tmp / "pushed").exists(), what="the push to complete")
    shutil.rmtree(remote)  # the remote is unreachable now: nothing can be concluded
    kill9(proc)
    record = wait_for(
        lambda: ((r := effect(daemon)).get("probe") or {}).get("attempts", 0) >= 2 and r,
        timeout=20,
        what="two inconclusive probes",
    )
    assert record["status"] == "uncertain"
    assert record["probe"]["verdict"] == "unknown"
    assert "git ls-remote" in record["probe"]["evidence"]["error"]
    assert record["probe"]["next_at"] > record["probe"]["at"]
    listed = towerctl(daemon, "effects", "list", RUN, check=True)
    assert "unknown (" in listed.stdout
    # A retry is still refused: uncertain waits for evidence or a person.
    retry = spawn(effect_run(daemon, work, "git", "push", "-q", "origin", f"HEAD:{REF}"), work)
    assert retry.wait(30) == 120
    assert daemon.stop() == 0


def test_a_git_push_whose_target_cannot_be_derived_says_so_and_is_not_probeable(
    daemon, repos, short_tmp
):
    work, _remote, _pushes = repos
    # CMD is a push whose destination git alone decides (no refspec): said at once.
    proc = spawn(effect_run(daemon, work, "git", "push", "--dry-run", "-q", "origin"), work)
    proc.wait(30)
    assert "cannot be probed" in (proc.stderr.read() if proc.stderr else "")
    assert effect(daemon)["git"] is None
    # Any other CMD without the target flags: the record says it.
    other = [*effect_run(daemon, work, "sh", "-c", "exit 0")]
    other[other.index(STEP)] = "other-step"
    proc = spawn(other, work)
    assert proc.wait(30) == 0
    assert "cannot be probed" not in (proc.stderr.read() if proc.stderr else "")
    listed = towerctl(daemon, "effects", "list", RUN, check=True).stdout
    assert "not probeable" not in listed  # settled effects need no probe
    assert "PROBE" in listed.splitlines()[0]


def test_a_push_to_a_short_heads_name_is_not_probed_unless_its_ref_is_given(daemon, repos):
    """``HEAD:heads/release`` goes to refs/heads/release if the remote has it, else to
    refs/heads/heads/release (a new branch): probing either one could answer for a push
    that went to the other (it was probed at refs/heads/heads/release, and a crash after
    a push to an existing branch then read as not done, and a retry ran CMD again). So
    it is not probed; ``--ref`` says which."""
    work, _remote, pushes = repos
    proc = spawn(effect_run(daemon, work, "git", "push", "-q", "origin", "HEAD:heads/release"),
                 work)  # fmt: skip
    assert proc.wait(30) == 0
    assert "names one of two refs" in (proc.stderr.read() if proc.stderr else "")
    assert effect(daemon)["git"] is None
    given = effect_run(daemon, work, "git", "push", "-q", "origin", "HEAD:heads/release",
                       extra=("--ref", REF))  # fmt: skip
    given[given.index(STEP)] = "given"
    proc = spawn(given, work)
    assert proc.wait(30) == 0, proc.stderr.read() if proc.stderr else ""
    with daemon.client() as client:
        recorded = client.effect_get(effect_key(RUN, "given", "git-push", REF))
    assert recorded["git"]["ref"] == REF
    # As said: the remote had no release branch, so git made refs/heads/heads/release.
    assert [line.split()[-1] for line in pushes_of(pushes)] == ["refs/heads/heads/release"]


# --- towerctl run --probe -------------------------------------------------------------------


def killed_run(daemon, short_tmp: Path, key: str, probe: str) -> None:
    """``towerctl run --key KEY --probe PROBE`` killed while CMD runs: the key turns
    outcome_unknown."""
    started = short_tmp / f"{key}.started"
    cmd = ["sh", "-c", f"touch {started}; exec sleep 1000"]
    proc = spawn([TOWERCTL, "--socket", str(daemon.socket_path), "run", "--key", key,
                  "--probe", probe, "--", *cmd], short_tmp)  # fmt: skip
    wait_for(started.exists, what="CMD to start")
    kill9(proc)
    with daemon.client() as client:
        wait_for(lambda: client.idem_get("shell", key)["state"] == "outcome_unknown",
                 what="the key to turn outcome_unknown")  # fmt: skip


def settle(daemon) -> dict[str, dict]:
    done = towerctl(daemon, "--json", "effects", "settle", check=True)
    return {o["key"]: o for o in json.loads(done.stdout)["outcomes"] if o.get("key")}


def test_a_run_probe_settles_an_unknown_key_by_its_exit_status(daemon, short_tmp):
    (short_tmp / "verdict").write_text("2\n")
    killed_run(daemon, short_tmp, "happened", 'exit "$(cat verdict)"')
    killed_run(daemon, short_tmp, "did-not", "exit 1")
    outcomes = settle(daemon)
    assert (outcomes["happened"]["verdict"], outcomes["happened"]["status"]) == (
        "unknown", "outcome_unknown")  # fmt: skip
    assert (outcomes["did-not"]["verdict"], outcomes["did-not"]["status"]) == ("aborted", "gone")
    # Exit 1: it did not happen, so the next run runs CMD.
    ran = towerctl(daemon, "run", "--key", "did-not", "--", "sh", "-c", "exit 7", cwd=short_tmp)
    assert ran.returncode == 7
    # Exit 2 left it unknown: a retry is still refused.
    refused = towerctl(daemon, "run", "--key", "happened", "--probe", "x", "--", "sh", "-c",
                       f"touch {short_tmp}/happened.started; exec sleep 1000")  # fmt: skip
    assert refused.returncode == 120
    # towerctl top's panel says the key is probed, with its last verdict (not "a person
    # decides"): from the watch snapshot the dashboard draws.
    from towerd.client.top_view import key_probe_verdict

    with daemon.client() as client:
        snapshot = next(iter(client.watch(["idem"])))
    (key,) = [k for k in snapshot["snapshot"]["idem"]["keys"] if k["key"] == "happened"]
    assert key_probe_verdict(key) == "unknown, 1 try"
    (short_tmp / "verdict").write_text("0\n")
    outcomes = settle(daemon)
    assert (outcomes["happened"]["verdict"], outcomes["happened"]["status"]) == (
        "committed", "completed")  # fmt: skip
    assert outcomes["happened"]["evidence"]["exit_status"] == 0
    # Exit 0: it happened; a retry replays (status 0) without running CMD.
    replay = towerctl(daemon, "run", "--key", "happened", "--", "sh", "-c",
                      f"touch {short_tmp}/happened.started; exec sleep 1000")  # fmt: skip
    assert replay.returncode == 0 and "already ran" in replay.stderr


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_run_probe_waits_for_the_command_and_what_it_started(daemon, short_tmp):
    """Only towerctl is killed (not its process group, as a hook runner's timeout does):
    the command goes on, and the effect is done by a process the command started (a
    script's own step). The key turns outcome_unknown, yet no probe runs while any of
    them runs: it would say "not done", release the key, and a retry would run the
    command beside them (a tester's reproducer ran the effect twice; killing the
    command with towerctl was not enough, its child did the effect). Once they are
    done, the probe says it happened and a retry replays: the effect ran once."""
    runs, gate, probed = short_tmp / "runs", short_tmp / "gate", short_tmp / "probed"
    child_pid = short_tmp / "child.pid"
    effect = (f"echo $$ > {child_pid}; while [ ! -e {gate} ]; do sleep 0.01; done; "
              f"echo ran >> {runs}")  # fmt: skip
    cmd = ["sh", "-c", f"sh -c '{effect}'; echo done"]
    argv = [TOWERCTL, "--socket", str(daemon.socket_path), "run", "--key", "push",
            "--probe", f"touch {probed}; [ -e {runs} ] && grep -q ran {runs}",
            "--", *cmd]  # fmt: skip
    proc = spawn(argv, short_tmp)
    wait_for(lambda: child_pid.exists() and child_pid.read_text().strip(), what="the effect")
    os.kill(proc.pid, signal.SIGKILL)  # towerctl alone
    proc.wait(10)
    with daemon.client() as client:
        wait_for(lambda: client.idem_get("shell", "push")["state"] == "outcome_unknown",
                 what="the key to turn outcome_unknown")  # fmt: skip
        waiting = settle(daemon)["push"]
        assert waiting["verdict"] == "holder_alive", waiting
        assert waiting["evidence"]["command_running"] > 0
        assert not probed.exists(), "probed while the command still ran"
        refused = subprocess.run(argv, cwd=short_tmp, capture_output=True, text=True,
                                 timeout=60)  # fmt: skip
        assert refused.returncode == 120, refused.stderr
        gate.touch()
        wait_for(lambda: settle(daemon) is not None
                 and client.idem_get("shell", "push")["state"] == "completed",
                 what="the probe to settle the key once the command ended")  # fmt: skip
    replay = subprocess.run(argv, cwd=short_tmp, capture_output=True, text=True, timeout=60)
    assert replay.returncode == 0 and "already ran" in replay.stderr, replay.stderr
    assert runs.read_text().splitlines() == ["ran"]


@pytest.mark.parametrize(
    ("argv", "parsed"),
    [
        (["git", "push", "origin", "HEAD:refs/heads/x"], (".", "origin", "HEAD", "refs/heads/x")),
        (
            ["git", "push", "-q", "--force-with-lease", "up", "+main:main"],
            (".", "up", "main", "main"),
        ),
        (["git", "-C", "sub", "push", "origin", "main"], ("./sub", "origin", None, "main")),
        (["git", "push", "-o", "ci.skip", "origin", "a:b"], (".", "origin", "a", "b")),
        (["git", "push"], (".", None, None, None)),
        (["/usr/bin/git", "push", "origin"], (".", "origin", None, None)),
        (["git", "fetch", "origin"], None),
        (["sh", "-c", "git push origin x"], None),
    ],
)
def test_the_git_push_form_effect_run_derives_its_target_from(argv, parsed):
    assert parse_git_push(argv) == parsed


@pytest.mark.parametrize(
    "argv", [["git", "push", "origin", ":gone"], ["git", "push", "origin", "a", "b"]]
)
def test_a_deletion_or_several_refspecs_cannot_be_probed(argv):
    with pytest.raises(NotProbeable):
        parse_git_push(argv)


def test_effect_run_derives_a_bare_branch_push_and_a_relative_remote_path(daemon, repos):
    """``git push ../remote.git main``: the URL is made absolute (the probe runs elsewhere),
    the ref is refs/heads/main, the commit is main's."""
    work, remote, pushes = repos
    proc = spawn(effect_run(daemon, work, "git", "push", "-q", "../remote.git", "main"), work)
    assert proc.wait(30) == 0, proc.stderr.read() if proc.stderr else ""
    record = effect(daemon)
    assert record["git"] == {"repo": str(work), "remote_url": str(remote),
                             "commit": git(work, "rev-parse", "main"),
                             "ref": "refs/heads/main"}  # fmt: skip
    assert len(pushes_of(pushes)) == 1


SPAWNER = """
import signal, sys
from towerd.client import Client
with Client(sys.argv[1]) as client:
    client.idem_claim("session.spawn", "spawn-1", effect_ref=sys.argv[2])
    print("claimed", flush=True)
    signal.pause()
"""


def test_a_spawn_whose_agent_process_appears_later_is_settled_without_a_restart(daemon):
    """The spawner dies before registering the row: outcome_unknown. Once an agent
    process carrying the session's id runs, the probes (here `effects settle`) complete
    the key from it."""
    import sys
    import uuid

    session_id = str(uuid.uuid4())
    spawner = subprocess.Popen([sys.executable, "-c", SPAWNER, str(daemon.socket_path),
                                session_id], stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert spawner.stdout is not None and spawner.stdout.readline().strip() == "claimed"
    spawner.kill()
    spawner.wait(10)
    with daemon.client() as client:
        wait_for(lambda: client.idem_get("session.spawn", "spawn-1")["state"] == "outcome_unknown",
                 what="the dead spawner's key to turn unknown")  # fmt: skip
        towerctl(daemon, "effects", "settle", check=True)
        assert client.idem_get("session.spawn", "spawn-1")["state"] == "outcome_unknown"
        env = {**os.environ, "TOWERD_SESSION_ID": session_id}
        agent = subprocess.Popen(["sleep", "1000"], env=env)
        try:
            towerctl(daemon, "effects", "settle", check=True)
            record = client.idem_get("session.spawn", "spawn-1")
        finally:
            agent.kill()
            agent.wait()
    assert record["state"] == "completed"
    assert record["result"]["agent_pid"] == agent.pid


def test_top_and_effects_list_say_what_a_probe_found_and_what_waits_for_a_person():
    from towerd.client.cli.effects import probe_column
    from towerd.client.top_view import PERSON, probe_verdict

    webhook = {"action_kind": "webhook", "status": "uncertain", "git": None, "probe": None}
    untargeted = {**webhook, "action_kind": "git-push"}
    target = {"repo": "/r", "remote_url": "/u", "commit": "0" * 40, "ref": REF}
    due = {**untargeted, "git": target}
    tried = {**due, "probe": {"verdict": "unknown", "attempts": 3, "at": 1, "next_at": 2}}
    assert probe_verdict(webhook) == probe_verdict(untargeted) == PERSON
    assert probe_verdict(due) == "probe due"
    assert probe_verdict(tried) == "unknown, 3 tries"
    assert probe_column(webhook) == "a person decides"
    assert probe_column(untargeted) == "not probeable: a person decides"
    assert probe_column(tried) == "unknown (3x), retried"
