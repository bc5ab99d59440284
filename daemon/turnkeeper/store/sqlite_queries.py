"""The SQLite store's reads that take more than one query or decode what they read: each
a function of the reader connection, run in the reader's thread (`sqlite_reader.py`), so
the event loop never decodes a row.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Sequence
from typing import Any

from turnkeeper.policy.limits import FinishedTurn
from turnkeeper.store.base import (
    DEAD_LETTER_SQL,
    DEAD_LETTERS_SHOWN,
    TERMINAL_SQL,
    dead_letter_entry,
    record_of,
    rows_by_turn,
    usage_of,
    with_messages,
)
from turnkeeper.store.sqlite_statements import TURN_NO, WITH_MESSAGE, Statement
from turnkeeper.store.writer import MESSAGES, TRAIL


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


def read_turn(c: sqlite3.Connection, turn_id: str) -> dict[str, Any] | None:
    """The turn's record, with the turn that replayed it (if any)."""
    row = c.execute(f"SELECT record, message, replayed_by FROM {WITH_MESSAGE}"
                    " WHERE id = ?", (turn_id,)).fetchone()
    if row is None:
        return None
    record = record_of(row[0], row[1])
    if row[2]:
        record["replayed_by"] = row[2]
    return record


def read_checkpoint(c: sqlite3.Connection, turn_id: str) -> dict[str, Any] | None:
    """The turn's checkpoint with its message and trail rows, all of one commit."""
    turns, messages, trail = _together(c, [
        ("SELECT checkpoint FROM turns WHERE id = ?", (turn_id,)),
        *((f"SELECT data FROM {table} WHERE turn_no = {TURN_NO} ORDER BY idx",
           (turn_id,)) for table in (MESSAGES, TRAIL))])
    return (_attach(turns[0][0], [r[0] for r in messages], [r[0] for r in trail])
            if turns else None)


def read_unfinished(c: sqlite3.Connection
                    ) -> list[tuple[int, dict[str, Any], dict[str, Any]]]:
    """Every turn not finished, in order: its number, record and checkpoint (with its
    rows), all of one commit."""
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


_USAGE = ("SELECT COALESCE(json_extract(record, '$.profile'), 'default'), state,"
          " json_extract(record, '$.result.stopped_because.code'),"
          " json_extract(record, '$.usage.total_tokens'),"
          " json_extract(record, '$.usage.seconds'),"
          " json_extract(record, '$.counters.steps'),"
          " json_extract(record, '$.usage.cost_usd'),"
          " json_extract(record, '$.would_have_stopped'),"
          " json_extract(record, '$.result.extensions')"
          f" FROM turns WHERE state IN {TERMINAL_SQL} AND updated_at >= ?"
          " AND json_extract(record, '$.result') IS NOT NULL ORDER BY seq DESC LIMIT ?")


def read_usage(c: sqlite3.Connection, since: float, limit: int) -> list[FinishedTurn]:
    """What the turns finished since `since` used, the latest first."""
    return [usage_of(profile, state, code, tokens, seconds, steps, cost,
                     json.loads(would) if would not in (None, "[]") else (), extensions)
            for profile, state, code, tokens, seconds, steps, cost, would, extensions
            in c.execute(_USAGE, (since, limit))]


def read_dead_letters(c: sqlite3.Connection) -> list[dict[str, Any]]:
    """The latest dead letters, DEAD_LETTERS_SHOWN at most."""
    return [dead_letter_entry(record_of(record_json, message), replayed_by)
            for record_json, message, replayed_by in c.execute(
                f"SELECT record, message, replayed_by FROM {WITH_MESSAGE} WHERE"
                f" json_extract(record, '$.result.stopped_because.code') IN {DEAD_LETTER_SQL}"
                f" ORDER BY seq DESC LIMIT {DEAD_LETTERS_SHOWN}")]
