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

`SQLiteStore` stands on `sqlite_conn.py`: the file and its lock, the commits and their
retries while the store cannot be written (a crash, a full disk, a second daemon: see
there), and the reader.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Sequence
from typing import Any

from turnkeeper import jsonwire
from turnkeeper.events import Event
from turnkeeper.policy.idempotency import IdempotencyKey, StoredKey
from turnkeeper.policy.limits import FinishedTurn
from turnkeeper.policy.turn_state import TERMINAL_STATES
from turnkeeper.store.base import (
    DEAD_LETTER_SQL,
    DEAD_LETTERS_SHOWN,
    TERMINAL_SQL,
    KeyTaken,
    MessageRows,
    StoreError,
    dead_letter_entry,
    journal_entry,
    list_turns_sql,
    record_of,
    rows_by_turn,
    stored_message,
    stored_record,
    usage_of,
    with_messages,
)
from turnkeeper.store.sqlite_conn import EVENT_TURN_KEY, TURN_NO, Statement
from turnkeeper.store.sqlite_outbox import SQLiteOutbox
from turnkeeper.store.sqlite_schema import SCHEMA_VERSION as SCHEMA_VERSION
from turnkeeper.store.writer import MESSAGES, TRAIL, message_write

# The turns with their messages, which `turn_input` holds apart (see the store interface).
WITH_MESSAGE = "turns LEFT JOIN turn_input ON turn_input.turn = turns.id"


def _dumps(value: Any) -> str:
    return jsonwire.dumps_str(value)


_EVENT_ROW = "INSERT OR IGNORE INTO events (seq, turn, turn_no, ts, type, data) VALUES"
_EVENT_BY_ID = f"{_EVENT_ROW} (?, ?, {TURN_NO}, ?, ?, ?)"
_EVENT = f"{_EVENT_ROW} (?, ?, ?, ?, ?, ?)"


def _event_statement(event: Event, number: int | None) -> Statement:
    """The event's row, with its turn's number when the store knows it (else looked up:
    a turn with no row, or none, leaves it NULL)."""
    sql, turn_key = (_EVENT_BY_ID, event.turn) if number is None else (_EVENT, number)
    return sql, (event.seq, event.turn, turn_key, event.ts, event.type, event.encoded())


def _turn_statement(record: dict[str, Any], checkpoint: dict[str, Any] | None) -> Statement:
    """The turn's row: its record (without its message), and its checkpoint when given."""
    if checkpoint is None:
        return ("UPDATE turns SET state = ?, updated_at = ?, record = ? WHERE id = ?",
                (record["state"], record["updated_at"], _dumps(stored_record(record)),
                 record["id"]))
    return ("UPDATE turns SET state = ?, updated_at = ?, record = ?, checkpoint = ?"
            " WHERE id = ?", (record["state"], record["updated_at"],
                               _dumps(stored_record(record)), _dumps(checkpoint),
                               record["id"]))


# A turn's events after a seq (the turn's id, the seq, the id, the seq, a limit), each
# row its JSON first: by the turn's number, and by its id (the events stored before it
# had one), two ranges of the index, each in order, merged. (`EVENT_TURN_KEY` says why
# the `+`.)
EVENTS_OF_TURN = (
    f"SELECT data, seq FROM events WHERE {EVENT_TURN_KEY} ="
    " (SELECT +seq FROM turns WHERE id = ?) AND seq > ? UNION ALL SELECT data, seq FROM"
    f" events WHERE {EVENT_TURN_KEY} = ? AND seq > ? ORDER BY seq LIMIT ?")


def prune_statements(ids: Sequence[str]) -> list[Statement]:
    """The turns `ids` deleted with everything they hold, those still finished when the
    transaction runs (a dead letter replayed since they were chosen is queued again, and
    keeps everything)."""
    marks = ",".join("?" * len(ids))
    of_due = f"FROM turns WHERE id IN ({marks}) AND state IN {TERMINAL_SQL}"
    due, numbers = f"SELECT id {of_due}", f"SELECT seq {of_due}"
    # An event is found by its turn's number or its id (`EVENT_TURN_KEY`).
    keys = f"SELECT +seq {of_due} UNION ALL SELECT +id {of_due}"
    return [
        (f"DELETE FROM events WHERE {EVENT_TURN_KEY} IN ({keys})", [*ids, *ids]),
        (f"DELETE FROM journal WHERE turn IN ({due})", ids),
        (f"DELETE FROM messages WHERE turn_no IN ({numbers})", ids),
        (f"DELETE FROM trail WHERE turn_no IN ({numbers})", ids),
        (f"DELETE FROM turn_input WHERE turn IN ({due})", ids),
        (f"DELETE FROM turns WHERE id IN ({due})", ids),
    ]


def _together(conn: sqlite3.Connection, queries: Sequence[Statement]
              ) -> list[list[tuple[Any, ...]]]:
    """Several queries in one read transaction: they see the same commit (a checkpoint
    and its message rows)."""
    conn.execute("BEGIN")
    try:
        return [conn.execute(sql, params).fetchall() for sql, params in queries]
    finally:
        conn.execute("COMMIT")


def _attach(checkpoint_json: str, rows: list[str], trail: list[str]) -> dict[str, Any]:
    return with_messages(json.loads(checkpoint_json), rows, trail)


def _key_rows(turn: str, idempotency: IdempotencyKey | None) -> list[Statement]:
    """A submit's key row, replacing an expired one of the key (or one whose turn was
    pruned); a live one held by another turn makes the INSERT fail."""
    if idempotency is None:
        return []
    return [("DELETE FROM idempotency_keys WHERE key = ? AND (created_at < ?"
             " OR turn NOT IN (SELECT id FROM turns))",
             (idempotency.key, idempotency.stale_before)),
            ("INSERT INTO idempotency_keys (key, turn, fingerprint, created_at)"
             " VALUES (?, ?, ?, ?)",
             (idempotency.key, turn, idempotency.fingerprint, idempotency.created_at))]


class SQLiteStore(SQLiteOutbox):
    def __repr__(self) -> str:
        return f"SQLiteStore({str(self.path)!r})"

    # -- writing ------------------------------------------------------------------

    def _number(self, record: dict[str, Any]) -> int | None:
        """The number of the turn `record` saves, known while the turn is live (inserted
        by this store or read back unfinished); forgotten once it finishes."""
        if record["state"] in TERMINAL_STATES:
            return self._numbers.pop(record["id"], None)
        return self._numbers.get(record["id"])

    def _event_rows(self, events: Sequence[Event], number: int | None) -> list[Statement]:
        """The events' rows, each followed by its webhook outbox rows (if any)."""
        if self._route is None:
            return [_event_statement(e, number) for e in events]
        return [row for e in events
                for row in (_event_statement(e, number), *self._outbox_rows(e))]

    async def insert_turn(self, record: dict[str, Any], checkpoint: dict[str, Any], *,
                          events: Sequence[Event] = (), within_s: float | None = None,
                          idempotency: IdempotencyKey | None = None) -> int:
        """The turn's row and its message, durable when this returns; `events` commit
        with them, and the key's row when given (its primary key refuses a second
        turn for a live key: the whole write fails, `KeyTaken`)."""
        self._next_seq += 1
        record["seq"] = number = self._next_seq
        try:
            await self._write([*_key_rows(record["id"], idempotency), (
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
        await self._write([_turn_statement(record, checkpoint),
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
        return self._enqueue_turn(record["id"], [
            _turn_statement(record, checkpoint),
            *message_write(record["id"], messages, trail, turn_no=self._number(record))])

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
            *self._event_rows(events, self._numbers.get(turn_id))])

    def append_event(self, event: Event) -> None:
        turn = event.turn
        self._enqueue_event(_event_statement(
            event, None if turn is None else self._numbers.get(turn)))
        if self._route is not None:
            for row in self._outbox_rows(event):  # joins the event's write
                self._enqueue_event(row)

    def reserve_event_seqs(self, upto: int) -> None:
        self._enqueue([(
            "INSERT INTO meta (key, value) VALUES ('event_seq_reserved', ?) ON CONFLICT(key)"
            " DO UPDATE SET value = MAX(value, excluded.value)", (upto,))])

    async def journal_intent(self, key: str, *, turn: str, tool: str, arguments: str,
                             idempotent: bool) -> None:
        """Queued or awaited as `_journal_intent` says; see `Store.journal_intent`."""
        statements: list[Statement] = [(
            "INSERT INTO journal (key, turn, tool, arguments, idempotent)"
            " VALUES (?, ?, ?, ?, ?) ON CONFLICT(key) DO UPDATE SET outcome = NULL",
            (key, turn, tool, arguments, int(idempotent)))]
        await self._journal_intent(key, statements, idempotent=idempotent)

    async def journal_outcome(self, key: str, outcome: dict[str, Any]) -> None:
        statements: list[Statement] = [("UPDATE journal SET outcome = ? WHERE key = ?",
                                         (_dumps(outcome), key))]
        await self._journal_outcome(key, statements)

    async def requeue_turn(self, record: dict[str, Any], checkpoint: dict[str, Any], *,
                           messages: MessageRows | None = None,
                           trail: MessageRows | None = None,
                           events: Sequence[Event] = ()) -> None:
        number = self._number(record)
        await self._write([(
            "UPDATE turns SET state = ?, updated_at = ?, record = ?, checkpoint = ?,"
            " replayed_by = NULL WHERE id = ?",
            (record["state"], record["updated_at"], _dumps(stored_record(record)),
             _dumps(checkpoint), record["id"])),
            *message_write(record["id"], messages, trail, turn_no=number),
            *self._event_rows(events, number)])

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
        statements = prune_statements(ids) if ids else []
        statements.append(("DELETE FROM events WHERE turn IS NULL AND ts < ?",
                           (finished_before,)))
        await self._write(statements)
        return len(ids)

    async def prune_idempotency_keys(self, *, created_before: float, limit: int) -> int:
        rows = await self._read("SELECT key FROM idempotency_keys WHERE created_at < ?"
                                " ORDER BY created_at LIMIT ?", (created_before, limit))
        keys = [r[0] for r in rows]
        if keys:
            await self._write([(f"DELETE FROM idempotency_keys WHERE key IN"
                                f" ({','.join('?' * len(keys))})", keys)])
        return len(keys)

    # -- reading ------------------------------------------------------------------

    async def idempotency_key(self, key: str) -> StoredKey | None:
        rows = await self._read("SELECT turn, fingerprint, created_at FROM idempotency_keys"
                                " WHERE key = ?", (key,))
        return StoredKey(key, *rows[0]) if rows else None

    async def max_event_seq(self) -> int:
        rows = await self._read(
            "SELECT MAX(COALESCE((SELECT MAX(seq) FROM events), 0),"
            " COALESCE((SELECT value FROM meta WHERE key = 'event_seq_reserved'), 0))")
        return int(rows[0][0])

    async def get_turn(self, turn_id: str) -> dict[str, Any] | None:
        def read(c: sqlite3.Connection) -> dict[str, Any] | None:
            row = c.execute(f"SELECT record, message, replayed_by FROM {WITH_MESSAGE}"
                            " WHERE id = ?", (turn_id,)).fetchone()
            if row is None:
                return None
            record = record_of(row[0], row[1])
            if row[2]:
                record["replayed_by"] = row[2]
            return record

        return await self._in_reader(read)

    async def get_checkpoint(self, turn_id: str) -> dict[str, Any] | None:
        def read(c: sqlite3.Connection) -> dict[str, Any] | None:
            turns, messages, trail = _together(c, [
                ("SELECT checkpoint FROM turns WHERE id = ?", (turn_id,)),
                *((f"SELECT data FROM {table} WHERE turn_no = {TURN_NO} ORDER BY idx",
                   (turn_id,)) for table in (MESSAGES, TRAIL))])
            return (_attach(turns[0][0], [r[0] for r in messages], [r[0] for r in trail])
                    if turns else None)

        return await self._in_reader(read)

    async def list_turns(self, *, state: str | None = None, session: str | None = None,
                         limit: int = 100, since: float | None = None,
                         before_seq: int | None = None) -> list[dict[str, Any]]:
        sql, params = list_turns_sql(state=state, session=session, since=since,
                                     before_seq=before_seq, placeholder=lambda n: "?",
                                     source=WITH_MESSAGE)
        return await self._read_records(sql, (*params, limit))

    async def unfinished_turns(self) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        def read(c: sqlite3.Connection) -> list[tuple[int, dict[str, Any], dict[str, Any]]]:
            turns, messages, trail = _together(c, [
                (f"SELECT id, seq, record, message, checkpoint FROM {WITH_MESSAGE} WHERE"
                 f" state NOT IN {TERMINAL_SQL} ORDER BY seq", ()),
                *((f"SELECT t.id, r.data FROM turns AS t JOIN {table} AS r ON"
                   f" r.turn_no = t.seq WHERE t.state NOT IN {TERMINAL_SQL}"
                   " ORDER BY t.seq, r.idx", ()) for table in (MESSAGES, TRAIL))])
            rows, lines = rows_by_turn(messages), rows_by_turn(trail)
            return [(number, record_of(record, message),
                     _attach(checkpoint, rows.get(turn_id, []), lines.get(turn_id, [])))
                    for turn_id, number, record, message, checkpoint in turns]

        unfinished = await self._in_reader(read)
        self._numbers.update((record["id"], number) for number, record, _ in unfinished)
        return [(record, checkpoint) for _, record, checkpoint in unfinished]

    async def session_history(self, session: str, *, before_seq: int) -> list[dict[str, Any]]:
        return await self._read_records(
            f"SELECT record, message FROM {WITH_MESSAGE} WHERE session = ? AND seq < ? AND"
            f" state IN {TERMINAL_SQL} ORDER BY seq", (session, before_seq))

    async def events(self, *, turn: str | None = None, after_seq: int = 0,
                     limit: int = 10_000) -> list[dict[str, Any]]:
        if turn is None:
            return await self._read_json("SELECT data FROM events WHERE seq > ? ORDER BY"
                                         " seq LIMIT ?", (after_seq, limit))
        return await self._read_json(EVENTS_OF_TURN, (turn, after_seq, turn, after_seq, limit))

    async def journal_get(self, key: str) -> dict[str, Any] | None:
        rows = await self._read(
            "SELECT tool, arguments, idempotent, outcome FROM journal WHERE key = ?", (key,))
        if not rows:
            return None
        return journal_entry(key, *rows[0])

    async def finished_usage(self, *, since: float | None = None,
                             limit: int = 100_000) -> list[FinishedTurn]:
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
            dead_letter_entry(record_of(record_json, message), replayed_by)
            for record_json, message, replayed_by in c.execute(
                f"SELECT record, message, replayed_by FROM {WITH_MESSAGE} WHERE"
                f" json_extract(record, '$.result.stopped_because.code') IN {DEAD_LETTER_SQL}"
                f" ORDER BY seq DESC LIMIT {DEAD_LETTERS_SHOWN}")])
