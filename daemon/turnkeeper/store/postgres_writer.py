"""The PostgreSQL store's steps' writer (`StepWriter`): the group commit
(`store/writer.py`) whose batches it commits on its own connection (`PgConnection`'s
`writer_conn`), as the set-based statements of `postgres_batch.commit`.

A batch the server refuses is committed again write by write, so only the write that
fails reports the error; a transaction rolled back for a deadlock or a serialization
failure is sent again at once; while the server cannot be reached the whole batch waits
and is sent again (`commit_until_reachable`). A batch nobody awaits waits a moment for
one somebody does (`_linger`), and a batch that `postgres_fused.fuse` can hold is one
statement: one round trip.
"""

from __future__ import annotations

from collections.abc import Sequence

import anyio
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
from turnkeeper.store.writer import MAX_BATCH, GroupCommitWriter, Write

# How long a batch nobody awaits waits for an awaited write to share its commit.
LINGER_S = 0.05


class StepWriter(GroupCommitWriter[Op]):
    """The steps' group commit over `db`'s writer connection."""

    def __init__(self, db: PgConnection) -> None:
        super().__init__(db.clock)
        self.db = db
        self.commits = 0
        self.lingered = 0  # batches nobody awaited, held for an awaited write

    async def _commit(self, batch: list[Write[Op]]) -> None:
        if not any(w.done is not None for w in batch):
            batch = await self._linger(batch)
        self._answer(batch, await self._commit_with_reconnect(batch))

    async def _linger(self, batch: list[Write[Op]]) -> list[Write[Op]]:
        """A batch nobody awaits (events, a queued checkpoint, an idempotent call's
        journal: each commits with the next durable write) waits up to LINGER_S for an
        awaited write, and takes everything queued by then. Sent at once, it held the
        one connection while the step's awaited write (the intent of its call, queued
        a moment after its checkpoint) waited behind it: a round trip more a step."""
        queue = self._queue
        with self.db.clock.move_on_after(LINGER_S):
            while not self._closed and not any(w.done is not None for w in queue):
                self._wake = anyio.Event()
                await self._wake.wait()
        self.lingered += 1
        while queue and len(batch) < MAX_BATCH:
            w = queue.popleft()
            if w.turn is not None and self._queued_turns.get(w.turn) is w:
                del self._queued_turns[w.turn]
            batch.append(w)
        return batch

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
