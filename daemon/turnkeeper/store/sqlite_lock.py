"""One daemon per state database: an exclusive lock on the database file itself.

Two daemons on one store would resume the same turns and repeat their side effects, so
the second one is refused (exit 69, like a socket another daemon listens on). The lock is
`flock` on an open descriptor of the database file: the kernel drops it when the process
dies, kill -9 included, so a crash never leaves a stale lock behind, and no file can be
deleted to get around it (deleting the database itself leaves the first daemon on the
old inode and the second on a new, empty store: nothing is shared or run twice). SQLite's
own locks are POSIX record locks, which `flock` does not touch. A small file beside the
database names the holder's pid, for the refusal message; it is also locked, so a
daemon from before the lock moved onto the database still refuses this one and the other
way round.

Both files are opened without following a link (ELOOP: the store refuses to open, naming
the path). A database created here is created 0600 (SQLite gives its `-wal` and `-shm` files the
database's mode): turns hold users' messages and tools' answers.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

from turnkeeper.store.base import StoreInUse

DB_MODE = 0o600
# Never through a link: a link planted where the database or its pid file should be
# would have the daemon write its pid into (truncate) a file of the planter's choosing.
_OPEN_FLAGS = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW


def _flock(fd: int) -> bool:
    """True when the exclusive lock was taken; False when another process holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EACCES):
            return False
        raise
    return True


def lock_exclusive(lock_path: Path, db_path: Path) -> tuple[int, int]:
    """Take the lock for the life of the process: the two descriptors (the database's and
    the pid file's) to close to release it."""
    db_fd = os.open(db_path, _OPEN_FLAGS, DB_MODE)
    try:
        pid_fd = os.open(lock_path, _OPEN_FLAGS, DB_MODE)
    except BaseException:
        os.close(db_fd)
        raise
    try:
        if not (_flock(db_fd) and _flock(pid_fd)):
            holder = os.pread(pid_fd, 32, 0).decode(errors="replace").strip()
            raise StoreInUse(
                f"state database {db_path} is in use by another turnkeeper"
                + (f" (pid {holder})" if holder else "")
                + "; two daemons on one state directory would run the same turns "
                "twice")
        os.ftruncate(pid_fd, 0)
        os.pwrite(pid_fd, f"{os.getpid()}\n".encode(), 0)
    except BaseException:
        os.close(pid_fd)
        os.close(db_fd)
        raise
    return db_fd, pid_fd
