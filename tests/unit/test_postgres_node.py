"""A fleet node's connections on PostgreSQL: made at open, the writers' plans kept, a
pooled connection handed back rolled back; a claim whose rows cannot be read."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anyio
import asyncpg
import pytest
from tests.pg import fresh_database

from turnkeeper.store import postgres_fleet
from turnkeeper.store.base import StoreError
from turnkeeper.store.postgres import PostgresStore

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def db() -> AsyncIterator[str]:
    async with fresh_database() as url:
        yield url


@pytest.fixture
async def nodes(db: str) -> AsyncIterator[list[PostgresStore]]:
    stores = [PostgresStore(db, node_id=f"n{i}") for i in range(2)]
    async with anyio.create_task_group() as tg:
        for store in stores:
            await store.open()
            await tg.start(store.run)
        try:
            yield stores
        finally:
            for store in stores:
                await store.close()


def record(turn_id: str) -> dict[str, Any]:
    return {"id": turn_id, "session": turn_id, "state": "queued", "message": "m",
            "created_at": 1.0, "updated_at": 1.0, "inbox": []}


async def test_a_claim_whose_rows_cannot_be_read_hands_its_turns_back_at_once(
        nodes: list[PostgresStore], db: str, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = nodes
    await a.insert_turn(record("t_0"), {"i": 0})
    # The claim commits on its own; the read of its rows after it fails.
    monkeypatch.setattr(postgres_fleet, "CLAIMED_ROWS", "SELECT no_such_column")
    with pytest.raises(StoreError):
        await a.claim(1)
    assert a.claims == {}
    conn = await asyncpg.connect(db)
    try:
        row = await conn.fetchrow("SELECT owner, epoch FROM turns WHERE id = 't_0'")
    finally:
        await conn.close()
    assert (row["owner"], row["epoch"]) == (None, 1)
    monkeypatch.undo()
    # Not left to its lease: another node takes it now, under a new epoch.
    [got] = await b.claim(1)
    assert (got.record["id"], got.epoch, got.checkpoint) == ("t_0", 2, {"i": 0})


async def test_a_nodes_connections_are_made_at_open_the_writers_keeping_their_plans(
        nodes: list[PostgresStore]) -> None:
    a = nodes[0]
    assert all(d.conn is not None for d in (*a.db.writer_conns, a.db.lease_conn,
                                            a.intake.connection))
    writer = a.db.writer_conns[0].conn
    assert writer is not None
    assert await writer.fetchval("SHOW plan_cache_mode") == "force_generic_plan"
    pool = a.db.require_pool()
    async with pool.acquire() as conn:
        assert await conn.fetchval("SHOW plan_cache_mode") == "auto"
        await conn.execute("BEGIN")  # handed back in a transaction: rolled back
        await conn.execute("UPDATE turns SET owner = 'x'")
    async with pool.acquire() as conn:
        assert not conn.is_in_transaction()
        assert await conn.fetchval("SELECT count(*) FROM turns WHERE owner = 'x'") == 0
