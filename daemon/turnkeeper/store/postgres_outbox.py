"""The PostgreSQL store's webhook outbox (what it is: store/outbox.py).

An event's outbox rows go with the event's row in its transaction, fenced as it is when
the event is a claimed turn's (a node that lost the turn writes neither). Several nodes
share the outbox: a node takes the due rows it will send in one statement that claims
them (`FOR UPDATE SKIP LOCKED`, then `claimed_by` and a lease in `claim_until`), so two
nodes never take the same row, and a row whose lease ran out (its node was killed while
sending) is due again to any node; a node that stops hands back what it holds
(`webhook_release`). A settled attempt writes only while this node still holds the claim.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from turnkeeper.events import Event
from turnkeeper.store.outbox import (
    DELIVERED,
    FAILED,
    PENDING,
    Backlog,
    Delivery,
    WebhookRoute,
    backlog_of,
    outbox_params,
)
from turnkeeper.store.postgres_batch import (
    OUTBOX_INSERT,
    OUTBOX_INSERT_FENCED,
    Conn,
    Op,
)
from turnkeeper.store.postgres_conn import PgConnection
from turnkeeper.store.postgres_writer import StepWriter

_CLAIM = (
    "WITH c AS (SELECT webhook, seq FROM webhook_outbox WHERE webhook = $1 AND state = $2"
    " AND next_at <= $3 AND (claim_until IS NULL OR claim_until < $3)"
    " AND NOT seq = ANY($4::bigint[]) ORDER BY next_at, seq LIMIT $5"
    " FOR UPDATE SKIP LOCKED)"
    " UPDATE webhook_outbox o SET claimed_by = $6, claim_until = $3 + $7 FROM c"
    " WHERE o.webhook = c.webhook AND o.seq = c.seq"
    " RETURNING o.seq, o.type, o.body, o.attempts, o.created_at")


class PgOutbox:
    """The store's outbox part: its reads through `db`, its settled attempts through the
    steps' `writer`."""

    def __init__(self, db: PgConnection, writer: StepWriter) -> None:
        self.db = db
        self.writer = writer
        self.route: WebhookRoute | None = None  # set by the daemon: no webhook until then

    def set_webhook_route(self, route: WebhookRoute | None) -> None:
        self.route = route

    def outbox_ops(self, event: Event, epoch: int | None) -> list[Op]:
        """`event`'s outbox rows, fenced by `epoch` (its turn's claim) when given."""
        route = self.route
        names = route(event) if route is not None else ()
        if not names:
            return []
        if epoch is None:
            return [(OUTBOX_INSERT, params) for params in outbox_params(event, names)]
        return [(OUTBOX_INSERT_FENCED, (*params, event.turn, epoch))
                for params in outbox_params(event, names)]

    async def webhook_due(self, webhook: str, *, now: float, limit: int,
                          skip: Collection[int] = (), lease_s: float = 60.0
                          ) -> list[Delivery]:
        async def claim(conn: Conn) -> list[Any]:
            return list(await conn.fetch(_CLAIM, webhook, PENDING, now, sorted(skip),
                                         limit, self.db.node_id, lease_s))

        rows = await self.db.read(claim)
        return sorted((Delivery(webhook, int(r["seq"]), r["type"], r["body"],
                                int(r["attempts"]), float(r["created_at"])) for r in rows),
                      key=lambda d: d.seq)

    async def webhook_settle(self, webhook: str, seq: int, *, state: str, attempts: int,
                             next_at: float, error: str | None, now: float) -> None:
        await self.writer.write([(
            "UPDATE webhook_outbox SET state = $1, attempts = $2, next_at = $3,"
            " last_error = $4, updated_at = $5, claimed_by = NULL, claim_until = NULL"
            " WHERE webhook = $6 AND seq = $7 AND state = $8"
            " AND (claimed_by IS NULL OR claimed_by = $9)",
            (state, attempts, next_at, error, now, webhook, seq, PENDING, self.db.node_id))])

    async def webhook_release(self) -> None:
        await self.writer.write([(
            "UPDATE webhook_outbox SET claimed_by = NULL, claim_until = NULL"
            " WHERE claimed_by = $1 AND state = $2", (self.db.node_id, PENDING))])

    async def webhook_give_up(self, webhook: str, *, count: int, error: str,
                              now: float) -> int:
        async def give_up(conn: Conn) -> int:
            rows = await conn.fetch(
                "UPDATE webhook_outbox SET state = $1, last_error = $2, updated_at = $3"
                " WHERE webhook = $4 AND seq IN (SELECT seq FROM webhook_outbox WHERE"
                " webhook = $4 AND state = $5 ORDER BY seq LIMIT $6 FOR UPDATE SKIP LOCKED)"
                " RETURNING seq", FAILED, error, now, webhook, PENDING, count)
            return len(rows)

        return await self.db.read(give_up)

    async def webhook_backlog(self) -> dict[str, Backlog]:
        rows = await self.db.fetch(
            "SELECT webhook, state, count(*), min(created_at), (SELECT last_error FROM"
            " webhook_outbox f WHERE f.webhook = o.webhook AND f.state = o.state"
            " ORDER BY updated_at DESC LIMIT 1) FROM webhook_outbox o"
            " GROUP BY webhook, state")
        return backlog_of(tuple(r) for r in rows)

    async def webhook_prune(self, *, delivered_before: float, failed_before: float,
                            limit: int = 1000) -> int:
        async def prune(conn: Conn) -> int:
            rows = await conn.fetch(
                "DELETE FROM webhook_outbox WHERE (webhook, seq) IN (SELECT webhook, seq"
                " FROM webhook_outbox WHERE (state = $1 AND updated_at < $2) OR (state = $3"
                " AND updated_at < $4) LIMIT $5 FOR UPDATE SKIP LOCKED) RETURNING seq",
                DELIVERED, delivered_before, FAILED, failed_before, limit)
            return len(rows)

        return await self.db.read(prune)
