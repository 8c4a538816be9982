"""Two-box torture: two towerd daemons (boxes a and b) on one private durable PostgreSQL
cluster, under load, with faults inflicted at random; every invariant checked at the end.

    .venv/bin/python bench/torture_boxes.py [--kills 30] [--faults daemon,postgres,partition]
                                            [--seed N] [--quick] [--keep] [--verbose]

The cluster is tests/pg_cluster.py's ``PgCluster(durable=True)`` (fsync,
full_page_writes and synchronous_commit on), one database migrated once; each box is a
real daemon with its own state dir, socket and daemon id (``--store DSN
--presence-interval 0.5 --presence-ttl 5``). With ``partition`` (tests/tcp_proxy.py
importable) each box reaches the server's TCP port through a proxy of its own.

Worker processes on both boxes, each writing what it did to an append-only journal of
its own (one JSON line per event, fsynced before the next call):

* ``idem``: claim -> effect -> complete, key after key. The effect is an ``exec`` line
  in the journal; a lost answer (``unavailable``) is retried with the same key and the
  same ``attempt`` token; ``outcome_unknown`` (or ``idempotency_in_progress``) means do
  not run, ever: the next key;
* ``lease``: acquire one of a few shared resources (TTL 8 s, longer than the presence
  TTL, so only a box's death frees it early), renew it a few times, release it; every
  grant (resource, token, box, pid, when asked, when answered, its deadline), renewal,
  refusal and release is journalled;
* ``effect``: the effects ledger: both boxes' effect workers walk the same effects
  (``webhook`` on two shared targets: the claim takes the target's lease), so they
  contend for each; the claimant executes (a journal line), then commits.

Faults, one after another, on a schedule drawn from ``--seed`` (the kinds cycle in a
random order, so each gets its share of ``--kills``):

* ``daemon``: kill -9 of one box's daemon, then a restart: at once (``sigkill``), once
  the other box declared it dead (``long``: down past the presence TTL), or through a
  start armed to kill itself at a crash point inside a later write batch
  (``batch.before_commit``, ``batch.after_commit``: committed, nobody answered), then
  a plain start; these modes cycle too;
* ``postgres``: SIGKILL of the whole server, restarted (crash recovery);
* ``partition``: one box's proxy paused (every byte held, no socket closed) until the
  other box declared it dead, then resumed.

After each fault both boxes must serve a write again (``recovery``: seconds from the
heal); a box down or cut off past the presence TTL must have been declared dead. For
each partition the longest the other box's idempotent steps waited is shown (``stalled``).
At the end, workers done and the store read directly and through both boxes:

* acknowledged writes lost: every key whose complete was acknowledged is ``completed``
  with that result, read through each box and in the database; every acknowledged
  effect commit is ``committed`` with its receipt;
* double executions: at most one ``exec`` line per key, one per effect;
* fencing tokens: strictly increasing per resource in grant order (the audit log, in
  commit order), and in real time (a grant answered before another was asked has the
  smaller token);
* overlapping grants: no grant of a resource answered while an earlier holder's grant
  was still valid as that holder knew it (granted, renewed, neither released nor
  refused nor past its deadline), unless the store released that earlier grant
  because its box was declared dead (``box-dead``, or ``holder-died`` in the
  transaction that declared it: counted as fenced; when a box was declared dead comes
  from the store: ``daemons.dead_at``, the dead box's own ``box_revived``, and the
  other box's ``box_declared_dead``); and the server never granted a token while the
  previous one was neither released nor past its deadline;
* stale holders: no renew, release or effect commit of a token accepted once a greater
  token of its resource had been granted.

It prints the faults, the invariants as a table, one summary line and
``{"failures": N}``; exit status 1 if any invariant failed (the work dir and the
cluster's files are kept then, as with ``--keep``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

from benchlib import Daemon

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))  # pg_cluster.py, tcp_proxy.py

OPERATION = "torture.boxes"
PROBE_OPERATION = "torture.probe"
LEASES = ("torture/lease-0", "torture/lease-1", "torture/lease-2")
TARGETS = ("https://hooks.example/torture-0", "https://hooks.example/torture-1")
EFFECT_KIND, EFFECT_STEP = "webhook", "notify"
PRESENCE_INTERVAL_S, PRESENCE_TTL_S = 0.5, 5.0
PRESENCE = ["--presence-interval", str(PRESENCE_INTERVAL_S), "--presence-ttl", str(PRESENCE_TTL_S)]
LEASE_TTL_MS = 8_000  # > the presence TTL: a cut-off box's lease outlives its presence
EFFECT_TIMEOUT_MS = 120_000  # no effect goes silent by itself here: only a box's death
CALL_TIMEOUT_S = 20.0  # > the store's 5 s deadline and its 10 s cut-off of a stuck call
GIVE_UP_S = 90.0  # a worker told to stop gives up a call unanswered this long
RECOVERY_DEADLINE_S = 60.0
FAULTS = ("daemon", "postgres", "partition")
CRASH_POINTS = ("batch.before_commit", "batch.after_commit")
BOXES = ("a", "b")
DEATH_LOGGED_WITHIN_MS = 10_000  # a release by a death: the death logged within this
LOGGED_WITHIN_MS = 3_000  # box_declared_dead is logged this soon after its batch commits

T = TypeVar("T")


def now_ms() -> float:
    """Wall-clock milliseconds: the server's clock is this machine's (``tx.now``)."""
    return time.time() * 1000


def proxy_class() -> Any:
    """tests/tcp_proxy.py's ``TcpProxy``, or None where it is not there."""
    try:
        from tcp_proxy import TcpProxy
    except ImportError:
        return None
    return TcpProxy


def available_faults() -> tuple[str, ...]:
    return FAULTS if proxy_class() is not None else ("daemon", "postgres")


# --- the workers (separate processes) ----------------------------------------------------


class GaveUp(Exception):
    """A call went unanswered past its deadline (``unavailable`` all along)."""


class Journal:
    """Append-only, one JSON line per event, fsynced before the worker goes on."""

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def write(self, **fields: Any) -> None:
        os.write(self.fd, (json.dumps(fields, separators=(",", ":")) + "\n").encode())
        os.fsync(self.fd)


class Connection:
    """One box's daemon, reconnected after every ``unavailable`` (the daemon gone or
    restarting, or its store unreachable), the call sent again until it is answered."""

    def __init__(self, socket_path: str, stop: Path) -> None:
        self.socket_path = socket_path
        self.stop = stop
        self.client: Any = None
        self.parent = os.getppid()

    def stopping(self) -> bool:
        if os.getppid() != self.parent:  # the torture died: do not outlive it
            os._exit(3)
        return self.stop.exists()

    def call(self, fn: Callable[[Any], T], *, until_ms: float | None = None) -> T:
        """``fn(client)``'s answer; a refusal other than ``unavailable`` is raised.
        ``until_ms``: give up (``GaveUp``) once this wall-clock time has passed."""
        from towerd.client import Client, Unavailable

        failures, began = 0, time.monotonic()
        while True:
            try:
                if self.client is None:
                    self.client = Client(self.socket_path, timeout=CALL_TIMEOUT_S)
                return fn(self.client)
            except Unavailable:
                if self.client is not None:
                    self.client.close()
                    self.client = None
                failures += 1
                if until_ms is not None and now_ms() >= until_ms:
                    raise GaveUp() from None
                if self.stopping() and time.monotonic() - began > GIVE_UP_S:
                    raise GaveUp() from None
                time.sleep(min(0.25, 0.01 * 2 ** min(failures, 5)))


def idem_worker(conn: Connection, journal: Journal, box: str, index: int, rng: Any) -> None:
    """Claim -> effect (an ``exec`` line) -> complete, key after key."""
    from towerd.client import IdempotencyInProgress, OutcomeUnknown, TowerdError

    n = 0
    while not conn.stopping():
        key = f"{box}{index}-k{n}"
        n += 1
        payload = {"box": box, "worker": index}
        attempt = secrets.token_hex(8)  # the same token for every retry of this claim
        try:
            answer = conn.call(
                lambda c, key=key, payload=payload, attempt=attempt: c.idem_claim(
                    OPERATION, key, payload=payload, attempt=attempt
                )
            )
        except (OutcomeUnknown, IdempotencyInProgress) as exc:
            journal.write(ev="unknown", key=key, code=exc.code, t=now_ms())
            continue  # it may have run: never again under this key
        except GaveUp:
            journal.write(ev="claim_gave_up", key=key, t=now_ms())
            return
        except TowerdError as exc:
            journal.write(ev="claim_refused", key=key, code=exc.code, message=exc.message[:300])
            continue
        if answer["state"] != "claimed":
            journal.write(
                ev="replayed", key=key, state=answer["state"], result=answer.get("result")
            )
            continue
        result = {"box": box, "worker": index, "ref": answer["effect_ref"]}
        journal.write(ev="exec", key=key, box=box, ref=answer["effect_ref"], t=now_ms())
        try:
            conn.call(lambda c, key=key, result=result: c.idem_complete(OPERATION, key, result))
        except GaveUp:
            journal.write(ev="complete_gave_up", key=key, t=now_ms())
            return
        except TowerdError as exc:
            journal.write(ev="complete_refused", key=key, code=exc.code, message=exc.message[:300])
            continue
        journal.write(ev="ack", key=key, result=result, t=now_ms())


def lease_worker(conn: Connection, journal: Journal, box: str, index: int, rng: Any) -> None:
    """Acquire a shared resource, renew it a few times, release it; all journalled."""
    from towerd.client import LeaseExpired, LeaseHeld, LeaseNotFound, LeaseSuperseded

    lost_codes = (LeaseExpired, LeaseNotFound, LeaseSuperseded)
    pid = os.getpid()
    while not conn.stopping():
        resource = rng.choice(LEASES)
        sent = now_ms()
        try:
            granted = conn.call(lambda c, r=resource: c.lease_acquire(r, ttl_ms=LEASE_TTL_MS))
        except LeaseHeld:
            time.sleep(rng.uniform(0.02, 0.15))
            continue
        except GaveUp:
            return
        token, expires = granted["fencing_token"], granted["expires_at"]
        journal.write(
            ev="grant",
            res=resource,
            token=token,
            box=box,
            pid=pid,
            sent=sent,
            ack=now_ms(),
            expires=expires,
            renewed=granted["renewed"],
        )
        held = True
        for _ in range(rng.randint(1, 4)):
            time.sleep(rng.uniform(0.1, 0.5))
            if now_ms() >= expires:
                journal.write(ev="lapsed", res=resource, token=token, t=now_ms())
                held = False
                break
            sent = now_ms()
            try:
                renewed = conn.call(
                    lambda c, r=resource, t=token: c.lease_renew(r, t, ttl_ms=LEASE_TTL_MS),
                    until_ms=expires,
                )
            except lost_codes as exc:
                journal.write(
                    ev="renew_refused",
                    res=resource,
                    token=token,
                    code=exc.code,
                    sent=sent,
                    ack=now_ms(),
                )
                held = False
                break
            except GaveUp:
                journal.write(ev="lapsed", res=resource, token=token, t=now_ms())
                held = False
                break
            expires = renewed["expires_at"]
            journal.write(
                ev="renew", res=resource, token=token, sent=sent, ack=now_ms(), expires=expires
            )
        if not held:
            continue
        journal.write(ev="release", res=resource, token=token, sent=now_ms())  # belief ends
        try:
            conn.call(lambda c, r=resource, t=token: c.lease_release(r, t), until_ms=expires)
        except lost_codes as exc:
            journal.write(ev="release_refused", res=resource, token=token, code=exc.code)
        except GaveUp:
            journal.write(ev="release_gave_up", res=resource, token=token)
        else:
            journal.write(ev="released", res=resource, token=token, ack=now_ms())


def effect_worker(conn: Connection, journal: Journal, box: str, index: int, rng: Any) -> None:
    """Walk the shared effects (the same ones as the other box's effect workers): claim,
    execute (an ``fx_exec`` line), commit."""
    from towerd.client import (
        EffectAlreadyCommitted,
        EffectAttemptSuperseded,
        EffectInFlight,
        EffectLeaseHeld,
        EffectLeaseSuperseded,
        EffectUncertain,
    )
    from towerd.protocol.naming import effect_key

    pid = os.getpid()
    n = 0
    while not conn.stopping():
        run_id, target = f"fx-{n}", TARGETS[n % len(TARGETS)]
        key = effect_key(run_id, EFFECT_STEP, EFFECT_KIND, target)
        attempt = f"{box}{index}-{n}-{secrets.token_hex(4)}"  # the same for every retry
        sent = now_ms()
        try:
            claimed = conn.call(
                lambda c, run_id=run_id, target=target, attempt=attempt: c.effect_claim(
                    run_id,
                    EFFECT_STEP,
                    attempt,
                    EFFECT_KIND,
                    target,
                    payload={"run": run_id},
                    timeout_ms=EFFECT_TIMEOUT_MS,
                    lease_ttl_ms=LEASE_TTL_MS,
                )
            )
        except (EffectInFlight, EffectLeaseHeld):
            time.sleep(rng.uniform(0.02, 0.1))  # another attempt holds it: nothing recorded
            continue
        except (EffectAlreadyCommitted, EffectUncertain) as exc:
            journal.write(ev="fx_settled", key=key, code=exc.code)
            n += 1
            continue
        except GaveUp:
            return
        token = claimed["fencing_token"]
        journal.write(
            ev="fx_grant",
            res=target,
            token=token,
            key=key,
            box=box,
            pid=pid,
            sent=sent,
            ack=now_ms(),
            expires=claimed["lease_expires_at"],
        )
        receipt = {"box": box, "attempt": attempt}
        journal.write(ev="fx_exec", key=key, res=target, token=token, box=box, t=now_ms())
        sent = now_ms()
        try:
            conn.call(
                lambda c, key=key, attempt=attempt, receipt=receipt: c.effect_commit(
                    key, attempt, receipt
                )
            )
        except (EffectUncertain, EffectLeaseSuperseded, EffectAttemptSuperseded) as exc:
            journal.write(
                ev="fx_refused", key=key, res=target, token=token, code=exc.code, sent=sent
            )
        except GaveUp:
            return
        else:
            journal.write(
                ev="fx_ack",
                key=key,
                res=target,
                token=token,
                receipt=receipt,
                sent=sent,
                ack=now_ms(),
            )
        n += 1


ROLES: dict[str, Callable[[Connection, Journal, str, int, Any], None]] = {
    "idem": idem_worker,
    "lease": lease_worker,
    "effect": effect_worker,
}


def worker_main(role: str, box: str, index: int, socket_path: str, out: str, seed: int) -> None:
    out_dir = Path(out)
    journal = Journal(out_dir / f"journal-{role}-{box}{index}.log")
    conn = Connection(socket_path, out_dir / "stop")
    try:
        ROLES[role](conn, journal, box, index, random.Random(f"{seed}-{role}-{box}-{index}"))
    except BaseException as exc:  # noqa: BLE001 - journalled for the checker, then raised
        journal.write(ev="crash", error=f"{type(exc).__name__}: {exc}"[:500], t=now_ms())
        raise


# --- the boxes, the cluster and the faults -----------------------------------------------


@dataclass
class Box:
    name: str
    daemon: Daemon
    workdir: Path
    proxy: Any = None
    daemon_id: str = ""

    @property
    def socket_path(self) -> Path:
        return self.daemon.socket_path

    @property
    def log_path(self) -> Path:
        return self.workdir / "daemon.log"

    def log_events(self, event: str) -> list[dict[str, Any]]:
        return [record for record in read_log(self.log_path) if record.get("event") == event]


def read_log(path: Path) -> list[dict[str, Any]]:
    records = []
    with contextlib.suppress(FileNotFoundError), open(path, errors="replace") as handle:
        for line in handle:
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if isinstance(record, dict):
                    records.append(record)
    return records


def log_time_ms(record: dict[str, Any]) -> float | None:
    stamp = record.get("timestamp")
    if not isinstance(stamp, str):
        return None
    try:
        return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp() * 1000
    except ValueError:
        return None


@dataclass
class Fault:
    kind: str
    box: str | None
    began: float  # wall ms
    healed: float = 0.0
    detail: str = ""
    mode: str = ""  # how a daemon fault went (kill_daemon)
    other_stall_s: float = 0.0  # a partition: the other box's longest wait for a step
    recovery_s: float = 0.0  # from the heal until both boxes served a write


@dataclass
class Tally:
    faults: list[Fault] = field(default_factory=list)
    kills: int = 0
    operations: int = 0  # executions of idempotent steps (exec lines)
    acknowledged: int = 0
    lost: int = 0
    double_effects: int = 0
    unknown_outcomes: int = 0
    grants: int = 0
    renewals: int = 0
    token_regressions: int = 0
    overlaps: int = 0
    overlaps_fenced: int = 0  # an earlier holder's box was declared dead: fenced out
    stale_accepted: int = 0
    stale_refused: int = 0  # renews and commits of superseded tokens refused
    effects_executed: int = 0
    effects_committed: int = 0
    effects_lost: int = 0
    effects_double: int = 0
    box_deaths: int = 0
    unlogged_deaths: int = 0  # declared dead (the store says so), not logged by any box
    checks: Counter[str] = field(default_factory=Counter)  # invariant -> items checked
    violations: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    evidence: list[str] = field(default_factory=list)  # log lines around the failures
    notes: list[str] = field(default_factory=list)
    phases: dict[str, float] = field(default_factory=dict)  # seconds: setup, faults, stop, check

    moments: list[tuple[str, float]] = field(default_factory=list)  # failure, wall ms

    def fail(self, invariant: str, message: str, at_ms: float | None = None) -> None:
        self.violations[invariant] += 1
        self.failures.append(f"{invariant}: {message}")
        if at_ms is not None:
            self.moments.append((message, at_ms))

    def fault_counts(self) -> Counter[str]:
        return Counter(fault.kind for fault in self.faults)

    def line(self, elapsed: float) -> str:
        kinds = ",".join(f"{k}={v}" for k, v in sorted(self.fault_counts().items()))
        recoveries = [f.recovery_s for f in self.faults]
        worst = max(recoveries) if recoveries else 0.0
        return (
            f"kills={self.kills} faults=[{kinds}] operations={self.operations} "
            f"acknowledged={self.acknowledged} lost={self.lost} "
            f"double_effects={self.double_effects} unknown_outcomes={self.unknown_outcomes} "
            f"grants={self.grants} token_regressions={self.token_regressions} "
            f"overlaps={self.overlaps} overlaps_fenced={self.overlaps_fenced} "
            f"stale_accepted={self.stale_accepted} effects={self.effects_committed} "
            f"effects_lost={self.effects_lost} effects_double={self.effects_double} "
            f"box_deaths={self.box_deaths} worst_recovery={worst:.1f}s elapsed={elapsed:.1f}s"
        )


class Fleet:
    """The cluster, the two boxes (and their proxies), the worker processes."""

    def __init__(self, workdir: Path, faults: tuple[str, ...], seed: int) -> None:
        from pg_cluster import ROLE, PgCluster

        self.workdir = workdir
        self.seed = seed
        self.out = workdir / "out"
        self.out.mkdir(parents=True)
        self.cluster = PgCluster(durable=True)
        try:
            self.cluster.start()
            self.dbname = "torture"
            self.dsn = self.cluster.new_database(self.dbname, migrated=True)
        except BaseException:
            self.cluster.close()
            raise
        proxy = proxy_class() if "partition" in faults else None
        self.boxes: dict[str, Box] = {}
        for name in BOXES:
            boxdir = workdir / name
            boxdir.mkdir(mode=0o700)
            running = proxy("127.0.0.1", self.cluster.port) if proxy is not None else None
            dsn = running.dsn(self.dbname, ROLE) if running else self.dsn
            daemon = Daemon(boxdir, ["--store", dsn, *PRESENCE])
            self.boxes[name] = Box(name, daemon, boxdir, running)
        self.workers: list[subprocess.Popen[bytes]] = []
        self.probes = 0

    def start_box(self, box: Box) -> None:
        """Start its daemon; a start refused (the store unreachable) is tried again."""
        deadline = time.monotonic() + RECOVERY_DEADLINE_S
        while not box.daemon.start():
            if time.monotonic() > deadline:
                raise RuntimeError(f"box {box.name} did not start:\n{tail(box.log_path)}")
            time.sleep(0.2)
        if not box.daemon_id:
            from towerd.client import Client

            with Client(box.socket_path, timeout=CALL_TIMEOUT_S) as client:
                box.daemon_id = client.status()["daemon_id"]

    def start(self, counts: dict[str, int]) -> None:
        for box in self.boxes.values():
            self.start_box(box)
        for role, per_box in counts.items():
            for box in self.boxes.values():
                for index in range(per_box):
                    self.workers.append(
                        subprocess.Popen(
                            [
                                sys.executable,
                                __file__,
                                "--worker",
                                role,
                                "--box",
                                box.name,
                                "--index",
                                str(index),
                                "--socket",
                                str(box.socket_path),
                                "--out",
                                str(self.out),
                                "--seed",
                                str(self.seed),
                            ]
                        )
                    )

    def other(self, box: Box) -> Box:
        return next(b for b in self.boxes.values() if b is not box)

    def dead_at(self, box: Box) -> int | None:
        """When a box declared ``box`` dead (the server's clock, ms), while it is; read
        from the database directly (``daemons.dead_at``: the store's own truth)."""
        import psycopg

        try:
            with psycopg.connect(self.dsn, autocommit=True, connect_timeout=5) as conn:
                row = conn.execute(
                    "SELECT dead_at FROM daemons WHERE daemon_id = %s", (box.daemon_id,)
                ).fetchone()
        except psycopg.Error:
            return None
        return None if row is None else row[0]

    def serves(self, box: Box, deadline: float) -> bool:
        """Wait until ``box`` serves a write (a fresh key claimed and completed)."""
        from towerd.client import Client, TowerdError, Unavailable

        while time.monotonic() < deadline:
            self.probes += 1
            key = f"probe-{self.probes}"
            try:
                with Client(box.socket_path, timeout=CALL_TIMEOUT_S) as client:
                    client.idem_claim(PROBE_OPERATION, key)
                    client.idem_complete(PROBE_OPERATION, key, {"probe": self.probes})
                return True
            except Unavailable:
                time.sleep(0.05)
            except TowerdError:
                time.sleep(0.05)  # the claim went through before its answer was lost
        return False

    def recover(self, fault: Fault, tally: Tally) -> None:
        fault.healed = now_ms()
        began = time.monotonic()
        deadline = began + RECOVERY_DEADLINE_S
        for box in self.boxes.values():
            if not self.serves(box, deadline):
                tally.fail(
                    "recovery",
                    f"box {box.name} served no write {RECOVERY_DEADLINE_S:.0f} s after the "
                    f"heal of {fault.kind} {fault.box or ''} {fault.detail}",
                    now_ms(),
                )
        fault.recovery_s = time.monotonic() - began

    # --- faults ------------------------------------------------------------------------

    def kill_daemon(self, box: Box, mode: str, tally: Tally) -> Fault:
        """kill -9 of ``box``'s daemon and a restart: at once (``sigkill``), once the
        other box declared it dead (``long``), or through a start armed to kill itself
        at a crash point inside a later write batch (before its COMMIT, or after it
        and before any caller is answered), then a plain start."""
        fault = Fault("daemon", box.name, now_ms(), mode=mode)
        box.daemon.kill()
        detail = ""
        dead = False
        if mode == "long":  # down past the presence TTL: the other box declares it dead
            dead = wait_until(lambda: self.dead_at(box) is not None, PRESENCE_TTL_S + 15)
        elif mode in CRASH_POINTS:
            armed = f"{mode}:{random.randint(1, 40)}"
            if box.daemon.start(armed) and not box.daemon.died_by_itself(timeout=10):
                box.daemon.kill()
                detail = f", {armed} not reached in 10 s"
            else:
                detail = f", then died at {armed}"
        else:
            time.sleep(random.uniform(0, 0.3))
        self.start_box(box)
        down = (now_ms() - fault.began) / 1000
        fault.detail = f"{mode}: down {down:.1f} s{detail}"
        if mode == "long" and not dead:
            fault.detail += ", not declared dead in time"
        return fault

    def kill_postgres(self, downtime: float, tally: Tally) -> Fault:
        fault = Fault("postgres", None, now_ms())
        self.cluster.kill()
        time.sleep(downtime)
        self.cluster.restart()
        down = (now_ms() - fault.began) / 1000
        fault.detail = f"down {down:.1f} s"
        return fault

    def partition(self, box: Box, tally: Tally) -> Fault:
        fault = Fault("partition", box.name, now_ms())
        box.proxy.pause()
        declared = wait_until(lambda: self.dead_at(box) is not None, PRESENCE_TTL_S + 15)
        time.sleep(random.uniform(0.2, 1.0))
        box.proxy.resume()
        cut = (now_ms() - fault.began) / 1000
        fault.detail = f"cut off {cut:.1f} s"
        if not declared:
            fault.detail += ", not declared dead in time"
        return fault

    # --- the end ---------------------------------------------------------------------

    def heal(self) -> None:
        for box in self.boxes.values():
            if box.proxy is not None and box.proxy.paused:
                box.proxy.resume()
        if not self.cluster.running:
            self.cluster.restart()
        for box in self.boxes.values():
            proc = box.daemon.proc
            if proc is None or proc.poll() is not None:
                self.start_box(box)

    def stop_workers(self, tally: Tally) -> None:
        (self.out / "stop").touch()
        for proc in self.workers:
            try:
                proc.wait(GIVE_UP_S + 30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                tally.fail("workers", f"worker {proc.pid} did not stop")

    def close(self, keep: bool) -> None:
        for proc in self.workers:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for box in self.boxes.values():
            proc = box.daemon.proc
            if proc is not None and proc.poll() is None:
                with contextlib.suppress(Exception):
                    box.daemon.stop()
            if box.proxy is not None:
                with contextlib.suppress(Exception):
                    box.proxy.close()
        if keep:
            with contextlib.suppress(Exception):
                self.cluster.stop()
        else:
            self.cluster.close()


def wait_until(condition: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return ""


# --- the invariant checker -------------------------------------------------------------------


def read_journals(out: Path) -> list[dict[str, Any]]:
    events = []
    for path in sorted(out.glob("journal-*.log")):
        worker = path.stem.removeprefix("journal-")
        data = path.read_text()
        for line in data.split("\n")[:-1]:  # a partial last line never happened
            event = json.loads(line)
            event["worker"] = worker
            events.append(event)
    return events


@dataclass
class Grant:
    resource: str
    token: int
    box: str
    worker: str
    sent: float
    ack: float
    intervals: list[list[float]]  # [start, end] wall ms: valid as its holder knew it
    effect: str | None = None


def read_store(dsn: str) -> dict[str, Any]:
    """The database's own account: keys, effects, the lease audit log in commit order."""
    import msgspec
    import psycopg

    decode = msgspec.msgpack.decode
    with psycopg.connect(dsn, autocommit=True) as conn:
        keys = {
            key: (state, decode(result) if result is not None else None)
            for key, state, result in conn.execute(
                "SELECT key, state, result FROM idempotency WHERE operation = %s", (OPERATION,)
            )
        }
        states = dict(
            conn.execute(
                "SELECT state, count(*) FROM idempotency WHERE operation = %s GROUP BY state",
                (OPERATION,),
            ).fetchall()
        )
        effects = {
            key: (status, attempt, decode(receipt) if receipt is not None else None, token)
            for key, status, attempt, receipt, token in conn.execute(
                "SELECT effect_key, status, attempt_id, receipt, fencing_token FROM effects"
            )
        }
        audit = [
            (seq, kind, ts, resource, decode(payload) if payload is not None else {})
            for seq, kind, ts, resource, payload in conn.execute(
                "SELECT seq, type, ts, trace_id, payload FROM audit_events "
                "WHERE category = 'lease' ORDER BY seq"
            )
        ]
        daemons = conn.execute(
            "SELECT daemon_id, owner_epoch, dead_at FROM daemons ORDER BY daemon_id"
        ).fetchall()
    return {"keys": keys, "states": states, "effects": effects, "audit": audit, "daemons": daemons}


def read_through(box: Box, calls: list[tuple[str, dict[str, Any]]]) -> list[Any]:
    """Each call's answer (or its error) through ``box``'s daemon, pipelined."""
    from towerd.client import Client

    answers: list[Any] = []
    with Client(box.socket_path, timeout=60) as client:
        for start in range(0, len(calls), 200):
            answers += client.call_many(calls[start : start + 200])
    return answers


def check(fleet: Fleet, tally: Tally) -> None:
    events = read_journals(fleet.out)
    store = read_store(fleet.dsn)
    check_keys(fleet, events, store, tally)
    check_effects(fleet, events, store, tally)
    grants = collect_grants(events, tally)
    check_audit(store["audit"], events, tally)
    deaths = collect_deaths(fleet, store, tally)
    check_fencing(grants, events, store["audit"], deaths, tally)
    measure_stalls(events, tally)


def measure_stalls(events: list[dict[str, Any]], tally: Tally) -> None:
    """For each partition: the longest the other box's idempotent-step workers went
    without a step done (the cut-off box's transaction may hold the one writer lock
    every box takes until the server ends it)."""
    times: dict[str, list[float]] = defaultdict(list)
    for event in events:
        if event["worker"].startswith("idem-") and event["ev"] in ("exec", "ack", "unknown"):
            times[event["worker"]].append(event["t"])
    for fault in tally.faults:
        if fault.kind != "partition":
            continue
        others = [w for w in times if not w.startswith(f"idem-{fault.box}")]
        for worker in others:
            moments = sorted(times[worker])
            for before, after in zip(moments, moments[1:], strict=False):
                if after >= fault.began and before <= fault.healed:
                    fault.other_stall_s = max(fault.other_stall_s, (after - before) / 1000)


def collect_deaths(fleet: Fleet, store: dict[str, Any], tally: Tally) -> dict[str, list[float]]:
    """box -> the moments (server clock, ms) a box declared it dead. The store's truth:
    ``declared_dead_at`` of each ``box_revived`` (a box that learns it was declared dead
    says when), ``daemons.dead_at`` at the end; and each ``box_declared_dead`` the other
    box logged (its own timestamp: after the commit). A death no box logged is noted:
    the beat that declared it committed after its caller gave up on it."""
    by_id = {box.daemon_id: name for name, box in fleet.boxes.items()}
    exact: dict[str, set[float]] = defaultdict(set)
    for name, box in fleet.boxes.items():
        for event in box.log_events("box_revived"):
            if event.get("declared_dead_at") is not None:
                exact[name].add(float(event["declared_dead_at"]))
    for daemon_id, _epoch, dead_at in store["daemons"]:
        if daemon_id in by_id and dead_at is not None:
            exact[by_id[daemon_id]].add(float(dead_at))
    logged: dict[str, list[float]] = defaultdict(list)
    for box in fleet.boxes.values():
        for event in box.log_events("box_declared_dead"):
            at = log_time_ms(event)
            if event.get("box") in by_id and at is not None:
                logged[by_id[event["box"]]].append(at)
    deaths: dict[str, list[float]] = {}
    for name in fleet.boxes:
        seen = sorted(exact[name])

        def same(death: float, at: float) -> bool:  # the log line of that very death
            return death <= at <= death + LOGGED_WITHIN_MS

        unmatched = [at for at in logged[name] if not any(same(d, at) for d in seen)]
        unlogged = [d for d in seen if not any(same(d, at) for at in logged[name])]
        deaths[name] = sorted(seen + unmatched)
        for at in unlogged:
            tally.unlogged_deaths += 1
            tally.notes.append(
                f"box {name} was declared dead at {at:.0f} (its box_revived says so) but no "
                "box logged box_declared_dead"
            )
    tally.box_deaths = sum(len(moments) for moments in deaths.values())
    for fault in tally.faults:
        dead = [
            name
            for name, moments in deaths.items()
            if any(fault.began <= at <= fault.healed + 2_000 for at in moments)
        ]
        if dead:
            fault.detail += f", box {'+'.join(dead)} declared dead"
        if fault.kind in ("partition",) or fault.mode == "long":
            if fault.box not in dead:
                tally.fail(
                    "liveness",
                    f"{fault.kind} of box {fault.box} ({fault.detail}): it was never declared dead",
                )
    return deaths


def check_keys(
    fleet: Fleet, events: list[dict[str, Any]], store: dict[str, Any], tally: Tally
) -> None:
    from towerd.client import TowerdError

    acked: dict[str, dict[str, Any]] = {}
    executed: Counter[str] = Counter()
    unknown = 0
    for event in events:
        ev = event["ev"]
        if ev == "ack":
            acked[event["key"]] = event["result"]
        elif ev == "exec":
            executed[event["key"]] += 1
        elif ev == "unknown":
            unknown += 1
        elif ev == "complete_refused":  # its claim was acknowledged
            tally.fail("acknowledged writes lost", f"{event['worker']} {ev}: {event}")
            tally.lost += 1
        elif ev == "replayed":  # a fresh key found completed: by whom?
            tally.fail("double executions", f"{event['worker']} {ev}: {event}")
        elif ev in ("claim_refused", "crash", "claim_gave_up", "complete_gave_up"):
            tally.fail("unexpected refusals", f"{event['worker']} {ev}: {event}")
    tally.operations = sum(executed.values())
    tally.acknowledged = len(acked)
    tally.unknown_outcomes = max(unknown, store["states"].get("outcome_unknown", 0))
    tally.checks["acknowledged writes lost"] += len(acked)
    tally.checks["double executions"] += len(executed)
    doubles = sorted(key for key, count in executed.items() if count > 1)
    tally.double_effects = len(doubles)
    for key in doubles:
        runs = [e for e in events if e["ev"] == "exec" and e["key"] == key]
        tally.fail("double executions", f"key {key} ran {len(runs)} times: {runs}", runs[-1]["t"])
    stored = store["keys"]
    for key in executed:
        if key not in acked and stored.get(key, (None,))[0] == "completed":
            tally.notes.append(f"key {key} completed but its acknowledgement was not journalled")
    for key, (state, result) in stored.items():
        if state == "completed" and key not in executed:
            tally.fail("double executions", f"key {key} is completed ({result}) but never ran")
    keys = sorted(acked)
    calls = [("idem.get", {"operation": OPERATION, "key": key}) for key in keys]
    lost: set[str] = set()
    for box in fleet.boxes.values():
        for key, answer in zip(keys, read_through(box, calls), strict=True):
            if isinstance(answer, TowerdError):
                lost.add(key)
                tally.fail(
                    "acknowledged writes lost",
                    f"key {key} through box {box.name}: {answer.code} {answer.message}",
                )
            elif answer["state"] != "completed" or answer["result"] != acked[key]:
                lost.add(key)
                tally.fail(
                    "acknowledged writes lost",
                    f"key {key} through box {box.name} is {answer['state']} with "
                    f"{answer['result']}, acknowledged {acked[key]}",
                )
    for key in keys:
        state, result = stored.get(key, (None, None))
        if state != "completed" or result != acked[key]:
            lost.add(key)
            tally.fail("acknowledged writes lost", f"key {key} in the database: {state} {result}")
    tally.lost += len(lost)


def check_effects(
    fleet: Fleet, events: list[dict[str, Any]], store: dict[str, Any], tally: Tally
) -> None:
    from towerd.client import TowerdError

    acked = {e["key"]: e for e in events if e["ev"] == "fx_ack"}
    executed: Counter[str] = Counter(e["key"] for e in events if e["ev"] == "fx_exec")
    tally.effects_executed = sum(executed.values())
    tally.effects_committed = len(acked)
    tally.checks["effects lost"] += len(acked)
    tally.checks["effects executed twice"] += len(executed)
    for key, count in executed.items():
        if count > 1:
            tally.effects_double += 1
            runs = [e for e in events if e["ev"] == "fx_exec" and e["key"] == key]
            tally.fail(
                "effects executed twice", f"effect {key} ran {count} times: {runs}", runs[-1]["t"]
            )
    for key, (status, _attempt, _receipt, _token) in store["effects"].items():
        if status == "committed" and key not in executed:
            tally.fail("effects executed twice", f"effect {key} committed but never ran")
    keys = sorted(acked)
    calls = [("effect.get", {"effect_key": key}) for key in keys]
    lost: set[str] = set()
    for box in fleet.boxes.values():
        for key, answer in zip(keys, read_through(box, calls), strict=True):
            want = acked[key]["receipt"]
            if isinstance(answer, TowerdError):
                lost.add(key)
                tally.fail("effects lost", f"effect {key} through box {box.name}: {answer.code}")
            elif answer["status"] != "committed" or answer["receipt"] != want:
                lost.add(key)
                tally.fail(
                    "effects lost",
                    f"effect {key} through box {box.name} is "
                    f"{answer['status']} with {answer['receipt']}, acknowledged {want}",
                )
    for key in keys:
        status, _attempt, receipt, _token = store["effects"].get(key, (None, None, None, None))
        if status != "committed" or receipt != acked[key]["receipt"]:
            lost.add(key)
            tally.fail("effects lost", f"effect {key} in the database: {status} {receipt}")
    tally.effects_lost = len(lost)


def collect_grants(events: list[dict[str, Any]], tally: Tally) -> dict[str, list[Grant]]:
    """Every grant a worker heard of, with the intervals it knew it valid: from each
    answer (grant, renewal) to the deadline it carried, cut at the release or commit
    the holder sent, or at the refusal it heard."""
    grants: dict[tuple[str, int], Grant] = {}
    for event in events:
        ev = event["ev"]
        if ev in ("grant", "fx_grant"):
            ident = (event["res"], event["token"])
            interval = [event["ack"], float(event["expires"] or event["ack"])]
            if ident in grants:  # the same lease again (an acquire of a lease it holds)
                grants[ident].intervals.append(interval)
                continue
            tally.grants += 1
            grants[ident] = Grant(
                event["res"],
                event["token"],
                event["box"],
                event["worker"],
                event["sent"],
                event["ack"],
                [interval],
                event.get("key"),
            )
    for event in events:
        ev = event["ev"]
        grant = grants.get((event.get("res", ""), event.get("token", -1)))
        if grant is None:
            continue
        if ev == "renew":
            tally.renewals += 1
            grant.intervals.append([event["ack"], float(event["expires"])])
        elif ev in ("release", "fx_refused", "fx_ack"):
            cut(grant, event["sent"])
        elif ev == "fx_exec":
            pass
        elif ev in ("renew_refused",):
            cut(grant, event["ack"])
        elif ev == "lapsed":
            cut(grant, event["t"])
    by_resource: dict[str, list[Grant]] = defaultdict(list)
    for grant in grants.values():
        by_resource[grant.resource].append(grant)
    for resource_grants in by_resource.values():
        resource_grants.sort(key=lambda g: g.token)
    return by_resource


def cut(grant: Grant, at: float) -> None:
    grant.intervals = [[start, min(end, at)] for start, end in grant.intervals if start < at]


def check_audit(audit: list[tuple[Any, ...]], events: list[dict[str, Any]], tally: Tally) -> None:
    """The server's own grant order (the audit log, in commit order): per resource, each
    grant's token greater than every earlier one, and granted only once the previous
    grant was released or past its deadline (as far as anyone heard it renewed)."""
    renewed: dict[tuple[str, int], float] = defaultdict(float)
    for event in events:
        if event["ev"] in ("renew", "grant", "fx_grant") and event.get("expires"):
            ident = (event["res"], event["token"])
            renewed[ident] = max(renewed[ident], float(event["expires"]))
    last: dict[str, tuple[int, float, str | None]] = {}  # resource -> token, deadline, released
    highest: dict[str, int] = {}
    for seq, kind, ts, resource, payload in audit:
        token = payload.get("fencing_token")
        if kind in ("lease-granted", "lease-restored"):
            deadline = max(float(payload.get("expires_at") or 0), renewed[(resource, token)])
            if kind == "lease-granted":
                tally.checks["fencing tokens increasing"] += 1
                if token <= highest.get(resource, 0):
                    tally.token_regressions += 1
                    tally.fail(
                        "fencing tokens increasing",
                        f"{resource}: token {token} granted (audit seq {seq}) after "
                        f"token {highest[resource]}",
                        ts,
                    )
                previous = last.get(resource)
                tally.checks["server granted over a live lease"] += 1
                if previous is not None and previous[2] is None and ts < previous[1]:
                    tally.fail(
                        "server granted over a live lease",
                        f"{resource}: token {token} granted at {ts:.0f} (seq {seq}) while "
                        f"token {previous[0]} was neither released nor past its "
                        f"deadline {previous[1]:.0f}",
                        ts,
                    )
                highest[resource] = max(highest.get(resource, 0), token)
            last[resource] = (token, deadline, None)
        elif kind == "lease-released":
            current = last.get(resource)
            if current is not None and current[0] == token:
                last[resource] = (token, current[1], str(payload.get("reason")))


def check_fencing(
    grants: dict[str, list[Grant]],
    events: list[dict[str, Any]],
    audit: list[tuple[Any, ...]],
    deaths: dict[str, list[float]],
    tally: Tally,
) -> None:
    """What the workers heard: tokens in real-time order; no grant answered while an
    earlier one was still valid as its holder knew it, unless the store fenced that
    holder out (its box declared dead); no superseded token accepted afterwards.

    ``deaths``: box -> when a box declared it dead (its log). A box declared dead has
    its holders settled as dead (``holder-died``), then the rest of its leases freed
    (``box-dead``), in the transaction that declares it: a ``holder-died`` release of a
    worker's lease (the workers never die) is an excuse only at such a moment."""
    released: dict[tuple[str, int], tuple[int, str, float]] = {}  # -> (seq, reason, ts)
    granted_seq: dict[tuple[str, int], int] = {}
    for seq, kind, ts, resource, payload in audit:
        ident = (resource, payload.get("fencing_token"))
        if kind == "lease-released":
            released.setdefault(ident, (seq, str(payload.get("reason")), float(ts)))
        elif kind == "lease-granted":
            granted_seq.setdefault(ident, seq)

    def fenced_out(grant: Grant, why: tuple[int, str, float] | None, before_seq: int) -> bool:
        if why is None or why[0] >= before_seq:
            return False
        seq, reason, ts = why
        if reason == "box-dead":
            return True
        return reason == "holder-died" and any(
            ts - 1_000 <= at <= ts + DEATH_LOGGED_WITHIN_MS for at in deaths.get(grant.box, [])
        )

    for resource, resource_grants in grants.items():
        for grant in resource_grants:
            if (resource, grant.token) not in granted_seq:
                tally.fail(
                    "fencing tokens increasing",
                    f"{resource}: token {grant.token} heard by {grant.worker} is not "
                    "in the audit log",
                    grant.ack,
                )
        # Real time: a grant answered before another was asked has the smaller token.
        by_sent = sorted(resource_grants, key=lambda g: g.sent)
        by_ack = sorted(resource_grants, key=lambda g: g.ack)
        best, i = None, 0
        for grant in by_sent:
            while i < len(by_ack) and by_ack[i].ack < grant.sent:
                if best is None or by_ack[i].token > best.token:
                    best = by_ack[i]
                i += 1
            tally.checks["fencing tokens increasing"] += 1
            if best is not None and grant.token <= best.token:
                tally.token_regressions += 1
                tally.fail(
                    "fencing tokens increasing",
                    f"{resource}: {grant.worker} asked at {grant.sent:.0f} and got token "
                    f"{grant.token}, but {best.worker} had token {best.token} at "
                    f"{best.ack:.0f}",
                    grant.ack,
                )
        # Overlaps: a later grant answered inside an earlier grant's known validity.
        for later_index, later in enumerate(resource_grants):
            for earlier in resource_grants[:later_index]:
                if not any(start <= later.ack < end for start, end in earlier.intervals):
                    continue
                why = released.get((resource, earlier.token))
                if fenced_out(earlier, why, granted_seq.get((resource, later.token), 0)):
                    tally.overlaps_fenced += 1
                    continue
                tally.overlaps += 1
                tally.fail(
                    "overlapping grants",
                    f"{resource}: token {later.token} granted to {later.worker} (box "
                    f"{later.box}) at {later.ack:.0f} while token {earlier.token} of "
                    f"{earlier.worker} (box {earlier.box}) was valid until "
                    f"{max(e for _, e in earlier.intervals):.0f}; its release: {why}",
                    later.ack,
                )
            tally.checks["overlapping grants"] += 1
    # Stale holders: nothing of a token accepted once a greater one was answered.
    first_greater: dict[str, list[tuple[float, int]]] = {
        resource: sorted((g.ack, g.token) for g in resource_grants)
        for resource, resource_grants in grants.items()
    }

    def superseded_at(resource: str, token: int) -> float | None:
        for ack, other in first_greater.get(resource, []):
            if other > token:
                return ack
        return None

    accepted = {"renew": "renewed", "released": "released", "fx_ack": "committed"}
    sent_of: dict[tuple[str, str, int], float] = {}
    for event in events:
        if event["ev"] == "release":
            sent_of[(event["worker"], event["res"], event["token"])] = event["sent"]
    for event in events:
        ev = event["ev"]
        if ev in ("renew_refused", "fx_refused", "release_refused"):
            tally.stale_refused += 1
        if ev not in accepted:
            continue
        resource, token = event["res"], event["token"]
        sent = event.get("sent") or sent_of.get((event["worker"], resource, token))
        at = superseded_at(resource, token)
        tally.checks["stale holder accepted"] += 1
        if at is not None and sent is not None and sent > at:
            tally.stale_accepted += 1
            tally.fail(
                "stale holder accepted",
                f"{resource}: {event['worker']}'s {ev} of token {token} sent at "
                f"{sent:.0f} was {accepted[ev]}, though a greater token was granted "
                f"at {at:.0f}",
                sent,
            )


def gather_evidence(fleet: Fleet, tally: Tally, window_ms: float = 3000) -> None:
    """The daemons' log lines and the faults around each failure's moment."""
    logs = {name: read_log(box.log_path) for name, box in fleet.boxes.items()}
    for message, at in tally.moments[:5]:
        tally.evidence.append(f"around {message[:120]}...")
        for fault in tally.faults:
            if fault.began - window_ms <= at <= (fault.healed or fault.began) + 10 * window_ms:
                tally.evidence.append(
                    f"  fault: {fault.kind} {fault.box or ''} at {fault.began:.0f}, healed "
                    f"{fault.healed:.0f}: {fault.detail}"
                )
        for name, records in logs.items():
            for record in records:
                stamp = log_time_ms(record)
                if stamp is not None and abs(stamp - at) <= window_ms:
                    tally.evidence.append(f"  box {name}: {json.dumps(record)[:400]}")


# --- the schedule -------------------------------------------------------------------------------


def schedule(kinds: tuple[str, ...], count: int, rng: random.Random) -> Iterator[str]:
    """``count`` of ``kinds``: all of them in a random order, again and again."""
    round_: list[str] = []
    for _ in range(count):
        if not round_:
            round_ = list(kinds)
            rng.shuffle(round_)
        yield round_.pop()


@dataclass(frozen=True)
class Settings:
    kills: int = 30
    idem_workers: int = 2  # per box
    lease_workers: int = 2
    effect_workers: int = 1
    gap: tuple[float, float] = (0.5, 2.0)  # seconds of load between two faults
    # How the daemon faults go (kill_daemon), cycled in a random order like the kinds.
    daemon_modes: tuple[str, ...] = (
        "sigkill",
        "long",
        "batch.after_commit",
        "sigkill",
        "batch.before_commit",
    )
    pg_downtime: tuple[float, float] = (0.1, 1.5)


QUICK = Settings(
    kills=6,
    idem_workers=2,
    lease_workers=2,
    effect_workers=1,
    gap=(0.3, 0.8),
    daemon_modes=("sigkill", "batch.after_commit"),
    pg_downtime=(0.1, 0.5),
)


def torture(
    settings: Settings,
    *,
    seed: int,
    workdir: Path,
    faults: tuple[str, ...],
    keep: bool = False,
    verbose: bool = False,
) -> Tally:
    for kind in faults:
        if kind not in FAULTS:
            raise ValueError(f"unknown fault {kind!r}: one of {', '.join(FAULTS)}")
    if "partition" in faults and proxy_class() is None:
        raise ValueError("partition needs tests/tcp_proxy.py")
    rng = random.Random(seed)
    random.seed(seed)  # the sleeps inside the faults
    tally = Tally()
    phase = time.monotonic()

    def lap(name: str) -> None:
        nonlocal phase
        tally.phases[name] = time.monotonic() - phase
        phase = time.monotonic()
        if verbose:
            print(f"phase {name}: {tally.phases[name]:.1f} s", file=sys.stderr)

    fleet = Fleet(workdir, faults, seed)
    failed = True
    try:
        fleet.start(
            {
                "idem": settings.idem_workers,
                "lease": settings.lease_workers,
                "effect": settings.effect_workers,
            }
        )
        lap("setup")
        modes = schedule(settings.daemon_modes, settings.kills, rng)
        for kind in schedule(faults, settings.kills, rng):
            time.sleep(rng.uniform(*settings.gap))
            box = fleet.boxes[rng.choice(BOXES)]
            if kind == "daemon":
                fault = fleet.kill_daemon(box, next(modes), tally)
            elif kind == "postgres":
                fault = fleet.kill_postgres(rng.uniform(*settings.pg_downtime), tally)
            else:
                fault = fleet.partition(box, tally)
            fleet.recover(fault, tally)
            tally.faults.append(fault)
            tally.kills += 1
            if verbose:
                print(
                    f"{fault.kind} {fault.box or ''}: {fault.detail}, recovery "
                    f"{fault.recovery_s:.1f} s",
                    file=sys.stderr,
                )
        time.sleep(rng.uniform(*settings.gap))
        lap("faults")
        fleet.heal()
        fleet.stop_workers(tally)
        lap("stop")
        check(fleet, tally)
        lap("check")
        if tally.failures:
            gather_evidence(fleet, tally)
        failed = bool(tally.failures)
        return tally
    finally:
        fleet.close(keep=keep or failed)
        if keep or failed:
            tally.notes.append(f"cluster files kept: {fleet.cluster.root}")


# --- output --------------------------------------------------------------------------------------


INVARIANTS = (
    ("acknowledged writes lost", "keys acknowledged, read through both boxes and the db"),
    ("double executions", "keys executed (journal lines)"),
    ("effects lost", "effect commits acknowledged"),
    ("effects executed twice", "effects executed"),
    ("fencing tokens increasing", "grants (audit order and real-time order)"),
    ("server granted over a live lease", "grants in the audit log"),
    ("overlapping grants", "grants heard by workers"),
    ("stale holder accepted", "renewals, releases, commits accepted"),
)


def report(
    tally: Tally,
    seed: int,
    settings: Settings,
    faults: tuple[str, ...],
    elapsed: float,
    timeline: bool = True,
) -> str:
    lines = [
        f"two-box torture: seed={seed} faults={','.join(faults)} kills={settings.kills} "
        f"workers per box: idem={settings.idem_workers} lease={settings.lease_workers} "
        f"effect={settings.effect_workers}; presence {PRESENCE_INTERVAL_S} s / TTL "
        f"{PRESENCE_TTL_S} s, lease TTL {LEASE_TTL_MS / 1000:.0f} s",
        "",
        f"{'fault':<10} {'count':>5}  {'recovery s (p50 / max)':>22}  detail",
    ]
    for kind in FAULTS:
        mine = [f for f in tally.faults if f.kind == kind]
        if not mine:
            continue
        recoveries = sorted(f.recovery_s for f in mine)
        per_box = Counter(f.box for f in mine if f.box)
        boxes = ", ".join(f"box {b} {n}" for b, n in sorted(per_box.items()))
        modes = ", ".join(
            f"{m} {n}" for m, n in sorted(Counter(f.mode for f in mine if f.mode).items())
        )
        dead = sum("declared dead" in f.detail for f in mine)
        stall = max(f.other_stall_s for f in mine)
        parts = (
            boxes,
            modes,
            f"declared dead {dead}" if dead else "",
            f"the other box stalled up to {stall:.1f} s" if kind == "partition" else "",
        )
        detail = "; ".join(part for part in parts if part)
        lines.append(
            f"{kind:<10} {len(mine):>5}  {recoveries[len(recoveries) // 2]:>10.1f} / "
            f"{recoveries[-1]:<9.1f}  {detail}"
        )
    if timeline:
        lines += [
            "",
            "each fault, in order (recovery: s from the heal until both boxes served a write):",
        ]
        for number, fault in enumerate(tally.faults, 1):
            stall = (
                f", other box stalled {fault.other_stall_s:.1f} s"
                if fault.kind == "partition"
                else ""
            )
            lines.append(
                f"  {number:>3}. {fault.kind:<9} {fault.box or '-':<2} {fault.detail}{stall}; "
                f"recovery {fault.recovery_s:.1f} s"
            )
    lines += [
        "",
        f"{'invariant':<34} {'checked':>8} {'violations':>10}  what was checked",
    ]
    for name, what in INVARIANTS:
        lines.append(f"{name:<34} {tally.checks[name]:>8} {tally.violations[name]:>10}  {what}")
    for name in sorted(set(tally.violations) - {n for n, _ in INVARIANTS}):
        lines.append(f"{name:<34} {'':>8} {tally.violations[name]:>10}")
    lines += [
        "",
        f"idempotent steps: {tally.operations} executed, {tally.acknowledged} acknowledged, "
        f"{tally.unknown_outcomes} outcome_unknown (not run again)",
        f"leases: {tally.grants} grants heard ({tally.renewals} renewals), "
        f"{tally.overlaps_fenced} grants over a holder fenced out by its box's death, "
        f"{tally.stale_refused} late renew/release/commit refused",
        f"effects: {tally.effects_executed} executed, {tally.effects_committed} committed; "
        f"boxes declared dead: {tally.box_deaths} ({tally.unlogged_deaths} of them logged by "
        "no box: box_declared_dead missing)",
        "phases: " + ", ".join(f"{name} {secs:.1f} s" for name, secs in tally.phases.items()),
        "",
        f"seed={seed} " + tally.line(elapsed),
    ]
    lines += [f"FAILED: {failure}" for failure in tally.failures[:20]]
    if len(tally.failures) > 20:
        lines.append(f"... and {len(tally.failures) - 20} more")
    lines += tally.evidence[:60]
    lines += [f"note: {note}" for note in tally.notes[:10]]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--kills", type=int, default=None, help="faults in all (default 30)")
    parser.add_argument(
        "--faults",
        default=",".join(available_faults()),
        help=f"comma-separated, of {', '.join(FAULTS)} (default: all this machine can do)",
    )
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--quick", action="store_true", help="~20 s: two faults of each kind")
    parser.add_argument("--keep", action="store_true", help="keep the work dir and cluster")
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--worker", choices=sorted(ROLES), help=argparse.SUPPRESS)
    parser.add_argument("--box", help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--socket", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the torture stops its workers
        worker_main(args.worker, args.box, args.index, args.socket, args.out, args.seed)
        return 0
    from pg_cluster import postgres_available

    why = postgres_available()
    if why is not None:
        print(f"PostgreSQL unavailable: {why}", file=sys.stderr)
        return 2
    settings = QUICK if args.quick else Settings()
    if args.kills is not None:
        settings = dataclasses.replace(settings, kills=args.kills)
    faults = tuple(kind for kind in args.faults.split(",") if kind)
    seed = args.seed if args.seed is not None else random.randrange(2**32)
    workdir = Path(tempfile.mkdtemp(prefix="tboxes-", dir="/tmp"))
    started = time.monotonic()
    tally = torture(
        settings, seed=seed, workdir=workdir, faults=faults, keep=args.keep, verbose=args.verbose
    )
    print(report(tally, seed, settings, faults, time.monotonic() - started))
    if not args.keep and not tally.failures:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        print(f"work dir kept: {workdir}")
    print(json.dumps({"failures": len(tally.failures)}))
    return 1 if tally.failures else 0


if __name__ == "__main__":
    sys.exit(main())
