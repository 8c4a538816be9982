"""The answers of one loop pass leave together (daemon/bursts.py).

What must hold: the first answer of a pass is written at once (a lone client waits
for nothing); later ones are held and all written when the pass ends, with no other
event needed; a connection's answers keep their order; a connection holds at most one
answer, never a large one (a pipelining peer meets the write buffer's backpressure as
before). On a real asyncio loop; the connections are recorders of what they write.
The real daemon's behaviour is in tests/integration/test_bad_input.py."""

from __future__ import annotations

import asyncio

import pytest

from towerd.daemon.bursts import HOLD_MAX_BYTES, AnswerBursts

pytestmark = pytest.mark.anyio


class Recorder:
    """A connection as AnswerBursts sees it, writing into a shared log."""

    def __init__(self, name: str, log: list[tuple[str, bytes]]) -> None:
        self.name = name
        self.log = log
        self.held: bytes | None = None

    def send(self, bursts: AnswerBursts, frame: bytes) -> None:
        """What Connection.send does with an answer that may be held."""
        if not bursts.hold(self, frame):
            self.log.append((self.name, frame))

    def release_held(self) -> None:
        frame, self.held = self.held, None
        if frame is not None:
            self.log.append((self.name, frame))


async def next_pass() -> None:
    """Let the loop run what is ready now (the pass's end) and come back."""
    await asyncio.sleep(0)
    await asyncio.sleep(0)


async def test_the_first_answer_of_a_pass_goes_now_the_rest_when_it_ends() -> None:
    log: list[tuple[str, bytes]] = []
    bursts = AnswerBursts()
    a, b, c = (Recorder(name, log) for name in "abc")
    a.send(bursts, b"a1")
    assert log == [("a", b"a1")]  # a lone client is answered at once
    b.send(bursts, b"b1")
    c.send(bursts, b"c1")
    assert log == [("a", b"a1")] and b.held == b"b1" and c.held == b"c1"
    await next_pass()  # nothing else happens: the pass's end releases them
    assert log == [("a", b"a1"), ("b", b"b1"), ("c", b"c1")]
    assert b.held is None and c.held is None and not bursts.pass_open
    b.send(bursts, b"b2")  # a new pass: its first answer goes now again
    assert log[-1] == ("b", b"b2")
    await next_pass()


async def test_a_connection_holds_one_answer_and_keeps_its_order() -> None:
    log: list[tuple[str, bytes]] = []
    bursts = AnswerBursts()
    first, pipelining = Recorder("first", log), Recorder("p", log)
    first.send(bursts, b"x")
    for n in range(5):
        pipelining.send(bursts, b"p%d" % n)
        # Never more than one held: the next one writes the held one, then itself.
        assert pipelining.held == (b"p%d" % n if n % 2 == 0 else None)
    assert [frame for name, frame in log if name == "p"] == [b"p0", b"p1", b"p2", b"p3"]
    await next_pass()
    assert [frame for name, frame in log if name == "p"] == [b"p%d" % n for n in range(5)]


async def test_a_large_answer_is_not_held_and_releases_the_held_one_first() -> None:
    log: list[tuple[str, bytes]] = []
    bursts = AnswerBursts()
    first, peer = Recorder("first", log), Recorder("peer", log)
    first.send(bursts, b"x")
    peer.send(bursts, b"small")
    large = b"L" * (HOLD_MAX_BYTES + 1)
    peer.send(bursts, large)
    assert peer.held is None
    assert log == [("first", b"x"), ("peer", b"small"), ("peer", large)]
    await next_pass()
    assert len(log) == 3
