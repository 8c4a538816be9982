"""Evidence probes at the store and the probe itself: the verdict write settles only what
is still the unsettled effect (or key) that was probed, never one a person resolved, a
new attempt took, or whose holder lives; an inconclusive probe only counts and backs
off. The git probe runs real git against a real bare repository.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from store_helpers import DEAD, LIVE, at, caller, opened, query
from towerd.daemon import probes
from towerd.daemon.store import Store, effects, idempotency, liveness
from towerd.protocol import naming
from towerd.protocol.methods import (
    EffectClaimParams,
    EffectKeyParams,
    EffectRecord,
    EffectResolveParams,
    EffectSettleParams,
    GitPushTarget,
    IdemClaimParams,
    IdemKeyParams,
    IdemResolveParams,
)

pytestmark = pytest.mark.anyio

ME = "alice"
REF = "refs/heads/shared"
COMMIT = "1" * 40
TARGET = GitPushTarget(repo="/nonexistent/repo", remote_url="/nonexistent/remote.git",
                       commit=COMMIT, ref=REF)  # fmt: skip
BASE_MS = 1000


def push_params(attempt: str = "a-1", git: GitPushTarget | None = TARGET) -> EffectClaimParams:
    return EffectClaimParams(run_id="run_1", step_id="push", attempt_id=attempt,
                             action_kind="git-push", target_ref=REF, lease_ttl_ms=60_000,
                             git=git)  # fmt: skip


KEY = naming.effect_key("run_1", "push", "git-push", REF)


async def record(store: Store) -> EffectRecord:
    return await store.read(effects.get, caller(ME), EffectKeyParams(KEY))


async def uncertain(store: Store, git: GitPushTarget | None = TARGET) -> None:
    """A git-push whose holder died mid-push: claimed, then parked by the sweep."""
    await store.write(effects.claim, caller(ME, DEAD), push_params(git=git))
    report = await store.write(liveness.settle, [DEAD])
    assert report.effects_parked == [KEY]


async def to_probe(store: Store, due_only: bool = False, *keys: str) -> list[effects.ToProbe]:
    return await store.read(effects.to_probe, caller(), EffectSettleParams(list(keys)), due_only)


def operator_log(root: Path) -> list[tuple[str, str, dict[str, Any]]]:
    rows = query(root, "SELECT principal, action, detail FROM operator_log ORDER BY at")
    return [(principal, action, json.loads(detail)) for principal, action, detail in rows]


async def test_a_committed_verdict_settles_with_its_evidence_in_the_receipt_and_the_log(
    short_tmp: Path,
) -> None:
    async with opened(short_tmp) as store:
        await uncertain(store)
        [item] = await to_probe(store)
        assert (item.verdict, item.git) == (None, TARGET)
        seen = {"seen": "the remote ref is at the commit"}
        outcome = await store.write(effects.record_probe, item, "committed", seen, BASE_MS)
        assert (outcome.verdict, outcome.status) == ("committed", "committed")
        stored = await record(store)
        assert stored.status == "committed"
        assert stored.receipt == {"settled_by": "evidence probe", "evidence": seen}
        assert stored.probe is not None and stored.probe.verdict == "committed"
        assert stored.git == TARGET
        assert await to_probe(store, True) == []  # nothing left to probe
    [(principal, action, detail)] = operator_log(short_tmp)
    assert (principal, action) == ("towerd:probe", "effect.probe")
    assert detail["outcome"] == "committed" and detail["evidence"] == seen
    assert detail["was"] == "uncertain"


async def test_a_verdict_never_overwrites_a_resolve_made_while_the_probe_ran(
    short_tmp: Path,
) -> None:
    async with opened(short_tmp) as store:
        await uncertain(store)
        [item] = await to_probe(store)
        await store.write(
            effects.resolve, caller(ME), EffectResolveParams(KEY, "aborted", {"by": "me"})
        )
        outcome = await store.write(effects.record_probe, item, "committed", {}, BASE_MS)
        assert (outcome.verdict, outcome.status) == ("not_unsettled", "aborted")
        assert (await record(store)).receipt == {"by": "me"}
        # A new attempt re-armed it meanwhile: the old probe's verdict is not its verdict.
        await store.write(effects.claim, caller(ME, DEAD), push_params("a-2"))
        await store.write(liveness.settle, [DEAD])
        assert (await record(store)).status == "uncertain"
        outcome = await store.write(effects.record_probe, item, "aborted", {}, BASE_MS)
        assert outcome.verdict == "not_unsettled"
        assert (await record(store)).status == "uncertain"
    assert [action for _, action, _ in operator_log(short_tmp)] == ["effect.resolve"]


async def test_an_effect_whose_holder_lives_is_never_probed_nor_settled(short_tmp: Path) -> None:
    async with opened(short_tmp) as store:
        await store.write(effects.claim, caller(ME, LIVE), push_params())
        [item] = await to_probe(store)
        assert item.verdict == "holder_alive"
        assert await to_probe(store, True) == []
        # Parked for silence while its process still runs (a push that hangs): not probed.
        parked = await store.write(at(400_000, effects.park_stale))
        assert parked == [KEY]
        [item] = await to_probe(store)
        assert (item.status, item.verdict) == ("uncertain", "holder_alive")
        forced = effects.ToProbe(KEY, "a-1", "uncertain", TARGET, None)
        outcome = await store.write(effects.record_probe, forced, "aborted", {}, BASE_MS)
        assert (outcome.verdict, outcome.status) == ("holder_alive", "uncertain")
        assert (await record(store)).status == "uncertain"


async def test_cannot_tell_counts_the_attempt_and_backs_off(short_tmp: Path) -> None:
    async with opened(short_tmp) as store:
        await uncertain(store)
        delays = []
        for attempt in (1, 2, 3):
            [item] = await to_probe(store, True)
            outcome = await store.write(
                effects.record_probe, item, "unknown", {"error": "unreachable"}, BASE_MS
            )
            assert (outcome.verdict, outcome.status) == ("unknown", "uncertain")
            stored = await record(store)
            assert stored.probe is not None and stored.probe.attempts == attempt
            assert stored.probe.next_at is not None
            delays.append(stored.probe.next_at - stored.probe.at)
            assert await to_probe(store, True) == []  # not due again yet
            # Due once the delay has passed (the clock moved by the delay).
            due = await store.read(
                at(delays[-1], effects.to_probe), caller(), EffectSettleParams(), True
            )
            assert [d.effect_key for d in due] == [KEY]
            await store.write(
                lambda tx, then=stored.probe.at: tx.conn.execute(
                    "UPDATE effects SET probe_next_at = ? WHERE effect_key = ?", (then, KEY)
                )
            )
        assert delays == [1000, 2000, 4000]
        assert (await record(store)).status == "uncertain"
    assert operator_log(short_tmp) == []  # only verdicts that settle are the operator's news


async def test_an_effect_without_a_target_is_not_probeable_and_waits_for_a_person(
    short_tmp: Path,
) -> None:
    async with opened(short_tmp) as store:
        await uncertain(store, git=None)
        [item] = await to_probe(store)
        assert (item.verdict, item.status) == ("not_probeable", "uncertain")
        assert await to_probe(store, True) == []


async def test_a_git_target_is_for_git_push_only() -> None:
    with pytest.raises(ValueError, match="git-push"):
        EffectClaimParams("r", "s", "a", "webhook", "https://x", git=TARGET)


# --- keys with a probe command ----------------------------------------------------------------


async def unknown_key(store: Store, key: str = "k", probe: str | None = "true") -> None:
    params = IdemClaimParams("shell", key, payload=["cmd"], probe=probe,
                             probe_cwd="/" if probe else None)  # fmt: skip
    await store.write(idempotency.claim, caller(ME, DEAD), params)
    await store.write(liveness.settle, [DEAD])
    state = await store.read(idempotency.get, caller(ME), IdemKeyParams("shell", key))
    assert state.state == "outcome_unknown"


async def test_a_key_probe_completes_releases_or_leaves_the_key(short_tmp: Path) -> None:
    async with opened(short_tmp) as store:
        for key in ("ran", "not-ran", "cannot-tell"):
            await unknown_key(store, key)
        await unknown_key(store, "no-probe", probe=None)
        found = {k.key: k for k in await store.read(idempotency.keys_to_probe, True)}
        assert set(found) == {"ran", "not-ran", "cannot-tell"}
        assert found["ran"].probe == "true" and found["ran"].cwd == "/"
        for key, verdict in (("ran", "committed"), ("not-ran", "aborted"),
                             ("cannot-tell", "unknown")):  # fmt: skip
            await store.write(idempotency.record_key_probe, found[key], verdict,
                              {"exit_status": 0}, BASE_MS)  # fmt: skip
        ran = await store.read(idempotency.get, caller(ME), IdemKeyParams("shell", "ran"))
        assert ran.state == "completed"
        assert ran.result == {"settled_by": "evidence probe", "probe": "true",
                              "evidence": {"exit_status": 0}}  # fmt: skip
        states = dict(query_states(short_tmp))  # "not-ran" was released
        assert states == {"ran": "completed", "cannot-tell": "outcome_unknown",
                          "no-probe": "outcome_unknown"}  # fmt: skip
        assert [k.key for k in await store.read(idempotency.keys_to_probe, True)] == []
        assert [k.key for k in await store.read(idempotency.keys_to_probe, False)] == [
            "cannot-tell"
        ]
    logged = [(d["key"], d["outcome"]) for _, action, d in operator_log(short_tmp)
              if action == "idem.probe"]  # fmt: skip
    assert logged == [("ran", "completed"), ("not-ran", "abandoned")]


def query_states(root: Path) -> list[tuple[str, str]]:
    return [(k, s) for k, s in query(root, "SELECT key, state FROM idempotency ORDER BY rowid")]


async def test_a_key_probe_verdict_loses_to_a_person_and_to_a_live_holder(short_tmp: Path) -> None:
    async with opened(short_tmp) as store:
        await unknown_key(store, "k")
        [found] = await store.read(idempotency.keys_to_probe, False)
        await store.write(idempotency.resolve, caller(ME),
                          IdemResolveParams("shell", "k", "completed", {"by": "me"}))  # fmt: skip
        outcome = await store.write(idempotency.record_key_probe, found, "aborted", {}, BASE_MS)
        assert (outcome.verdict, outcome.status) == ("not_unsettled", "completed")
        # A key whose holder lives (it survived a daemon restart) is left to its holder.
        params = IdemClaimParams("shell", "live", payload=["cmd"], probe="true")
        await store.write(idempotency.claim, caller(ME, LIVE), params)
        await store.write(idempotency.mark_unknown, caller(ME), IdemKeyParams("shell", "live"))
        assert await store.read(idempotency.keys_to_probe, False) == []


# --- the git probe, against a real bare repository ----------------------------------------------


def git(cwd: Path, *args: str) -> str:
    done = subprocess.run(["git", "-C", str(cwd), *args], capture_output=True, text=True,
                          check=True)  # fmt: skip
    return done.stdout.strip()


@pytest.fixture
def repos(short_tmp: Path) -> tuple[Path, Path]:
    remote, work = short_tmp / "remote.git", short_tmp / "work"
    subprocess.run(["git", "init", "-q", "--bare", str(remote)], check=True)
    subprocess.run(["git", "init", "-q", "-b", "main", str(work)], check=True)
    git(work, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty",
        "-m", "one")  # fmt: skip
    git(work, "remote", "add", "origin", str(remote))
    return remote, work


def target(work: Path, remote: Path, commit: str, ref: str = REF) -> GitPushTarget:
    return GitPushTarget(repo=str(work), remote_url=str(remote), commit=commit, ref=ref)


def test_the_git_probe_reads_the_remote(repos: tuple[Path, Path], short_tmp: Path) -> None:
    remote, work = repos
    one = git(work, "rev-parse", "HEAD")
    verdict, evidence = probes.probe_git_push(target(work, remote, one), 10)
    assert (verdict, evidence["remote_tip"]) == ("aborted", None)  # no such ref: not pushed
    git(work, "push", "-q", "origin", f"HEAD:{REF}")
    assert probes.probe_git_push(target(work, remote, one), 10)[0] == "committed"
    # Another clone pushes a descendant: the commit is in the ref's history (fetched).
    other = short_tmp / "other"
    subprocess.run(["git", "clone", "-q", str(remote), str(other)], check=True)
    git(other, "checkout", "-q", "-b", "x", f"origin/{REF.removeprefix('refs/heads/')}")
    git(other, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty",
        "-m", "two")  # fmt: skip
    git(other, "push", "-q", "origin", f"HEAD:{REF}")
    verdict, evidence = probes.probe_git_push(target(work, remote, one), 10)
    assert (verdict, evidence.get("fetched")) == ("committed", True)
    # A commit the remote ref does not contain: it did not happen.
    git(work, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty",
        "-m", "local only")  # fmt: skip
    local = git(work, "rev-parse", "HEAD")
    assert probes.probe_git_push(target(work, remote, local), 10)[0] == "aborted"


def test_the_git_probe_cannot_tell_without_the_remote_or_the_repository(
    repos: tuple[Path, Path], short_tmp: Path
) -> None:
    remote, work = repos
    one = git(work, "rev-parse", "HEAD")
    gone = short_tmp / "gone.git"
    verdict, evidence = probes.probe_git_push(target(work, gone, one), 10)
    assert verdict == "unknown" and "git ls-remote" in evidence["error"]
    # The ref is elsewhere and the repository that could decide ancestry is gone.
    git(work, "push", "-q", "origin", f"HEAD:{REF}")
    missing = GitPushTarget(repo=str(short_tmp / "nowhere"), remote_url=str(remote),
                            commit="2" * 40, ref=REF)  # fmt: skip
    assert probes.probe_git_push(missing, 10)[0] == "unknown"
    # The recorded commit is not in the repository: an error, not absence.
    assert probes.probe_git_push(target(work, remote, "3" * 40), 10)[0] == "unknown"


def test_a_stray_git_environment_does_not_mislead_the_probe(
    repos: tuple[Path, Path], short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ancestry check runs in the recorded repository, not wherever GIT_DIR says."""
    remote, work = repos
    one = git(work, "rev-parse", "HEAD")
    git(work, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty",
        "-m", "two")  # fmt: skip
    git(work, "push", "-q", "origin", f"HEAD:{REF}")
    monkeypatch.setenv("GIT_DIR", str(short_tmp / "not-a-repo"))
    monkeypatch.setenv("GIT_WORK_TREE", str(short_tmp))
    assert probes.probe_git_push(target(work, remote, one), 10)[0] == "committed"


def test_a_probe_command_s_exit_status_is_its_verdict(short_tmp: Path) -> None:
    assert probes.probe_command("exit 0", str(short_tmp), 10)[0] == "committed"
    assert probes.probe_command("exit 1", str(short_tmp), 10)[0] == "aborted"
    assert probes.probe_command("exit 2", str(short_tmp), 10)[0] == "unknown"
    verdict, evidence = probes.probe_command("sleep 30", str(short_tmp), 0.2)
    assert verdict == "unknown" and "timed out" in evidence["error"]
    assert probes.probe_command("exit 0", str(short_tmp / "gone"), 10)[0] == "unknown"
    verdict, evidence = probes.probe_command("pwd", str(short_tmp), 10)
    assert evidence["stdout"].strip() == str(short_tmp)


# --- session.spawn: a live agent process carrying the session's id ----------------------------


async def test_a_spawn_key_completes_from_a_live_process_carrying_the_session_id(
    short_tmp: Path,
) -> None:
    """No fleet row yet, but an agent process runs with TOWERD_SESSION_ID (or the id as
    an argument): the spawn happened. Without such a process the key stays unknown."""
    import os
    import signal
    import uuid

    found, missing, by_argument = (str(uuid.uuid4()) for _ in range(3))
    env = {**os.environ, "TOWERD_SESSION_ID": found}
    agents = [
        subprocess.Popen(["sleep", "1000"], env=env, start_new_session=True),
        subprocess.Popen(
            ["sh", "-c", "sleep 1000; :", "agent", f"--session-id={by_argument}"],
            start_new_session=True,
        ),  # fmt: skip
    ]
    try:
        async with opened(short_tmp) as store:
            for key, ref in (("a", found), ("b", missing), ("c", by_argument)):
                params = IdemClaimParams("session.spawn", key, effect_ref=ref)
                await store.write(idempotency.claim, caller(ME, DEAD), params)
            report = await store.write(liveness.settle, [DEAD])
            assert sorted(k for _, _, k in report.keys_completed) == ["a", "c"]
            assert [k for _, _, k in report.keys_unknown] == ["b"]
            record = await store.read(idempotency.get, caller(ME),
                                      IdemKeyParams("session.spawn", "a"))  # fmt: skip
            evidence = "a live process carries the session id"
            assert record.result == {"session_id": found, "agent_pid": agents[0].pid,
                                     "evidence": evidence}  # fmt: skip
    finally:
        for agent in agents:
            os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()
