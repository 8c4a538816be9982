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

from collections.abc import Iterator

import pytest

import store_helpers
from towerd_testing import backend_params


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "store_backend" not in metafunc.fixturenames:
        return
    if metafunc.definition.get_closest_marker("no_backend_param") is not None:
        return
    metafunc.parametrize("store_backend", backend_params(metafunc.definition), indirect=True)


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
