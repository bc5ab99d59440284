"""What the nodes of a fleet share through the PostgreSQL store: retry budget counts,
breakers (a streak of failures and the time a breaker stays open, by the database's
clock) and Retry-After windows; a change every node must hear at once is NOTIFYed.
"""

from __future__ import annotations

import json

import asyncpg

from turnkeeper.store.fleet import CHANNEL_BREAKERS, CHANNEL_RETRY_AFTER, breaker_notice
from turnkeeper.store.postgres_batch import Conn
from turnkeeper.store.postgres_conn import PgConnection, dumps

# The seconds a breakers row stays open, by the database's clock (NULL: not open).
OPEN_LEFT_S = ("CASE WHEN open_until > now() THEN extract(epoch FROM open_until - now())"
               " END")


SHARE_BUDGETS = (
    "WITH u AS (UPDATE nodes SET budgets = $2 WHERE node_id = $1)"
    " SELECT budgets FROM nodes WHERE node_id <> $1 AND stopped_at IS NULL"
    " AND heartbeat_at > now() - make_interval(secs => $3)")


class PgShared:
    """The fleet's shared budgets, breakers and Retry-After windows, through `db`."""

    def __init__(self, db: PgConnection, lease_s: float) -> None:
        self.db = db
        self.node_id = db.node_id
        self.lease_s = lease_s

    async def share_budgets(self, budgets: dict[str, tuple[int, int]]
                            ) -> dict[str, tuple[int, int]]:
        """Publish this node's retry budget counts (provider -> requests, retries in
        flight) and read the sum of the other live nodes' counts."""
        async def share(conn: Conn) -> list[asyncpg.Record]:
            # One statement (the other nodes' rows are read as they were before it, which
            # is all it reads), on the heartbeat's own connection, after the renewal.
            return await conn.fetch(SHARE_BUDGETS, self.node_id, dumps(budgets), self.lease_s)

        totals: dict[str, tuple[int, int]] = {}
        for row in await self.db.read(share, on=self.db.lease_conn):
            for provider, (requests, retries) in json.loads(row["budgets"]).items():
                r, t = totals.get(provider, (0, 0))
                totals[provider] = (r + int(requests), t + int(retries))
        return totals

    async def open_breaker(self, name: str, for_s: float) -> None:
        """This node opened the breaker of a peer (provider or tool) for `for_s` seconds:
        every node keeps it open as long (NOTIFY tells them at once)."""
        async def publish(conn: Conn) -> None:
            # One statement, its own transaction (one round trip): the row, and the
            # NOTIFY the commit delivers.
            await conn.execute(
                "WITH b AS (INSERT INTO breakers AS b (name, open_until, node) VALUES ($1,"
                " now() + make_interval(secs => $2), $3) ON CONFLICT (name) DO UPDATE"
                " SET open_until = GREATEST(b.open_until, excluded.open_until),"
                " node = excluded.node) SELECT pg_notify($4, $5)",
                name, for_s, self.node_id, CHANNEL_BREAKERS, breaker_notice(name, for_s))

        await self.db.read(publish)

    async def add_breaker_failures(self, name: str, failures: int, *, reset: bool,
                                   threshold: int, cooldown_s: float
                                   ) -> tuple[int, float | None]:
        """Add this node's failures to the fleet's streak of a breaker (after setting it
        back to zero if `reset`: a success here broke it). When the streak reaches
        `threshold` and the breaker is not open, it opens for `cooldown_s` in the same
        transaction and every node hears it at once (NOTIFY). Returns the streak and the
        seconds the breaker stays open (None: not open), by the database's clock."""
        async def add(conn: Conn) -> tuple[int, float | None]:
            async with conn.transaction():
                row = await conn.fetchrow(
                    "INSERT INTO breakers AS b (name, open_until, node, failures)"
                    " VALUES ($1, NULL, $2, $3) ON CONFLICT (name) DO UPDATE SET failures"
                    " = CASE WHEN $4 THEN 0 ELSE b.failures END + excluded.failures"
                    f" RETURNING failures, {OPEN_LEFT_S} AS left_s",
                    name, self.node_id, failures, reset)
                assert row is not None  # an upsert returns its row
                streak, left = int(row["failures"]), row["left_s"]
                if left is None and streak >= threshold:
                    left = await conn.fetchval(
                        "UPDATE breakers SET open_until = now() + make_interval(secs =>"
                        " $2), node = $3 WHERE name = $1 RETURNING extract(epoch FROM"
                        " open_until - now())", name, cooldown_s, self.node_id)
                    await conn.execute("SELECT pg_notify($1, $2)", CHANNEL_BREAKERS,
                                       breaker_notice(name, float(left)))
                return streak, None if left is None else float(left)

        return await self.db.read(add)

    async def shared_breakers(self) -> dict[str, tuple[int, float | None]]:
        """Every breaker the fleet shares: name -> (streak, seconds it stays open or
        None), by the database's clock, so nodes' clocks need not agree."""
        rows = await self.db.fetch(
            f"SELECT name, failures, {OPEN_LEFT_S} AS s FROM breakers")
        return {r["name"]: (int(r["failures"]), None if r["s"] is None else float(r["s"]))
                for r in rows}

    async def share_retry_after(self, name: str, for_s: float) -> None:
        """A peer (provider or tool) asked this node, in a Retry-After, not to be called
        for `for_s` seconds: every node keeps from calling it as long (NOTIFY tells them
        at once). A window already open longer is kept."""
        async def publish(conn: Conn) -> None:
            await conn.execute(  # one statement, as `open_breaker`
                "WITH w AS (INSERT INTO retry_after AS w (name, until, node) VALUES ($1,"
                " now() + make_interval(secs => $2), $3) ON CONFLICT (name) DO UPDATE"
                " SET until = GREATEST(w.until, excluded.until), node = excluded.node)"
                " SELECT pg_notify($4, $5)",
                name, for_s, self.node_id, CHANNEL_RETRY_AFTER, breaker_notice(name, for_s))

        await self.db.read(publish)

    async def shared_retry_after(self) -> dict[str, float]:
        """Every open Retry-After window of the fleet: name -> seconds left, by the
        database's clock."""
        rows = await self.db.fetch(
            "SELECT name, extract(epoch FROM until - now()) AS s FROM retry_after"
            " WHERE until > now()")
        return {r["name"]: float(r["s"]) for r in rows}
