"""One daemon per state database: an exclusive lock on a file beside it.

Two daemons on one store would resume the same turns and repeat their side effects, so
the second one is refused (exit 69, like a socket another daemon listens on). The lock is
`flock` on an open descriptor: the kernel drops it when the process dies, kill -9
included, so a crash never leaves a stale lock behind. The file holds the holder's pid,
for the refusal message.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

from turnkeeper.store.base import StoreInUse


def lock_exclusive(lock_path: Path, db_path: Path) -> int:
    """Take the lock for the life of the process; the descriptor to close to release it."""
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o640)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EACCES):
            raise StoreInUse(
                f"state database {db_path} is in use by another turnkeeper"
                + (f" (pid {holder})" if holder else "")
                + "; two daemons on one state directory would run the same turns "
                "twice") from None
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd
