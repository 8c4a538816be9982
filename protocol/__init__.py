"""towerd's wire protocol, sans-I/O: bytes in, messages out.

This package never touches a socket or an event loop, so the daemon, the
blocking client and the async client all share one definition of the wire.
Importing ``towerd.protocol`` itself pulls in the standard library only;
the typed per-method messages live in ``towerd.protocol.methods`` (msgspec),
which the daemon imports and short-lived clients do not need.
"""

from towerd.protocol.errors import ERROR_CODES, TowerdError, error_for_code
from towerd.protocol.framing import (
    DEFAULT_MAX_FRAME,
    RESPONSE_SLACK,
    FrameDecoder,
    FrameTooLargeError,
    encode_frame,
)

PROTOCOL_VERSION = 1
SERVER_NAME = "towerd"
VERSION = "0.1.0"

__all__ = [
    "DEFAULT_MAX_FRAME",
    "ERROR_CODES",
    "PROTOCOL_VERSION",
    "RESPONSE_SLACK",
    "SERVER_NAME",
    "VERSION",
    "FrameDecoder",
    "FrameTooLargeError",
    "TowerdError",
    "encode_frame",
    "error_for_code",
]
