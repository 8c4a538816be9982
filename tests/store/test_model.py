"""A stateful model test of the store: hypothesis drives the real Store (a real SQLite
file in a temp dir) and a plain in-memory model of docs/protocol.md sections 7 and 8
with the same random sequence of requests, and compares every answer (the exact error
class included) and, after every step, everything read back from the store.

What is modelled:

- Idempotency keys (global per (principal, operation, key), each remembering the daemon
  that created it): ``idem.claim`` in the documented check order (payload hash with
  reordered maps, replay, ``held_by_caller`` by pid *and* start time, ``outcome_unknown``,
  ``replay_only``), ``complete`` (repeat with a canonically equal result is a no-op),
  ``release``, ``mark_unknown``, ``resolve``, expiry, the holder liveness sweep.
- Fleet rows of two daemons sharing the file: ``session.register`` (with and without an
  idempotency key, minted ids included), ``session.update`` (name, pinned, parent,
  agent_session_id), ``session.remove``, ``fleet.write`` (dedup by session id and agent
  session id, the unmentioned-holder conflict, relinking into one level, the result
  counters) and writes across daemons (``stale_epoch``).
- Restarts of either daemon: epoch + 1, rows re-stamped, own ``in_progress`` keys become
  ``outcome_unknown``, then keys with fleet-row evidence complete, then (optionally, with
  a negative TTL) every completed key expires; the reconciliation report is checked.

Invariants after every step: all keys and all fleet rows (order, fields, owner, epoch)
equal the model; ``fleet.list`` of each daemon shows exactly its own rows; the hierarchy
is one level within one daemon; agent session ids are unique per daemon; the daemons
table holds the model's epochs; ``PRAGMA integrity_check`` is ok.

Default settings keep it CI-sized (50 runs of at most 30 steps, about 5 s on 2 cores).
For a longer run (500 runs: about 40 s; with 50 steps about 55 s):

    TOWERD_MODEL_EXAMPLES=500 TOWERD_MODEL_STEPS=50 \\
        .venv/bin/python -m pytest tests/store/test_model.py -q

Add ``--hypothesis-show-statistics`` to see which answers the runs reached (each store
call records an event such as ``claim -> IdempotencyInProgress``).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import anyio.from_thread
from hypothesis import HealthCheck, settings
from hypothesis import event as hypothesis_event
from hypothesis import strategies as st
from hypothesis.errors import InvalidArgument
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
    run_state_machine_as_test,
)
from msgspec import UNSET

from store_helpers import backend, caller, entry, forget_store, register_params, store_config
from towerd.daemon.store import Store, fleet, open_store
from towerd.daemon.store import idempotency as idem
from towerd.daemon.store.idempotency import Holder
from towerd.daemon.store.reconcile import settle_dead_holders
from towerd.daemon.store.tx import Caller, Tx
from towerd.protocol.errors import (
    BadArgs,
    Conflict,
    IdempotencyConflict,
    IdempotencyInProgress,
    IdempotencyKeyUnknown,
    NotFound,
    OutcomeUnknown,
    StaleEpoch,
    TowerdError,
)
from towerd.protocol.methods import (
    UUID_PATTERN,
    FleetListParams,
    FleetWriteParams,
    IdemClaimParams,
    IdemCompleteParams,
    IdemKeyParams,
    IdemListParams,
    IdemReleaseParams,
    IdemResolveParams,
    SessionIdParams,
    SessionUpdateParams,
)

EXAMPLES = int(os.environ.get("TOWERD_MODEL_EXAMPLES", "50"))
STEPS = int(os.environ.get("TOWERD_MODEL_STEPS", "30"))

DAY_MS = 24 * 60 * 60 * 1000
EXPIRE_ALL_MS = -60_000  # a TTL that expires every completed key (updated_at < now + 60 s)

A, B = "A", "B"  # A: the state dir's own daemon id; B: a second daemon on the same file
B_ID = "bbbbbbbb-0000-4000-8000-00000000000b"

PRINCIPALS = ["alice", "bob"]
OPERATIONS = ["session.spawn", "session.register", "tool.run"]  # two have evidence probes
KEYS = ["k1", "r1"]  # "r1" is also a session.register key (see register)
POOL = [f"00000000-0000-4000-8000-{i:012d}" for i in range(1, 6)]
AGENTS = [None, "as-1", "as-2", "as-3"]
NAMES = [None, "main", "helper"]
HOLDERS = [None, Holder(4242, 1000), Holder(4343, 1000), Holder(4242, 2000)]  # last: reused pid
# (label, value): equal labels are canonically equal payloads (map key order is ignored;
# 1 and 1.0 differ).
PAYLOADS = [
    ("none", None),
    ("ab", {"a": 1, "b": [1, 2]}),
    ("ab", {"b": [1, 2], "a": 1}),
    ("one", 1),
    ("one.0", 1.0),
]
RESULTS = [None, {"ok": True, "n": 1}, {"n": 1, "ok": True}, {"ok": False}, 1, 1.0]
EVIDENCE = {"session.spawn", "session.register"}
EFFECT_REFS = [None, None, "job-1", POOL[0], POOL[1]]  # pool ids: evidence once registered


# --- the model ---------------------------------------------------------------------


@dataclass
class KeyRec:
    payload: Any  # a payload label; equal labels hash equal
    state: str
    effect_ref: str
    result: Any
    holder: Holder | None
    daemon: str


@dataclass
class RowRec:
    agent: str | None
    parent: str | None
    name: str | None
    pinned: bool


class Refused(Exception):
    """The model's prediction that the store refuses with ``cls`` (and ``data`` items)."""

    def __init__(self, cls: type[TowerdError], **data: Any) -> None:
        super().__init__(cls.__name__)
        self.cls = cls
        self.data = data


def strict_equal(a: Any, b: Any) -> bool:
    """Equality that tells 1 from 1.0 and True from 1 (as canonical msgpack does)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(strict_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(strict_equal(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def model_relink(
    order: list[str], links: dict[str, str | None], replaced: dict[str, str]
) -> dict[str, str | None]:
    """docs/protocol.md section 8 rule 5, written naively (the fleets here are tiny)."""
    position = {sid: i for i, sid in enumerate(order)}

    def surviving(sid: str) -> str | None:  # 5.1
        link, seen = links.get(sid), set()
        while link is not None and link not in seen:
            seen.add(link)
            target = replaced.get(link, link)
            if target != sid:
                return target if target in position else None
            link = links.get(link)  # this row replaced its own parent: take that link
        return None

    linked = {sid: surviving(sid) for sid in order}
    while True:  # 5.2: break one cycle at a time at its first-written row
        for start in order:
            path, current = [start], linked[start]
            while current is not None and current not in path:
                path.append(current)
                current = linked[current]
            if current is not None:
                cycle = path[path.index(current) :]
                linked[min(cycle, key=position.__getitem__)] = None
                break
        else:
            break

    def top(sid: str) -> str:  # 5.3
        while linked[sid] is not None:
            sid = linked[sid]
        return sid

    return {sid: None if top(sid) == sid else top(sid) for sid in order}


def keyed(key_id: tuple[str, str, str]) -> tuple[Caller, IdemKeyParams]:
    """The (caller, params) of an idem call on ``key_id``: (principal, operation, key)."""
    principal, operation, key = key_id
    return caller(principal), IdemKeyParams(operation=operation, key=key)


def released(key_id: tuple[str, str, str]) -> tuple[Caller, IdemReleaseParams]:
    """The (caller, params) of an idem.release of ``key_id``."""
    principal, operation, key = key_id
    return caller(principal), IdemReleaseParams(operation=operation, key=key)


def event(label: str) -> None:
    """hypothesis.event (shown by --hypothesis-show-statistics), a no-op outside a test."""
    try:
        hypothesis_event(label)
    except InvalidArgument:
        pass


# --- strategies --------------------------------------------------------------------

daemons = st.sampled_from([A, A, B])
ENTRY_FIELDS = (  # session_id, agent_session_id, parent, name of a fleet.write entry
    st.sampled_from(POOL),
    st.sampled_from(AGENTS),
    st.one_of(st.none(), st.sampled_from(POOL)),
    st.sampled_from(NAMES),
)
key_ids = st.tuples(st.sampled_from(PRINCIPALS), st.sampled_from(OPERATIONS), st.sampled_from(KEYS))


# --- the machine -------------------------------------------------------------------


class StoreModel(RuleBasedStateMachine):
    sessions = Bundle("sessions")  # session ids that were registered or written

    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="td-model-", dir=_scratch_dir()))
        self.stack = ExitStack()
        self.portal = self.stack.enter_context(
            anyio.from_thread.start_blocking_portal(backend="asyncio")
        )
        self.stores: dict[str, tuple[AbstractContextManager[Store], Store]] = {}
        self.ids: dict[str, str] = {B: B_ID}
        # the model
        self.epoch = {A: 0, B: 0}
        self.keys: dict[tuple[str, str, str], KeyRec] = {}  # in claim (rowid) order
        self.fleet: dict[str, dict[str, RowRec]] = {A: {}, B: {}}  # in stored order
        try:
            self._start(A, DAY_MS)
        except BaseException:
            self.teardown()  # hypothesis only tears down a machine it could build
            raise
        self.ids[A] = self.stores[A][1].daemon_id

    def teardown(self) -> None:
        """Close every store, then the portal (an open store would keep it running)."""
        error: BaseException | None = None
        for daemon in list(self.stores):
            try:
                self._close(daemon)
            except BaseException as exc:  # noqa: BLE001 - close the others, then raise it
                error = error or exc
        try:
            if error is None:
                self.stack.close()
            else:  # the portal then cancels whatever is left instead of waiting for it
                self.stack.__exit__(type(error), error, error.__traceback__)
        finally:
            try:
                forget_store(self.root)  # PostgreSQL: this run's database
            finally:
                shutil.rmtree(self.root, ignore_errors=True)
        if error is not None:
            raise error

    # --- driving the store ----------------------------------------------------------

    def _close(self, daemon: str) -> None:
        manager, _ = self.stores.pop(daemon)
        manager.__exit__(None, None, None)

    def _open(self, daemon: str, ttl_ms: int) -> Store:
        config = store_config(
            self.root, completed_ttl_ms=ttl_ms, daemon_id=B_ID if daemon == B else None
        )
        manager = self.portal.wrap_async_context_manager(open_store(config))
        store = manager.__enter__()
        self.stores[daemon] = (manager, store)
        return store

    def store(self, daemon: str) -> Store:
        """The daemon's store, started (and reconciled) on first use."""
        if daemon not in self.stores:
            self._start(daemon, DAY_MS)
        return self.stores[daemon][1]

    def write(self, daemon: str, fn: Callable[..., Any], *args: Any) -> Any:
        answer = self.portal.call(self.store(daemon).write, fn, *args)
        event(f"{fn.__name__} -> ok")
        return answer

    def read(self, daemon: str, fn: Callable[..., Any], *args: Any) -> Any:
        return self.portal.call(self.store(daemon).read, fn, *args)

    def expect_refusal(
        self, refusal: Refused, daemon: str, fn: Callable[..., Any], *args: Any
    ) -> None:
        try:
            answer = self.write(daemon, fn, *args)
        except TowerdError as exc:
            assert type(exc) is refusal.cls, f"expected {refusal.cls.__name__}, got {exc!r}"
            event(f"{fn.__name__} -> {refusal.cls.__name__}")
            for name, value in refusal.data.items():
                assert exc.data is not None and exc.data.get(name) == value, (name, exc.data)
            return
        raise AssertionError(f"expected {refusal.cls.__name__}, the store answered {answer!r}")

    def owner(self, session_id: str) -> str | None:
        return next((d for d, rows in self.fleet.items() if session_id in rows), None)

    @initialize(
        fleet_a=st.lists(st.tuples(*ENTRY_FIELDS), min_size=1, max_size=4),
        fleet_b=st.lists(st.tuples(*ENTRY_FIELDS), max_size=2),
    )
    def seed(self, fleet_a: list[Any], fleet_b: list[Any]) -> None:
        """Start most runs with a few rows of each daemon (feature flags often switch the
        row-making rules off for a whole run)."""
        self.write_fleet(A, fleet_a, [])
        if fleet_b:
            self.write_fleet(B, fleet_b, [])

    # --- start-up ----------------------------------------------------------------------

    def _start(self, daemon: str, ttl_ms: int) -> None:
        """Open the daemon's store and check the start-up transaction against the model."""
        store = self._open(daemon, ttl_ms)
        self.epoch[daemon] += 1
        mine = [(key_id, rec) for key_id, rec in self.keys.items() if rec.daemon == daemon]
        marked = 0
        for _, rec in mine:
            if rec.state == "in_progress":
                rec.state = "outcome_unknown"
                marked += 1
        unknown = [(key_id, rec) for key_id, rec in mine if rec.state == "outcome_unknown"]
        settled = self._settle(unknown)
        expired = self._expire(ttl_ms) if ttl_ms < 0 else 0

        report = store.reconciliation
        assert store.owner_epoch == report.owner_epoch == self.epoch[daemon]
        assert (
            report.rows_taken,
            report.marked_unknown,
            report.completed_from_evidence,
            report.still_unknown,
            report.expired,
        ) == (len(self.fleet[daemon]), marked, settled, len(unknown) - settled, expired)
        event(f"start: marked {bool(marked)}, settled {bool(settled)}, expired {bool(expired)}")
        states = self.read(daemon, _key_states_of, store.daemon_id)
        assert "in_progress" not in states, states

    def _settle(self, unknown: list[tuple[tuple[str, str, str], KeyRec]]) -> int:
        """Evidence probes: a fleet row (of any daemon) whose session id is the effect_ref."""
        settled = 0
        for (_, operation, _), rec in unknown:
            owner = self.owner(rec.effect_ref)
            if operation not in EVIDENCE or owner is None:
                continue
            result: dict[str, Any] = {"session_id": rec.effect_ref}
            if operation == "session.spawn":
                agent = self.fleet[owner][rec.effect_ref].agent
                result |= {"agent_session_id": agent, "target": None, "target_identity": None}
            rec.state, rec.result = "completed", result
            settled += 1
        return settled

    def _expire(self, ttl_ms: int) -> int:
        if ttl_ms >= 0:
            return 0  # every key here is younger than any non-negative TTL used
        gone = [k for k, rec in self.keys.items() if rec.state == "completed"]
        for k in gone:
            del self.keys[k]
        return len(gone)

    # --- idempotency rules ---------------------------------------------------------------

    def draw_key(self, data: st.DataObject) -> tuple[str, str, str]:
        """Mostly a key the model holds, else any key id."""
        held = st.sampled_from(list(self.keys)) if self.keys else st.nothing()
        return data.draw(st.one_of(held, held, key_ids), label="key")

    @initialize(
        keys=st.lists(
            st.tuples(
                key_ids,
                st.sampled_from(PAYLOADS),
                st.sampled_from(HOLDERS),
                st.sampled_from(EFFECT_REFS),
                st.sampled_from(["in_progress", "outcome_unknown", *RESULTS]),
            ),
            min_size=1,
            max_size=4,
        )
    )
    def seed_keys(self, keys: list[Any]) -> None:
        """Start most runs with a few keys of daemon A in every state (a fate that is not
        a state is the result the key is completed with)."""
        for key_id, payload, holder, effect_ref, fate in keys:
            if key_id in self.keys:
                continue
            self._claim(A, key_id, payload, holder, effect_ref, False)
            if fate == "outcome_unknown":
                self._mark_unknown(A, key_id)
            elif fate != "in_progress":
                self._complete(A, key_id, fate)

    @rule(
        daemon=daemons,
        data=st.data(),
        payload=st.sampled_from(PAYLOADS),
        holder=st.sampled_from(HOLDERS),
        effect_ref=st.sampled_from(EFFECT_REFS),
        replay_only=st.booleans(),
    )
    def claim(
        self,
        daemon: str,
        data: st.DataObject,
        payload: tuple[str, Any],
        holder: Holder | None,
        effect_ref: str | None,
        replay_only: bool,
    ) -> None:
        key_id = self.draw_key(data)
        self._claim(daemon, key_id, payload, holder, effect_ref, replay_only)

    def _claim(
        self,
        daemon: str,
        key_id: tuple[str, str, str],
        payload: tuple[str, Any],
        holder: Holder | None,
        effect_ref: str | None,
        replay_only: bool,
    ) -> None:
        principal, operation, key = key_id
        label, value = payload
        params = IdemClaimParams(
            operation=operation,
            key=key,
            payload=value,
            effect_ref=effect_ref,
            replay_only=replay_only,
        )
        claimant = caller(principal, holder)
        rec = self.keys.get(key_id)
        refusal: Refused | None = None
        if rec is not None:
            if rec.payload != label:
                refusal = Refused(IdempotencyConflict, state=rec.state)
            elif rec.state == "completed":
                answer = self.write(daemon, idem.claim, claimant, params)
                assert (answer.state, answer.effect_ref) == ("completed", rec.effect_ref)
                assert strict_equal(answer.result, rec.result), (answer.result, rec.result)
                return
            else:
                refusal = self._unsettled(rec, holder)
        elif replay_only:
            refusal = Refused(IdempotencyKeyUnknown, operation=operation, key=key)
        if refusal is not None:
            return self.expect_refusal(refusal, daemon, idem.claim, claimant, params)
        answer = self.write(daemon, idem.claim, claimant, params)
        assert answer.state == "claimed" and answer.result is None
        if effect_ref is not None:
            assert answer.effect_ref == effect_ref
        else:
            assert re.fullmatch(UUID_PATTERN, answer.effect_ref), answer.effect_ref
        self.keys[key_id] = KeyRec(label, "in_progress", answer.effect_ref, None, holder, daemon)
        return None

    @staticmethod
    def _unsettled(rec: KeyRec, caller: Holder | None) -> Refused:
        if rec.state == "in_progress":
            event(f"in progress, held_by_caller {caller is not None and caller == rec.holder}")
            return Refused(
                IdempotencyInProgress,
                effect_ref=rec.effect_ref,
                holder_pid=None if rec.holder is None else rec.holder.pid,
                held_by_caller=caller is not None and caller == rec.holder,
            )
        return Refused(OutcomeUnknown, effect_ref=rec.effect_ref)

    @staticmethod
    def _missing(key_id: tuple[str, str, str]) -> Refused:
        return Refused(IdempotencyKeyUnknown, operation=key_id[1], key=key_id[2])

    @rule(daemon=daemons, data=st.data(), result=st.sampled_from(RESULTS))
    def complete(self, daemon: str, data: st.DataObject, result: Any) -> None:
        self._complete(daemon, self.draw_key(data), result)

    def _complete(self, daemon: str, key_id: tuple[str, str, str], result: Any) -> None:
        rec = self.keys.get(key_id)
        principal, operation, key = key_id
        args = (caller(principal), IdemCompleteParams(operation=operation, key=key, result=result))
        if rec is None:
            return self.expect_refusal(self._missing(key_id), daemon, idem.complete, *args)
        if rec.state == "completed":
            if not strict_equal(rec.result, result):
                refusal = Refused(Conflict, operation=key_id[1], key=key_id[2])
                return self.expect_refusal(refusal, daemon, idem.complete, *args)
            before = self.read(daemon, idem.get, *keyed(key_id))
            assert self.write(daemon, idem.complete, *args) == before  # unchanged, updated_at too
            return None
        record = self.write(daemon, idem.complete, *args)
        rec.state, rec.result = "completed", result
        assert (record.state, record.effect_ref) == ("completed", rec.effect_ref)
        assert strict_equal(record.result, result)
        return None

    @rule(daemon=daemons, data=st.data())
    def release(self, daemon: str, data: st.DataObject) -> None:
        key_id = self.draw_key(data)
        rec = self.keys.get(key_id)
        if rec is None:
            missing = self._missing(key_id)
            return self.expect_refusal(missing, daemon, idem.release, *released(key_id))
        if rec.state == "completed":
            refusal = Refused(Conflict, operation=key_id[1], key=key_id[2])
            return self.expect_refusal(refusal, daemon, idem.release, *released(key_id))
        if rec.state == "outcome_unknown":
            refusal = Refused(OutcomeUnknown, effect_ref=rec.effect_ref)
            return self.expect_refusal(refusal, daemon, idem.release, *released(key_id))
        answer = self.write(daemon, idem.release, *released(key_id))
        assert (answer.operation, answer.key, answer.released) == (*key_id[1:], True)
        del self.keys[key_id]
        return None

    @rule(daemon=daemons, data=st.data())
    def mark_unknown(self, daemon: str, data: st.DataObject) -> None:
        self._mark_unknown(daemon, self.draw_key(data))

    def _mark_unknown(self, daemon: str, key_id: tuple[str, str, str]) -> None:
        rec = self.keys.get(key_id)
        if rec is None:
            missing = self._missing(key_id)
            return self.expect_refusal(missing, daemon, idem.mark_unknown, *keyed(key_id))
        if rec.state == "completed":
            refusal = Refused(Conflict, operation=key_id[1], key=key_id[2])
            return self.expect_refusal(refusal, daemon, idem.mark_unknown, *keyed(key_id))
        record = self.write(daemon, idem.mark_unknown, *keyed(key_id))
        rec.state = "outcome_unknown"
        assert (record.state, record.effect_ref) == ("outcome_unknown", rec.effect_ref)
        return None

    @rule(
        daemon=daemons,
        data=st.data(),
        outcome=st.sampled_from(["completed", "abandoned"]),
        result=st.sampled_from(RESULTS),
    )
    def resolve(self, daemon: str, data: st.DataObject, outcome: str, result: Any) -> None:
        key_id = self.draw_key(data)
        rec = self.keys.get(key_id)
        principal, operation, key = key_id
        params = IdemResolveParams(operation=operation, key=key, outcome=outcome, result=result)
        args = (caller(principal), params)
        if rec is None:
            return self.expect_refusal(self._missing(key_id), daemon, idem.resolve, *args)
        if rec.state != "outcome_unknown":
            refusal = Refused(Conflict, operation=key_id[1], key=key_id[2], state=rec.state)
            return self.expect_refusal(refusal, daemon, idem.resolve, *args)
        answer = self.write(daemon, idem.resolve, *args)
        assert (answer.operation, answer.key, answer.outcome) == (*key_id[1:], outcome)
        if outcome == "abandoned":
            assert answer.record is None
            del self.keys[key_id]
        else:
            rec.state, rec.result = "completed", result
            assert answer.record is not None and answer.record.state == "completed"
            assert strict_equal(answer.record.result, result)
        return None

    @rule(daemon=daemons, ttl_ms=st.sampled_from([DAY_MS, EXPIRE_ALL_MS]))
    def expire(self, daemon: str, ttl_ms: int) -> None:
        """Only completed keys expire (of every daemon and principal), never unsettled ones."""
        assert self.write(daemon, idem.expire_completed, ttl_ms) == self._expire(ttl_ms)

    @rule(daemon=daemons, holder=st.sampled_from(HOLDERS[1:]))
    def holder_dies(self, daemon: str, holder: Holder) -> None:
        """The liveness sweep: this daemon's in-progress keys of the dead holder become
        outcome_unknown, then complete where evidence exists."""
        moved = [
            (key_id, rec)
            for key_id, rec in self.keys.items()
            if rec.daemon == daemon and rec.state == "in_progress" and rec.holder == holder
        ]
        for _, rec in moved:
            rec.state = "outcome_unknown"
        self._settle(moved)
        report = self.write(daemon, settle_dead_holders, [holder])
        done = [key_id for key_id, rec in moved if rec.state == "completed"]
        unknown = [key_id for key_id, rec in moved if rec.state == "outcome_unknown"]
        assert (sorted(report.completed), sorted(report.unknown)) == (sorted(done), sorted(unknown))

    # --- fleet rules ---------------------------------------------------------------------

    @rule(
        target=sessions,
        daemon=daemons,
        principal=st.sampled_from(PRINCIPALS),
        session_id=st.one_of(st.none(), st.sampled_from(POOL)),
        agent=st.sampled_from(AGENTS),
        data=st.data(),
        name=st.sampled_from(NAMES),
        key=st.sampled_from([None, None, "r1", "r2"]),
        holder=st.sampled_from(HOLDERS),
    )
    def register(
        self,
        daemon: str,
        principal: str,
        session_id: str | None,
        agent: str | None,
        data: st.DataObject,
        name: str | None,
        key: str | None,
        holder: Holder | None,
    ) -> Any:
        parent = self.draw_session(data, daemon, "parent", None)
        return self._register(daemon, principal, session_id, agent, parent, name, key, holder)

    def _register(
        self,
        daemon: str,
        principal: str,
        session_id: str | None,
        agent: str | None,
        parent: str | None,
        name: str | None,
        key: str | None,
        holder: Holder | None,
    ) -> Any:
        params = register_params(
            session_id=session_id,
            agent_session_id=agent,
            parent=parent,
            name=name,
            idempotency_key=key,
        )
        call = (fleet.register_session, caller(principal, holder), params)
        key_id = (principal, "session.register", key or "")
        label = ("register", session_id, agent, parent, name)  # every other field is default
        try:
            if key is not None and (rec := self.keys.get(key_id)) is not None:
                if rec.payload != label:
                    raise Refused(IdempotencyConflict, state=rec.state)
                if rec.state != "completed":
                    raise self._unsettled(rec, holder)
                answer = self.write(daemon, *call)
                assert answer.session_id == rec.result["session_id"]  # the replay
                return multiple()
            rows = self.fleet[daemon]
            if session_id is not None:
                if self.owner(session_id) not in (None, daemon):
                    raise Refused(StaleEpoch, session_id=session_id)
                if session_id in rows:
                    raise Refused(Conflict, session_id=session_id)
            if parent is not None:
                if parent == session_id:
                    raise Refused(BadArgs)
                if parent not in rows:
                    raise Refused(NotFound, session_id=parent)
                parent = rows[parent].parent or parent
            if agent is not None:
                holder_row = next((s for s, r in rows.items() if r.agent == agent), None)
                if holder_row is not None and holder_row != session_id:
                    raise Refused(Conflict, agent_session_id=agent, session_id=holder_row)
        except Refused as refusal:
            self.expect_refusal(refusal, daemon, *call)
            return multiple()
        answer = self.write(daemon, *call)
        if session_id is not None:
            assert answer.session_id == session_id
        else:
            assert re.fullmatch(UUID_PATTERN, answer.session_id), answer.session_id
            assert self.owner(answer.session_id) is None
        rows[answer.session_id] = RowRec(agent, parent, name, False)
        if key is not None:
            result = {"session_id": answer.session_id}
            self.keys[key_id] = KeyRec(
                label, "completed", answer.session_id, result, holder, daemon
            )
        return answer.session_id

    def draw_session(
        self, data: st.DataObject, daemon: str, label: str, *extra: Any, besides: Any = None
    ) -> Any:
        """One of the daemon's own rows other than ``besides``, one of ``extra`` (None), or
        any id (``besides`` included)."""
        mine = [sid for sid in self.fleet[daemon] if sid != besides]
        own = st.sampled_from(mine) if mine else st.nothing()
        others = st.one_of(st.sampled_from(POOL), self.sessions)
        extras = st.sampled_from(extra) if extra else st.nothing()
        return data.draw(st.one_of(own, extras, others), label=label)

    @rule(
        daemon=daemons,
        data=st.data(),
        name=st.one_of(st.just(UNSET), st.sampled_from(NAMES)),
        pinned=st.one_of(st.just(UNSET), st.booleans()),
        agent=st.one_of(st.just(UNSET), st.sampled_from(AGENTS)),
        give_parent=st.booleans(),
    )
    def update(
        self,
        daemon: str,
        data: st.DataObject,
        name: Any,
        pinned: Any,
        agent: Any,
        give_parent: bool,
    ) -> None:
        session_id = self.draw_session(data, daemon, "session_id")
        parent = UNSET
        if give_parent:
            parent = self.draw_session(data, daemon, "parent", None, besides=session_id)
        params = SessionUpdateParams(
            session_id=session_id, name=name, pinned=pinned, parent=parent, agent_session_id=agent
        )
        rows = self.fleet[daemon]
        try:
            if self.owner(session_id) not in (None, daemon):
                raise Refused(StaleEpoch, session_id=session_id)
            if session_id not in rows:
                raise Refused(NotFound, session_id=session_id)
            top = parent
            if parent is not UNSET and parent is not None:
                if parent == session_id:
                    raise Refused(BadArgs)
                if parent not in rows:
                    raise Refused(NotFound, session_id=parent)
                top = rows[parent].parent or parent
                if top == session_id:
                    raise Refused(Conflict, session_id=session_id, parent=parent)
            if agent is not UNSET and agent is not None:
                holder_row = next(
                    (s for s, r in rows.items() if r.agent == agent and s != session_id), None
                )
                if holder_row is not None:
                    raise Refused(Conflict, agent_session_id=agent, session_id=holder_row)
        except Refused as refusal:
            return self.expect_refusal(refusal, daemon, fleet.update_session, caller(), params)
        answer = self.write(daemon, fleet.update_session, caller(), params)
        row = rows[session_id]
        if top is not UNSET:
            if top is not None:
                for child in rows.values():
                    if child.parent == session_id:
                        child.parent = top
            row.parent = top
        row.name = row.name if name is UNSET else name
        row.pinned = row.pinned if pinned is UNSET else pinned
        row.agent = row.agent if agent is UNSET else agent
        got = (answer.agent_session_id, answer.parent, answer.name, answer.pinned)
        assert got == (row.agent, row.parent, row.name, row.pinned)
        assert (answer.daemon_id, answer.owner_epoch) == (self.ids[daemon], self.epoch[daemon])
        return None

    @rule(daemon=daemons, data=st.data())
    def remove(self, daemon: str, data: st.DataObject) -> None:
        session_id = self.draw_session(data, daemon, "session_id")
        rows = self.fleet[daemon]
        args = (caller(), SessionIdParams(session_id))
        if self.owner(session_id) not in (None, daemon):
            refusal = Refused(StaleEpoch, session_id=session_id)
            return self.expect_refusal(refusal, daemon, fleet.remove_session, *args)
        if session_id not in rows:
            refusal = Refused(NotFound, session_id=session_id)
            return self.expect_refusal(refusal, daemon, fleet.remove_session, *args)
        answer = self.write(daemon, fleet.remove_session, *args)
        assert (answer.session_id, answer.removed) == (session_id, True)
        del rows[session_id]
        for row in rows.values():
            if row.parent == session_id:
                row.parent = None
        return None

    @rule(
        target=sessions,
        daemon=daemons,
        given=st.lists(
            st.tuples(
                st.one_of(st.sampled_from(POOL), sessions),
                st.sampled_from(AGENTS),
                st.one_of(st.none(), st.sampled_from(POOL), sessions),
                st.sampled_from(NAMES),
            ),
            max_size=4,
        ),
        removed=st.lists(st.one_of(st.sampled_from(POOL), sessions), max_size=2),
    )
    def write_fleet(
        self,
        daemon: str,
        given: list[tuple[str, str | None, str | None, str | None]],
        removed: list[str],
    ) -> Any:
        entries = [
            entry(sid, agent_session_id=agent, parent=parent, name=name)
            for sid, agent, parent, name in given
        ]
        args = (caller(), FleetWriteParams(sessions=entries, removed=removed))
        rows = self.fleet[daemon]
        removed_set = set(removed)
        # Rule 1: the last entry per session id, at the position of that last occurrence.
        latest: dict[str, RowRec] = {}
        for sid, agent, parent, name in given:
            latest.pop(sid, None)
            latest[sid] = RowRec(agent, parent, name, False)
        # Rule 2: the last entry per agent session id.
        survivor = {e.agent: sid for sid, e in latest.items() if e.agent is not None}
        replaced = {
            sid: survivor[e.agent]
            for sid, e in latest.items()
            if e.agent is not None and survivor[e.agent] != sid
        }
        kept = {sid: e for sid, e in latest.items() if sid not in replaced}
        try:
            if removed_set & latest.keys():
                raise Refused(BadArgs)
            for sid in [*latest, *removed_set]:
                if self.owner(sid) not in (None, daemon):
                    raise Refused(StaleEpoch)
            for sid, row in rows.items():  # rule 3
                if sid not in latest and sid not in removed_set and row.agent in survivor:
                    raise Refused(Conflict, agent_session_id=row.agent, session_id=sid)
        except Refused as refusal:
            self.expect_refusal(refusal, daemon, fleet.write_fleet, *args)
            return multiple()
        answer = self.write(daemon, fleet.write_fleet, *args)
        # Rule 4: stored order minus removed and dropped, then new rows in given order.
        order = [sid for sid in rows if sid not in removed_set and sid not in replaced]
        order += [sid for sid in kept if sid not in rows]
        links = {sid: row.parent for sid, row in rows.items()}
        links |= {sid: e.parent for sid, e in latest.items()}
        parents = model_relink(order, links, replaced)  # rule 5
        relinked = sum(
            parents[sid] != (kept[sid].parent if sid in kept else rows[sid].parent) for sid in order
        )
        expected = (len(kept), len(removed_set & rows.keys()), sorted(replaced), relinked)
        got = (answer.written, answer.removed, answer.dropped, answer.relinked)
        assert got == expected, (got, expected)
        event(f"write_fleet: dropped {bool(replaced)}, relinked {bool(relinked)}")
        after = {sid: replace(kept.get(sid) or rows[sid], parent=parents[sid]) for sid in order}
        self.fleet[daemon] = after
        return multiple(*(sid for sid in after if sid not in rows))

    @precondition(lambda self: bool(self.fleet[A] or self.fleet[B]))
    @rule(
        data=st.data(),
        how=st.sampled_from(["update", "remove", "write", "remove-via-write", "register"]),
        name=st.sampled_from(NAMES),
    )
    def cross_daemon_write(self, data: st.DataObject, how: str, name: str | None) -> None:
        """Every write of one daemon that touches a row of the other is stale_epoch and
        changes nothing (checked by the invariants)."""
        rows = [(d, sid) for d in (A, B) for sid in self.fleet[d]]
        owner, session_id = data.draw(st.sampled_from(rows), label="row")
        writer = B if owner == A else A
        self.store(writer)  # started first: the refusal names its epoch
        fn, args = {
            "update": (
                fleet.update_session,
                (caller(), SessionUpdateParams(session_id, name=name)),
            ),
            "remove": (fleet.remove_session, (caller(), SessionIdParams(session_id))),
            "write": (
                fleet.write_fleet,
                (caller(), FleetWriteParams([entry(session_id, name=name)], [])),
            ),
            "remove-via-write": (
                fleet.write_fleet,
                (caller(), FleetWriteParams([], [session_id])),
            ),
            "register": (fleet.insert_session, (register_params(session_id=session_id),)),
        }[how]
        refusal = Refused(
            StaleEpoch,
            session_id=session_id,
            owner_daemon_id=self.ids[owner],
            owner_epoch=self.epoch[owner],
            daemon_id=self.ids[writer],
            epoch=self.epoch[writer],
        )
        self.expect_refusal(refusal, writer, fn, *args)

    @rule(
        daemon=daemons,
        principal=st.sampled_from(PRINCIPALS),
        key=st.sampled_from(KEYS),
        session_id=st.sampled_from(POOL),
        operation=st.sampled_from(["session.spawn", "session.register"]),
        agent=st.sampled_from(AGENTS),
    )
    def spawn_interrupted(
        self, daemon: str, principal: str, key: str, session_id: str, operation: str, agent: Any
    ) -> None:
        """A spawner's claim, then its effect (the fleet row named by effect_ref), then no
        idem.complete: the evidence a restart or the liveness sweep settles the key from."""
        self._claim(daemon, (principal, operation, key), PAYLOADS[0], HOLDERS[1], session_id, False)
        self._register(daemon, principal, session_id, agent, None, None, None, None)

    # --- restarts ----------------------------------------------------------------------

    @rule(daemon=daemons, expire_at_start=st.booleans())
    def restart(self, daemon: str, expire_at_start: bool) -> None:
        """Close (if open) and reopen: the next epoch and start-up reconciliation."""
        if daemon in self.stores:
            self._close(daemon)
        self._start(daemon, EXPIRE_ALL_MS if expire_at_start else DAY_MS)

    # --- invariants ----------------------------------------------------------------------

    @invariant()
    def store_equals_model(self) -> None:
        snapshot = self.read(A, _snapshot, PRINCIPALS)
        assert snapshot["integrity"] == [("ok",)]

        # Every key, in claim order, with everything a client can see.
        keys = [
            (
                (principal, rec.operation, rec.key),
                (rec.state, rec.effect_ref, rec.result, rec.holder_pid),
            )
            for principal, listed in snapshot["keys"].items()
            for rec in listed
        ]
        want = [
            (key_id, (m.state, m.effect_ref, m.result, None if m.holder is None else m.holder.pid))
            for principal in PRINCIPALS
            for key_id, m in self.keys.items()
            if key_id[0] == principal
        ]
        assert [k for k, _ in keys] == [k for k, _ in want]
        for (key_id, got), (_, expected) in zip(keys, want, strict=True):
            assert got[:2] == expected[:2] and got[3] == expected[3], (key_id, got, expected)
            assert strict_equal(got[2], expected[2]), (key_id, got[2], expected[2])
        raw = {(p, o, k): (daemon_id, start) for p, o, k, daemon_id, start in snapshot["raw_keys"]}
        for key_id, m in self.keys.items():
            start = None if m.holder is None else m.holder.start
            assert raw[key_id] == (self.ids[m.daemon], start), key_id

        # Every fleet row, in stored order, under its owner at the owner's current epoch.
        daemons_table = dict(snapshot["daemons"])
        for daemon in (A, B):
            if self.epoch[daemon]:
                assert daemons_table[self.ids[daemon]] == self.epoch[daemon]
            else:
                assert B_ID not in daemons_table
            stored = [r for r in snapshot["sessions"] if r[-2] == self.ids.get(daemon)]
            expected_rows = [
                (sid, r.agent, r.parent, r.name, r.pinned, self.ids[daemon], self.epoch[daemon])
                for sid, r in self.fleet[daemon].items()
            ]
            assert stored == expected_rows, (daemon, stored, expected_rows)
            # One level within one daemon; agent session ids unique per daemon.
            own = {r[0]: r for r in stored}
            for sid, _, parent, *_ in stored:
                assert parent is None or (parent in own and own[parent][2] is None), sid
            agents = [r[1] for r in stored if r[1] is not None]
            assert len(agents) == len(set(agents)), agents
        assert len(snapshot["sessions"]) == len(self.fleet[A]) + len(self.fleet[B])

        # fleet.list shows each daemon exactly its own rows.
        for daemon in self.stores:
            listed = self.read(daemon, _listed)
            assert listed == list(self.fleet[daemon]), (daemon, listed)
        assert self.stores[A][1].owner_epoch == self.epoch[A]


def _scratch_dir() -> str | None:
    """/dev/shm when usable (fsync there is free, a third off the run time), else the default."""
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK | os.X_OK) else None


# --- read functions (run on the store's read connection) --------------------------------


def _snapshot(tx: Tx, principals: list[str]) -> dict[str, Any]:
    conn, ok = tx.conn, [("ok",)]
    return {
        # SQLite's own check of its file (PostgreSQL has no such statement).
        "integrity": (
            conn.execute("PRAGMA integrity_check").fetchall() if backend() == "sqlite" else ok
        ),
        "keys": {
            p: idem.list_keys(tx, caller(p), IdemListParams(limit=5000)).keys for p in principals
        },
        "raw_keys": conn.execute(
            "SELECT principal, operation, key, daemon_id, holder_start FROM idempotency"
        ).fetchall(),
        "daemons": conn.execute("SELECT daemon_id, owner_epoch FROM daemons").fetchall(),
        "sessions": [
            (sid, agent, parent, name, bool(pinned), daemon_id, epoch)
            for sid, agent, parent, name, pinned, daemon_id, epoch in conn.execute(
                "SELECT session_id, agent_session_id, parent, name, pinned, daemon_id, "
                "owner_epoch FROM sessions ORDER BY rowid"
            )
        ],
    }


def _listed(tx: Tx) -> list[str]:
    # This daemon's rows: the embedded store's default; a shared store lists every box's
    # by default (tests/store/test_boxes_store.py), so the model names its own box there.
    own = None if tx.one_box else tx.daemon_id
    page = fleet.list_sessions(tx, caller(), FleetListParams(limit=5000, daemon_id=own))
    assert page.next_cursor is None
    assert {row.daemon_id for row in page.sessions} <= {tx.daemon_id}
    return [row.session_id for row in page.sessions]


def _key_states_of(tx: Tx, daemon_id: str) -> list[str]:
    return [
        row[0]
        for row in tx.conn.execute(
            "SELECT state FROM idempotency WHERE daemon_id = ?", (daemon_id,)
        ).fetchall()
    ]


MODEL_SETTINGS = settings(
    max_examples=EXAMPLES,
    stateful_step_count=STEPS,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def test_store_model() -> None:
    """The machine's runs, on the backend of this run (a plain test function, not
    ``StoreModel.TestCase``: tests/store/conftest.py parametrizes functions only)."""
    run_state_machine_as_test(StoreModel, settings=MODEL_SETTINGS)


# The hypothesis pytest plugin reports statistics (--hypothesis-show-statistics) for
# hypothesis tests only; StoreModel.TestCase.runTest is marked the same way.
test_store_model.is_hypothesis_test = True  # type: ignore[attr-defined]
