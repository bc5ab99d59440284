"""The PostgreSQL store's reads: a turn, its checkpoint with the rows it counts, the
turns to resume, a session's history, events, the journal, usage and dead letters. Each
goes through `PgConnection`'s reads, which survive a lost connection; the ones that
must agree with each other (a checkpoint and its rows, the unfinished turns and theirs)
read one snapshot (a repeatable-read, read-only transaction). The writes are
`PgWrites`', in `store/postgres_writes.py`."""

from __future__ import annotations

import json
from typing import Any

import asyncpg

from turnkeeper.policy.idempotency import StoredKey
from turnkeeper.policy.limits import FinishedTurn
from turnkeeper.store.base import (
    DEAD_LETTER_SQL,
    DEAD_LETTERS_SHOWN,
    TERMINAL_SQL,
    dead_letter_entry,
    journal_entry,
    list_turns_sql,
    record_of,
    rows_by_turn,
    usage_of,
    with_messages,
)
from turnkeeper.store.postgres_batch import Conn
from turnkeeper.store.postgres_conn import PgConnection
from turnkeeper.store.writer import MESSAGES, TRAIL


def _row_counts(checkpoint_json: str) -> dict[str, int]:
    """How many rows of each list (table -> count) the checkpoint holds, for the lists
    whose rows are to be read: a list without a count (a checkpoint from before rows
    existed) is left out, and so is one that counts none (a trail still all in the
    checkpoint's tail), which would be a query for nothing."""
    checkpoint = json.loads(checkpoint_json)
    counts: dict[str, int] = {}
    for table, key in ((MESSAGES, "conversation"), (TRAIL, "trail")):
        value = checkpoint.get(key)
        if isinstance(value, dict) and value.get("count"):
            counts[table] = int(value["count"])
    return counts


class PgReads:
    """What `PostgresStore` reads (see the module's docstring), through `db`."""

    def __init__(self, db: PgConnection) -> None:
        self.db = db

    async def max_event_seq(self) -> int:
        rows = await self.db.fetch(
            "SELECT GREATEST(COALESCE((SELECT max(seq) FROM events), 0),"
            " COALESCE((SELECT value FROM meta WHERE key = 'event_seq_reserved'), 0))")
        return int(rows[0][0])

    async def get_turn(self, turn_id: str) -> dict[str, Any] | None:
        rows = await self.db.fetch(
            "SELECT record, message, replayed_by FROM turns WHERE id = $1", turn_id)
        if not rows:
            return None
        record_json, message, replayed_by = rows[0]
        record = record_of(record_json, message)
        if replayed_by:
            record["replayed_by"] = replayed_by
        return record

    async def get_checkpoint(self, turn_id: str) -> dict[str, Any] | None:
        """The checkpoint with its messages and trail rows, read from one snapshot: of
        each list only the rows the checkpoint counts."""
        async def read(conn: Conn) -> tuple[str | None, dict[str, list[str]]]:
            async with conn.transaction(isolation="repeatable_read", readonly=True):
                stored = await conn.fetchval("SELECT checkpoint FROM turns WHERE id = $1",
                                             turn_id)
                lists: dict[str, list[str]] = {}
                if stored is None:
                    return stored, lists
                for table, count in _row_counts(stored).items():
                    # `table` is MESSAGES or TRAIL: never a value read from the database.
                    rows = await conn.fetch(f"SELECT data FROM {table} WHERE turn = $1"
                                            " AND idx < $2 ORDER BY idx", turn_id, count)
                    lists[table] = [r[0] for r in rows]
                return stored, lists

        stored, lists = await self.db.read(read)
        return None if stored is None else with_messages(
            json.loads(stored), lists.get(MESSAGES, []), lists.get(TRAIL, []))

    async def list_turns(self, *, state: str | None = None, session: str | None = None,
                         limit: int = 100, since: float | None = None,
                         before_seq: int | None = None) -> list[dict[str, Any]]:
        sql, params = list_turns_sql(state=state, session=session, since=since,
                                     before_seq=before_seq, placeholder=lambda n: f"${n}")
        return [record_of(record_json, message)
                for record_json, message in await self.db.fetch(sql, *params, limit)]

    async def unfinished_turns(self) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        """Every unfinished turn with its checkpoint, in three queries (the turns, then
        the message rows and the trail rows of all of them) read from one snapshot."""
        async def read(conn: Conn) -> tuple[list[asyncpg.Record], list[asyncpg.Record],
                                            list[asyncpg.Record]]:
            async with conn.transaction(isolation="repeatable_read", readonly=True):
                turns = await conn.fetch(
                    "SELECT id, record, message, checkpoint FROM turns WHERE state NOT IN"
                    f" {TERMINAL_SQL} ORDER BY seq")
                messages, trail = [await conn.fetch(
                    f"SELECT r.turn, r.data FROM {table} r JOIN turns t ON t.id = r.turn"
                    f" WHERE t.state NOT IN {TERMINAL_SQL} ORDER BY r.turn, r.idx")
                    for table in (MESSAGES, TRAIL)]
                return turns, messages, trail

        turns, messages, trail = await self.db.read(read)
        rows, lines = rows_by_turn(messages), rows_by_turn(trail)
        return [(record_of(record_json, message),
                 with_messages(json.loads(checkpoint), rows.get(turn_id, []),
                               lines.get(turn_id, [])))
                for turn_id, record_json, message, checkpoint in turns]

    async def session_history(self, session: str, *, before_seq: int) -> list[dict[str, Any]]:
        rows = await self.db.fetch(
            f"SELECT record, message FROM turns WHERE session = $1 AND seq < $2 AND state"
            f" IN {TERMINAL_SQL} ORDER BY seq", session, before_seq)
        return [record_of(record_json, message) for record_json, message in rows]

    async def events(self, *, turn: str | None = None, after_seq: int = 0,
                     limit: int = 10_000) -> list[dict[str, Any]]:
        if turn is None:
            rows = await self.db.fetch("SELECT data FROM events WHERE seq > $1 ORDER BY seq"
                                     " LIMIT $2", after_seq, limit)
        else:
            # In the order they reached the database: a turn that moved between nodes has
            # events from several nodes' number blocks.
            rows = await self.db.fetch("SELECT data FROM events WHERE turn = $1 AND seq > $2"
                                     " ORDER BY pos LIMIT $3", turn, after_seq, limit)
        return [json.loads(r[0]) for r in rows]

    async def journal_get(self, key: str) -> dict[str, Any] | None:
        rows = await self.db.fetch(
            "SELECT tool, arguments, idempotent, outcome FROM journal WHERE key = $1", key)
        if not rows:
            return None
        return journal_entry(key, *rows[0])

    async def finished_usage(self, *, since: float | None = None,
                             limit: int = 100_000) -> list[FinishedTurn]:
        # jsonb refuses the escape of a NUL character, which an answer or an error may
        # hold: it is read as U+FFFD here. Replacing the six characters keeps the JSON
        # valid wherever they stand (after an escaped backslash they are plain text), and
        # changes only text inside strings, none of which this reads.
        rows = await self.db.fetch(
            "SELECT COALESCE(r->>'profile', 'default'), state,"
            " r->'result'->'stopped_because'->>'code', r->'usage'->>'total_tokens',"
            " r->'usage'->>'seconds', r->'counters'->>'steps', r->'usage'->>'cost_usd',"
            " COALESCE(r->'would_have_stopped', '[]'::jsonb)::text,"
            " r->'result'->>'extensions'"
            " FROM (SELECT replace(record, '\\u0000', '\\ufffd')::jsonb AS r, state, seq"
            " FROM turns"
            f" WHERE state IN {TERMINAL_SQL} AND updated_at >= $1) AS t"
            " WHERE r->'result' IS NOT NULL AND r->'result' <> 'null'::jsonb"
            " ORDER BY seq DESC LIMIT $2", since if since is not None else 0.0, limit)
        return [usage_of(profile, state, code, tokens, seconds, steps, cost,
                         json.loads(would), extensions)
                for profile, state, code, tokens, seconds, steps, cost, would, extensions
                in rows]

    async def dead_letters(self) -> list[dict[str, Any]]:
        rows = await self.db.fetch(
            "SELECT record, message, replayed_by FROM turns WHERE stop_code IN"
            f" {DEAD_LETTER_SQL} ORDER BY seq DESC LIMIT {DEAD_LETTERS_SHOWN}")
        return [dead_letter_entry(record_of(record_json, message), replayed_by)
                for record_json, message, replayed_by in rows]

    async def idempotency_key(self, key: str) -> StoredKey | None:
        rows = await self.db.fetch("SELECT turn, fingerprint, created_at FROM"
                                 " idempotency_keys WHERE key = $1", key)
        return StoredKey(key, *rows[0]) if rows else None
