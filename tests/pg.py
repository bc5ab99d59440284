"""A fresh PostgreSQL database for a test, on the server TURNKEEPER_TEST_PG names (else
postgresql://postgres@127.0.0.1:5432/postgres), dropped afterwards.

Where no server answers, the tests that need one are skipped with the reason, so the
README's test command works on a machine with only Python; CI sets
TURNKEEPER_TEST_PG_REQUIRED=1 (`.ci/run` starts a server first), and there a missing
server fails them. TURNKEEPER_TEST_PG=skip turns them off on purpose.
"""

from __future__ import annotations

import os
import secrets
import urllib.parse
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

from turnkeeper.store.postgres import PostgresStore

DEFAULT_SERVER = "postgresql://postgres@127.0.0.1:5432/postgres"


def server_url() -> str:
    url = os.environ.get("TURNKEEPER_TEST_PG", "") or DEFAULT_SERVER
    if url == "skip":
        pytest.skip("TURNKEEPER_TEST_PG=skip: the PostgreSQL tests were turned off")
    return url


def with_database(url: str, name: str) -> str:
    parts = urllib.parse.urlsplit(url)
    return urllib.parse.urlunsplit(parts._replace(path="/" + name))


async def _admin(url: str) -> Any:
    import asyncpg

    try:
        return await asyncpg.connect(url, timeout=10)
    except (OSError, asyncpg.PostgresError) as exc:
        why = (f"no PostgreSQL server at {url} ({exc}): start one (.ci/run does), point "
               "TURNKEEPER_TEST_PG at one, or set TURNKEEPER_TEST_PG=skip")
        if os.environ.get("TURNKEEPER_TEST_PG_REQUIRED"):  # CI: a missing server fails
            pytest.fail(why)
        pytest.skip(why)


async def create_database() -> str:
    """A new empty database; its URL."""
    url = server_url()
    name = "tk_test_" + secrets.token_hex(6)
    conn = await _admin(url)
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    return with_database(url, name)


async def drop_database(db_url: str) -> None:
    name = urllib.parse.urlsplit(db_url).path.lstrip("/")
    conn = await _admin(with_database(db_url, urllib.parse.urlsplit(server_url()).path
                                      .lstrip("/") or "postgres"))
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await conn.close()


@asynccontextmanager
async def fresh_database() -> AsyncIterator[str]:
    url = await create_database()
    try:
        yield url
    finally:
        await drop_database(url)


class CuttableProxy:
    """A TCP proxy in front of the server that a test can cut (every connection closed,
    new ones refused) and restore on the same port: the database gone, then back."""

    def __init__(self, target_url: str) -> None:
        parts = urllib.parse.urlsplit(target_url)
        self.target = (parts.hostname or "127.0.0.1", parts.port or 5432)
        self.target_url = target_url
        self.port = 0
        self._server: Any = None
        self._writers: set[Any] = set()

    def url(self) -> str:
        parts = urllib.parse.urlsplit(self.target_url)
        user = f"{parts.username}@" if parts.username else ""
        return urllib.parse.urlunsplit(parts._replace(netloc=f"{user}127.0.0.1:{self.port}"))

    async def start(self) -> None:
        import asyncio

        async def pipe(reader: Any, writer: Any) -> None:
            try:
                while data := await reader.read(65536):
                    writer.write(data)
                    await writer.drain()
            except (OSError, asyncio.CancelledError):
                pass
            finally:
                writer.close()

        async def handle(reader: Any, writer: Any) -> None:
            try:
                up_reader, up_writer = await asyncio.open_connection(*self.target)
            except OSError:
                writer.close()
                return
            self._writers.update((writer, up_writer))
            await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
            self._writers.difference_update((writer, up_writer))

        self._server = await asyncio.start_server(handle, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def cut(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    async def close(self) -> None:
        await self.cut()


class FreshPostgresStore(PostgresStore):
    """The PostgreSQL store on a database of its own, created on open and dropped on
    close: each test starts from an empty one."""

    def __init__(self) -> None:
        super().__init__("postgresql://unset/")

    async def open(self) -> None:
        self.url = await create_database()
        await super().open()

    async def close(self) -> None:
        await super().close()
        if self.url != "postgresql://unset/":
            await drop_database(self.url)
            self.url = "postgresql://unset/"
