"""The SQL the SQLite store sends: the statements its writes are made of, built from
records, events and rows, and the queries it shares. Pure: no connection here.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from turnkeeper import jsonwire
from turnkeeper.events import Event
from turnkeeper.policy.idempotency import IdempotencyKey
from turnkeeper.store.base import TERMINAL_SQL, stored_record
from turnkeeper.store.writer import TRAIL, MessageWrite

Statement = tuple[str, Sequence[Any]]
# A write's ops: statements, and a turn's conversation rows (turned into statements when
# they commit, so a dropped checkpoint's rows can join the newer write's: see the writer).
Op = Statement | MessageWrite

# The number of the turn whose id is the parameter: a turn's rows are keyed by it.
TURN_NO = "(SELECT seq FROM turns WHERE id = ?)"
# What the events' index orders them by: their turn's number, or its id where they have
# none (stored before the number was, or their turn has no row). Its values have no type
# affinity, and a value compared with them must have none either (`+seq`, not `seq`), or
# SQLite converts each one instead of using the index.
EVENT_TURN_KEY = "coalesce(turn_no, turn)"
# The turns with their messages, which `turn_input` holds apart (see the store interface).
WITH_MESSAGE = "turns LEFT JOIN turn_input ON turn_input.turn = turns.id"

# Rows per INSERT statement (3 parameters each, far below SQLite's limit of 32,766).
_ROWS_PER_INSERT = 500


def _dumps(value: Any) -> str:
    return jsonwire.dumps_str(value)


# A trail row of a turn that has a row. The trail only grows (a checkpoint never counts
# fewer lines than the one before it), so its rows are only added, one statement for
# all of them: a row at an index already there (a write that failed, sent again) is
# replaced, and nothing past the rows written is ever left to delete.
_TRAIL_ROW = ("INSERT OR REPLACE INTO trail (turn_no, idx, data) SELECT seq, ?, ? FROM turns"
              " WHERE id = ?")


def _message_inserts(m: MessageWrite, out: list[Statement]) -> None:
    """`m`'s message rows into `out`, _ROWS_PER_INSERT a statement."""
    number, rows = m.turn_no, m.rows
    for first in range(0, len(rows), _ROWS_PER_INSERT):
        chunk = rows[first:first + _ROWS_PER_INSERT]
        params: list[Any] = []
        if number is None:
            for n, text in enumerate(chunk, m.start + first):
                params += (n, text)
            params.append(m.turn)
            out.append((
                "INSERT OR REPLACE INTO messages (turn_no, idx, data) SELECT t.seq,"
                " v.column1, v.column2 FROM (VALUES " + ",".join(["(?,?)"] * len(chunk))
                + ") AS v JOIN turns AS t ON t.id = ?", params))
        else:
            for n, text in enumerate(chunk, m.start + first):
                params += (number, n, text)
            out.append(("INSERT OR REPLACE INTO messages (turn_no, idx, data) VALUES "
                        + ",".join(["(?,?,?)"] * len(chunk)), params))


def message_statements(m: MessageWrite) -> list[Statement]:
    """Replace the turn's rows from `m.start` on, deleting those past the write's end
    first when it `trims` (a step's write only adds rows: nothing to delete). Rows are
    keyed by the turn's number, `m.turn_no` or, not given, looked up by its id: then a
    turn with no row gets none (as the UPDATE of its record, which matches nothing). The
    store gives the number only for a live turn whose row it inserted or read back."""
    number = m.turn_no
    if m.table == TRAIL:
        if number is None:
            return [(_TRAIL_ROW, (n, text, m.turn)) for n, text in enumerate(m.rows, m.start)]
        return [("INSERT OR REPLACE INTO trail (turn_no, idx, data) VALUES (?, ?, ?)",
                 (number, n, text)) for n, text in enumerate(m.rows, m.start)]
    out: list[Statement] = []
    if m.trims:
        turn_sql, turn_key = (TURN_NO, m.turn) if number is None else ("?", number)
        out.append((f"DELETE FROM messages WHERE turn_no = {turn_sql} AND idx >= ?",
                    (turn_key, m.start)))
    _message_inserts(m, out)
    return out


def statements(ops: Iterable[Op]) -> Iterator[Statement]:
    """The statements `ops` are made of, in order."""
    for op in ops:
        if isinstance(op, MessageWrite):
            yield from message_statements(op)
        else:
            yield op


def probe(now: float) -> Statement:
    """A one-row write that needs the disk as any write does."""
    return ("INSERT INTO meta (key, value) VALUES ('writable_probe', ?) ON CONFLICT(key)"
            " DO UPDATE SET value = excluded.value", (int(now),))


_EVENT_ROW = "INSERT OR IGNORE INTO events (seq, turn, turn_no, ts, type, data) VALUES"
_EVENT_BY_ID = f"{_EVENT_ROW} (?, ?, {TURN_NO}, ?, ?, ?)"
_EVENT = f"{_EVENT_ROW} (?, ?, ?, ?, ?, ?)"


def event_statement(event: Event, number: int | None) -> Statement:
    """The event's row, with its turn's number when the store knows it (else looked up:
    a turn with no row, or none, leaves it NULL)."""
    sql, turn_key = (_EVENT_BY_ID, event.turn) if number is None else (_EVENT, number)
    return sql, (event.seq, event.turn, turn_key, event.ts, event.type, event.encoded())


def turn_statement(record: dict[str, Any], checkpoint: dict[str, Any] | None) -> Statement:
    """The turn's row: its record (without its message), and its checkpoint when given."""
    if checkpoint is None:
        return ("UPDATE turns SET state = ?, updated_at = ?, record = ? WHERE id = ?",
                (record["state"], record["updated_at"], _dumps(stored_record(record)),
                 record["id"]))
    return ("UPDATE turns SET state = ?, updated_at = ?, record = ?, checkpoint = ?"
            " WHERE id = ?", (record["state"], record["updated_at"],
                               _dumps(stored_record(record)), _dumps(checkpoint),
                               record["id"]))


def key_rows(turn: str, idempotency: IdempotencyKey | None) -> list[Statement]:
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
