"""Fixtures shared by every test; the helpers live in towerd_testing.py."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from towerd_testing import Daemon


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


@pytest.fixture
def make_daemon(short_tmp: Path) -> Iterator[Callable[..., Daemon]]:
    """Factory for daemons sharing one temp root; all are killed at teardown."""
    daemons: list[Daemon] = []

    def make(name: str = "d") -> Daemon:
        daemon = Daemon(short_tmp, name)
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
