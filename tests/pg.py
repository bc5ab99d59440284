"""A fresh PostgreSQL database for a test, on the server TURNKEEPER_TEST_PG names (else
postgresql://postgres@127.0.0.1:5432/postgres), dropped afterwards.

Where no server answers, the tests that need one are skipped with the reason, so the
README's test command works on a machine with only Python; CI sets
TURNKEEPER_TEST_PG_REQUIRED=1 (`.ci/run` starts a server first), and there a missing
server fails them. TURNKEEPER_TEST_PG=skip turns them off on purpose.
"""

from __future__ import annotations

import contextlib
import os
import queue
import secrets
import socket
import threading
import time
import urllib.parse
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

from turnkeeper.store.postgres import PostgresStore

DEFAULT_SERVER = "postgresql://postgres@127.0.0.1:5432/postgres"

# The tests marked `postgres` (tests/conftest.py sets it at collection): `-m "not
# postgres"` must leave out every test that needs the server, so one that reaches it
# unmarked fails, naming the mark.
MARKED_POSTGRES: frozenset[str] = frozenset()


def _check_marked() -> None:
    current = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    if current and current not in MARKED_POSTGRES:
        pytest.fail(f"{current} uses the PostgreSQL server but is not marked postgres: "
                    "add @pytest.mark.postgres (tests/conftest.py marks those it sees)")


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

    _check_marked()

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
    """A TCP proxy on 127.0.0.1 in front of the server `target_url` names, that a test
    can cut (every connection closed, new ones refused) and restore on the same port:
    the database gone, then back. Threads carry the bytes, so it serves a test's own
    event loop and daemons in other processes alike. `delay`: seconds each chunk of
    bytes waits in each direction (a database that far away, one way), its order and
    the throughput kept."""

    def __init__(self, target_url: str, *, delay: float = 0.0) -> None:
        self.delay = delay
        parts = urllib.parse.urlsplit(target_url)
        self.target = (parts.hostname or "127.0.0.1", parts.port or 5432)
        self.target_url = target_url
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self.port = 0
        self.accepted = 0

    def url(self) -> str:
        """`target_url` through the proxy."""
        parts = urllib.parse.urlsplit(self.target_url)
        user = f"{parts.username}@" if parts.username else ""
        return urllib.parse.urlunsplit(parts._replace(netloc=f"{user}127.0.0.1:{self.port}"))

    def start(self) -> CuttableProxy:
        """Listen (again: on the same port after a cut)."""
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self.port = listener.getsockname()[1]
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()
        return self

    restore = start

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # cut
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._listener is not listener:
                    client.close()
                    upstream.close()
                    return
                self._conns.update((client, upstream))
                self.accepted += 1
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        if self.delay > 0:
            self._pump_delayed(src, dst)
            return
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            self._shut(src, dst)

    def _pump_delayed(self, src: socket.socket, dst: socket.socket) -> None:
        """Read as bytes come; a second thread sends each chunk `delay` after it came."""
        chunks: queue.SimpleQueue[tuple[float, bytes]] = queue.SimpleQueue()

        def send() -> None:
            try:
                while data := (item := chunks.get())[1]:
                    wait = item[0] - time.monotonic()
                    if wait > 0:
                        time.sleep(wait)
                    dst.sendall(data)
            except OSError:
                pass
            finally:
                self._shut(src, dst)

        threading.Thread(target=send, daemon=True).start()
        try:
            while data := src.recv(65536):
                chunks.put((time.monotonic() + self.delay, data))
        except OSError:
            pass
        finally:
            chunks.put((0.0, b""))

    @staticmethod
    def _shut(*sockets: socket.socket) -> None:
        for s in sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
            conns, self._conns = self._conns, set()
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        for s in conns:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    close = cut


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
