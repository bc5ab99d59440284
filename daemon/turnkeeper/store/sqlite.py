"""The embedded store: one SQLite file in WAL mode.

One writer task owns the write connection and commits in groups: every write queued
while the previous transaction was committing goes into the next transaction, so
hundreds of concurrent turns share one fsync instead of queueing on it. A caller that
awaits a write resumes only after its transaction committed (synchronous=FULL), so what
was acknowledged is on disk. Reads use a second connection; WAL lets them run beside
the writer. All SQLite calls run in worker threads, never on the event loop.

A step's writes are appended: the conversation is a table of message rows, one per
message, inserted once (a compaction deletes the rows from the first one it changed and
inserts their replacements); the turn's row holds the record and a checkpoint of
counters and positions, a few hundred bytes whatever the conversation's length. Reads
put the messages back into the checkpoint inside one read transaction, so a checkpoint
and its rows always come from the same commit.

Under a crash (kill -9, power loss) the database holds exactly the transactions that
committed: a write whose await returned, and every event enqueued before it. Events
that must never be kept without their state (`turn.queued`, `turn.finished`,
`turn.message`) are written in the same transaction as the turn's row. A transaction
that fails takes none of its neighbours down with it: the batch is retried write by
write and only the write that fails reports the error. A write that fails for the
store's own reason (a full disk, an I/O error, a lock held elsewhere) is not reported at
all: it is retried with backoff, in order, until it goes through, and the store reports
the outage (`outage`) so the daemon can say it is degraded (`policy/store_outage.py`).
One daemon at a time: an exclusive lock on the database file refuses a second one (exit
69, like a socket another daemon listens on), which would otherwise resume the same
turns and repeat their side effects. A database that cannot be read, fails its integrity check or
comes from a newer schema stops start-up (StoreError, exit 74); it is never replaced by
a new, empty one.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import sqlite3
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import anyio
import structlog
from anyio.abc import TaskGroup

from turnkeeper import jsonwire
from turnkeeper.clock import Clock, SystemClock
from turnkeeper.events import Event
from turnkeeper.policy.limits import TurnUsage
from turnkeeper.policy.store_outage import DEFAULT_FATAL_AFTER_S, StoreOutage
from turnkeeper.store.base import (
    DEAD_LETTER_SQL,
    TERMINAL_SQL,
    MessageRows,
    StoreError,
    StoreUnavailable,
    dead_letter_entry,
    list_turns_sql,
    usage_of,
    with_messages,
)
from turnkeeper.store.sqlite_lock import lock_exclusive
from turnkeeper.store.sqlite_schema import MIGRATIONS as MIGRATIONS
from turnkeeper.store.sqlite_schema import SCHEMA_VERSION as SCHEMA_VERSION
from turnkeeper.store.sqlite_schema import prepare
from turnkeeper.store.writer import GroupCommitWriter, Write

log = structlog.get_logger("turnkeeper.store")

# SQLite's primary result codes that are the store's failure, not the write's: busy or
# locked past the timeout, out of memory, read-only, I/O error, full, cannot open,
# locking protocol. A constraint or a malformed statement is the write's own.
_UNAVAILABLE_CODES = frozenset({5, 6, 7, 8, 10, 13, 14, 15})
# While the store is failing, one log line at most this often (and one when it recovers).
OUTAGE_LOG_EVERY_S = 10.0
DEAD_LETTERS_SHOWN = 1000


def _dumps(value: Any) -> str:
    return jsonwire.dumps_str(value)


_Statement = tuple[str, Sequence[Any]]
_T = TypeVar("_T")


def store_unavailable(exc: BaseException) -> bool:
    """True when `exc` is the store failing (retry the write later), not the write."""
    if isinstance(exc, sqlite3.Error):
        code = getattr(exc, "sqlite_errorcode", None)
        if code is None:
            return isinstance(exc, sqlite3.OperationalError)
        return (int(code) & 0xFF) in _UNAVAILABLE_CODES
    return isinstance(exc, OSError)


def _event_statement(event: Event) -> _Statement:
    return ("INSERT OR IGNORE INTO events (seq, turn, ts, type, data) VALUES (?, ?, ?, ?, ?)",
            (event.seq, event.turn, event.ts, event.type, event.encoded()))


# Rows per INSERT statement (3 parameters each, far below SQLite's limit of 32,766).
_ROWS_PER_INSERT = 500


def _message_statements(turn_id: str, messages: MessageRows | None) -> list[_Statement]:
    """Replace the turn's message rows from `messages.start` on; none for a turn with no
    row (as the UPDATE of its record, which matches nothing)."""
    if messages is None:
        return []
    out: list[_Statement] = [("DELETE FROM messages WHERE turn = ? AND idx >= ?",
                              (turn_id, messages.start))]
    rows = messages.rows
    for first in range(0, len(rows), _ROWS_PER_INSERT):
        chunk = rows[first:first + _ROWS_PER_INSERT]
        params: list[Any] = []
        for n, text in enumerate(chunk, messages.start + first):
            params += (n, text)
        params.append(turn_id)
        out.append((
            "INSERT INTO messages (turn, idx, data) SELECT t.id, v.column1, v.column2"
            " FROM (VALUES " + ",".join(["(?,?)"] * len(chunk)) + ") AS v"
            " JOIN turns AS t ON t.id = ?", params))
    return out


def _execute_run(conn: sqlite3.Connection, sql: str, rows: list[Sequence[Any]]) -> None:
    if len(rows) == 1:
        conn.execute(sql, rows[0])
    elif rows:
        conn.executemany(sql, rows)


def _together(conn: sqlite3.Connection, queries: Sequence[_Statement]
              ) -> list[list[tuple[Any, ...]]]:
    """Several queries in one read transaction: they see the same commit (a checkpoint
    and its message rows)."""
    conn.execute("BEGIN")
    try:
        return [conn.execute(sql, params).fetchall() for sql, params in queries]
    finally:
        conn.execute("COMMIT")


def _attach(checkpoint_json: str, rows: list[str]) -> dict[str, Any]:
    return with_messages(json.loads(checkpoint_json), rows)


class SQLiteStore(GroupCommitWriter[_Statement]):
    def __init__(self, path: Path, *, clock: Clock | None = None,
                 fatal_after_s: float = DEFAULT_FATAL_AFTER_S) -> None:
        super().__init__()
        self.path = path
        self._clock: Clock = clock or SystemClock()
        self.outage = StoreOutage(fatal_after_s=fatal_after_s)
        self._outage_logged_at: float | None = None
        self._writer: sqlite3.Connection | None = None
        self._reader: sqlite3.Connection | None = None
        self._read_lock = anyio.Lock()
        self._tg: TaskGroup | None = None
        self._lock_fds: tuple[int, ...] = ()
        self._next_seq = 0
        self.commits = 0

    def __repr__(self) -> str:
        return f"SQLiteStore({str(self.path)!r})"

    # -- lifecycle ----------------------------------------------------------------

    async def open(self) -> None:
        await anyio.to_thread.run_sync(self._open_sync)

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None,
                               timeout=30.0)
        conn.execute("PRAGMA busy_timeout = 30000")
        return conn

    @property
    def lock_path(self) -> Path:
        return self.path.with_name(self.path.name + ".lock")

    def _lock_sync(self) -> None:
        self._lock_fds = lock_exclusive(self.lock_path, self.path)

    def _open_sync(self) -> None:
        conn: sqlite3.Connection | None = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o750)
            self._lock_sync()
            conn = self._connect()
            prepare(conn, self.path)
            row = conn.execute("SELECT COALESCE(MAX(seq), 0) FROM turns").fetchone()
            self._next_seq = int(row[0])
            self._writer = conn
            self._reader = self._connect()
        except BaseException as exc:
            if conn is not None:
                conn.close()
            self._unlock_sync()
            if isinstance(exc, sqlite3.DatabaseError):
                raise StoreError(f"state database {self.path} cannot be opened: {exc} "
                                 "(not a turnkeeper database, or damaged; restore it from "
                                 "a backup or move it aside)") from None
            if isinstance(exc, OSError):
                raise StoreError(f"state directory {self.path.parent} is not usable: "
                                 f"{exc.strerror or exc}") from None
            raise

    def _unlock_sync(self) -> None:
        for fd in self._lock_fds:
            os.close(fd)  # closing the descriptor releases the flock
        self._lock_fds = ()

    async def _commit(self, batch: list[Write[_Statement]]) -> None:
        """Commit `batch` in order. The writes the store itself cannot take (see
        `store_unavailable`) wait and are tried again, from the first of them on, until
        they go through, the outage turns fatal, or the store closes."""
        pending = batch
        while pending:
            try:
                errors = await anyio.to_thread.run_sync(self._commit_sync, pending)
            except Exception as exc:  # the thread itself failed
                errors = [exc] * len(pending)
            cut = next((i for i, e in enumerate(errors)
                        if e is not None and store_unavailable(e)), len(pending))
            self._answer(pending[:cut], errors[:cut])
            if cut == len(pending):
                if self.outage.recovered():
                    log.warning("store.recovered", path=str(self.path))
                    self._outage_logged_at = None
                return
            pending, error = pending[cut:], errors[cut]
            now = self._clock.monotonic()
            if self.outage.fatal(now=now) or self._closed:
                why = ("unwritable for "
                       f"{self.outage.failing_for(now=now):.0f} s" if not self._closed
                       else "closing while unwritable")
                self._answer(pending, [StoreUnavailable(
                    f"state database {why}: {error}")] * len(pending))
                return
            delay = self.outage.failed(f"{type(error).__name__}: {error}", now=now,
                                       rand=random.uniform)
            if self._outage_logged_at is None or \
                    now - self._outage_logged_at >= OUTAGE_LOG_EVERY_S:
                self._outage_logged_at = now
                log.error("store.unwritable", path=str(self.path), error=str(error),
                          waiting_writes=len(pending),
                          failing_for_s=round(self.outage.failing_for(now=now), 3),
                          fatal_after_s=self.outage.fatal_after_s)
            await self._clock.sleep(delay)

    def _commit_sync(self, batch: list[Write[_Statement]]) -> list[BaseException | None]:
        """One transaction for the batch. If it fails, each write gets its own, so one
        bad write fails alone, never its neighbours. A write the store itself cannot take
        ends the pass: it and the writes after it are left to retry in order (the events
        that reach the disk stay a prefix of those published)."""
        conn = self._writer
        assert conn is not None, "store is not open"
        try:
            self._transaction(conn, [s for w in batch for s in w.ops])
            self.commits += 1
            return [None] * len(batch)
        except Exception as exc:
            if len(batch) == 1 or store_unavailable(exc):
                return [exc] * len(batch)
        errors: list[BaseException | None] = []
        for w in batch:
            try:
                self._transaction(conn, w.ops)
                self.commits += 1
                errors.append(None)
            except Exception as exc:
                if store_unavailable(exc):
                    return errors + [exc] * (len(batch) - len(errors))
                errors.append(exc)
        return errors

    @staticmethod
    def _transaction(conn: sqlite3.Connection, statements: Iterable[_Statement]) -> None:
        conn.execute("BEGIN IMMEDIATE")
        try:
            # A run of the same statement (event rows queued back to back) goes as one
            # executemany: the statement is looked up once for the run.
            run: list[Sequence[Any]] = []
            run_sql = ""
            for sql, params in statements:
                if sql != run_sql:
                    _execute_run(conn, run_sql, run)
                    run, run_sql = [], sql
                run.append(params)
            _execute_run(conn, run_sql, run)
            conn.execute("COMMIT")
        except BaseException:
            # SQLite may have rolled back by itself (a full disk, an I/O error): a second
            # ROLLBACK would raise and hide the error that matters.
            if conn.in_transaction:
                with contextlib.suppress(sqlite3.Error):
                    conn.execute("ROLLBACK")
            raise

    async def close(self) -> None:
        await self._stop_writer()
        for conn in (self._writer, self._reader):
            if conn is not None:
                await anyio.to_thread.run_sync(conn.close)
        self._writer = self._reader = None
        self._unlock_sync()

    # -- writing ------------------------------------------------------------------

    async def insert_turn(self, record: dict[str, Any], checkpoint: dict[str, Any], *,
                          events: Sequence[Event] = ()) -> int:
        """The turn's row, durable when this returns; `events` commit with it."""
        self._next_seq += 1
        record["seq"] = self._next_seq
        await self._write([(
            "INSERT INTO turns (id, seq, session, state, created_at, updated_at, record,"
            " checkpoint) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (record["id"], record["seq"], record["session"], record["state"],
             record["created_at"], record["updated_at"], _dumps(record), _dumps(checkpoint)),
        ), *map(_event_statement, events)])
        return int(record["seq"])

    async def save_turn(self, record: dict[str, Any],
                        checkpoint: dict[str, Any] | None = None, *,
                        messages: MessageRows | None = None,
                        events: Sequence[Event] = ()) -> None:
        """The record (and the checkpoint and message rows, when given) in one
        transaction with `events`. The record and the checkpoint of a turn must describe
        the same moment: a write of the record alone is for a turn that ends (its
        checkpoint is no longer read)."""
        stmt: _Statement
        if checkpoint is None:
            stmt = ("UPDATE turns SET state = ?, updated_at = ?, record = ? WHERE id = ?",
                    (record["state"], record["updated_at"], _dumps(record), record["id"]))
        else:
            stmt = ("UPDATE turns SET state = ?, updated_at = ?, record = ?, checkpoint = ?"
                    " WHERE id = ?", (record["state"], record["updated_at"], _dumps(record),
                                       _dumps(checkpoint), record["id"]))
        await self._write([stmt, *_message_statements(record["id"], messages),
                           *map(_event_statement, events)],
                          supersedes=None if checkpoint is None else record["id"])

    def queue_turn(self, record: dict[str, Any], checkpoint: dict[str, Any], *,
                   messages: MessageRows | None = None) -> bool:
        """`save_turn` of a record and checkpoint, queued and not awaited: it commits
        with the next durable write, before any later write of the turn; a newer
        checkpoint of the turn arriving before it is taken for a commit drops it (its
        message rows go with the newer one). False when the store takes no more writes
        (nothing was queued: the caller awaits `save_turn` instead). See `QueuesTurns`
        in the store interface for when a caller may leave a checkpoint unawaited."""
        return self._enqueue_turn(record["id"], [(
            "UPDATE turns SET state = ?, updated_at = ?, record = ?, checkpoint = ?"
            " WHERE id = ?", (record["state"], record["updated_at"], _dumps(record),
                              _dumps(checkpoint), record["id"])),
            *_message_statements(record["id"], messages)])

    async def append_message(self, turn_id: str, message: dict[str, Any], *,
                             updated_at: float, events: Sequence[Event] = ()) -> None:
        """Add a user message (steer, answer) to the stored inbox of a turn, leaving the
        rest of its record as of its last checkpoint. Writing the live record instead
        would store an inbox from which the runner already took messages that its last
        checkpoint does not hold yet: a crash then would lose them."""
        await self._write([(
            "UPDATE turns SET updated_at = ?, record = json_set(record, '$.inbox',"
            " json(json_insert(COALESCE(json_extract(record, '$.inbox'), json('[]')),"
            " '$[#]', json(?))), '$.updated_at', ?) WHERE id = ?",
            (updated_at, _dumps(message), updated_at, turn_id)),
            *map(_event_statement, events)])

    def append_event(self, event: Event) -> None:
        self._enqueue_event(_event_statement(event))

    def reserve_event_seqs(self, upto: int) -> None:
        self._enqueue([(
            "INSERT INTO meta (key, value) VALUES ('event_seq_reserved', ?) ON CONFLICT(key)"
            " DO UPDATE SET value = MAX(value, excluded.value)", (upto,))])

    async def journal_intent(self, key: str, *, turn: str, tool: str, arguments: str,
                             idempotent: bool) -> None:
        """Queued or awaited as `_journal_intent` says."""
        statements: list[_Statement] = [(
            "INSERT OR IGNORE INTO journal (key, turn, tool, arguments, idempotent)"
            " VALUES (?, ?, ?, ?, ?)", (key, turn, tool, arguments, int(idempotent)))]
        await self._journal_intent(key, statements, idempotent=idempotent)

    async def journal_outcome(self, key: str, outcome: dict[str, Any]) -> None:
        statements: list[_Statement] = [("UPDATE journal SET outcome = ? WHERE key = ?",
                                         (_dumps(outcome), key))]
        await self._journal_outcome(key, statements)

    async def requeue_turn(self, record: dict[str, Any], checkpoint: dict[str, Any], *,
                           messages: MessageRows | None = None,
                           events: Sequence[Event] = ()) -> None:
        await self._write([(
            "UPDATE turns SET state = ?, updated_at = ?, record = ?, checkpoint = ?,"
            " replayed_by = NULL WHERE id = ?",
            (record["state"], record["updated_at"], _dumps(record), _dumps(checkpoint),
             record["id"])), *_message_statements(record["id"], messages),
            *map(_event_statement, events)])

    async def mark_replayed(self, turn_id: str, new_turn_id: str) -> None:
        await self._write([("UPDATE turns SET replayed_by = ? WHERE id = ?",
                            (new_turn_id, turn_id))])

    async def prune(self, *, finished_before: float, dead_letters: bool = False,
                    limit: int) -> int:
        keep_dead = "" if dead_letters else (
            " AND COALESCE(json_extract(record, '$.result.stopped_because.code'), '')"
            f" NOT IN {DEAD_LETTER_SQL}")
        rows = await self._read(
            f"SELECT id FROM turns WHERE state IN {TERMINAL_SQL} AND updated_at < ?"
            f"{keep_dead} ORDER BY seq LIMIT ?", (finished_before, limit))
        ids = [r[0] for r in rows]
        # Checked again inside the transaction: a dead letter replayed since the read is
        # queued again, and keeps everything.
        marks = ",".join("?" * len(ids))
        due = f"SELECT id FROM turns WHERE id IN ({marks}) AND state IN {TERMINAL_SQL}"
        statements: list[_Statement] = [
            (f"DELETE FROM events WHERE turn IN ({due})", ids),
            (f"DELETE FROM journal WHERE turn IN ({due})", ids),
            (f"DELETE FROM messages WHERE turn IN ({due})", ids),
            (f"DELETE FROM turns WHERE id IN ({due})", ids),
        ] if ids else []
        statements.append(("DELETE FROM events WHERE turn IS NULL AND ts < ?",
                           (finished_before,)))
        await self._write(statements)
        return len(ids)

    # -- reading ------------------------------------------------------------------

    async def _in_reader(self, work: Callable[[sqlite3.Connection], _T]) -> _T:
        """`work(reader)` in a worker thread, one read at a time. A row that is not the
        JSON this store wrote (a damaged database that passed its quick check) is a
        StoreError naming it, never a traceback."""
        def run() -> _T:
            assert self._reader is not None, "store is not open"
            return work(self._reader)

        async with self._read_lock:
            try:
                return await anyio.to_thread.run_sync(run)
            except sqlite3.DatabaseError as exc:
                raise StoreError(f"state database read failed: {exc}") from exc
            except ValueError as exc:  # json.JSONDecodeError
                raise StoreError(f"state database {self.path} holds a damaged row ({exc}); "
                                 "restore it from a backup") from exc

    async def _read(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        return await self._in_reader(lambda c: c.execute(sql, params).fetchall())

    async def _read_json(self, sql: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]:
        """The first column of each row, decoded in the worker thread: 10,000 records
        decoded on the event loop held every turn up for half a second."""
        return await self._in_reader(
            lambda c: [json.loads(r[0]) for r in c.execute(sql, params)])

    async def max_event_seq(self) -> int:
        rows = await self._read(
            "SELECT MAX(COALESCE((SELECT MAX(seq) FROM events), 0),"
            " COALESCE((SELECT value FROM meta WHERE key = 'event_seq_reserved'), 0))")
        return int(rows[0][0])

    async def get_turn(self, turn_id: str) -> dict[str, Any] | None:
        rows = await self._read("SELECT record, replayed_by FROM turns WHERE id = ?",
                                (turn_id,))
        if not rows:
            return None
        record: dict[str, Any] = json.loads(rows[0][0])
        if rows[0][1]:
            record["replayed_by"] = rows[0][1]
        return record

    async def get_checkpoint(self, turn_id: str) -> dict[str, Any] | None:
        def read(c: sqlite3.Connection) -> dict[str, Any] | None:
            turns, messages = _together(c, [
                ("SELECT checkpoint FROM turns WHERE id = ?", (turn_id,)),
                ("SELECT data FROM messages WHERE turn = ? ORDER BY idx", (turn_id,))])
            return _attach(turns[0][0], [r[0] for r in messages]) if turns else None

        return await self._in_reader(read)

    async def list_turns(self, *, state: str | None = None, session: str | None = None,
                         limit: int = 100, since: float | None = None,
                         before_seq: int | None = None) -> list[dict[str, Any]]:
        sql, params = list_turns_sql(state=state, session=session, since=since,
                                     before_seq=before_seq, placeholder=lambda n: "?")
        return await self._read_json(sql, (*params, limit))

    async def unfinished_turns(self) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        def read(c: sqlite3.Connection) -> list[tuple[dict[str, Any], dict[str, Any]]]:
            turns, messages = _together(c, [
                (f"SELECT id, record, checkpoint FROM turns WHERE state NOT IN"
                 f" {TERMINAL_SQL} ORDER BY seq", ()),
                ("SELECT m.turn, m.data FROM turns AS t JOIN messages AS m ON m.turn = t.id"
                 f" WHERE t.state NOT IN {TERMINAL_SQL} ORDER BY t.seq, m.idx", ())])
            rows: dict[str, list[str]] = {}
            for turn_id, data in messages:
                rows.setdefault(turn_id, []).append(data)
            return [(json.loads(record), _attach(checkpoint, rows.get(turn_id, [])))
                    for turn_id, record, checkpoint in turns]

        return await self._in_reader(read)

    async def session_history(self, session: str, *, before_seq: int) -> list[dict[str, Any]]:
        return await self._read_json(
            f"SELECT record FROM turns WHERE session = ? AND seq < ? AND state IN"
            f" {TERMINAL_SQL} ORDER BY seq", (session, before_seq))

    async def events(self, *, turn: str | None = None, after_seq: int = 0,
                     limit: int = 10_000) -> list[dict[str, Any]]:
        if turn is None:
            return await self._read_json("SELECT data FROM events WHERE seq > ? ORDER BY"
                                         " seq LIMIT ?", (after_seq, limit))
        return await self._read_json("SELECT data FROM events WHERE turn = ? AND seq > ?"
                                     " ORDER BY seq LIMIT ?", (turn, after_seq, limit))

    async def journal_get(self, key: str) -> dict[str, Any] | None:
        rows = await self._read(
            "SELECT tool, arguments, idempotent, outcome FROM journal WHERE key = ?", (key,))
        if not rows:
            return None
        tool, arguments, idempotent, outcome = rows[0]
        return {"key": key, "tool": tool, "arguments": arguments,
                "idempotent": bool(idempotent),
                "outcome": json.loads(outcome) if outcome else None}

    async def finished_usage(self, *, since: float | None = None,
                             limit: int = 100_000) -> list[TurnUsage]:
        sql = ("SELECT COALESCE(json_extract(record, '$.profile'), 'default'), state,"
               " json_extract(record, '$.result.stopped_because.code'),"
               " json_extract(record, '$.usage.total_tokens'),"
               " json_extract(record, '$.usage.seconds'),"
               " json_extract(record, '$.counters.steps'),"
               " json_extract(record, '$.usage.cost_usd'),"
               " json_extract(record, '$.would_have_stopped'),"
               " json_extract(record, '$.result.extensions')"
               f" FROM turns WHERE state IN {TERMINAL_SQL} AND updated_at >= ?"
               " AND json_extract(record, '$.result') IS NOT NULL ORDER BY seq DESC LIMIT ?")
        return await self._in_reader(lambda c: [
            usage_of(profile, state, code, tokens, seconds, steps, cost,
                     json.loads(would) if would not in (None, "[]") else (), extensions)
            for profile, state, code, tokens, seconds, steps, cost, would, extensions
            in c.execute(sql, (since if since is not None else 0.0, limit))])

    async def dead_letters(self) -> list[dict[str, Any]]:
        return await self._in_reader(lambda c: [
            dead_letter_entry(json.loads(record_json), replayed_by)
            for record_json, replayed_by in c.execute(
                "SELECT record, replayed_by FROM turns WHERE json_extract(record,"
                f" '$.result.stopped_because.code') IN {DEAD_LETTER_SQL}"
                f" ORDER BY seq DESC LIMIT {DEAD_LETTERS_SHOWN}")])
