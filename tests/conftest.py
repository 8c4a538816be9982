"""Fixtures shared by every test; the helpers live in towerd_testing.py."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from towerd_testing import Daemon, backend_params

if TYPE_CHECKING:  # tests/pg_cluster.py is imported only when a test asks for PostgreSQL
    from pg_cluster import Databases, PgCluster


def pytest_sessionstart(session: pytest.Session) -> None:
    """Compile towerd's modules once, up front. The tests start hundreds of daemons and
    towerctl processes; where PYTHONDONTWRITEBYTECODE is set (this sandbox sets it), each
    of them would compile every module it imports anew: ~130 ms more per daemon start
    (435 against 565 ms to READY, measured here)."""
    import compileall

    root = Path(__file__).resolve().parent.parent
    for package in ("protocol", "client", "daemon", "systemd"):
        compileall.compile_dir(root / package, quiet=1)


@pytest.fixture
def anyio_backend() -> str:
    # aiosqlite runs on asyncio only.
    return "asyncio"


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A temp dir with a short path: AF_UNIX socket paths are limited to 107 bytes."""
    path = Path(tempfile.mkdtemp(prefix="td-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


# --- the store backend of the daemons a test makes -------------------------------------


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test of a module marked ``both_backends`` that makes daemons (``daemon``,
    ``make_daemon``) runs once per store backend: ``[sqlite]`` and ``[pg]``, as the
    store suite does (TOWERD_TEST_BACKENDS picks; ``sqlite_only`` keeps ``[sqlite]``).
    tests/store/ parametrizes its own ``store_backend`` (tests/store/conftest.py)."""
    if "store_backend" not in metafunc.fixturenames:
        return
    if metafunc.definition.get_closest_marker("both_backends") is None:
        return
    metafunc.parametrize("store_backend", backend_params(metafunc.definition), indirect=True)


@pytest.fixture
def store_backend(request: pytest.FixtureRequest) -> str:
    """The store backend of the daemons this test makes: ``"sqlite"`` unless the test's
    module is marked ``both_backends`` and this is its ``[pg]`` run (``"postgresql"``)."""
    return str(getattr(request, "param", "sqlite"))


@pytest.fixture
def make_daemon(
    short_tmp: Path, store_backend: str, request: pytest.FixtureRequest
) -> Iterator[Callable[..., Daemon]]:
    """Factory for daemons sharing one temp root; all are killed at teardown.

    On PostgreSQL each state dir gets a fresh database of the session's cluster, made at
    the first start on it: every daemon started on the same state dir (a restart, a
    second instance, a daemon made again with the same name) reaches the same database,
    another state dir another one, as each state dir has its own SQLite file (as
    store_helpers.store_dsn does)."""
    daemons: list[Daemon] = []
    databases = request.getfixturevalue("pg_databases") if store_backend == "postgresql" else None
    dsns: dict[Path, str] = {}  # state dir -> its database

    def database_of(state_dir: Path) -> str | None:
        if databases is None:
            return None
        directory = Path(os.path.abspath(state_dir))
        if directory not in dsns:
            dsns[directory] = databases()
        return dsns[directory]

    def make(name: str = "d") -> Daemon:
        daemon = Daemon(short_tmp, name)
        daemon.store_of = database_of
        daemons.append(daemon)
        return daemon

    yield make
    for daemon in daemons:
        daemon.close()


@pytest.fixture
def daemon(make_daemon: Callable[..., Daemon]) -> Iterator[Daemon]:
    """A running daemon; it must stop cleanly (exit 0) at teardown unless the test ended it."""
    running = make_daemon().start()
    yield running
    if running.proc is not None and running.proc.poll() is None:
        assert running.stop() == 0, running.log()


# --- PostgreSQL: one private cluster per session, started when a test first asks ------


@pytest.fixture(scope="session")
def pg_cluster() -> Iterator[PgCluster]:
    """The session's private PostgreSQL cluster (tests/pg_cluster.py), stopped and
    removed at the end. Without PostgreSQL here the test is skipped, and fails under
    CI=true: CI always runs the PostgreSQL tests. A test that kills or stops a cluster
    starts its own ``PgCluster`` instead of this shared one."""
    from pg_cluster import PgCluster, postgres_available, require_postgres

    require_postgres(postgres_available())
    # In memory when it can be: copying a database (one per PostgreSQL test) takes
    # ~15 ms on tmpfs against ~300 ms on this machine's /tmp. Nothing here tests the
    # durability of this cluster: the tests that kill PostgreSQL start their own.
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK | os.X_OK) else "/tmp"
    with PgCluster(base=base) as cluster:
        yield cluster


@pytest.fixture
def pg_databases(pg_cluster: PgCluster) -> Iterator[Databases]:
    """Factory of fresh databases owned by ``towerd``: each call creates one and returns
    its DSN; all are dropped at teardown (best effort)."""
    from pg_cluster import Databases

    databases = Databases(pg_cluster)
    yield databases
    databases.drop_all()


@pytest.fixture
def pg_dsn(pg_databases: Databases) -> str:
    """The DSN of a fresh database for this test (``postgresql://towerd@/NAME?host=...``)."""
    return pg_databases()
