"""The work-dispatch ledger under real races, through a real daemon.

Every worker here is a separate Python process (a "puppet" run with ``sys.executable
-c``): the daemon identifies a worker by its process, so only separate processes are
separate workers, and only a real process can be SIGKILLed mid-dispatch. The test
drives each puppet over its stdin/stdout, one JSON line per call; a daemon error
comes back as its code and is raised here as the same exception class.
"""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from towerd.client import (
    AlreadyActive,
    AttemptsExhausted,
    Conflict,
    LeaseNotFound,
    NotBefore,
    StaleLease,
    TowerdError,
    Unavailable,
)
from towerd.protocol.errors import error_for_code
from towerd_testing import Daemon, start_crashing_at, wait_for

pytestmark = pytest.mark.both_backends

TAKEOVER = "stale-dispatch-lease-takeover"
REPLY_TIMEOUT = 15.0

PUPPET = textwrap.dedent(
    """
    import json, os, sys, threading, time
    from towerd.client import Client, TowerdError

    socket_path = sys.argv[1]
    client = Client(socket_path)


    def heartbeat_every(worker_id, interval):
        with Client(socket_path) as beats:
            while True:
                beats.worker_heartbeat(worker_id)
                time.sleep(interval)  # pacing, not synchronisation


    def answer(message):
        sys.stdout.write(json.dumps(message) + "\\n")
        sys.stdout.flush()


    for line in sys.stdin:
        command = json.loads(line)
        op = command["op"]
        try:
            if op == "exit":
                break
            if op == "reconnect":
                client.connect()
                answer({"ok": None})
                continue
            if op == "heartbeat_every":
                threading.Thread(
                    target=heartbeat_every, args=(command["worker_id"], command["interval"]),
                    daemon=True,
                ).start()
                answer({"ok": None})
                continue
            barrier = command.get("barrier")
            if barrier:
                answer({"waiting": True})
                deadline = time.monotonic() + 20
                while not os.path.exists(barrier):
                    if time.monotonic() > deadline:
                        raise SystemExit("the start barrier never appeared")
                    time.sleep(0.001)
            method = getattr(client, command["method"])
            answer({"ok": method(*command["args"], **command["kwargs"])})
        except TowerdError as exc:
            answer({"error": exc.code, "message": exc.message, "data": exc.data})
    """
)


class Puppet:
    """A worker process; ``call`` runs one client call in it and returns its result."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.proc = subprocess.Popen(
            [sys.executable, "-c", PUPPET, str(daemon.socket_path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.worker_id = ""

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def send(self, **command: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()

    def reply(self, timeout: float = REPLY_TIMEOUT) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"worker pid {self.pid}: no answer within {timeout}s") from None
        if line is None:
            raise AssertionError(f"worker pid {self.pid} exited (rc {self.proc.wait(5)})")
        return json.loads(line)

    @staticmethod
    def outcome(answer: dict[str, Any]) -> Any:
        if "error" in answer:
            raise error_for_code(answer["error"], answer["message"], answer["data"])
        return answer["ok"]

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        self.send(op="call", method=method, args=args, kwargs=kwargs)
        return self.outcome(self.reply())

    def call_at_barrier(self, barrier: Path, method: str, *args: Any, **kwargs: Any) -> None:
        """Send a call that waits for ``barrier`` to exist; returns once the puppet waits."""
        self.send(op="call", method=method, args=args, kwargs=kwargs, barrier=str(barrier))
        assert self.reply() == {"waiting": True}

    # --- the worker's steps --------------------------------------------------------------------

    def register(self, root: str = "/srv/project") -> str:
        registered = self.call("worker_register", root, version="test")
        assert registered["existing"] is False
        self.worker_id = registered["worker_id"]
        return self.worker_id

    def acquire(self, resource: str, ttl_ms: int = 600_000) -> int:
        return self.call("lease_acquire", resource, ttl_ms=ttl_ms)["fencing_token"]

    def claim(self, resource: str, token: int, unit_id: str, **kwargs: Any) -> dict[str, Any]:
        return self.call(
            "dispatch_claim", self.worker_id, resource, token, "task", unit_id, "M1",
            f"trace-{unit_id}", **kwargs,
        )  # fmt: skip

    def reconnect(self) -> None:
        self.send(op="reconnect")
        self.outcome(self.reply())

    def exit(self) -> int:
        self.send(op="exit")
        return self.proc.wait(10)

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()


@pytest.fixture
def spawn(make_daemon: Callable[..., Daemon]) -> Iterator[Callable[[Daemon], Puppet]]:
    """Start worker processes on a daemon; all are killed before the daemons stop."""
    puppets: list[Puppet] = []

    def start(daemon: Daemon) -> Puppet:
        puppet = Puppet(daemon)
        puppets.append(puppet)
        return puppet

    yield start
    for puppet in puppets:
        puppet.close()


def raises(
    kind: type[TowerdError], call: Callable[..., Any], *args: Any, **kwargs: Any
) -> TowerdError:
    """``call(*args, **kwargs)`` must fail with exactly ``kind`` (its code, not a
    subclass's); returns the error."""
    with pytest.raises(TowerdError) as caught:
        call(*args, **kwargs)
    assert type(caught.value) is kind, repr(caught.value)
    assert caught.value.code == kind.code
    return caught.value


def unit_rows(client: Any, unit_id: str) -> list[dict[str, Any]]:
    return client.dispatch_list(unit_type="task", unit_id=unit_id)["dispatches"]


def active(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [row for row in rows if row["status"] in ("claimed", "running")]


def events(client: Any, **filters: Any) -> list[dict[str, Any]]:
    """Every matching audit event, oldest first (all pages)."""
    found: list[dict[str, Any]] = []
    before = None
    while True:
        page = client.audit_list(before=before, limit=500, **filters)
        found += page["events"]
        before = page.get("next_before")
        if before is None:
            return found[::-1]


def worker_record(client: Any, worker_id: str) -> dict[str, Any]:
    (record,) = [w for w in client.worker_list()["workers"] if w["worker_id"] == worker_id]
    return record


# --- 1. many workers race for one unit --------------------------------------------------------


def test_eight_worker_processes_claim_one_unit_at_once_exactly_one_wins(daemon, spawn):
    puppets = [spawn(daemon) for _ in range(8)]
    tokens = []
    for i, puppet in enumerate(puppets):
        puppet.register()
        tokens.append(puppet.acquire(f"worker-lease:{i}"))
    barrier = daemon.root / "start-barrier"
    for i, puppet in enumerate(puppets):
        puppet.call_at_barrier(
            barrier, "dispatch_claim", puppet.worker_id, f"worker-lease:{i}", tokens[i],
            "task", "T1", "M1", "trace-T1",
        )  # fmt: skip
    barrier.touch()  # every puppet is polling for it: they claim together

    winners, refused = [], []
    for puppet in puppets:
        answer = puppet.reply()
        if "ok" in answer:
            winners.append((puppet, answer["ok"]))
        else:
            refused.append(error_for_code(answer["error"], answer["message"], answer["data"]))
    assert len(winners) == 1, (winners, refused)
    (winner, won) = winners[0]
    assert won["attempt_n"] == 1 and won["status"] == "claimed"
    assert len(refused) == 7
    for error in refused:
        assert type(error) is AlreadyActive and error.code == "already_active", repr(error)
        assert error.data["dispatch"]["dispatch_id"] == won["dispatch_id"]
        assert error.data["dispatch"]["worker_id"] == winner.worker_id

    with daemon.client() as client:
        rows = unit_rows(client, "T1")
        assert [(r["dispatch_id"], r["status"], r["worker_id"]) for r in rows] == [
            (won["dispatch_id"], "claimed", winner.worker_id)
        ]
        claimed = events(client, type="dispatch-claimed")
        assert [e["payload"]["dispatch_id"] for e in claimed] == [won["dispatch_id"]]


# --- 2. the lease is taken over while a dispatch runs -----------------------------------------


def take_over(daemon: Daemon, spawn: Callable[[Daemon], Puppet]):
    """A claims U1 under token t and starts it, then releases its lease mid-dispatch;
    B takes the resource over with a token > t. Returns (a, b, A's dispatch, t, B's)."""
    a, b = spawn(daemon), spawn(daemon)
    a.register()
    b.register()
    token_a = a.acquire("repo/one")
    old = a.claim("repo/one", token_a, "U1")
    a.call("dispatch_start", old["dispatch_id"], a.worker_id, token_a)
    assert a.call("lease_release", "repo/one", token_a)["released"] is True
    token_b = b.acquire("repo/one")
    assert token_b > token_a
    return a, b, old, token_a, token_b


def assert_taken_over(client: Any, old: dict[str, Any], b: Puppet, new: dict[str, Any]) -> None:
    """A's row is canceled for the takeover; B's claim is the unit's one active row."""
    assert new["attempt_n"] == 2 and new["dispatch_id"] != old["dispatch_id"]
    taken = client.dispatch_get(old["dispatch_id"])
    assert (taken["status"], taken["exit_reason"]) == ("canceled", TAKEOVER)
    assert taken["ended_at"] is not None
    assert [
        (r["dispatch_id"], r["status"], r["worker_id"]) for r in active(unit_rows(client, "U1"))
    ] == [(new["dispatch_id"], "claimed", b.worker_id)]
    (cancel,) = [
        e for e in events(client, type="dispatch-canceled")
        if e["payload"]["dispatch_id"] == old["dispatch_id"]
    ]  # fmt: skip
    assert cancel["payload"]["exit_reason"] == TAKEOVER
    assert cancel["payload"]["taken_over_by"] == b.worker_id
    assert cancel["trace_id"] == "trace-U1"


def test_old_worker_settling_after_a_takeover_but_before_the_new_claim_is_stale_lease(
    daemon, spawn
):
    """A completes after B took the lease, before B claims: stale_lease, the row is
    untouched; B's claim then cancels it (stale-dispatch-lease-takeover), attempt 2."""
    a, b, old, token_a, token_b = take_over(daemon, spawn)
    with daemon.client() as client:
        error = raises(
            StaleLease, a.call, "dispatch_complete", old["dispatch_id"], a.worker_id, token_a
        )
        assert error.data["lease"]["fencing_token"] == token_b
        assert client.dispatch_get(old["dispatch_id"])["status"] == "running"
        raises(StaleLease, a.claim, "repo/one", token_a, "U9")  # nor may A claim anew
        new = b.claim("repo/one", token_b, "U1")
        assert_taken_over(client, old, b, new)
        done = b.call("dispatch_complete", new["dispatch_id"], b.worker_id, token_b)
        assert done["status"] == "completed"


def test_old_worker_settling_after_the_new_claim_finds_its_row_canceled(daemon, spawn):
    """B claims first: A's row is canceled for the takeover and a settled row never
    reopens, so A's late complete is conflict (the row says why)."""
    a, b, old, token_a, token_b = take_over(daemon, spawn)
    with daemon.client() as client:
        new = b.claim("repo/one", token_b, "U1")
        assert_taken_over(client, old, b, new)
        error = raises(
            Conflict, a.call, "dispatch_complete", old["dispatch_id"], a.worker_id, token_a
        )
        assert error.data["dispatch"]["exit_reason"] == TAKEOVER
        assert client.dispatch_get(old["dispatch_id"])["status"] == "canceled"
        assert client.dispatch_get(new["dispatch_id"])["status"] == "claimed"


# --- 3. a worker SIGKILLed mid-dispatch -------------------------------------------------------


def test_kill9_of_a_worker_mid_dispatch_cancels_it_within_seconds(daemon, spawn):
    puppet = spawn(daemon)
    worker_id = puppet.register()
    token = puppet.acquire("repo/crash", ttl_ms=600_000)  # a 10-minute lease
    claim = puppet.claim("repo/crash", token, "C1")
    puppet.call("dispatch_start", claim["dispatch_id"], worker_id, token)
    with daemon.client() as client:
        assert worker_record(client, worker_id)["pid"] == puppet.pid
        killed_at = time.monotonic()
        puppet.kill9()
        row = wait_for(
            lambda: (r := client.dispatch_get(claim["dispatch_id"]))["status"] != "running" and r,
            timeout=5, what="the dead worker's dispatch to be settled",
        )  # fmt: skip
        elapsed = time.monotonic() - killed_at
        assert elapsed < 5.0  # the worker TTL is 60 s: this is the dead process, not a timeout
        assert row["status"] == "canceled" and row["exit_reason"] == "worker-crashed"
        raises(LeaseNotFound, client.lease_get, "repo/crash")
        worker = worker_record(client, worker_id)
        assert (worker["status"], worker["end_reason"]) == ("crashed", "process-gone")
        assert worker["ended_at"] is not None

        (crashed,) = events(client, type="worker-crashed")
        assert crashed["trace_id"] == worker_id and crashed["category"] == "worker"
        assert crashed["payload"]["worker_id"] == worker_id
        assert crashed["payload"]["reason"] == "process-gone"
        (released,) = [
            e for e in events(client, type="lease-released") if e["trace_id"] == "repo/crash"
        ]
        assert released["caused_by"] == crashed["event_id"]
        assert released["payload"]["fencing_token"] == token
        (canceled,) = events(client, type="dispatch-canceled")
        assert canceled["caused_by"] == crashed["event_id"]
        assert canceled["payload"]["dispatch_id"] == claim["dispatch_id"]
        assert canceled["trace_id"] == "trace-C1"
        assert crashed["seq"] < released["seq"] and crashed["seq"] < canceled["seq"]


# --- 4. heartbeat TTL --------------------------------------------------------------------------


def test_a_silent_live_worker_is_reaped_by_the_heartbeat_ttl_a_beating_one_stays(
    make_daemon, spawn
):
    daemon = make_daemon().start("--worker-ttl", "1", "--holder-check-interval", "0.2")
    silent, beating = spawn(daemon), spawn(daemon)
    beating.register()
    beating.send(op="heartbeat_every", worker_id=beating.worker_id, interval=0.2)
    beating.outcome(beating.reply())
    beating_token = beating.acquire("repo/beating")
    silent.register()
    silent_token = silent.acquire("repo/silent")
    claim = silent.claim("repo/silent", silent_token, "H1")

    with daemon.client() as client:
        worker = wait_for(
            lambda: (w := worker_record(client, silent.worker_id))["ended_at"] and w,
            timeout=5, what="the silent worker to be reaped",
        )  # fmt: skip
        assert (worker["status"], worker["end_reason"]) == ("crashed", "heartbeat-timeout")
        assert silent.proc.poll() is None  # its process is alive: the TTL reaped it
        raises(LeaseNotFound, client.lease_get, "repo/silent")
        row = client.dispatch_get(claim["dispatch_id"])
        assert (row["status"], row["exit_reason"]) == ("canceled", "worker-crashed")
        raises(Conflict, silent.call, "worker_heartbeat", silent.worker_id)

        # The beating worker outlives the TTL several times over, still active.
        registered = worker_record(client, beating.worker_id)["registered_at"]
        wait_for(
            lambda: worker_record(client, beating.worker_id)["heartbeat_at"] >= registered + 2500,
            timeout=10, what="the beating worker to live 2.5 TTLs",
        )  # fmt: skip
        kept = worker_record(client, beating.worker_id)
        assert (kept["status"], kept["ended_at"]) == ("active", None)
        lease = client.lease_get("repo/beating")
        assert lease["live"] is True and lease["fencing_token"] == beating_token
        assert beating.claim("repo/beating", beating_token, "H2")["attempt_n"] == 1


# --- 5. retry metadata ------------------------------------------------------------------------


def test_max_attempts_and_retry_after_are_enforced_and_failed_rows_never_reopen(daemon, spawn):
    puppet = spawn(daemon)
    wid = puppet.register()
    token = puppet.acquire("repo/retry")
    with daemon.client() as client:
        for n in (1, 2):
            claim = puppet.claim("repo/retry", token, "R1", max_attempts=2)
            assert claim["attempt_n"] == n
            failed = puppet.call(
                "dispatch_fail", claim["dispatch_id"], wid, token, "E_TEST", f"failure {n}"
            )
            assert failed["status"] == "failed" and failed["next_run_at"] is None
        error = raises(AttemptsExhausted, puppet.claim, "repo/retry", token, "R1", max_attempts=2)
        assert error.data["attempts"] == 2 and error.data["max_attempts"] == 2
        assert len(unit_rows(client, "R1")) == 2

        claim = puppet.claim("repo/retry", token, "R2")
        before = time.time() * 1000
        failed = puppet.call(
            "dispatch_fail", claim["dispatch_id"], wid, token, "E_RATE", "rate limited",
            retry_after_ms=60_000,
        )  # fmt: skip
        after = time.time() * 1000
        assert failed["next_run_at"] == failed["ended_at"] + 60_000
        assert before + 60_000 - 1000 <= failed["next_run_at"] <= after + 60_000 + 1000
        error = raises(NotBefore, puppet.claim, "repo/retry", token, "R2")
        assert error.data["next_run_at"] == failed["next_run_at"]
        assert error.data["dispatch_id"] == claim["dispatch_id"]

        # A failed row never reopens; repeating the failure answers it unchanged.
        dispatch_id = claim["dispatch_id"]
        raises(Conflict, puppet.call, "dispatch_complete", dispatch_id, wid, token)
        raises(Conflict, puppet.call, "dispatch_start", dispatch_id, wid, token)
        raises(Conflict, puppet.call, "dispatch_cancel", dispatch_id, wid, token, "x")
        again = puppet.call("dispatch_fail", dispatch_id, wid, token, "E_RATE", "rate limited")
        assert again == failed
        assert client.dispatch_get(dispatch_id) == failed
        assert [r["status"] for r in unit_rows(client, "R2")] == ["failed"]


# --- 6. the daemon SIGKILLed around a claim's commit ------------------------------------------


def assert_audit_matches_rows(client: Any) -> None:
    """Every dispatch row has exactly one dispatch-claimed event, and every such event
    names a row; no unit has two active rows."""
    rows = client.dispatch_list(limit=500)["dispatches"]
    claimed = [e["payload"]["dispatch_id"] for e in events(client, type="dispatch-claimed")]
    assert sorted(claimed) == sorted(row["dispatch_id"] for row in rows)
    units = [row["unit_key"] for row in active(rows)]
    assert len(units) == len(set(units)), rows


def test_daemon_kill9_before_and_after_a_claims_commit(make_daemon, spawn):
    daemon = make_daemon().start()
    puppet = spawn(daemon)
    wid = puppet.register()
    token = puppet.acquire("repo/crashy")
    daemon.kill9()

    # Before the commit: the claim is lost with the batch; the retry claims attempt 1.
    start_crashing_at(daemon, "batch.before_commit")
    puppet.reconnect()
    raises(Unavailable, puppet.claim, "repo/crashy", token, "K1")
    assert daemon.proc.wait(20) == -signal.SIGKILL
    daemon.start()
    puppet.reconnect()
    with daemon.client() as client:
        assert unit_rows(client, "K1") == []
        assert_audit_matches_rows(client)
    first = puppet.claim("repo/crashy", token, "K1")
    assert first["attempt_n"] == 1
    daemon.kill9()

    # After the commit, before the reply: the retry finds the worker's own claim.
    start_crashing_at(daemon, "batch.after_commit")
    puppet.reconnect()
    raises(Unavailable, puppet.claim, "repo/crashy", token, "K2")
    assert daemon.proc.wait(20) == -signal.SIGKILL
    daemon.start()
    puppet.reconnect()
    error = raises(AlreadyActive, puppet.claim, "repo/crashy", token, "K2")
    kept = error.data["dispatch"]
    assert (kept["worker_id"], kept["fencing_token"], kept["attempt_n"]) == (wid, token, 1)
    assert kept["status"] == "claimed"
    raises(AlreadyActive, puppet.claim, "repo/crashy", token, "K1")
    with daemon.client() as client:
        assert [r["dispatch_id"] for r in unit_rows(client, "K1")] == [first["dispatch_id"]]
        assert [r["dispatch_id"] for r in unit_rows(client, "K2")] == [kept["dispatch_id"]]
        assert_audit_matches_rows(client)
        assert worker_record(client, wid)["status"] == "active"
    # The surviving claim is the worker's to run: the fence still holds.
    started = puppet.call("dispatch_start", kept["dispatch_id"], wid, token)
    assert started["status"] == "running"
    assert daemon.stop() == 0


# --- 7. a stopping worker ---------------------------------------------------------------------


def test_a_stopping_worker_claims_nothing_and_ends_process_exited(daemon, spawn):
    puppet = spawn(daemon)
    wid = puppet.register()
    token = puppet.acquire("repo/stop")
    claim = puppet.claim("repo/stop", token, "S1")
    puppet.call("dispatch_start", claim["dispatch_id"], wid, token)
    stopping = puppet.call("worker_stopping", wid)
    assert stopping["status"] == "stopping" and stopping["ended_at"] is None
    assert puppet.call("worker_stopping", wid) == stopping  # repeated: unchanged
    error = raises(Conflict, puppet.claim, "repo/stop", token, "S2")
    assert error.data["worker"]["status"] == "stopping"
    with daemon.client() as client:
        assert unit_rows(client, "S2") == []
        assert puppet.exit() == 0
        worker = wait_for(
            lambda: (w := worker_record(client, wid))["ended_at"] and w,
            timeout=5, what="the stopped worker's exit to be noticed",
        )  # fmt: skip
        assert (worker["status"], worker["end_reason"]) == ("stopping", "process-exited")
        row = client.dispatch_get(claim["dispatch_id"])
        assert (row["status"], row["exit_reason"]) == ("canceled", "worker-exited")
        raises(LeaseNotFound, client.lease_get, "repo/stop")
        (exited,) = events(client, type="worker-exited")
        assert exited["trace_id"] == wid and exited["payload"]["reason"] == "process-exited"
        assert events(client, type="worker-crashed") == []
        (canceled,) = events(client, type="dispatch-canceled")
        assert canceled["caused_by"] == exited["event_id"]


def test_a_worker_that_exits_normally_is_noticed_soon_after_its_disconnect(make_daemon, spawn):
    """A clean exit closes the socket while the process still lives, so the sweep the
    disconnect triggers finds it alive; a re-check right after catches it, long before
    the next periodic sweep (30 s here)."""
    daemon = make_daemon().start("--holder-check-interval", "30")
    puppet = spawn(daemon)
    wid = puppet.register()
    with daemon.client() as client:
        assert worker_record(client, wid)["ended_at"] is None
        started = time.monotonic()
        assert puppet.exit() == 0
        worker = wait_for(
            lambda: (w := worker_record(client, wid))["ended_at"] and w,
            timeout=5, what="the exited worker to be noticed",
        )  # fmt: skip
        assert time.monotonic() - started < 5
        assert (worker["status"], worker["end_reason"]) == ("crashed", "process-gone")
