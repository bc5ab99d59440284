"""The SQLite store's connection part: the file, its lock, and its two connections.

One daemon at a time: an exclusive lock on the database file refuses a second one (exit
69, like a socket another daemon listens on), which would otherwise resume the same
turns and repeat their side effects. A database that cannot be read, fails its integrity
check or comes from a newer schema stops start-up (StoreError, exit 74); it is never
replaced by a new, empty one.

The writer connection is used by the writer part (`sqlite_writer.py`) in one worker
thread at a time, the reader connection by the reader part (`sqlite_reader.py`) under
`read_lock`; every SQLite call runs in a worker thread, never on the event loop.
"""

from __future__ import annotations

import errno
import os
import sqlite3
from pathlib import Path

import anyio

from turnkeeper.store.base import StoreError
from turnkeeper.store.sqlite_lock import lock_exclusive
from turnkeeper.store.sqlite_schema import prepare


def _open_error(path: Path, exc: BaseException) -> StoreError | None:
    """What start-up says when opening `path` failed with `exc` (None: raise it as is)."""
    if isinstance(exc, sqlite3.DatabaseError):
        return StoreError(f"state database {path} cannot be opened: {exc} (not a turnkeeper"
                          " database, or damaged; restore it from a backup or move it"
                          " aside)")
    if isinstance(exc, OSError) and exc.errno == errno.ELOOP:
        return StoreError(f"state file {exc.filename} is a symbolic link: the store opens"
                          " its files only directly (remove the link)")
    if isinstance(exc, OSError):
        return StoreError(f"state directory {path.parent} is not usable: "
                          f"{exc.strerror or exc}")
    if isinstance(exc, ValueError):  # a migration read a row that is not JSON
        return StoreError(f"state database {path} holds a damaged row ({exc}); restore it"
                          " from a backup")
    return None


class SQLiteConnection:
    """The file at `path`, locked while open, and its writer and reader connections
    (None while closed)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.writer: sqlite3.Connection | None = None
        self.reader: sqlite3.Connection | None = None
        # Held while a batch of reads is in the reader's thread: the reader is closed
        # only outside it.
        self.read_lock = anyio.Lock()
        self.last_turn_no = 0  # the highest turn number in the file when it was opened
        self._lock_fds: tuple[int, ...] = ()

    @property
    def lock_path(self) -> Path:
        return self.path.with_name(self.path.name + ".lock")

    async def open(self) -> None:
        """Lock the file, check it and bring its schema up to date, and connect; a file
        that cannot be opened raises StoreError, and is left unlocked."""
        await anyio.to_thread.run_sync(self._open_sync)

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None,
                               timeout=30.0)
        conn.execute("PRAGMA busy_timeout = 30000")
        return conn

    def _open_sync(self) -> None:
        conn: sqlite3.Connection | None = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o750)
            self._lock_fds = lock_exclusive(self.lock_path, self.path)
            conn = self._connect()
            prepare(conn, self.path)
            row = conn.execute("SELECT COALESCE(MAX(seq), 0) FROM turns").fetchone()
            self.last_turn_no = int(row[0])
            self.writer = conn
            self.reader = self._connect()
        except BaseException as exc:
            if conn is not None:
                conn.close()
            self._unlock()
            error = _open_error(self.path, exc)
            if error is not None:
                raise error from None
            raise

    def _unlock(self) -> None:
        for fd in self._lock_fds:
            os.close(fd)  # closing the descriptor releases the flock
        self._lock_fds = ()

    async def close(self) -> None:
        """Close both connections and release the lock (the writer part has stopped)."""
        if self.writer is not None:
            await anyio.to_thread.run_sync(self.writer.close)
        # A read batch may be in the reader's thread (a background reader: the webhook
        # sender, a follower): the connection is closed once it is done, never under it
        # (closing a connection a thread is reading crashes the process).
        async with self.read_lock:
            if self.reader is not None:
                await anyio.to_thread.run_sync(self.reader.close)
            self.writer = self.reader = None
        self._unlock()
