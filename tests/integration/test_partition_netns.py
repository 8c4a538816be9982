"""A partition of a real network: box a's daemon runs in a network namespace of its own
and reaches PostgreSQL over TCP through a veth pair, the server listening on the host
side's address; the test cuts the link (``ip link set DEV down``) past the presence TTL
and heals it (``up``). No proxy between them: the kernel drops what the cut-off box
sends, as a pulled cable would.

What is proven is what the proxy's partition test proves (test_store_faults_pg.py),
on a real link: box b declares box a dead, parks its in-flight shared effect
``uncertain``, turns its key ``outcome_unknown`` and takes its lease under a greater
token; healed, box a's late commit is refused (``effect_uncertain``), nothing is
committed twice (both boxes read the same record), and box a serves again under a new
epoch.

Needs root and ``ip netns`` (iproute2): skipped without them, except under CI=true,
where it must run. The namespace and its link are removed whatever happens.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import random
import shutil
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from pg_cluster import ROLE, PgCluster, postgres_available, require_postgres
from towerd.client import EffectUncertain, LeaseHeld, OutcomeUnknown, TowerdError, Unavailable
from towerd_testing import Daemon, wait_for

SHORT_PRESENCE = ["--presence-interval", "0.5", "--presence-ttl", "5"]
WEBHOOK = "https://hooks.example/deploy"  # a shared kind: the claim takes its lease
SUBNETS = ipaddress.ip_network("10.213.0.0/16")  # a /30 of it per test, picked at random


def ip(*args: str, netns: str | None = None, check: bool = True) -> str:
    command = ["ip", *args] if netns is None else ["ip", "netns", "exec", netns, "ip", *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=10)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)}: {done.stderr.strip()}")
    return done.stdout


def netns_unavailable() -> str | None:
    """Why a network namespace cannot be made here, or None when it can."""
    if os.geteuid() != 0:
        return "needs root to make a network namespace and a veth pair"
    if shutil.which("ip") is None:
        return "needs ip(8) (iproute2) for ip netns"
    probe = f"td-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add is refused here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@dataclass
class Link:
    """Box a's side (the namespace) and the host's side of one veth pair."""

    netns: str
    host_dev: str
    host_address: str
    inner_address: str
    network: str

    def cut(self) -> None:
        ip("link", "set", self.host_dev, "down")

    def heal(self) -> None:
        ip("link", "set", self.host_dev, "up")


def _free_subnet() -> ipaddress.IPv4Network:
    """A /30 of SUBNETS that overlaps no address or route of this machine."""
    taken = []
    for line in (ip("-4", "-o", "addr", "show") + ip("-4", "route", "show")).splitlines():
        for word in line.split():
            with contextlib.suppress(ValueError):
                taken.append(ipaddress.ip_network(word, strict=False))
    candidates = list(SUBNETS.subnets(new_prefix=30))
    for _ in range(100):
        subnet = random.choice(candidates)
        if not any(subnet.overlaps(other) for other in taken if other.version == 4):
            return subnet  # type: ignore[return-value]
    raise RuntimeError(f"no free /30 in {SUBNETS}")


@contextlib.contextmanager
def network_namespace() -> Iterator[Link]:
    """A network namespace joined to this one by a veth pair (a /30: the host side .1,
    the namespace's side .2); on exit every process in it is killed and it is removed,
    its veth pair with it."""
    tag = f"{os.getpid() % 100000}{random.randrange(100):02d}"
    netns, host_dev, inner_dev = f"towerd-test-{tag}", f"tdh{tag}", f"tdn{tag}"
    subnet = _free_subnet()
    host_address, inner_address = (str(host) for host in subnet.hosts())
    ip("netns", "add", netns)
    try:
        ip("link", "add", host_dev, "type", "veth", "peer", "name", inner_dev)
        ip("link", "set", inner_dev, "netns", netns)
        ip("addr", "add", f"{host_address}/30", "dev", host_dev)
        ip("link", "set", host_dev, "up")
        ip("addr", "add", f"{inner_address}/30", "dev", inner_dev, netns=netns)
        ip("link", "set", inner_dev, "up", netns=netns)
        ip("link", "set", "lo", "up", netns=netns)
        yield Link(netns, host_dev, host_address, inner_address, str(subnet))
    finally:
        for pid in ip("netns", "pids", netns, check=False).split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), 9)
        ip("netns", "del", netns, check=False)
        ip("link", "del", host_dev, check=False)  # gone with the namespace, unless held


@pytest.fixture
def link() -> Iterator[Link]:
    reason = netns_unavailable()
    if reason is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI runs the network namespace partition test: {reason}")
        pytest.skip(reason)
    with network_namespace() as made:
        yield made


@pytest.fixture
def cluster(link: Link) -> Iterator[PgCluster]:
    """A cluster of this test's own that also listens on the host side of the link."""
    require_postgres(postgres_available())
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK | os.X_OK) else "/tmp"
    with PgCluster(base=base, also_on=(link.host_address, link.network)) as running:
        yield running


def late(call: Callable[[], Any]) -> Any:
    """``call``'s answer once the healed box reaches the store again: ("answered",
    result) or ("refused", error); None (wait on) while the store is unreachable."""

    def attempt() -> Any:
        try:
            return ("answered", call())
        except Unavailable as exc:
            if (exc.data or {}).get("reason") == "store_unreachable":
                return None
            return ("refused", exc)
        except TowerdError as exc:
            return ("refused", exc)

    return wait_for(attempt, timeout=20, what="the healed box to reach the store")


def log_events(daemon: Daemon, event: str) -> list[dict[str, Any]]:
    import json

    found = []
    for line in daemon.log().splitlines():
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if isinstance(record, dict) and record.get("event") == event:
                found.append(record)
    return found


def test_a_box_in_its_own_network_namespace_cut_off_past_the_ttl_is_fenced_at_heal(
    make_daemon: Callable[..., Daemon], link: Link, cluster: PgCluster
) -> None:
    cluster.new_database("netns", migrated=True)
    a = make_daemon("a")
    a.prefix = ["ip", "netns", "exec", link.netns]
    over_the_link = f"postgresql://{ROLE}@{link.host_address}:{cluster.port}/netns"
    a.extra_args = ["--store", over_the_link, *SHORT_PRESENCE]
    a.start()
    b = make_daemon("b")
    b.extra_args = ["--store", cluster.dsn("netns"), *SHORT_PRESENCE]
    b.start()
    try:
        with a.client() as ca, b.client() as cb:
            # Box a reaches the server over the link, from its namespace's address.
            clients = cluster.psql(
                "netns", "SELECT DISTINCT host(client_addr) FROM pg_stat_activity"
                " WHERE datname = 'netns' AND client_addr IS NOT NULL",
            )  # fmt: skip
            assert clients == [(link.inner_address,)], clients
            status = ca.status()
            cut_off, epoch = status["daemon_id"], status["owner_epoch"]
            claimed = ca.effect_claim("run-5", "notify", "attempt-a", "webhook", WEBHOOK,
                                      payload={"v": 1}, timeout_ms=600_000)  # fmt: skip
            assert claimed["status"] == "in_flight" and claimed["lease_resource"] == WEBHOOK
            effect_key, token = claimed["effect_key"], claimed["fencing_token"]
            assert ca.idem_claim("deploy", "release-5")["state"] == "claimed"

            link.cut()
            dead = wait_for(
                lambda: [e for e in log_events(b, "box_declared_dead") if e["box"] == cut_off],
                timeout=15,
                what="box b to declare box a dead",
            )
            assert dead[0]["effects_parked"] == 1 and dead[0]["keys_unknown"] == 1
            assert dead[0]["leases_released"] >= 1
            assert cb.effect_get(effect_key)["status"] == "uncertain"
            with pytest.raises(EffectUncertain):
                cb.effect_claim("run-5", "notify", "attempt-b", "webhook", WEBHOOK,
                                payload={"v": 1}, timeout_ms=600_000)  # fmt: skip
            taken = cb.lease_acquire(WEBHOOK, ttl_ms=600_000)
            assert taken["fencing_token"] > token

            link.heal()
            outcome, answer = late(lambda: ca.effect_commit(effect_key, "attempt-a", {"id": 1}))
            assert outcome == "refused", f"a's late commit was accepted: {answer!r}"
            assert isinstance(answer, EffectUncertain), repr(answer)
            record_a, record_b = ca.effect_get(effect_key), cb.effect_get(effect_key)
            assert record_a == record_b  # one record: nothing committed twice
            assert record_a["status"] == "uncertain" and record_a["receipt"] is None
            now = ca.status()
            assert now["daemon_id"] == cut_off and now["owner_epoch"] > epoch
            assert [e["old_epoch"] for e in log_events(a, "box_revived")] == [epoch]
            for client in (ca, cb):
                with pytest.raises(OutcomeUnknown):
                    client.idem_claim("deploy", "release-5")
            assert cb.lease_get(WEBHOOK)["fencing_token"] == taken["fencing_token"]
            with pytest.raises(LeaseHeld):
                ca.lease_acquire(WEBHOOK, ttl_ms=600_000)
            # Service resumes over the healed link.
            assert ca.session_register(cwd="/after", agent="claude")["session_id"]
    except AssertionError as exc:
        tails = "".join(f"\n--- {d.log_path.name} ---\n{d.log()[-5000:]}" for d in (a, b))
        raise AssertionError(f"{exc}{tails}") from exc
