"""A group commit on PostgreSQL as a handful of set-based statements.

The writes of a batch are built from a few kinds of op: a turn's row (`TurnUpdate`), a
turn's rows of one of its two lists, its conversation or its trail (`MessageWrite`), a
plain statement (an event, a journal entry, ...) and, for what needs a value back
mid-transaction, a call on the connection.
Instead of a statement per op, one transaction sends

- every turn update of the batch as ONE `UPDATE turns ... FROM unnest(...)`; an update
  of a claimed turn names its epoch, and the rows it returns tell which claims no longer
  hold: the writes of those turns are left out of the rest of the transaction and fail
  alone (StaleLease), the others commit;
- every conversation row as ONE statement, and every trail row as one more (the rows
  past the end of each write that trims deleted, the written ones upserted, from `unnest`);
- every non-idempotent call's intent on a claimed turn (`FencedIntent`) as ONE
  `INSERT INTO journal ... SELECT ... FROM unnest(...) JOIN turns`, which writes each
  only while its claim holds and its lease has not run out at the database's clock
  (a check and an INSERT a call, one round trip each, and a segment cut at each, before);
- each run of statements of one shape (journal entries, ...) as one pipelined
  `executemany`, and the event rows last, one `executemany` per shape (an event row
  depends on no other write of the transaction).

Order is kept where it matters: the ops are cut into segments, and only within a
segment are turn, conversation and trail rows written ahead of the plain statements
queued before them. A call, a statement that is not known to be independent of those
rows, or a second write of a turn's row (or of the same list of a turn) already in the
segment starts a new one. A batch where every turn steps once (the common case) is one
segment: a statement or two per kind of row, whatever the number of turns.

Building the statements is pure (`segments`, `turn_update`, `message_upsert`,
`intent_insert`, `stale_writes`); `postgres_commit.commit` runs them on a connection
inside one transaction.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import asyncpg

from turnkeeper.store.fleet import StaleLease
from turnkeeper.store.writer import MESSAGES, TRAIL, MessageWrite

Statement = tuple[str, Sequence[Any]]
Conn = asyncpg.Connection | asyncpg.pool.PoolConnectionProxy
Call = Callable[[Conn], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class TurnUpdate:
    """A turn's row: its record as the row holds it (`stored_record`), and its checkpoint
    when given. With an `epoch`, written only while `owner`'s claim of that epoch is the
    turn's."""

    turn: str
    state: str
    updated_at: float
    record: str
    stop_code: str | None
    checkpoint: str | None = None
    owner: str | None = None
    epoch: int | None = None


@dataclass(frozen=True, slots=True)
class TurnCall:
    """A call that locks the row of one turn (`turn`): the batch takes that lock with
    the others, in order, when it locks turn rows at more than one point."""

    turn: str
    call: Call

    async def __call__(self, conn: Conn) -> None:
        await self.call(conn)


@dataclass(frozen=True, slots=True)
class FencedIntent:
    """A non-idempotent call's intent on a claimed turn: its journal row, written only
    while `owner`'s claim of `epoch` is the turn's and its lease has not run out at the
    database's clock (the turn's row is locked FOR SHARE meanwhile, so no claim takes
    it before the commit). Otherwise nothing of its write is written (StaleLease) and
    the call is not sent. The intents of a segment go in one statement
    (`intent_insert`), not a check and an INSERT each."""

    key: str
    turn: str
    tool: str
    arguments: str
    owner: str
    epoch: int


Op = Statement | Call | TurnUpdate | MessageWrite | FencedIntent

EVENT_INSERT = ("INSERT INTO events (seq, turn, ts, type, data) VALUES ($1, $2, $3, $4, $5)"
                " ON CONFLICT (seq) DO NOTHING")
# An event of a claimed turn: written only while the claim's epoch is the turn's.
EVENT_INSERT_FENCED = (
    "INSERT INTO events (seq, turn, ts, type, data) SELECT $1, $2, $3, $4, $5"
    " WHERE EXISTS (SELECT 1 FROM turns WHERE id = $2 AND epoch = $6)"
    " ON CONFLICT (seq) DO NOTHING")
# An event's webhook outbox rows (store/outbox.py), sent with the event rows; fenced like
# the event of a claimed turn (the claim's epoch the last parameter).
OUTBOX_INSERT = (
    "INSERT INTO webhook_outbox (webhook, seq, type, body, created_at, next_at, updated_at)"
    " VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT (webhook, seq) DO NOTHING")
OUTBOX_INSERT_FENCED = (
    "INSERT INTO webhook_outbox (webhook, seq, type, body, created_at, next_at, updated_at)"
    " SELECT $1, $2, $3, $4, $5, $6, $7 WHERE EXISTS (SELECT 1 FROM turns WHERE id = $8"
    " AND epoch = $9) ON CONFLICT (webhook, seq) DO NOTHING")
EVENT_SQL = frozenset({EVENT_INSERT, EVENT_INSERT_FENCED, OUTBOX_INSERT,
                       OUTBOX_INSERT_FENCED})

# Statements that write neither a turn's row nor its conversation or trail rows, so the
# turn, conversation and trail rows of their segment may be written before them.
_INDEPENDENT = ("INSERT INTO events ", "INSERT INTO webhook_outbox ", "INSERT INTO journal ",
                "UPDATE journal ",
                "INSERT INTO meta ", "INSERT INTO mail ", "DELETE FROM mail ",
                "SELECT pg_notify(")

# Every statement that locks several turn rows locks them in one order, by id: the
# renewal of a node's leases, the claims' hand-back and the writer's batched update all
# do, so two of them waiting for each other's rows is impossible. An UPDATE ... FROM
# unnest(...) locks its rows in whatever order its join's plan meets them (a nested loop
# follows the array, a hash join the table), so the order is fixed by a locking CTE
# sorted by id (MATERIALIZED: locked first, in that order, then updated); sorting the
# arrays alone would not fix it. `$9` names the rows to lock: the updated ones, or every
# turn row the batch locks when it locks at more than one point (`lock_points`).
TURN_UPDATE = (
    "WITH l AS MATERIALIZED (SELECT t.id FROM turns t WHERE t.id = ANY($9::text[])"
    " ORDER BY t.id FOR UPDATE)"
    " UPDATE turns AS t SET state = u.state, updated_at = u.updated_at, record = u.record,"
    " stop_code = u.stop_code, checkpoint = COALESCE(u.checkpoint, t.checkpoint)"
    " FROM unnest($1::text[], $2::text[], $3::float8[], $4::text[], $5::text[],"
    " $6::text[], $7::text[], $8::bigint[])"
    " AS u(id, state, updated_at, record, stop_code, checkpoint, owner, epoch)"
    " WHERE t.id = u.id AND t.id IN (SELECT id FROM l)"
    " AND (u.epoch IS NULL OR (t.owner = u.owner AND t.epoch = u.epoch))"
    " RETURNING t.id")
# Every fenced intent of a segment (`FencedIntent`), their turn rows locked FOR SHARE in
# id order (the order every statement that locks several turn rows takes them in).
INTENT_INSERT = (
    "INSERT INTO journal (key, turn, tool, arguments, idempotent)"
    " SELECT j.key, j.turn, j.tool, j.arguments, false FROM unnest($1::text[], $2::text[],"
    " $3::text[], $4::text[], $5::text[], $6::bigint[])"
    " AS j(key, turn, tool, arguments, owner, epoch) JOIN turns t ON t.id = j.turn"
    " AND t.owner = j.owner AND t.epoch = j.epoch AND t.lease_until > clock_timestamp()"
    " ORDER BY t.id FOR SHARE OF t"
    " ON CONFLICT (key) DO UPDATE SET outcome = NULL RETURNING key")
# The turn rows a batch will lock, taken at its start, in order, when its first lock is
# not a turn update that can take them all (`commit`).
LOCK_TURNS = "SELECT 1 FROM turns WHERE id = ANY($1::text[]) ORDER BY id FOR UPDATE"


def _rows_upsert(table: str) -> str:
    """The statement that writes the rows of many turns into `table` (messages or trail):
    the rows past the end of each write that trims deleted, the written ones inserted
    or replaced; none for a turn with no row (as the UPDATE of its record, which matches
    nothing)."""
    return (
        f"WITH gone AS (DELETE FROM {table} m USING unnest($1::text[], $2::int[]) AS"
        " e(turn, stop) WHERE m.turn = e.turn AND m.idx >= e.stop)"
        f" INSERT INTO {table} (turn, idx, data)"
        " SELECT r.turn, r.idx, r.data FROM unnest($3::text[], $4::int[], $5::text[])"
        " AS r(turn, idx, data) JOIN turns t ON t.id = r.turn"
        " ON CONFLICT (turn, idx) DO UPDATE SET data = excluded.data")


# One statement per list, in the order a segment sends them. The table name in the SQL
# comes from these constants only: a write naming any other table is refused.
ROWS_UPSERT: dict[str, str] = {MESSAGES: _rows_upsert(MESSAGES), TRAIL: _rows_upsert(TRAIL)}
MESSAGE_UPSERT = ROWS_UPSERT[MESSAGES]
TRAIL_UPSERT = ROWS_UPSERT[TRAIL]


def independent(sql: str) -> bool:
    return sql.startswith(_INDEPENDENT)


@dataclass(slots=True)
class Segment:
    """Ops of the batch written together; each op with the index of its write."""

    updates: list[tuple[int, TurnUpdate]] = field(default_factory=list)
    messages: list[tuple[int, MessageWrite]] = field(default_factory=list)
    intents: list[tuple[int, FencedIntent]] = field(default_factory=list)
    statements: list[tuple[int, Statement]] = field(default_factory=list)
    _turns_updated: set[str] = field(default_factory=set)
    _lists_written: set[tuple[str, str]] = field(default_factory=set)  # (turn, table)
    _ordered: bool = False  # holds a statement the turn rows must not pass

    def takes(self, op: TurnUpdate | MessageWrite | FencedIntent) -> bool:
        """Whether `op` may join: a turn's row once, and each list of a turn once (its
        conversation write and its trail write may share a segment); fenced intents
        while no statement they must not pass is in it."""
        if self._ordered:
            return False
        if isinstance(op, FencedIntent):
            return True
        if isinstance(op, TurnUpdate):
            return op.turn not in self._turns_updated
        return (op.turn, op.table) not in self._lists_written

    def add(self, i: int, op: TurnUpdate | MessageWrite | FencedIntent | Statement) -> None:
        if isinstance(op, FencedIntent):
            self.intents.append((i, op))
        elif isinstance(op, TurnUpdate):
            self.updates.append((i, op))
            self._turns_updated.add(op.turn)
        elif isinstance(op, MessageWrite):
            self.messages.append((i, op))
            self._lists_written.add((op.turn, op.table))
        else:
            self.statements.append((i, op))
            if not independent(op[0]):
                self._ordered = True

    def __bool__(self) -> bool:
        return bool(self.updates or self.messages or self.intents or self.statements)


def segments(writes: Sequence[Sequence[Op]]) -> list[Segment | tuple[int, Call]]:
    """The batch's ops, in order, cut where a segment must end: before a call (run on its
    own, in place), before a turn, conversation or trail row that would pass a statement
    not known to be independent of it, before a second write of a turn's row (or of the
    same list of its rows)."""
    out: list[Segment | tuple[int, Call]] = []
    current = Segment()
    for i, ops in enumerate(writes):
        for op in ops:
            if isinstance(op, (TurnUpdate, MessageWrite, FencedIntent)):
                if not current.takes(op):
                    out.append(current)
                    current = Segment()
                current.add(i, op)
            elif isinstance(op, tuple):
                current.add(i, op)
            else:
                if current:
                    out.append(current)
                    current = Segment()
                out.append((i, op))
    if current:
        out.append(current)
    return out


def turn_update(updates: Sequence[TurnUpdate], lock: Sequence[str] | None = None
                ) -> Statement:
    """One UPDATE for every turn row of a segment (each turn at most once), locking
    first, in id order, the rows of `lock` (None: the updated ones)."""
    return TURN_UPDATE, ([u.turn for u in updates], [u.state for u in updates],
                         [u.updated_at for u in updates], [u.record for u in updates],
                         [u.stop_code for u in updates], [u.checkpoint for u in updates],
                         [u.owner for u in updates], [u.epoch for u in updates],
                         sorted({u.turn for u in updates} if lock is None else lock))


@dataclass(frozen=True, slots=True)
class BatchLocks:
    """The turn rows a batch locks (`turns`, sorted) and at how many points (`points`:
    each segment that updates turn rows, each call that locks one). Locked at more than
    one point, a batch could hold a row of a high id and then wait for one of a lower
    id that a renewal holds while it waits for the first: so such a batch takes every
    one of its locks at its first, in order. `first_is_update`: that first lock is a
    turn update, which then takes them all; otherwise `LOCK_TURNS` goes first."""

    turns: list[str]
    points: int
    first_is_update: bool

    @property
    def up_front(self) -> bool:
        return self.points > 1


def batch_locks(parts: Sequence[Segment | tuple[int, Call]]) -> BatchLocks:
    turns: set[str] = set()
    points = 0
    first_is_update = False
    for part in parts:
        if isinstance(part, tuple):
            if not isinstance(part[1], TurnCall):
                continue
            turns.add(part[1].turn)
            here = 1
        else:
            # A segment locks where it updates turn rows and again where it writes
            # fenced intents (after its updates).
            turns.update(u.turn for _, u in part.updates)
            turns.update(f.turn for _, f in part.intents)
            here = bool(part.updates) + bool(part.intents)
            if not here:
                continue
        if points == 0:
            first_is_update = not isinstance(part, tuple) and bool(part.updates)
        points += here
    return BatchLocks(sorted(turns), points, first_is_update)


def message_upsert(messages: Sequence[MessageWrite]) -> list[Statement]:
    """One statement per list present in a segment's row writes (each list of a turn at
    most once): every conversation row in one, every trail row in another. In each,
    rows past the end of each write that `trims` are deleted and the written ones
    inserted or replaced."""
    by_table: dict[str, list[MessageWrite]] = {}
    for m in messages:
        by_table.setdefault(m.table, []).append(m)
    out: list[Statement] = []
    for table, sql in ROWS_UPSERT.items():
        writes = by_table.pop(table, [])
        if not writes:
            continue
        turns: list[str] = []
        idx: list[int] = []
        data: list[str] = []
        for m in writes:
            turns += [m.turn] * len(m.rows)
            idx += range(m.start, m.start + len(m.rows))
            data += m.rows
        trimmed = [m for m in writes if m.trims]
        out.append((sql, ([m.turn for m in trimmed],
                          [m.start + len(m.rows) for m in trimmed], turns, idx, data)))
    if by_table:
        raise ValueError(f"row writes to unknown tables: {sorted(by_table)}")
    return out


def intent_insert(intents: Sequence[FencedIntent]) -> Statement:
    return INTENT_INSERT, ([f.key for f in intents], [f.turn for f in intents],
                           [f.tool for f in intents], [f.arguments for f in intents],
                           [f.owner for f in intents], [f.epoch for f in intents])


def lapsed_error(f: FencedIntent) -> StaleLease:
    return StaleLease(f"turn {f.turn}: the lease of node {f.owner} has run out, or its"
                      f" claim {f.epoch} is no longer the turn's; the call is not sent")


def stale_writes(updates: Sequence[tuple[int, TurnUpdate]], written: set[str]
                 ) -> dict[int, TurnUpdate]:
    """The writes whose fenced turn update wrote nothing (`written`: the ids the UPDATE
    returned): write index -> its update."""
    return {i: u for i, u in updates if u.epoch is not None and u.turn not in written}


def stale_error(u: TurnUpdate) -> StaleLease:
    return StaleLease(f"turn {u.turn}: claim {u.epoch} of node {u.owner} is no longer "
                      "the turn's; not written")


def runs(statements: Sequence[Statement]) -> list[tuple[str, list[Sequence[Any]]]]:
    """Consecutive statements of one shape as one run (an `executemany`)."""
    out: list[tuple[str, list[Sequence[Any]]]] = []
    for sql, args in statements:
        if out and out[-1][0] == sql:
            out[-1][1].append(args)
        else:
            out.append((sql, [args]))
    return out
