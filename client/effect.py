"""Run one external effect under the effects ledger: claim, heartbeat, commit.

``client.effect(...)`` (on :class:`~towerd.client.Client` and
:class:`~towerd.client.AsyncClient`) is a context manager around an effect::

    with client.effect("run_42", "push", "git-push", "refs/heads/main") as fx:
        sha = push_with_lease(fencing_token=fx.fencing_token)
        fx.receipt = {"sha": sha}  # a with-block cannot return a value: assign it here

* entering claims the effect (and, for shared kinds, the daemon takes the target's
  lease); a claim the ledger refuses raises as usual: ``EffectAlreadyCommitted``
  (``data["effect"]["receipt"]`` says how it went), ``EffectUncertain``,
  ``EffectInFlight``, ``EffectLeaseHeld``, ``IdempotencyConflict``;
* while the body runs, a heartbeat every ``heartbeat_interval`` seconds keeps the
  effect and its lease alive: a background thread on a connection of its own for
  the blocking client (which is not thread-safe), a task for the async one. The
  holder is the process, so any connection of the process holds it;
* leaving normally commits with ``fx.receipt``; if a heartbeat was refused because
  the lease moved to another holder or the effect was parked (``effect_lease_superseded``,
  ``effect_uncertain``, ...), that error is raised instead of committing (it is also
  on ``fx.lost`` as soon as it happens, for a body that wants to check);
* the body raising :class:`~towerd.client.EffectNotStarted` aborts the effect (it did
  not happen; the next claim runs it afresh) and the exception propagates;
* the commit or abort survives a lost connection or a daemon restart: it is sent
  again, on a new connection, with backoff (:data:`~towerd.client.retry.PATIENT`),
  by the blocking and the async client alike;
* any other exception leaves the effect ``in_flight`` for recovery, since it may
  have happened: heartbeats stop, nothing is committed or aborted, the exception
  propagates. The daemon parks it ``uncertain`` once its ``timeout_ms`` passes
  without a heartbeat, or at once if this process dies; a person then settles it
  with ``towerctl effects resolve``.

The protocol is one generator, :func:`effect_steps`, carried out by the drivers that
run ``run_once`` (:class:`~towerd.client.idempotent.SyncDriver`,
``towerd.client.aio.AsyncDriver``); :class:`EffectSpec` names the effect for both
contexts and ``towerctl effect run``. :class:`Heartbeat` is the small background
helper: it calls a function every N seconds in a daemon thread until stopped
(``towerctl effect run`` and ``towerctl lock worktree`` use it too).
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import AsyncIterator, Callable, Generator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from towerd.client.api import _given
from towerd.client.idempotent import Call, EffectNotStarted, SyncDriver
from towerd.client.retry import ONCE, PATIENT, UNREACHABLE
from towerd.protocol.errors import (
    EffectAlreadyCommitted,
    EffectAttemptSuperseded,
    EffectLeaseSuperseded,
    EffectNotFound,
    EffectUncertain,
    TowerdError,
)

if TYPE_CHECKING:
    from types import TracebackType

    from towerd.client.aio import AsyncClient
    from towerd.client.sync import Client

DEFAULT_HEARTBEAT_INTERVAL = 30.0

# A heartbeat refused with one of these means the attempt no longer owns the effect:
# committing would be refused too, so the first one seen is kept and raised at exit.
LOST = (
    EffectLeaseSuperseded,
    EffectUncertain,
    EffectAttemptSuperseded,
    EffectAlreadyCommitted,
    EffectNotFound,
)


def new_attempt_id() -> str:
    return secrets.token_hex(8)


@dataclass(frozen=True)
class EffectSpec:
    """One external effect as ``client.effect(...)`` and ``towerctl effect run`` name it:
    what it does (run, step, kind, target: its key), its payload, the attempt (minted
    when not given) and how it is kept alive (heartbeat every ``heartbeat_interval``
    seconds, ``None`` or 0 for none; the lease's TTL; the silence after which the
    daemon parks it), and for a git-push what it pushes where (``git``: the evidence
    probe's target)."""

    run_id: str
    step_id: str
    action_kind: str
    target_ref: str
    payload: Any = None
    attempt_id: str | None = None
    heartbeat_interval: float | None = DEFAULT_HEARTBEAT_INTERVAL
    lease_ttl_ms: int | None = None
    timeout_ms: int | None = None
    # git-push: {repo, remote_url, commit, ref}, so the daemon can probe the remote when
    # the outcome is lost (towerctl effect run derives it from ``git push ...``).
    git: dict[str, str] | None = None

    def __post_init__(self) -> None:
        if self.attempt_id is None:
            object.__setattr__(self, "attempt_id", new_attempt_id())

    def claim_params(self) -> dict[str, Any]:
        return _given(
            run_id=self.run_id,
            step_id=self.step_id,
            attempt_id=self.attempt_id,
            action_kind=self.action_kind,
            target_ref=self.target_ref,
            payload=self.payload,
            timeout_ms=self.timeout_ms,
            lease_ttl_ms=self.lease_ttl_ms,
            git=self.git,
        )


class EffectFailed(Exception):
    """Thrown into an effect's steps: it ran and did not succeed (``towerctl effect run``'s
    non-zero exit). It is recorded ``failed`` with ``error``; the next attempt runs it
    afresh."""

    def __init__(self, error: Any) -> None:
        super().__init__(error)
        self.error = error


class ClaimedEffect:
    """What the body of ``with client.effect(...) as fx`` sees.

    Set ``fx.receipt`` to what the effect produced (a URL, a sha, a status code): it
    is committed at exit. ``fx.lost`` is the error a heartbeat met once the attempt
    lost the effect (``None`` while all is well); ``fx.record`` is the ledger's
    receipt after the commit or abort.
    """

    def __init__(self, spec: EffectSpec, claim: dict[str, Any]) -> None:
        self.spec = spec
        self.run_id = spec.run_id
        self.step_id = spec.step_id
        self.action_kind = spec.action_kind
        self.target_ref = spec.target_ref
        self.effect_key: str = claim["effect_key"]
        self.attempt_id: str = claim["attempt_id"]
        self.lease_resource: str | None = claim.get("lease_resource")
        self.fencing_token: int | None = claim.get("fencing_token")
        self.lease_expires_at: int | None = claim.get("lease_expires_at")
        self.receipt: Any = None
        self.lost: TowerdError | None = None
        self.heartbeats = 0
        self.heartbeat_at: int | None = None
        self.record: dict[str, Any] | None = None

    def __repr__(self) -> str:
        return (
            f"ClaimedEffect({self.action_kind} on {self.target_ref!r}, key={self.effect_key}, "
            f"attempt={self.attempt_id}, token={self.fencing_token})"
        )

    def _beaten(self, record: dict[str, Any]) -> None:
        self.heartbeats += 1
        self.heartbeat_at = record.get("heartbeat_at")


# --- the protocol, as steps -----------------------------------------------------------------


@dataclass(frozen=True)
class RunBody:
    """The effect is claimed: run the body (heartbeating it), then hand back the receipt
    to commit, or throw what the body raised."""

    effect: ClaimedEffect


def effect_steps(spec: EffectSpec) -> Generator[Call | RunBody, Any, ClaimedEffect]:
    """claim -> body -> commit, as steps for a driver (``SyncDriver``, ``AsyncDriver``),
    like :func:`~towerd.client.idempotent.idempotent_steps`.

    Thrown at ``RunBody``: ``EffectNotStarted`` aborts the effect and ``EffectFailed``
    records it failed, each raised again once recorded; anything else may have touched
    the world, so the effect stays in flight for recovery and the exception propagates.
    A heartbeat that found the effect lost (``effect.lost``) is raised instead of
    committing or failing. After a lost connection the outcome is sent again, as the
    driver's policy allows (a repeated commit is answered again; a repeated abort or
    fail is recognised from the record).
    """
    claim = yield Call("effect.claim", spec.claim_params(), UNREACHABLE)
    effect = ClaimedEffect(spec, claim)
    attempt = {"effect_key": effect.effect_key, "attempt_id": effect.attempt_id}
    try:
        receipt = yield RunBody(effect)
    except EffectNotStarted as exc:
        reason = {"reason": _reason(exc)}
        abort = Call("effect.abort", {**attempt, **reason}, UNREACHABLE)
        effect.record = yield from _settled(abort, "aborted", reason)
        raise
    except EffectFailed as exc:
        if effect.lost is not None:
            raise effect.lost from None
        error = {"error": exc.error}
        effect.record = yield from _settled(
            Call("effect.fail", {**attempt, **error}, UNREACHABLE), "failed", error
        )
        raise
    if effect.lost is not None:
        raise effect.lost
    effect.record = yield Call("effect.commit", {**attempt, "receipt": receipt}, UNREACHABLE)
    return effect


def _settled(call: Call, status: str, receipt: Any) -> Generator[Call, Any, Any]:
    """Send an abort or a fail. The daemon refuses either once the effect is settled, so
    a repeat of ours whose first answer was lost is refused too: that refusal is no
    error when the record shows our attempt settled as we asked."""
    try:
        return (yield call)
    except EffectAttemptSuperseded:
        record = yield Call("effect.get", {"effect_key": call.params["effect_key"]})
        ours = record["attempt_id"] == call.params["attempt_id"]
        if ours and record["status"] == status and record["receipt"] == receipt:
            return record
        raise


def _reason(exc: BaseException) -> str:
    return (str(exc) or type(exc).__name__)[:4096]


# --- the background heartbeat ----------------------------------------------------------


class Heartbeat:
    """Call ``beat()`` every ``interval`` seconds in a daemon thread until :meth:`stop`.

    ``beat`` returns False to stop beating. ``on_stop`` runs in the thread when it
    ends (close a connection the beats opened there). An exception from ``beat``
    ends the thread and is kept on ``.error``.
    """

    def __init__(
        self,
        beat: Callable[[], bool],
        interval: float,
        *,
        name: str = "towerd-heartbeat",
        on_stop: Callable[[], None] | None = None,
    ) -> None:
        if interval <= 0:
            raise ValueError(f"heartbeat interval must be positive, got {interval!r}")
        self.interval = interval
        self.error: BaseException | None = None
        self._beat = beat
        self._on_stop = on_stop
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def stop(self, timeout: float | None = None) -> None:
        """Stop beating and wait for a beat in progress to finish."""
        self._stopping.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def __enter__(self) -> Heartbeat:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _loop(self) -> None:
        try:
            # Event.wait, not sleep: stop() ends the wait at once.
            while not self._stopping.wait(self.interval):
                if not self._beat():
                    return
        except BaseException as exc:  # noqa: BLE001 - kept for the owner to look at
            self.error = exc
        finally:
            if self._on_stop is not None:
                self._on_stop()


class EffectBeat:
    """One ``effect.heartbeat`` per call, on a connection of its own made by ``connect``
    (opened at the first beat, reopened after a lost connection). Returns False, after
    recording the error on ``effect.lost``, once the attempt has lost the effect."""

    def __init__(self, connect: Callable[[], Client], effect: ClaimedEffect) -> None:
        self._driver = SyncDriver(ONCE, connect=connect)
        self.effect = effect

    def __call__(self) -> bool:
        try:
            record = self._driver.send(heartbeat_call(self.effect))
        except TowerdError as exc:
            return keep_beating(self.effect, exc)
        self.effect._beaten(record)
        return True

    def close(self) -> None:
        self._driver.close()


def heartbeat_call(effect: ClaimedEffect) -> Call:
    """A beat missed is not sent again: the next one is, ``heartbeat_interval`` later."""
    params = _given(
        effect_key=effect.effect_key,
        attempt_id=effect.attempt_id,
        lease_ttl_ms=effect.spec.lease_ttl_ms,
    )
    return Call("effect.heartbeat", params)


def keep_beating(effect: ClaimedEffect, refusal: TowerdError) -> bool:
    """After a refused heartbeat: False once the attempt lost the effect (kept on
    ``effect.lost``); else the next beat tries again (the daemon may be restarting, its
    disk full for a moment)."""
    if isinstance(refusal, LOST):
        effect.lost = refusal
        return False
    return True


def beat_in_background(effect: ClaimedEffect, connect: Callable[[], Client]) -> Heartbeat | None:
    """Heartbeat ``effect`` from a thread, on a connection ``connect`` makes (a blocking
    client is not thread-safe); None when its spec asks for no heartbeat."""
    interval = effect.spec.heartbeat_interval
    if not interval:
        return None
    beat = EffectBeat(connect, effect)
    name = f"towerd-heartbeat-{effect.effect_key}"
    return Heartbeat(beat, interval, name=name, on_stop=beat.close).start()


# --- the blocking context manager ------------------------------------------------------


class EffectContext:
    """``with client.effect(...) as fx``: see the module documentation."""

    def __init__(self, client: Client, spec: EffectSpec) -> None:
        self.spec = spec
        self._client = client
        self._steps = effect_steps(spec)
        self._driver = SyncDriver(PATIENT, client=client)
        self._heartbeat: Heartbeat | None = None
        self.effect: ClaimedEffect | None = None

    def _own_connection(self) -> Client:
        from towerd.client.sync import Client

        client = self._client
        return Client(
            client.socket_path,
            timeout=client.timeout,
            client_name=f"{client.client_name}/heartbeat",
            principal=client.principal,
        )

    def __enter__(self) -> ClaimedEffect:
        body = self._driver.advance(self._steps, policy=ONCE)
        self.effect = body.effect
        self._heartbeat = beat_in_background(body.effect, self._own_connection)
        return body.effect

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self.effect is not None
        if self._heartbeat is not None:
            self._heartbeat.stop()
        try:
            self._driver.advance(self._steps, self.effect.receipt, exc)
        except BaseException as raised:
            if raised is not exc:
                raise
            # The body's own exception, handed back once the protocol saw it: the with
            # statement raises it.


# --- the async twin ---------------------------------------------------------------------


async def _beat_async(client: AsyncClient, effect: ClaimedEffect, interval: float) -> None:
    """Heartbeats as a task on the client's own (pipelined) connection; a lost one is
    not reopened here (the commit at exit reconnects)."""
    import anyio

    call = heartbeat_call(effect)
    while True:
        await anyio.sleep(interval)
        try:
            record = await client.call(call.method, call.params)
        except TowerdError as exc:
            if not keep_beating(effect, exc):
                return
        else:
            effect._beaten(record)


@asynccontextmanager
async def effect_async(client: AsyncClient, spec: EffectSpec) -> AsyncIterator[ClaimedEffect]:
    """``async with client.effect(...) as fx``: the same steps on the async driver,
    heartbeats as a task."""
    import anyio

    from towerd.client.aio import AsyncDriver

    steps = effect_steps(spec)
    async with AsyncDriver(PATIENT, client=client) as driver:
        body = await driver.advance(steps, policy=ONCE)
        effect: ClaimedEffect = body.effect
        failure: BaseException | None = None
        async with anyio.create_task_group() as tasks:
            if spec.heartbeat_interval:
                tasks.start_soon(_beat_async, client, effect, spec.heartbeat_interval)
            try:
                yield effect
            except BaseException as exc:  # noqa: BLE001 - handed to the steps below
                failure = exc
            finally:
                tasks.cancel_scope.cancel()
        # Outside the task group, so callers catch the error itself, not an
        # ExceptionGroup around it (as AsyncClient.open does).
        await driver.advance(steps, effect.receipt, failure)
