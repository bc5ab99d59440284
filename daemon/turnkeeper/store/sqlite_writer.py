"""The SQLite store's writer part: the group commit (`writer.py`) over the writer
connection, and its retries while the store cannot be written.

Under a crash (kill -9, power loss) the database holds exactly the transactions that
committed: a write whose await returned, and every event enqueued before it. Events
that must never be kept without their state (`turn.queued`, `turn.finished`,
`turn.message`) are written in the same transaction as the turn's row. A transaction
that fails takes none of its neighbours down with it: the batch is retried write by
write and only the write that fails reports the error. A write that fails for the
store's own reason (a full disk, an I/O error, a lock held elsewhere) is not reported at
all: it is retried with backoff, in order, until it goes through, and the store reports
the outage (`outage`) so the daemon can say it is degraded (`policy/store_outage.py`).
"""

from __future__ import annotations

import contextlib
import random
import sqlite3
import time
from collections.abc import Iterable, Sequence
from typing import Any

import anyio
import structlog

from turnkeeper.clock import Clock
from turnkeeper.policy.store_outage import StoreOutage
from turnkeeper.store.base import StoreUnavailable
from turnkeeper.store.sqlite_conn import SQLiteConnection
from turnkeeper.store.sqlite_statements import Op, probe, statements
from turnkeeper.store.writer import GroupCommitWriter, Write

log = structlog.get_logger("turnkeeper.store")

# SQLite's primary result codes that are the store's failure, not the write's: busy or
# locked past the timeout, out of memory, read-only, I/O error, full, cannot open,
# locking protocol. A constraint or a malformed statement is the write's own.
_UNAVAILABLE_CODES = frozenset({5, 6, 7, 8, 10, 13, 14, 15})
# While the store is failing, one log line at most this often (and one when it recovers).
OUTAGE_LOG_EVERY_S = 10.0


def store_unavailable(exc: BaseException) -> bool:
    """True when `exc` is the store failing (retry the write later), not the write."""
    if isinstance(exc, sqlite3.Error):
        code = getattr(exc, "sqlite_errorcode", None)
        if code is None:
            return isinstance(exc, sqlite3.OperationalError)
        return (int(code) & 0xFF) in _UNAVAILABLE_CODES
    return isinstance(exc, OSError)


def _execute_run(conn: sqlite3.Connection, sql: str, rows: list[Sequence[Any]]) -> None:
    if len(rows) == 1:
        conn.execute(sql, rows[0])
    elif rows:
        conn.executemany(sql, rows)


def _transaction(conn: sqlite3.Connection, ops: Iterable[Op]) -> None:
    conn.execute("BEGIN IMMEDIATE")
    try:
        # A run of the same statement (event rows queued back to back) goes as one
        # executemany: the statement is looked up once for the run.
        run: list[Sequence[Any]] = []
        run_sql = ""
        for sql, params in statements(ops):
            if sql != run_sql:
                _execute_run(conn, run_sql, run)
                run, run_sql = [], sql
            run.append(params)
        _execute_run(conn, run_sql, run)
        conn.execute("COMMIT")
    except BaseException:
        # SQLite may have rolled back by itself (a full disk, an I/O error): a second
        # ROLLBACK would raise and hide the error that matters.
        if conn.in_transaction:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
        raise


class SQLiteWriter(GroupCommitWriter[Op]):
    """The one writer task of a `SQLiteConnection`: its `_commit` is a transaction in a
    worker thread on the writer connection."""

    def __init__(self, connection: SQLiteConnection, clock: Clock, *,
                 fatal_after_s: float) -> None:
        super().__init__(clock)
        self._conn = connection
        self.outage = StoreOutage(fatal_after_s=fatal_after_s)
        self._outage_logged_at: float | None = None
        self.commits = 0
        self.commit_cpu_s = 0.0  # the writer thread's CPU in its transactions

    async def _commit(self, batch: list[Write[Op]]) -> None:
        """Commit `batch` in order. The writes the store itself cannot take (see
        `store_unavailable`) wait and are tried again, from the first of them on, until
        they go through, the outage turns fatal, or the store closes."""
        pending = batch
        while pending:
            try:
                errors = await anyio.to_thread.run_sync(self._commit_sync, pending)
            except Exception as exc:  # the thread itself failed
                errors = [exc] * len(pending)
            cut = next((i for i, e in enumerate(errors)
                        if e is not None and store_unavailable(e)), len(pending))
            self._answer(pending[:cut], errors[:cut])
            if cut == len(pending):
                if self.outage.recovered():
                    log.warning("store.recovered", path=str(self._conn.path))
                    self._outage_logged_at = None
                return
            pending = self._drop_withdrawn(pending[cut:])
            pending = await self._wait_out(pending, errors[cut])

    async def _wait_out(self, pending: list[Write[Op]], error: BaseException | None
                        ) -> list[Write[Op]]:
        """The store could not take `pending` (`error`): wait before they are tried
        again, or, when the outage turned fatal or the store closes, fail them (none
        left to try)."""
        now = self._writer_clock.monotonic()
        if not pending:
            # Every waiting write was withdrawn: a write nobody awaits takes their
            # place, so the store keeps trying the disk and says it is writable
            # again only once the disk takes a write (a store that stopped trying
            # would stay degraded, refusing every submit, for ever).
            pending = [Write([probe(now)])]
        if self.outage.fatal(now=now) or self._closed:
            why = ("unwritable for "
                   f"{self.outage.failing_for(now=now):.0f} s" if not self._closed
                   else "closing while unwritable")
            self._answer(pending, [StoreUnavailable(
                f"state database {why}: {error}")] * len(pending))
            return []
        delay = self.outage.failed(f"{type(error).__name__}: {error}", now=now,
                                   rand=random.uniform)
        if self._outage_logged_at is None or \
                now - self._outage_logged_at >= OUTAGE_LOG_EVERY_S:
            self._outage_logged_at = now
            log.error("store.unwritable", path=str(self._conn.path), error=str(error),
                      waiting_writes=len(pending),
                      failing_for_s=round(self.outage.failing_for(now=now), 3),
                      fatal_after_s=self.outage.fatal_after_s)
        await self._writer_clock.sleep(delay)
        return pending

    def _commit_sync(self, batch: list[Write[Op]]) -> list[BaseException | None]:
        """`_commit_batch`, its thread's CPU counted in `commit_cpu_s`."""
        started = time.thread_time()
        try:
            return self._commit_batch(batch)
        finally:
            self.commit_cpu_s += time.thread_time() - started

    def _commit_batch(self, batch: list[Write[Op]]) -> list[BaseException | None]:
        """One transaction for the batch. If it fails, each write gets its own, so one
        bad write fails alone, never its neighbours. A write the store itself cannot take
        ends the pass: it and the writes after it are left to retry in order (the events
        that reach the disk stay a prefix of those published)."""
        conn = self._conn.writer
        assert conn is not None, "store is not open"
        try:
            _transaction(conn, [s for w in batch for s in w.ops])
            self.commits += 1
            return [None] * len(batch)
        except Exception as exc:
            if len(batch) == 1 or store_unavailable(exc):
                return [exc] * len(batch)
        errors: list[BaseException | None] = []
        for w in batch:
            try:
                _transaction(conn, w.ops)
                self.commits += 1
                errors.append(None)
            except Exception as exc:
                if store_unavailable(exc):
                    return errors + [exc] * (len(batch) - len(errors))
                errors.append(exc)
        return errors
