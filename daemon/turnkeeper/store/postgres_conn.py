"""The PostgreSQL store's connections (`PgConnection`, a part the store and its other
parts share): the pool, the dedicated connections, the outage state, and reads that
survive a lost connection. The writer that commits over them is `postgres_writer.py`.

The writer and the lease renewal each have a connection of their own (`Dedicated`),
outside the pool: a connection handed back to an asyncpg pool is reset first (a round
trip the releasing task awaits), so a commit that went through the pool cost every step
one more round trip after its COMMIT; and a renewal that waited for a pooled connection
behind claims and reads could miss its lease over a slow link. Reads, claims and the
rest share the pool.

A lost connection (the server restarted, a backend terminated, the network gone) is not
a failed write: the writer keeps the batch, reconnects with backoff and commits it when
the server answers, so no write is reported done before it is durable and nothing
queued is dropped; only after `fatal_after` seconds without a server are the waiting
writes failed (StoreError). `degraded` tells the daemon's health while it waits.

Driver: asyncpg. Measured against psycopg 3 on this machine (1,000 transactions of an
UPDATE and an INSERT on a local server, median of 3 rounds alternated): asyncpg 1.47
ms and 0.53 ms of CPU per transaction, psycopg 1.39 ms and 0.58 ms of CPU. The wall
time is the server's commit either way; asyncpg spends ~9% less of the daemon's CPU,
brings its own pool and LISTEN support, and pipelines `executemany` in one round trip.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import socket
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import anyio
import asyncpg
import structlog

from turnkeeper.clock import Clock, SystemClock
from turnkeeper.config.redact import redact_url
from turnkeeper.policy.store_outage import StoreOutage
from turnkeeper.store.base import StoreError, StoreUnavailable
from turnkeeper.store.postgres_batch import Conn

POOL_SIZE = 4
# Transactions the steps' writer has in flight at once, each on a connection of its own
# (`postgres_writer.py`).
WRITERS = 2
CONNECT_TIMEOUT = 10.0
COMMAND_TIMEOUT = 60.0
BACKOFF_FIRST = 0.05
READ_RETRY_S = 10.0
BACKOFF_MAX = 2.0

_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, check_circular=False)

# What a lost or unusable connection raises; an error the server reports about a
# statement (a constraint, a type) is a PostgresError that is not one of these.
CONNECTION_ERRORS: tuple[type[BaseException], ...] = (
    OSError, TimeoutError, asyncpg.InterfaceError, asyncpg.PostgresConnectionError,
    asyncpg.exceptions.InternalClientError,
    asyncpg.exceptions.AdminShutdownError, asyncpg.exceptions.CrashShutdownError,
    asyncpg.exceptions.CannotConnectNowError, asyncpg.exceptions.TooManyConnectionsError)
DB_ERRORS: tuple[type[BaseException], ...] = (asyncpg.PostgresError, *CONNECTION_ERRORS)

# A transaction the server rolled back to break a deadlock (40P01) or a serialization
# failure (40001) did nothing: it is sent again at once, up to CONFLICT_RETRIES times,
# not left to the next heartbeat or the writer's next batch. Lock order makes a deadlock
# between the store's own statements impossible (see `postgres_batch.TURN_UPDATE`); the
# retry is for what that leaves (an operator's session, a statement that locks one row).
CONFLICTS: tuple[type[BaseException], ...] = (
    asyncpg.exceptions.DeadlockDetectedError, asyncpg.exceptions.SerializationError)
CONFLICT_RETRIES = 3
# A read or a renewal rolled back is sent again after a few milliseconds at random: the
# session it deadlocked with gets the rows it was waiting for first, instead of meeting
# the retry on them again (a one-statement renewal is back on the rows within a
# millisecond on a local server).
CONFLICT_JITTER_S = (0.005, 0.025)

_T = TypeVar("_T")
log = structlog.get_logger("turnkeeper.store")


def lost(exc: BaseException) -> bool:
    """The connection failed, not the statement (a bad argument is a DataError, which
    asyncpg derives from InterfaceError)."""
    return (isinstance(exc, CONNECTION_ERRORS)
            and not isinstance(exc, asyncpg.exceptions.DataError))


async def commit_until_reachable(
        commit: Callable[[], Awaitable[list[BaseException | None]]], size: int, *,
        outage: StoreOutage, clock: Clock, where: str, closed: Callable[[], bool],
        reconnected: Callable[[], None]) -> list[BaseException | None]:
    """`commit()` a batch of `size` writes; while the server cannot be reached, wait (the
    outage's backoff) and send the whole batch again, up to `store.fatal_after` or until
    the store is `closed()`: then every write fails with StoreUnavailable. A write whose
    caller gave up on it stays in the batch: a lost connection may have lost only the
    answer to a commit the server made, so leaving it out could not promise it was not
    made. The steps' writer and the submits' both commit this way."""
    while True:
        try:
            errors = await commit()
        except Exception as exc:
            if not lost(exc):
                raise
            now = clock.monotonic()
            if closed() or outage.fatal(now=now):
                return [StoreUnavailable(
                    f"state database {where} unreachable for "
                    f"{outage.failing_for(now=now):.0f} s: "
                    f"{type(exc).__name__}: {exc}")] * size
            delay = outage.failed(f"state database {where} unreachable: "
                                  f"{type(exc).__name__}", now=now, rand=random.uniform)
            reconnected()
            await clock.sleep(delay)
            continue
        outage.recovered()
        return errors


def dumps(value: Any) -> str:
    return _ENCODER.encode(value)


async def _reset(conn: asyncpg.Connection) -> None:
    """A pooled connection handed back: a transaction left open (a read cut short) is
    rolled back. asyncpg's own reset sends four statements (advisory locks, cursors,
    LISTEN, settings) at every release, one round trip each read or claim waits for, and
    statements on the database's CPU, at the pace of every node's claims: the store
    leaves none of those on a pooled connection (its advisory lock is a transaction's,
    LISTEN has a connection of its own, no session setting is changed)."""
    if conn.is_in_transaction():
        await conn.execute("ROLLBACK")


class Dedicated:
    """A connection of one task's own (the writer's, the lease renewal's), outside the
    pool: made when the store opens (`PgConnection.open_dedicated`) and again when
    next needed after it was lost, never reset between uses. `lock` keeps two uses from
    overlapping.

    `warm`: the statements the connection will run, prepared (parsed and described)
    once it is made. A new server session reads the tables' and types' catalog entries
    the first time a statement names them, and asyncpg looks up the array types a
    statement's parameters use (a recursive query of the type catalog, ~25 ms on a new
    session): a node's connections made while its first turns run would put that on
    their steps, and on the database's CPU during them, once for every connection of
    every node."""

    def __init__(self, connect: Callable[[], Awaitable[asyncpg.Connection]],
                 warm: Sequence[str] = ()) -> None:
        self._connect = connect
        self.warm = tuple(warm)
        self.conn: asyncpg.Connection | None = None
        self.lock = anyio.Lock()
        self.connects = 0

    async def get(self) -> asyncpg.Connection:
        if self.conn is None or self.conn.is_closed():
            self.conn = None
            conn = await self._connect()
            try:
                for sql in self.warm:
                    await conn.prepare(sql)
            except BaseException:
                conn.terminate()
                raise
            self.conn = conn
            self.connects += 1
        return self.conn

    def drop(self) -> None:
        """Never used again (lost, or left in an unknown state by a cancellation)."""
        conn, self.conn = self.conn, None
        if conn is not None:
            conn.terminate()

    def after(self, exc: BaseException) -> None:
        """A use of the connection ended with `exc`: dropped when it was lost, cancelled
        (maybe mid-statement) or left inside a transaction; kept after a statement the
        server refused and rolled back."""
        conn = self.conn
        if conn is not None and (lost(exc) or not isinstance(exc, Exception)
                                 or conn.is_in_transaction()):
            self.drop()

    async def close(self) -> None:
        conn, self.conn = self.conn, None
        if conn is None:
            return
        with anyio.CancelScope(shield=True):
            try:
                with anyio.fail_after(5):
                    await conn.close()
            except Exception:
                conn.terminate()


class PgConnection:
    """The pool, the writer's and the lease renewal's own connections, the outage state
    every writer shares, and the reads (`read`, `fetch`). No store calls: the store's
    other parts send theirs through this one."""

    def __init__(self, url: str, *, clock: Clock | None, fatal_after: float,
                 pool_size: int, node_id: str | None) -> None:
        self.clock = clock or SystemClock()
        self.url = url
        self.node_id = node_id or f"{socket.gethostname()[:60]}-{secrets.token_hex(3)}"
        self.where = redact_url(url)
        self.pool_size = pool_size
        self.pool: asyncpg.Pool | None = None
        self._settings: dict[str, str] = {}
        # The writer's connection and the lease renewal's, outside the pool.
        self.writer_conns = [Dedicated(self.connect_writer) for _ in range(WRITERS)]
        self.writer_conn = self.writer_conns[0]
        self.lease_conn = Dedicated(self.connect_one)
        self.dedicated = [*self.writer_conns, self.lease_conn]
        # Whether writes go through; while the server cannot be reached they wait, and
        # past `fatal_after` they fail (policy/store_outage.py, as for the SQLite file).
        self.outage = StoreOutage(fatal_after_s=fatal_after)
        self.reconnects = 0
        self.conflicts = 0  # transactions sent again after a deadlock or a serialization failure

    @property
    def degraded(self) -> str | None:
        """Why writes wait, while they do."""
        return self.outage.last_error if self.outage.degraded else None

    async def connect(self, lease_s: float) -> asyncpg.Pool:
        """The pool, its sessions named after this node."""
        settings = {
            "application_name": f"turnkeeper {self.node_id} pid {os.getpid()}",
            # A node paused inside a transaction (SIGSTOP, a long GC) would hold its rows
            # locked, and claims skip locked rows: the server ends such a session well
            # before the lease runs out, so another node can take the turns over.
            "idle_in_transaction_session_timeout": str(int(lease_s * 1000 / 3)),
        }
        self._settings = settings
        self.pool = await asyncpg.create_pool(
            self.url, min_size=1, max_size=self.pool_size, timeout=CONNECT_TIMEOUT,
            command_timeout=COMMAND_TIMEOUT, server_settings=settings, reset=_reset)
        return self.pool

    async def open_dedicated(self, *more: Dedicated) -> None:
        """Make the dedicated connections (these and `more`) at once, before the node
        takes work: none is made on the path of a step."""
        async with anyio.create_task_group() as tg:
            for conn in (*self.dedicated, *more):
                tg.start_soon(conn.get)

    async def connect_one(self, **settings: str) -> asyncpg.Connection:
        """A connection outside the pool (`Dedicated`), with the pool's settings and
        `settings`."""
        if self.pool is None:
            raise asyncpg.InterfaceError("store is closed")
        return await asyncpg.connect(self.url, timeout=CONNECT_TIMEOUT,
                                     command_timeout=COMMAND_TIMEOUT,
                                     server_settings={**self._settings, **settings})

    async def connect_writer(self) -> asyncpg.Connection:
        """A steps' writer connection. Its statements keep one plan each (a generic
        plan, made at the first use): the server otherwise plans the one-statement step
        commit (`postgres_fused.FUSED`, some twenty CTEs) again at every execution,
        its custom plans never costed above its generic one, ~0.7 ms of the database's
        CPU a commit against ~0.03 ms with the plan kept; the same for every node, so
        the more nodes split the steps into smaller batches the more it cost a step.
        Every statement a writer sends finds its rows by key (`= ANY` of an array,
        `unnest` joined on the primary key): a generic plan is the one it would get."""
        return await self.connect_one(plan_cache_mode="force_generic_plan")

    async def close(self) -> None:
        for conn in self.writer_conns:
            await conn.close()
        await self.lease_conn.close()
        if self.pool is not None:
            pool, self.pool = self.pool, None
            with anyio.CancelScope(shield=True):
                try:
                    with anyio.fail_after(5):
                        await pool.close()
                except Exception:  # a connection that cannot close cleanly is dropped
                    pool.terminate()

    def conflicted(self, what: str, exc: BaseException) -> None:
        self.conflicts += 1
        log.warning("store.conflict_retried", node=self.node_id, transaction=what,
                    error=f"{type(exc).__name__}: {exc}")

    # -- reads --------------------------------------------------------------------

    def require_pool(self) -> asyncpg.Pool:
        if self.pool is None:
            raise StoreError("state database is closed: nothing can be read")
        return self.pool

    async def read(self, read: Callable[[Conn], Awaitable[_T]], *,
                   on: Dedicated | None = None) -> _T:
        """Run `read` on a pooled connection (or on the dedicated connection `on`, one
        use at a time). A connection found dead (the server
        restarted, a backend terminated) is dropped and the read tried again, with
        backoff, for up to READ_RETRY_S; then it fails (StoreError). A transaction the
        server rolled back for a deadlock or a serialization failure is run again at
        once (a lease renewal among them: not at the next heartbeat)."""
        pool = self.require_pool()
        started = self.clock.monotonic()
        delay = BACKOFF_FIRST
        conflicts = 0
        while True:
            try:
                if on is not None:
                    return await self._read_on(on, read)
                async with pool.acquire() as conn:
                    try:
                        return await read(conn)
                    except BaseException as exc:
                        if lost(exc):
                            conn.terminate()
                        raise
            except CONFLICTS as exc:  # rolled back: sent again at once, a few times
                if conflicts >= CONFLICT_RETRIES:
                    raise StoreError(f"state database transaction failed: "
                                     f"{type(exc).__name__}: {exc}") from exc
                conflicts += 1
                self.conflicted(getattr(read, "__name__", "read"), exc)
                await self.clock.sleep(random.uniform(*CONFLICT_JITTER_S))
                continue
            except DB_ERRORS as exc:
                if not lost(exc) or self.clock.monotonic() - started >= READ_RETRY_S \
                        or self.pool is None:
                    raise StoreError(f"state database read failed: {type(exc).__name__}: "
                                     f"{exc}") from exc
                self.reconnects += 1
            await self.clock.sleep(delay)
            delay = min(delay * 2, BACKOFF_MAX)

    async def _read_on(self, on: Dedicated, read: Callable[[Conn], Awaitable[_T]]) -> _T:
        async with on.lock:
            conn = await on.get()
            try:
                return await read(conn)
            except BaseException as exc:
                on.after(exc)
                raise

    async def fetch(self, sql: str, *args: Any) -> list[asyncpg.Record]:
        async def fetch(conn: Conn) -> list[asyncpg.Record]:
            return await conn.fetch(sql, *args)

        return await self.read(fetch)
