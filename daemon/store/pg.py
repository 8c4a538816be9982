"""The PostgreSQL backend's connection: the store's SQL, written once, run on psycopg.

Every store function is plain SQL on ``tx.conn`` in the subset SQLite and PostgreSQL
share (``?`` placeholders, ``ON CONFLICT``, ``RETURNING``, an explicit ``rowid``
column on PostgreSQL where SQLite has an implicit one: daemon/store/pg_schema.py).
:class:`PgConnection` gives a psycopg connection the face of ``sqlite3.Connection``
as far as the store functions use it, so one body of SQL serves both backends:

* ``?`` becomes ``$1``, ``$2``..., once per statement text; a statement with arguments
  goes through libpq itself (:meth:`PgConnection._run`), its arguments and rows adapted
  by psycopg's own adapters, and is prepared on the server from its second use;
* a ``bool`` argument is sent as the integer the schema stores;
* ``BEGIN IMMEDIATE`` (SQLite: take the write lock now) is ``BEGIN`` and a transaction
  advisory lock every box's writer takes, so writes are serial across boxes exactly as
  they are in one SQLite file; the server's clock and the fleet clock's record are read
  under that lock (daemon/store/fleet_clock.py): every TTL and deadline in the shared
  store is on the fleet's clock;
* ``total_changes`` and ``in_transaction`` mean what they mean in sqlite3.

The writer lock makes every check-then-write in the store functions as safe on
PostgreSQL as on SQLite, without retries on serialization failures. A batch's own
brackets cost one round trip each (:meth:`PgConnection.begin_batch`: BEGIN, the lock,
then the clock and this daemon's epoch in a statement of its own; COMMIT with the
batch's notifications before it). Statements go through libpq, not a psycopg cursor:
a cursor's Python layer cost 45-75 us of CPU per statement on the write path, more
than the round trip itself on a Unix socket, against 20-40 us this way (measured).
Only the daemon imports this module (psycopg is a daemon dependency, never a client's).
"""

from __future__ import annotations

import functools
import socket
from collections.abc import Iterator
from typing import Any

import psycopg
from psycopg import pq
from psycopg.adapt import PyFormat, Transformer

from towerd.daemon.store import fleet_clock
from towerd.protocol import fields

WRITE_LOCK = 0x746F_7764_0057  # "towd" "W": the one advisory lock every box's writer takes
CONNECT_TIMEOUT_S = int(fields.STORE_DEADLINE_S)  # libpq takes whole seconds

# floor, not the cast's rounding: a millisecond is the one that has begun, as in now_ms
_SERVER_NOW_MS = "floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint"
# The fleet's clock (daemon/store/fleet_clock.py) is read from the server's and the
# record in meta, under the writers' lock.
_RECORD = f"(SELECT value FROM meta WHERE key = '{fleet_clock.KEY}')"
# One simple-protocol message, one round trip: the statements run in order, and in READ
# COMMITTED each takes its snapshot when it starts, so the clock is read, and every later
# statement sees every commit made, once the lock is granted.
_BEGIN_WRITE = (
    f"BEGIN; SELECT pg_advisory_xact_lock({WRITE_LOCK}); SELECT {_SERVER_NOW_MS}, {_RECORD}"
)
# A write batch's head, prepared once per connection (parsed and planned on every batch,
# inside the lock, it cost 45-90 us more per batch than EXECUTE: measured): the server's
# clock and the fleet clock's record, this daemon's epoch and dead_at.
_BATCH_HEAD = "towerd_batch_head"
_PREPARE_BATCH_HEAD = (
    f"PREPARE {_BATCH_HEAD}(text) AS SELECT {_SERVER_NOW_MS}, {_RECORD}, "
    "(SELECT owner_epoch FROM daemons WHERE daemon_id = $1), "
    "(SELECT dead_at FROM daemons WHERE daemon_id = $1)"
).encode()
_DML = ("INSERT", "UPDATE", "DELETE", "MERGE")
_DML_STATUS = tuple(verb.encode() for verb in _DML)
_AUTO = PyFormat.AUTO
PREPARED_MAX = 2000  # statements prepared per connection (the store has a few hundred)
# A prepared statement's plan is made once and kept: made while a table was a page or
# two (a fresh database), a lookup by primary key is a sequential scan, and stays one as
# the table grows, until the server happens to analyze it. Measured: 146 us per
# idempotency lookup at 20 rows, 1225 us at 6,000, 97 us once replanned. So every this
# many statements a connection's plans are made again (DISCARD PLANS: one more round
# trip per thousand statements; the statements stay prepared).
REPLAN_EVERY = 1000
# Statements without arguments or rows, sent as they are through libpq (no cursor).
_BRACKETS = frozenset(
    ["BEGIN", "COMMIT", "ROLLBACK", "SAVEPOINT request", "RELEASE request", "ROLLBACK TO request"]
)


@functools.lru_cache(maxsize=8192)
def numbered(sql: str) -> bytes:
    """SQLite-style ``?`` placeholders to PostgreSQL's ``$1``, ``$2``... outside string
    literals and quoted names, for libpq (which gives ``%`` no meaning)."""
    out: list[str] = []
    quote: str | None = None
    count = 0
    for char in sql:
        if quote is not None:
            if char == quote:
                quote = None
        elif char in ("'", '"'):
            quote = char
        elif char == "?":
            count += 1
            out.append(f"${count}")
            continue
        out.append(char)
    return "".join(out).encode()


class Rows:
    """An executed statement's rows, read as a store function reads a sqlite3 cursor:
    ``fetchone``, ``fetchall``, ``fetchmany``, iteration, ``rowcount`` (rows changed
    or returned, -1 when the statement says none)."""

    __slots__ = ("_rows", "_next", "rowcount")

    def __init__(self, rows: list[tuple[Any, ...]], rowcount: int) -> None:
        self._rows = rows
        self._next = 0
        self.rowcount = rowcount

    def fetchone(self) -> tuple[Any, ...] | None:
        if self._next >= len(self._rows):
            return None
        self._next += 1
        return self._rows[self._next - 1]

    def fetchmany(self, size: int = 1) -> list[tuple[Any, ...]]:
        rows = self._rows[self._next : self._next + size]
        self._next += len(rows)
        return rows

    def fetchall(self) -> list[tuple[Any, ...]]:
        rows = self._rows[self._next :]
        self._next = len(self._rows)
        return rows

    def __iter__(self) -> Iterator[tuple[Any, ...]]:
        return self

    def __next__(self) -> tuple[Any, ...]:
        row = self.fetchone()
        if row is None:
            raise StopIteration
        return row


def _int(value: bytes | None) -> int:
    if value is None:
        raise psycopg.OperationalError("the server answered NULL for a number")
    return int(value)


def _arguments(args: Any) -> Any:
    if any(type(value) is bool for value in args):
        return [int(value) if type(value) is bool else value for value in args]
    return args


class PgConnection:
    """A psycopg connection (autocommit: towerd says BEGIN and COMMIT itself, as it does
    on sqlite3 with ``isolation_level=None``) seen as the store functions see sqlite3."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.raw = conn
        self.total_changes = 0
        self.server_now: int | None = None  # the fleet's clock, read by BEGIN IMMEDIATE
        self.server_ms = 0  # the server's clock, read by a batch's head
        self.fleet_clock = fleet_clock.FleetClock()  # the box's (open_pg_store sets it)
        self.clock_record: fleet_clock.Record | None = None  # and the fleet clock's record
        self._notes: list[bytes] = []  # pg_notify statements sent with the next COMMIT
        self._begin_batch: dict[str, bytes] = {}  # daemon id -> its batch's first message
        self._tx = Transformer(conn)  # psycopg's adapters: arguments out, rows in
        self._prepared: dict[tuple[str, tuple[int, ...]], bytes] = {}  # -> statement name
        self._seen: set[tuple[str, tuple[int, ...]]] = set()  # used once, not prepared
        self._statements = 0  # run since the plans were last made again (REPLAN_EVERY)

    def execute(self, sql: str, args: Any = ()) -> Any:
        """A psycopg cursor, as sqlite3's ``execute`` returns one; None for the
        transaction brackets (BEGIN, COMMIT, savepoints...), which return no rows."""
        if sql in _BRACKETS:
            notes = self._notes
            if sql in ("BEGIN", "COMMIT", "ROLLBACK"):
                self._notes = []
            self._exec(b"; ".join([*notes, b"COMMIT"]) if sql == "COMMIT" else sql.encode())
            return None
        if sql == "BEGIN IMMEDIATE":
            self._notes.clear()
            result = self._exec(_BEGIN_WRITE.encode())
            record = fleet_clock.Record.parse(self._value(result, 1))
            self.server_now = self.fleet_clock.reading(_int(self._value(result, 0)), record)
            return None
        if args:
            return self._run(sql, _arguments(args))
        # Without arguments psycopg sends the text as it is (several statements allowed).
        cursor = self.raw.execute(sql)
        if cursor.rowcount > 0 and (cursor.statusmessage or "").startswith(_DML):
            self.total_changes += cursor.rowcount
        return cursor

    def _run(self, sql: str, args: Any) -> Rows:
        """A statement with arguments, through libpq: the arguments dumped and the rows
        loaded by psycopg's own adapters (the same types as through a psycopg cursor),
        the statement prepared on the server from its second use (per argument types),
        the GIL released while the server answers."""
        self._statements += 1
        if self._statements >= REPLAN_EVERY and not self.failed:
            self._statements = 0
            self._exec(b"DISCARD PLANS")
        tx = self._tx
        params = tx.dump_sequence(args, [_AUTO] * len(args))
        types: tuple[int, ...] = tx.types or ()
        formats = tx.formats
        key = (sql, types)
        pgconn = self.raw.pgconn
        name = self._prepared.get(key)
        if name is None and key in self._seen and len(self._prepared) < PREPARED_MAX:
            name = b"towerd_%d" % len(self._prepared)
            self._checked(pgconn.prepare(name, numbered(sql), types))
            self._prepared[key] = name
        if name is not None:
            # None is NULL, as in exec_params (psycopg's stub leaves it out here only).
            answer = pgconn.exec_prepared(name, params, formats)  # type: ignore[arg-type]
            result = self._checked(answer)
        else:
            if len(self._seen) >= PREPARED_MAX:
                self._seen.clear()
            self._seen.add(key)
            result = self._checked(pgconn.exec_params(numbered(sql), params, types, formats))
        count = result.command_tuples
        rowcount = -1 if count is None else count
        if rowcount > 0 and (result.command_status or b"").startswith(_DML_STATUS):
            self.total_changes += rowcount
        if result.status != pq.ExecStatus.TUPLES_OK:
            return Rows([], rowcount)
        tx.set_pgresult(result)
        rows = tx.load_rows(0, result.ntuples, tuple)
        tx.set_pgresult(None)
        return Rows(rows, rowcount)

    def begin_batch(self, daemon_id: str) -> tuple[int | None, int | None]:
        """``BEGIN IMMEDIATE`` for a write batch, in one round trip: BEGIN, the writer
        lock, then the server's clock (``server_ms``), the fleet clock's record
        (``clock_record``), and this daemon's ``owner_epoch`` and ``dead_at`` as the
        lock holder sees them (None, None: its row is gone)."""
        message = self._begin_batch.get(daemon_id)
        if message is None:
            if not self._begin_batch:
                self._exec(_PREPARE_BATCH_HEAD)  # kept by the session, whatever rolls back
            message = self._begin_batch[daemon_id] = (
                f"BEGIN; SELECT pg_advisory_xact_lock({WRITE_LOCK}); "
                f"EXECUTE {_BATCH_HEAD}({self._literal(daemon_id)})"
            ).encode()
        self._notes.clear()
        result = self._exec(message)
        self.server_ms = _int(self._value(result, 0))
        self.clock_record = fleet_clock.Record.parse(self._value(result, 1))
        epoch, dead_at = self._value(result, 2), self._value(result, 3)
        return (
            None if epoch is None else _int(epoch),
            None if dead_at is None else _int(dead_at),
        )

    def notify_at_commit(self, channel: str, payload: str) -> None:
        """``pg_notify(channel, payload)`` in the open transaction, sent in the same
        message as its COMMIT (a notification goes out if and only if it commits); a
        ROLLBACK or the next BEGIN drops it."""
        self._notes.append(
            f"SELECT pg_notify({self._literal(channel)}, {self._literal(payload)})".encode()
        )

    def _literal(self, value: str) -> str:
        return pq.Escaping(self.raw.pgconn).escape_literal(value.encode()).decode()

    def _exec(self, message: bytes) -> pq.abc.PGresult:
        """Send ``message`` (one or more statements, simple protocol) through libpq and
        wait for its last result, the GIL released meanwhile."""
        return self._checked(self.raw.pgconn.exec_(message))

    def _checked(self, result: pq.abc.PGresult) -> pq.abc.PGresult:
        """``result`` if it succeeded; else the psycopg error it is, and a lost
        connection's as psycopg's own (``OperationalError``)."""
        if result.status in (pq.ExecStatus.COMMAND_OK, pq.ExecStatus.TUPLES_OK):
            return result
        pgconn = self.raw.pgconn
        if pgconn.status == pq.ConnStatus.BAD or result.status != pq.ExecStatus.FATAL_ERROR:
            why = result.get_error_message() or pgconn.get_error_message()
            raise psycopg.OperationalError(why.strip() or "the connection was lost")
        raise psycopg.errors.error_from_result(result)

    @staticmethod
    def _value(result: pq.abc.PGresult, column: int) -> bytes | None:
        if result.ntuples != 1:
            raise psycopg.OperationalError(f"expected one row, got {result.ntuples}")
        return result.get_value(0, column)

    @property
    def in_transaction(self) -> bool:
        """Like sqlite3's; a transaction PostgreSQL aborted (an error) still counts: it
        must be rolled back (or back to a savepoint) before anything else runs."""
        status = self.raw.info.transaction_status
        return status in (pq.TransactionStatus.INTRANS, pq.TransactionStatus.INERROR)

    @property
    def failed(self) -> bool:
        """PostgreSQL abandoned the open transaction's statements after an error: only a
        rollback (to a savepoint) lets the next statement run."""
        return self.raw.info.transaction_status == pq.TransactionStatus.INERROR

    @property
    def broken(self) -> bool:
        return self.raw.closed or self.raw.broken

    def clock_sources(self) -> tuple[int, fleet_clock.Record | None]:
        """The server's clock and the fleet clock's record (one round trip), outside the
        writer's lock."""
        row = self.raw.execute(f"SELECT {_SERVER_NOW_MS}, {_RECORD}").fetchone()
        assert row is not None
        return int(row[0]), fleet_clock.Record.parse(row[1])

    def interrupt(self) -> None:
        """From any thread: shut the connection's socket down, so that a statement
        waiting on it (in another thread) fails now with a connection error and the
        connection counts as broken. For a path that is silent but still acknowledges
        packets, where neither ``tcp_user_timeout`` nor keepalives ever fire."""
        try:
            fd = self.raw.pgconn.socket
        except psycopg.OperationalError:
            return  # closed already
        sock = socket.socket(fileno=fd)
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # not connected any more
        finally:
            sock.detach()  # the descriptor stays libpq's

    def close(self) -> None:
        self.raw.close()


def connect(dsn: str, connect_timeout: int = CONNECT_TIMEOUT_S) -> PgConnection:
    """A connection that gives up within :data:`CONNECT_TIMEOUT_S` when the server is
    unreachable: at connect, on a statement (``statement_timeout``, which also bounds
    the wait for the writer lock), and on a silent network (TCP keepalives and
    ``tcp_user_timeout``); the server ends a transaction left idle by a vanished box, so
    its lock is not held for longer than that either."""
    timeout_ms = CONNECT_TIMEOUT_S * 1000
    conn = psycopg.connect(
        dsn,
        autocommit=True,
        connect_timeout=connect_timeout,  # libpq: at least 2 s
        application_name="towerd",
        keepalives=1,
        keepalives_idle=2,
        keepalives_interval=1,
        keepalives_count=2,
        tcp_user_timeout=timeout_ms,
        options=(
            f"-c statement_timeout={timeout_ms} "
            f"-c idle_in_transaction_session_timeout={timeout_ms} "
            "-c lock_timeout=0 -c TimeZone=UTC"
        ),
    )
    return PgConnection(conn)


def redacted(dsn: str) -> str:
    """The DSN without its password, for logs and ``status``."""
    try:
        info = psycopg.conninfo.conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        return "postgresql://(unparseable DSN)"
    info.pop("password", None)
    host = info.get("host") or ""
    port = info.get("port")
    where = f"{host}:{port}" if port else host
    return f"postgresql://{info.get('user') or ''}@{where}/{info.get('dbname') or ''}"
