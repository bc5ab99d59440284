"""The embedded store: one SQLite file in WAL mode.

One writer task owns the write connection and commits in groups: every write queued
while the previous transaction was committing goes into the next transaction, so
hundreds of concurrent turns share one fsync instead of queueing on it. A caller that
awaits a write resumes only after its transaction committed (synchronous=FULL), so what
was acknowledged is on disk. Reads use a second connection; WAL lets them run beside
the writer, and those that come while one runs go together in one hop to its thread.
All SQLite calls run in worker threads, never on the event loop.

A step's writes are appended: the conversation is a table of message rows, one per
message, inserted once (a compaction deletes the rows from the first one it changed and
inserts their replacements), and the trail a table of rows of a few kilobytes of
partial-work lines, loop guard keys and side effects' outcomes; the turn's row holds the
record and a checkpoint of counters and positions, a few kilobytes at most whatever the
turn's length.
Reads put the rows back into the checkpoint inside one read transaction, so a checkpoint
and its rows always come from the same commit.

`SQLiteStore` is the store's calls; it has its parts, each in its module: the connection
(`sqlite_conn.py`: the file, its lock, the writer and reader connections), the writer
(`sqlite_writer.py`: the group commit and its retries while the store cannot be written:
a crash, a full disk, a second daemon), the reader (`sqlite_reader.py`: reads batched
into hops to its thread) and the webhook outbox (`sqlite_outbox.py`). The SQL it sends
is built in `sqlite_statements.py`.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio

from turnkeeper import jsonwire
from turnkeeper.clock import Clock, SystemClock
from turnkeeper.events import Event
from turnkeeper.policy.idempotency import IdempotencyKey, StoredKey
from turnkeeper.policy.limits import FinishedTurn
from turnkeeper.policy.store_outage import DEFAULT_FATAL_AFTER_S
from turnkeeper.policy.turn_state import TERMINAL_STATES
from turnkeeper.store.base import (
    DEAD_LETTER_SQL,
    TERMINAL_SQL,
    KeyTaken,
    MessageRows,
    StoreError,
    journal_entry,
    list_turns_sql,
    stored_message,
    stored_record,
)
from turnkeeper.store.outbox import OutboxFront
from turnkeeper.store.sqlite_conn import SQLiteConnection
from turnkeeper.store.sqlite_outbox import SQLiteOutbox
from turnkeeper.store.sqlite_queries import (
    read_checkpoint,
    read_dead_letters,
    read_turn,
    read_unfinished,
    read_usage,
)
from turnkeeper.store.sqlite_reader import SQLiteReader
from turnkeeper.store.sqlite_schema import SCHEMA_VERSION as SCHEMA_VERSION
from turnkeeper.store.sqlite_statements import EVENTS_OF_TURN as EVENTS_OF_TURN
from turnkeeper.store.sqlite_statements import (
    WITH_MESSAGE,
    Statement,
    event_statement,
    key_rows,
    turn_statement,
)
from turnkeeper.store.sqlite_statements import prune_statements as prune_statements
from turnkeeper.store.sqlite_writer import SQLiteWriter
from turnkeeper.store.writer import message_write


def _dumps(value: Any) -> str:
    return jsonwire.dumps_str(value)


class SQLiteStore(OutboxFront):
    """The `Store` (and `Outbox`) on one SQLite file, made of its parts: `connection`,
    `writer`, `reader` and `outbox`."""

    outbox: SQLiteOutbox

    def __init__(self, path: Path, *, clock: Clock | None = None,
                 fatal_after_s: float = DEFAULT_FATAL_AFTER_S) -> None:
        self.path = path
        self.connection = SQLiteConnection(path)
        self.writer = SQLiteWriter(self.connection, clock or SystemClock(),
                                   fatal_after_s=fatal_after_s)
        self.reader = SQLiteReader(self.connection)
        self.outbox = SQLiteOutbox(self.reader, self.writer)
        self.outage = self.writer.outage
        self._next_seq = 0
        # Turn id -> its number (`turns.seq`), for the turns not finished whose row this
        # store inserted or read back: their event, message and trail rows are keyed by it.
        self._numbers: dict[str, int] = {}

    def __repr__(self) -> str:
        return f"SQLiteStore({str(self.path)!r})"

    # -- lifecycle ----------------------------------------------------------------

    async def open(self) -> None:
        await self.connection.open()
        self._next_seq = self.connection.last_turn_no

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
                  ) -> None:
        """The writer task: runs until the store closes, committing everything queued
        before it ends."""
        await self.writer.run(task_status=task_status)

    async def close(self) -> None:
        await self.writer.stop()
        await self.connection.close()

    async def flush(self) -> None:
        """Until everything enqueued so far is durable."""
        await self.writer.flush()

    # The writer's counts.
    @property
    def commits(self) -> int:
        return self.writer.commits

    @property
    def commit_cpu_s(self) -> float:
        return self.writer.commit_cpu_s

    @property
    def durable_writes(self) -> int:
        return self.writer.durable_writes

    @property
    def failed_writes(self) -> int:
        return self.writer.failed_writes

    @property
    def superseded(self) -> int:
        return self.writer.superseded

    # -- writing ------------------------------------------------------------------

    def _number(self, record: dict[str, Any]) -> int | None:
        """The number of the turn `record` saves, known while the turn is live (inserted
        by this store or read back unfinished); forgotten once it finishes."""
        if record["state"] in TERMINAL_STATES:
            return self._numbers.pop(record["id"], None)
        return self._numbers.get(record["id"])

    def _event_rows(self, events: Sequence[Event], number: int | None) -> list[Statement]:
        """The events' rows, each followed by its webhook outbox rows (if any)."""
        outbox = self.outbox
        if outbox.route is None:
            return [event_statement(e, number) for e in events]
        return [row for e in events
                for row in (event_statement(e, number), *outbox.rows(e))]

    async def insert_turn(self, record: dict[str, Any], checkpoint: dict[str, Any], *,
                          events: Sequence[Event] = (), within_s: float | None = None,
                          idempotency: IdempotencyKey | None = None) -> int:
        """The turn's row and its message, durable when this returns; `events` commit
        with them, and the key's row when given (its primary key refuses a second
        turn for a live key: the whole write fails, `KeyTaken`)."""
        self._next_seq += 1
        record["seq"] = number = self._next_seq
        try:
            await self.writer.write([*key_rows(record["id"], idempotency), (
                "INSERT INTO turns (id, seq, session, state, created_at, updated_at, record,"
                " checkpoint) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (record["id"], number, record["session"], record["state"],
                 record["created_at"], record["updated_at"], _dumps(stored_record(record)),
                 _dumps(checkpoint)),
            ), ("INSERT INTO turn_input (turn, message) VALUES (?, ?)",
                (record["id"], stored_message(record))), *self._event_rows(events, number)],
                within_s=within_s)
        except StoreError as exc:
            if idempotency is not None and isinstance(exc.__cause__, sqlite3.IntegrityError) \
                    and "idempotency_keys" in str(exc.__cause__):
                raise KeyTaken(f"idempotency key {idempotency.key!r} is held by another "
                               "turn") from None
            raise
        if record["state"] not in TERMINAL_STATES:
            self._numbers[record["id"]] = number
        return number

    async def save_turn(self, record: dict[str, Any],
                        checkpoint: dict[str, Any] | None = None, *,
                        messages: MessageRows | None = None,
                        trail: MessageRows | None = None,
                        events: Sequence[Event] = ()) -> None:
        """The record (and the checkpoint, message and trail rows, when given) in one
        transaction with `events`. The record and the checkpoint of a turn must describe
        the same moment: a write of the record alone is for a turn that ends (its
        checkpoint is no longer read)."""
        number = self._number(record)
        await self.writer.write([turn_statement(record, checkpoint),
                           *message_write(record["id"], messages, trail, turn_no=number),
                           *self._event_rows(events, number)],
                          supersedes=None if checkpoint is None else record["id"])

    def queue_turn(self, record: dict[str, Any], checkpoint: dict[str, Any], *,
                   messages: MessageRows | None = None,
                   trail: MessageRows | None = None) -> bool:
        """`save_turn` of a record and checkpoint, queued and not awaited: it commits
        with the next durable write, before any later write of the turn; a newer
        checkpoint of the turn arriving before it is taken for a commit drops it (its
        rows go with the newer one). False when the store takes no more writes (nothing
        was queued: the caller awaits `save_turn` instead). See `QueuesTurns` in the
        store interface for when a caller may leave a checkpoint unawaited."""
        return self.writer.enqueue_turn(record["id"], [
            turn_statement(record, checkpoint),
            *message_write(record["id"], messages, trail, turn_no=self._number(record))])

    async def append_message(self, turn_id: str, message: dict[str, Any], *,
                             updated_at: float, events: Sequence[Event] = ()) -> None:
        """Add a user message (steer, answer) to the stored inbox of a turn, leaving the
        rest of its record as of its last checkpoint. Writing the live record instead
        would store an inbox from which the runner already took messages that its last
        checkpoint does not hold yet: a crash then would lose them."""
        await self.writer.write([(
            "UPDATE turns SET updated_at = ?, record = json_set(record, '$.inbox',"
            " json(json_insert(COALESCE(json_extract(record, '$.inbox'), json('[]')),"
            " '$[#]', json(?))), '$.updated_at', ?) WHERE id = ?",
            (updated_at, _dumps(message), updated_at, turn_id)),
            *self._event_rows(events, self._numbers.get(turn_id))])

    def append_event(self, event: Event) -> None:
        turn = event.turn
        self.writer.enqueue_event(event_statement(
            event, None if turn is None else self._numbers.get(turn)))
        if self.outbox.route is not None:
            for row in self.outbox.rows(event):  # joins the event's write
                self.writer.enqueue_event(row)

    def reserve_event_seqs(self, upto: int) -> None:
        self.writer.enqueue([(
            "INSERT INTO meta (key, value) VALUES ('event_seq_reserved', ?) ON CONFLICT(key)"
            " DO UPDATE SET value = MAX(value, excluded.value)", (upto,))])

    async def journal_intent(self, key: str, *, turn: str, tool: str, arguments: str,
                             idempotent: bool) -> None:
        """Queued or awaited as `SQLiteWriter.journal_intent` says; see `Store.journal_intent`."""
        statements: list[Statement] = [(
            "INSERT INTO journal (key, turn, tool, arguments, idempotent)"
            " VALUES (?, ?, ?, ?, ?) ON CONFLICT(key) DO UPDATE SET outcome = NULL",
            (key, turn, tool, arguments, int(idempotent)))]
        await self.writer.journal_intent(key, statements, idempotent=idempotent)

    async def journal_outcome(self, key: str, outcome: dict[str, Any]) -> None:
        statements: list[Statement] = [("UPDATE journal SET outcome = ? WHERE key = ?",
                                         (_dumps(outcome), key))]
        await self.writer.journal_outcome(key, statements)

    async def requeue_turn(self, record: dict[str, Any], checkpoint: dict[str, Any], *,
                           messages: MessageRows | None = None,
                           trail: MessageRows | None = None,
                           events: Sequence[Event] = ()) -> None:
        number = self._number(record)
        await self.writer.write([(
            "UPDATE turns SET state = ?, updated_at = ?, record = ?, checkpoint = ?,"
            " replayed_by = NULL WHERE id = ?",
            (record["state"], record["updated_at"], _dumps(stored_record(record)),
             _dumps(checkpoint), record["id"])),
            *message_write(record["id"], messages, trail, turn_no=number),
            *self._event_rows(events, number)])

    async def mark_replayed(self, turn_id: str, new_turn_id: str) -> None:
        await self.writer.write([("UPDATE turns SET replayed_by = ? WHERE id = ?",
                            (new_turn_id, turn_id))])

    async def prune(self, *, finished_before: float, dead_letters: bool = False,
                    limit: int) -> int:
        keep_dead = "" if dead_letters else (
            " AND COALESCE(json_extract(record, '$.result.stopped_because.code'), '')"
            f" NOT IN {DEAD_LETTER_SQL}")
        rows = await self.reader.rows(
            f"SELECT id FROM turns WHERE state IN {TERMINAL_SQL} AND updated_at < ?"
            f"{keep_dead} ORDER BY seq LIMIT ?", (finished_before, limit))
        ids = [r[0] for r in rows]
        statements = prune_statements(ids) if ids else []
        statements.append(("DELETE FROM events WHERE turn IS NULL AND ts < ?",
                           (finished_before,)))
        await self.writer.write(statements)
        return len(ids)

    async def prune_idempotency_keys(self, *, created_before: float, limit: int) -> int:
        rows = await self.reader.rows("SELECT key FROM idempotency_keys WHERE created_at < ?"
                                " ORDER BY created_at LIMIT ?", (created_before, limit))
        keys = [r[0] for r in rows]
        if keys:
            await self.writer.write([(f"DELETE FROM idempotency_keys WHERE key IN"
                                f" ({','.join('?' * len(keys))})", keys)])
        return len(keys)

    # -- reading ------------------------------------------------------------------

    async def idempotency_key(self, key: str) -> StoredKey | None:
        rows = await self.reader.rows("SELECT turn, fingerprint, created_at FROM idempotency_keys"
                                " WHERE key = ?", (key,))
        return StoredKey(key, *rows[0]) if rows else None

    async def max_event_seq(self) -> int:
        rows = await self.reader.rows(
            "SELECT MAX(COALESCE((SELECT MAX(seq) FROM events), 0),"
            " COALESCE((SELECT value FROM meta WHERE key = 'event_seq_reserved'), 0))")
        return int(rows[0][0])

    async def get_turn(self, turn_id: str) -> dict[str, Any] | None:
        return await self.reader.run(lambda c: read_turn(c, turn_id))

    async def get_checkpoint(self, turn_id: str) -> dict[str, Any] | None:
        return await self.reader.run(lambda c: read_checkpoint(c, turn_id))

    async def list_turns(self, *, state: str | None = None, session: str | None = None,
                         limit: int = 100, since: float | None = None,
                         before_seq: int | None = None) -> list[dict[str, Any]]:
        sql, params = list_turns_sql(state=state, session=session, since=since,
                                     before_seq=before_seq, placeholder=lambda n: "?",
                                     source=WITH_MESSAGE)
        return await self.reader.records(sql, (*params, limit))

    async def unfinished_turns(self) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        unfinished = await self.reader.run(read_unfinished)
        self._numbers.update((record["id"], number) for number, record, _ in unfinished)
        return [(record, checkpoint) for _, record, checkpoint in unfinished]

    async def session_history(self, session: str, *, before_seq: int) -> list[dict[str, Any]]:
        return await self.reader.records(
            f"SELECT record, message FROM {WITH_MESSAGE} WHERE session = ? AND seq < ? AND"
            f" state IN {TERMINAL_SQL} ORDER BY seq", (session, before_seq))

    async def events(self, *, turn: str | None = None, after_seq: int = 0,
                     limit: int = 10_000) -> list[dict[str, Any]]:
        if turn is None:
            return await self.reader.json_rows(
                "SELECT data FROM events WHERE seq > ? ORDER BY seq LIMIT ?", (after_seq, limit))
        return await self.reader.json_rows(EVENTS_OF_TURN,
                                           (turn, after_seq, turn, after_seq, limit))

    async def journal_get(self, key: str) -> dict[str, Any] | None:
        rows = await self.reader.rows(
            "SELECT tool, arguments, idempotent, outcome FROM journal WHERE key = ?", (key,))
        if not rows:
            return None
        return journal_entry(key, *rows[0])

    async def finished_usage(self, *, since: float | None = None,
                             limit: int = 100_000) -> list[FinishedTurn]:
        floor = since if since is not None else 0.0
        return await self.reader.run(lambda c: read_usage(c, floor, limit))

    async def dead_letters(self) -> list[dict[str, Any]]:
        return await self.reader.run(read_dead_letters)
