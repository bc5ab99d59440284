"""The PostgreSQL store's schema and its migrations, versioned like the SQLite ones.

The version lives in a one-row `schema_version` table. Migrations run in order, each in
its own transaction together with the version it reaches, so a crash during one leaves
the database at the version before it. Daemons starting at the same time on one
database take a transaction-level advisory lock first: one migrates, the others find
the work done. A database from a newer turnkeeper is refused before anything is
written to it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from turnkeeper.store.base import StoreError, stored_message_of

if TYPE_CHECKING:
    import asyncpg

    Conn = asyncpg.Connection | asyncpg.pool.PoolConnectionProxy

SCHEMA_VERSION = 13

# The advisory lock key that serialises migrations ("tk" "migr" as an integer).
MIGRATION_LOCK = 0x746B_6D69_6772
# Rows a migration step that reads every turn writes back at a time.
MIGRATION_BATCH = 1000


async def _messages_apart(conn: Conn) -> None:
    """Every turn's message into its `message` column, from its record, read through a
    cursor and written MIGRATION_BATCH rows at a time. Read here, not with `->>`, which
    fails on a whole row (and so the migration) for a NUL character (`\\u0000`) anywhere
    in its record."""
    update = "UPDATE turns SET message = $2 WHERE id = $1"
    batch: list[tuple[str, str]] = []
    async for row in conn.cursor("SELECT id, record FROM turns"):
        message = stored_message_of(row["record"])
        if message is not None:
            batch.append((row["id"], message))
        if len(batch) == MIGRATION_BATCH:
            await conn.executemany(update, batch)
            batch = []
    await conn.executemany(update, batch)


# Migrations: index i brings the schema from version i to i + 1; a step is a statement,
# or a function of the connection for what SQL cannot do.
MIGRATIONS: tuple[tuple[str | Callable[[Conn], Awaitable[None]], ...], ...] = (
    (
        # Turns are numbered by a sequence, so submissions on any node share one order.
        "CREATE SEQUENCE turn_seq",
        """CREATE TABLE turns (
            id TEXT PRIMARY KEY,
            seq BIGINT NOT NULL UNIQUE,
            session TEXT NOT NULL,
            state TEXT NOT NULL,
            created_at DOUBLE PRECISION NOT NULL,
            updated_at DOUBLE PRECISION NOT NULL,
            record TEXT NOT NULL,
            checkpoint TEXT NOT NULL DEFAULT '{}',
            stop_code TEXT,
            replayed_by TEXT
        )""",
        "CREATE INDEX turns_state ON turns (state, seq)",
        "CREATE INDEX turns_session ON turns (session, seq)",
        "CREATE INDEX turns_stop_code ON turns (stop_code, seq) WHERE stop_code IS NOT NULL",
        """CREATE TABLE messages (
            turn TEXT NOT NULL,
            idx INTEGER NOT NULL,
            data TEXT NOT NULL,
            PRIMARY KEY (turn, idx)
        )""",
        """CREATE TABLE events (
            seq BIGINT PRIMARY KEY,
            pos BIGINT GENERATED ALWAYS AS IDENTITY UNIQUE,
            turn TEXT,
            ts DOUBLE PRECISION NOT NULL,
            type TEXT NOT NULL,
            data TEXT NOT NULL
        )""",
        "CREATE INDEX events_turn ON events (turn, seq)",
        """CREATE TABLE journal (
            key TEXT PRIMARY KEY,
            turn TEXT NOT NULL,
            tool TEXT NOT NULL,
            arguments TEXT NOT NULL,
            idempotent BOOLEAN NOT NULL,
            outcome TEXT
        )""",
        """CREATE TABLE meta (
            key TEXT PRIMARY KEY,
            value BIGINT NOT NULL
        )""",
    ),
    (
        # The fleet: the daemons sharing the database, and each turn's claim: the node
        # that holds it, until when, and the fencing epoch every write of it carries.
        """CREATE TABLE nodes (
            node_id TEXT PRIMARY KEY,
            pid INTEGER NOT NULL,
            host TEXT NOT NULL,
            started_at TIMESTAMPTZ NOT NULL,
            heartbeat_at TIMESTAMPTZ NOT NULL,
            stopped_at TIMESTAMPTZ,
            turns INTEGER NOT NULL DEFAULT 0
        )""",
        "ALTER TABLE turns ADD COLUMN owner TEXT",
        "ALTER TABLE turns ADD COLUMN epoch BIGINT NOT NULL DEFAULT 0",
        "ALTER TABLE turns ADD COLUMN lease_until TIMESTAMPTZ",
        # The claimable turns, oldest first: the unfinished ones.
        "CREATE INDEX turns_unfinished ON turns (seq) WHERE state NOT IN"
        " ('blocked', 'cancelled', 'completed', 'failed', 'partial')",
        "CREATE INDEX turns_owner ON turns (owner) WHERE owner IS NOT NULL",
    ),
    (
        # Messages (steer, answer, cancel) for a turn another node runs: kept until the
        # node holding the turn has applied them.
        """CREATE TABLE mail (
            id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
            turn TEXT NOT NULL,
            kind TEXT NOT NULL,
            body TEXT NOT NULL
        )""",
        "CREATE INDEX mail_turn ON mail (turn, id)",
    ),
    (
        # Circuit breakers a node opened: every node keeps the peer's breaker open too.
        """CREATE TABLE breakers (
            name TEXT PRIMARY KEY,
            open_until TIMESTAMPTZ NOT NULL,
            node TEXT NOT NULL
        )""",
    ),
    (
        # Each node's retry budget counts (provider -> [requests, retries] in flight).
        "ALTER TABLE nodes ADD COLUMN budgets TEXT NOT NULL DEFAULT '{}'",
    ),
    (
        # Retention deletes a finished turn's journal entries with it.
        "CREATE INDEX journal_turn ON journal (turn)",
    ),
    (
        # The fleet's failure streak of each breaker, which every node adds to: a row
        # may hold a streak and no opening yet.
        "ALTER TABLE breakers ADD COLUMN failures INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE breakers ALTER COLUMN open_until DROP NOT NULL",
    ),
    (
        # A turn's trail: its partial-work lines, loop guard keys and side effects'
        # outcomes, a few kilobytes of them a row, each row written once (a checkpoint
        # holds their count).
        """CREATE TABLE trail (
            turn TEXT NOT NULL,
            idx INTEGER NOT NULL,
            data TEXT NOT NULL,
            PRIMARY KEY (turn, idx)
        )""",
    ),
    (
        # A turn's message (as JSON: `stored_message`), written once when the turn is
        # inserted: a record saved later is written without it. The turns already there
        # get theirs from their record, which keeps its own copy until it is next saved.
        "ALTER TABLE turns ADD COLUMN message TEXT",
        _messages_apart,
    ),
    (
        # Retry-After windows a node heard: every node keeps from calling the peer
        # (provider or tool) until the window ends.
        """CREATE TABLE retry_after (
            name TEXT PRIMARY KEY,
            until TIMESTAMPTZ NOT NULL,
            node TEXT NOT NULL
        )""",
    ),
    (
        # Submits' Idempotency-Keys: the turn each made and the fingerprint of the submit,
        # written in the turn's transaction; the key is unique, so one key is one turn
        # whichever node took the submit.
        """CREATE TABLE idempotency_keys (
            key TEXT PRIMARY KEY,
            turn TEXT NOT NULL,
            fingerprint TEXT NOT NULL,
            created_at DOUBLE PRECISION NOT NULL
        )""",
        "CREATE INDEX idempotency_keys_created ON idempotency_keys (created_at)",
    ),
    (
        # The webhook outbox: a row per webhook and event it takes, written with the
        # event's row, kept until it is delivered or given up; a node sending one holds
        # it by a lease (store/outbox.py).
        """CREATE TABLE webhook_outbox (
            webhook TEXT NOT NULL,
            seq BIGINT NOT NULL,
            type TEXT NOT NULL,
            body TEXT NOT NULL,
            created_at DOUBLE PRECISION NOT NULL,
            state TEXT NOT NULL DEFAULT 'pending',
            attempts INTEGER NOT NULL DEFAULT 0,
            next_at DOUBLE PRECISION NOT NULL,
            updated_at DOUBLE PRECISION NOT NULL,
            last_error TEXT,
            claimed_by TEXT,
            claim_until DOUBLE PRECISION,
            PRIMARY KEY (webhook, seq)
        )""",
        "CREATE INDEX webhook_outbox_due ON webhook_outbox (webhook, state, next_at)",
    ),
    (
        # The transaction that wrote each event: `pos` is taken when the row is inserted,
        # so two transactions in flight commit their rows out of `pos` order, and a
        # reader following `pos` alone would step over the one that commits last. A
        # follower reads by (tx, pos), only rows of transactions older than every one
        # still running (store/postgres_fleet.py).
        "ALTER TABLE events ADD COLUMN tx xid8 NOT NULL DEFAULT pg_current_xact_id()",
        "CREATE INDEX events_tx ON events (tx, pos)",
    ),
)


async def prepare(conn: Conn, where: str) -> None:
    """Bring the schema of the database on `conn` to `SCHEMA_VERSION`; `where` names it
    in errors (the URL without its password). Raises StoreError when it must not be used."""
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock($1)", MIGRATION_LOCK)
        await conn.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
        version = await conn.fetchval("SELECT max(version) FROM schema_version")
        if version is None:
            await conn.execute("INSERT INTO schema_version (version) VALUES (0)")
            version = 0
    if version > SCHEMA_VERSION:
        raise StoreError(
            f"state database {where} has schema version {version}, newer than this "
            f"turnkeeper understands ({SCHEMA_VERSION}); refusing to touch it (run the "
            "newer turnkeeper, or restore a backup made by this one)")
    while version < SCHEMA_VERSION:
        async with conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock($1)", MIGRATION_LOCK)
            current = await conn.fetchval("SELECT max(version) FROM schema_version")
            if current == version:  # not migrated by another daemon meanwhile
                for step in MIGRATIONS[version]:
                    if isinstance(step, str):
                        await conn.execute(step)
                    else:
                        await step(conn)
                await conn.execute("UPDATE schema_version SET version = $1", version + 1)
                current = version + 1
            version = current
    if version > SCHEMA_VERSION:
        raise StoreError(f"state database {where} was migrated to schema version "
                         f"{version} by a newer turnkeeper while this one started")
