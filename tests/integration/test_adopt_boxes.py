"""``fleet.adopt`` across two boxes: an operator moves a dead box's sessions to a live
box, and the dead box, when it comes back, is fenced out of them.

Two real daemons on one real PostgreSQL database; box a is killed with kill -9, its
presence lapses (``--presence-ttl 5``), box b declares it dead, and the operator runs
``towerctl fleet adopt`` against box b. What is proven: b owns a's rows at b's epoch
and writes them; a restarted answers ``stale_epoch`` to every write to an adopted
session (naming b as the owner), and serves its own new sessions; nothing a
acknowledged is lost (its rows, a message left for one, its completed keys: a retry
through either box answers what was acknowledged, its key in progress at the kill is
``outcome_unknown``); b cannot write a's new sessions either.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from towerd.client import OutcomeUnknown, StaleEpoch
from towerd_testing import Daemon, towerctl, wait_for

PRESENCE = ["--presence-interval", "0.5", "--presence-ttl", "5"]


def box(make_daemon: Callable[..., Daemon], name: str, dsn: str) -> Daemon:
    daemon = make_daemon(name)
    daemon.extra_args = ["--store", dsn, *PRESENCE]
    return daemon.start()


def fleet_of(client: Any) -> dict[str, dict[str, Any]]:
    return {row["session_id"]: row for row in client.fleet_list(limit=1000)["sessions"]}


def declared_dead(client: Any, box_id: str) -> bool:
    """Whether ``client``'s box lists ``box_id`` as dead (``towerctl boxes``)."""
    return any(
        x["daemon_id"] == box_id and x["state"] == "dead" for x in client.boxes_list()["boxes"]
    )


def refused_stale(call: Callable[[], Any], owner: str) -> dict[str, Any]:
    with pytest.raises(StaleEpoch) as refused:
        call()
    data = refused.value.data or {}
    assert data.get("owner_daemon_id") == owner, data
    return data


def test_a_dead_box_s_sessions_adopted_by_another_box_fence_it_when_it_returns(
    make_daemon: Callable[..., Daemon], pg_dsn: str
) -> None:
    a, b = box(make_daemon, "a", pg_dsn), box(make_daemon, "b", pg_dsn)
    with a.client() as ca, b.client() as cb:
        dead, adopter = ca.status()["daemon_id"], cb.status()["daemon_id"]
        # What box a acknowledged before it died.
        s1 = ca.session_register(cwd="/s1", agent="claude", idempotency_key="reg-1")
        s1 = s1["session_id"]
        s2 = ca.session_register(cwd="/s2", agent="codex")["session_id"]
        ca.session_update(s2, name="two")
        s3 = ca.session_register(cwd="/s3", agent="claude", parent=s1)["session_id"]
        message = ca.session_message(s1, "look at #42", idempotency_key="msg-1")
        assert ca.idem_claim("deploy", "done")["state"] == "claimed"
        ca.idem_complete("deploy", "done", {"url": "https://x/1"})
        assert ca.idem_claim("deploy", "open")["state"] == "claimed"  # in progress at the kill
        acknowledged = fleet_of(ca)
        assert set(acknowledged) == {s1, s2, s3}
    a.kill9()

    with b.client() as cb:
        wait_for(lambda: declared_dead(cb, dead), timeout=20, what="box b to declare a dead")
        # The operator's takeover, through the real CLI.
        done = towerctl(b, "--json", "fleet", "adopt", dead)
        assert done.returncode == 0, done.stderr
        adopted = json.loads(done.stdout)
        assert adopted["adopted"] == 3 and adopted["from_daemon_id"] == dead
        assert adopted["daemon_id"] == adopter and adopted["keys_adopted"] == 4
        again = json.loads(towerctl(b, "--json", "fleet", "adopt", dead, check=True).stdout)
        assert again["adopted"] == 0
        rows = fleet_of(cb)
        assert {sid: row["daemon_id"] for sid, row in rows.items()} == dict.fromkeys(
            acknowledged, adopter
        )
        assert cb.session_update(s2, name="two, now b's")["name"] == "two, now b's"

    a.start()  # box a comes back: its next epoch, a's rows now b's
    with a.client() as ca, b.client() as cb:
        assert ca.status()["owner_epoch"] == 2
        # Every write to an adopted session is fenced, whichever method.
        refused_stale(lambda: ca.session_update(s1, name="late"), adopter)
        refused_stale(lambda: ca.session_remove(s3), adopter)
        entry = {"session_id": s2, "cwd": "/s2", "agent": "codex", "name": "a's again"}
        refused_stale(lambda: ca.fleet_write([entry]), adopter)
        # Box a serves its own new sessions; box b cannot write them.
        s4 = ca.session_register(cwd="/s4", agent="claude")["session_id"]
        refused_stale(lambda: cb.session_update(s4, name="b's?"), dead)

        # Nothing acknowledged is lost, and no retry makes a second copy.
        for client in (ca, cb):
            rows = fleet_of(client)
            assert set(rows) == {s1, s2, s3, s4}
            assert {sid: rows[sid]["daemon_id"] for sid in acknowledged} == dict.fromkeys(
                acknowledged, adopter
            )
            assert rows[s1]["cwd"] == "/s1" and rows[s1]["name"] is None
            assert rows[s2]["name"] == "two, now b's"
            assert rows[s3]["parent"] == s1
            again = client.session_register(cwd="/s1", agent="claude", idempotency_key="reg-1")
            assert again["session_id"] == s1
            resent = client.session_message(s1, "look at #42", idempotency_key="msg-1")
            assert resent["message_id"] == message["message_id"]
            assert client.idem_claim("deploy", "done")["result"] == {"url": "https://x/1"}
            with pytest.raises(OutcomeUnknown):
                client.idem_claim("deploy", "open")
        assert len(fleet_of(cb)) == 4
        listed = cb.message_list(s1)["messages"]
        assert [m["message_id"] for m in listed] == [message["message_id"]]
        assert cb.message_ack(message["message_id"])["status"] == "read"


def test_a_box_cut_off_while_its_sessions_were_adopted_is_fenced_when_the_path_heals(
    make_daemon: Callable[..., Daemon], pg_databases: Any
) -> None:
    """The same without a restart: box a is cut off (a TCP proxy the test pauses) past
    its TTL, declared dead and adopted from; healed, the same process serves again under
    a new epoch and a write to an adopted session, sent during the cut or after, answers
    ``stale_epoch``."""
    import threading

    from pg_cluster import ROLE
    from tcp_proxy import TcpProxy
    from towerd.client import Unavailable

    dsn = pg_databases()
    name = pg_databases.names[dsn]
    with TcpProxy("127.0.0.1", pg_databases.cluster.port) as proxy:
        a = box(make_daemon, "a", proxy.dsn(name, ROLE))
        b = box(make_daemon, "b", dsn)
        with a.client() as ca, b.client() as cb:
            cut_off, adopter = ca.status()["daemon_id"], cb.status()["daemon_id"]
            epoch = ca.status()["owner_epoch"]
            s1 = ca.session_register(cwd="/s1", agent="claude", idempotency_key="k1")
            s1 = s1["session_id"]
            proxy.pause()
            during: list[Any] = []

            def update_during_the_cut() -> None:  # answered unavailable at its deadline
                with a.client() as own:
                    try:
                        during.append(own.session_update(s1, name="during"))
                    except Exception as exc:  # noqa: BLE001 - checked below
                        during.append(exc)

            writer = threading.Thread(target=update_during_the_cut)
            writer.start()
            wait_for(lambda: declared_dead(cb, cut_off), timeout=20, what="b to declare a dead")
            assert cb.fleet_adopt(cut_off)["adopted"] == 1
            assert cb.session_update(s1, name="b's")["name"] == "b's"
            writer.join(15)
            assert len(during) == 1 and isinstance(during[0], Unavailable), during
            proxy.resume()

            def late_update() -> Any:
                try:
                    ca.session_update(s1, name="late")
                except Unavailable:
                    return None  # not reconnected yet
                except StaleEpoch as exc:
                    return exc
                raise AssertionError("box a wrote a session box b adopted")

            refused = wait_for(late_update, timeout=15, what="box a to reach the store again")
            assert (refused.data or {}).get("owner_daemon_id") == adopter
            assert ca.status()["owner_epoch"] > epoch  # revived, the same process
            assert a.proc is not None and a.proc.poll() is None
            row = cb.fleet_get(s1)
            assert row["daemon_id"] == adopter and row["name"] == "b's"
            again = ca.session_register(cwd="/s1", agent="claude", idempotency_key="k1")
            assert again["session_id"] == s1
            assert len(fleet_of(cb)) == 1
