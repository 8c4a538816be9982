"""``towerctl doctor``: what is wrong with this towerd, and what to do about each finding.

Asks the daemon about its database when it answers (integrity, schema version,
WAL size, keys stuck ``outcome_unknown``); checks the socket and state
directories itself; and when no daemon answers, checks the database file
directly, read-only.
"""

from __future__ import annotations

import os
import sqlite3
import stat
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from towerd.client.sync import Client
from towerd.protocol.errors import StorageFull, TowerdError, Unavailable, store_unreachable
from towerd.protocol.paths import default_socket_path, default_state_dir

if TYPE_CHECKING:
    from towerd.client.results import DoctorResult, StatusResult

WAL_WARNING_BYTES = 64 * 1024 * 1024


@dataclass
class Finding:
    check: str
    status: str  # ok | warning | error
    detail: str
    fix: str = ""


def examine(
    socket_path: Path | None, state_dir: Path | None, principal: str | None, full: bool
) -> dict[str, Any]:
    socket_path = socket_path or Path(default_socket_path())
    findings: list[Finding] = []
    report: DoctorResult | None = None
    last_seen: list[Any] | None = None
    unreachable: str | None = None  # why the daemon cannot reach its store
    shared = False  # the store is PostgreSQL: no database file here, db_path is its DSN
    try:
        with Client(socket_path, principal=principal, timeout=60) as client:
            status = client.status()
            # A store the daemon cannot reach (status says so at once once it knows) is
            # asked nothing more: each call would wait out its 5 s deadline.
            unreachable = _unreachable_store(status.get("store"))
            if unreachable is None:
                try:
                    report = client.doctor(full=full)
                    last_seen = _last_seen(client)
                except Unavailable as exc:
                    if not store_unreachable(exc):
                        raise
                    unreachable = exc.message
        findings.append(
            Finding(
                "daemon",
                "ok",
                f"daemon {status['daemon_id']} pid {status['pid']} "
                f"epoch {status['owner_epoch']}, protocol {status['protocol']}",
            )
        )
        findings += _health_findings(status)
        findings += _fleet_clock_findings(status.get("store"))
        if unreachable is not None:
            findings.append(
                Finding(
                    "store",
                    "error",
                    f"the daemon cannot reach its store: {unreachable}",
                    "check the PostgreSQL server and the network path to it; the daemon "
                    "serves again by itself once it answers (a write answered `unavailable` "
                    "meanwhile: retry it with the same key)",
                )
            )
        store = status.get("store")
        shared = store is not None and store.get("backend") == "postgresql"
        if (told := status.get("state_dir")) is not None:
            state_dir = state_dir or Path(told)
        elif not shared:  # a daemon from before status named its state dir
            state_dir = state_dir or Path(status["db_path"]).parent
    except TowerdError as exc:
        findings.append(
            Finding(
                "daemon",
                "error",
                f"no daemon answers at {socket_path}: {exc.message}",
                "start it (`towerd`, or `systemctl --user start towerd.socket`), or pass "
                "the right --socket",
            )
        )
    findings += _private_path(socket_path.parent, "socket dir", want_dir=True)
    if socket_path.exists():
        findings += _private_path(socket_path, "socket", want_dir=False, socket=True)
    state_dir = state_dir or Path(default_state_dir())
    findings += _private_path(state_dir, "state dir", want_dir=True)
    db_path = state_dir / "towerd.db"
    findings += _disk_findings(state_dir)
    if shared:
        pass  # the database is the server's: its own checks come with the report below
    elif db_path.exists():
        findings += _private_path(db_path, "database file", want_dir=False)
    elif (state_dir / "daemon_id").exists():
        findings.append(
            Finding(
                "database",
                "error",
                f"{db_path} is missing, but {state_dir} held a store (its daemon_id record "
                "is there): towerd refuses to start afresh, which would forget every "
                "acknowledged key",
                f"restore the database from a backup (e.g. {state_dir / 'backups'}, or one "
                "`towerctl backup` made), or start towerd once with --new-store to begin "
                "an empty store on purpose",
            )
        )
    if report is not None:
        findings += _database_findings(report)
    elif db_path.exists() and not shared:
        findings += _offline_database_findings(db_path, full)
    findings += _hooks_findings(last_seen)
    return {
        "ok": all(finding.status == "ok" for finding in findings),
        "findings": [asdict(finding) for finding in findings],
        "report": report,
    }


def _private_path(path: Path, what: str, *, want_dir: bool, socket: bool = False) -> list[Finding]:
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return [
            Finding(
                what, "warning", f"{path} does not exist", "it is created when towerd first starts"
            )
        ]
    problems = []
    if stat.S_ISLNK(info.st_mode):
        problems.append("is a symlink")
    if info.st_uid != os.geteuid():
        problems.append(f"belongs to uid {info.st_uid}")
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o077:
        problems.append(f"has mode {mode:04o}")
    if not problems:
        return [Finding(what, "ok", f"{path} is private ({mode:04o})")]
    wanted = "700" if want_dir else "600"
    return [
        Finding(
            what,
            "error",
            f"{path} " + ", ".join(problems),
            f"`chmod {wanted} {path}` and make sure it belongs to you"
            + ("" if not socket else "; restarting towerd recreates the socket"),
        )
    ]


CLOCK_OFFSET_WARNING_MS = 60_000
DISK_WARNING_BYTES = 64 * 1024 * 1024


def _unreachable_store(store: Any) -> str | None:
    """Why the daemon cannot reach its store, if ``status`` says it cannot."""
    if not store or store.get("reachable", True):
        return None
    return str(store.get("error") or "no answer")


def _fleet_clock_findings(store: Any) -> list[Finding]:
    """PostgreSQL: the server's clock was stepped apart from the fleet's."""
    offset = (store or {}).get("clock_offset_ms") or 0  # the daemon reports over 1 s
    if not offset:
        return []
    way = "ahead of" if offset > 0 else "behind"
    return [
        Finding(
            "fleet clock",
            "warning",
            f"the PostgreSQL server's clock is {abs(offset) / 1000:.0f} s {way} the fleet's "
            "(it was stepped): TTLs go on in elapsed time, and the fleet's clock comes "
            "back to the server's at 1% of elapsed time",
            "fix the server's time source; times towerd shows are off by that much "
            "until the clocks agree",
        )
    ]


def _health_findings(status: StatusResult) -> list[Finding]:
    """The daemon's background tasks and its clock, as ``status`` reports them."""
    findings = []
    failing = [task for task in status.get("upkeep") or [] if task["failures"]]
    for task in failing:
        fix = (
            "free space on the disk holding the state dir; the task retries by itself"
            if task["last_error_code"] == StorageFull.code
            else "see the daemon's log (`upkeep_failed`); the task retries by itself"
        )
        findings.append(
            Finding(
                f"upkeep {task['name']}",
                "error",
                f"background task {task['name']} failed {task['failures']} time(s) in a "
                f"row ({task['last_error_code']}): {task['last_error']}",
                fix,
            )
        )
    if not failing:
        findings.append(Finding("upkeep", "ok", "every background task runs"))
    clock = status.get("clock")
    if clock and abs(clock["offset_ms"]) > CLOCK_OFFSET_WARNING_MS:
        findings.append(
            Finding(
                "clock",
                "warning",
                f"the wall clock is {clock['offset_ms'] / 1000:+.0f} s from towerd's clock "
                f"({clock['steps_detected']} step(s) seen): towerd measures TTLs in real "
                "elapsed time and shows its own times until the next reboot",
                "nothing to do for correctness; times shown by towerd are off by that much",
            )
        )
    return findings


def _disk_findings(state_dir: Path) -> list[Finding]:
    try:
        info = os.statvfs(state_dir)
    except OSError:
        return []
    free = info.f_bavail * info.f_frsize
    if free >= DISK_WARNING_BYTES:
        return [Finding("disk", "ok", f"{free // (1024 * 1024)} MiB free for {state_dir}")]
    return [
        Finding(
            "disk",
            "error" if free < 1024 * 1024 else "warning",
            f"only {free // 1024} KiB free on the disk holding {state_dir}: writes fail "
            "storage_full when it is full",
            "free some space on that disk",
        )
    ]


def verdict(check: str, healthy: bool, *, ok: str, problem: str, fix: str, level: str) -> Finding:
    """One check's finding: ``ok`` with its detail, or ``level`` with ``problem`` and ``fix``."""
    return Finding(check, "ok", ok) if healthy else Finding(check, level, problem, fix)


def _last_seen(client: Client) -> list[Any] | None:
    """When each event kind last arrived, per agent; None from a daemon that cannot say
    (one older than ``event.last_seen``): the hooks findings then go without it."""
    try:
        return list(client.event_last_seen()["kinds"])
    except TowerdError:
        return None


def _hooks_findings(last_seen: list[Any] | None) -> list[Finding]:
    """One finding per agent, from ``towerctl hooks status``'s verdict (user scope, and
    the current directory's project). Hooks not installed is information, not a fault:
    towerd works without them."""
    from towerd.client.agents import AGENTS
    from towerd.client.hooks_install import STATES, hooks_status

    try:
        agents = hooks_status(AGENTS, None, last_seen)["agents"]
    except OSError as exc:  # the current directory is gone, say
        return [Finding("hooks", "warning", f"hooks not checked: {exc}", "run doctor elsewhere")]
    findings = []
    for agent, found in agents.items():
        level = STATES[found["state"]]
        detail = f"{found['state']}: {found['detail']}"
        if found["state"] == "not_installed":
            detail += f" (`towerctl hooks install --agent {agent}` wires them)"
        check = f"hooks {agent}"
        fix = found["fix"]
        findings.append(
            verdict(check, level == "ok", ok=detail, problem=detail, fix=fix, level=level)
        )
    return findings


RESTORE_ADVICE = (
    "stop towerd, keep a copy of the damaged file, and restore the latest backup "
    "(`towerctl backup PATH` makes them)"
)


def _integrity(check: str, rows: list[str], fix: str, where: str = "") -> Finding:
    # ``check`` is SQLite's PRAGMA, or "postgresql": the server's own account
    what = "the PostgreSQL store" if check == "postgresql" else f"PRAGMA {check}"
    return verdict(
        "integrity", rows == ["ok"], ok=f"{what}: ok{where}",
        problem=f"{what}: {'; '.join(rows[:5])}", fix=fix, level="error",
    )  # fmt: skip


def _database_findings(report: DoctorResult) -> list[Finding]:
    schema, supported = report["schema_version"], report["supported_schema_version"]
    wal = f"the WAL holds {report['wal_bytes'] // 1024} KiB"
    unknown = report["keys"]["outcome_unknown"]
    unknown_sample = ", ".join(
        f"{key['operation']}/{key['key']} ({key['principal']})"
        for key in report["unknown_keys"][:5]
    )
    uncertain = report.get("uncertain_effects") or []
    uncertain_sample = ", ".join(
        f"{e['action_kind']} {e['target_ref']} ({e['effect_key']}, run {e['run_id']})"
        for e in uncertain[:5]
    )
    findings = [
        _integrity(report["check"], report["integrity"], RESTORE_ADVICE),
        verdict(
            "schema",
            schema == supported,
            ok=f"schema version {schema}",
            problem=f"schema version {schema}, this towerd supports {supported}",
            fix="run the matching towerd version",
            level="error",
        ),
        verdict(
            "wal",
            report["wal_bytes"] <= WAL_WARNING_BYTES,
            ok=wal,
            problem=wal,
            fix="a long-running reader keeps it from being checkpointed; it shrinks at the "
            "next checkpoint once that reader is gone",
            level="warning",
        ),
        verdict(
            "outcome_unknown",
            not unknown,
            ok="no key waits for a decision",
            problem=f"{unknown} keys wait for a decision: {unknown_sample}",
            fix="check whether each effect happened, then `towerctl --principal NAME idem "
            "resolve OPERATION KEY --outcome completed --result JSON` (it did) or "
            "`--outcome abandoned` (it did not); the principal is the part after `uid:N:`",
            level="warning",
        ),
        verdict(
            "uncertain_effects",
            not uncertain,
            ok="no effect waits for a decision",
            problem=f"{len(uncertain)}{'+' if len(uncertain) >= 20 else ''} effects may or "
            f"may not have happened: {uncertain_sample}",
            fix="check each in the outside world, then `towerctl effects resolve KEY "
            "--outcome committed` (it happened) or `--outcome aborted` (it did not)",
            level="warning",
        ),
    ]
    if report["check"] == "postgresql":  # no WAL file of towerd's: the server keeps its own
        findings = [finding for finding in findings if finding.check != "wal"]
    return findings


def _offline_database_findings(db_path: Path, full: bool) -> list[Finding]:
    check = "integrity_check" if full else "quick_check"
    try:
        conn = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True)
        try:
            rows = [row[0] for row in conn.execute(f"PRAGMA {check}")]
            version = conn.execute("PRAGMA user_version").fetchone()[0]
        finally:
            conn.close()
    except sqlite3.DatabaseError as exc:
        return [Finding("integrity", "error", f"{db_path}: {exc}", "restore the latest backup")]
    return [
        Finding("schema", "ok", f"schema version {version} (read offline)"),
        _integrity(check, rows, "restore the latest backup", " (read offline)"),
    ]


def render(result: dict[str, Any]) -> str:
    lines = []
    for finding in result["findings"]:
        lines.append(f"{finding['status'].upper():8} {finding['check']:16} {finding['detail']}")
        if finding["fix"] and finding["status"] != "ok":
            lines.append(f"{'':8} {'':16} -> {finding['fix']}")
    lines.append("all good" if result["ok"] else "something needs attention")
    return "\n".join(lines)
