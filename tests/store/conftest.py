"""Every store test runs on each store backend: ``[sqlite]`` (the file in the state dir)
and ``[pg]`` (a fresh database of the session's private PostgreSQL cluster, reached
through ``store_helpers.opened``/``query``/``execute``; tests/pg_cluster.py).

TOWERD_TEST_BACKENDS picks the backends (default ``sqlite,postgresql``, what CI runs).
Two markers take a test out of the product:

* ``sqlite_only``: about the SQLite file itself; only its ``[sqlite]`` run exists.
* ``no_backend_param``: not a store test (the cluster's self-test, a PostgreSQL-only
  test that takes ``pg_dsn`` itself): it runs once, with no backend id, and the helpers
  reach SQLite.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

import store_helpers

BACKENDS = {"sqlite": "sqlite", "postgresql": "pg"}  # backend -> its test id
DEFAULT_BACKENDS = "sqlite,postgresql"


def selected_backends() -> list[str]:
    raw = os.environ.get("TOWERD_TEST_BACKENDS", DEFAULT_BACKENDS)
    names = [name.strip() for name in raw.split(",") if name.strip()]
    unknown = [name for name in names if name not in BACKENDS]
    if unknown or not names:
        raise pytest.UsageError(
            f"TOWERD_TEST_BACKENDS={raw!r}: a comma-separated subset of {', '.join(BACKENDS)}"
        )
    return list(dict.fromkeys(names))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "store_backend" not in metafunc.fixturenames:
        return
    if metafunc.definition.get_closest_marker("no_backend_param") is not None:
        return
    names = selected_backends()
    if metafunc.definition.get_closest_marker("sqlite_only") is not None:
        names = [name for name in names if name == "sqlite"]
    params = [pytest.param(name, id=BACKENDS[name]) for name in names]
    if not params:  # sqlite_only, and TOWERD_TEST_BACKENDS leaves sqlite out
        reason = "sqlite_only, and TOWERD_TEST_BACKENDS leaves sqlite out"
        params = [pytest.param("sqlite", id="sqlite", marks=pytest.mark.skip(reason=reason))]
    metafunc.parametrize("store_backend", params, indirect=True)


@pytest.fixture(autouse=True)
def store_backend(request: pytest.FixtureRequest) -> Iterator[str | None]:
    """The backend this run of the test is on (None: a ``no_backend_param`` test)."""
    name: str | None = getattr(request, "param", None)
    if name == "postgresql":
        databases = request.getfixturevalue("pg_databases")
        store_helpers.use_backend(
            store_helpers.Backend(name, new_database=databases, drop_database=databases.drop)
        )
    else:
        store_helpers.use_backend(store_helpers.Backend())
    try:
        yield name
    finally:
        store_helpers.use_backend(store_helpers.Backend())
