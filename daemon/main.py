"""``towerd``: start the daemon. Exit 0 after a clean stop, 75 when another
towerd holds the state dir, 78 when starting would be unsafe (a newer or
damaged database, unsafe permissions) or when this process was superseded;
systemd is told not to restart on 78."""

from __future__ import annotations

import asyncio
import os
import resource
import signal
import socket
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import msgspec
import structlog

from towerd.daemon import stages, systemd
from towerd.daemon.config import DaemonConfig, parse_args
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
    LivenessSweep,
    Upkeep,
    checkpoint_periodically,
    expire_periodically,
    guard_periodically,
)
from towerd.daemon.outbox import Outbox
from towerd.daemon.private_paths import StartRefused, ensure_private_dir
from towerd.daemon.probes import Prober
from towerd.daemon.server import Server
from towerd.daemon.store import open_store
from towerd.daemon.store.tx import now_ms
from towerd.daemon.watch import WatchHub
from towerd.protocol import VERSION
from towerd.protocol.errors import TooSlow

EXIT_OK = 0
EXIT_ALREADY_RUNNING = 75  # EX_TEMPFAIL
STARTUP_SWEEP_S = 2.0  # the liveness sweep before the first answer, at most
EXIT_REFUSED = 78  # EX_CONFIG: restarting will not help

log = structlog.get_logger("towerd")


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
    store_config = config.store_config(lock.path.parent)
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
            started_at=now_ms(),
            started_monotonic=time.monotonic(),
        ),
        request_shutdown=stop.request,
    )
    upkeep = Upkeep()
    handlers.upkeep = upkeep
    if not store.one_box:  # a shared store can be out of reach: hook events wait for it
        handlers.outbox = Outbox(store.config.state_dir)
    sweep = LivenessSweep(store, config.holder_check_interval, upkeep)
    prober = Prober(store, config.probe_interval, upkeep, config.probe_timeout)
    handlers.prober = prober
    server = Server(
        handlers,
        limits=config.limits(),
        on_disconnect=lambda caller: sweep.poke() if caller.claimed else None,
        trace_requests=config.log_level == "debug",
        watch_hub=WatchHub(config.watch_max_queue),
        spin_us=config.spin_us,
    )
    hub = server.watch_hub

    def on_changes(changes: list[tuple[str, Any]]) -> None:
        handlers.cache.apply(changes)  # before anyone hears of the commit
        hub.publish(changes)

    store.on_changes = on_changes
    listener = _listen_to_other_boxes(store, hub)
    try:
        # One liveness sweep before the first answer: what died while no daemon ran (a
        # reboot) is settled first, so no caller is told an agent runs that is gone (a
        # `fleet restore` at boot found every session still live and launched none).
        # Bounded: a store that stalls (PostgreSQL) must not keep every caller waiting;
        # a sweep that fails or is cut short is logged, and the periodic one follows.
        with anyio.move_on_after(STARTUP_SWEEP_S) as sweep_scope:
            await upkeep.attempt(sweep.NAME, sweep.sweep_once)
        if sweep_scope.cancelled_caught:
            log.warning("startup_sweep_cut_short", code="unavailable", seconds=STARTUP_SWEEP_S)
        async with anyio.create_task_group() as tasks:
            await tasks.start(server.serve, listening)
            tasks.start_soon(sweep.run)
            tasks.start_soon(prober.run)  # its first pass runs beside READY, never before it
            tasks.start_soon(expire_periodically, store, config.expiry_interval, upkeep)
            if store.backend == "sqlite":  # a WAL file to keep small
                tasks.start_soon(checkpoint_periodically, store, config.checkpoint_interval, upkeep)
            tasks.start_soon(guard_periodically, store, handlers.clock_steps, upkeep)
            if handlers.outbox is not None:
                tasks.start_soon(_forward_outbox, handlers, upkeep)
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
    finally:
        if listener is not None:
            await anyio.to_thread.run_sync(listener.stop)


def _listen_to_other_boxes(store, hub: WatchHub) -> Any:
    """On a shared store: other boxes' changes reach this box's watchers; a change that
    cannot be relayed ends every watch (too_slow: reconnect for a fresh snapshot)."""
    if store.one_box:
        return None
    from towerd.daemon.store.pg_changes import ChangeListener

    def gap(why: str) -> None:
        ended = hub.end_all(TooSlow(
            f"changes made by other boxes may have been missed ({why}); watch again for "
            "a fresh snapshot", {"reason": "changes_missed"},
        ))  # fmt: skip
        log.warning("watchers_resynced", code="too_slow", reason=why, watchers=ended)

    loop = asyncio.get_running_loop()
    listener = ChangeListener(store.dsn, store.daemon_id, loop.call_soon_threadsafe,
                              hub.publish, gap)  # fmt: skip
    listener.start()
    return listener


def _allow_open_files(wanted: int) -> None:
    """Raise the soft fd limit (often 1024) so the connection cap, not EMFILE, decides."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


async def _stop_on_signals(
    stop: StopRequest, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
) -> None:
    """SIGTERM, SIGINT, and SIGHUP: the terminal a daemon was started from in the
    background closed (it killed the daemon without a line in its log, and every hook
    then failed open unseen); it now stops as for SIGTERM and says why. A SIGHUP the
    daemon was started ignoring (``nohup towerd``) stays ignored."""
    hangup = () if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN else (signal.SIGHUP,)
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, *hangup) as signals:
        task_status.started()
        async for signum in signals:
            why = f"signal {signal.Signals(signum).name}"
            if signum == signal.SIGHUP:
                why += (
                    " (the terminal that started towerd closed? start it with setsid, or "
                    "under systemd: towerctl install-systemd)"
                )
            stop.request(why)


OUTBOX_EVERY = 1.0  # seconds between looks at the outbox while events wait in it


async def _forward_outbox(handlers: Handlers, upkeep: Upkeep) -> None:
    """File the hook events queued while the shared store was unreachable, in order,
    as soon as it answers again (the presence heartbeat finds out within its interval)."""
    while True:
        await anyio.sleep(OUTBOX_EVERY)
        if handlers.store.reachable:
            await upkeep.attempt("outbox", handlers.forward_outbox)


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


def main(argv: list[str] | None = None) -> None:
    config = parse_args(argv)
    configure_logging(
        config.log_level,
        json_lines=None if config.log_format == "auto" else config.log_format == "json",
    )
    try:
        code = anyio.run(run_daemon, config, backend="asyncio", backend_options=_backend_options())
        stages.write_summary()  # TOWERD_STAGE_TRACE (bench/writes.py --stages): else nothing
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
