"""Run an effect at most once under an idempotency key, across lost connections,
daemon restarts and retries of the whole process.

The protocol lives in one generator, :func:`idempotent_steps`, which yields
the calls to make and the moment to run the effect; :class:`SyncDriver` carries
such steps out on the blocking client (:func:`run_once`), and
``towerd.client.aio.AsyncDriver`` on the async one (``run_once_async``). The
effects ledger's protocol (:func:`towerd.client.effect.effect_steps`) runs on the
same two drivers. What a caller of ``run_once`` sees:

* the key is new: the effect runs once with its ``effect_ref``, the result is
  recorded and returned;
* the key completed earlier: the stored result is returned, the effect does
  not run;
* the connection drops at any point: reconnect and resume with the same key
  (a claim whose answer was lost is repeated with the same ``attempt`` token,
  and the daemon answers it ``claimed`` again);
* the disk under the daemon is full when the outcome is recorded: recording is
  retried (with backoff) until it succeeds, as for a lost connection; a claim
  refused ``storage_full`` wrote nothing and is raised;
* the effect raises: the key is marked ``outcome_unknown`` (it may have
  happened) and the exception propagates, unless it is
  :class:`EffectNotStarted`, which releases the key so a retry runs fresh;
* the key is ``outcome_unknown`` or held by another live process:
  ``OutcomeUnknown`` / ``IdempotencyInProgress`` is raised; the effect is
  never run again under that key.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Generator

from towerd.client.record import Record
from towerd.client.retry import (
    PATIENT,
    UNREACHABLE,
    UNREACHABLE_OR_FULL,
    RetryPolicy,
)
from towerd.client.sync import DEFAULT_TIMEOUT, Client
from towerd.protocol.errors import TowerdError


class EffectNotStarted(Exception):
    """Raise from an effect to say it did nothing: the key is released for a fresh retry."""


TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs hooks ~3 ms
if TYPE_CHECKING:
    from typing import Any, Self

    Outcome = tuple[Any, BaseException | None]  # a value, or the exception raised instead
else:
    Outcome = tuple


class Call(Record):
    """One request for the driver to send. After a refusal in ``retried`` it sends the
    same request again (reconnecting first if the connection was lost), as its policy
    allows; any other refusal is thrown into the steps."""

    __slots__ = ("method", "params", "retried")
    method: str
    params: dict[str, Any]
    retried: tuple[type[TowerdError], ...]

    def __init__(
        self, method: str, params: dict[str, Any], retried: tuple[type[TowerdError], ...] = ()
    ) -> None:
        object.__setattr__(self, "method", method)
        object.__setattr__(self, "params", params)
        object.__setattr__(self, "retried", retried)


class RunEffect(Record):
    __slots__ = ("effect_ref",)
    effect_ref: str

    def __init__(self, effect_ref: str) -> None:
        object.__setattr__(self, "effect_ref", effect_ref)


class Done(Record):
    """What a driver's ``advance`` returns once the steps finished: their return value."""

    __slots__ = ("value",)
    value: Any

    def __init__(self, value: Any) -> None:
        object.__setattr__(self, "value", value)


Step = Call | RunEffect


def idempotent_steps(operation: str, key: str, payload: Any = None) -> Generator[Step, Any, Any]:
    """The claim -> effect -> complete protocol, as steps for a driver to carry out.

    The driver sends back each call's answer, or throws its ``TowerdError``; for
    ``RunEffect`` it sends the effect's return value or throws its exception.
    """
    key_params = {"operation": operation, "key": key}
    # One token for this logical claim: a retry after a lost answer repeats it and
    # is answered "claimed" again; any other claim of the key is refused.
    claim = {**key_params, "attempt": os.urandom(16).hex()}  # secrets.token_hex(16)
    if payload is not None:
        claim["payload"] = payload
    answer = yield Call("idem.claim", claim, UNREACHABLE)
    if answer["state"] == "completed":
        return answer.get("result")
    # Once the effect ran, what happened must reach the daemon, full disk or not.
    try:
        result = yield RunEffect(answer["effect_ref"])
    except EffectNotStarted:
        yield Call("idem.release", key_params, UNREACHABLE_OR_FULL)
        raise
    except BaseException:
        yield Call("idem.mark_unknown", key_params, UNREACHABLE_OR_FULL)
        raise
    yield Call("idem.complete", {**key_params, "result": result}, UNREACHABLE_OR_FULL)
    return result


def next_step(steps: Generator[Any, Any, Any], value: Any, error: BaseException | None) -> Any:
    """Resume ``steps`` with a value or an exception: the step it yields, or ``Done``."""
    try:
        return steps.throw(error) if error is not None else steps.send(value)
    except StopIteration as finished:
        return Done(finished.value)


class SyncDriver:
    """Carries out steps on one blocking connection: the ``client`` given (reconnected in
    place once lost) or one made by ``connect`` (closed with the driver).

    A refusal the call is ``retried`` on is waited out and the call sent again, as
    ``policy`` allows; once it is spent, the refusal is raised to the caller (the steps
    stay where they were: running them again later with the same key is safe).
    """

    def __init__(
        self,
        policy: RetryPolicy = PATIENT,
        *,
        client: Client | None = None,
        connect: Callable[[], Client] | None = None,
    ) -> None:
        self.policy = policy
        self._client = client
        self._connect = connect
        self._owned = client is None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        if self._owned and self._client is not None:
            self._client.close()
            self._client = None

    def connected(self) -> Client:
        if self._client is None:
            assert self._connect is not None, "a driver needs a client or a way to connect"
            self._client = self._connect()
        elif self._client._sock is None:  # lost: a client closes itself then
            self._client.connect()
        return self._client

    def request(
        self,
        send: Callable[[Client], Any],
        retried: tuple[type[TowerdError], ...] = UNREACHABLE,
        policy: RetryPolicy | None = None,
    ) -> Any:
        """``send(client)``, sent again after a refusal in ``retried`` as the policy allows."""
        pauses = (policy or self.policy).pauses()
        while True:
            try:
                return send(self.connected())
            except retried:
                pause = next(pauses, None)
                if pause is None:
                    raise
                time.sleep(pause)

    def send(self, call: Call, policy: RetryPolicy | None = None) -> Any:
        return self.request(
            lambda client: client.call(call.method, call.params), call.retried, policy
        )

    def advance(
        self,
        steps: Generator[Any, Any, Any],
        value: Any = None,
        error: BaseException | None = None,
        *,
        policy: RetryPolicy | None = None,
    ) -> Any:
        """Resume ``steps`` with ``value`` (or ``error``) and carry out their calls until
        they hand over (``RunEffect``, ``RunBody``: returned) or finish (``Done``)."""
        while isinstance(step := next_step(steps, value, error), Call):
            value, error = self._answer(step, policy)
        return step

    def _answer(self, call: Call, policy: RetryPolicy | None) -> Outcome:
        try:
            return self.send(call, policy), None
        except call.retried:
            raise  # the policy is spent
        except TowerdError as exc:
            return None, exc  # for the steps to handle

    def drive(self, steps: Generator[Any, Any, Any], hand_over: Callable[[Any], Any]) -> Any:
        """Run ``steps`` to the end, answering each hand-over with ``hand_over(step)``."""
        step = self.advance(steps)
        while not isinstance(step, Done):
            step = self.advance(steps, *outcome(hand_over, step))
        return step.value


def outcome(run: Callable[..., Any], *args: Any) -> Outcome:
    """``run(*args)``'s value, or what it raised (handed to the protocol)."""
    try:
        return run(*args), None
    except BaseException as exc:  # noqa: BLE001 - the steps decide what it means
        return None, exc


def run_once(
    operation: str,
    key: str,
    effect: Callable[[str], Any],
    *,
    payload: Any = None,
    socket_path: str | None = None,
    principal: str | None = None,
    attempts: int | None = PATIENT.attempts,
    backoff: float = PATIENT.backoff,
    max_backoff: float = PATIENT.max_backoff,
    timeout: float | None = DEFAULT_TIMEOUT,
) -> Any:
    """Run ``effect(effect_ref)`` at most once under (operation, key); return its result.

    Gives up with ``Unavailable`` after ``attempts`` consecutive failures to
    reach the daemon (``None``: never), waiting ``backoff`` seconds after the first,
    doubling up to ``max_backoff`` (a :class:`~towerd.client.retry.RetryPolicy`);
    calling ``run_once`` again later with the same key is always safe.
    """
    with SyncDriver(
        RetryPolicy(attempts, backoff, max_backoff),
        connect=lambda: Client(socket_path, timeout=timeout, principal=principal),
    ) as driver:
        return driver.drive(
            idempotent_steps(operation, key, payload), lambda step: effect(step.effect_ref)
        )
