"""The shared store: a PostgreSQL database (`[store] url = "postgresql://..."`).

The same calls and the same write semantics as the embedded SQLite store. One writer
task commits in groups: every write queued while the previous transaction was
committing goes into the next one, so concurrent turns share a commit; consecutive
statements of the same shape (the events of a step) go to the server as one pipelined
`executemany`. A caller that awaits a write resumes only after its transaction
committed. `append_event`, and the journal of an idempotent call, are not awaited: they
commit, in order, with the next durable write. Events that must never be kept without
their state (`turn.queued`, `turn.finished`, `turn.message`) are in the row's
transaction. A transaction that fails takes none of its neighbours down: the batch is
retried write by write, and only the write that fails reports the error.

A lost connection (the server restarted, a backend terminated, the network gone) is not
a failed write: the writer keeps the batch, reconnects with backoff and commits it when
the server answers, so no write is reported done before it is durable and nothing
queued is dropped; only after `fatal_after` seconds without a server are the waiting
writes failed (StoreError). `degraded` tells the daemon's health while it waits.

Driver: asyncpg. Measured against psycopg 3 on this machine (1,000 transactions of an
UPDATE and an INSERT on a local server, median of 3 rounds alternated): asyncpg 1.47
ms and 0.53 ms of CPU per transaction, psycopg 1.39 ms and 0.58 ms of CPU. The wall
time is the server's commit either way; asyncpg spends ~9% less of the daemon's CPU,
brings its own pool and LISTEN support, and pipelines `executemany` in one round trip.

Event numbers: an event row keeps the number the daemon's bus gave it as its key, as
in SQLite, so `events(after_seq=...)` and the bus's restart point read the same on both
backends. Every row also gets `pos`, an identity PostgreSQL assigns at insert: a global
order of the rows written by every daemon on the database, for readers that follow
several nodes. (Reserving blocks of bus numbers per node was the other choice; it gives
each node's events a contiguous range that does not follow time across nodes.)

Until turns are claimed with leases, one daemon at a time uses a database: a
session-level advisory lock, held by a connection for the life of the store, refuses a
second one (StoreInUse, exit 69). The server drops the lock when that connection ends,
kill -9 of the daemon included. The URL's password is never written to a log or an
error: `redact_url` replaces it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
import asyncpg
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from turnkeeper.clock import Clock, SystemClock
from turnkeeper.config.sections import redact_url
from turnkeeper.events import Event
from turnkeeper.policy.outcome import DEAD_LETTER_CODES
from turnkeeper.policy.turn_state import TERMINAL_STATES
from turnkeeper.store.base import StoreError, StoreInUse, dead_letter_entry
from turnkeeper.store.postgres_schema import MIGRATIONS as MIGRATIONS
from turnkeeper.store.postgres_schema import SCHEMA_VERSION as SCHEMA_VERSION
from turnkeeper.store.postgres_schema import prepare

MAX_BATCH = 1000
DEAD_LETTERS_SHOWN = 1000
MAX_PENDING_IDEMPOTENT = 100_000
POOL_SIZE = 4
CONNECT_TIMEOUT = 10.0
COMMAND_TIMEOUT = 60.0
# The session advisory lock one daemon holds on its database ("tk" "store").
STORE_LOCK = 0x746B_7374_6F72
BACKOFF_FIRST = 0.05
BACKOFF_MAX = 2.0


@dataclass(frozen=True, slots=True)
class MessageRows:  # moves to store/base.py
    """The conversation rows a checkpoint writes. After the write the turn holds exactly
    `start + len(rows)` message rows: rows at index >= start are replaced by `rows`."""

    start: int
    rows: tuple[str, ...]  # each message as JSON text, encoded once


def _sql_set(values: Iterable[str]) -> str:
    """A constant set as an SQL list: `('a','b')` (the values are our own enum names)."""
    return "(" + ",".join(f"'{v}'" for v in sorted(values)) + ")"


_TERMINAL_SQL = _sql_set(TERMINAL_STATES)
_DEAD_LETTER_SQL = _sql_set(DEAD_LETTER_CODES)
_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, check_circular=False)

# What a lost or unusable connection raises; an error the server reports about a
# statement (a constraint, a type) is a PostgresError that is not one of these.
_CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    OSError, TimeoutError, asyncpg.InterfaceError, asyncpg.PostgresConnectionError,
    asyncpg.exceptions.InternalClientError,
    asyncpg.exceptions.AdminShutdownError, asyncpg.exceptions.CrashShutdownError,
    asyncpg.exceptions.CannotConnectNowError, asyncpg.exceptions.TooManyConnectionsError)
_DB_ERRORS: tuple[type[BaseException], ...] = (asyncpg.PostgresError, *_CONNECTION_ERRORS)


def _lost(exc: BaseException) -> bool:
    """The connection failed, not the statement (a bad argument is a DataError, which
    asyncpg derives from InterfaceError)."""
    return (isinstance(exc, _CONNECTION_ERRORS)
            and not isinstance(exc, asyncpg.exceptions.DataError))


def _dumps(value: Any) -> str:
    return _ENCODER.encode(value)


def _stop_code(record: dict[str, Any]) -> str | None:
    result = record.get("result")
    if not isinstance(result, dict):
        return None
    stopped = result.get("stopped_because")
    code = stopped.get("code") if isinstance(stopped, dict) else None
    return code if isinstance(code, str) else None


def _attach_messages(checkpoint: dict[str, Any], rows: Sequence[str]) -> dict[str, Any]:
    """Put the conversation's stored rows (idx order) back into the checkpoint; one
    written before message rows existed (no "count") is returned as it is."""
    conversation = checkpoint.get("conversation")
    if isinstance(conversation, dict) and "count" in conversation:
        count = int(conversation["count"])
        conversation["messages"] = [json.loads(data) for data in rows[:count]]
    return checkpoint


def _message_count(checkpoint_json: str) -> int | None:
    conversation = json.loads(checkpoint_json).get("conversation")
    if isinstance(conversation, dict) and "count" in conversation:
        return int(conversation["count"])
    return None


_T = TypeVar("_T")
_Statement = tuple[str, Sequence[Any]]
_Conn = asyncpg.Connection | asyncpg.pool.PoolConnectionProxy
_Call = Callable[[_Conn], Awaitable[None]]
_Op = _Statement | _Call


def _event_statement(event: Event) -> _Statement:
    return ("INSERT INTO events (seq, turn, ts, type, data) VALUES ($1, $2, $3, $4, $5)"
            " ON CONFLICT (seq) DO NOTHING",
            (event.seq, event.turn, event.ts, event.type, _dumps(event.to_json())))


def _message_statements(turn_id: str, messages: MessageRows | None) -> list[_Op]:
    if messages is None:
        return []
    ops: list[_Op] = [("DELETE FROM messages WHERE turn = $1 AND idx >= $2",
                       (turn_id, messages.start))]
    if messages.rows:
        ops.append(("INSERT INTO messages (turn, idx, data) SELECT $1, $2 + o::int - 1, d"
                    " FROM unnest($3::text[]) WITH ORDINALITY AS u(d, o)",
                    (turn_id, messages.start, list(messages.rows))))
    return ops


@dataclass(slots=True)
class _Write:
    ops: Sequence[_Op]
    done: anyio.Event | None = None
    error: BaseException | None = field(default=None)


class PostgresStore:
    def __init__(self, url: str, *, clock: Clock | None = None, fatal_after: float = 300.0,
                 pool_size: int = POOL_SIZE) -> None:
        self.url = url
        self.where = redact_url(url)
        self.clock = clock or SystemClock()
        self.fatal_after = fatal_after
        self.pool_size = pool_size
        self._pool: asyncpg.Pool | None = None
        self._lock_conn: asyncpg.Connection | None = None
        self._send: MemoryObjectSendStream[_Write] | None = None
        self._receive: MemoryObjectReceiveStream[_Write] | None = None
        self._tg: TaskGroup | None = None
        self._writer_done = anyio.Event()
        self._closed = False
        self._idempotent_keys: set[str] = set()
        self.degraded: str | None = None  # why writes wait, while they do
        self.commits = 0
        self.durable_writes = 0
        self.failed_writes = 0
        self.reconnects = 0

    def __repr__(self) -> str:
        return f"PostgresStore({self.where!r})"

    # -- lifecycle ----------------------------------------------------------------

    async def _connect(self, conn: asyncpg.Connection) -> None:
        """Every pooled connection: nothing to set up yet (a hook for later settings)."""

    async def open(self) -> None:
        settings = {"application_name": f"turnkeeper pid {os.getpid()}"}
        try:
            self._lock_conn = await asyncpg.connect(self.url, timeout=CONNECT_TIMEOUT,
                                                    server_settings=settings)
            if not await self._lock_conn.fetchval("SELECT pg_try_advisory_lock($1)",
                                                  STORE_LOCK):
                holder = await self._lock_conn.fetchval(
                    "SELECT a.application_name || ' on ' || COALESCE(host(a.client_addr),"
                    " 'a local socket') FROM pg_locks l JOIN pg_stat_activity a"
                    " ON a.pid = l.pid WHERE l.locktype = 'advisory' AND l.granted"
                    " AND l.classid = $1 AND l.objid = $2 LIMIT 1",
                    STORE_LOCK >> 32, STORE_LOCK & 0xFFFF_FFFF)
                raise StoreInUse(
                    f"state database {self.where} is in use by another turnkeeper"
                    + (f" ({holder})" if holder else "")
                    + "; two daemons on one database would run the same turns twice")
            await prepare(self._lock_conn, self.where)
            self._pool = await asyncpg.create_pool(
                self.url, min_size=1, max_size=self.pool_size, timeout=CONNECT_TIMEOUT,
                command_timeout=COMMAND_TIMEOUT, server_settings=settings)
        except BaseException as exc:
            await self._close_connections()
            if isinstance(exc, StoreError):
                raise
            if isinstance(exc, (*_DB_ERRORS, ValueError)):
                raise StoreError(f"state database {self.where} cannot be opened: "
                                 f"{type(exc).__name__}: {exc}") from None
            raise

    async def _close_connections(self) -> None:
        if self._pool is not None:
            pool, self._pool = self._pool, None
            with anyio.CancelScope(shield=True):
                try:
                    with anyio.fail_after(5):
                        await pool.close()
                except Exception:  # a connection that cannot close cleanly is dropped
                    pool.terminate()
        if self._lock_conn is not None:
            conn, self._lock_conn = self._lock_conn, None
            with anyio.CancelScope(shield=True):
                try:
                    with anyio.fail_after(5):
                        await conn.close()
                except Exception:  # a connection that cannot close cleanly is dropped
                    conn.terminate()

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
                  ) -> None:
        """The writer task. Runs until `close()`; flushes everything queued before it ends."""
        send, receive = anyio.create_memory_object_stream[_Write](math.inf)
        self._send, self._receive = send, receive
        task_status.started()
        try:
            async with receive:
                while True:
                    try:
                        first = await receive.receive()
                    except anyio.EndOfStream:
                        return
                    batch = [first]
                    while len(batch) < MAX_BATCH:
                        try:
                            batch.append(receive.receive_nowait())
                        except (anyio.WouldBlock, anyio.EndOfStream):
                            break
                    with anyio.CancelScope(shield=True):
                        await self._commit(batch)
        finally:
            self._writer_done.set()

    async def _commit(self, batch: list[_Write]) -> None:
        errors = await self._commit_with_reconnect(batch)
        for w, error in zip(batch, errors, strict=True):
            w.error = error
            if error is not None:
                self.failed_writes += 1
            if w.done is not None:
                w.done.set()

    async def _commit_with_reconnect(self, batch: list[_Write]) -> list[BaseException | None]:
        """Commit the batch; while the server cannot be reached, wait and try again (the
        batch is kept whole), up to `fatal_after` seconds."""
        started = self.clock.monotonic()
        delay = BACKOFF_FIRST
        while True:
            try:
                errors = await self._commit_batch(batch)
            except Exception as exc:
                if not _lost(exc):
                    raise
                waited = self.clock.monotonic() - started
                if self._pool is None or waited >= self.fatal_after:
                    self.degraded = None
                    return [StoreError(f"state database {self.where} unreachable for "
                                       f"{waited:.0f} s: {type(exc).__name__}: {exc}")
                            ] * len(batch)
                self.degraded = (f"state database {self.where} unreachable: "
                                 f"{type(exc).__name__}")
                self.reconnects += 1
                await self.clock.sleep(delay)
                delay = min(delay * 2, BACKOFF_MAX)
                continue
            self.degraded = None
            return errors

    async def _commit_batch(self, batch: list[_Write]) -> list[BaseException | None]:
        """One transaction for the batch. If the server refuses it, each write gets its
        own, so one bad write fails alone, never its neighbours. A lost connection is
        raised (the caller retries the whole batch)."""
        pool = self._pool
        if pool is None:
            raise asyncpg.InterfaceError("store is closed")
        async with pool.acquire() as conn:
            try:
                return await self._commit_on(conn, batch)
            except BaseException as exc:
                if _lost(exc):
                    conn.terminate()  # never handed out again half-broken
                raise

    async def _commit_on(self, conn: _Conn, batch: list[_Write]) -> list[BaseException | None]:
        try:
            await self._transaction(conn, [op for w in batch for op in w.ops])
            self.commits += 1
            return [None] * len(batch)
        except Exception as exc:
            if _lost(exc):
                raise
            if len(batch) == 1:
                return [exc]
        errors: list[BaseException | None] = []
        for w in batch:
            try:
                await self._transaction(conn, w.ops)
                self.commits += 1
                errors.append(None)
            except Exception as exc:
                if _lost(exc):
                    raise
                errors.append(exc)
        return errors

    @staticmethod
    async def _transaction(conn: _Conn, ops: Sequence[_Op]) -> None:
        async with conn.transaction():
            i, n = 0, len(ops)
            while i < n:
                op = ops[i]
                if not isinstance(op, tuple):
                    await op(conn)
                    i += 1
                    continue
                sql, j = op[0], i + 1
                while j < n and isinstance(ops[j], tuple) and ops[j][0] == sql:  # type: ignore[index]
                    j += 1
                if j - i == 1:
                    await conn.execute(sql, *op[1])
                else:
                    await conn.executemany(sql, [o[1] for o in ops[i:j]])  # type: ignore[index]
                i = j

    async def close(self) -> None:
        self._closed = True
        if self._send is not None:
            self._send.close()
            await self._writer_done.wait()
        await self._close_connections()

    # -- writing ------------------------------------------------------------------

    async def _write(self, ops: Sequence[_Op]) -> None:
        if self._send is None or self._closed:
            raise StoreError("state database is closed: the write was not made")
        w = _Write(ops, anyio.Event())
        self.durable_writes += 1
        self._send.send_nowait(w)
        await w.done.wait()  # type: ignore[union-attr]
        if w.error is not None:
            if isinstance(w.error, StoreError):
                raise w.error
            raise StoreError(f"state database write failed: {w.error}") from w.error

    def _enqueue(self, ops: Sequence[_Op]) -> None:
        if self._send is not None and not self._closed:
            with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError):
                self._send.send_nowait(_Write(ops))

    async def flush(self) -> None:
        await self._write(())

    async def insert_turn(self, record: dict[str, Any], checkpoint: dict[str, Any], *,
                          events: Sequence[Event] = ()) -> int:
        """The turn's row, durable when this returns; `events` commit with it. Its number
        comes from a sequence, so turns submitted on any daemon share one order."""
        checkpoint_json = _dumps(checkpoint)

        async def insert(conn: _Conn) -> None:
            record["seq"] = int(await conn.fetchval("SELECT nextval('turn_seq')"))
            inserted = await conn.fetchval(
                "INSERT INTO turns (id, seq, session, state, created_at, updated_at, record,"
                " checkpoint, stop_code) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)"
                " ON CONFLICT (id) DO NOTHING RETURNING seq",
                record["id"], record["seq"], record["session"], record["state"],
                record["created_at"], record["updated_at"], _dumps(record), checkpoint_json,
                _stop_code(record))
            if inserted is None:
                # Committed by an attempt whose answer the lost connection never brought
                # back: the row that is there is this turn's.
                record["seq"] = int(await conn.fetchval(
                    "SELECT seq FROM turns WHERE id = $1", record["id"]))

        await self._write([insert, *map(_event_statement, events)])
        return int(record["seq"])

    async def save_turn(self, record: dict[str, Any],
                        checkpoint: dict[str, Any] | None = None, *,
                        messages: MessageRows | None = None,
                        events: Sequence[Event] = ()) -> None:
        """The record (and the checkpoint and the conversation's changed rows, when
        given) in one transaction with `events`."""
        stmt: _Statement
        if checkpoint is None:
            stmt = ("UPDATE turns SET state = $1, updated_at = $2, record = $3, stop_code = $4"
                    " WHERE id = $5", (record["state"], record["updated_at"], _dumps(record),
                                       _stop_code(record), record["id"]))
        else:
            stmt = ("UPDATE turns SET state = $1, updated_at = $2, record = $3, stop_code = $4,"
                    " checkpoint = $5 WHERE id = $6",
                    (record["state"], record["updated_at"], _dumps(record),
                     _stop_code(record), _dumps(checkpoint), record["id"]))
        await self._write([*_message_statements(record["id"], messages), stmt,
                           *map(_event_statement, events)])

    async def append_message(self, turn_id: str, message: dict[str, Any], *,
                             updated_at: float, events: Sequence[Event] = ()) -> None:
        """Add a user message to the stored inbox of a turn, leaving the rest of its
        record as of its last checkpoint (the row is locked while it is changed)."""
        async def append(conn: _Conn) -> None:
            stored = await conn.fetchval("SELECT record FROM turns WHERE id = $1 FOR UPDATE",
                                         turn_id)
            if stored is None:
                return
            record = json.loads(stored)
            inbox = record.get("inbox")
            record["inbox"] = [*(inbox if isinstance(inbox, list) else []), message]
            record["updated_at"] = updated_at
            await conn.execute("UPDATE turns SET updated_at = $1, record = $2 WHERE id = $3",
                               updated_at, _dumps(record), turn_id)

        await self._write([append, *map(_event_statement, events)])

    def append_event(self, event: Event) -> None:
        self._enqueue([_event_statement(event)])

    def reserve_event_seqs(self, upto: int) -> None:
        self._enqueue([(
            "INSERT INTO meta (key, value) VALUES ('event_seq_reserved', $1) ON CONFLICT (key)"
            " DO UPDATE SET value = GREATEST(meta.value, excluded.value)", (upto,))])

    async def journal_intent(self, key: str, *, turn: str, tool: str, arguments: str,
                             idempotent: bool) -> None:
        """An idempotent call may run again after a crash (with the same key), so its
        intent and outcome commit with the next durable write; a non-idempotent call's
        intent is durable before the call is sent."""
        ops: list[_Op] = [(
            "INSERT INTO journal (key, turn, tool, arguments, idempotent)"
            " VALUES ($1, $2, $3, $4, $5) ON CONFLICT (key) DO NOTHING",
            (key, turn, tool, arguments, idempotent))]
        if idempotent:
            if len(self._idempotent_keys) < MAX_PENDING_IDEMPOTENT:
                self._idempotent_keys.add(key)
            self._enqueue(ops)
        else:
            await self._write(ops)

    async def journal_outcome(self, key: str, outcome: dict[str, Any]) -> None:
        ops: list[_Op] = [("UPDATE journal SET outcome = $1 WHERE key = $2",
                           (_dumps(outcome), key))]
        if key in self._idempotent_keys:
            self._idempotent_keys.discard(key)
            self._enqueue(ops)
        else:
            await self._write(ops)

    async def requeue_turn(self, record: dict[str, Any], checkpoint: dict[str, Any], *,
                           messages: MessageRows | None = None,
                           events: Sequence[Event] = ()) -> None:
        await self._write([*_message_statements(record["id"], messages), (
            "UPDATE turns SET state = $1, updated_at = $2, record = $3, checkpoint = $4,"
            " stop_code = $5, replayed_by = NULL WHERE id = $6",
            (record["state"], record["updated_at"], _dumps(record), _dumps(checkpoint),
             _stop_code(record), record["id"])), *map(_event_statement, events)])

    async def mark_replayed(self, turn_id: str, new_turn_id: str) -> None:
        await self._write([("UPDATE turns SET replayed_by = $1 WHERE id = $2",
                            (new_turn_id, turn_id))])

    # -- reading ------------------------------------------------------------------

    def _require_pool(self) -> asyncpg.Pool:
        if self._pool is None:
            raise StoreError("state database is closed: nothing can be read")
        return self._pool

    async def _read(self, read: Callable[[_Conn], Awaitable[_T]]) -> _T:
        """Run `read` on a pooled connection; a connection found dead (the server
        restarted, a backend terminated) is dropped and the read tried once more."""
        pool = self._require_pool()
        for attempt in (1, 2):
            try:
                async with pool.acquire() as conn:
                    try:
                        return await read(conn)
                    except BaseException as exc:
                        if _lost(exc):
                            conn.terminate()
                        raise
            except _DB_ERRORS as exc:
                if attempt == 1 and _lost(exc):
                    continue
                raise StoreError(f"state database read failed: {type(exc).__name__}: "
                                 f"{exc}") from exc
        raise AssertionError("unreachable")

    async def _fetch(self, sql: str, *args: Any) -> list[asyncpg.Record]:
        async def fetch(conn: _Conn) -> list[asyncpg.Record]:
            return await conn.fetch(sql, *args)

        return await self._read(fetch)

    async def max_event_seq(self) -> int:
        rows = await self._fetch(
            "SELECT GREATEST(COALESCE((SELECT max(seq) FROM events), 0),"
            " COALESCE((SELECT value FROM meta WHERE key = 'event_seq_reserved'), 0))")
        return int(rows[0][0])

    async def get_turn(self, turn_id: str) -> dict[str, Any] | None:
        rows = await self._fetch("SELECT record, replayed_by FROM turns WHERE id = $1",
                                 turn_id)
        if not rows:
            return None
        record: dict[str, Any] = json.loads(rows[0][0])
        if rows[0][1]:
            record["replayed_by"] = rows[0][1]
        return record

    async def get_checkpoint(self, turn_id: str) -> dict[str, Any] | None:
        async def read(conn: _Conn) -> tuple[str | None, list[str]]:
            async with conn.transaction(isolation="repeatable_read", readonly=True):
                stored = await conn.fetchval("SELECT checkpoint FROM turns WHERE id = $1",
                                             turn_id)
                count = None if stored is None else _message_count(stored)
                if count is None:
                    return stored, []
                rows = await conn.fetch("SELECT data FROM messages WHERE turn = $1"
                                        " AND idx < $2 ORDER BY idx", turn_id, count)
                return stored, [r[0] for r in rows]

        stored, rows = await self._read(read)
        return None if stored is None else _attach_messages(json.loads(stored), rows)

    async def list_turns(self, *, state: str | None = None, session: str | None = None,
                         limit: int = 100) -> list[dict[str, Any]]:
        where: list[str] = []
        params: list[Any] = []
        if state:
            params.append(state)
            where.append(f"state = ${len(params)}")
        if session:
            params.append(session)
            where.append(f"session = ${len(params)}")
        sql = "SELECT record FROM turns"
        if where:
            sql += " WHERE " + " AND ".join(where)
        params.append(limit)
        sql += f" ORDER BY seq DESC LIMIT ${len(params)}"
        return [json.loads(r[0]) for r in await self._fetch(sql, *params)]

    async def unfinished_turns(self) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        """Every unfinished turn with its checkpoint, in two queries (the turns, then the
        message rows of all of them) read from one snapshot."""
        async def read(conn: _Conn) -> tuple[list[asyncpg.Record], list[asyncpg.Record]]:
            async with conn.transaction(isolation="repeatable_read", readonly=True):
                turns = await conn.fetch(
                    "SELECT id, record, checkpoint FROM turns WHERE state NOT IN"
                    f" {_TERMINAL_SQL} ORDER BY seq")
                rows = await conn.fetch(
                    "SELECT m.turn, m.data FROM messages m JOIN turns t ON t.id = m.turn"
                    f" WHERE t.state NOT IN {_TERMINAL_SQL} ORDER BY m.turn, m.idx")
                return turns, rows

        turns, rows = await self._read(read)
        by_turn: dict[str, list[str]] = {}
        for turn_id, data in rows:
            by_turn.setdefault(turn_id, []).append(data)
        return [(json.loads(record), _attach_messages(json.loads(checkpoint),
                                                      by_turn.get(turn_id, ())))
                for turn_id, record, checkpoint in turns]

    async def session_history(self, session: str, *, before_seq: int) -> list[dict[str, Any]]:
        rows = await self._fetch(
            f"SELECT record FROM turns WHERE session = $1 AND seq < $2 AND state IN"
            f" {_TERMINAL_SQL} ORDER BY seq", session, before_seq)
        return [json.loads(r[0]) for r in rows]

    async def events(self, *, turn: str | None = None, after_seq: int = 0,
                     limit: int = 10_000) -> list[dict[str, Any]]:
        if turn is None:
            rows = await self._fetch("SELECT data FROM events WHERE seq > $1 ORDER BY seq"
                                     " LIMIT $2", after_seq, limit)
        else:
            rows = await self._fetch("SELECT data FROM events WHERE turn = $1 AND seq > $2"
                                     " ORDER BY seq LIMIT $3", turn, after_seq, limit)
        return [json.loads(r[0]) for r in rows]

    async def journal_get(self, key: str) -> dict[str, Any] | None:
        rows = await self._fetch(
            "SELECT tool, arguments, idempotent, outcome FROM journal WHERE key = $1", key)
        if not rows:
            return None
        tool, arguments, idempotent, outcome = rows[0]
        return {"key": key, "tool": tool, "arguments": arguments,
                "idempotent": bool(idempotent),
                "outcome": json.loads(outcome) if outcome else None}

    async def finished_turns(self, *, since: float | None = None,
                             limit: int = 100_000) -> list[dict[str, Any]]:
        rows = await self._fetch(
            f"SELECT record FROM turns WHERE state IN {_TERMINAL_SQL} AND updated_at >= $1"
            " ORDER BY seq DESC LIMIT $2", since if since is not None else 0.0, limit)
        return [json.loads(r[0]) for r in rows]

    async def dead_letters(self) -> list[dict[str, Any]]:
        rows = await self._fetch(
            f"SELECT record, replayed_by FROM turns WHERE stop_code IN {_DEAD_LETTER_SQL}"
            f" ORDER BY seq DESC LIMIT {DEAD_LETTERS_SHOWN}")
        return [dead_letter_entry(json.loads(record_json), replayed_by)
                for record_json, replayed_by in rows]
