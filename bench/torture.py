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
reconciliation, inside the first migration), then restarts it. ``--faults`` adds
the faults users meet besides crashes (default: every one this machine can do):

* ``intruder``: now and then a second towerd with another state dir is started on
  the same socket; it must be refused (exit 75) and the first must keep serving;
* ``clock``: the daemon runs under libfaketime and its wall clock is stepped at
  random (+90 s, +25 h, -1 h, +2 h) while the expiry pass runs every half second:
  a completed key expiring early would show up as a lost acknowledgement;
* ``disk``: the state dir lives on a 64 MiB tmpfs in a mount namespace, filled up
  now and then; a restart while it is full must be refused (exit 78), and
  succeed once it is freed.

With the workers frozen (SIGSTOP), an invariant checker verifies:

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

from benchlib import TOWERD, Daemon

OPERATION = "torture.spawn"
CRASH_POINTS = ("batch.before_commit", "batch.after_commit", "reconcile.before_commit")
FAULTS = ("intruder", "clock", "disk")
FAKETIME = next(iter(sorted(Path("/usr/lib").glob("*/faketime/libfaketimeMT.so.1"))), Path("-"))
CLOCK_STEPS = (90, 25 * 3600, -3600, 2 * 3600)  # seconds added to the daemon's wall clock
EXIT_ALREADY_RUNNING, EXIT_REFUSED = 75, 78


def available_faults() -> tuple[str, ...]:
    """The faults this machine can inflict: the clock needs libfaketime, the disk root
    and mount namespaces."""
    faults = ["intruder"]
    if FAKETIME.exists():
        faults.append("clock")
    if os.geteuid() == 0 and subprocess.run(["unshare", "-m", "true"]).returncode == 0:
        faults.append("disk")
    return tuple(faults)


# --- the worker (a separate process) ------------------------------------------------------


def worker_main(socket_path: str, worker: int, out_dir: str) -> None:
    """Claim -> effect -> complete, key after key, until the stop file appears."""
    from towerd.client import (
        Client,
        IdempotencyInProgress,
        OutcomeUnknown,
        StorageFull,
        Unavailable,
        run_once,
    )

    out = Path(out_dir)
    effects = os.open(out / f"effects-{worker}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    acks = os.open(out / f"acks-{worker}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    stop = out / "stop"
    n = 0
    while True:
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
                except (Unavailable, StorageFull):
                    time.sleep(0.02)  # the daemon is restarting, or its disk is full

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
        except StorageFull:
            time.sleep(0.05)  # the claim wrote nothing: the same key again, later
            continue
        n += 1


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
    faults: Counter[str] = field(default_factory=Counter)

    def line(self, elapsed: float) -> str:
        points = ",".join(f"{name}={count}" for name, count in sorted(self.crash_points.items()))
        faults = ",".join(f"{name}={count}" for name, count in sorted(self.faults.items()))
        return (
            f"kills={self.kills} operations={self.operations} acknowledged={self.acknowledged} "
            f"lost={self.lost} double_effects={self.double_effects} "
            f"unknown_outcomes={self.unknown_outcomes} checks={self.checks} "
            f"crash_points=[{points}] faults=[{faults}] elapsed={elapsed:.1f}s"
        )


def _complete_lines(path: Path) -> list[list[str]]:
    data = path.read_text() if path.exists() else ""
    return [line.split() for line in data.split("\n")[:-1]]  # a partial last line waits


def snapshot(db_path: str) -> dict:
    """What the checker needs from the database, read-only, as JSON-able values."""
    import msgspec

    db = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
    try:
        count = "SELECT count(*) FROM idempotency WHERE state = ?"
        return {
            "in_progress": db.execute(count, ("in_progress",)).fetchone()[0],
            "outcome_unknown": db.execute(count, ("outcome_unknown",)).fetchone()[0],
            "keys": [
                (key, state, msgspec.msgpack.decode(result) if result else None)
                for key, state, result in db.execute(
                    "SELECT key, state, result FROM idempotency WHERE operation = ?",
                    (OPERATION,),
                )
            ],
            "sessions": [row[0] for row in db.execute("SELECT session_id FROM sessions")],
            "epoch": db.execute("SELECT max(owner_epoch) FROM daemons").fetchone()[0],
            "integrity": [row[0] for row in db.execute("PRAGMA integrity_check")],
        }
    finally:
        db.close()


def read_store(daemon: Daemon) -> dict:
    """:func:`snapshot` of the daemon's database, from inside its mount namespace when
    it runs in one (SQLite resolves /proc/PID/root paths to the outside view)."""
    db_path = str(daemon.state_dir / "towerd.db")
    if not daemon.prefix:
        return snapshot(db_path)
    run = subprocess.run(
        [*daemon.prefix, sys.executable, __file__, "--snapshot", db_path],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(run.stdout)


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
    store = read_store(daemon)
    if store["in_progress"]:
        failures.append(f"{store['in_progress']} keys still in_progress after reconciliation")
    keys = {key: (state, result) for key, state, result in store["keys"]}
    sessions = set(store["sessions"])
    new_epoch, integrity, outcome_unknown = (
        store["epoch"],
        store["integrity"],
        store["outcome_unknown"],
    )
    lost = 0
    for key, session_id in acked.items():
        state, stored = keys.get(key, (None, None))
        if state != "completed" or not stored or stored.get("session_id") != session_id:
            lost += 1
            failures.append(f"acknowledged {key} is {state} with {stored}, expected {session_id}")
        elif session_id not in sessions:
            lost += 1
            failures.append(f"acknowledged {key}: fleet row {session_id} is missing")
    doubles = [key for key, count in effects.items() if count > 1]
    if doubles:
        failures.append(f"effects ran twice: {doubles[:5]}")
    if integrity != ["ok"]:
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


# --- the other faults -------------------------------------------------------------------------


class Faults:
    """What ``--faults`` adds to the kills: a socket intruder, wall-clock steps, a full
    disk. Each is inflicted between kills, at random, while the workers run."""

    def __init__(self, kinds: tuple[str, ...], rng: random.Random, workdir: Path) -> None:
        self.kinds = set(kinds)
        self.rng = rng
        self.workdir = workdir
        self.offset = 0  # seconds libfaketime adds to the daemon's wall clock
        self.clock_file = workdir / "faketime"
        self.holder: subprocess.Popen[bytes] | None = None  # keeps the mount namespace
        self.mount = workdir / "disk"
        self.filler: str | None = None
        if "clock" in self.kinds:
            self.clock_file.write_text("+0s\n")
        if "disk" in self.kinds:
            self._mount_small_disk()

    def _mount_small_disk(self) -> None:
        self.mount.mkdir(mode=0o700)
        self.holder = subprocess.Popen(
            ["unshare", "-m", "sh", "-c",
             'mount -t tmpfs -o size=128m,mode=0700 tmpfs "$0" && touch "$0/.mounted" '
             "&& exec sleep 1000000", str(self.mount)]
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while not os.path.exists(self.inside(".mounted")):
            if time.monotonic() > deadline or self.holder.poll() is not None:
                raise RuntimeError("could not mount the small disk")
            time.sleep(0.01)

    def inside(self, name: str) -> str:
        """A path on the small disk, as this (outside) process reaches it."""
        assert self.holder is not None
        return f"/proc/{self.holder.pid}/root{self.mount}/{name}"

    def daemon(self, workdir: Path) -> Daemon:
        env, prefix, state_dir, extra = {}, [], None, []
        if "clock" in self.kinds:
            env = {"LD_PRELOAD": str(FAKETIME), "FAKETIME_TIMESTAMP_FILE": str(self.clock_file),
                   "FAKETIME_CACHE_DURATION": "1", "DONT_FAKE_MONOTONIC": "1"}  # fmt: skip
            extra = ["--expiry-interval", "0.5"]  # an early expiry would lose acked keys
        if self.holder is not None:
            prefix = ["nsenter", "--target", str(self.holder.pid), "--mount", "--"]
            state_dir = self.mount / "state"
        return Daemon(workdir, extra, state_dir=state_dir, env=env, prefix=prefix)

    def inflict(self, daemon: Daemon, tally: Tally) -> None:
        """Maybe one of each fault, now."""
        if "intruder" in self.kinds and self.rng.random() < 0.15:
            self.intrude(daemon, tally)
        if "clock" in self.kinds and self.rng.random() < 0.3:
            self.offset += self.rng.choice(CLOCK_STEPS)
            staging = self.clock_file.with_suffix(".new")
            staging.write_text(f"{self.offset:+d}s\n")
            os.replace(staging, self.clock_file)
            tally.faults["clock_steps"] += 1
        if "disk" in self.kinds:
            if self.filler is None and self.rng.random() < 0.2:
                self.filler = fill(self.inside(""))
                tally.faults["disk_full"] += 1
            elif self.filler is not None:
                self.free()

    def intrude(self, daemon: Daemon, tally: Tally) -> None:
        """A second towerd, another state dir, the same socket: refused, first unharmed."""
        from towerd.client import Client

        env = {k: v for k, v in os.environ.items() if not k.startswith(("TOWERD_", "NOTIFY"))}
        intruder = subprocess.run(
            [TOWERD, "--socket", str(daemon.socket_path), "--state-dir",
             str(self.workdir / "intruder"), "--log-format", "json"],
            env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        tally.faults["intruders"] += 1
        if intruder.returncode != EXIT_ALREADY_RUNNING:
            tally.failures.append(f"intruder exited {intruder.returncode}: {intruder.stderr}")
        with Client(daemon.socket_path, timeout=10) as client:
            pid = client.status()["pid"]
        if pid != daemon.pid:
            tally.failures.append(f"after the intruder the socket answers pid {pid}")
        if (self.workdir / "intruder" / "towerd.db").exists():
            tally.failures.append("the intruder opened a store")

    def start_on_full_disk(self, daemon: Daemon, tally: Tally) -> bool:
        """With the disk still full, try a start: it is refused (78), or it succeeds
        (SQLite found room in pages it already had); any other end is a failure. Space
        is freed either way. True if the daemon is now running."""
        if self.filler is None:
            return False
        started = daemon.start()
        if started:
            tally.faults["full_disk_starts_served"] += 1
        elif daemon.proc is not None and daemon.proc.returncode != EXIT_REFUSED:
            tally.failures.append(f"a start on a full disk exited {daemon.proc.returncode}")
        else:
            tally.faults["full_disk_starts_refused"] += 1
        self.free()
        return started

    def free(self) -> None:
        if self.filler is not None:
            os.unlink(self.filler)
            self.filler = None

    def close(self) -> None:
        self.free()
        if self.holder is not None:
            self.holder.kill()
            self.holder.wait()


def fill(directory: str) -> str:
    """Write a filler file until the filesystem is full; returns its path."""
    path = os.path.join(directory, "filler")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 65536)
    except OSError:
        pass  # ENOSPC: full
    finally:
        os.close(fd)
    return path


# --- the killer ---------------------------------------------------------------------------------


def torture(
    kills: int,
    workers: int,
    *,
    seed: int,
    crash_points: bool,
    workdir: Path,
    verbose: bool = False,
    faults: tuple[str, ...] = (),
) -> Tally:
    rng = random.Random(seed)
    out = workdir / "out"
    out.mkdir(parents=True)
    injector = Faults(faults, rng, workdir)
    try:
        return _torture(kills, workers, rng, crash_points, workdir, out, injector, verbose)
    finally:
        injector.close()


def _torture(
    kills: int,
    workers: int,
    rng: random.Random,
    crash_points: bool,
    workdir: Path,
    out: Path,
    injector: Faults,
    verbose: bool,
) -> Tally:
    daemon = injector.daemon(workdir)
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
            if not armed:
                injector.inflict(daemon, tally)
            if armed and daemon.died_by_itself(timeout=5.0):
                tally.crash_points[armed.split(":")[0]] += 1
            else:
                daemon.kill()
            tally.kills += 1
            for proc in procs:
                proc.send_signal(signal.SIGSTOP)
            armed = None
            if injector.start_on_full_disk(daemon, tally):
                pass  # running: that start is the restart
            elif crash_points and rng.random() < 0.4:
                point = rng.choice(CRASH_POINTS)
                armed = (
                    point if point == "reconcile.before_commit" else f"{point}:{rng.randint(1, 40)}"
                )
            if daemon.proc is not None and daemon.proc.poll() is None:
                pass
            elif not daemon.start(armed):  # died inside its start-up reconciliation
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
        injector.free()
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
    parser.add_argument(
        "--faults",
        default=",".join(available_faults()),
        help=f"comma-separated, of {', '.join(FAULTS)} (default: all this machine can do)",
    )
    parser.add_argument("--keep", action="store_true", help="keep the work dir for inspection")
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--socket", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--snapshot", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.snapshot is not None:
        print(json.dumps(snapshot(args.snapshot)))
        return 0
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
        faults=tuple(fault for fault in args.faults.split(",") if fault),
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
