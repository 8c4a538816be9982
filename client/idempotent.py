"""Run an effect at most once under an idempotency key, across lost connections,
daemon restarts and retries of the whole process.

The protocol lives in one generator, :func:`idempotent_steps`, which yields
the calls to make and the moment to run the effect; :func:`run_once` drives
it with the blocking client and ``AsyncClient.run_once`` with the async one.
What a caller sees:

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

import secrets
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

from towerd.client.sync import DEFAULT_TIMEOUT, Client
from towerd.protocol.errors import StorageFull, TowerdError, Unavailable

# Refusals after which a call is sent again: the daemon could not be reached (or
# restarted), or its disk was full. Claims are sent again only when unreachable.
RETRIED_AFTER_CLAIM = (Unavailable, StorageFull)


class EffectNotStarted(Exception):
    """Raise from an effect to say it did nothing: the key is released for a fresh retry."""


@dataclass(frozen=True)
class Call:
    method: str
    params: dict[str, Any]


@dataclass(frozen=True)
class RunEffect:
    effect_ref: str


Step = Call | RunEffect


def idempotent_steps(operation: str, key: str, payload: Any = None) -> Generator[Step, Any, Any]:
    """The claim -> effect -> complete protocol, as steps for a driver to carry out.

    The driver sends back each call's result, or throws its ``TowerdError``
    (``Unavailable`` after it reconnected); for ``RunEffect`` it sends the
    effect's return value or throws its exception.
    """
    key_params = {"operation": operation, "key": key}
    # One token for this logical claim: a retry after a lost answer repeats it and
    # is answered "claimed" again; any other claim of the key is refused.
    claim = {**key_params, "attempt": secrets.token_hex(16)}
    if payload is not None:
        claim["payload"] = payload
    while True:
        try:
            answer = yield Call("idem.claim", claim)
            break
        except Unavailable:
            continue  # reconnected: repeat the same claim
    if answer["state"] == "completed":
        return answer.get("result")
    try:
        result = yield RunEffect(answer["effect_ref"])
    except EffectNotStarted as exc:
        yield from _until_delivered(Call("idem.release", key_params))
        raise exc
    except BaseException as exc:
        yield from _until_delivered(Call("idem.mark_unknown", key_params))
        raise exc
    yield from _until_delivered(Call("idem.complete", {**key_params, "result": result}))
    return result


def _until_delivered(call: Call) -> Generator[Step, Any, Any]:
    """Once the effect ran, what happened must reach the daemon: keep sending."""
    while True:
        try:
            return (yield call)
        except RETRIED_AFTER_CLAIM:
            continue


def retry_delay(failures: int, backoff: float, max_backoff: float) -> float:
    """Exponential backoff after ``failures`` consecutive failures, capped."""
    return min(max_backoff, backoff * 2 ** min(failures - 1, 32))


def run_once(
    operation: str,
    key: str,
    effect: Callable[[str], Any],
    *,
    payload: Any = None,
    socket_path: str | None = None,
    principal: str | None = None,
    attempts: int = 20,
    backoff: float = 0.1,
    max_backoff: float = 2.0,
    timeout: float | None = DEFAULT_TIMEOUT,
) -> Any:
    """Run ``effect(effect_ref)`` at most once under (operation, key); return its result.

    Gives up with ``Unavailable`` after ``attempts`` consecutive failures to
    reach the daemon; calling ``run_once`` again later with the same key is
    always safe.
    """
    steps = idempotent_steps(operation, key, payload)
    client: Client | None = None
    to_send: Any = None
    to_throw: BaseException | None = None
    failures = 0
    try:
        while True:
            try:
                step = steps.throw(to_throw) if to_throw else steps.send(to_send)
            except StopIteration as finished:
                return finished.value
            to_send, to_throw = None, None
            if isinstance(step, RunEffect):
                try:
                    to_send = effect(step.effect_ref)
                except BaseException as exc:  # noqa: BLE001 - handed to the protocol
                    to_throw = exc
                continue
            try:
                if client is None:
                    client = Client(socket_path, timeout=timeout, principal=principal)
                to_send = client.call(step.method, step.params)
                failures = 0
            except Unavailable as exc:
                if client is not None:
                    client.close()
                    client = None
                failures += 1
                if failures >= attempts:
                    raise
                time.sleep(retry_delay(failures, backoff, max_backoff))
                to_throw = exc
            except StorageFull as exc:
                if step.method != "idem.claim":  # the outcome is sent again: wait first
                    failures += 1
                    if failures >= attempts:
                        raise
                    time.sleep(retry_delay(failures, backoff, max_backoff))
                to_throw = exc
            except TowerdError as exc:
                to_throw = exc
    finally:
        if client is not None:
            client.close()
