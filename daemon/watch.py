"""``watch``: committed changes fanned out to subscribed connections.

The store hands every committed batch's change notes to :meth:`WatchHub.publish`
on the event loop, before any writer is answered. Each change is encoded once
and written to every subscriber of its topic with that subscriber's next
``seq``. A subscriber's queue is its connection's outbound buffer, bounded by
``max_queued_bytes``: one that falls behind is sent ``too_slow`` and
disconnected, so a slow watcher never holds up the daemon or other clients.

A subscription starts with a snapshot read on the loop's own read connection
in the same loop step as the subscription is registered; notes are published
on the loop too, so no change falls between the snapshot and the first push.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

import structlog

from towerd.protocol.envelope import encode_data, encode_error, encode_push
from towerd.protocol.errors import TooSlow, TowerdError

log = structlog.get_logger("towerd.watch")

DEFAULT_MAX_QUEUED_BYTES = 1024 * 1024


class Outlet(Protocol):
    """What a subscription needs of its connection (``server.Connection``)."""

    def queued_bytes(self) -> int: ...
    def write(self, frame: bytes) -> None: ...
    def close_after(self, frame: bytes) -> None: ...
    def is_closing(self) -> bool: ...


class Subscription:
    def __init__(self, outlet: Outlet, request_id: int, topics: Iterable[str]) -> None:
        self.outlet = outlet
        self.request_id = request_id
        self.topics = frozenset(topics)
        self.seq = 0
        self.active = True


class WatchHub:
    def __init__(self, max_queued_bytes: int = DEFAULT_MAX_QUEUED_BYTES) -> None:
        self.max_queued_bytes = max_queued_bytes
        self._by_topic: dict[str, set[Subscription]] = {}

    @property
    def subscribers(self) -> int:
        return len({sub for subs in self._by_topic.values() for sub in subs})

    def subscribe(
        self, subscription: Subscription, snapshot: Callable[[], dict[str, Any]]
    ) -> dict[str, Any]:
        """Register ``subscription`` and take its snapshot in one loop step."""
        taken = snapshot()
        for topic in subscription.topics:
            self._by_topic.setdefault(topic, set()).add(subscription)
        return taken

    def end_all(self, error: TowerdError) -> int:
        """End every subscription with ``error`` (its watcher reconnects for a fresh
        snapshot): for when changes may have been missed. Returns how many ended."""
        subs = {sub for subs in self._by_topic.values() for sub in subs}
        for sub in subs:
            self.unsubscribe(sub)
            if not sub.outlet.is_closing():
                sub.outlet.close_after(encode_error(sub.request_id, error))
        return len(subs)

    def unsubscribe(self, subscription: Subscription) -> None:
        subscription.active = False
        for topic in subscription.topics:
            subs = self._by_topic.get(topic)
            if subs is not None:
                subs.discard(subscription)
                if not subs:
                    del self._by_topic[topic]

    def publish(self, changes: list[tuple[str, Any]]) -> None:
        for topic, data in changes:
            subs = self._by_topic.get(topic)
            if not subs:
                continue
            encoded = encode_data(data)
            for sub in list(subs):
                self._push(sub, topic, encoded)

    def _push(self, sub: Subscription, topic: str, encoded: Any) -> None:
        if sub.outlet.is_closing():
            self.unsubscribe(sub)
            return
        queued = sub.outlet.queued_bytes()
        if queued > self.max_queued_bytes:
            self.unsubscribe(sub)
            log.warning("watcher_too_slow", code="too_slow", queued_bytes=queued, seq=sub.seq)
            error = TooSlow(
                f"this watcher fell {queued} bytes behind (limit {self.max_queued_bytes}) at "
                f"seq {sub.seq}; reconnect and watch again for a fresh snapshot",
                {"seq": sub.seq, "queued_bytes": queued, "limit": self.max_queued_bytes},
            )
            sub.outlet.close_after(encode_error(sub.request_id, error))
            return
        sub.seq += 1
        sub.outlet.write(encode_push(topic, sub.seq, encoded))
