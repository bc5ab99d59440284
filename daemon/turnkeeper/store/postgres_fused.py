"""A step's group commit in one round trip: the whole batch as ONE statement.

asyncpg cannot pipeline a transaction (BEGIN, the statements, COMMIT each wait for
their answer), so a commit of a turn's row, its conversation and trail rows and its
events cost six round trips, and a step three commits (the intent of its call, the
outcome, the checkpoint): thirteen round trips a step, half a second with the database
20 ms away. A single statement is its own transaction: `FUSED` writes everything a step
batch holds with data-modifying CTEs, one round trip, atomically.

It writes what `postgres_commit.commit` writes, with the same fencing, in the same lock
order:

- `l` locks every turn row the batch writes, sorted by id, before any is written (the
  order every statement that locks several turn rows takes them in); FOR UPDATE hands it
  the rows' latest versions, so the checks made against `l` see a claim another node
  committed while this statement waited for the lock (the statement's snapshot would not);
- `u` updates the turn rows; one whose claim no longer holds is not written, and every
  other row of its write is left out (`s`, the stale writes): that write fails alone
  (StaleLease), the others commit;
- `j` writes each fenced intent only while the claim of its turn (as `l` locked it) holds
  and its lease has not run out at the database's clock;
- the conversation and trail rows, the journal outcomes, the events and their outbox rows
  (an event of a claimed turn only while the claim's epoch is the turn's), and the mail
  a finished turn takes.

A batch is fused only when this is exactly what it holds (`fuse`): one segment of
`postgres_batch.segments`, no call, every conversation or trail write with its turn's
row, every fenced intent a write of its own, each journal key written once, and no
other statement. Anything else takes the transaction of `postgres_commit.commit`.
The statement's text is always the same (empty arrays for what a batch lacks), so it is
prepared once per connection.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from turnkeeper.store.postgres_batch import (
    EVENT_INSERT,
    EVENT_INSERT_FENCED,
    OUTBOX_INSERT,
    OUTBOX_INSERT_FENCED,
    Conn,
    FencedIntent,
    Op,
    Segment,
    TurnUpdate,
    lapsed_error,
    segments,
    stale_error,
)
from turnkeeper.store.writer import MESSAGES, TRAIL, MessageWrite

JOURNAL_OUTCOME = "UPDATE journal SET outcome = $1 WHERE key = $2"
# The same, naming the key's turn (known for a claimed turn's call): the writer may then
# commit it beside another transaction that writes none of the turn's rows.
JOURNAL_OUTCOME_OF = "UPDATE journal SET outcome = $1 WHERE key = $2 AND turn = $3"
JOURNAL_INTENT = ("INSERT INTO journal (key, turn, tool, arguments, idempotent)"
                  " VALUES ($1, $2, $3, $4, $5) ON CONFLICT (key) DO UPDATE SET outcome = NULL")
MAIL_TAKEN = "DELETE FROM mail WHERE turn = $1"  # a turn's end takes its mail


def _rows(table: str, first: int) -> str:
    """The CTEs writing `table`'s rows from `$first` on (7 arrays), a stale write's left
    out: the rows past each trimming write's end deleted, the written ones upserted."""
    a = [f"${first + k}" for k in range(7)]
    return (
        f" {table}_gone AS (DELETE FROM {table} m USING unnest({a[0]}::text[],"
        f" {a[1]}::int[], {a[2]}::int[]) AS e(turn, stop, w) WHERE m.turn = e.turn"
        " AND m.idx >= e.stop AND e.w NOT IN (SELECT w FROM s)),"
        f" {table}_put AS (INSERT INTO {table} (turn, idx, data) SELECT r.turn, r.idx,"
        f" r.data FROM unnest({a[3]}::text[], {a[4]}::int[], {a[5]}::text[],"
        f" {a[6]}::int[]) AS r(turn, idx, data, w) JOIN turns t ON t.id = r.turn"
        " WHERE r.w NOT IN (SELECT w FROM s)"
        " ON CONFLICT (turn, idx) DO UPDATE SET data = excluded.data),")


FUSED = (
    "WITH l AS MATERIALIZED (SELECT t.id, t.owner, t.epoch, t.lease_until FROM turns t"
    " WHERE t.id = ANY($1::text[]) ORDER BY t.id FOR UPDATE),"
    " u AS (UPDATE turns AS t SET state = u.state, updated_at = u.updated_at,"
    " record = u.record, stop_code = u.stop_code,"
    " checkpoint = COALESCE(u.checkpoint, t.checkpoint)"
    " FROM unnest($2::text[], $3::text[], $4::float8[], $5::text[], $6::text[],"
    " $7::text[], $8::text[], $9::bigint[])"
    " AS u(id, state, updated_at, record, stop_code, checkpoint, owner, epoch)"
    " WHERE t.id = u.id AND t.id IN (SELECT id FROM l)"
    " AND (u.epoch IS NULL OR (t.owner = u.owner AND t.epoch = u.epoch)) RETURNING t.id),"
    " s AS (SELECT x.w FROM unnest($2::text[], $9::bigint[], $10::int[]) AS x(id, epoch, w)"
    " WHERE x.epoch IS NOT NULL AND x.id NOT IN (SELECT id FROM u)),"
    " j AS (INSERT INTO journal (key, turn, tool, arguments, idempotent)"
    " SELECT i.key, i.turn, i.tool, i.arguments, false FROM unnest($11::text[],"
    " $12::text[], $13::text[], $14::text[], $15::text[], $16::bigint[])"
    " AS i(key, turn, tool, arguments, owner, epoch) JOIN l ON l.id = i.turn"
    " AND l.owner = i.owner AND l.epoch = i.epoch AND l.lease_until > clock_timestamp()"
    " ON CONFLICT (key) DO UPDATE SET outcome = NULL RETURNING key),"
    + _rows(MESSAGES, 17) + _rows(TRAIL, 24)
    + " o AS (UPDATE journal SET outcome = v.outcome FROM unnest($31::text[], $32::text[])"
    " AS v(outcome, key) WHERE journal.key = v.key),"
    " e AS (INSERT INTO events (seq, turn, ts, type, data) SELECT v.seq, v.turn, v.ts,"
    " v.type, v.data FROM unnest($33::bigint[], $34::text[], $35::float8[], $36::text[],"
    " $37::text[], $38::bigint[], $39::int[]) AS v(seq, turn, ts, type, data, epoch, w)"
    " WHERE v.w NOT IN (SELECT w FROM s) AND (v.epoch IS NULL OR COALESCE("
    "(SELECT l.epoch = v.epoch FROM l WHERE l.id = v.turn),"
    " EXISTS (SELECT 1 FROM turns t WHERE t.id = v.turn AND t.epoch = v.epoch)))"
    " ON CONFLICT (seq) DO NOTHING),"
    " ob AS (INSERT INTO webhook_outbox (webhook, seq, type, body, created_at, next_at,"
    " updated_at) SELECT v.webhook, v.seq, v.type, v.body, v.created_at, v.next_at,"
    " v.updated_at FROM unnest($40::text[], $41::bigint[], $42::text[], $43::text[],"
    " $44::float8[], $45::float8[], $46::float8[], $47::text[], $48::bigint[], $49::int[])"
    " AS v(webhook, seq, type, body, created_at, next_at, updated_at, turn, epoch, w)"
    " WHERE v.w NOT IN (SELECT w FROM s) AND (v.epoch IS NULL OR COALESCE("
    "(SELECT l.epoch = v.epoch FROM l WHERE l.id = v.turn),"
    " EXISTS (SELECT 1 FROM turns t WHERE t.id = v.turn AND t.epoch = v.epoch)))"
    " ON CONFLICT (webhook, seq) DO NOTHING),"
    " mail_gone AS (DELETE FROM mail USING unnest($50::text[], $51::int[]) AS x(turn, w)"
    " WHERE mail.turn = x.turn AND x.w NOT IN (SELECT w FROM s))"
    " SELECT 'u' AS k, id FROM u UNION ALL SELECT 'j', key FROM j")


@dataclass(slots=True)
class Fused:
    """A batch as `FUSED`'s columns; `w` the index of each row's write."""

    updates: list[tuple[int, TurnUpdate]] = field(default_factory=list)
    intents: list[tuple[int, FencedIntent]] = field(default_factory=list)
    lists: dict[str, list[tuple[int, MessageWrite]]] = field(
        default_factory=lambda: {MESSAGES: [], TRAIL: []})
    outcomes: list[tuple[str, str]] = field(default_factory=list)  # (outcome, key)
    events: list[tuple[Any, ...]] = field(default_factory=list)  # 5 columns, epoch, w
    outbox: list[tuple[Any, ...]] = field(default_factory=list)  # 7 columns, turn, epoch, w
    mail: list[tuple[str, int]] = field(default_factory=list)  # (turn, w)


def _statement(fused: Fused, i: int, sql: str, args: Sequence[Any]) -> bool:
    """`args` of a statement of write `i` into `fused`; False: not one it can hold."""
    if sql in (EVENT_INSERT, EVENT_INSERT_FENCED):
        fused.events.append((*args[:5], args[5] if len(args) > 5 else None, i))
    elif sql in (OUTBOX_INSERT, OUTBOX_INSERT_FENCED):
        turn, epoch = (args[7], args[8]) if len(args) > 7 else (None, None)
        fused.outbox.append((*args[:7], turn, epoch, i))
    elif sql in (JOURNAL_OUTCOME, JOURNAL_OUTCOME_OF):  # a key is one turn's
        fused.outcomes.append((args[0], args[1]))
    elif sql == MAIL_TAKEN:
        fused.mail.append((args[0], i))
    else:
        return False
    return True


def _segment(writes: Sequence[Sequence[Op]]) -> Segment | None:
    parts = segments(writes)
    if len(parts) != 1 or isinstance(parts[0], tuple):
        return None
    return parts[0]


def fuse(writes: Sequence[Sequence[Op]]) -> Fused | None:
    """The batch as one statement's columns, or None when it holds anything `FUSED`
    does not write as `postgres_commit.commit` would (see the module's docstring)."""
    part = _segment(writes)
    if part is None:
        return None
    fused = Fused(updates=part.updates, intents=part.intents)
    for i, m in part.messages:
        fused.lists[m.table].append((i, m))
    for i, (sql, args) in part.statements:
        if not _statement(fused, i, sql, args):
            return None
    updated = {u.turn for _, u in part.updates}
    if any(m.turn not in updated for _, m in part.messages):
        return None  # rows of a turn whose row the batch does not lock
    intent_writes = {i for i, _ in part.intents}
    if any(not isinstance(op, FencedIntent) for i in intent_writes for op in writes[i]):
        return None  # a lapsed intent's write must have nothing else to leave out
    keys = [f.key for _, f in part.intents] + [key for _, key in fused.outcomes]
    if len(set(keys)) != len(keys):
        return None  # a journal row written twice in one statement
    return fused


def _columns(rows: Sequence[tuple[Any, ...]], n: int) -> list[list[Any]]:
    return [list(c) for c in zip(*rows, strict=True)] if rows else [[] for _ in range(n)]


def _list_args(writes: Sequence[tuple[int, MessageWrite]]) -> list[list[Any]]:
    trimmed = [(i, m) for i, m in writes if m.trims]
    turns: list[str] = []
    idx: list[int] = []
    data: list[str] = []
    w: list[int] = []
    for i, m in writes:
        turns += [m.turn] * len(m.rows)
        idx += range(m.start, m.start + len(m.rows))
        data += m.rows
        w += [i] * len(m.rows)
    return [[m.turn for _, m in trimmed], [m.start + len(m.rows) for _, m in trimmed],
            [i for i, _ in trimmed], turns, idx, data, w]


def fused_args(fused: Fused) -> list[Any]:
    """`FUSED`'s 51 arguments."""
    ups = [u for _, u in fused.updates]
    lock = sorted({u.turn for u in ups} | {f.turn for _, f in fused.intents})
    args: list[Any] = [lock, [u.turn for u in ups], [u.state for u in ups],
                       [u.updated_at for u in ups], [u.record for u in ups],
                       [u.stop_code for u in ups], [u.checkpoint for u in ups],
                       [u.owner for u in ups], [u.epoch for u in ups],
                       [i for i, _ in fused.updates]]
    args += _columns([(f.key, f.turn, f.tool, f.arguments, f.owner, f.epoch)
                      for _, f in fused.intents], 6)
    args += _list_args(fused.lists[MESSAGES]) + _list_args(fused.lists[TRAIL])
    args += _columns(fused.outcomes, 2)
    args += _columns(fused.events, 7)
    args += _columns(fused.outbox, 10)
    args += _columns(fused.mail, 2)
    return args


async def commit_fused(conn: Conn, fused: Fused, size: int) -> list[BaseException | None]:
    """The batch of `size` writes in one statement (its own transaction): None for each
    write that committed, StaleLease for each whose claim no longer held."""
    rows = await conn.fetch(FUSED, *fused_args(fused))
    written = {r[1] for r in rows if r[0] == "u"}
    keys = {r[1] for r in rows if r[0] == "j"}
    errors: list[BaseException | None] = [None] * size
    for i, u in fused.updates:
        if u.epoch is not None and u.turn not in written:
            errors[i] = stale_error(u)
    for i, f in fused.intents:
        if f.key not in keys:
            errors[i] = lapsed_error(f)
    return errors
