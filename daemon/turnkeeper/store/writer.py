"""The one writer task every durable store runs, and the group commit it does.

Writes are queued to a single task that takes everything queued while its last
transaction was committing and commits it as the next one: hundreds of concurrent turns
share one commit instead of queueing on it. A caller that awaits a write (`write`)
resumes only after its transaction committed; a write that is only enqueued
(`enqueue`: events, an idempotent call's journal) commits, in order, with the next one.
The queue is a deque the writer drains: events queued back to back join one write (the
backend may then insert them in one statement), so a step's five events cost the writer
one write, not five.

A turn's checkpoint may also be queued (`enqueue_turn`): it commits in order, before any
later write of the same turn. A queued checkpoint that a newer one of the same turn
supersedes before it was taken for a commit is dropped (`superseded`); its message and
trail rows move into the newer write, which counts them, joined with the newer rows of
the same list into one `MessageWrite` where they run on (a step's checkpoint at the top
of the step, dropped for the one after the model's reply: one write of each list, not
two).
What a commit does (SQLite's transaction in a worker thread, PostgreSQL's over the
network, and how each rides out its store's own failures) is the backend's `_commit`;
it answers every write of the batch through `_answer`.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar, cast

import anyio

from turnkeeper.clock import Clock
from turnkeeper.store.base import MessageRows, StoreError
from turnkeeper.values import value_class

# Writes in one transaction at most: a burst past it commits in several.
MAX_BATCH = 1000
# Idempotent calls between intent and outcome (a cancelled call never clears its key: the
# bound keeps that from growing; past it, outcomes are simply awaited).
MAX_PENDING_IDEMPOTENT = 100_000
# Callers of a commit's writes resumed per turn of the event loop (`_wake`).
WAKE_CHUNK = 64

Op = TypeVar("Op")


def _wake(waiters: list[asyncio.Future[None]], start: int) -> None:
    """Resume the callers of a commit's writes, WAKE_CHUNK of them a turn of the event
    loop. Woken all at once, a commit of a thousand turns' checkpoints had each of them
    run its next stretch (tools, the next model request) in one turn of the loop, and
    nothing else (a timer, a status request, a reply read) ran for hundreds of
    milliseconds."""
    end = start + WAKE_CHUNK
    for done in waiters[start:end]:
        if not done.done():  # a waiter cancelled: done
            done.set_result(None)
    if end < len(waiters):
        asyncio.get_running_loop().call_soon(_wake, waiters, end)


# The tables of a turn's two row lists: its conversation and its trail.
MESSAGES = "messages"
TRAIL = "trail"


@value_class
class MessageWrite:
    """A turn's rows of one list (`table`: MESSAGES or TRAIL) from index `start`: after
    it the turn holds exactly `start + len(rows)` rows in that table. `trims` as in
    `MessageRows`; `turn_no` the turn's number where the store keys rows by it and knows
    it (None: the backend looks it up)."""

    turn: str
    start: int
    rows: tuple[str, ...]
    table: str = MESSAGES
    trims: bool = True
    turn_no: int | None = None


def message_write(turn: str, messages: MessageRows | None,
                  trail: MessageRows | None = None, *,
                  turn_no: int | None = None) -> list[MessageWrite]:
    """The ops that write a checkpoint's message and trail rows (none for a list it
    leaves as it is)."""
    ops = [] if messages is None else [
        MessageWrite(turn, messages.start, messages.rows, MESSAGES, messages.trims, turn_no)]
    if trail is not None:
        ops.append(MessageWrite(turn, trail.start, trail.rows, TRAIL, trail.trims, turn_no))
    return ops


def _joined(old: object, new: object) -> MessageWrite | None:
    """`old` and then `new` as one write, when both write rows of the same list of a turn
    and `new` runs on from (or overlaps) `old`. It trims if either did: rows past its end
    may be stored when they were past the end of either."""
    if isinstance(old, MessageWrite) and isinstance(new, MessageWrite) \
            and old.turn == new.turn and old.table == new.table \
            and old.start <= new.start <= old.start + len(old.rows):
        return MessageWrite(old.turn, old.start, old.rows[:new.start - old.start] + new.rows,
                            old.table, old.trims or new.trims, new.turn_no)
    return None


def join_messages(moved: Sequence[Op], ops: Sequence[Op]) -> list[Op]:
    """The rows of a turn's dropped checkpoint (`moved`) put into the newer checkpoint's
    write (`ops`, its row first), ahead of its own rows: they commit with the checkpoint
    that counts them, never without one. Where the newer rows of a list run on from (or
    overlap) the dropped ones, the two become one `MessageWrite`."""
    head, rest = ops[0], list(ops[1:])
    ahead: list[Op] = []
    for old in moved:
        for i, new in enumerate(rest):
            joined = _joined(old, new)
            if joined is not None:
                rest[i] = cast(Op, joined)
                break
        else:
            ahead.append(old)
    return [head, *ahead, *rest]


@dataclass(slots=True)
class Write(Generic[Op]):
    """One write: its statements, and for an awaited one the future its caller waits on
    (a bare asyncio future: an anyio Event cost 3.4 us a write to make, set and wait on,
    a future 0.25) and the error it gets. `events` marks a write of event rows only,
    which later event rows may join while it is queued; `turn` marks a queued
    checkpoint, whose first statement (the turn's row) a newer checkpoint of the turn
    may drop."""

    ops: Sequence[Op]
    done: asyncio.Future[None] | None = None
    error: BaseException | None = field(default=None)
    events: bool = False
    turn: str | None = None
    # Its caller stopped waiting (`write(within_s=...)`): not tried again (see
    # `_drop_withdrawn`).
    withdrawn: bool = False


class WriteWithdrawn(StoreError):
    """An awaited write given up before it was made: its caller's time ran out while the
    store could not take it (a full disk, an unreachable server). It never commits."""


class GroupCommitWriter(Generic[Op]):
    def __init__(self, clock: Clock) -> None:
        self._writer_clock = clock
        self._queue: deque[Write[Op]] = deque()
        self._wake: anyio.Event | None = None
        self._running = False
        self._writer_done = anyio.Event()
        self._closed = False
        self.durable_writes = 0  # awaited writes (the events riding along not counted)
        self.failed_writes = 0
        self.superseded = 0  # queued checkpoints dropped for a newer one of their turn
        self._idempotent_keys: set[str] = set()
        # Turn -> its queued checkpoint not yet taken for a commit.
        self._queued_turns: dict[str, Write[Op]] = {}

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
                  ) -> None:
        """The writer task. Runs until the store closes; commits everything queued before
        it ends."""
        self._running = True
        task_status.started()
        queue = self._queue
        try:
            while True:
                if not queue:
                    if self._closed:
                        return
                    self._wake = anyio.Event()
                    await self._wake.wait()
                    continue
                batch: list[Write[Op]] = []
                while queue and len(batch) < MAX_BATCH:
                    w = queue.popleft()
                    if w.turn is not None and self._queued_turns.get(w.turn) is w:
                        del self._queued_turns[w.turn]
                    batch.append(w)
                with anyio.CancelScope(shield=True):
                    await self._commit(batch)
        finally:
            self._running = False
            self._writer_done.set()
            # Cancelled with writes queued: whoever awaits one hears it was not made.
            while queue:
                self._answer([queue.popleft()], [StoreError(
                    "state database writer has stopped: the write was not made")])
            self._queued_turns.clear()

    async def _commit(self, batch: list[Write[Op]]) -> None:
        """Commit `batch` in order and answer each of its writes (`_answer`)."""
        raise NotImplementedError

    def _answer(self, writes: Sequence[Write[Op]], errors: Sequence[BaseException | None]
                ) -> None:
        waiters: list[asyncio.Future[None]] = []
        for w, error in zip(writes, errors, strict=True):
            w.error = error
            if error is not None:
                self.failed_writes += 1
            if w.done is not None:
                waiters.append(w.done)
        _wake(waiters, 0)

    async def stop(self) -> None:
        """No more writes; the writer commits what is queued and ends."""
        self._closed = True
        if self._running:
            self._notify()
            await self._writer_done.wait()

    def _notify(self) -> None:
        wake = self._wake
        if wake is not None:
            self._wake = None
            wake.set()

    def _push(self, w: Write[Op]) -> None:
        self._queue.append(w)
        self._notify()

    def _supersede(self, turn: str, ops: Sequence[Op]) -> Sequence[Op]:
        """A newer checkpoint of `turn` (`ops`, its row first) is written: the turn's
        queued one, if not yet taken for a commit, is dropped, and its rows move into the
        newer write (`join_messages`)."""
        old = self._queued_turns.pop(turn, None)
        if old is None:
            return ops
        moved, old.ops = old.ops[1:], ()
        self.superseded += 1
        return join_messages(moved, ops) if moved else ops

    async def write(self, ops: Sequence[Op], *, supersedes: str | None = None,
                     within_s: float | None = None) -> None:
        """`ops` in a transaction (with whatever else is queued), durable on return. A
        StoreError of the backend's own is raised as it is; any other error wrapped.
        `supersedes`: the turn whose queued checkpoint these ops make obsolete (their
        first statement writes the turn's row and checkpoint). `within_s`: a write not
        made within that long is withdrawn (`WriteWithdrawn`, and it never commits),
        unless a commit that holds it is under way, whose answer is then awaited: the
        caller hears exactly what the store holds."""
        if self._closed or not self._running:
            stopped = not self._closed and self._writer_done.is_set()
            raise StoreError("state database writer has stopped: the write was not made"
                             if stopped else "state database is closed: the write was not made")
        if supersedes is not None and self._queued_turns:
            ops = self._supersede(supersedes, ops)
        done = asyncio.get_running_loop().create_future()
        self.durable_writes += 1
        w = Write(ops, done)
        self._push(w)
        if within_s is None:
            # Cancelled while waiting (its future with it), the write still commits.
            await done
        else:
            await self._await_within(w, done, within_s)
        if isinstance(w.error, StoreError):
            raise w.error
        if w.error is not None:
            raise StoreError(f"state database write failed: {w.error}") from w.error

    async def _await_within(self, w: Write[Op], done: asyncio.Future[None],
                            within_s: float) -> None:
        with self._writer_clock.move_on_after(within_s):
            await asyncio.shield(done)
        if done.done():
            return
        w.withdrawn = True
        try:
            self._queue.remove(w)  # not taken for a commit yet: it never will be
        except ValueError:
            await done  # in a commit under way: its answer says what the store holds
            return
        self.failed_writes += 1
        w.error = WriteWithdrawn(f"the state store could not take the write within "
                                 f"{within_s:g} s: it was withdrawn and not made")
        done.cancel()

    def _drop_withdrawn(self, pending: list[Write[Op]]) -> list[Write[Op]]:
        """Before a commit that failed is tried again: the writes whose callers gave up
        on them are answered as withdrawn and left out, so they never commit."""
        if not any(w.withdrawn for w in pending):
            return pending
        gone = [w for w in pending if w.withdrawn]
        self._answer(gone, [WriteWithdrawn("the state store could not take the write in "
                                           "time: it was withdrawn and not made")] * len(gone))
        return [w for w in pending if not w.withdrawn]

    def enqueue(self, ops: Sequence[Op]) -> None:
        """`ops` with the next durable write, in order; not awaited."""
        if self._running and not self._closed:
            self._push(Write(ops))

    def enqueue_event(self, op: Op) -> None:
        """An event row with the next durable write, in order; not awaited. Event rows
        queued back to back make one write."""
        if self._running and not self._closed:
            queue = self._queue
            if queue and queue[-1].events:
                ops = queue[-1].ops
                assert isinstance(ops, list)
                ops.append(op)
            else:
                self._push(Write([op], events=True))

    def enqueue_turn(self, turn: str, ops: Sequence[Op]) -> bool:
        """A turn's checkpoint (`ops[0]` writes its row, the rest its rows),
        committed in order with the next durable write and not awaited; it supersedes the
        turn's queued one. False when the writer takes no more writes (nothing queued)."""
        if not self._running or self._closed:
            return False
        if self._queued_turns:
            ops = self._supersede(turn, ops)
        w = Write(ops, turn=turn)
        self._queued_turns[turn] = w
        self._push(w)
        return True

    async def journal_intent(self, key: str, ops: Sequence[Op], *, idempotent: bool
                              ) -> None:
        """An idempotent call may run again after a crash (with the same Idempotency-Key),
        so its intent and outcome are not awaited: they commit, in order, with the next
        durable write (the step's next checkpoint), saving two commits a call. A
        non-idempotent call's intent is durable before the call is sent."""
        if idempotent:
            if len(self._idempotent_keys) < MAX_PENDING_IDEMPOTENT:
                self._idempotent_keys.add(key)
            self.enqueue(ops)
        else:
            await self.write(ops)

    async def journal_outcome(self, key: str, ops: Sequence[Op]) -> None:
        """An outcome goes as its intent went: queued for an idempotent call, awaited
        otherwise."""
        if key in self._idempotent_keys:
            self._idempotent_keys.discard(key)
            self.enqueue(ops)
        else:
            await self.write(ops)

    async def flush(self) -> None:
        """Until everything enqueued so far is durable."""
        await self.write(())
