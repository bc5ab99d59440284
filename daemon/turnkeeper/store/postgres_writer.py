"""The PostgreSQL store's steps' writer (`StepWriter`): the group commit
(`store/writer.py`) whose batches it commits on its own connection (`PgConnection`'s
`writer_conn`), as the set-based statements of `postgres_batch.commit`.

A batch the server refuses is committed again write by write, so only the write that
fails reports the error; a transaction rolled back for a deadlock or a serialization
failure is sent again at once; while the server cannot be reached the whole batch waits
and is sent again (`commit_until_reachable`). A batch that `postgres_fused.fuse` can hold
is one statement: one round trip.
"""

from __future__ import annotations

from collections.abc import Sequence

import asyncpg

from turnkeeper.store.postgres_batch import Conn, Op, commit
from turnkeeper.store.postgres_conn import (
    CONFLICT_RETRIES,
    CONFLICTS,
    PgConnection,
    commit_until_reachable,
    lost,
)
from turnkeeper.store.postgres_fused import commit_fused, fuse
from turnkeeper.store.writer import GroupCommitWriter, Write


class StepWriter(GroupCommitWriter[Op]):
    """The steps' group commit over `db`'s writer connection."""

    def __init__(self, db: PgConnection) -> None:
        super().__init__(db.clock)
        self.db = db
        self.commits = 0

    async def _commit(self, batch: list[Write[Op]]) -> None:
        self._answer(batch, await self._commit_with_reconnect(batch))

    async def _commit_with_reconnect(self, batch: list[Write[Op]]) -> list[BaseException | None]:
        """Commit the batch, sent again whole while the server cannot be reached
        (`commit_until_reachable`)."""
        db = self.db
        return await commit_until_reachable(
            lambda: self._commit_batch(batch), len(batch), outage=db.outage,
            clock=db.clock, where=db.where,
            closed=lambda: db.pool is None or self._closed,
            reconnected=self._reconnected)

    def _reconnected(self) -> None:
        self.db.reconnects += 1

    async def _commit_batch(self, batch: list[Write[Op]]) -> list[BaseException | None]:
        """One transaction for the batch, on the writer's own connection. If the server
        refuses it, each write gets its own, so one bad write fails alone, never its
        neighbours. A lost connection is raised (the caller retries the whole batch)."""
        if self.db.pool is None:
            raise asyncpg.InterfaceError("store is closed")
        dedicated = self.db.writer_conn
        conn = await dedicated.get()
        try:
            return await self._commit_on(conn, batch)
        except BaseException as exc:
            dedicated.after(exc)  # a lost one is made again for the next try
            raise

    async def _commit_on(self, conn: Conn, batch: list[Write[Op]]) -> list[BaseException | None]:
        """The batch in one transaction (`postgres_batch.commit`: a write whose claim no
        longer holds fails alone in it); if the server refuses it, each write in its own."""
        try:
            return await self._commit_retrying(conn, [w.ops for w in batch])
        except Exception as exc:
            if lost(exc):
                raise
            if len(batch) == 1:
                return [exc]
        errors = []
        for w in batch:
            try:
                errors += await self._commit_retrying(conn, [w.ops])
            except Exception as exc:
                if lost(exc):
                    raise
                errors.append(exc)
        return errors

    async def _commit_retrying(self, conn: Conn, writes: list[Sequence[Op]]
                               ) -> list[BaseException | None]:
        """One transaction of `writes` (one statement, `postgres_fused.py`, when the
        batch is what it writes; `postgres_batch.commit` otherwise), sent again at once
        when the server rolled it back for a deadlock or a serialization failure
        (CONFLICT_RETRIES times at most)."""
        tries = 0
        while True:
            try:
                fused = fuse(writes)
                errors = await (commit(conn, writes) if fused is None
                                else commit_fused(conn, fused, len(writes)))
            except CONFLICTS as exc:
                if tries >= CONFLICT_RETRIES:
                    raise
                tries += 1
                self.db.conflicted("commit", exc)
                continue
            self.commits += 1
            return errors
