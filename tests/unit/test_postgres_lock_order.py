"""Lock order in the PostgreSQL store, on a real server: a node's lease renewal and its
writer's batched commit lock the same turn rows, and must never wait for each other.

The race is made certain rather than hoped for: a third session holds the row in the
middle, both statements are let run until the server shows each of them waiting for a
lock, and only then is the middle row let go. If the two took their rows in different
orders (the renewal in its held order, the batch in the reverse), each would by then
hold half of the rows the other needs, and the server would break the deadlock by
rolling one back (the store counts each such transaction it sends again:
`conflicts`)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import asyncpg
import pytest

from turnkeeper.store.postgres import PostgresStore

pytestmark = pytest.mark.anyio

TURNS = 200


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def node(db: str) -> AsyncIterator[PostgresStore]:
    store = PostgresStore(db, node_id="n0", lease_s=60.0)
    async with anyio.create_task_group() as tg:
        await store.open()
        await tg.start(store.run)
        try:
            yield store
        finally:
            await store.close()


def running(turn_id: str) -> dict[str, Any]:
    return {"id": turn_id, "session": turn_id, "state": "running", "message": "m",
            "created_at": 1.0, "updated_at": 2.0, "inbox": []}


async def waiting_for_locks(db: str, n: int) -> None:
    """Until `n` sessions of the database wait for a row lock (a guard against a hang
    only: the test waits on the server's own view, never on time)."""
    conn = await asyncpg.connect(db)
    try:
        deadline = time.monotonic() + 30
        while await conn.fetchval(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                " AND wait_event_type = 'Lock'") < n:
            assert time.monotonic() < deadline, "the statements never met the held row"
            await anyio.sleep(0.01)
    finally:
        await conn.close()


async def test_a_renewal_and_a_batched_commit_of_the_same_turns_never_deadlock(
        db: str, node: PostgresStore) -> None:
    ids = [f"t_{i:04d}" for i in range(TURNS)]
    for turn_id in ids:
        await node.insert_turn({**running(turn_id), "state": "queued"}, {})
    assert len(await node.claim(TURNS)) == TURNS  # held in id order: the renewal's order
    blocker = await asyncpg.connect(db)
    tx = blocker.transaction()
    await tx.start()
    await blocker.execute("SELECT 1 FROM turns WHERE id = $1 FOR UPDATE", ids[TURNS // 2])
    renewed: dict[str, int] = {}
    try:
        async with anyio.create_task_group() as tg:
            # One batch of the writer, its turns in the reverse order of the renewal's.
            for turn_id in reversed(ids):
                assert node.queue_turn(running(turn_id), {"step": 1})

            async def renew() -> None:
                renewed.update(await node.renew())

            tg.start_soon(node.flush)
            tg.start_soon(renew)
            await waiting_for_locks(db, 2)
            await tx.rollback()
    finally:
        await blocker.close()
    assert node.conflicts == 0  # no transaction was rolled back to break a deadlock
    assert renewed == {turn_id: 1 for turn_id in ids}  # every lease renewed
    conn = await asyncpg.connect(db)
    try:
        states = await conn.fetch("SELECT state, checkpoint FROM turns")
    finally:
        await conn.close()
    assert {(r["state"], r["checkpoint"]) for r in states} == {("running", '{"step":1}')}


async def test_a_renewal_rolled_back_by_a_deadlock_is_sent_again_at_once(
        db: str, node: PostgresStore) -> None:
    """A session of someone else's (an operator's, say) locks the rows the other way
    round: the server rolls the renewal back, and the store sends it again then, not a
    heartbeat later."""
    for turn_id in ("t_a", "t_b"):
        await node.insert_turn({**running(turn_id), "state": "queued"}, {})
    assert len(await node.claim(2)) == 2
    other = await asyncpg.connect(db)
    tx = other.transaction()
    await tx.start()
    # The renewal waits first, so its backend is the one that finds the deadlock.
    await other.execute("SET LOCAL deadlock_timeout = '60s'")
    await other.execute("SELECT 1 FROM turns WHERE id = 't_b' FOR UPDATE")
    renewed: dict[str, int] = {}
    try:
        async with anyio.create_task_group() as tg:
            async def renew() -> None:
                renewed.update(await node.renew())

            async def lock_a_then_let_go() -> None:
                await other.execute("SELECT 1 FROM turns WHERE id = 't_a' FOR UPDATE")
                await tx.rollback()

            tg.start_soon(renew)
            await waiting_for_locks(db, 1)  # the renewal holds t_a and waits for t_b
            tg.start_soon(lock_a_then_let_go)
    finally:
        await other.close()
    assert node.conflicts == 1
    assert renewed == {"t_a": 1, "t_b": 1}
