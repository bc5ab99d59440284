"""What the fleet tests share: a fresh PostgreSQL database per test (the `db` fixture), a
tool server of the test's own (`server`) and synchronous reads of the database, to
watch real daemons from outside."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import asyncpg
import pytest

from tests.integration.tool_server import ToolServer
from tests.pg import create_database, drop_database

FINISHED = "('completed', 'partial', 'failed', 'blocked', 'cancelled')"


@pytest.fixture(name="server")
def fleet_server() -> Iterator[ToolServer]:
    """A tool server of the test's own (import `fleet_server`, ask for `server`)."""
    s = ToolServer().start()
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(name="db")
def fleet_db() -> Iterator[str]:
    """A new PostgreSQL database for the test (import `fleet_db`, ask for `db`)."""
    url = asyncio.run(create_database())
    try:
        yield url
    finally:
        asyncio.run(drop_database(url))


def query(db: str, sql: str, *args: Any) -> list[Any]:
    async def run() -> list[Any]:
        conn = await asyncpg.connect(db)
        try:
            return list(await conn.fetch(sql, *args))
        finally:
            await conn.close()
    return asyncio.run(run())


def wait_finished(db: str, n: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        [(done,)] = query(db, f"SELECT count(*) FROM turns WHERE state IN {FINISHED}")
        if done >= n:
            return
        if time.monotonic() > deadline:
            states = query(db, "SELECT state, owner, count(*) FROM turns GROUP BY 1, 2")
            raise AssertionError(f"{done} of {n} turns finished in {timeout} s: {states}")
        time.sleep(0.5)
