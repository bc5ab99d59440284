"""The embedded store: one SQLite file in WAL mode.

One writer task owns the write connection and commits in groups: every write queued
while the previous transaction was committing goes into the next transaction, so
hundreds of concurrent turns share one fsync instead of queueing on it. A caller that
awaits a write resumes only after its transaction committed (synchronous=FULL), so what
was acknowledged is on disk. Reads use a second connection; WAL lets them run beside
the writer. All SQLite calls run in worker threads, never on the event loop.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from turnkeeper.events import Event
from turnkeeper.store.base import StoreError

SCHEMA_VERSION = 1
MAX_BATCH = 1000

# Migrations: index i brings the schema from version i to i + 1.
MIGRATIONS: tuple[tuple[str, ...], ...] = (
    (
        """CREATE TABLE turns (
            id TEXT PRIMARY KEY,
            seq INTEGER NOT NULL UNIQUE,
            session TEXT NOT NULL,
            state TEXT NOT NULL,
            created_at REAL NOT NULL,
            updated_at REAL NOT NULL,
            record TEXT NOT NULL,
            checkpoint TEXT NOT NULL DEFAULT '{}',
            replayed_by TEXT
        )""",
        "CREATE INDEX turns_state ON turns(state, seq)",
        "CREATE INDEX turns_session ON turns(session, seq)",
        """CREATE TABLE events (
            seq INTEGER PRIMARY KEY,
            turn TEXT,
            ts REAL NOT NULL,
            type TEXT NOT NULL,
            data TEXT NOT NULL
        )""",
        "CREATE INDEX events_turn ON events(turn, seq)",
        """CREATE TABLE journal (
            key TEXT PRIMARY KEY,
            turn TEXT NOT NULL,
            tool TEXT NOT NULL,
            arguments TEXT NOT NULL,
            idempotent INTEGER NOT NULL,
            outcome TEXT
        )""",
    ),
)

TERMINAL_STATES = ("completed", "blocked", "partial", "failed", "cancelled")
_TERMINAL_SQL = "(" + ",".join(f"'{s}'" for s in TERMINAL_STATES) + ")"


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


@dataclass(slots=True)
class _Write:
    statements: Sequence[tuple[str, Sequence[Any]]]
    done: anyio.Event | None = None
    error: BaseException | None = field(default=None)


class SQLiteStore:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._writer: sqlite3.Connection | None = None
        self._reader: sqlite3.Connection | None = None
        self._read_lock = anyio.Lock()
        self._send: MemoryObjectSendStream[_Write] | None = None
        self._receive: MemoryObjectReceiveStream[_Write] | None = None
        self._tg: TaskGroup | None = None
        self._writer_done = anyio.Event()
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

    def _open_sync(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o750)
            conn = self._connect()
            conn.execute("PRAGMA journal_mode = WAL")
            conn.execute("PRAGMA synchronous = FULL")
            conn.execute("PRAGMA foreign_keys = ON")
            check = conn.execute("PRAGMA quick_check").fetchone()
            if check is None or check[0] != "ok":
                raise StoreError(f"state database {self.path} is corrupt: {check}")
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise StoreError(
                    f"state database {self.path} has schema version {version}, newer than "
                    f"this turnkeeper understands ({SCHEMA_VERSION}); refusing to touch it")
            for v in range(version, SCHEMA_VERSION):
                conn.execute("BEGIN IMMEDIATE")
                for stmt in MIGRATIONS[v]:
                    conn.execute(stmt)
                conn.execute(f"PRAGMA user_version = {v + 1}")
                conn.execute("COMMIT")
            row = conn.execute("SELECT COALESCE(MAX(seq), 0) FROM turns").fetchone()
            self._next_seq = int(row[0])
            self._writer = conn
            self._reader = self._connect()
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"state database {self.path} cannot be opened: {exc}") from None
        except OSError as exc:
            raise StoreError(f"state directory {self.path.parent} is not usable: "
                             f"{exc.strerror}") from None

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
                  ) -> None:
        """The writer task. Runs until `close()`; flushes everything queued before it ends."""
        send, receive = anyio.create_memory_object_stream[_Write](float("inf"))
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
        error: BaseException | None = None
        try:
            await anyio.to_thread.run_sync(self._commit_sync, batch)
            self.commits += 1
        except Exception as exc:  # reported to every waiter of the batch
            error = exc
        for w in batch:
            w.error = error
            if w.done is not None:
                w.done.set()

    def _commit_sync(self, batch: list[_Write]) -> None:
        conn = self._writer
        assert conn is not None, "store is not open"
        conn.execute("BEGIN IMMEDIATE")
        try:
            for w in batch:
                for sql, params in w.statements:
                    conn.execute(sql, params)
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise

    async def close(self) -> None:
        if self._send is not None:
            self._send.close()
            await self._writer_done.wait()
        for conn in (self._writer, self._reader):
            if conn is not None:
                await anyio.to_thread.run_sync(conn.close)
        self._writer = self._reader = None

    # -- writing ------------------------------------------------------------------

    async def _write(self, statements: Sequence[tuple[str, Sequence[Any]]]) -> None:
        if self._send is None:
            raise StoreError("store writer is not running")
        w = _Write(statements, anyio.Event())
        self._send.send_nowait(w)
        assert w.done is not None
        await w.done.wait()
        if w.error is not None:
            raise StoreError(f"state database write failed: {w.error}") from w.error

    def _enqueue(self, statements: Sequence[tuple[str, Sequence[Any]]]) -> None:
        if self._send is not None:
            with contextlib.suppress(anyio.ClosedResourceError):
                self._send.send_nowait(_Write(statements))

    async def flush(self) -> None:
        await self._write(())

    async def insert_turn(self, record: dict[str, Any], checkpoint: dict[str, Any]) -> int:
        self._next_seq += 1
        record["seq"] = self._next_seq
        await self._write([(
            "INSERT INTO turns (id, seq, session, state, created_at, updated_at, record,"
            " checkpoint) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (record["id"], record["seq"], record["session"], record["state"],
             record["created_at"], record["updated_at"], _dumps(record), _dumps(checkpoint)),
        )])
        return int(record["seq"])

    async def save_turn(self, record: dict[str, Any],
                        checkpoint: dict[str, Any] | None = None) -> None:
        stmt: tuple[str, tuple[Any, ...]]
        if checkpoint is None:
            stmt = ("UPDATE turns SET state = ?, updated_at = ?, record = ? WHERE id = ?",
                    (record["state"], record["updated_at"], _dumps(record), record["id"]))
        else:
            stmt = ("UPDATE turns SET state = ?, updated_at = ?, record = ?, checkpoint = ?"
                    " WHERE id = ?", (record["state"], record["updated_at"], _dumps(record),
                                       _dumps(checkpoint), record["id"]))
        await self._write([stmt])

    def append_event(self, event: Event) -> None:
        self._enqueue([(
            "INSERT OR IGNORE INTO events (seq, turn, ts, type, data) VALUES (?, ?, ?, ?, ?)",
            (event.seq, event.turn, event.ts, event.type, _dumps(event.to_json())),
        )])

    async def journal_intent(self, key: str, *, turn: str, tool: str, arguments: str,
                             idempotent: bool) -> None:
        await self._write([(
            "INSERT OR IGNORE INTO journal (key, turn, tool, arguments, idempotent)"
            " VALUES (?, ?, ?, ?, ?)", (key, turn, tool, arguments, int(idempotent)))])

    async def journal_outcome(self, key: str, outcome: dict[str, Any]) -> None:
        await self._write([("UPDATE journal SET outcome = ? WHERE key = ?",
                            (_dumps(outcome), key))])

    async def mark_replayed(self, turn_id: str, new_turn_id: str) -> None:
        await self._write([("UPDATE turns SET replayed_by = ? WHERE id = ?",
                            (new_turn_id, turn_id))])

    # -- reading ------------------------------------------------------------------

    async def _read(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        def run() -> list[tuple[Any, ...]]:
            assert self._reader is not None, "store is not open"
            return self._reader.execute(sql, params).fetchall()

        async with self._read_lock:
            try:
                return await anyio.to_thread.run_sync(run)
            except sqlite3.DatabaseError as exc:
                raise StoreError(f"state database read failed: {exc}") from exc

    async def max_event_seq(self) -> int:
        rows = await self._read("SELECT COALESCE(MAX(seq), 0) FROM events")
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
        rows = await self._read("SELECT checkpoint FROM turns WHERE id = ?", (turn_id,))
        return json.loads(rows[0][0]) if rows else None

    async def list_turns(self, *, state: str | None = None, session: str | None = None,
                         limit: int = 100) -> list[dict[str, Any]]:
        where, params = [], []
        if state:
            where.append("state = ?")
            params.append(state)
        if session:
            where.append("session = ?")
            params.append(session)
        sql = "SELECT record FROM turns"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY seq DESC LIMIT ?"
        rows = await self._read(sql, (*params, limit))
        return [json.loads(r[0]) for r in rows]

    async def unfinished_turns(self) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        rows = await self._read(
            f"SELECT record, checkpoint FROM turns WHERE state NOT IN {_TERMINAL_SQL}"
            " ORDER BY seq")
        return [(json.loads(r[0]), json.loads(r[1])) for r in rows]

    async def session_history(self, session: str, *, before_seq: int) -> list[dict[str, Any]]:
        rows = await self._read(
            f"SELECT record FROM turns WHERE session = ? AND seq < ? AND state IN"
            f" {_TERMINAL_SQL} ORDER BY seq", (session, before_seq))
        return [json.loads(r[0]) for r in rows]

    async def events(self, *, turn: str | None = None, after_seq: int = 0,
                     limit: int = 10_000) -> list[dict[str, Any]]:
        if turn is None:
            rows = await self._read("SELECT data FROM events WHERE seq > ? ORDER BY seq"
                                    " LIMIT ?", (after_seq, limit))
        else:
            rows = await self._read("SELECT data FROM events WHERE turn = ? AND seq > ?"
                                    " ORDER BY seq LIMIT ?", (turn, after_seq, limit))
        return [json.loads(r[0]) for r in rows]

    async def journal_get(self, key: str) -> dict[str, Any] | None:
        rows = await self._read(
            "SELECT tool, arguments, idempotent, outcome FROM journal WHERE key = ?", (key,))
        if not rows:
            return None
        tool, arguments, idempotent, outcome = rows[0]
        return {"key": key, "tool": tool, "arguments": arguments,
                "idempotent": bool(idempotent),
                "outcome": json.loads(outcome) if outcome else None}

    async def dead_letters(self) -> list[dict[str, Any]]:
        rows = await self._read(
            "SELECT record, replayed_by FROM turns WHERE state = 'failed' OR"
            " json_extract(record, '$.result.stopped_because.code') = 'providers.exhausted'"
            " ORDER BY seq DESC LIMIT 1000")
        out = []
        for record_json, replayed_by in rows:
            record = json.loads(record_json)
            result = record.get("result") or {}
            out.append({"id": record["id"], "turn": record["id"],
                        "session": record["session"], "message": record["message"],
                        "budget": record.get("budget"), "deadline": record.get("deadline"),
                        "stopped_because": result.get("stopped_because"),
                        "last_error": record.get("last_error"),
                        "finished_at": record["updated_at"], "replayed_by": replayed_by})
        return out
