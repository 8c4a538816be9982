"""Hook events while the shared store is unreachable: answered at once as queued, kept
in a bounded outbox in the state dir, filed in order when PostgreSQL returns; ping,
status and doctor answer from the daemon itself and name the store's state.

A real PostgreSQL cluster of this test's own is SIGKILLed and restarted; the daemon is
a real subprocess. The outbox's own rules (the bound, a restart, a torn record) are
checked on the real class and a real file.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from towerd.client import Unavailable
from towerd.daemon.outbox import OUTBOX_FILE, Outbox
from towerd.protocol.methods import HookEventParams
from towerd_testing import Daemon, wait_for


@pytest.fixture
def private_cluster(pg_cluster: object) -> Iterator[object]:
    """A cluster of this test's own (it is killed), durable: a commit survives SIGKILL."""
    from pg_cluster import PgCluster

    with PgCluster(durable=True) as cluster:
        yield cluster


def test_hook_events_wait_in_the_outbox_and_are_filed_in_order(
    make_daemon: Callable[..., Daemon], private_cluster: object
) -> None:
    cluster = private_cluster
    dsn = cluster.new_database(migrated=True)  # type: ignore[attr-defined]
    daemon = make_daemon()
    daemon.extra_args = ["--store", dsn, "--presence-interval", "0.5", "--presence-ttl", "5"]
    daemon.start()
    try:
        run_through_a_store_outage(daemon, cluster)
    except BaseException:
        print(daemon.log()[-6000:])
        raise
    assert not (daemon.state_dir / OUTBOX_FILE).exists()


def run_through_a_store_outage(daemon: Daemon, cluster: object) -> None:
    with daemon.client() as client:
        before = client.hook_event("UserPromptSubmit", "claude", agent_session_id="s-1")
        assert not before.get("queued") and before["event_id"] > 0
        cluster.kill()  # type: ignore[attr-defined]
        wait_for(lambda: client.ping()["store"] == "unreachable", 15, "the store to be missed")
        answered = []
        for n in range(3):
            started = time.monotonic()
            answer = client.hook_event(
                "PostToolUse", "claude", agent_session_id="s-1", payload={"n": n}
            )
            answered.append(time.monotonic() - started)
            assert answer["queued"] is True and answer["event_id"] == 0, answer
        assert max(answered) < 1.0, answered  # at once: a hook never waits on the network
        status = client.status()
        assert status["store"]["reachable"] is False
        assert status["store"]["outbox_queued"] == 3
        assert (daemon.state_dir / OUTBOX_FILE).exists()
        with pytest.raises(Unavailable) as refused:  # typed, as every call needing it
            client.doctor()
        assert (refused.value.data or {}).get("reason") == "store_unreachable"

        cluster.restart()  # type: ignore[attr-defined]
        wait_for(
            lambda: client.status()["store"]["outbox_forwarded"] == 3,
            30,
            "the queued events to be filed",
        )
        status = client.status()
        assert status["store"]["reachable"] is True and status["store"]["outbox_queued"] == 0
        events = client.event_list(agent_session_ids=["s-1"])["events"]
        filed = [e["payload"]["n"] for e in reversed(events) if e["kind"] == "PostToolUse"]
        assert filed == [0, 1, 2]  # each once, in order
        assert [e["event_id"] for e in events if e["kind"] == "UserPromptSubmit"] == [
            before["event_id"]
        ]  # acknowledged before the kill: still there
        assert client.doctor()["integrity"] == ["ok"]


def event(n: int) -> HookEventParams:
    return HookEventParams(kind="PostToolUse", agent="claude", agent_session_id="s", payload=n)


def test_the_outbox_is_bounded_drops_the_oldest_and_survives_a_restart(tmp_path: Path) -> None:
    outbox = Outbox(tmp_path, limit=3)
    for n in range(5):
        outbox.put("alice", event(n), f"k{n}")
    assert [e.params.payload for e in outbox.events] == [2, 3, 4]
    assert outbox.dropped == 2
    again = Outbox(tmp_path, limit=3)  # the daemon restarted: the file holds the queue
    assert [e.params.payload for e in again.events] == [2, 3, 4]
    assert [e.principal for e in again.events] == ["alice"] * 3
    assert [e.filing_key for e in again.events] == ["k2", "k3", "k4"]


def test_an_outbox_written_before_filing_keys_still_loads(tmp_path: Path) -> None:
    """A record of a towerd before filing keys (principal and params only) loads, keyless."""
    import struct

    import msgspec

    record = msgspec.msgpack.encode(["alice", event(7)])
    (tmp_path / OUTBOX_FILE).write_bytes(struct.pack(">I", len(record)) + record)
    [loaded] = Outbox(tmp_path).events
    assert (loaded.principal, loaded.params.payload, loaded.filing_key) == ("alice", 7, None)


def test_a_torn_last_record_is_left_out_and_the_rest_kept(tmp_path: Path) -> None:
    outbox = Outbox(tmp_path)
    for n in range(2):
        outbox.put("alice", event(n), f"k{n}")
    path = tmp_path / OUTBOX_FILE
    path.write_bytes(path.read_bytes()[:-3])  # a crash in the middle of an append
    assert [e.params.payload for e in Outbox(tmp_path).events] == [0]


@pytest.mark.anyio
async def test_forwarding_stops_at_an_unreachable_store_and_keeps_the_order(
    tmp_path: Path,
) -> None:
    from towerd.protocol.errors import BadArgs, Unavailable

    outbox = Outbox(tmp_path)
    for n in range(4):
        outbox.put("alice", event(n), f"k{n}")
    seen: list[object] = []

    async def write(principal: str, params: HookEventParams, filing_key: str | None) -> None:
        assert filing_key == f"k{params.payload}"  # each event under its own key, every time
        if params.payload == 1:
            raise BadArgs("refused for good")  # dropped, counted; the rest go on
        if params.payload == 2 and not seen.count("down"):
            seen.append("down")
            raise Unavailable("down", {"reason": "store_unreachable"})
        seen.append(params.payload)

    assert await outbox.forward(write) == 2  # 0 filed, 1 refused; 2 waits
    assert [e.params.payload for e in Outbox(tmp_path).events] == [2, 3]
    assert await outbox.forward(write) == 2
    assert seen == [0, "down", 2, 3] and outbox.dropped == 1 and not outbox.events


def test_a_busy_batchs_notes_are_split_over_notifications_and_only_a_huge_one_is_a_gap() -> None:
    """The relay of change notes between boxes (daemon/store/pg_changes.py): many small
    notes fit in several notifications, in order; only one note over the limit is a gap."""
    import base64

    import msgspec

    from towerd.daemon.store.pg_changes import GAP, MAX_PAYLOAD, _payloads

    small = [("idem", {"key": f"k{n}", "pad": "x" * 200}) for n in range(200)]
    payloads = _payloads("box-a", small)
    assert len(payloads) > 1 and all(len(p) <= MAX_PAYLOAD for p in payloads)
    relayed = [
        tuple(change) for p in payloads for change in msgspec.msgpack.decode(base64.b64decode(p))[1]
    ]
    assert relayed == [(topic, data) for topic, data in small]  # all, in order
    huge = [("idem", {"key": "a"}), ("events", {"payload": "y" * 20_000}), ("idem", {"key": "b"})]
    kinds = [p.startswith(GAP) for p in _payloads("box-a", huge)]
    assert kinds == [False, True, False]
