"""The callers of one commit resume a bounded number per turn of the event loop, on a
real SQLite file: a commit that answered a thousand turns at once held the loop for all
of their next stretches before a timer or a request could run."""

from __future__ import annotations

import asyncio
from pathlib import Path

import anyio
import pytest

from turnkeeper.store.sqlite import SQLiteStore
from turnkeeper.store.writer import WAKE_CHUNK

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_a_commit_wakes_its_callers_a_chunk_per_turn_of_the_loop(tmp_path: Path
                                                                      ) -> None:
    store = SQLiteStore(tmp_path / "state.sqlite3")
    await store.open()
    callers = 3 * WAKE_CHUNK + 5
    ticks = 0
    woken_at: list[int] = []
    writing = True

    async def ticker() -> None:
        nonlocal ticks
        while writing:
            ticks += 1
            await asyncio.sleep(0)

    async def caller() -> None:
        await store.flush()
        woken_at.append(ticks)

    async with anyio.create_task_group() as tg:
        await tg.start(store.run)
        tg.start_soon(ticker)
        async with anyio.create_task_group() as callers_tg:
            for _ in range(callers):
                callers_tg.start_soon(caller)
        writing = False
        assert store.commits < callers  # they shared commits: the case at hand
        await store.close()
        tg.cancel_scope.cancel()
    assert len(woken_at) == callers
    per_tick = {t: woken_at.count(t) for t in set(woken_at)}
    assert max(per_tick.values()) <= WAKE_CHUNK
