"""Point reads answered from memory: ``fleet.get`` and ``idem.get``.

A point read on SQLite costs ~20 us of the loop's time (lookup and row building),
five times an echo. Rows read once are kept here and dropped, never rewritten,
when a committed write's change notes (the ones ``watch`` pushes) name them: the
store hands each committed batch's notes to :meth:`ReadCache.apply` on the loop
before any writer is answered. A read that missed while that batch was in
flight read the state before it or after it (each read is its own short
transaction), so whatever it cached is dropped by that same ``apply``. A note
that names no single row (an adoption, an expiry sweep) clears the topic.
Nothing is ever installed from a
note: what is cached was read from a committed snapshot.
"""

from __future__ import annotations

from typing import Any

MAX_ENTRIES = 50_000  # per topic; then the topic starts again empty


class ReadCache:
    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        self.max_entries = max_entries
        self.fleet: dict[str, Any] = {}
        self.idem: dict[tuple[str, str, str], Any] = {}

    def remember(self, table: dict[Any, Any], key: Any, value: Any) -> Any:
        if len(table) >= self.max_entries:
            table.clear()
        table[key] = value
        return value

    def apply(self, changes: list[tuple[str, Any]]) -> None:
        for topic, data in changes:
            if topic == "fleet":
                self._forget_session(data)
            elif topic == "idem":
                self._forget_key(data)

    def _forget_session(self, data: Any) -> None:
        session = data.get("session")
        session_id = session.session_id if session is not None else data.get("session_id")
        if session_id is None:
            self.fleet.clear()  # an adoption: many rows changed owner
        else:
            self.fleet.pop(session_id, None)

    def _forget_key(self, data: Any) -> None:
        record = data.get("record")
        operation = record.operation if record is not None else data.get("operation")
        key = record.key if record is not None else data.get("key")
        if operation is None or key is None:
            self.idem.clear()  # an expiry sweep: many keys went
        else:
            self.idem.pop((data["principal"], operation, key), None)
