"""Where towerd's clock is anchored (daemon/clock.py), kept in the ``meta`` table.

The anchor is written by the start-up transaction; the high-water mark (the last
clock reading known to have been used) is refreshed periodically, so the first
start after a reboot never sets the clock before times already stored.
"""

from __future__ import annotations

import json
import sqlite3

from towerd.daemon.clock import Anchor
from towerd.daemon.store.tx import Tx

ANCHOR_KEY = "clock_anchor"
HIGH_WATER_KEY = "clock_high_water"


def _get(conn: sqlite3.Connection, key: str) -> str | None:
    row = conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
    return None if row is None else row[0]


def _put(conn: sqlite3.Connection, key: str, value: str) -> None:
    conn.execute(
        "INSERT INTO meta (key, value) VALUES (?, ?) "
        "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
        (key, value),
    )


def load(conn: sqlite3.Connection) -> tuple[Anchor | None, int | None]:
    """The stored anchor and high-water mark (None where missing or unreadable)."""
    anchor = None
    try:
        fields = json.loads(_get(conn, ANCHOR_KEY) or "null")
        if isinstance(fields, dict):
            anchor = Anchor(str(fields["boot_id"]), int(fields["boottime_ms"]),
                            int(fields["clock_ms"]))  # fmt: skip
    except (ValueError, KeyError, TypeError):
        anchor = None
    try:
        high_water = int(_get(conn, HIGH_WATER_KEY) or 0) or None
    except ValueError:
        high_water = None
    return anchor, high_water


def save_anchor(conn: sqlite3.Connection, anchor: Anchor, now_ms: int) -> None:
    _put(conn, ANCHOR_KEY, json.dumps({"boot_id": anchor.boot_id,
                                       "boottime_ms": anchor.boottime_ms,
                                       "clock_ms": anchor.clock_ms}))  # fmt: skip
    _put(conn, HIGH_WATER_KEY, str(now_ms))


def save_high_water(tx: Tx) -> None:
    """A store function: record that towerd's clock has reached ``tx.now``."""
    _put(tx.conn, HIGH_WATER_KEY, str(tx.now))
