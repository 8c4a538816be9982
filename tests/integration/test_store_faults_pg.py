"""Issue 16's fault contract on PostgreSQL, with real parts: real daemons, a real
server killed with SIGKILL, a real TCP path cut by a proxy the test controls
(tests/tcp_proxy.py), the real client. No mocks.

What is proven here:

* PostgreSQL killed (SIGKILL, a durable private cluster): every call that needs the
  store answers ``unavailable`` (data reason ``store_unreachable``, the message saying
  the write may or may not have been applied) within the 5 s deadline; ``ping`` answers
  at once; once the server is back the daemon serves again by itself, in the same
  process and epoch, and every write acknowledged before the kill is there, once;
* a partition shorter than the presence TTL: calls through the cut-off box answer
  ``unavailable`` within the deadline, ``ping`` at once, the other box serves on; after
  the heal a write given up at its deadline and retried with its key exists once;
* a partition longer than the presence TTL: the other box declares the cut-off box
  dead, parks its in-flight shared effect ``uncertain``, frees its lease (taken over
  under a greater token) and turns its in-progress key ``outcome_unknown``; after the
  heal the late commit of the old attempt is refused, nothing is committed twice (both
  boxes read the same record), and the box serves again under a new epoch;
* fencing across boxes: a lease that lapsed during a short partition and was taken by
  the other box refuses the late commit ``effect_lease_superseded``;
* connections reset under a box: told at once, replaced at the next use;
* a silent path that still acknowledges packets (libpq's timeouts never fire): a watch
  snapshot read on the event loop is cut off after 2 s (it froze the whole daemon,
  ping too, until the path healed), and a call stuck on its connection is cut off after
  10 s (the writer waited until the path healed: SIGTERM did not stop the daemon).
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from pg_cluster import ROLE, Databases, PgCluster, postgres_available, require_postgres
from tcp_proxy import TcpProxy
from towerd.client import (
    EffectLeaseSuperseded,
    EffectUncertain,
    LeaseHeld,
    OutcomeUnknown,
    TowerdError,
    Unavailable,
)
from towerd_testing import TOWERCTL, Daemon, wait_for

DEADLINE_S = 6.5  # the store's 5 s deadline, and slack for a loaded machine
AT_ONCE_S = 1.0  # what needs no store answers in well under this
SHORT_PRESENCE = ["--presence-interval", "0.5", "--presence-ttl", "5"]
LONG_PRESENCE = ["--presence-interval", "0.5", "--presence-ttl", "30"]  # nobody lapses
WEBHOOK = "https://hooks.example/deploy"  # a shared kind: the claim takes its lease


def store_unreachable(exc: BaseException) -> bool:
    """The daemon's own answer for a store it cannot reach (not the client's timeout)."""
    return isinstance(exc, Unavailable) and (exc.data or {}).get("reason") == "store_unreachable"


def assert_store_unreachable(exc: BaseException) -> None:
    assert store_unreachable(exc), repr(exc)
    assert isinstance(exc, Unavailable)
    assert exc.code == "unavailable"
    assert "unreachable" in exc.message
    assert "may or may not have been applied" in exc.message
    assert exc.data is not None and exc.data.get("retry") == "same_key"


def timed(call: Callable[[], Any]) -> tuple[float, Any, BaseException | None]:
    began = time.monotonic()
    try:
        result, error = call(), None
    except TowerdError as exc:
        result, error = None, exc
    return time.monotonic() - began, result, error


def answers_unreachable(call: Callable[[], Any], what: str) -> float:
    """``call`` answers ``unavailable`` / ``store_unreachable`` within the deadline."""
    elapsed, result, error = timed(call)
    assert error is not None, f"{what} answered {result!r} with the store unreachable"
    assert_store_unreachable(error)
    assert elapsed < DEADLINE_S, f"{what} took {elapsed:.2f}s"
    return elapsed


def register(client: Any, key: str) -> Any:
    """A fleet row under idempotency key ``key`` (a retry sends the same params)."""
    return client.session_register(cwd=f"/{key}", agent="a", idempotency_key=key)


def answers_at_once(client: Any) -> None:
    """``ping`` needs no store: it answers at once whatever the store does."""
    elapsed, pong, error = timed(client.ping)
    assert error is None and pong["pong"] is True, repr(error)
    assert elapsed < AT_ONCE_S, f"ping took {elapsed:.2f}s"


def assert_status_says_unreachable(client: Any) -> None:
    """``status`` answers (the daemon's own account, within the deadline) and says the
    store is unreachable."""
    elapsed, status, error = timed(client.status)
    assert error is None, repr(error)
    assert elapsed < DEADLINE_S, f"status took {elapsed:.2f}s"
    assert status["store"]["reachable"] is False, status["store"]


def assert_doctor_says_unreachable(daemon: Daemon) -> None:
    """``towerctl doctor`` answers within the deadline, names the store as the fault, and
    gives no advice meant for a damaged file (it said "restore the latest backup" and
    "schema version 0, run the matching towerd version" for a network fault)."""
    began = time.monotonic()
    done = subprocess.run(
        [TOWERCTL, "--socket", str(daemon.socket_path), "doctor"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    elapsed = time.monotonic() - began
    assert elapsed < DEADLINE_S, f"doctor took {elapsed:.2f}s"
    assert done.returncode == 1, done
    assert "the daemon cannot reach its store" in done.stdout, done.stdout
    assert "backup" not in done.stdout and "schema version" not in done.stdout, done.stdout


def served(call: Callable[[], Any]) -> Callable[[], Any]:
    """For wait_for: ``call``'s result, or None while the store is unreachable."""

    def attempt() -> Any:
        try:
            return call() or True
        except Unavailable as exc:
            if store_unreachable(exc):
                return None
            raise

    return attempt


def log_events(daemon: Daemon, event: str) -> list[dict[str, Any]]:
    found = []
    for line in daemon.log().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("event") == event:
            found.append(record)
    return found


@contextlib.contextmanager
def explained(*daemons: Daemon) -> Iterator[None]:
    """A failure comes with the tail of each daemon's log (its state dir is removed)."""
    try:
        yield
    except AssertionError as exc:
        tails = "".join(f"\n--- {d.log_path.name} ---\n{d.log()[-6000:]}" for d in daemons)
        raise AssertionError(f"{exc}{tails}") from exc


def box(make_daemon: Callable[..., Daemon], name: str, dsn: str, presence: list[str]) -> Daemon:
    daemon = make_daemon(name)
    daemon.extra_args = ["--store", dsn, *presence]
    return daemon.start()


@pytest.fixture
def database(pg_databases: Databases) -> tuple[str, str]:
    """A fresh migrated database of the session's cluster: (its Unix-socket DSN, its name)."""
    dsn = pg_databases()
    return dsn, pg_databases.names[dsn]


@pytest.fixture
def proxy(pg_databases: Databases) -> Iterator[TcpProxy]:
    """A proxy to the session cluster's TCP port."""
    with TcpProxy("127.0.0.1", pg_databases.cluster.port) as running:
        yield running


# --- the proxy itself -------------------------------------------------------------------------


def recv_exactly(sock: Any, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        assert chunk, f"EOF after {data!r}"
        data += chunk
    return data


def test_the_proxy_forwards_pauses_resumes_and_resets() -> None:
    import socket

    with socket.create_server(("127.0.0.1", 0)) as server:
        with TcpProxy("127.0.0.1", server.getsockname()[1]) as tcp:
            client = socket.create_connection(("127.0.0.1", tcp.port), timeout=5)
            peer, _ = server.accept()
            peer.settimeout(5)
            client.sendall(b"ping")
            assert recv_exactly(peer, 4) == b"ping"
            tcp.pause()
            client.sendall(b"lost?")
            peer.sendall(b"late")
            peer.settimeout(0.3)  # a bounded look: nothing may arrive while paused
            with pytest.raises(TimeoutError):
                peer.recv(16)
            client.settimeout(0.3)
            with pytest.raises(TimeoutError):
                client.recv(16)
            tcp.resume()  # what was sent meanwhile is delivered
            peer.settimeout(5)
            client.settimeout(5)
            assert recv_exactly(peer, 5) == b"lost?"
            assert recv_exactly(client, 4) == b"late"
            tcp.reset()  # both sides see a TCP reset, at once
            with pytest.raises(ConnectionResetError):
                client.recv(16)
            with pytest.raises(ConnectionResetError):
                peer.recv(16)
            client.close()
            peer.close()
            assert tcp.connections == 0 and tcp.accepted == 1


# --- a. PostgreSQL itself killed ------------------------------------------------------------


def test_postgresql_killed_answers_unavailable_within_the_deadline_then_serves_again(
    make_daemon: Callable[..., Daemon],
) -> None:
    require_postgres(postgres_available())
    with PgCluster(durable=True) as cluster:
        cluster.new_database("faults", migrated=True)
        a = box(make_daemon, "a", cluster.tcp_dsn("faults"), SHORT_PRESENCE)
        acknowledged: dict[str, str] = {}  # idempotency key -> session id, answered
        maybe: list[str] = []  # keys answered store_unreachable: applied or not
        errors: list[BaseException] = []

        def write_on() -> None:  # a client writing until the kill answers it unavailable
            try:
                with a.client() as client:
                    for i in range(100_000):
                        key = f"w-{i}"
                        elapsed, row, error = timed(lambda k=key: register(client, k))
                        if error is not None:
                            assert_store_unreachable(error)
                            assert elapsed < DEADLINE_S, f"{key} took {elapsed:.2f}s"
                            maybe.append(key)
                            return
                        acknowledged[key] = row["session_id"]
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        with explained(a), a.client() as ca:
            epoch = ca.status()["owner_epoch"]
            for i in range(20):
                key = f"k-{i}"
                acknowledged[key] = register(ca, key)["session_id"]
            assert ca.idem_claim("deploy", "r-1")["state"] == "claimed"
            ca.idem_complete("deploy", "r-1", {"url": "https://x/1"})
            granted = ca.lease_acquire("deploy/prod", ttl_ms=600_000)
            writer = threading.Thread(target=write_on)
            writer.start()
            wait_for(lambda: len(acknowledged) > 40, what="the writer to be under way")
            cluster.kill()
            writer.join(DEADLINE_S + 5)
            assert not writer.is_alive() and not errors, errors
            assert maybe  # the writer met the kill

            calls: dict[str, Callable[[], Any]] = {
                "session.register": lambda: register(ca, "during"),
                "idem.claim": lambda: ca.idem_claim("deploy", "r-2"),
                "lease.acquire": lambda: ca.lease_acquire("deploy/other"),
                "fleet.list": ca.fleet_list,
                "idem.get": lambda: ca.idem_get("deploy", "r-1"),
                "effect.get": lambda: ca.effect_get("eff_0123456789abcdef"),
            }
            for what, call in calls.items():
                answers_unreachable(call, what)
                answers_at_once(ca)
            assert_status_says_unreachable(ca)
            assert_doctor_says_unreachable(a)
            assert a.proc is not None and a.proc.poll() is None, a.log()

            cluster.restart()
            again = wait_for(
                served(lambda: register(ca, "back")),
                timeout=15,
                what="a write to succeed once PostgreSQL is back",
            )
            assert again["session_id"]
            # The same process, the same epoch: it reconnected by itself.
            assert a.proc.poll() is None
            assert ca.status()["owner_epoch"] == epoch
            rows = {r["session_id"] for r in ca.fleet_list(limit=1000)["sessions"]}
            for key, session_id in acknowledged.items():
                assert session_id in rows, f"acknowledged {key} lost"
                # A retry with the key answers the id it acknowledged: inserted once.
                assert register(ca, key)["session_id"] == session_id
            for key in [*maybe, "during"]:  # applied or not: a retry settles it, once
                register(ca, key)
            total = len(ca.fleet_list(limit=1000)["sessions"])
            assert total == len(acknowledged) + len(maybe) + 2  # + "during" + "back"
            assert ca.idem_claim("deploy", "r-1")["result"] == {"url": "https://x/1"}
            lease = ca.lease_get("deploy/prod")  # the lease outlived the crash
            assert lease["fencing_token"] == granted["fencing_token"]


# --- c. a partition shorter than the presence TTL ------------------------------------------


def test_a_partitioned_box_answers_unavailable_within_the_deadline_and_ping_at_once(
    make_daemon: Callable[..., Daemon], database: tuple[str, str], proxy: TcpProxy
) -> None:
    dsn, name = database
    a = box(make_daemon, "a", proxy.dsn(name, ROLE), LONG_PRESENCE)
    b = box(make_daemon, "b", dsn, LONG_PRESENCE)
    with explained(a, b), a.client() as ca, b.client() as cb:
        epoch = ca.status()["owner_epoch"]
        before = register(ca, "before")["session_id"]
        proxy.pause()
        results: dict[str, float] = {}
        errors: list[BaseException] = []

        def through_a(what: str, call: Callable[[], Any]) -> None:
            try:
                with a.client() as own:
                    results[what] = answers_unreachable(lambda: call(own), what)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        calls: dict[str, Callable[[Any], Any]] = {
            "session.register": lambda c: register(c, "during"),
            "idem.claim": lambda c: c.idem_claim("deploy", "c-1"),
            "fleet.list": lambda c: c.fleet_list(),
            "fleet.get": lambda c: c.fleet_get(before),
        }
        threads = [threading.Thread(target=through_a, args=item) for item in calls.items()]

        def status() -> None:
            try:
                with a.client() as own:
                    assert_status_says_unreachable(own)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads.append(threading.Thread(target=status))
        for thread in threads:
            thread.start()
        answers_at_once(ca)  # while every call above waits on the cut-off store
        assert register(cb, "b-during")["session_id"]  # the other box serves on
        for thread in threads:
            thread.join(DEADLINE_S + 5)
        assert not errors, errors
        assert set(results) == set(calls), results
        answers_at_once(ca)
        assert_doctor_says_unreachable(a)  # a silent path: no call waits out a deadline
        proxy.resume()
        again = wait_for(served(lambda: register(ca, "during")), timeout=10,
                         what="box a to serve again once the partition heals")  # fmt: skip
        # The write given up at its deadline may have committed late; its retry with the
        # same key answers one row, whichever it was.
        rows = [r for r in cb.fleet_list(limit=1000)["sessions"] if r["cwd"] == "/during"]
        assert [r["session_id"] for r in rows] == [again["session_id"]]
        assert ca.status()["owner_epoch"] == epoch  # not declared dead: the same epoch
        assert not log_events(a, "box_revived") and not log_events(b, "box_declared_dead")


def test_connections_reset_under_a_box_are_replaced_at_the_next_use(
    make_daemon: Callable[..., Daemon], database: tuple[str, str], proxy: TcpProxy
) -> None:
    _dsn, name = database
    a = box(make_daemon, "a", proxy.dsn(name, ROLE), LONG_PRESENCE)
    with explained(a), a.client() as ca:
        epoch = ca.status()["owner_epoch"]
        first = register(ca, "first")["session_id"]
        accepted = proxy.accepted
        proxy.reset()  # every connection of the box to the server is gone, at once
        # A call that meets the broken connection is told at once, never after a wait;
        # the next one runs on a new connection.
        for what, call in {"session.register": lambda: register(ca, "second"),
                           "fleet.list": ca.fleet_list}.items():  # fmt: skip
            elapsed, _, error = timed(call)
            if error is not None:
                assert_store_unreachable(error)
            assert elapsed < AT_ONCE_S, f"{what} took {elapsed:.2f}s"
        second = wait_for(served(lambda: register(ca, "second")), timeout=10,
                          what="a write on a new connection")  # fmt: skip
        assert proxy.accepted > accepted
        cwds = {r["session_id"]: r["cwd"] for r in ca.fleet_list()["sessions"]}
        assert cwds == {first: "/first", second["session_id"]: "/second"}
        assert ca.status()["owner_epoch"] == epoch


# --- b. a partition longer than the presence TTL, then healed ------------------------------


def late(call: Callable[[], Any]) -> Any:
    """``call``'s error once the healed box reaches the store again (a retry of an
    answer ``store_unreachable`` is what the answer asks for: the same call again)."""

    def attempt() -> Any:
        try:
            return ("answered", call())
        except Unavailable as exc:
            if store_unreachable(exc):
                return None
            return ("refused", exc)
        except TowerdError as exc:
            return ("refused", exc)

    return wait_for(attempt, timeout=15, what="the healed box to reach the store")


def test_a_box_cut_off_past_the_ttl_is_declared_dead_and_its_late_commit_is_refused(
    make_daemon: Callable[..., Daemon], database: tuple[str, str], proxy: TcpProxy
) -> None:
    dsn, name = database
    a = box(make_daemon, "a", proxy.dsn(name, ROLE), SHORT_PRESENCE)
    b = box(make_daemon, "b", dsn, SHORT_PRESENCE)
    with explained(a, b), a.client() as ca, b.client() as cb:
        status = ca.status()
        cut_off, epoch = status["daemon_id"], status["owner_epoch"]
        claimed = ca.effect_claim("run-16", "notify", "attempt-a", "webhook", WEBHOOK,
                                  payload={"v": 1}, timeout_ms=600_000)  # fmt: skip
        assert claimed["status"] == "in_flight" and claimed["lease_resource"] == WEBHOOK
        effect_key, token = claimed["effect_key"], claimed["fencing_token"]
        assert ca.idem_claim("deploy", "release-16")["state"] == "claimed"

        proxy.pause()
        dead = wait_for(
            lambda: [e for e in log_events(b, "box_declared_dead") if e.get("box") == cut_off],
            timeout=15, what="box b to declare box a dead",
        )  # fmt: skip
        assert dead[0]["effects_parked"] == 1 and dead[0]["keys_unknown"] == 1
        assert dead[0]["leases_released"] >= 1
        # Box b takes the target over: the effect is parked for a person to resolve, the
        # lease goes to b under a greater token.
        assert cb.effect_get(effect_key)["status"] == "uncertain"
        with pytest.raises(EffectUncertain):
            cb.effect_claim("run-16", "notify", "attempt-b", "webhook", WEBHOOK,
                            payload={"v": 1}, timeout_ms=600_000)  # fmt: skip
        taken = cb.lease_acquire(WEBHOOK, ttl_ms=600_000)
        assert taken["fencing_token"] > token

        proxy.resume()
        outcome, answer = late(lambda: ca.effect_commit(effect_key, "attempt-a", {"id": 1}))
        assert outcome == "refused", f"a's late commit was accepted: {answer!r}"
        # Box b parked the effect when it declared box a dead: the ledger answers
        # effect_uncertain before it looks at the fence (effect_lease_superseded is the
        # answer while the effect is still in flight: the next test).
        assert isinstance(answer, EffectUncertain), repr(answer)
        assert answer.data is not None and answer.data["effect"]["status"] == "uncertain"
        record_a, record_b = ca.effect_get(effect_key), cb.effect_get(effect_key)
        assert record_a == record_b
        assert record_a["status"] == "uncertain" and record_a["receipt"] is None
        assert record_a["attempt_id"] == "attempt-a"
        # A serves again, under a new epoch, having noticed it was declared dead.
        now = ca.status()
        assert now["daemon_id"] == cut_off and now["owner_epoch"] > epoch
        revived = log_events(a, "box_revived")
        assert revived and revived[0]["old_epoch"] == epoch
        assert revived[0]["owner_epoch"] == now["owner_epoch"]
        # Its key is outcome_unknown through either box; the lease stays b's.
        for client in (ca, cb):
            with pytest.raises(OutcomeUnknown):
                client.idem_claim("deploy", "release-16")
        assert cb.lease_get(WEBHOOK)["fencing_token"] == taken["fencing_token"]
        with pytest.raises(LeaseHeld):
            ca.lease_acquire(WEBHOOK, ttl_ms=600_000)


# --- fencing across boxes during a short partition -----------------------------------------


def test_a_lease_lapsed_during_a_partition_and_taken_by_the_other_box_fences_the_commit(
    make_daemon: Callable[..., Daemon], database: tuple[str, str], proxy: TcpProxy
) -> None:
    dsn, name = database
    a = box(make_daemon, "a", proxy.dsn(name, ROLE), LONG_PRESENCE)
    b = box(make_daemon, "b", dsn, LONG_PRESENCE)
    with explained(a, b), a.client() as ca, b.client() as cb:
        epoch = ca.status()["owner_epoch"]
        claimed = ca.effect_claim("run-17", "notify", "attempt-a", "webhook", WEBHOOK,
                                  timeout_ms=600_000, lease_ttl_ms=5_000)  # fmt: skip
        proxy.pause()  # a cannot renew its lease now

        def take() -> Any:
            try:
                return cb.lease_acquire(WEBHOOK, ttl_ms=600_000)
            except LeaseHeld:
                return None

        taken = wait_for(take, timeout=15, what="a's lease to lapse for box b")
        assert taken["fencing_token"] > claimed["fencing_token"]
        proxy.resume()
        outcome, answer = late(
            lambda: ca.effect_commit(claimed["effect_key"], "attempt-a", {"id": 1})
        )
        assert outcome == "refused", f"a's late commit was accepted: {answer!r}"
        assert isinstance(answer, EffectLeaseSuperseded), repr(answer)
        assert answer.data is not None and answer.data["effect"]["status"] == "uncertain"
        record_a = ca.effect_get(claimed["effect_key"])
        assert record_a == cb.effect_get(claimed["effect_key"])
        assert record_a["status"] == "uncertain"
        assert ca.status()["owner_epoch"] == epoch  # a was never declared dead


# --- the daemon's own threads and loop on a silent path ------------------------------------


def test_a_watch_opened_on_a_silent_path_is_refused_within_its_bound_and_ping_goes_on(
    make_daemon: Callable[..., Daemon], database: tuple[str, str], proxy: TcpProxy
) -> None:
    """A watch snapshot is read on the event loop's own connection (one loop step): on a
    path that acknowledges packets but never answers, that read froze the whole daemon
    (ping, every client, every deadline) until the path healed. Now the read is cut off
    after 2 s (pg_store.INLINE_BOUND_S): the loop is held that long at most."""
    _dsn, name = database
    a = box(make_daemon, "a", proxy.dsn(name, ROLE), LONG_PRESENCE)
    bound = 2.0 + 1.5  # the inline read's bound, and slack
    with explained(a), a.client() as ca, a.client() as watcher:
        register(ca, "before")
        with a.client() as first:
            next(first.watch(["fleet"]))  # the inline connection is open and was used
        proxy.pause()
        watched: list[tuple[float, Any, BaseException | None]] = []
        thread = threading.Thread(
            target=lambda: watched.append(timed(lambda: next(watcher.watch(["fleet"]))))
        )
        thread.start()
        elapsed, pong, error = timed(ca.ping)  # sent while the watch's read waits, or not
        assert error is None and pong["pong"] is True, repr(error)
        assert elapsed < bound, f"ping took {elapsed:.2f}s"
        thread.join(10)
        assert watched, "the watch did not answer"
        elapsed, _, error = watched[0]
        assert error is not None
        assert_store_unreachable(error)
        assert elapsed < bound, f"watch took {elapsed:.2f}s"
        answers_at_once(ca)
        proxy.resume()
    with a.client() as again:
        snapshot = wait_for(served(lambda: next(again.watch(["fleet"]))), timeout=10,
                            what="a watch to be served once the path heals")  # fmt: skip
        assert "snapshot" in snapshot


@pytest.mark.slow
def test_a_box_on_a_silent_path_stops_on_sigterm_without_waiting_for_the_path(
    make_daemon: Callable[..., Daemon], database: tuple[str, str], proxy: TcpProxy
) -> None:
    """The writer's thread waited on the silent connection until the path healed (TCP
    still acknowledged every packet, so neither tcp_user_timeout nor keepalives fired):
    every later write queued behind it and SIGTERM did not stop the daemon. A call
    still on its connection after 10 s now has the connection cut off."""
    _dsn, name = database
    a = box(make_daemon, "a", proxy.dsn(name, ROLE), LONG_PRESENCE)
    with explained(a), a.client() as ca:
        register(ca, "before")
        proxy.pause()
        answers_unreachable(lambda: register(ca, "during"), "session.register")
        assert a.proc is not None
        began = time.monotonic()
        a.proc.terminate()
        try:
            code = a.proc.wait(25)
        finally:
            proxy.resume()  # the old code exits only now
        assert code == 0, a.log()
        assert time.monotonic() - began < 25
        assert log_events(a, "store_connection_stuck")
