from towerd_testing import towerctl


def test_smoke(daemon):
    with daemon.client() as c:
        assert c.ping()["pong"] is True
    r = towerctl(daemon, "--json", "status")
    assert r.returncode == 0, r.stderr
