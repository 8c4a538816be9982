"""Crash torture: kill -9 the daemon again and again under load, and check after every
restart that nothing acknowledged was lost and no effect ran twice.

    .venv/bin/python bench/torture.py --kills 200 --workers 16

Worker processes run the idempotent-effect protocol exactly as the README tells
users to (``run_once``: claim -> effect -> complete, reconnecting and retrying
the same key after any lost connection). Each effect appends one line naming
its key to an effect log the daemon does not own, then registers a fleet row
(itself idempotent under its own key). A killer sends SIGKILL to the daemon at
random moments, or (``--crash-points``, default on) arms a named crash point
inside the daemon (before commit, after commit before reply, inside
reconciliation, inside the first migration), then restarts it. With the
workers frozen (SIGSTOP), an invariant checker verifies:

* no key is ``in_progress`` (start-up reconciliation settled them all);
* every key a worker saw acknowledged is ``completed`` with the same result;
* no key's effect appears more than once in the effect logs;
* every acknowledged fleet row exists;
* the owner epoch went up by exactly one per successful start;
* ``PRAGMA integrity_check`` is ``ok``.

It prints one summary line: kills, operations, acknowledged, lost, double
effects, unknown outcomes. Exit status 1 if any invariant failed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from benchlib import Daemon

OPERATION = "torture.spawn"
CRASH_POINTS = ("batch.before_commit", "batch.after_commit", "reconcile.before_commit")


# --- the worker (a separate process) ------------------------------------------------------


def worker_main(socket_path: str, worker: int, out_dir: str) -> None:
    """Claim -> effect -> complete, key after key, until the stop file appears."""
    from towerd.client import (
        Client,
        IdempotencyInProgress,
        OutcomeUnknown,
        Unavailable,
        run_once,
    )

    out = Path(out_dir)
    effects = os.open(out / f"effects-{worker}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    acks = os.open(out / f"acks-{worker}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    stop = out / "stop"
    for n in range(10**9):
        if stop.exists():
            return
        key = f"w{worker}-k{n}"

        def effect(effect_ref: str, key: str = key) -> dict[str, str]:
            os.write(effects, f"{key} {effect_ref}\n".encode())  # the external effect
            while True:  # the fleet row, idempotent under its own key
                try:
                    with Client(socket_path, timeout=10) as client:
                        client.session_register(
                            cwd="/torture",
                            agent="torture",
                            session_id=effect_ref,
                            idempotency_key=f"register-{key}",
                        )
                    return {"session_id": effect_ref}
                except Unavailable:
                    time.sleep(0.02)  # the daemon is restarting

        try:
            result = run_once(
                OPERATION,
                key,
                effect,
                payload={"worker": worker, "n": n},
                socket_path=socket_path,
                attempts=100_000,
                backoff=0.01,
                max_backoff=0.1,
            )
            os.write(acks, f"ACK {key} {result['session_id']}\n".encode())
        except (OutcomeUnknown, IdempotencyInProgress) as exc:
            os.write(acks, f"UNKNOWN {key} {exc.code}\n".encode())


# --- the invariant checker -------------------------------------------------------------------


@dataclass
class Tally:
    kills: int = 0
    crash_points: Counter[str] = field(default_factory=Counter)
    checks: int = 0
    failures: list[str] = field(default_factory=list)
    operations: int = 0
    acknowledged: int = 0
    lost: int = 0
    double_effects: int = 0
    unknown_outcomes: int = 0

    def line(self, elapsed: float) -> str:
        points = ",".join(f"{name}={count}" for name, count in sorted(self.crash_points.items()))
        return (
            f"kills={self.kills} operations={self.operations} acknowledged={self.acknowledged} "
            f"lost={self.lost} double_effects={self.double_effects} "
            f"unknown_outcomes={self.unknown_outcomes} checks={self.checks} "
            f"crash_points=[{points}] elapsed={elapsed:.1f}s"
        )


def _complete_lines(path: Path) -> list[list[str]]:
    data = path.read_text() if path.exists() else ""
    return [line.split() for line in data.split("\n")[:-1]]  # a partial last line waits


def check_invariants(
    daemon: Daemon, out: Path, workers: int, tally: Tally, epoch: int | None
) -> int:
    """Verify every invariant with the workers frozen; returns the daemon's epoch."""
    failures: list[str] = []
    acked: dict[str, str] = {}
    unknown = 0
    effects: Counter[str] = Counter()
    for worker in range(workers):
        for fields in _complete_lines(out / f"acks-{worker}.log"):
            if fields[0] == "ACK":
                acked[fields[1]] = fields[2]
            else:
                unknown += 1
        for fields in _complete_lines(out / f"effects-{worker}.log"):
            effects[fields[0]] += 1
    db = sqlite3.connect(f"file:{daemon.state_dir / 'towerd.db'}?mode=ro", uri=True)
    try:
        in_progress = db.execute(
            "SELECT count(*) FROM idempotency WHERE state = 'in_progress'"
        ).fetchone()[0]
        if in_progress:
            failures.append(f"{in_progress} keys still in_progress after reconciliation")
        keys = {
            key: (state, result)
            for key, state, result in db.execute(
                "SELECT key, state, result FROM idempotency WHERE operation = ?", (OPERATION,)
            )
        }
        sessions = {row[0] for row in db.execute("SELECT session_id FROM sessions")}
        new_epoch = db.execute("SELECT max(owner_epoch) FROM daemons").fetchone()[0]
        integrity = db.execute("PRAGMA integrity_check").fetchall()
        outcome_unknown = db.execute(
            "SELECT count(*) FROM idempotency WHERE state = 'outcome_unknown'"
        ).fetchone()[0]
    finally:
        db.close()
    import msgspec

    lost = 0
    for key, session_id in acked.items():
        state, result = keys.get(key, (None, None))
        stored = msgspec.msgpack.decode(result) if result else None
        if state != "completed" or not stored or stored.get("session_id") != session_id:
            lost += 1
            failures.append(f"acknowledged {key} is {state} with {stored}, expected {session_id}")
        elif session_id not in sessions:
            lost += 1
            failures.append(f"acknowledged {key}: fleet row {session_id} is missing")
    doubles = [key for key, count in effects.items() if count > 1]
    if doubles:
        failures.append(f"effects ran twice: {doubles[:5]}")
    if integrity != [("ok",)]:
        failures.append(f"integrity_check: {integrity[:3]}")
    if epoch is not None and new_epoch != epoch + 1:
        failures.append(f"owner epoch went from {epoch} to {new_epoch}, not +1")
    tally.checks += 1
    tally.operations = len(effects)
    tally.acknowledged = len(acked)
    tally.lost = max(tally.lost, lost)
    tally.double_effects = max(tally.double_effects, len(doubles))
    tally.unknown_outcomes = max(unknown, outcome_unknown)
    tally.failures += failures
    return new_epoch


# --- the killer ---------------------------------------------------------------------------------


def torture(
    kills: int, workers: int, *, seed: int, crash_points: bool, workdir: Path, verbose: bool = False
) -> Tally:
    rng = random.Random(seed)
    out = workdir / "out"
    out.mkdir(parents=True)
    daemon = Daemon(workdir)
    tally = Tally()
    if crash_points:  # the very first start dies inside its migration
        if not daemon.start("migrate.before_commit"):
            tally.kills += 1
            tally.crash_points["migrate.before_commit"] += 1
    if not daemon.start():
        raise RuntimeError("the daemon failed to start")
    epoch = check_invariants(daemon, out, 0, tally, None)
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--worker",
                str(worker),
                "--socket",
                str(daemon.socket_path),
                "--out",
                str(out),
            ]
        )
        for worker in range(workers)
    ]
    armed: str | None = None
    try:
        while tally.kills < kills:
            time.sleep(rng.uniform(0.02, 0.4))  # a random moment under load, not a sync wait
            if armed and daemon.died_by_itself(timeout=5.0):
                tally.crash_points[armed.split(":")[0]] += 1
            else:
                daemon.kill()
            tally.kills += 1
            for proc in procs:
                proc.send_signal(signal.SIGSTOP)
            armed = None
            if crash_points and rng.random() < 0.4:
                point = rng.choice(CRASH_POINTS)
                armed = (
                    point if point == "reconcile.before_commit" else f"{point}:{rng.randint(1, 40)}"
                )
            if not daemon.start(armed):  # died inside its start-up reconciliation
                tally.crash_points[armed.split(":")[0]] += 1
                tally.kills += 1
                armed = None
                if not daemon.start():
                    raise RuntimeError("the daemon failed to start")
            epoch = check_invariants(daemon, out, workers, tally, epoch)
            if verbose:
                print(tally.line(0), file=sys.stderr)
            for proc in procs:
                proc.send_signal(signal.SIGCONT)
            if tally.failures:
                break
    finally:
        # Let the workers finish their current key against a live, unarmed daemon,
        # whatever ended the loop (an exception propagates after this).
        (out / "stop").touch()
        if armed or daemon.proc is None or daemon.proc.poll() is not None:
            daemon.kill()
            if not daemon.start():
                raise RuntimeError("the daemon failed to start")
            epoch += 1  # a start the checker did not see
        for proc in procs:
            proc.send_signal(signal.SIGCONT)
        for proc in procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                tally.failures.append(f"worker {proc.pid} did not stop within 60 s")
    daemon.kill()
    for proc in procs:
        proc.send_signal(signal.SIGSTOP)
    if daemon.start():
        check_invariants(daemon, out, workers, tally, epoch)
        daemon.stop()
    return tally


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--kills", type=int, default=200)
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--no-crash-points", action="store_true")
    parser.add_argument("--keep", action="store_true", help="keep the work dir for inspection")
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--socket", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker_main(args.socket, args.worker, args.out)
        return 0
    seed = args.seed if args.seed is not None else random.randrange(2**32)
    workdir = Path(tempfile.mkdtemp(prefix="torture-", dir="/tmp"))
    started = time.monotonic()
    tally = torture(
        args.kills,
        args.workers,
        seed=seed,
        crash_points=not args.no_crash_points,
        workdir=workdir,
        verbose=args.verbose,
    )
    print(f"seed={seed} workers={args.workers} " + tally.line(time.monotonic() - started))
    for failure in tally.failures[:20]:
        print(f"FAILED: {failure}")
    if not args.keep and not tally.failures:
        subprocess.run(["rm", "-rf", str(workdir)], check=False)
    else:
        print(f"work dir kept: {workdir}")
    print(json.dumps({"failures": len(tally.failures)}))
    return 1 if tally.failures else 0


if __name__ == "__main__":
    sys.exit(main())
