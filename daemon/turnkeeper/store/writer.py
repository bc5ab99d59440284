"""The one writer task every durable store runs, and the group commit it does.

Writes are queued to a single task that takes everything queued while its last
transaction was committing and commits it as the next one: hundreds of concurrent turns
share one commit instead of queueing on it. A caller that awaits a write (`_write`)
resumes only after its transaction committed; a write that is only enqueued
(`_enqueue`: events, an idempotent call's journal) commits, in order, with the next one.
What a commit does (SQLite's transaction in a worker thread, PostgreSQL's over the
network, and how each rides out its store's own failures) is the backend's `_commit`;
it answers every write of the batch through `_answer`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from turnkeeper.store.base import StoreError

# Writes in one transaction at most: a burst past it commits in several.
MAX_BATCH = 1000
# Idempotent calls between intent and outcome (a cancelled call never clears its key: the
# bound keeps that from growing; past it, outcomes are simply awaited).
MAX_PENDING_IDEMPOTENT = 100_000

Op = TypeVar("Op")


@dataclass(slots=True)
class Write(Generic[Op]):
    """One write: its statements, and for an awaited one the event its caller waits on
    and the error it gets."""

    ops: Sequence[Op]
    done: anyio.Event | None = None
    error: BaseException | None = field(default=None)


class GroupCommitWriter(Generic[Op]):
    def __init__(self) -> None:
        self._send: MemoryObjectSendStream[Write[Op]] | None = None
        self._receive: MemoryObjectReceiveStream[Write[Op]] | None = None
        self._writer_done = anyio.Event()
        self._closed = False
        self.durable_writes = 0  # awaited writes (the events riding along not counted)
        self.failed_writes = 0
        self._idempotent_keys: set[str] = set()

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
                  ) -> None:
        """The writer task. Runs until the store closes; commits everything queued before
        it ends."""
        send, receive = anyio.create_memory_object_stream[Write[Op]](math.inf)
        self._send, self._receive = send, receive
        task_status.started()
        try:
            async with receive:
                while True:
                    try:
                        first = await receive.receive()
                    except anyio.EndOfStream:
                        return
                    batch = [first]
                    while len(batch) < MAX_BATCH:
                        try:
                            batch.append(receive.receive_nowait())
                        except (anyio.WouldBlock, anyio.EndOfStream):
                            break
                    with anyio.CancelScope(shield=True):
                        await self._commit(batch)
        finally:
            self._writer_done.set()

    async def _commit(self, batch: list[Write[Op]]) -> None:
        """Commit `batch` in order and answer each of its writes (`_answer`)."""
        raise NotImplementedError

    def _answer(self, writes: Sequence[Write[Op]], errors: Sequence[BaseException | None]
                ) -> None:
        for w, error in zip(writes, errors, strict=True):
            w.error = error
            if error is not None:
                self.failed_writes += 1
            if w.done is not None:
                w.done.set()

    async def _stop_writer(self) -> None:
        """No more writes; the writer commits what is queued and ends."""
        self._closed = True
        if self._send is not None:
            self._send.close()
            await self._writer_done.wait()

    async def _write(self, ops: Sequence[Op]) -> None:
        """`ops` in a transaction (with whatever else is queued), durable on return. A
        StoreError of the backend's own is raised as it is; any other error wrapped."""
        if self._send is None or self._closed:
            raise StoreError("state database is closed: the write was not made")
        w = Write(ops, anyio.Event())
        self.durable_writes += 1
        try:
            self._send.send_nowait(w)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            raise StoreError("state database writer has stopped: the write was not made"
                             ) from None
        assert w.done is not None
        await w.done.wait()
        if isinstance(w.error, StoreError):
            raise w.error
        if w.error is not None:
            raise StoreError(f"state database write failed: {w.error}") from w.error

    def _enqueue(self, ops: Sequence[Op]) -> None:
        """`ops` with the next durable write, in order; not awaited."""
        if self._send is not None and not self._closed:
            with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError):
                self._send.send_nowait(Write(ops))

    async def _journal_intent(self, key: str, ops: Sequence[Op], *, idempotent: bool
                              ) -> None:
        """An idempotent call may run again after a crash (with the same Idempotency-Key),
        so its intent and outcome are not awaited: they commit, in order, with the next
        durable write (the step's next checkpoint), saving two commits a call. A
        non-idempotent call's intent is durable before the call is sent."""
        if idempotent:
            if len(self._idempotent_keys) < MAX_PENDING_IDEMPOTENT:
                self._idempotent_keys.add(key)
            self._enqueue(ops)
        else:
            await self._write(ops)

    async def _journal_outcome(self, key: str, ops: Sequence[Op]) -> None:
        """An outcome goes as its intent went: queued for an idempotent call, awaited
        otherwise."""
        if key in self._idempotent_keys:
            self._idempotent_keys.discard(key)
            self._enqueue(ops)
        else:
            await self._write(ops)

    async def flush(self) -> None:
        """Until everything enqueued so far is durable."""
        await self._write(())
