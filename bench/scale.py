"""Scale of state: start-up, memory and listing with many keys and fleet rows.

    .venv/bin/python bench/scale.py [--sizes 10000,100000,1000000] [--fleet-rows 100000]
                                    [--quick] [--rebuild] [--cache-dir DIR]

For each size (idempotency keys; every size also holds ``--fleet-rows`` fleet
rows), a state database is built once and cached, then copied afresh for
every daemon start, so each start does the same work:

* start-up: spawning ``towerd`` until it sends READY=1, median of 3 starts,
  split into: until the start-up transaction begins (interpreter, imports,
  open, header/``quick_check``/shape checks, migrations), the start-up
  transaction (next epoch, taking the fleet rows, reconciling the keys:
  from the ``reconciled`` log line) and the rest up to READY. Also shown: the
  bare ``import towerd.daemon.main`` time and ``PRAGMA quick_check`` on the
  same file with plain sqlite3 (both also part of the first phase);
* the daemon's RSS after READY, after the listings, and its peak (VmHWM);
* ``status`` (median of 5);
* paging through the whole ``fleet.list`` and ``idem.list`` with the default
  page size, the first page alone (median of 5), and the largest page (the
  msgpack size of the decoded page re-encoded, plus the 4-byte prefix).

Building: towerd is started once on an empty state dir (it creates the schema,
its daemon id and epoch 1) and stopped; then the keys and rows are bulk
inserted with sqlite3 ``executemany`` in large transactions, under that daemon
id and epoch, for the principal the blocking client uses by default. Keys are
98% ``completed`` (updated in the last hour, so none expire), 1% ``in_progress``
(reconciled to ``outcome_unknown`` at every start) and 1% ``outcome_unknown``
(half of which have a fleet row as evidence and complete at start-up); 10% of
fleet rows are children of another row.

Cache: ``$TMPDIR/towerd-bench-cache-<uid>/scale/keys<K>-fleet<F>/state/towerd.db``
(plus ``manifest.json``), reused while younger than 12 hours (completed keys
expire after 24 h) and built for the same schema version; ``--rebuild``
forces a new build. The cache holds about 420 MiB for 10^6 keys; delete the
directory to reclaim it. Start-ups are measured with a warm page cache.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import msgspec

from benchlib import Daemon, machine
from towerd.client import Client
from towerd.daemon.store.schema import SCHEMA_VERSION
from towerd.protocol import DEFAULT_MAX_FRAME

BUILD_FORMAT = 1  # bump when the generated content changes
CACHE_MAX_AGE_S = 12 * 3600
STARTS = 3
REPEATS = 5
TARGET_KEYS = 1_000_000
TARGET_FLEET = 100_000
TARGET_STARTUP_S = 2.0
TARGET_RSS_MIB = 150.0
PRINCIPAL = f"uid:{os.geteuid()}:default"  # what Client() says in hello by default
OPERATIONS = ("git.push", "issue.comment", "bench.op", "session.spawn")
CHUNK = 100_000


def default_cache_dir() -> Path:
    return Path(tempfile.gettempdir()) / f"towerd-bench-cache-{os.geteuid()}" / "scale"


def private_dir(path: Path) -> Path:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    path.chmod(0o700)
    return path


# --- building ------------------------------------------------------------------------------


# The columns _session_rows fills, named: later schema steps added columns (the agent's
# process and liveness, left empty here: no agent runs), and a bare VALUES list broke.
SESSION_COLUMNS = (
    "session_id", "agent_session_id", "name", "cwd", "agent", "pinned", "last_attached_at",
    "exited", "parent", "prompt", "result", "transcript_path", "model", "effort", "target",
    "target_identity", "daemon_id", "owner_epoch", "updated_at",
)  # fmt: skip


def _session_rows(count: int, daemon_id: str, epoch: int, now: int) -> list[tuple[Any, ...]]:
    ids = [str(uuid.uuid4()) for _ in range(count)]
    rows = []
    for i, session_id in enumerate(ids):
        child = i % 10 == 9  # a child of the top-level row nine places back
        rows.append(
            (
                session_id,
                str(uuid.uuid4()),  # agent_session_id
                f"issue {i}: fix the flaky test in module {i % 97}",
                f"/home/dev/src/project-{i % 50}",
                ("claude", "codex", "aider")[i % 3],
                int(i % 20 == 0),
                now - (i % 86_400_000),
                int(i % 3 == 0),
                ids[i - 9] if child else None,
                f"Work on issue #{i}: reproduce the failure, write a regression test, fix the "
                f"root cause, and open a pull request against main (attempt {i % 4}).",
                "opened pull request" if i % 3 == 0 else None,
                f"/home/dev/.claude/projects/project-{i % 50}/{session_id}.jsonl",
                "claude-opus-4" if i % 2 else "gpt-5-codex",
                ("low", "medium", "high")[i % 3],
                f"tmux:agents:{i}",
                f"tmux-pane-%{i}",
                daemon_id,
                epoch,
                now - (i % 3_600_000),
            )
        )
    return rows


def _key_row(
    i: int, keys: int, daemon_id: str, now: int, session_ids: list[str]
) -> tuple[Any, ...]:
    """Key ``i`` of ``keys``: the last 1% in progress, the 1% before them unknown."""
    in_progress_from = keys - keys // 100
    unknown_from = in_progress_from - keys // 100
    updated_at = now - (i % 3_600_000)
    digest = hashlib.sha256(i.to_bytes(8, "little")).digest()
    if i >= unknown_from:
        operation = "session.spawn"
        state = "in_progress" if i >= in_progress_from else "outcome_unknown"
        with_evidence = state == "outcome_unknown" and i % 2 == 0 and session_ids
        effect_ref = session_ids[i % len(session_ids)] if with_evidence else str(uuid.uuid4())
        result = None
    else:
        operation = OPERATIONS[i % len(OPERATIONS)]
        state = "completed"
        effect_ref = str(uuid.uuid4())
        result = msgspec.msgpack.encode(
            {"session_id": effect_ref}
            if operation == "session.spawn"
            else {"ok": True, "ref": digest.hex()[:40]}
        )
    return (
        PRINCIPAL,
        operation,
        f"{operation}:k{i:08d}",
        digest,
        state,
        effect_ref,
        result,
        4_000_000 + i % 1000,  # holder pids long gone
        1,
        None,
        daemon_id,
        updated_at - 1000,
        updated_at,
    )


def build(cache_dir: Path, keys: int, fleet_rows: int, rebuild: bool) -> tuple[Path, dict]:
    """The cached database for this size, built first if missing or stale."""
    name = f"keys{keys}-fleet{fleet_rows}"
    final = cache_dir / name
    manifest_path = final / "manifest.json"
    if manifest_path.exists() and not rebuild:
        manifest = json.loads(manifest_path.read_text())
        fresh = time.time() - manifest["built_at"] < CACHE_MAX_AGE_S
        if fresh and manifest["schema"] == SCHEMA_VERSION and manifest["format"] == BUILD_FORMAT:
            return final / "state" / "towerd.db", manifest
    started = time.perf_counter()
    staging = cache_dir / f"{name}.building-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    private_dir(staging)
    daemon = Daemon(staging)  # creates the schema, the daemon id and epoch 1
    try:
        if not daemon.start():
            raise RuntimeError(f"towerd did not start; see {staging / 'daemon.log'}")
        if daemon.stop() != 0:
            raise RuntimeError(f"towerd did not stop cleanly; see {staging / 'daemon.log'}")
    finally:
        release(daemon)
    db_path = staging / "state" / "towerd.db"
    conn = sqlite3.connect(db_path, isolation_level=None)
    try:
        conn.execute("PRAGMA synchronous = OFF")  # a cache: rebuilt if a crash spoils it
        conn.execute("PRAGMA cache_size = -262144")
        (daemon_id,) = conn.execute("SELECT value FROM meta WHERE key = 'daemon_id'").fetchone()
        (epoch,) = conn.execute(
            "SELECT owner_epoch FROM daemons WHERE daemon_id = ?", (daemon_id,)
        ).fetchone()
        now = time.time_ns() // 1_000_000
        sessions = _session_rows(fleet_rows, daemon_id, epoch, now)
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany(
            f"INSERT INTO sessions ({', '.join(SESSION_COLUMNS)}) "
            f"VALUES ({', '.join('?' * len(SESSION_COLUMNS))})"
            if sessions
            else "SELECT 1",
            sessions,
        )
        conn.execute("COMMIT")
        session_ids = [row[0] for row in sessions]
        for start in range(0, keys, CHUNK):
            rows = [
                _key_row(i, keys, daemon_id, now, session_ids)
                for i in range(start, min(keys, start + CHUNK))
            ]
            conn.execute("BEGIN IMMEDIATE")
            conn.executemany(
                """INSERT INTO idempotency (principal, operation, key, payload_hash, state,
                       effect_ref, result, holder_pid, holder_start, attempt, daemon_id,
                       created_at, updated_at)
                   VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)""",
                rows,
            )
            conn.execute("COMMIT")
        counts = dict(conn.execute("SELECT state, count(*) FROM idempotency GROUP BY state"))
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        conn.close()
    manifest = {
        "built_at": now / 1000,
        "schema": SCHEMA_VERSION,
        "format": BUILD_FORMAT,
        "keys": keys,
        "fleet_rows": fleet_rows,
        "daemon_id": daemon_id,
        "states": counts,
        "build_seconds": round(time.perf_counter() - started, 1),
        "db_bytes": db_path.stat().st_size,
    }
    (staging / "manifest.json").write_text(json.dumps(manifest, indent=1))
    shutil.rmtree(final, ignore_errors=True)
    staging.rename(final)
    return final / "state" / "towerd.db", manifest


# --- measuring --------------------------------------------------------------------------------


def release(daemon: Daemon) -> None:
    """Close what the benchlib helper keeps open for a stopped daemon."""
    daemon.notify.close()
    daemon.log.close()


@dataclass
class Result:
    keys: int
    fleet_rows: int
    db_mib: float
    starts: list[float] = field(default_factory=list)
    to_tx: list[float] = field(default_factory=list)  # spawn -> start-up transaction begins
    in_tx: list[float] = field(default_factory=list)  # start-up transaction (+ reader open)
    quick_check: float = 0.0
    rss_ready: float = 0.0
    rss_listed: float = 0.0
    rss_peak: float = 0.0
    reconciliation: dict = field(default_factory=dict)
    status_s: float = 0.0
    fleet: dict = field(default_factory=dict)
    idem: dict = field(default_factory=dict)


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _log_time(log_path: Path, event: str) -> float | None:
    """Wall time (s since the epoch) of the last ``event`` line in a JSON log."""
    found = None
    for line in log_path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("event") == event:
            found = datetime.fromisoformat(entry["timestamp"].replace("Z", "+00:00")).timestamp()
    return found


def _proc_status(pid: int, field_name: str) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(field_name + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def import_seconds() -> float:
    """Interpreter start-up plus the daemon's imports, nothing else (median of 3)."""
    samples = []
    for _ in range(3):
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import towerd.daemon.main"], check=True)
        samples.append(time.perf_counter() - started)
    return _median(samples)


def quick_check_seconds(db_path: Path) -> float:
    conn = sqlite3.connect(db_path)
    try:
        started = time.perf_counter()
        conn.execute("PRAGMA quick_check").fetchall()
        return time.perf_counter() - started
    finally:
        conn.close()


def page_through(
    fetch, items_key: str, expected: int, limit_s: float, daemon_pid: int
) -> dict[str, Any]:
    """Every page from the start (stopping after ``limit_s`` s of walking, if > 0); the
    time of the whole walk (extrapolated from the items per second when it was cut
    short) and of the first page alone."""
    firsts = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        fetch(None)
        firsts.append(time.perf_counter() - started)
    total, pages, items, largest, cursor = 0.0, 0, 0, 0, None
    daemon_cpu = 0.0
    while True:
        cpu_before = _cpu_seconds(daemon_pid)
        started = time.perf_counter()
        page = fetch(cursor)
        total += time.perf_counter() - started
        daemon_cpu += _cpu_seconds(daemon_pid) - cpu_before
        pages += 1
        items += len(page[items_key])
        largest = max(largest, 4 + len(msgspec.msgpack.encode({"id": 2**31, "result": page})))
        cursor = page.get("next_cursor")
        if cursor is None or (limit_s > 0 and total > limit_s):
            break
    capped = cursor is not None
    return {
        "total": total * expected / items if capped and items else total,
        "walked": total,
        "daemon_cpu": daemon_cpu,
        "capped": capped,
        "first": _median(firsts),
        "pages": pages,
        "items": items,
        "expected": expected,
        "largest": largest,
    }


def measure(root: Path, db_path: Path, manifest: dict, walk_limit: float) -> Result:
    result = Result(manifest["keys"], manifest["fleet_rows"], db_path.stat().st_size / 2**20)
    daemon = None
    for trial in range(STARTS):
        workdir = private_dir(root / f"k{result.keys}-{trial}")
        state = private_dir(workdir / "state")
        shutil.copyfile(db_path, state / "towerd.db")
        (state / "towerd.db").chmod(0o600)
        if trial == 0:
            result.quick_check = quick_check_seconds(state / "towerd.db")
        daemon = Daemon(workdir, ["--log-level", "info"])
        spawned = time.time()
        started = time.perf_counter()
        if not daemon.start():
            raise RuntimeError(f"towerd did not start; see {workdir / 'daemon.log'}")
        result.starts.append(time.perf_counter() - started)
        result.rss_ready = daemon.rss_mib()
        with Client(daemon.socket_path) as client:
            report = client.status()["reconciliation"]
        reconciled = _log_time(workdir / "daemon.log", "reconciled")
        result.to_tx.append(report["at"] / 1000 - spawned)
        if reconciled is not None:
            result.in_tx.append(reconciled - report["at"] / 1000)
        result.reconciliation = report
        if trial < STARTS - 1:
            daemon.stop()
            release(daemon)
            shutil.rmtree(workdir, ignore_errors=True)
    assert daemon is not None
    try:
        with Client(daemon.socket_path) as client:
            samples = []
            for _ in range(REPEATS):
                started = time.perf_counter()
                client.status()
                samples.append(time.perf_counter() - started)
            result.status_s = _median(samples)
            status = client.status()
            result.fleet = page_through(
                lambda cursor: client.fleet_list(cursor=cursor),
                "sessions",
                status["sessions"],
                walk_limit,
                daemon.pid,
            )
            result.idem = page_through(
                lambda cursor: client.idem_list(cursor=cursor),
                "keys",
                sum(status["keys"].values()),
                walk_limit,
                daemon.pid,
            )
        result.rss_listed = daemon.rss_mib()
        result.rss_peak = _proc_status(daemon.pid, "VmHWM")
    finally:
        daemon.stop()
        release(daemon)
    return result


# --- report ---------------------------------------------------------------------------------


def report(results: list[Result], imports: float) -> None:
    print(
        f"{'keys':>9} {'fleet':>7} {'db MiB':>7} | {'startup s':>9} {'min-max':>11} "
        f"{'pre-tx s':>8} {'tx s':>6} {'rest s':>6} {'qcheck s':>8} | {'RSS ready':>9} "
        f"{'listed':>7} {'peak':>6} | {'status ms':>9}"
    )
    for r in results:
        start, pre, tx = _median(r.starts), _median(r.to_tx), _median(r.in_tx)
        print(
            f"{r.keys:>9} {r.fleet_rows:>7} {r.db_mib:>7.0f} | {start:>9.2f} "
            f"{f'{min(r.starts):.2f}-{max(r.starts):.2f}':>11} {pre:>8.2f} {tx:>6.2f} "
            f"{max(0.0, start - pre - tx):>6.2f} {r.quick_check:>8.2f} | {r.rss_ready:>9.1f} "
            f"{r.rss_listed:>7.1f} {r.rss_peak:>6.1f} | {r.status_s * 1000:>9.1f}"
        )
    print(
        f"\nstartup: spawn to READY=1, median of {STARTS} (fresh copy of the database each "
        "time, warm page cache); pre-tx: spawn until the start-up transaction begins "
        f"(includes {imports:.2f} s of interpreter + imports measured alone, and the "
        "checks, of which PRAGMA quick_check alone is qcheck); tx: the start-up transaction "
        "(epoch, fleet rows, reconciliation) and opening the reader; rest: up to READY. "
        "RSS in MiB (peak = VmHWM after the listings)."
    )
    print()
    print(
        f"{'keys':>9} {'list':>10} {'items':>8} {'pages':>6} {'whole s':>9} {'items/s':>9} "
        f"{'ms/page':>8} {'daemon %':>9} {'first ms':>9} {'largest page':>13}"
    )
    capped = False
    for r in results:
        for name, walk in (("fleet.list", r.fleet), ("idem.list", r.idem)):
            capped = capped or walk["capped"]
            whole = f"{'~' if walk['capped'] else ''}{walk['total']:.2f}"
            items = f"{walk['items']}{'*' if walk['capped'] else ''}"
            print(
                f"{r.keys:>9} {name:>10} {items:>8} {walk['pages']:>6} {whole:>9} "
                f"{walk['items'] / walk['walked']:>9.0f} "
                f"{walk['walked'] / walk['pages'] * 1000:>8.1f} "
                f"{100 * walk['daemon_cpu'] / walk['walked']:>8.0f}% "
                f"{walk['first'] * 1000:>9.1f} {walk['largest']:>13}"
            )
    print(
        "\nwhole: paging through everything with the default page size (500) from the "
        "blocking client; daemon %: the daemon's CPU time during the walk over its wall time "
        "(the rest is the client decoding and the socket); first: the first page alone "
        "(median of 5); largest page: bytes of the biggest response frame."
        + (
            " * walk stopped at the --walk-limit; ~whole is extrapolated from its items/s "
            "to every item at the rate walked."
            if capped
            else ""
        )
    )
    print("\nreconciliation at the last start of each size:")
    for r in results:
        fields = ("rows_taken", "marked_unknown", "completed_from_evidence", "still_unknown")
        print(
            f"  {r.keys:>9} keys: "
            + ", ".join(f"{name} {r.reconciliation.get(name)}" for name in (*fields, "expired"))
        )
    print()
    target = next(
        (r for r in results if r.keys == TARGET_KEYS and r.fleet_rows == TARGET_FLEET), None
    )
    if target is None:
        print(
            f"target: startup and RSS at {TARGET_KEYS} keys + {TARGET_FLEET} fleet rows: "
            "not measured in this run (run without --quick, or with that size) -> NOT met"
        )
    else:
        startup = _median(target.starts)
        print(
            f"target: startup with {TARGET_KEYS} keys + {TARGET_FLEET} fleet rows < "
            f"{TARGET_STARTUP_S:g} s: measured {startup:.2f} s -> "
            f"{'met' if startup < TARGET_STARTUP_S else 'NOT met'}"
        )
        rss = max(target.rss_ready, target.rss_listed, target.rss_peak)
        print(
            f"target: RSS with {TARGET_KEYS} keys + {TARGET_FLEET} fleet rows < "
            f"{TARGET_RSS_MIB:g} MB: measured {rss:.1f} MiB peak ({target.rss_ready:.1f} after "
            f"READY, {target.rss_listed:.1f} after listing everything) -> "
            f"{'met' if rss < TARGET_RSS_MIB else 'NOT met'}"
        )
    largest = max(max(r.fleet["largest"], r.idem["largest"]) for r in results)
    smallest, biggest = results[0], results[-1]
    first_small = max(smallest.fleet["first"], smallest.idem["first"])
    first_big = max(biggest.fleet["first"], biggest.idem["first"])
    bounded = largest <= DEFAULT_MAX_FRAME and first_big <= 2 * first_small + 0.005
    print(
        f"target: listing paged and bounded (every page <= {DEFAULT_MAX_FRAME} bytes; first "
        f"page at {biggest.keys} keys within 2x (+5 ms) of at {smallest.keys}): measured "
        f"largest page {largest} bytes, first page {first_big * 1000:.1f} ms vs "
        f"{first_small * 1000:.1f} ms -> {'met' if bounded else 'NOT met'}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes", default=None, help="comma-separated key counts (10000,100000,1000000)"
    )
    parser.add_argument("--fleet-rows", type=int, default=TARGET_FLEET)
    parser.add_argument("--quick", action="store_true", help="sizes 10^4 and 10^5 only")
    parser.add_argument("--rebuild", action="store_true", help="ignore cached databases")
    parser.add_argument("--cache-dir", type=Path, default=None)
    parser.add_argument(
        "--walk-limit",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="stop paging through one listing after this long and extrapolate (0: never)",
    )
    args = parser.parse_args()
    sizes = (
        [int(float(s)) for s in args.sizes.split(",")]
        if args.sizes
        else ([10_000, 100_000] if args.quick else [10_000, 100_000, 1_000_000])
    )
    cache_dir = private_dir(args.cache_dir or default_cache_dir())

    print(machine())
    print(
        f"scale of state: keys {', '.join(map(str, sizes))}, each with {args.fleet_rows} "
        f"fleet rows; cache {cache_dir}"
    )
    built = []
    for keys in sizes:
        db_path, manifest = build(cache_dir, keys, args.fleet_rows, args.rebuild)
        age = (time.time() - manifest["built_at"]) / 60
        print(
            f"  {keys} keys: {db_path} ({manifest['db_bytes'] / 2**20:.0f} MiB, built in "
            f"{manifest['build_seconds']} s, {age:.0f} min ago; states {manifest['states']})"
        )
        built.append((db_path, manifest))
    print()
    imports = import_seconds()
    root = Path(tempfile.mkdtemp(prefix="towerd-scale-"))
    try:
        results = [measure(root, db_path, manifest, args.walk_limit) for db_path, manifest in built]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report(results, imports)


if __name__ == "__main__":
    main()
