"""The PostgreSQL store's steps' writer (`StepWriter`): the group commit
(`store/writer.py`) whose batches it commits on its own connection (`PgConnection`'s
`writer_conn`), as the set-based statements of `postgres_commit.commit`.

A batch the server refuses is committed again write by write, so only the write that
fails reports the error; a transaction rolled back for a deadlock or a serialization
failure is sent again at once; while the server cannot be reached the whole batch waits
and is sent again (`commit_until_reachable`). A batch that `postgres_fused.fuse` can hold
is one statement: one round trip.

Up to WRITERS transactions are in flight at once, each on a writer connection of its own:
with one, every awaited write first waited for the batch in flight, half a commit on
average, three times a step (a step's call's intent, its outcome, its checkpoint): 5.3
round trips added a step with 40 turns on a node 20 ms from its database, against 2.4
with two. Two transactions in flight never write rows of the same turn (`turns_of`,
`_take`: a turn's writes commit in the order they were queued, and lock no row the
other holds, so the two never wait for each other), and a write that may touch anything
(a flush, a statement not known here) goes alone, after everything before it. Event rows
of two transactions in flight may reach the database out of their `pos` order, as those
of two nodes always could.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import anyio
import anyio.abc
import asyncpg

from turnkeeper.store.base import StoreError
from turnkeeper.store.postgres_batch import (
    EVENT_INSERT,
    EVENT_INSERT_FENCED,
    OUTBOX_INSERT,
    OUTBOX_INSERT_FENCED,
    Conn,
    FencedIntent,
    Op,
    TurnCall,
    TurnUpdate,
)
from turnkeeper.store.postgres_commit import commit
from turnkeeper.store.postgres_conn import (
    CONFLICT_RETRIES,
    CONFLICTS,
    Dedicated,
    PgConnection,
    commit_until_reachable,
    lost,
)
from turnkeeper.store.postgres_fused import (
    JOURNAL_INTENT,
    JOURNAL_OUTCOME_OF,
    MAIL_TAKEN,
    commit_fused,
    fuse,
)
from turnkeeper.store.writer import MAX_BATCH, GroupCommitWriter, MessageWrite, Write


def turns_of(ops: Sequence[Op]) -> set[str] | None:
    """The turns whose rows `ops` write (their events, journal and mail included); None
    for ops that may write anything (a call, a statement not known here, or none at
    all: a `flush`, which must commit after everything queued before it)."""
    if not ops:
        return None
    turns: set[str] = set()
    for op in ops:
        if isinstance(op, (TurnUpdate, MessageWrite, FencedIntent, TurnCall)):
            turns.add(op.turn)
        elif not isinstance(op, tuple):
            return None
        elif op[0] in _TURN_ARG:
            turn = op[1][_TURN_ARG[op[0]]]
            if turn is not None:
                turns.add(turn)
        elif op[0] != OUTBOX_INSERT:  # an event's outbox row, keyed by its number
            return None
    return turns


# Statements that write a turn's rows only: the index of the turn among their arguments.
_TURN_ARG = {EVENT_INSERT: 1, EVENT_INSERT_FENCED: 1, OUTBOX_INSERT_FENCED: 7,
             JOURNAL_INTENT: 1, JOURNAL_OUTCOME_OF: 2, MAIL_TAKEN: 0}


@dataclass(eq=False)
class _Flight:
    turns: set[str]
    alone: bool  # holds a write that may write anything: nothing else in flight with it


class StepWriter(GroupCommitWriter[Op]):
    """The steps' group commit over `db`'s writer connections: up to WRITERS
    transactions in flight at once, never two that write rows of the same turn."""

    def __init__(self, db: PgConnection) -> None:
        super().__init__(db.clock)
        self.db = db
        self.commits = 0
        self._flights: list[_Flight] = []
        self._free = list(db.writer_conns)

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
                  ) -> None:
        """The writer task: each batch it can take (`_take`) committed on a free
        connection beside the others in flight. Runs until the store closes; commits
        everything queued before it ends."""
        self._running = True
        task_status.started()
        try:
            async with anyio.create_task_group() as tg:
                while True:
                    if self._free and not any(f.alone for f in self._flights):
                        batch, flight = self._take()
                        if batch:
                            self._flights.append(flight)
                            tg.start_soon(self._fly, batch, flight, self._free.pop())
                            continue
                    if self._closed and not self._queue and not self._flights:
                        return
                    self._wake = anyio.Event()
                    await self._wake.wait()
        finally:
            self._running = False
            self._writer_done.set()
            while self._queue:  # cancelled with writes queued: they were not made
                self._answer([self._queue.popleft()], [StoreError(
                    "state database writer has stopped: the write was not made")])
            self._queued_turns.clear()

    def _take(self) -> tuple[list[Write[Op]], _Flight]:
        """The queued writes that may commit now, in order: none of a turn that a
        transaction in flight writes, or that a write left queued before it writes; a
        write that may write anything only with nothing in flight and nothing left
        before it (and then nothing else goes in flight beside its transaction)."""
        busy = set().union(*(f.turns for f in self._flights))
        flight = _Flight(set(), False)
        batch: list[Write[Op]] = []
        kept: list[Write[Op]] = []
        queue = self._queue
        while queue and len(batch) < MAX_BATCH:
            w = queue.popleft()
            turns = turns_of(w.ops)
            if turns is None and (self._flights or kept):
                queue.appendleft(w)
                break
            if turns is not None and turns & busy:
                kept.append(w)
                busy |= turns
                continue
            if w.turn is not None and self._queued_turns.get(w.turn) is w:
                del self._queued_turns[w.turn]
            batch.append(w)
            if turns is None:
                flight.alone = True
            else:
                flight.turns |= turns
        queue.extendleft(reversed(kept))
        return batch, flight

    async def _fly(self, batch: list[Write[Op]], flight: _Flight, conn: Dedicated) -> None:
        try:
            with anyio.CancelScope(shield=True):
                self._answer(batch, await self._commit_with_reconnect(batch, conn))
        finally:
            self._flights.remove(flight)
            self._free.append(conn)
            self._notify()

    async def _commit(self, batch: list[Write[Op]]) -> None:
        self._answer(batch, await self._commit_with_reconnect(batch, self.db.writer_conn))

    async def _commit_with_reconnect(self, batch: list[Write[Op]], conn: Dedicated
                                     ) -> list[BaseException | None]:
        """Commit the batch, sent again whole while the server cannot be reached
        (`commit_until_reachable`)."""
        db = self.db
        return await commit_until_reachable(
            lambda: self._commit_batch(batch, conn), len(batch), outage=db.outage,
            clock=db.clock, where=db.where,
            closed=lambda: db.pool is None or self._closed,
            reconnected=self._reconnected)

    def _reconnected(self) -> None:
        self.db.reconnects += 1

    async def _commit_batch(self, batch: list[Write[Op]], dedicated: Dedicated
                            ) -> list[BaseException | None]:
        """One transaction for the batch, on the writer's own connection. If the server
        refuses it, each write gets its own, so one bad write fails alone, never its
        neighbours. A lost connection is raised (the caller retries the whole batch)."""
        if self.db.pool is None:
            raise asyncpg.InterfaceError("store is closed")
        conn = await dedicated.get()
        try:
            return await self._commit_on(conn, batch)
        except BaseException as exc:
            dedicated.after(exc)  # a lost one is made again for the next try
            raise

    async def _commit_on(self, conn: Conn, batch: list[Write[Op]]) -> list[BaseException | None]:
        """The batch in one transaction (`postgres_commit.commit`: a write whose claim no
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
        batch is what it writes; `postgres_commit.commit` otherwise), sent again at once
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
