"""The connection half of the embedded SQLite store: the file, its lock, the writer's
commits with their retries while the store cannot be written, and the reader.

Under a crash (kill -9, power loss) the database holds exactly the transactions that
committed: a write whose await returned, and every event enqueued before it. Events
that must never be kept without their state (`turn.queued`, `turn.finished`,
`turn.message`) are written in the same transaction as the turn's row. A transaction
that fails takes none of its neighbours down with it: the batch is retried write by
write and only the write that fails reports the error. A write that fails for the
store's own reason (a full disk, an I/O error, a lock held elsewhere) is not reported at
all: it is retried with backoff, in order, until it goes through, and the store reports
the outage (`outage`) so the daemon can say it is degraded (`policy/store_outage.py`).
One daemon at a time: an exclusive lock on the database file refuses a second one (exit
69, like a socket another daemon listens on), which would otherwise resume the same
turns and repeat their side effects. A database that cannot be read, fails its integrity check or
comes from a newer schema stops start-up (StoreError, exit 74); it is never replaced by
a new, empty one.

"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import random
import sqlite3
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar, cast

import anyio
import structlog
from anyio.abc import TaskGroup

from turnkeeper.clock import Clock, SystemClock
from turnkeeper.policy.store_outage import DEFAULT_FATAL_AFTER_S, StoreOutage
from turnkeeper.store.base import StoreError, StoreUnavailable, record_of
from turnkeeper.store.sqlite_lock import lock_exclusive
from turnkeeper.store.sqlite_schema import prepare
from turnkeeper.store.writer import TRAIL, GroupCommitWriter, MessageWrite, Write

log = structlog.get_logger("turnkeeper.store")

# SQLite's primary result codes that are the store's failure, not the write's: busy or
# locked past the timeout, out of memory, read-only, I/O error, full, cannot open,
# locking protocol. A constraint or a malformed statement is the write's own.
_UNAVAILABLE_CODES = frozenset({5, 6, 7, 8, 10, 13, 14, 15})
# While the store is failing, one log line at most this often (and one when it recovers).
OUTAGE_LOG_EVERY_S = 10.0

Statement = tuple[str, Sequence[Any]]
# A write's ops: statements, and a turn's conversation rows (turned into statements when
# they commit, so a dropped checkpoint's rows can join the newer write's: see the writer).
Op = Statement | MessageWrite
_T = TypeVar("_T")


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


# The number of the turn whose id is the parameter: a turn's rows are keyed by it.
TURN_NO = "(SELECT seq FROM turns WHERE id = ?)"
# What the events' index orders them by: their turn's number, or its id where they have
# none (stored before the number was, or their turn has no row). Its values have no type
# affinity, and a value compared with them must have none either (`+seq`, not `seq`), or
# SQLite converts each one instead of using the index.
EVENT_TURN_KEY = "coalesce(turn_no, turn)"

# Rows per INSERT statement (3 parameters each, far below SQLite's limit of 32,766).
_ROWS_PER_INSERT = 500


# A trail row of a turn that has a row. The trail only grows (a checkpoint never counts
# fewer lines than the one before it), so its rows are only added, one statement for
# all of them: a row at an index already there (a write that failed, sent again) is
# replaced, and nothing past the rows written is ever left to delete.
_TRAIL_ROW = ("INSERT OR REPLACE INTO trail (turn_no, idx, data) SELECT seq, ?, ? FROM turns"
              " WHERE id = ?")


def message_statements(m: MessageWrite) -> list[Statement]:
    """Replace the turn's rows from `m.start` on, deleting those past the write's end
    first when it `trims` (a step's write only adds rows: nothing to delete). Rows are
    keyed by the turn's number, `m.turn_no` or, not given, looked up by its id: then a
    turn with no row gets none (as the UPDATE of its record, which matches nothing). The
    store gives the number only for a live turn whose row it inserted or read back."""
    number = m.turn_no
    if m.table == TRAIL:
        if number is None:
            return [(_TRAIL_ROW, (n, text, m.turn)) for n, text in enumerate(m.rows, m.start)]
        return [("INSERT OR REPLACE INTO trail (turn_no, idx, data) VALUES (?, ?, ?)",
                 (number, n, text)) for n, text in enumerate(m.rows, m.start)]
    out: list[Statement] = []
    if m.trims:
        turn_sql, turn_key = (TURN_NO, m.turn) if number is None else ("?", number)
        out.append((f"DELETE FROM messages WHERE turn_no = {turn_sql} AND idx >= ?",
                    (turn_key, m.start)))
    rows = m.rows
    for first in range(0, len(rows), _ROWS_PER_INSERT):
        chunk = rows[first:first + _ROWS_PER_INSERT]
        params: list[Any] = []
        if number is None:
            for n, text in enumerate(chunk, m.start + first):
                params += (n, text)
            params.append(m.turn)
            out.append((
                "INSERT OR REPLACE INTO messages (turn_no, idx, data) SELECT t.seq,"
                " v.column1, v.column2 FROM (VALUES " + ",".join(["(?,?)"] * len(chunk))
                + ") AS v JOIN turns AS t ON t.id = ?", params))
        else:
            for n, text in enumerate(chunk, m.start + first):
                params += (number, n, text)
            out.append(("INSERT OR REPLACE INTO messages (turn_no, idx, data) VALUES "
                        + ",".join(["(?,?,?)"] * len(chunk)), params))
    return out


def _statements(ops: Iterable[Op]) -> Iterator[Statement]:
    for op in ops:
        if isinstance(op, MessageWrite):
            yield from message_statements(op)
        else:
            yield op


def _probe(now: float) -> Op:
    """A one-row write that needs the disk as any write does."""
    return ("INSERT INTO meta (key, value) VALUES ('writable_probe', ?) ON CONFLICT(key)"
            " DO UPDATE SET value = excluded.value", (int(now),))


class SQLiteConnection(GroupCommitWriter[Op]):
    """The file and its two connections; the store's calls are in `SQLiteStore`."""

    def __init__(self, path: Path, *, clock: Clock | None = None,
                 fatal_after_s: float = DEFAULT_FATAL_AFTER_S) -> None:
        self._clock: Clock = clock or SystemClock()
        super().__init__(self._clock)
        self.path = path
        self.outage = StoreOutage(fatal_after_s=fatal_after_s)
        self._outage_logged_at: float | None = None
        self._writer: sqlite3.Connection | None = None
        self._reader: sqlite3.Connection | None = None
        self._read_lock = anyio.Lock()
        self._reads: list[_Read] = []  # reads waiting for the next hop to the reader
        self._tg: TaskGroup | None = None
        self._lock_fds: tuple[int, ...] = ()
        self._next_seq = 0
        # Turn id -> its number (`turns.seq`), for the turns not finished whose row this
        # store inserted or read back: their event, message and trail rows are keyed by it.
        self._numbers: dict[str, int] = {}
        self.commits = 0
        self.commit_cpu_s = 0.0  # the writer thread's CPU in its transactions

    # -- lifecycle ----------------------------------------------------------------

    async def open(self) -> None:
        await anyio.to_thread.run_sync(self._open_sync)

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None,
                               timeout=30.0)
        conn.execute("PRAGMA busy_timeout = 30000")
        return conn

    @property
    def lock_path(self) -> Path:
        return self.path.with_name(self.path.name + ".lock")

    def _lock_sync(self) -> None:
        self._lock_fds = lock_exclusive(self.lock_path, self.path)

    def _open_sync(self) -> None:
        conn: sqlite3.Connection | None = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o750)
            self._lock_sync()
            conn = self._connect()
            prepare(conn, self.path)
            row = conn.execute("SELECT COALESCE(MAX(seq), 0) FROM turns").fetchone()
            self._next_seq = int(row[0])
            self._writer = conn
            self._reader = self._connect()
        except BaseException as exc:
            if conn is not None:
                conn.close()
            self._unlock_sync()
            if isinstance(exc, sqlite3.DatabaseError):
                raise StoreError(f"state database {self.path} cannot be opened: {exc} "
                                 "(not a turnkeeper database, or damaged; restore it from "
                                 "a backup or move it aside)") from None
            if isinstance(exc, OSError) and exc.errno == errno.ELOOP:
                raise StoreError(f"state file {exc.filename} is a symbolic link: the "
                                 "store opens its files only directly (remove the link)"
                                 ) from None
            if isinstance(exc, OSError):
                raise StoreError(f"state directory {self.path.parent} is not usable: "
                                 f"{exc.strerror or exc}") from None
            if isinstance(exc, ValueError):  # a migration read a row that is not JSON
                raise StoreError(f"state database {self.path} holds a damaged row ({exc}); "
                                 "restore it from a backup") from None
            raise

    def _unlock_sync(self) -> None:
        for fd in self._lock_fds:
            os.close(fd)  # closing the descriptor releases the flock
        self._lock_fds = ()

    async def close(self) -> None:
        await self._stop_writer()
        if self._writer is not None:
            await anyio.to_thread.run_sync(self._writer.close)
        # A read batch may be in the reader's thread (a background reader: the webhook
        # sender, a follower): the connection is closed once it is done, never under it
        # (closing a connection a thread is reading crashes the process).
        async with self._read_lock:
            if self._reader is not None:
                await anyio.to_thread.run_sync(self._reader.close)
            self._writer = self._reader = None
        self._unlock_sync()

    # -- the writer's commits ---------------------------------------------------------

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
                    log.warning("store.recovered", path=str(self.path))
                    self._outage_logged_at = None
                return
            pending, error = self._drop_withdrawn(pending[cut:]), errors[cut]
            now = self._clock.monotonic()
            if not pending:
                # Every waiting write was withdrawn: a write nobody awaits takes their
                # place, so the store keeps trying the disk and says it is writable
                # again only once the disk takes a write (a store that stopped trying
                # would stay degraded, refusing every submit, for ever).
                pending = [Write([_probe(now)])]
            if self.outage.fatal(now=now) or self._closed:
                why = ("unwritable for "
                       f"{self.outage.failing_for(now=now):.0f} s" if not self._closed
                       else "closing while unwritable")
                self._answer(pending, [StoreUnavailable(
                    f"state database {why}: {error}")] * len(pending))
                return
            delay = self.outage.failed(f"{type(error).__name__}: {error}", now=now,
                                       rand=random.uniform)
            if self._outage_logged_at is None or \
                    now - self._outage_logged_at >= OUTAGE_LOG_EVERY_S:
                self._outage_logged_at = now
                log.error("store.unwritable", path=str(self.path), error=str(error),
                          waiting_writes=len(pending),
                          failing_for_s=round(self.outage.failing_for(now=now), 3),
                          fatal_after_s=self.outage.fatal_after_s)
            await self._clock.sleep(delay)

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
        conn = self._writer
        assert conn is not None, "store is not open"
        try:
            self._transaction(conn, [s for w in batch for s in w.ops])
            self.commits += 1
            return [None] * len(batch)
        except Exception as exc:
            if len(batch) == 1 or store_unavailable(exc):
                return [exc] * len(batch)
        errors: list[BaseException | None] = []
        for w in batch:
            try:
                self._transaction(conn, w.ops)
                self.commits += 1
                errors.append(None)
            except Exception as exc:
                if store_unavailable(exc):
                    return errors + [exc] * (len(batch) - len(errors))
                errors.append(exc)
        return errors

    @staticmethod
    def _transaction(conn: sqlite3.Connection, ops: Iterable[Op]) -> None:
        conn.execute("BEGIN IMMEDIATE")
        try:
            # A run of the same statement (event rows queued back to back) goes as one
            # executemany: the statement is looked up once for the run.
            run: list[Sequence[Any]] = []
            run_sql = ""
            for sql, params in _statements(ops):
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

    # -- reads --------------------------------------------------------------------

    async def _in_reader(self, work: Callable[[sqlite3.Connection], _T]) -> _T:
        """`work(reader)` in a worker thread. Reads run one at a time, and those that
        come while one runs go together, one after another, in the next hop to the
        thread: a read each cost a hop there and back through the event loop, which
        under load waits its turn (after a restart 1,000 resumed turns each reading
        their journal and events took seconds one by one). A row that is not the JSON
        this store wrote (a damaged database that passed its quick check) is a
        StoreError naming it, never a traceback; each read gets its own answer."""
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        read = (work, done)
        self._reads.append(read)
        try:
            async with self._read_lock:
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
        conn = self._reader
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
                    f"state database {self.path} holds a damaged row ({exc}); restore it"
                    " from a backup"), exc)))
            except Exception as exc:
                outcomes.append((False, exc))

    async def _read(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        return await self._in_reader(lambda c: c.execute(sql, params).fetchall())

    async def _read_json(self, sql: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]:
        """The first column of each row, decoded in the worker thread: 10,000 records
        decoded on the event loop held every turn up for half a second."""
        return await self._in_reader(
            lambda c: [json.loads(r[0]) for r in c.execute(sql, params)])

    async def _read_records(self, sql: str, params: Sequence[Any] = ()
                            ) -> list[dict[str, Any]]:
        """Turn records from rows of (record, message), decoded in the worker thread, as
        `_read_json`."""
        return await self._in_reader(
            lambda c: [record_of(r, m) for r, m in c.execute(sql, params)])
