"""``towerd``: start the daemon. Exit 0 after a clean stop, 75 when another
towerd holds the state dir, 78 when starting would be unsafe (a newer or
damaged database, unsafe permissions) or when this process was superseded;
systemd is told not to restart on 78."""

from __future__ import annotations

import argparse
import os
import resource
import signal
import socket
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import msgspec
import structlog

from towerd.daemon import systemd
from towerd.daemon.handlers import DaemonInfo, Handlers
from towerd.daemon.instance import AlreadyRunning, InstanceLock
from towerd.daemon.listen import (
    SocketLock,
    bind_private_socket,
    current_holder,
    refuse_live_socket,
)
from towerd.daemon.logs import configure_logging
from towerd.daemon.maintenance import (
    HolderSweep,
    Upkeep,
    checkpoint_periodically,
    expire_periodically,
    guard_periodically,
)
from towerd.daemon.private_paths import StartRefused, ensure_private_dir
from towerd.daemon.server import DEFAULT_MAX_CONNECTIONS_PER_PROCESS, Limits, Server
from towerd.daemon.store import StoreConfig, open_store
from towerd.daemon.store.tx import now_ms
from towerd.daemon.watch import DEFAULT_MAX_QUEUED_BYTES, WatchHub
from towerd.protocol import DEFAULT_MAX_FRAME, VERSION
from towerd.protocol.methods import DEFAULT_EVENT_MAX_PAYLOAD, DEFAULT_KV_MAX_VALUE
from towerd.protocol.paths import default_socket_path, default_state_dir

EXIT_OK = 0
EXIT_ALREADY_RUNNING = 75  # EX_TEMPFAIL
EXIT_REFUSED = 78  # EX_CONFIG: restarting will not help

log = structlog.get_logger("towerd")


@dataclass(frozen=True)
class DaemonConfig:
    socket_path: Path
    state_dir: Path
    max_frame: int = DEFAULT_MAX_FRAME
    completed_ttl_seconds: float = 24 * 3600
    holder_check_interval: float = 1.0
    expiry_interval: float = 600.0
    checkpoint_interval: float = 30.0
    shutdown_grace: float = 10.0
    takeover: bool = False
    takeover_timeout: float = 15.0
    new_store: bool = False
    max_connections: int = 1024
    max_connections_per_process: int = DEFAULT_MAX_CONNECTIONS_PER_PROCESS
    hello_timeout: float = 10.0
    frame_timeout: float = 10.0
    send_timeout: float = 10.0
    log_level: str = "info"
    branch_prefix: str = "kxm/"
    worker_ttl_seconds: float = 60.0
    retention_days: float = 30.0
    kv_max_value: int = DEFAULT_KV_MAX_VALUE
    event_max_payload: int = DEFAULT_EVENT_MAX_PAYLOAD
    event_retention_days: float = 30.0
    events_per_session: int = 5000
    events_per_principal: int = 100_000
    message_retention_days: float = 30.0
    effect_retention_days: float = 30.0
    quota_rows: int = 1_000_000
    watch_max_queue: int = DEFAULT_MAX_QUEUED_BYTES


class StopRequest:
    """The first reason to stop wins; it carries the exit code."""

    def __init__(self) -> None:
        self.event = anyio.Event()
        self.reason = ""
        self.exit_code = EXIT_OK

    def request(self, reason: str, exit_code: int = EXIT_OK) -> None:
        if not self.event.is_set():
            self.reason, self.exit_code = reason, exit_code
            self.event.set()


async def run_daemon(config: DaemonConfig) -> int:
    """Start, serve until asked to stop, stop cleanly; returns the exit code."""
    stop = StopRequest()
    async with anyio.create_task_group() as signals:
        # Handlers first: a SIGTERM during start-up still ends in a clean stop.
        await signals.start(_stop_on_signals, stop)
        try:
            await _run(config, stop)
        finally:
            signals.cancel_scope.cancel()
    log.info("stopped", reason=stop.reason, exit_code=stop.exit_code)
    return stop.exit_code


async def _run(config: DaemonConfig, stop: StopRequest) -> None:
    os.umask(0o077)
    _allow_open_files(config.max_connections + 64)
    state_dir = ensure_private_dir(config.state_dir, "state dir")
    activated = systemd.listen_socket()
    socket_path = Path(activated.getsockname()) if activated else config.socket_path
    wait = config.takeover_timeout if config.takeover else 0.0
    if config.takeover:
        await ask_running_daemon_to_stop(socket_path, state_dir)
    lock = await anyio.to_thread.run_sync(
        partial(InstanceLock.acquire, state_dir, socket_path, wait_seconds=wait)
    )
    try:
        socket_lock = await anyio.to_thread.run_sync(
            partial(SocketLock.acquire, socket_path, state_dir, wait_seconds=wait)
        )
        try:
            if activated is None:
                # Before the store is opened (and its epoch bumped): a live socket is
                # another daemon's, and this one must not start at all.
                await anyio.to_thread.run_sync(refuse_live_socket, socket_path)
            await _open_and_serve(config, stop, lock, socket_path, activated)
        finally:
            socket_lock.release()
    finally:
        lock.release()


async def _open_and_serve(
    config: DaemonConfig,
    stop: StopRequest,
    lock: InstanceLock,
    socket_path: Path,
    activated: socket.socket | None,
) -> None:
    store_config = StoreConfig(
        lock.path.parent,
        completed_ttl_ms=int(config.completed_ttl_seconds * 1000),
        worker_ttl_ms=int(config.worker_ttl_seconds * 1000),
        retention_ms=int(config.retention_days * 86_400_000),
        event_retention_ms=int(config.event_retention_days * 86_400_000),
        events_per_session=config.events_per_session,
        events_per_principal=config.events_per_principal,
        message_retention_ms=int(config.message_retention_days * 86_400_000),
        effect_retention_ms=int(config.effect_retention_days * 86_400_000),
        quota_rows=config.quota_rows,
        new_store=config.new_store,
    )
    async with open_store(store_config) as store:
        lock.record_daemon(store.daemon_id)
        log.info(
            "reconciled",
            daemon_id=store.daemon_id,
            **msgspec.structs.asdict(store.reconciliation),
        )
        if activated is not None:
            await serve(config, store, activated, socket_path, stop)
            return
        bound = bind_private_socket(socket_path)
        try:
            await serve(config, store, bound.socket, socket_path, stop)
        finally:
            bound.unlink()


async def serve(config, store, listening, socket_path: Path, stop: StopRequest) -> None:
    listening.setblocking(False)
    handlers = Handlers(
        store,
        DaemonInfo(
            socket_path=str(socket_path),
            max_frame=config.max_frame,
            started_at=now_ms(),
            started_monotonic=time.monotonic(),
            branch_prefix=config.branch_prefix,
            kv_max_value=config.kv_max_value,
            event_max_payload=config.event_max_payload,
        ),
        request_shutdown=stop.request,
    )
    upkeep = Upkeep()
    handlers.upkeep = upkeep
    sweep = HolderSweep(store, config.holder_check_interval, upkeep)
    server = Server(
        handlers,
        limits=Limits(
            max_frame=config.max_frame,
            max_connections=config.max_connections,
            max_connections_per_process=config.max_connections_per_process,
            hello_timeout=config.hello_timeout,
            frame_timeout=config.frame_timeout,
            send_timeout=config.send_timeout,
        ),
        on_disconnect=lambda caller: sweep.poke() if caller.claimed else None,
        trace_requests=config.log_level == "debug",
        watch_hub=WatchHub(config.watch_max_queue),
    )
    hub = server.watch_hub

    def on_changes(changes: list[tuple[str, Any]]) -> None:
        handlers.cache.apply(changes)  # before anyone hears of the commit
        hub.publish(changes)

    store.on_changes = on_changes
    async with anyio.create_task_group() as tasks:
        await tasks.start(server.serve, listening)
        tasks.start_soon(sweep.run)
        tasks.start_soon(expire_periodically, store, config.expiry_interval, upkeep)
        tasks.start_soon(checkpoint_periodically, store, config.checkpoint_interval, upkeep)
        tasks.start_soon(guard_periodically, store, handlers.clock_steps, upkeep)
        tasks.start_soon(_stop_when_superseded, store, stop)
        tasks.start_soon(_stop_when_store_lost, store, stop)
        interval = systemd.watchdog_interval()
        if interval:
            tasks.start_soon(_watchdog, store, interval, upkeep)
        systemd.notify(f"READY=1\nSTATUS=serving on {socket_path}\nMAINPID={os.getpid()}")
        log.info("serving", socket=str(socket_path), pid=os.getpid(), version=VERSION)
        await stop.event.wait()
        systemd.notify(f"STOPPING=1\nSTATUS=stopping: {stop.reason}")
        log.info("stopping", reason=stop.reason)
        await server.drain(config.shutdown_grace)
        tasks.cancel_scope.cancel()


def _allow_open_files(wanted: int) -> None:
    """Raise the soft fd limit (often 1024) so the connection cap, not EMFILE, decides."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


async def _stop_on_signals(
    stop: StopRequest, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
) -> None:
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        task_status.started()
        async for signum in signals:
            stop.request(f"signal {signal.Signals(signum).name}")


async def _stop_when_superseded(store, stop: StopRequest) -> None:
    await store.superseded.wait()
    log.error(
        "superseded",
        code="stale_epoch",
        daemon_id=store.daemon_id,
        owner_epoch=store.owner_epoch,
    )
    stop.request("superseded by a later epoch of this daemon", EXIT_REFUSED)


async def _stop_when_store_lost(store, stop: StopRequest) -> None:
    await store.lost.wait()
    log.error(
        "store_lost",
        code="unavailable",
        daemon_id=store.daemon_id,
        db_path=str(store.db_path),
        reason=store.lost_reason,
    )
    stop.request(f"the database was deleted or replaced ({store.lost_reason})", EXIT_REFUSED)


async def _watchdog(store, interval: float, upkeep: Upkeep) -> None:
    """Ping systemd only while the event loop and the database thread both answer."""

    async def answer() -> None:
        await store.read(lambda tx: tx.conn.execute("SELECT 1").fetchone())
        systemd.notify("WATCHDOG=1")

    while True:
        await upkeep.attempt("watchdog", answer)
        await anyio.sleep(interval)


async def ask_running_daemon_to_stop(socket_path: Path, state_dir: Path) -> None:
    """--takeover: ask the daemon on our socket to shut down (it may be gone already).
    A daemon of another state dir is not ours to replace: its clients would land on
    another store."""
    from towerd.client import Client, TowerdError

    holder = current_holder(socket_path) or {}
    serving = holder.get("state_dir")
    if serving is not None and os.path.realpath(str(serving)) != os.path.realpath(state_dir):
        raise AlreadyRunning(
            f"--takeover refused: the socket {socket_path} is served by towerd pid "
            f"{holder.get('pid', '?')} with another state dir ({serving}), not {state_dir}; "
            "a takeover replaces a daemon of the same state dir only",
            holder,
        )

    def request() -> None:
        try:
            with Client(socket_path, timeout=5.0, client_name="towerd --takeover") as client:
                client.shutdown()
        except TowerdError as exc:
            log.info("takeover_no_daemon", socket=str(socket_path), reason=str(exc))

    await anyio.to_thread.run_sync(request)


def parse_args(argv: list[str] | None) -> tuple[DaemonConfig, argparse.Namespace]:
    parser = argparse.ArgumentParser(
        prog="towerd", description="The towerd daemon: fleet state and idempotency keys."
    )
    parser.add_argument(
        "--socket",
        type=Path,
        default=None,
        help="Unix socket path (default $TOWERD_SOCKET, else $XDG_RUNTIME_DIR/towerd/towerd.sock, "
        "else $XDG_STATE_HOME/towerd/towerd.sock)",
    )
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="state directory (default $TOWERD_STATE_DIR, else $XDG_STATE_HOME/towerd)",
    )
    parser.add_argument(
        "--takeover",
        action="store_true",
        help="ask the running daemon to stop, then start at the next epoch",
    )
    parser.add_argument("--takeover-timeout", type=float, default=15.0, metavar="SECONDS")
    parser.add_argument(
        "--new-store",
        action="store_true",
        help="start an empty store although the state dir shows a previous one was lost "
        "(its database is missing or was replaced): every key it held is forgotten",
    )
    parser.add_argument("--max-frame", type=int, default=DEFAULT_MAX_FRAME, metavar="BYTES")
    parser.add_argument(
        "--completed-ttl",
        type=float,
        default=24 * 3600,
        metavar="SECONDS",
        help="how long completed idempotency keys are kept (default 24 h)",
    )
    parser.add_argument(
        "--expiry-interval",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="how often expired completed keys are swept (default 600)",
    )
    parser.add_argument(
        "--checkpoint-interval",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="how often a grown WAL is truncated when no reader is in the way (default 30)",
    )
    parser.add_argument("--holder-check-interval", type=float, default=1.0, metavar="SECONDS")
    parser.add_argument("--shutdown-grace", type=float, default=10.0, metavar="SECONDS")
    parser.add_argument(
        "--max-connections",
        type=int,
        default=1024,
        metavar="N",
        help="connections beyond this are refused with `unavailable` (default 1024)",
    )
    parser.add_argument(
        "--max-connections-per-process",
        type=int,
        default=DEFAULT_MAX_CONNECTIONS_PER_PROCESS,
        metavar="N",
        help="one process's connections beyond this are refused with `unavailable` "
        f"(default {DEFAULT_MAX_CONNECTIONS_PER_PROCESS})",
    )
    parser.add_argument(
        "--hello-timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="a connection that has not said hello within this is closed (default 10)",
    )
    parser.add_argument(
        "--frame-timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="a started frame must be complete within this (default 10)",
    )
    parser.add_argument(
        "--send-timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="a peer that does not read its replies this long is dropped",
    )
    parser.add_argument(
        "--branch-prefix",
        default="kxm/",
        help="prefix of run branches: a push to the run's own branch needs no lease (kxm/)",
    )
    parser.add_argument(
        "--worker-ttl",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="a worker whose last heartbeat is older is reaped as crashed (default 60)",
    )
    parser.add_argument(
        "--retention-days",
        type=float,
        default=30.0,
        metavar="DAYS",
        help="audit events, settled dispatches and ended workers older are pruned (30)",
    )
    parser.add_argument(
        "--kv-max-value",
        type=int,
        default=DEFAULT_KV_MAX_VALUE,
        metavar="BYTES",
        help="largest soft-state value, msgpack-encoded (default 65536)",
    )
    parser.add_argument(
        "--event-max-payload",
        type=int,
        default=DEFAULT_EVENT_MAX_PAYLOAD,
        metavar="BYTES",
        help="largest hook event payload, msgpack-encoded (default 65536)",
    )
    parser.add_argument(
        "--event-retention-days",
        type=float,
        default=30.0,
        metavar="DAYS",
        help="hook events older are pruned (default 30)",
    )
    parser.add_argument(
        "--events-per-session",
        type=int,
        default=5000,
        metavar="N",
        help="hook events kept per session, newest first (default 5000)",
    )
    parser.add_argument(
        "--events-per-principal",
        type=int,
        default=100_000,
        metavar="N",
        help="hook events kept per principal, newest first (default 100000)",
    )
    parser.add_argument(
        "--message-retention-days",
        type=float,
        default=30.0,
        metavar="DAYS",
        help="messages sent longer ago are pruned, whatever their status (default 30)",
    )
    parser.add_argument(
        "--effect-retention-days",
        type=float,
        default=30.0,
        metavar="DAYS",
        help="committed, failed and aborted effects settled longer ago are pruned; a claim "
        "of a pruned effect runs it again (default 30)",
    )
    parser.add_argument(
        "--quota",
        type=int,
        default=1_000_000,
        metavar="ROWS",
        dest="quota_rows",
        help="rows one principal may have in each of the idempotency, kv, messages, events, "
        "effects, leases and lease_tokens tables; past it, quota_exceeded (default 1000000)",
    )
    parser.add_argument(
        "--watch-max-queue",
        type=int,
        default=DEFAULT_MAX_QUEUED_BYTES,
        metavar="BYTES",
        help="a watcher this far behind is sent too_slow and disconnected (default 1 MiB)",
    )
    parser.add_argument(
        "--log-level",
        default=os.environ.get("TOWERD_LOG_LEVEL", "info"),
        choices=["debug", "info", "warning", "error"],
    )
    parser.add_argument("--log-format", default="auto", choices=["auto", "json", "console"])
    parser.add_argument("--version", action="version", version=f"towerd {VERSION}")
    args = parser.parse_args(argv)
    config = DaemonConfig(
        socket_path=args.socket or Path(default_socket_path()),
        state_dir=args.state_dir or Path(default_state_dir()),
        max_frame=args.max_frame,
        completed_ttl_seconds=args.completed_ttl,
        holder_check_interval=args.holder_check_interval,
        expiry_interval=args.expiry_interval,
        checkpoint_interval=args.checkpoint_interval,
        shutdown_grace=args.shutdown_grace,
        takeover=args.takeover,
        takeover_timeout=args.takeover_timeout,
        new_store=args.new_store,
        max_connections=args.max_connections,
        max_connections_per_process=args.max_connections_per_process,
        hello_timeout=args.hello_timeout,
        frame_timeout=args.frame_timeout,
        send_timeout=args.send_timeout,
        log_level=args.log_level,
        branch_prefix=args.branch_prefix,
        worker_ttl_seconds=args.worker_ttl,
        retention_days=args.retention_days,
        kv_max_value=args.kv_max_value,
        event_max_payload=args.event_max_payload,
        event_retention_days=args.event_retention_days,
        events_per_session=args.events_per_session,
        events_per_principal=args.events_per_principal,
        message_retention_days=args.message_retention_days,
        effect_retention_days=args.effect_retention_days,
        quota_rows=args.quota_rows,
        watch_max_queue=args.watch_max_queue,
    )
    return config, args


def main(argv: list[str] | None = None) -> None:
    config, args = parse_args(argv)
    configure_logging(
        args.log_level, json_lines=None if args.log_format == "auto" else args.log_format == "json"
    )
    try:
        code = anyio.run(run_daemon, config, backend="asyncio", backend_options=_backend_options())
    except BaseException as exc:  # noqa: BLE001 - refusals may arrive inside exception groups
        refused = _first(exc, StartRefused)
        if refused is None:
            raise
        if isinstance(refused, AlreadyRunning):
            log.error("already_running", code="unavailable", reason=str(refused))
            code = EXIT_ALREADY_RUNNING
        else:
            log.error("start_refused", code="refused", reason=str(refused))
            code = EXIT_REFUSED
        print(f"towerd: {refused}", file=sys.stderr)
    sys.exit(code)


def _backend_options() -> dict[str, bool]:
    """uvloop when installed (the `fast` extra): measured faster on the wire path."""
    if os.environ.get("TOWERD_NO_UVLOOP"):
        return {}
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return {}
    return {"use_uvloop": True}


def _first(exc: BaseException, kind: type[BaseException]) -> BaseException | None:
    """The first ``kind`` in ``exc`` or, recursively, in the exception groups around it."""
    if isinstance(exc, kind):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = _first(inner, kind)
            if found is not None:
                return found
    return None


if __name__ == "__main__":
    main()
