"""Fenced leases and the external-effects ledger, through a real daemon.

Two principals on one daemon stand for two boxes sharing a target ("box A" and
"box B"): each has its own holder identity, so a lease one holds refuses the other.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading

import pytest

from towerd.client import (
    EffectAlreadyCommitted,
    EffectAttemptSuperseded,
    EffectInFlight,
    EffectLeaseHeld,
    EffectLeaseSuperseded,
    EffectUncertain,
    LeaseExpired,
    LeaseHeld,
    LeaseNotFound,
    LeaseSuperseded,
    Unavailable,
)
from towerd.protocol.naming import effect_key
from towerd_testing import start_crashing_at, wait_for

pytestmark = pytest.mark.both_backends

PR = "github.com/acme/app#pull/feature-x"


def test_two_boxes_contend_for_one_shared_effect(daemon):
    """A gets token t; B is refused effect_lease_held and leaves no row; A's lease lapses;
    A's own renewal is then lease_expired; B takes over with a token > t; A's late commit
    is refused and parks uncertain (persisted); B commits."""
    with daemon.client(principal="box-a") as a, daemon.client(principal="box-b") as b:
        claim_a = a.effect_claim("run_a", "open-pr", "a-1", "pr-create", PR, lease_ttl_ms=5000)
        token_a = claim_a["fencing_token"]
        assert claim_a["lease_resource"] == PR and token_a >= 1

        key_b = effect_key("run_b", "open-pr", "pr-create", PR)
        with pytest.raises(EffectLeaseHeld) as held:
            b.effect_claim("run_b", "open-pr", "b-1", "pr-create", PR)
        assert held.value.data["lease"]["fencing_token"] == token_a
        assert b.effect_list("run_b")["effects"] == []
        with pytest.raises(Exception) as missing:
            b.effect_get(key_b)
        assert missing.value.code == "effect_not_found"

        wait_for(lambda: not b.lease_get(PR)["live"], timeout=15, what="A's lease to lapse")
        with pytest.raises(LeaseExpired):
            a.lease_renew(PR, token_a)

        claim_b = b.effect_claim("run_b", "open-pr", "b-1", "pr-create", PR)
        assert claim_b["fencing_token"] > token_a

        with pytest.raises(EffectLeaseSuperseded):
            a.effect_commit(claim_a["effect_key"], "a-1", {"url": "https://pr/1"})
        assert a.effect_get(claim_a["effect_key"])["status"] == "uncertain"

        done = b.effect_commit(claim_b["effect_key"], "b-1", {"url": "https://pr/2"})
        assert done["status"] == "committed" and done["receipt"] == {"url": "https://pr/2"}
        assert b.lease_list()["leases"] == []  # commit gave the lease back

        with pytest.raises(EffectUncertain):
            a.effect_claim("run_a", "open-pr", "a-2", "pr-create", PR)
        resolved = a.effect_resolve(claim_a["effect_key"], "aborted")
        assert resolved["status"] == "aborted"


def test_commit_after_a_lapse_nobody_took_over_is_still_fenced_correctly(daemon):
    """A token that is still the newest for its target commits, even though its lease
    deadline passed: nobody else can have written."""
    with daemon.client(principal="box-a") as a:
        claim = a.effect_claim("run_a", "hook", "a-1", "webhook", "https://hooks/x",
                               lease_ttl_ms=5000)  # fmt: skip
        wait_for(lambda: not a.lease_get("https://hooks/x")["live"], timeout=15, what="lapse")
        done = a.effect_commit(claim["effect_key"], "a-1", {"status": 200})
        assert done["status"] == "committed"


def test_tokens_only_grow_across_release_restart_and_a_crash_before_the_reply(make_daemon):
    """Tokens per resource are never reused: not after a release, not after a restart,
    not when the daemon dies after granting one but before answering."""
    daemon = make_daemon().start()
    issued = []
    with daemon.client() as client:
        for _ in range(3):
            lease = client.lease_acquire("repo/main")
            issued.append(lease["fencing_token"])
            client.lease_release("repo/main", lease["fencing_token"])
    daemon.kill9()
    start_crashing_at(daemon, "batch.after_commit")
    with daemon.client() as client, pytest.raises(Unavailable):
        client.lease_acquire("repo/main")  # granted and committed; the reply never left
    assert daemon.proc.wait(20) == -signal.SIGKILL
    daemon.start()
    with daemon.client() as client:
        kept = client.lease_acquire("repo/main")  # the grant whose answer was lost stands
        assert kept["renewed"] is True and kept["fencing_token"] > max(issued)
        client.lease_release("repo/main", kept["fencing_token"])
        after = client.lease_acquire("repo/main")["fencing_token"]
    assert issued == sorted(set(issued)) and after > kept["fencing_token"]
    assert daemon.stop() == 0


def test_lease_refusals(daemon):
    with daemon.client(principal="box-a") as a, daemon.client(principal="box-b") as b:
        with pytest.raises(LeaseNotFound):
            a.lease_renew("nothing", 1)
        lease = a.lease_acquire("res", ttl_ms=60_000)
        again = a.lease_acquire("res", ttl_ms=120_000)
        assert again["renewed"] is True and again["fencing_token"] == lease["fencing_token"]
        assert again["expires_at"] > lease["expires_at"]
        with pytest.raises(LeaseHeld) as held:
            b.lease_acquire("res")
        assert held.value.data["lease"]["holder"].startswith("uid:")
        with pytest.raises(LeaseSuperseded):
            b.lease_release("res", lease["fencing_token"])  # not B's lease
        with pytest.raises(LeaseSuperseded):
            a.lease_renew("res", lease["fencing_token"] + 7)  # not A's token
        with pytest.raises(Exception) as bad:
            a.lease_acquire("res", ttl_ms=4999)
        assert bad.value.code == "bad_args"
        assert a.lease_release("res", lease["fencing_token"])["released"] is True
        assert b.lease_acquire("res")["fencing_token"] == lease["fencing_token"] + 1


HOLDER = textwrap.dedent(
    """
    import signal, sys
    from towerd.client import Client
    with Client(sys.argv[1]) as client:
        lease = client.lease_acquire("shared/target", ttl_ms=600000)
        print(lease["fencing_token"], flush=True)
        signal.pause()
    """
)


def test_a_dead_holders_lease_frees_the_resource_at_once(daemon):
    """A holder killed mid-lease (10-minute TTL) frees the resource within seconds."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(daemon.socket_path)], stdout=subprocess.PIPE, text=True
    )
    token = int(holder.stdout.readline())
    with daemon.client() as client:
        with pytest.raises(LeaseHeld):
            client.lease_acquire("shared/target")
        holder.kill()
        holder.wait(10)

        def acquired() -> int | None:
            try:
                return client.lease_acquire("shared/target")["fencing_token"]
            except LeaseHeld:
                return None

        assert wait_for(acquired, timeout=10, what="the dead holder's lease to go") > token


def test_concurrent_claims_of_one_effect_exactly_one_wins(daemon):
    results = []

    def claim(n: int) -> None:
        with daemon.client(principal=f"worker-{n}") as client:
            try:
                results.append(
                    client.effect_claim(
                        "run_1", "push", f"attempt-{n}", "git-push", "refs/heads/main"
                    )
                )
            except (EffectInFlight, EffectLeaseHeld) as exc:
                results.append(exc.code)

    threads = [threading.Thread(target=claim, args=(n,)) for n in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    winners = [r for r in results if isinstance(r, dict)]
    assert len(results) == 20 and len(winners) == 1
    assert all(r in ("effect_in_flight", "effect_lease_held") for r in results if r not in winners)


def test_effect_lifecycle_and_guards(daemon):
    """Claim -> heartbeat -> commit; retries of the same call are answered, a stale
    attempt changes nothing, and a committed effect is never claimed again."""
    with daemon.client() as client:
        claim = client.effect_claim("run_7", "branch", "att-1", "git-branch", "kxm/run-7")
        assert claim["lease_resource"] is None  # local: no lease
        again = client.effect_claim("run_7", "branch", "att-1", "git-branch", "kxm/run-7")
        assert again["effect_key"] == claim["effect_key"]  # a lost answer, repeated
        with pytest.raises(EffectInFlight):
            client.effect_claim("run_7", "branch", "att-2", "git-branch", "kxm/run-7")
        beat = client.effect_heartbeat(claim["effect_key"], "att-1")
        assert beat["status"] == "in_flight"
        with pytest.raises(EffectAttemptSuperseded):
            client.effect_abort(claim["effect_key"], "att-9", "not mine")
        done = client.effect_commit(claim["effect_key"], "att-1", {"sha": "abc"})
        assert client.effect_commit(claim["effect_key"], "att-1", {"sha": "abc"}) == done
        with pytest.raises(EffectAlreadyCommitted) as committed:
            client.effect_claim("run_7", "branch", "att-3", "git-branch", "kxm/run-7")
        assert committed.value.data["effect"]["receipt"] == {"sha": "abc"}
        own_push = client.effect_claim("run_7", "push", "att-1", "git-push", "kxm/run-7-fix")
        assert own_push["lease_resource"] is None  # a push to the run's own branch
        aborted = client.effect_abort(own_push["effect_key"], "att-1", "nothing pushed")
        assert aborted["status"] == "aborted"
        rearmed = client.effect_claim("run_7", "push", "att-2", "git-push", "kxm/run-7-fix")
        assert rearmed["attempt_id"] == "att-2"
        listed = [e["effect_key"] for e in client.effect_list("run_7")["effects"]]
        assert listed == [claim["effect_key"], own_push["effect_key"]]


CLAIMANT = textwrap.dedent(
    """
    import signal, sys
    from towerd.client import Client
    with Client(sys.argv[1]) as client:
        client.effect_claim("run_9", sys.argv[2], "a-1", sys.argv[3], sys.argv[4])
        print("claimed", flush=True)
        signal.pause()
    """
)


def test_a_dead_claimants_shared_effect_parks_and_a_local_one_can_be_taken_over(daemon):
    def claimant(step: str, kind: str, target: str) -> None:
        proc = subprocess.Popen(
            [sys.executable, "-c", CLAIMANT, str(daemon.socket_path), step, kind, target],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout.readline().strip() == "claimed"
        proc.kill()
        proc.wait(10)

    claimant("issue", "tracker-issue", "JIRA-1")
    claimant("commit", "git-commit", "kxm/run-9")
    shared = effect_key("run_9", "issue", "tracker-issue", "JIRA-1")
    with daemon.client() as client:
        wait_for(lambda: client.effect_get(shared)["status"] == "uncertain", timeout=10,
                 what="the dead claimant's shared effect to park")  # fmt: skip
        with pytest.raises(EffectUncertain):
            client.effect_claim("run_9", "issue", "a-2", "tracker-issue", "JIRA-1")
        taken = client.effect_claim("run_9", "commit", "a-2", "git-commit", "kxm/run-9")
        assert taken["attempt_id"] == "a-2"


def test_idempotency_key_fronting_an_effect_completes_from_it_at_restart(daemon):
    """An idempotency key whose effect_ref is an effect key completes at the next start
    when that effect is committed (its claimant died before idem.complete)."""
    with daemon.client() as client:
        claim = client.effect_claim("run_5", "push", "a-1", "git-push", "refs/heads/release")
        client.idem_claim("deploy", "release-5", effect_ref=claim["effect_key"])
        client.effect_commit(claim["effect_key"], "a-1", {"sha": "f00"})
    daemon.kill9()
    daemon.start()
    with daemon.client() as client:
        record = client.idem_get("deploy", "release-5")
        assert record["state"] == "completed"
        assert record["result"] == {"effect_key": claim["effect_key"], "receipt": {"sha": "f00"}}
