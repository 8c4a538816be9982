"""The ceiling for bench/reads.py: the least a server can do per length-prefixed frame.

    .venv/bin/python bench/echo_server.py --socket PATH [--replies FILE] [--no-uvloop]

A bare asyncio ``Protocol`` on a Unix socket (uvloop's loop when installed,
unless ``--no-uvloop``). For each complete request frame it writes one answer
frame: towerd's own recorded answer to that exact request when ``--replies``
names it (a JSON list of ``[request payload hex, answer frame hex]``), so the
bytes on the wire in both directions are the same as towerd's; any other frame
is echoed back unchanged. It decodes no msgpack and keeps no state besides the
frame buffer: one dict lookup and one ``write`` per request.

Prints ``READY <loop>`` on stdout once listening; stops on SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys


class EchoProtocol(asyncio.Protocol):
    __slots__ = ("buffer", "replies", "transport")

    def __init__(self, replies: dict[bytes, bytes]) -> None:
        self.replies = replies
        self.buffer = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        buffer = self.buffer
        if not buffer and len(data) >= 4 and int.from_bytes(data[:4], "big") + 4 == len(data):
            # the common case in a closed loop: exactly one whole frame
            payload = data[4:]
            self.transport.write(self.replies.get(payload) or data)  # type: ignore[union-attr]
            return
        buffer += data
        out = []
        while len(buffer) >= 4:
            end = 4 + int.from_bytes(buffer[:4], "big")
            if len(buffer) < end:
                break
            frame = bytes(buffer[:end])
            del buffer[:end]
            out.append(self.replies.get(frame[4:]) or frame)
        if out:
            self.transport.write(b"".join(out))  # type: ignore[union-attr]


async def serve(path: str, replies: dict[bytes, bytes], loop_name: str) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_unix_server(lambda: EchoProtocol(replies), path, backlog=1024)
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    print(f"READY {loop_name}", flush=True)
    await stop.wait()
    server.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--socket", required=True)
    parser.add_argument("--replies", help="JSON list of [request payload hex, answer frame hex]")
    parser.add_argument("--no-uvloop", action="store_true", help="use the stdlib event loop")
    args = parser.parse_args()
    replies: dict[bytes, bytes] = {}
    if args.replies:
        with open(args.replies) as f:
            replies = {bytes.fromhex(req): bytes.fromhex(ans) for req, ans in json.load(f)}
    try:
        os.unlink(args.socket)
    except FileNotFoundError:
        pass
    loop_factory = None
    loop_name = "asyncio"
    if not args.no_uvloop:
        try:
            import uvloop
        except ImportError:
            pass
        else:
            loop_factory, loop_name = uvloop.new_event_loop, "uvloop"
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(serve(args.socket, replies, loop_name))
    sys.exit(0)


if __name__ == "__main__":
    main()
