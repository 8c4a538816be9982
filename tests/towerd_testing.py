"""Test helpers: a real towerd subprocess, its notify socket, the real CLI.

Readiness is the daemon's own systemd notification (``READY=1`` on a datagram
socket the test binds), so no test sleeps to wait for start-up.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from towerd.client import Client

if TYPE_CHECKING:
    import pytest

BIN = Path(sys.executable).parent
TOWERD = str(BIN / "towerd")
TOWERCTL = str(BIN / "towerctl")
START_TIMEOUT = 20.0


# --- the store backends a test runs on --------------------------------------------------

BACKENDS = {"sqlite": "sqlite", "postgresql": "pg"}  # backend -> its test id
DEFAULT_BACKENDS = "sqlite,postgresql"  # what CI runs


def selected_backends() -> list[str]:
    """The backends TOWERD_TEST_BACKENDS picks (default both, what CI runs)."""
    import pytest

    raw = os.environ.get("TOWERD_TEST_BACKENDS", DEFAULT_BACKENDS)
    names = [name.strip() for name in raw.split(",") if name.strip()]
    unknown = [name for name in names if name not in BACKENDS]
    if unknown or not names:
        raise pytest.UsageError(
            f"TOWERD_TEST_BACKENDS={raw!r}: a comma-separated subset of {', '.join(BACKENDS)}"
        )
    return list(dict.fromkeys(names))


def backend_params(definition: pytest.Item) -> list[Any]:
    """The ``store_backend`` parameters of one test: each selected backend, with its id
    (``[sqlite]``, ``[pg]``); ``sqlite_only`` keeps the SQLite one. A ``sqlite_only``
    test that TOWERD_TEST_BACKENDS leaves without a backend is one skipped ``[sqlite]``."""
    import pytest

    names = selected_backends()
    if definition.get_closest_marker("sqlite_only") is not None:
        names = [name for name in names if name == "sqlite"]
    params = [pytest.param(name, id=BACKENDS[name]) for name in names]
    if not params:
        reason = "sqlite_only, and TOWERD_TEST_BACKENDS leaves sqlite out"
        params = [pytest.param("sqlite", id="sqlite", marks=pytest.mark.skip(reason=reason))]
    return params


def wait_for(condition: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    """Poll ``condition`` until it returns a truthy value or the deadline passes."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


class NotifySocket:
    """A datagram socket standing in for systemd's $NOTIFY_SOCKET."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.messages: list[str] = []

    def wait_for(
        self, needle: str, timeout: float, alive: Callable[[], bool] = lambda: True
    ) -> str:
        """Wait for a message containing ``needle``; fail early if ``alive()`` turns False."""
        deadline = time.monotonic() + timeout
        for message in self.messages:
            if needle in message:
                return message
        while time.monotonic() < deadline:
            self.sock.settimeout(0.1)
            try:
                message = self.sock.recv(4096).decode()
            except TimeoutError:
                if not alive():
                    raise AssertionError(f"process exited before sending {needle!r}") from None
                continue
            self.messages.append(message)
            if needle in message:
                return message
        raise AssertionError(f"no {needle!r} notification within {timeout}s: {self.messages}")

    def close(self) -> None:
        self.sock.close()


class Daemon:
    """A towerd subprocess. ``start()`` returns once it sent READY=1."""

    def __init__(self, root: Path, name: str = "d") -> None:
        self.root = root
        self.socket_path = root / f"{name}.run" / "towerd.sock"
        self.state_dir = root / f"{name}.state"
        self.log_path = root / f"{name}.log"
        self.notify = NotifySocket(root / f"{name}.notify")
        self.proc: subprocess.Popen[bytes] | None = None
        self.extra_args: list[str] = []
        # What runs the daemon, e.g. ["ip", "netns", "exec", NAME]: it must exec it, so
        # that the process started is the daemon (its pid, its signals).
        self.prefix: list[str] = []
        # The store of a state dir: None is SQLite in it; a postgresql:// DSN is passed as
        # --store. The make_daemon fixture sets it on a [pg] run: one database per state
        # dir, looked up when the daemon starts (a test may move ``state_dir`` first), so
        # every start on one state dir reaches the same database.
        self.store_of: Callable[[Path], str | None] = lambda state_dir: None

    @property
    def store(self) -> str | None:
        """The PostgreSQL DSN this daemon's state dir has its store in, or None (SQLite)."""
        return self.store_of(self.state_dir)

    @property
    def backend(self) -> str:
        """``"sqlite"`` or ``"postgresql"``: the store this daemon runs on."""
        return "sqlite" if self.store is None else "postgresql"

    def command(self, *extra: str) -> list[str]:
        return [
            TOWERD,
            "--socket",
            str(self.socket_path),
            "--state-dir",
            str(self.state_dir),
            "--log-format",
            "json",
            "--log-level",
            "debug",
            *(["--store", store] if (store := self.store) is not None else []),
            *self.extra_args,
            *extra,
        ]

    def env(self, **overrides: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TOWERD_", "LISTEN_"))}
        env["NOTIFY_SOCKET"] = str(self.notify.path)
        env.update(overrides)
        return env

    def spawn(self, *extra: str, **popen: Any) -> subprocess.Popen[bytes]:
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the process's lifetime
        popen.setdefault("env", self.env())
        command = [*self.prefix, *self.command(*extra)]
        return subprocess.Popen(command, stdout=log, stderr=log, **popen)

    def start(self, *extra: str, **popen: Any) -> Daemon:
        self.notify.messages.clear()
        self.proc = self.spawn(*extra, **popen)
        proc = self.proc
        try:
            self.notify.wait_for("READY=1", START_TIMEOUT, alive=lambda: proc.poll() is None)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n--- daemon log ---\n{self.log()}") from None
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def client(self, **kwargs: Any) -> Client:
        return Client(self.socket_path, **kwargs)

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM and wait; returns the exit code."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def log(self) -> str:
        try:
            return self.log_path.read_text()
        except FileNotFoundError:
            return ""

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.notify.close()


def start_crashing_at(daemon: Daemon, point: str, nth: int = 1) -> Daemon:
    """Start ``daemon`` armed to SIGKILL itself at ``point`` (``batch.before_commit`` or
    ``batch.after_commit``, daemon/crashpoints.py) in the ``nth`` write batch clients
    send it. On PostgreSQL the daemon's own first batch is its presence heartbeat,
    queued as the store opens, before READY (daemon/store/pg_store.py ``_keep_present``):
    there the point is armed one batch later, and the next heartbeat put off (a long
    ``--presence-interval``), so that no other batch of its own comes in between."""
    if daemon.store is None:
        return daemon.start(env=daemon.env(TOWERD_CRASH_AT=f"{point}:{nth}"))
    return daemon.start(
        "--presence-interval", "600", "--presence-ttl", "1200",
        env=daemon.env(TOWERD_CRASH_AT=f"{point}:{nth + 1}"),
    )  # fmt: skip


def store_query(daemon: Daemon, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Read ``daemon``'s store directly, committed rows: its SQLite file with sqlite3, or
    its PostgreSQL database with psycopg (the same SQL: ``?`` placeholders, no ``?`` or
    ``%`` inside a literal)."""
    store = daemon.store
    if store is not None:
        import psycopg

        with psycopg.connect(store, autocommit=True) as pg:
            return pg.execute(sql.replace("?", "%s"), args).fetchall()
    import sqlite3
    from contextlib import closing

    with closing(sqlite3.connect(daemon.state_dir / "towerd.db")) as conn:
        return conn.execute(sql, args).fetchall()


def store_execute(daemon: Daemon, sql: str, args: tuple[Any, ...] = ()) -> None:
    """Write ``daemon``'s store directly, committed (see ``store_query``)."""
    store = daemon.store
    if store is not None:
        import psycopg

        with psycopg.connect(store, autocommit=True) as pg:
            pg.execute(sql.replace("?", "%s"), args)
        return
    import sqlite3
    from contextlib import closing

    with closing(sqlite3.connect(daemon.state_dir / "towerd.db", isolation_level=None)) as conn:
        conn.execute(sql, args)


def db_location(daemon: Daemon) -> str:
    """What ``status`` says is the daemon's store (``db_path``, ``store.location``): the
    file in the state dir, or on PostgreSQL the DSN without its password."""
    if daemon.store is None:
        return str(daemon.state_dir / "towerd.db")
    from towerd.daemon.store.pg import redacted

    return redacted(daemon.store)


def towerctl(
    daemon: Daemon, *args: str, check: bool = False, **kwargs: Any
) -> subprocess.CompletedProcess[str]:
    """Run the real CLI against ``daemon``'s socket."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOWERD_")}
    return subprocess.run(
        [TOWERCTL, "--socket", str(daemon.socket_path), *args],
        capture_output=True,
        text=True,
        env=env,
        check=check,
        timeout=30,
        **kwargs,
    )


def fill_filesystem(directory: str | os.PathLike[str]) -> str:
    """Write a filler file into ``directory`` until its filesystem is full; returns it."""
    import errno

    path = os.path.join(directory, "filler")
    block = b"\0" * 4096
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        while True:
            os.write(fd, block)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC, exc
    finally:
        os.close(fd)
    return path


def can_mount_tmpfs() -> str | None:
    """Why a size-capped tmpfs in a mount namespace is impossible here, or None."""
    import shutil

    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return "needs root and unshare(1) to mount a size-capped tmpfs"
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True)
    if probe.returncode != 0:
        return f"the kernel refuses mount namespaces here: {probe.stderr.decode().strip()}"
    return None


def spawn_on_small_disk(
    daemon: Daemon, mountpoint: Path, *extra: str, size: str = "4m", before_exec: str = ""
) -> subprocess.Popen[bytes]:
    """Run ``daemon`` in its own mount namespace with a ``size`` tmpfs on ``mountpoint``
    (its state dir must be inside it). ``before_exec`` is shell run first, inside the
    namespace (``$M`` is the mountpoint): to copy a state dir in, or fill the disk. The
    test reaches the tmpfs through ``/proc/<pid>/root``."""
    mount = f'mount -t tmpfs -o size={size},mode=0700 tmpfs "$M"'
    script = f'M="$0"; {mount} && {{ {before_exec or ":"}; }}; exec "$@"'
    log = open(daemon.log_path, "ab")  # noqa: SIM115 - the process's lifetime
    daemon.proc = subprocess.Popen(
        ["unshare", "-m", "sh", "-c", script, str(mountpoint), *daemon.command(*extra)],
        env=daemon.env(),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    return daemon.proc


def rss_kib(pid: int) -> int:
    """A process's resident set, in KiB (VmRSS)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


def plant_foreign_rows(
    state_dir: Path, daemon_id: str, count: int = 1, store: str | None = None
) -> list[str]:
    """Write fleet rows as another daemon id into a stopped daemon's store, in process:
    rows a crashed or retired daemon left behind, for ``fleet.adopt`` to take over.
    ``store``: the daemon's PostgreSQL DSN (``Daemon.store``), None for its SQLite file.

    On PostgreSQL the planted box is then made silent since long ago (its presence at
    0), as a box that crashed: the next heartbeat of a live box declares it dead (the
    daemon beats once as it starts), and only then may it be adopted (wait with
    ``wait_box_dead``). The embedded store has no presence: adoption needs no wait."""
    import anyio

    from towerd.daemon.store import StoreConfig, open_store
    from towerd.daemon.store.fleet import insert_session
    from towerd.protocol.methods import SessionRegisterParams

    async def plant() -> list[str]:
        # Its own presence TTL, recorded at its start, is the one it is judged by.
        config = StoreConfig(
            state_dir, daemon_id=daemon_id, store=store, presence_ttl_ms=QUICK_TTL_S * 1000
        )
        async with open_store(config) as opened:
            return [
                await opened.write(insert_session, SessionRegisterParams(cwd=f"/f{i}", agent="a"))
                for i in range(count)
            ]

    planted = anyio.run(plant)
    if store is not None:
        import psycopg

        with psycopg.connect(store, autocommit=True) as conn:
            conn.execute("UPDATE daemons SET presence_at = 0 WHERE daemon_id = %s", (daemon_id,))
    return planted


# A daemon on PostgreSQL that declares a silent box dead soon: a box is declared dead
# once its declarer has seen it silent for the presence TTL on its own clock (at least
# 5 s), so a planted silent box waits that long after the daemon's start.
QUICK_TTL_S = 5
QUICK_PRESENCE = ("--presence-interval", "0.5", "--presence-ttl", str(QUICK_TTL_S))


def start_declaring(daemon: Daemon) -> Daemon:
    """``daemon.start()``, with :data:`QUICK_PRESENCE` on PostgreSQL."""
    return daemon.start(*(QUICK_PRESENCE if daemon.store is not None else ()))


def wait_box_dead(daemon: Daemon, daemon_id: str, timeout: float = 15.0) -> None:
    """PostgreSQL: wait until ``daemon`` (started by :func:`start_declaring`) has
    declared the box ``daemon_id`` dead (a box planted silent by ``plant_foreign_rows``:
    declared once the daemon has seen it silent for the presence TTL). Nothing on
    SQLite, where no box is ever declared dead."""
    if daemon.store is None:
        return

    def dead() -> bool:
        with daemon.client() as client:
            boxes = client.boxes_list()["boxes"]
        return any(box["daemon_id"] == daemon_id and box["state"] == "dead" for box in boxes)

    wait_for(dead, timeout=timeout, what=f"box {daemon_id} to be declared dead")
