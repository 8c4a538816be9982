"""A private PostgreSQL cluster for the tests, from the Debian server binaries.

``PgCluster`` runs initdb in a short temp dir under /tmp (socket paths are limited),
starts the server on its own Unix socket dir and on a free TCP port of 127.0.0.1 (so a
test can also reach it over TCP, e.g. through a proxy), and hands out fresh databases
owned by ``towerd``, a role with no privileges beyond LOGIN. Administration is psycopg
as the superuser ``postgres`` over the Unix socket; authentication is ``trust``.

initdb and the server refuse to run as root: as root they run as the ``postgres`` user
(``runuser -u postgres --``), with the data dir (0700) and the socket dir (0755) owned
by it and the temp root traversable. Readiness is ``pg_ctl -w`` (a condition with a
deadline), and :meth:`PgCluster.kill` waits for every process of the server to have
exited (pidfd), never for a time.

Default settings trade durability for speed (fsync, full_page_writes and
synchronous_commit off); ``PgCluster(durable=True)`` runs with all three on, for tests
of what survives a crash. The cluster uses the C locale whatever the environment says:
deterministic, and text sorts by bytes, as SQLite's BINARY collation does.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import itertools
import os
import pwd
import re
import select
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

SUPERUSER = "postgres"  # initdb -U: the cluster's superuser, used for administration
ROLE = "towerd"  # owner of every database new_database makes: LOGIN and nothing else
SERVER_USER = "postgres"  # the OS user the server runs as when the tests run as root
START_TIMEOUT_S = 60  # pg_ctl -w -t: readiness (and crash recovery) within this
STOP_TIMEOUT_S = 60
EXIT_TIMEOUT_S = 30  # kill(): every server process gone within this


def bindir() -> Path | None:
    """The newest /usr/lib/postgresql/<version>/bin that has initdb, or None."""
    found = [Path(p).parent for p in glob.glob("/usr/lib/postgresql/*/bin/initdb")]

    def version(path: Path) -> tuple[int, ...]:
        return tuple(int(n) for n in re.findall(r"\d+", path.parent.name)) or (0,)

    return max(found, key=version) if found else None


def postgres_available() -> str | None:
    """Why a private cluster cannot be started here, or None when it can."""
    binaries = bindir()
    if binaries is None:
        return "no PostgreSQL server (/usr/lib/postgresql/*/bin/initdb: Debian package postgresql)"
    for tool in ("initdb", "pg_ctl", "postgres"):
        if not os.access(binaries / tool, os.X_OK):
            return f"{binaries / tool} is missing or not executable"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam(SERVER_USER)
        except KeyError:
            return f"running as root (initdb refuses root) and there is no {SERVER_USER!r} user"
        if runuser() is None:
            return f"running as root and runuser is missing (to run the server as {SERVER_USER})"
    if importlib.util.find_spec("psycopg") is None:
        return "psycopg is not installed (pip install -e '.[postgresql]')"
    return None


def runuser() -> str | None:
    """runuser's path: on PATH, else in the sbin directories (a root shell opened with
    Debian's ``su``, not ``su -``, keeps a PATH without them)."""
    return shutil.which("runuser") or shutil.which("runuser", path="/usr/sbin:/sbin")


def in_ci(environ: Mapping[str, str] = os.environ) -> bool:
    return environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def require_postgres(reason: str | None, environ: Mapping[str, str] = os.environ) -> None:
    """Nothing when PostgreSQL is available (``reason`` is None); otherwise skip the test,
    or fail it under CI=true: there the PostgreSQL run is not optional."""
    import pytest

    if reason is None:
        return
    if in_ci(environ):
        pytest.fail(f"PostgreSQL is required in CI (CI=true): {reason}", pytrace=False)
    pytest.skip(f"PostgreSQL unavailable: {reason}")


def free_port() -> int:
    """A TCP port of 127.0.0.1 nobody listens on now (bind port 0, read it, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class PgCluster:
    """One private cluster: ``start()``, databases, ``kill()``/``restart()``, ``stop()``.

    As a context manager it starts on entry and on exit stops and removes its files."""

    def __init__(
        self,
        *,
        durable: bool = False,
        locale: str = "C",
        base: str = "/tmp",
        also_on: tuple[str, str] | None = None,
        server_env: Mapping[str, str] | None = None,
    ) -> None:
        """``also_on``: (an address of this machine, a network in CIDR): the server also
        listens on that address and trusts clients of that network (a test's network
        namespace reaching it over a veth pair); the address must exist at start.
        ``server_env``: more environment for the server (libfaketime, for a test that
        steps the server's clock)."""
        binaries = bindir()
        if binaries is None:
            raise RuntimeError(postgres_available() or "no PostgreSQL binaries")
        self.bin = binaries
        self.durable = durable
        self.locale = locale
        self.also_on = also_on
        self.server_env = dict(server_env or {})
        self.base = base  # where the temp root goes: a short path (socket paths are limited)
        self.as_server_user = os.geteuid() == 0
        self.root: Path | None = None
        self.port = 0
        self.start_ms: float | None = None  # the first start: initdb + server ready
        self._running = False
        self._names = itertools.count(1)
        self._admin: Any = None  # psycopg.Connection to the postgres database, as SUPERUSER

    # --- paths ---------------------------------------------------------------------

    @property
    def data(self) -> Path:
        return self._root / "data"

    @property
    def sockdir(self) -> Path:
        return self._root / "sock"

    @property
    def logfile(self) -> Path:
        return self._root / "postgres.log"

    @property
    def _root(self) -> Path:
        if self.root is None:
            raise RuntimeError("the cluster was not started")
        return self.root

    # --- life cycle ----------------------------------------------------------------

    def __enter__(self) -> PgCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> PgCluster:
        """initdb (the first time), then start the server and wait until it is ready;
        later starts (after stop() or kill()) keep the socket dir and the port."""
        if self._running:
            return self
        began = time.perf_counter()
        fresh = self.root is None
        if fresh:
            self._initdb()
        else:
            self._forget_unreaped_postmaster()
        self._start_server(pick_port=fresh)
        if fresh:
            self.psql(
                "postgres",
                f"CREATE ROLE {ROLE} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION",
            )
            self.start_ms = (time.perf_counter() - began) * 1000
        return self

    def stop(self) -> None:
        """A clean shutdown (``pg_ctl -m fast``; ``-m immediate`` if that fails)."""
        if self._running:
            self._drain_drops()
        self._close_admin()
        if not self._running:
            return
        result = self._pg_ctl("stop", "-m", "fast", "-t", str(STOP_TIMEOUT_S))
        if result.returncode != 0:
            result = self._pg_ctl("stop", "-m", "immediate", "-t", str(STOP_TIMEOUT_S))
        if result.returncode != 0:
            raise RuntimeError(f"pg_ctl stop failed: {result.stdout}{result.stderr}")
        self._running = False

    def kill(self) -> None:
        """A crash: SIGKILL to the postmaster (postmaster.pid) and, as pg_ctl started it
        in a session of its own, to its whole process group (every backend at once, so
        nothing of the server writes afterwards). Returns when all of them have exited."""
        self._close_admin()
        pid = self.postmaster_pid()
        group = os.getpgid(pid)
        if group == pid:
            os.killpg(group, signal.SIGKILL)
        else:  # not a group leader: the postmaster alone, its children follow it out
            group = 0
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + EXIT_TIMEOUT_S
        _wait_exit(pid, deadline)
        if group:
            while members := _live_group_members(group):
                for member in members:
                    _wait_exit(member, deadline)
        self._running = False

    def restart(self) -> None:
        """Start the server again (after ``kill()``: crash recovery) on the same socket
        and port, so every DSN handed out before still reaches it; waits until ready."""
        if self._running:
            self.stop()
        self.start()

    def close(self) -> None:
        """Stop the server and remove every file of the cluster."""
        try:
            self._drain_drops()
            if self._running:
                self.stop()
        finally:
            if self.root is not None:
                shutil.rmtree(self.root, ignore_errors=True)
                self.root = None

    @property
    def running(self) -> bool:
        return self._running

    def postmaster_pid(self) -> int:
        return int((self.data / "postmaster.pid").read_text().split("\n", 1)[0])

    def log(self) -> str:
        try:
            return self.logfile.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    # --- databases -----------------------------------------------------------------

    def dsn(self, dbname: str, user: str = ROLE) -> str:
        """The Unix-socket DSN of ``dbname`` (the port names the socket file)."""
        return f"postgresql://{user}@/{dbname}?host={self.sockdir}&port={self.port}"

    def tcp_dsn(self, dbname: str, user: str = ROLE) -> str:
        return f"postgresql://{user}@127.0.0.1:{self.port}/{dbname}"

    def new_database(self, name: str | None = None, *, migrated: bool = False) -> str:
        """A fresh database owned by ``towerd``; its DSN. ``migrated``: a copy of one
        database towerd's schema ladder migrated once in this cluster (empty tables, as
        the first daemon start would leave them): a copy takes milliseconds, the ladder
        ~0.4 s per test. Tests of the ladder itself use an empty one (from template0)."""
        from psycopg import sql

        name = name or self.fresh_name()
        template = self._migrated_template() if migrated else "template0"
        self._admin_execute(
            sql.SQL("CREATE DATABASE {} OWNER {} TEMPLATE {} STRATEGY FILE_COPY").format(
                sql.Identifier(name), sql.Identifier(ROLE), sql.Identifier(template)
            )
        )
        return self.dsn(name)

    MIGRATED_TEMPLATE = "towerd_migrated"

    def _migrated_template(self) -> str:
        if not getattr(self, "_has_migrated_template", False):
            import psycopg

            from towerd.daemon.store import pg_schema

            dsn = self.new_database(self.MIGRATED_TEMPLATE)
            with psycopg.connect(dsn, autocommit=True) as conn:
                pg_schema.migrate(conn)
            self._has_migrated_template = True
        return self.MIGRATED_TEMPLATE

    def fresh_name(self) -> str:
        """A database name not used yet in this cluster."""
        return f"t{next(self._names)}"

    def drop_soon(self, name: str) -> None:
        """Drop ``name`` in a background thread (see ``Databases.drop``)."""
        if getattr(self, "_dropper", None) is None:
            self._dropper = _Dropper(self)
        self._dropper.names.put(name)

    def _drain_drops(self) -> None:
        dropper, self._dropper = getattr(self, "_dropper", None), None
        if dropper is not None:
            dropper.drain()

    def drop_database(self, name: str) -> None:
        """Drop ``name``, ending any session still connected to it."""
        from psycopg import sql

        self._admin_execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )

    def psql(self, dbname: str, statement: str, user: str = SUPERUSER) -> list[tuple[Any, ...]]:
        """Run ``statement`` (several, ``;``-separated, are allowed) on ``dbname`` as
        ``user``, autocommit, with psycopg over the Unix socket; the last one's rows."""
        import psycopg

        with psycopg.connect(self._conninfo(dbname, user), autocommit=True) as conn:
            cursor = conn.execute(statement)
            return cursor.fetchall() if cursor.description is not None else []

    # --- inside ----------------------------------------------------------------------

    def _conninfo(self, dbname: str, user: str) -> str:
        return (
            f"host={self.sockdir} port={self.port} dbname={dbname} user={user} connect_timeout=10"
        )

    def _admin_execute(self, statement: Any) -> None:
        import psycopg

        if self._admin is None or self._admin.closed or self._admin.broken:
            self._admin = psycopg.connect(self._conninfo("postgres", SUPERUSER), autocommit=True)
        self._admin.execute(statement)

    def _close_admin(self) -> None:
        if self._admin is not None:
            with contextlib.suppress(Exception):
                self._admin.close()
            self._admin = None

    def _initdb(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="pg-", dir=self.base))
        self.root.chmod(0o711)  # the server user must reach data/ and sock/ inside
        self.data.mkdir(mode=0o700)
        self.sockdir.mkdir(mode=0o755)
        self.logfile.touch(mode=0o600)
        if self.as_server_user:
            user = pwd.getpwnam(SERVER_USER)
            for path in (self.data, self.sockdir, self.logfile):
                os.chown(path, user.pw_uid, user.pw_gid)
        result = self._run(
            self.bin / "initdb", "-D", str(self.data), "-A", "trust", "-U", SUPERUSER,
            "--no-sync", "-E", "UTF8", f"--locale={self.locale}",
        )  # fmt: skip
        if result.returncode != 0:
            output = result.stdout + result.stderr
            raise RuntimeError(f"initdb failed ({result.returncode}):\n{output}")
        if self.also_on is not None:
            with open(self.data / "pg_hba.conf", "a") as hba:
                hba.write(f"host all all {self.also_on[1]} trust\n")

    def _forget_unreaped_postmaster(self) -> None:
        """The killed postmaster's parent was pg_ctl, long gone: until whoever inherited
        it (pid 1) reaps it, its pid is taken by a zombie, and the new postmaster would
        take postmaster.pid and the socket's lock file for a live server's. Every process
        of the old server has exited (kill() waited), so a lock file naming a zombie is
        stale: remove it, as the server itself concludes once the pid is reaped."""
        for lock in (self.data / "postmaster.pid", self.sockdir / f".s.PGSQL.{self.port}.lock"):
            try:
                pid = int(lock.read_text().split("\n", 1)[0])
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, ValueError, IndexError):
                continue  # no lock file, or its pid is free: the server handles that itself
            if state in ("Z", "X"):
                lock.unlink()

    def _server_options(self) -> str:
        durable = "on" if self.durable else "off"
        return " ".join(
            [
                f"-k {self.sockdir}",
                f"-c listen_addresses=127.0.0.1{',' + self.also_on[0] if self.also_on else ''}",
                f"-p {self.port}",
                f"-c fsync={durable}",
                f"-c full_page_writes={durable}",
                f"-c synchronous_commit={durable}",
                "-c max_connections=300",
            ]
        )

    def _start_server(self, pick_port: bool) -> None:
        attempts = 5 if pick_port else 1
        for _ in range(attempts):
            if pick_port:
                self.port = free_port()
            logged = self.logfile.stat().st_size
            result = self._pg_ctl(
                "start", "-l", str(self.logfile), "-t", str(START_TIMEOUT_S),
                "-o", self._server_options(),
            )  # fmt: skip
            if result.returncode == 0:
                self._running = True
                return
            this_start = self.log()[logged:]
            if pick_port and "could not bind" in this_start:
                continue  # someone took the free port in between: another one
            raise RuntimeError(
                f"pg_ctl start failed ({result.returncode}): {result.stdout}{result.stderr}\n"
                f"server log:\n{this_start[-4000:]}"
            )
        raise RuntimeError(f"no free TCP port for the server after {attempts} attempts")

    def _pg_ctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        return self._run(self.bin / "pg_ctl", args[0], "-w", "-D", str(self.data), *args[1:])

    def _run(self, *argv: str | Path) -> subprocess.CompletedProcess[str]:
        command = [str(arg) for arg in argv]
        if self.server_env and Path(command[0]).name == "pg_ctl":
            # set after the switch of user: a preloaded library (libfaketime) loaded by
            # runuser as root would make state the server's user cannot open
            command = ["env", *(f"{k}={v}" for k, v in self.server_env.items()), *command]
        if self.as_server_user:
            command = [runuser() or "runuser", "-u", SERVER_USER, "--", *command]
        # No PG* settings of the caller's environment reach the server tools; messages
        # in English (the port-taken check reads the log).
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        env["LC_ALL"] = "C"
        return subprocess.run(
            command,
            cwd=self._root,  # the server user may not be able to enter the caller's cwd
            env=env,
            capture_output=True,
            text=True,
            timeout=START_TIMEOUT_S + 30,
            check=False,
        )


class Databases:
    """Fresh databases of one cluster for one test; ``drop_all()`` at its end."""

    def __init__(self, cluster: PgCluster) -> None:
        self.cluster = cluster
        self.names: dict[str, str] = {}  # dsn -> database name

    def __call__(self, *, migrated: bool = True) -> str:
        name = self.cluster.fresh_name()
        dsn = self.cluster.new_database(name, migrated=migrated)
        self.names[dsn] = name
        return dsn

    def drop(self, dsn: str) -> None:
        """Dropped in the background (a DROP costs ~0.1 s, once per PostgreSQL test):
        the name is never reused, and the dropper is drained before the cluster stops."""
        self.cluster.drop_soon(self.names.pop(dsn))

    def drop_all(self) -> None:
        """Best effort: a test may have left the cluster down."""
        for dsn in list(self.names):
            with contextlib.suppress(Exception):
                self.drop(dsn)


class _Dropper:
    """A thread with its own admin connection dropping databases handed to it."""

    def __init__(self, cluster: PgCluster) -> None:
        import queue

        self.cluster = cluster
        self.names: queue.Queue[str | None] = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="pg-dropper", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        import psycopg
        from psycopg import sql

        conn = None
        while (name := self.names.get()) is not None:
            with contextlib.suppress(Exception):  # best effort, as drop_all
                if conn is None or conn.closed or conn.broken:
                    conn = psycopg.connect(
                        self.cluster._conninfo("postgres", SUPERUSER), autocommit=True
                    )
                statement = sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)")
                conn.execute(statement.format(sql.Identifier(name)))
        if conn is not None:
            conn.close()

    def drain(self) -> None:
        self.names.put(None)
        self.thread.join(timeout=60)


# --- waiting for processes to exit ----------------------------------------------------


def _live_group_members(group: int) -> list[int]:
    """The processes of process group ``group`` that have not exited (zombies have)."""
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue  # gone meanwhile
        state, _ppid, pgrp = stat.rsplit(")", 1)[1].split()[:3]
        if int(pgrp) == group and state not in ("Z", "X"):
            members.append(int(entry))
    return members


def _wait_exit(pid: int, deadline: float) -> None:
    """Return once ``pid`` has exited (any process, not only a child: a pidfd turns
    readable at exit); TimeoutError at ``deadline``."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            raise TimeoutError(f"process {pid} still runs after SIGKILL")
    finally:
        os.close(fd)
