"""The SQLite store's reader part: its reads, on the reader connection, in a worker
thread, those that come while one runs together in the next hop there.

A read each cost a hop to the thread and back through the event loop, which under load
waits its turn (after a restart 1,000 resumed turns each reading their journal and
events took seconds one by one). A row that is not the JSON this store wrote (a damaged
database that passed its quick check) is a StoreError naming it, never a traceback; each
read gets its own answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import anyio

from turnkeeper.store.base import StoreError, record_of
from turnkeeper.store.sqlite_conn import SQLiteConnection

_T = TypeVar("_T")
# A read waiting for the reader: its work, and the future its caller waits on.
_Read = tuple[Callable[[sqlite3.Connection], Any], "asyncio.Future[Any]"]


def _caused(error: StoreError, cause: BaseException) -> StoreError:
    error.__cause__ = cause
    return error


def _answer_reads(batch: list[_Read], outcomes: list[tuple[bool, Any]]) -> None:
    """Each caller of `batch` its outcome; one the thread never reached (it failed)
    hears its read was not made."""
    for i, (_, done) in enumerate(batch):
        if done.done():  # its caller was cancelled
            continue
        if i >= len(outcomes):
            done.set_exception(StoreError("state database read was not made"))
        elif outcomes[i][0]:
            done.set_result(outcomes[i][1])
        else:
            done.set_exception(outcomes[i][1])


class SQLiteReader:
    """The reads of a `SQLiteConnection`, one batch at a time under its `read_lock`."""

    def __init__(self, connection: SQLiteConnection) -> None:
        self._conn = connection
        self._reads: list[_Read] = []  # reads waiting for the next hop to the reader

    async def run(self, work: Callable[[sqlite3.Connection], _T]) -> _T:
        """`work(reader)` in a worker thread, with the reads that wait beside it."""
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        read = (work, done)
        self._reads.append(read)
        try:
            async with self._conn.read_lock:
                if not done.done():  # not taken by the batch before: this one takes it
                    batch, self._reads = self._reads, []
                    outcomes: list[tuple[bool, Any]] = []
                    try:
                        await anyio.to_thread.run_sync(self._read_batch, batch, outcomes)
                    finally:
                        _answer_reads(batch, outcomes)
        except BaseException:
            if not done.done():  # cancelled before it was read: it is not
                with contextlib.suppress(ValueError):
                    self._reads.remove(read)
                done.cancel()
            elif not done.cancelled():
                done.exception()  # answered, and its caller has gone: nothing to report
            raise
        return cast(_T, done.result())

    def _read_batch(self, batch: list[_Read], outcomes: list[tuple[bool, Any]]) -> None:
        """Each read of `batch` in turn, its answer (or its error) into `outcomes`."""
        conn = self._conn.reader
        for work, _ in batch:
            try:
                if conn is None:
                    raise sqlite3.ProgrammingError("the state database is closed")
                outcomes.append((True, work(conn)))
            except sqlite3.DatabaseError as exc:
                outcomes.append((False, _caused(StoreError(
                    f"state database read failed: {exc}"), exc)))
            except ValueError as exc:  # json.JSONDecodeError
                outcomes.append((False, _caused(StoreError(
                    f"state database {self._conn.path} holds a damaged row ({exc}); restore"
                    " it from a backup"), exc)))
            except Exception as exc:
                outcomes.append((False, exc))

    async def rows(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        return await self.run(lambda c: c.execute(sql, params).fetchall())

    async def json_rows(self, sql: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]:
        """The first column of each row, decoded in the worker thread: 10,000 records
        decoded on the event loop held every turn up for half a second."""
        return await self.run(lambda c: [json.loads(r[0]) for r in c.execute(sql, params)])

    async def records(self, sql: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]:
        """Turn records from rows of (record, message), decoded in the worker thread, as
        `json_rows`."""
        return await self.run(lambda c: [record_of(r, m) for r, m in c.execute(sql, params)])
