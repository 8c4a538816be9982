"""The daemon's options, each declared once: its field here carries its flag, metavar,
type and help (supervisor-style field metadata), and ``parse_args`` builds the
command line from these fields. The README's option table is checked against them
(tests/test_readme.py)."""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

from towerd.daemon.private_paths import StartRefused, check_private
from towerd.daemon.server import DEFAULT_MAX_CONNECTIONS_PER_PROCESS, Limits
from towerd.daemon.spin import DEFAULT_SPIN_US
from towerd.daemon.store import StoreConfig
from towerd.daemon.watch import DEFAULT_MAX_QUEUED_BYTES
from towerd.protocol import DEFAULT_MAX_FRAME, VERSION
from towerd.protocol.methods import (
    DEFAULT_EVENT_MAX_PAYLOAD,
    DEFAULT_KV_MAX_VALUE,
    DEFAULT_PATH_LEASE_TTL_MS,
)
from towerd.protocol.naming import DEFAULT_PREFIX
from towerd.protocol.paths import default_socket_path, default_state_dir

DAY_MS = 86_400_000


@dataclass(frozen=True)
class Number:
    """A numeric option's type and range, declared with the option (argparse calls it on
    the text given). A value outside the range, ``nan`` or an infinity is refused at start
    with the option's name (exit 2, before anything is opened), instead of surfacing later
    as a crash in a timer, a loop that never sleeps, or a daemon that refuses every
    request (``--max-frame 0``, ``--max-connections 0``)."""

    kind: type[int] | type[float]
    least: float
    most: float = 0  # 0: the kind's own sane ceiling (``ceiling``)

    @property
    def ceiling(self) -> float:
        return self.most or (MAX_COUNT if self.kind is int else MAX_SECONDS)

    def __call__(self, text: str) -> int | float:
        try:
            value = self.kind(text)
        except ValueError:
            noun = "an integer" if self.kind is int else "a number"
            raise argparse.ArgumentTypeError(f"{text!r} is not {noun}") from None
        if not (math.isfinite(value) and self.least <= value <= self.ceiling):
            raise argparse.ArgumentTypeError(f"{text!r} is out of range: {self.describe()}")
        return value

    def describe(self) -> str:
        """The range in words, as the refusal and the tests say it."""
        kind = "an integer" if self.kind is int else "a number"
        return f"{kind} >= {_plain(self.least)} and <= {_plain(self.ceiling)}"


def _plain(value: float) -> str:
    """A bound as a person writes it: 315360000, not 3.1536e+08."""
    return str(int(value)) if value == int(value) else f"{value:g}"


MAX_SECONDS = 10 * 365 * 86_400.0  # ten years: far beyond any sane period, inside timers
MAX_COUNT = 2**62  # an integer SQLite and msgpack both store
MAX_DAYS = 36_500.0
# A period, a timeout or a lifetime: at least a millisecond (the store keeps them in
# ms, so less is 0, and a period under it is a loop that never sleeps).
SECONDS = Number(float, 0.001)
DAYS = Number(float, 0.00001, most=MAX_DAYS)  # about a second at least
COUNT = Number(int, 1)  # a number of things that must allow at least one
BYTES = Number(int, 1, most=1 << 30)  # a size limit
FRAME_BYTES = Number(int, 1024, most=1 << 30)  # hello, errors and pings fit in 1 KiB
SPIN_WINDOW = Number(int, 0, most=1_000_000)  # microseconds, 0 (off) to a second


def option(
    default: Any,
    flag: str,
    help: str,
    metavar: str | None = None,
    *,
    env: str | None = None,
    **argparse: Any,
) -> Any:
    """A field of DaemonConfig that is also a command-line option (``env``: a variable
    that sets its default)."""
    meta = {"flag": flag, "help": help, "metavar": metavar, "env": env, "argparse": argparse}
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class DaemonConfig:
    socket_path: Path = option(
        None, "--socket", "Unix socket path (default $TOWERD_SOCKET, else "
        "$XDG_RUNTIME_DIR/towerd/towerd.sock, else $XDG_STATE_HOME/towerd/towerd.sock)",
        "PATH", type=Path,
    )  # fmt: skip
    state_dir: Path = option(
        None, "--state-dir", "state directory (default $TOWERD_STATE_DIR, else "
        "$XDG_STATE_HOME/towerd)", "DIR", type=Path,
    )  # fmt: skip
    store: str = option(
        None, "--store", "the state store: a postgresql:// DSN puts it on PostgreSQL, shared "
        "by every box's daemon (default $TOWERD_STORE, else SQLite in the state dir)",
        "DSN", env="TOWERD_STORE",
    )  # fmt: skip
    store_dsn_file: Path = option(
        None, "--store-dsn-file", "read the PostgreSQL DSN from this file (mode 0600, yours), "
        "so no password is on a command line or in a unit file", "PATH", type=Path,
    )  # fmt: skip
    presence_interval: float = option(
        5.0, "--presence-interval", "PostgreSQL store: how often this box heartbeats its "
        "presence (default 5)", "SECONDS", type=SECONDS,
    )  # fmt: skip
    presence_ttl: float = option(
        30.0, "--presence-ttl", "PostgreSQL store: a box silent this long is dead for every "
        "box: its keys turn outcome_unknown, its leases are freed (default 30, at least 5)",
        "SECONDS", type=SECONDS,
    )  # fmt: skip
    takeover: bool = option(
        False, "--takeover", "ask the running daemon to stop, then start at the next epoch",
        action="store_true",
    )  # fmt: skip
    takeover_timeout: float = option(
        15.0, "--takeover-timeout", "how long --takeover waits for the old daemon (15)",
        "SECONDS", type=SECONDS,
    )  # fmt: skip
    new_store: bool = option(
        False, "--new-store", "start an empty store although the state dir shows a previous "
        "one was lost (its database is missing or was replaced), or run on an older copy "
        "of it (a backup put back): every key it no longer holds is forgotten",
        action="store_true",
    )  # fmt: skip
    max_frame: int = option(
        DEFAULT_MAX_FRAME, "--max-frame", "the largest request, and the page size (1 MiB)",
        "BYTES", type=FRAME_BYTES,
    )  # fmt: skip
    completed_ttl_seconds: float = option(
        24 * 3600.0, "--completed-ttl", "how long completed idempotency keys are kept "
        "(default 24 h)", "SECONDS", type=SECONDS,
    )  # fmt: skip
    expiry_interval: float = option(
        600.0, "--expiry-interval", "how often expired completed keys are swept (default 600)",
        "SECONDS", type=SECONDS,
    )  # fmt: skip
    checkpoint_interval: float = option(
        30.0, "--checkpoint-interval", "how often a grown WAL is truncated when no reader is "
        "in the way (default 30)", "SECONDS", type=SECONDS,
    )  # fmt: skip
    holder_check_interval: float = option(
        1.0, "--holder-check-interval", "how often dead claimants are looked for (default 1)",
        "SECONDS", type=SECONDS,
    )  # fmt: skip
    probe_interval: float = option(
        60.0, "--probe-interval", "how often uncertain effects and unknown keys with a probe "
        "are probed again (their backoff grows from this; default 60)", "SECONDS", type=SECONDS,
    )  # fmt: skip
    probe_timeout: float = option(
        30.0, "--probe-timeout", "an evidence probe (git ls-remote, a --probe command) still "
        "running after this is killed and counts as cannot tell (default 30)", "SECONDS",
        type=SECONDS,
    )  # fmt: skip
    shutdown_grace: float = option(
        10.0, "--shutdown-grace", "how long a stop waits for requests in flight (default 10)",
        "SECONDS", type=Number(float, 0),
    )  # fmt: skip
    max_connections: int = option(
        1024, "--max-connections", "connections beyond this are refused with `unavailable` "
        "(default 1024)", "N", type=COUNT,
    )  # fmt: skip
    max_connections_per_process: int = option(
        DEFAULT_MAX_CONNECTIONS_PER_PROCESS, "--max-connections-per-process",
        "one process's connections beyond this are refused with `unavailable` "
        f"(default {DEFAULT_MAX_CONNECTIONS_PER_PROCESS})", "N", type=COUNT,
    )  # fmt: skip
    hello_timeout: float = option(
        10.0, "--hello-timeout", "a connection that has not said hello within this is closed "
        "(default 10)", "SECONDS", type=SECONDS,
    )  # fmt: skip
    frame_timeout: float = option(
        10.0, "--frame-timeout", "a started frame must be complete within this (default 10)",
        "SECONDS", type=SECONDS,
    )  # fmt: skip
    send_timeout: float = option(
        10.0, "--send-timeout", "a peer that does not read its replies this long is dropped",
        "SECONDS", type=SECONDS,
    )  # fmt: skip
    spin_us: int = option(
        DEFAULT_SPIN_US, "--spin-us", "after an answer, poll this long for the next request "
        "before sleeping: a client sending requests back to back finds the daemon awake "
        "(saves a wake-up, most on VMs; slower for other patterns and on a busy machine: "
        f"see bench/README.md; default {DEFAULT_SPIN_US}: off)", "MICROSECONDS", type=SPIN_WINDOW,
    )  # fmt: skip
    branch_prefix: str = option(
        DEFAULT_PREFIX, "--branch-prefix", "prefix of run branches: a push to the run's own "
        f"branch needs no lease ({DEFAULT_PREFIX})", "PREFIX",
    )  # fmt: skip
    worker_ttl_seconds: float = option(
        60.0, "--worker-ttl", "a worker whose last heartbeat is older is reaped as crashed "
        "(default 60)", "SECONDS", type=SECONDS,
    )  # fmt: skip
    path_lease_ttl_seconds: float = option(
        DEFAULT_PATH_LEASE_TTL_MS / 1000, "--path-lease-ttl", "a session's path lease lapses "
        "this long after its last edit of the path (default 1800)", "SECONDS", type=SECONDS,
    )  # fmt: skip
    retention_days: float = option(
        30.0, "--retention-days", "audit events, settled dispatches and ended workers older "
        "are pruned (30)", "DAYS", type=DAYS,
    )  # fmt: skip
    kv_max_value: int = option(
        DEFAULT_KV_MAX_VALUE, "--kv-max-value", "largest soft-state value, msgpack-encoded "
        "(default 65536)", "BYTES", type=BYTES,
    )  # fmt: skip
    event_max_payload: int = option(
        DEFAULT_EVENT_MAX_PAYLOAD, "--event-max-payload", "largest hook event payload, "
        "msgpack-encoded (default 65536)", "BYTES", type=BYTES,
    )  # fmt: skip
    event_retention_days: float = option(
        30.0, "--event-retention-days", "hook events older are pruned (default 30)", "DAYS",
        type=DAYS,
    )  # fmt: skip
    events_per_session: int = option(
        5000, "--events-per-session", "hook events kept per session, newest first "
        "(default 5000)", "N", type=COUNT,
    )  # fmt: skip
    events_per_principal: int = option(
        100_000, "--events-per-principal", "hook events kept per principal, newest first "
        "(default 100000)", "N", type=COUNT,
    )  # fmt: skip
    message_retention_days: float = option(
        30.0, "--message-retention-days", "messages sent longer ago are pruned, whatever "
        "their status (default 30)", "DAYS", type=DAYS,
    )  # fmt: skip
    effect_retention_days: float = option(
        30.0, "--effect-retention-days", "committed, failed and aborted effects settled "
        "longer ago are pruned; a claim of a pruned effect runs it again (default 30)",
        "DAYS", type=DAYS,
    )  # fmt: skip
    quota_rows: int = option(
        1_000_000, "--quota", "rows one principal may have in each of the idempotency, kv, "
        "messages, events, effects, leases and lease_tokens tables; past it, "
        "quota_exceeded (default 1000000)", "ROWS", type=COUNT,
    )  # fmt: skip
    watch_max_queue: int = option(
        DEFAULT_MAX_QUEUED_BYTES, "--watch-max-queue", "a watcher this far behind is sent "
        "too_slow and disconnected (default 1 MiB)", "BYTES", type=BYTES,
    )  # fmt: skip
    log_level: str = option(
        "info", "--log-level", "default $TOWERD_LOG_LEVEL, else info", env="TOWERD_LOG_LEVEL",
        choices=["debug", "info", "warning", "error"],
    )  # fmt: skip
    log_format: str = option(
        "auto", "--log-format", "JSON lines under systemd or when stderr is not a terminal",
        choices=["auto", "json", "console"],
    )  # fmt: skip

    def store_config(self, state_dir: Path) -> StoreConfig:
        """What the store needs of these settings (in its units: milliseconds)."""
        self.check_presence()
        return StoreConfig(
            state_dir,
            completed_ttl_ms=int(self.completed_ttl_seconds * 1000),
            worker_ttl_ms=int(self.worker_ttl_seconds * 1000),
            path_lease_ttl_ms=int(self.path_lease_ttl_seconds * 1000),
            retention_ms=int(self.retention_days * DAY_MS),
            event_retention_ms=int(self.event_retention_days * DAY_MS),
            events_per_session=self.events_per_session,
            events_per_principal=self.events_per_principal,
            message_retention_ms=int(self.message_retention_days * DAY_MS),
            effect_retention_ms=int(self.effect_retention_days * DAY_MS),
            quota_rows=self.quota_rows,
            new_store=self.new_store,
            max_frame=self.max_frame,
            branch_prefix=self.branch_prefix,
            kv_max_value=self.kv_max_value,
            event_max_payload=self.event_max_payload,
            store=self.store_dsn(),
            presence_interval_ms=int(self.presence_interval * 1000),
            presence_ttl_ms=int(self.presence_ttl * 1000),
        )

    def check_presence(self) -> None:
        if self.presence_ttl < 5 or not 0 < self.presence_interval < self.presence_ttl:
            raise StartRefused(
                f"--presence-ttl {self.presence_ttl:g} must be at least 5 seconds and longer "
                f"than --presence-interval {self.presence_interval:g} (which must be > 0)"
            )

    def store_dsn(self) -> str | None:
        """The PostgreSQL DSN (``--store``, else ``--store-dsn-file``), or None for SQLite."""
        if self.store_dsn_file is not None:
            return read_dsn_file(self.store_dsn_file)
        return self.store or None

    def limits(self) -> Limits:
        """What one peer may cost the server."""
        return Limits(
            max_frame=self.max_frame,
            max_connections=self.max_connections,
            max_connections_per_process=self.max_connections_per_process,
            hello_timeout=self.hello_timeout,
            frame_timeout=self.frame_timeout,
            send_timeout=self.send_timeout,
        )


def read_dsn_file(path: Path) -> str:
    """The DSN in ``path``, which must be a regular file of this uid that nobody else may
    read (it may hold a password)."""
    check_private(path, "store DSN file", want_dir=False)
    try:
        text = path.read_text().strip()
    except OSError as exc:
        raise StartRefused(f"cannot read the store DSN file {path}: {exc}") from None
    if not text:
        raise StartRefused(f"the store DSN file {path} is empty")
    return text


def options() -> list[tuple[str, Any]]:
    """(field name, field) of every option, in declaration order."""
    return [(f.name, f) for f in fields(DaemonConfig) if "flag" in f.metadata]


def parse_args(argv: list[str] | None) -> DaemonConfig:
    parser = argparse.ArgumentParser(
        prog="towerd", description="The towerd daemon: fleet state and idempotency keys."
    )
    for name, spec in options():
        meta = spec.metadata
        kwargs = dict(meta["argparse"])
        if meta["metavar"] is not None:
            kwargs["metavar"] = meta["metavar"]
        default = os.environ.get(meta["env"]) if meta["env"] else None
        parser.add_argument(
            meta["flag"], dest=name, default=default or spec.default, help=meta["help"], **kwargs
        )
    parser.add_argument("--version", action="version", version=f"towerd {VERSION}")
    given = vars(parser.parse_args(argv))
    given["socket_path"] = given["socket_path"] or Path(default_socket_path())
    given["state_dir"] = given["state_dir"] or Path(default_state_dir())
    assert all(spec.default is not MISSING for _name, spec in options())
    return DaemonConfig(**given)
