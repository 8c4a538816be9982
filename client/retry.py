"""The clients' one retry policy: which refusals a call is sent again after, how often,
how patiently.

A call is sent again only after a refusal that leaves repeating it safe:

* ``Unavailable``: the daemon could not be reached, restarted, or the connection
  dropped. Every call the clients repeat is built to be repeated: a claim carries the
  same attempt token and is answered ``claimed`` again, a repeated commit or complete
  is answered again, a repeated abort or fail is recognised from the record;
* ``StorageFull`` as well, for what ``run_once`` records after its effect ran: the
  outcome must reach the daemon, and a refused write wrote nothing. A claim refused
  ``storage_full`` is raised at once (nothing ran yet: the caller decides).

The policies, each for one situation, live here so that no retry loop has constants
of its own: :data:`PATIENT` once an effect ran, :data:`FAIL_FAST` before anything ran
(towerctl without a daemon says so within a second), :data:`ONCE` for a call that is
not repeated, :data:`RECONNECT_WATCH` for ``towerctl top``'s subscription.
"""

from __future__ import annotations

from towerd.client.record import Record
from towerd.protocol.errors import StorageFull, Unavailable

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs hooks ~3 ms
if TYPE_CHECKING:
    from collections.abc import Iterator

UNREACHABLE = (Unavailable,)
UNREACHABLE_OR_FULL = (Unavailable, StorageFull)


class RetryPolicy(Record):
    """Send a call at most ``attempts`` times in a row (``None``: until it is answered),
    waiting ``backoff`` seconds after the first failure, twice that after the next, and
    so on up to ``max_backoff``. (A frozen record, as a frozen dataclass would be.)"""

    __slots__ = ("attempts", "backoff", "max_backoff")
    attempts: int | None
    backoff: float
    max_backoff: float

    def __init__(
        self, attempts: int | None = 20, backoff: float = 0.1, max_backoff: float = 2.0
    ) -> None:
        object.__setattr__(self, "attempts", attempts)
        object.__setattr__(self, "backoff", backoff)
        object.__setattr__(self, "max_backoff", max_backoff)

    def delay(self, failures: int) -> float:
        """The wait after ``failures`` consecutive failures."""
        return min(self.max_backoff, self.backoff * 2 ** min(failures - 1, 32))

    def pauses(self) -> Iterator[float]:
        """The wait before each repeat of one call: ``attempts - 1`` of them, so a loop
        that finds none left has sent it ``attempts`` times and gives up."""
        failures = 1
        while self.attempts is None or failures < self.attempts:
            yield self.delay(failures)
            failures += 1


PATIENT = RetryPolicy()  # 20 sends over about 30 s: what ran must be recorded
FAIL_FAST = RetryPolicy(attempts=3)  # nothing ran yet: without a daemon, say so soon
ONCE = RetryPolicy(attempts=1)
RECONNECT_WATCH = RetryPolicy(attempts=None, backoff=0.2, max_backoff=5.0)
