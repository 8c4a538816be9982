import json

import pytest

from towerd_testing import towerctl

pytestmark = pytest.mark.both_backends


def test_smoke(daemon):
    with daemon.client() as c:
        assert c.ping()["pong"] is True
    r = towerctl(daemon, "--json", "status")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["store"]["backend"] == daemon.backend
