"""The SQLite store's reads: those that come while one runs go together in one hop to the
reader's thread, and each caller still gets its own answer or its own error."""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from turnkeeper.store.base import StoreError
from turnkeeper.store.sqlite import SQLiteStore

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SQLiteStore]:
    s = SQLiteStore(tmp_path / "state.db")
    await s.open()
    async with anyio.create_task_group() as tg:
        await tg.start(s.run)
        try:
            yield s
        finally:
            await s.close()


def record(turn_id: str) -> dict[str, Any]:
    return {"id": turn_id, "session": turn_id, "state": "queued", "message": f"m {turn_id}",
            "created_at": 1.0, "updated_at": 1.0, "inbox": [], "budget": {},
            "deadline": None}


def count_hops(store: SQLiteStore) -> list[int]:
    """The number of reads each hop to the reader's thread carried."""
    hops: list[int] = []
    run = store.reader._read_batch

    def counted(batch: Any, outcomes: Any) -> None:
        hops.append(len(batch))
        run(batch, outcomes)

    store.reader._read_batch = counted  # type: ignore[method-assign]
    return hops


async def test_concurrent_reads_share_hops_and_each_gets_its_own_answer(
        store: SQLiteStore) -> None:
    for i in range(50):
        await store.insert_turn(record(f"t_{i}"), {})
    hops = count_hops(store)
    got: dict[str, Any] = {}

    async def read(turn_id: str) -> None:
        got[turn_id] = await store.get_turn(turn_id)

    async with anyio.create_task_group() as tg:
        for i in range(50):
            tg.start_soon(read, f"t_{i}")
    assert {k: v["message"] for k, v in got.items()} == {
        f"t_{i}": f"m t_{i}" for i in range(50)}
    assert sum(hops) == 50 and len(hops) <= 3, hops  # the first alone, then the rest


async def test_a_read_that_fails_fails_alone(store: SQLiteStore) -> None:
    await store.insert_turn(record("t_a"), {})
    results: dict[str, Any] = {}

    def damaged(_: sqlite3.Connection) -> Any:
        raise ValueError("Expecting value: line 1 column 1 (char 0)")

    def broken(c: sqlite3.Connection) -> Any:
        return c.execute("SELECT * FROM no_such_table").fetchall()

    async def call(name: str, work: Any) -> None:
        try:
            results[name] = await store.reader.run(work)
        except Exception as exc:
            results[name] = exc

    async with anyio.create_task_group() as tg:
        tg.start_soon(call, "first", lambda c: c.execute("SELECT 1").fetchall())
        tg.start_soon(call, "damaged", damaged)
        tg.start_soon(call, "broken", broken)
        tg.start_soon(call, "good", lambda c: c.execute("SELECT id FROM turns").fetchall())
    assert results["first"] == [(1,)] and results["good"] == [("t_a",)]
    assert isinstance(results["damaged"], StoreError) and "damaged row" in str(
        results["damaged"])
    assert isinstance(results["broken"], StoreError) and "no such table" in str(
        results["broken"])


async def test_a_read_cancelled_while_it_waits_is_not_made(store: SQLiteStore) -> None:
    ran: list[str] = []
    gate = anyio.Event()

    def slow(_: sqlite3.Connection) -> str:
        anyio.from_thread.run(gate.wait)
        ran.append("slow")
        return "slow"

    def quick(name: str) -> Any:
        def work(_: sqlite3.Connection) -> str:
            ran.append(name)
            return name
        return work

    answers: list[str] = []
    async with anyio.create_task_group() as tg:
        async def call(work: Any) -> None:
            answers.append(await store.reader.run(work))

        tg.start_soon(call, slow)
        await anyio.wait_all_tasks_blocked()
        with anyio.CancelScope() as scope:
            scope.cancel()
            await store.reader.run(quick("cancelled"))
        tg.start_soon(call, quick("after"))
        await anyio.wait_all_tasks_blocked()
        gate.set()
    assert ran == ["slow", "after"] and sorted(answers) == ["after", "slow"]


async def test_close_waits_for_the_read_in_the_readers_thread(tmp_path: Path) -> None:
    """A background read (the webhook sender's, a follower's) may be in the reader's
    thread when the store closes: the connection is closed after it, never under it (a
    connection closed while a thread reads it crashed the process), and a read that
    comes after the close fails as a StoreError."""
    s = SQLiteStore(tmp_path / "state.db")
    await s.open()
    entered, gate = anyio.Event(), anyio.Event()

    def slow(conn: sqlite3.Connection) -> Any:
        anyio.from_thread.run_sync(entered.set)
        anyio.from_thread.run(gate.wait)
        return conn.execute("SELECT 1").fetchall()

    answers: list[Any] = []
    async with anyio.create_task_group() as tg:
        async def read() -> None:
            answers.append(await s.reader.run(slow))

        tg.start_soon(read)
        await entered.wait()
        tg.start_soon(s.close)
        await anyio.wait_all_tasks_blocked()
        gate.set()
    assert answers == [[(1,)]]
    with pytest.raises(StoreError, match="closed"):
        await s.reader.run(lambda c: c.execute("SELECT 1").fetchall())
