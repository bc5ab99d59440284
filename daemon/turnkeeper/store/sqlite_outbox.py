"""The SQLite store's outbox part: its webhook outbox (what it is: store/outbox.py).

An event's outbox rows are statements written right after the event's own, in the same
write, so they commit in its transaction. One daemon holds the file, so nothing is
claimed: the sender keeps the deliveries it has in flight out of the next read
(`skip`). Reads go through the store's reader part, writes through its writer part.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Collection

from turnkeeper.events import Event
from turnkeeper.store.outbox import (
    DELIVERED,
    FAILED,
    OUTBOX_COLUMNS,
    PENDING,
    Backlog,
    Delivery,
    WebhookRoute,
    backlog_of,
    outbox_params,
)
from turnkeeper.store.sqlite_reader import SQLiteReader
from turnkeeper.store.sqlite_statements import Statement
from turnkeeper.store.sqlite_writer import SQLiteWriter

OUTBOX_INSERT = (f"INSERT OR IGNORE INTO webhook_outbox {OUTBOX_COLUMNS}"
                 " VALUES (?, ?, ?, ?, ?, ?, ?)")


class SQLiteOutbox:
    """The `Outbox` of a SQLite store, reading with its `reader` and writing with its
    `writer`."""

    def __init__(self, reader: SQLiteReader, writer: SQLiteWriter) -> None:
        self._reader = reader
        self._writer = writer
        self.route: WebhookRoute | None = None  # set by the daemon: no webhook until then

    def set_webhook_route(self, route: WebhookRoute | None) -> None:
        self.route = route

    def rows(self, event: Event) -> list[Statement]:
        """The outbox rows of `event`, to write with its row (none when no webhook
        takes it)."""
        route = self.route
        if route is None:
            return []
        names = route(event)
        return [(OUTBOX_INSERT, params) for params in outbox_params(event, names)] \
            if names else []

    async def webhook_due(self, webhook: str, *, now: float, limit: int,
                          skip: Collection[int] = (), lease_s: float = 60.0
                          ) -> list[Delivery]:
        rows = await self._reader.rows(
            "SELECT seq, type, body, attempts, created_at FROM webhook_outbox WHERE"
            " webhook = ? AND state = ? AND next_at <= ? AND seq NOT IN (SELECT value"
            " FROM json_each(?)) ORDER BY next_at, seq LIMIT ?",
            (webhook, PENDING, now, json.dumps(sorted(skip)), limit))
        return [Delivery(webhook, *row) for row in rows]

    async def webhook_settle(self, webhook: str, seq: int, *, state: str, attempts: int,
                             next_at: float, error: str | None, now: float) -> None:
        await self._writer.write([(
            "UPDATE webhook_outbox SET state = ?, attempts = ?, next_at = ?, last_error = ?,"
            " updated_at = ? WHERE webhook = ? AND seq = ? AND state = ?",
            (state, attempts, next_at, error, now, webhook, seq, PENDING))])

    async def webhook_release(self) -> None:
        return None  # one daemon holds the file: nothing is claimed

    async def webhook_give_up(self, webhook: str, *, count: int, error: str,
                              now: float) -> int:
        rows = await self._reader.rows(
            "SELECT seq FROM webhook_outbox WHERE webhook = ? AND state = ? ORDER BY seq"
            " LIMIT ?", (webhook, PENDING, count))
        seqs = [r[0] for r in rows]
        if seqs:
            await self._writer.write([(
                "UPDATE webhook_outbox SET state = ?, last_error = ?, updated_at = ? WHERE"
                " webhook = ? AND state = ? AND seq IN (SELECT value FROM json_each(?))",
                (FAILED, error, now, webhook, PENDING, json.dumps(seqs)))])
        return len(seqs)

    async def webhook_backlog(self) -> dict[str, Backlog]:
        def read(c: sqlite3.Connection) -> dict[str, Backlog]:
            rows = c.execute(
                "SELECT webhook, state, count(*), min(created_at), (SELECT last_error FROM"
                " webhook_outbox AS f WHERE f.webhook = o.webhook AND f.state = o.state"
                " ORDER BY updated_at DESC LIMIT 1) FROM webhook_outbox AS o"
                " GROUP BY webhook, state").fetchall()
            return backlog_of(rows)

        return await self._reader.run(read)

    async def webhook_prune(self, *, delivered_before: float, failed_before: float,
                            limit: int = 1000) -> int:
        rows = await self._reader.rows(
            "SELECT webhook, seq FROM webhook_outbox WHERE (state = ? AND updated_at < ?)"
            " OR (state = ? AND updated_at < ?) LIMIT ?",
            (DELIVERED, delivered_before, FAILED, failed_before, limit))
        if rows:
            await self._writer.write([
                ("DELETE FROM webhook_outbox WHERE webhook = ? AND seq = ?", (webhook, seq))
                for webhook, seq in rows])
        return len(rows)
