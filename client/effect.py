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
* any other exception leaves the effect ``in_flight`` for recovery, since it may
  have happened: heartbeats stop, nothing is committed or aborted, the exception
  propagates. The daemon parks it ``uncertain`` once its ``timeout_ms`` passes
  without a heartbeat, or at once if this process dies; a person then settles it
  with ``towerctl effects resolve``.

:class:`Heartbeat` is the small background helper: it calls a function every N
seconds in a daemon thread until stopped (``towerctl effect run`` and
``towerctl lock worktree`` use it too).
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from towerd.client.idempotent import EffectNotStarted, retry_delay
from towerd.protocol.errors import (
    EffectAlreadyCommitted,
    EffectAttemptSuperseded,
    EffectLeaseSuperseded,
    EffectNotFound,
    EffectUncertain,
    TowerdError,
    Unavailable,
)

if TYPE_CHECKING:
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

# Delivering the outcome after the effect ran: reconnect and repeat on a lost
# connection, as run_once does (a commit repeated is answered again).
_ATTEMPTS, _BACKOFF, _MAX_BACKOFF = 20, 0.1, 2.0


def new_attempt_id() -> str:
    return secrets.token_hex(8)


class ClaimedEffect:
    """What the body of ``with client.effect(...) as fx`` sees.

    Set ``fx.receipt`` to what the effect produced (a URL, a sha, a status code): it
    is committed at exit. ``fx.lost`` is the error a heartbeat met once the attempt
    lost the effect (``None`` while all is well); ``fx.record`` is the ledger's
    receipt after the commit or abort.
    """

    def __init__(self, run_id: str, step_id: str, action_kind: str, target_ref: str,
                 claim: dict[str, Any]) -> None:  # fmt: skip
        self.run_id = run_id
        self.step_id = step_id
        self.action_kind = action_kind
        self.target_ref = target_ref
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

    def __init__(
        self, connect: Callable[[], Client], effect: ClaimedEffect, lease_ttl_ms: int | None
    ) -> None:
        self._connect = connect
        self._client: Client | None = None
        self.effect = effect
        self.lease_ttl_ms = lease_ttl_ms

    def __call__(self) -> bool:
        try:
            if self._client is None:
                self._client = self._connect()
            record = self._client.effect_heartbeat(
                self.effect.effect_key, self.effect.attempt_id, lease_ttl_ms=self.lease_ttl_ms
            )
        except Unavailable:
            self.close()
            return True  # the daemon may be restarting: try again at the next beat
        except LOST as exc:
            self.effect.lost = exc
            return False
        except TowerdError:
            return True  # storage_full, internal: nothing changed, try again
        self.effect._beaten(record)
        return True

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


# --- the blocking context manager ------------------------------------------------------


def deliver(client: Client, method: str, *args: Any, settled: str | None = None) -> Any:
    """``client.METHOD(*args)``, reconnecting and repeating on a lost connection.

    ``settled``: for abort and fail, which the daemon refuses when repeated
    (the attempt no longer owns an effect it already settled), the status that
    says our own earlier call went through.
    """
    failures = 0
    while True:
        try:
            if client._sock is None:
                client.connect()
            return getattr(client, method)(*args)
        except Unavailable:
            failures += 1
            if failures >= _ATTEMPTS:
                raise
            time.sleep(retry_delay(failures, _BACKOFF, _MAX_BACKOFF))
        except EffectAttemptSuperseded:
            if failures and settled is not None:
                record = client.effect_get(args[0])
                if record["status"] == settled and record["attempt_id"] == args[1]:
                    return record
            raise


class EffectContext:
    """``with client.effect(...) as fx``: see the module documentation."""

    def __init__(
        self,
        client: Client,
        run_id: str,
        step_id: str,
        action_kind: str,
        target_ref: str,
        *,
        payload: Any = None,
        attempt_id: str | None = None,
        heartbeat_interval: float | None = DEFAULT_HEARTBEAT_INTERVAL,
        lease_ttl_ms: int | None = None,
        timeout_ms: int | None = None,
    ) -> None:
        self._client = client
        self._claim = (run_id, step_id, attempt_id or new_attempt_id(), action_kind, target_ref)
        self._payload = payload
        self._interval = heartbeat_interval
        self._lease_ttl_ms = lease_ttl_ms
        self._timeout_ms = timeout_ms
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
        run_id, step_id, attempt_id, action_kind, target_ref = self._claim
        claim = self._client.effect_claim(
            run_id, step_id, attempt_id, action_kind, target_ref,
            payload=self._payload, timeout_ms=self._timeout_ms, lease_ttl_ms=self._lease_ttl_ms,
        )  # fmt: skip
        effect = self.effect = ClaimedEffect(run_id, step_id, action_kind, target_ref, claim)
        if self._interval:
            beat = EffectBeat(self._own_connection, effect, self._lease_ttl_ms)
            self._heartbeat = Heartbeat(
                beat, self._interval, name=f"towerd-heartbeat-{effect.effect_key}",
                on_stop=beat.close,
            ).start()  # fmt: skip
        return effect

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        effect = self.effect
        assert effect is not None
        if self._heartbeat is not None:
            self._heartbeat.stop()
        key, attempt = effect.effect_key, effect.attempt_id
        if exc is None:
            if effect.lost is not None:
                raise effect.lost
            effect.record = deliver(self._client, "effect_commit", key, attempt, effect.receipt)
        elif isinstance(exc, EffectNotStarted):
            effect.record = deliver(
                self._client, "effect_abort", key, attempt, _reason(exc), settled="aborted"
            )
        # Anything else may have touched the world: the effect stays in flight for
        # recovery, and the exception propagates.


def _reason(exc: BaseException) -> str:
    return (str(exc) or type(exc).__name__)[:4096]


# --- the async twin ---------------------------------------------------------------------


async def _beat_async(
    client: AsyncClient, effect: ClaimedEffect, interval: float, lease_ttl_ms: int | None
) -> None:
    import anyio

    while True:
        await anyio.sleep(interval)
        try:
            record = await client.effect_heartbeat(
                effect.effect_key, effect.attempt_id, lease_ttl_ms=lease_ttl_ms
            )
        except LOST as exc:
            effect.lost = exc
            return
        except TowerdError:
            continue  # the commit at exit reports a lost connection itself
        effect._beaten(record)


@asynccontextmanager
async def effect_async(
    client: AsyncClient,
    run_id: str,
    step_id: str,
    action_kind: str,
    target_ref: str,
    *,
    payload: Any = None,
    attempt_id: str | None = None,
    heartbeat_interval: float | None = DEFAULT_HEARTBEAT_INTERVAL,
    lease_ttl_ms: int | None = None,
    timeout_ms: int | None = None,
) -> AsyncIterator[ClaimedEffect]:
    """``async with client.effect(...) as fx``: the same protocol, heartbeats as a task
    on the client's own (pipelined) connection."""
    import anyio

    claim = await client.effect_claim(
        run_id, step_id, attempt_id or new_attempt_id(), action_kind, target_ref,
        payload=payload, timeout_ms=timeout_ms, lease_ttl_ms=lease_ttl_ms,
    )  # fmt: skip
    effect = ClaimedEffect(run_id, step_id, action_kind, target_ref, claim)
    failure: BaseException | None = None
    async with anyio.create_task_group() as tasks:
        if heartbeat_interval:
            tasks.start_soon(_beat_async, client, effect, heartbeat_interval, lease_ttl_ms)
        try:
            yield effect
        except BaseException as exc:  # noqa: BLE001 - re-raised below, unwrapped
            failure = exc
        finally:
            tasks.cancel_scope.cancel()
    key, attempt = effect.effect_key, effect.attempt_id
    if failure is None:
        if effect.lost is not None:
            raise effect.lost
        effect.record = await client.effect_commit(key, attempt, effect.receipt)
        return
    if isinstance(failure, EffectNotStarted):
        effect.record = await client.effect_abort(key, attempt, _reason(failure))
    # Raised outside the task group, so callers catch the error itself, not an
    # ExceptionGroup around it (as AsyncClient.open does).
    raise failure
