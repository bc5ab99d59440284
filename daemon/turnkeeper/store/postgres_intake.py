"""Submits into the PostgreSQL store: new turns' rows, written apart from the steps.

The store's writer (`postgres_conn.py`) is serial: one transaction at a time, and a
step's checkpoint waits for the one in flight. Submits used to be queued into it, so
the intake of a burst (a sequence number, an INSERT and a NOTIFY per turn, and the key
rows of an Idempotency-Key) stretched the transactions every running turn waited on.
They have a group commit of their own here, on a connection of their own: every turn
submitted while the last intake transaction was committing goes into the next one, as
one statement (`TURNS_INSERT`: every turn row from arrays with `unnest`, its
`turn.queued` event rows in the same statement, and one NOTIFY for the batch). A batch
without idempotency keys is that single statement, its own transaction: one round trip.
A batch with keys takes each key's row after the insert (`take_key`), and a batch whose
events have webhook outbox rows writes them after it, in one explicit transaction.

What a caller hears is what the store holds, as for any write (`writer.py`): a submit is
answered once its transaction committed; a connection lost before the answer came is
taken again (the insert skips a turn already there and reads its number back); a batch
the server refuses is written turn by turn, so one bad turn (a key another turn holds)
fails alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from turnkeeper.clock import Clock
from turnkeeper.policy.idempotency import IdempotencyKey
from turnkeeper.policy.store_outage import StoreOutage
from turnkeeper.store.base import KeyTaken
from turnkeeper.store.fleet import CHANNEL_TURNS
from turnkeeper.store.postgres_batch import Conn, Statement, runs
from turnkeeper.store.postgres_conn import Dedicated, commit_until_reachable, lost
from turnkeeper.store.writer import GroupCommitWriter, Write

# Every turn row of a batch, their `turn.queued` event rows and the batch's one NOTIFY,
# in one statement. Numbers come from the sequence in the arrays' order, so the turns of
# one session keep the order they were submitted in; the stored record (a JSON object
# without its number) gets its number as its first key. A turn already there (committed by
# an attempt whose answer was lost) is skipped; its event rows, keyed by their number,
# are skipped likewise.
TURNS_INSERT = (
    "WITH t AS (INSERT INTO turns (id, seq, session, state, created_at, updated_at, record,"
    " message, checkpoint, stop_code) SELECT s.id, s.seq, s.session, s.state, s.created_at,"
    " s.updated_at, '{\"seq\":' || s.seq || ',' || substr(s.record, 2), s.message,"
    " s.checkpoint, s.stop_code FROM (SELECT u.*, nextval('turn_seq') AS seq"
    " FROM unnest($1::text[], $2::text[], $3::text[], $4::float8[], $5::float8[],"
    " $6::text[], $7::text[], $8::text[], $9::text[]) AS u(id, session, state, created_at,"
    " updated_at, record, message, checkpoint, stop_code)) AS s"
    " ON CONFLICT (id) DO NOTHING RETURNING id, seq),"
    " e AS (INSERT INTO events (seq, turn, ts, type, data) SELECT * FROM unnest("
    "$10::bigint[], $11::text[], $12::float8[], $13::text[], $14::text[])"
    " ON CONFLICT (seq) DO NOTHING)"
    " SELECT t.id, t.seq FROM (SELECT pg_notify($15, '')) AS n LEFT JOIN t ON true")
SEQ_OF = "SELECT id, seq FROM turns WHERE id = ANY($1::text[])"


@dataclass(slots=True)
class TurnInsert:
    """A new turn's row (`row`: id, session, state, created_at, updated_at, record,
    message, checkpoint, stop_code), its event rows (seq, turn, ts, type, data), its
    key and `extra` statements; `record` gets its number (`seq`) when the insert
    commits."""

    record: dict[str, Any]
    row: tuple[Any, ...]
    events: list[tuple[Any, ...]] = field(default_factory=list)
    idempotency: IdempotencyKey | None = None
    # Statements that commit with the turn (its events' webhook outbox rows).
    extra: list[Statement] = field(default_factory=list)


async def take_key(conn: Conn, turn: str, key: IdempotencyKey) -> None:
    """The key's row for `turn`, replacing an expired one (or one whose turn was
    pruned). A live row of another turn raises `KeyTaken`, which rolls back the turn's
    insert with it: two nodes given one key at once make one turn (the second waits on
    the first's row in the unique index, then finds it)."""
    await conn.execute(
        "DELETE FROM idempotency_keys WHERE key = $1 AND (created_at < $2 OR NOT EXISTS"
        " (SELECT 1 FROM turns WHERE turns.id = idempotency_keys.turn))",
        key.key, key.stale_before)
    holder = await conn.fetchval(
        "INSERT INTO idempotency_keys (key, turn, fingerprint, created_at) VALUES"
        " ($1, $2, $3, $4) ON CONFLICT (key) DO NOTHING RETURNING turn",
        key.key, turn, key.fingerprint, key.created_at)
    if holder is None:  # held: by this turn after a lost answer, or by another one
        holder = await conn.fetchval("SELECT turn FROM idempotency_keys WHERE key = $1",
                                     key.key)
        if holder != turn:
            raise KeyTaken(f"idempotency key {key.key!r} is held by turn {holder}")


def turns_insert(inserts: Sequence[TurnInsert]) -> tuple[Any, ...]:
    """`TURNS_INSERT`'s arguments for `inserts` (each record a JSON object, `{...}`)."""
    columns = list(zip(*(i.row for i in inserts), strict=True))
    events = [e for i in inserts for e in i.events]
    event_columns: list[Sequence[Any]] = (list(zip(*events, strict=True)) if events
                                          else [()] * 5)
    return (*map(list, columns), *map(list, event_columns), CHANNEL_TURNS)


async def insert(conn: Conn, inserts: Sequence[TurnInsert]) -> None:
    """The turns in one transaction: one statement without keys or extra statements,
    the keys' rows and the extra statements after it otherwise. Each record gets its
    number."""
    keyed = [i for i in inserts if i.idempotency is not None]
    extra = [st for i in inserts for st in i.extra]
    if keyed or extra:
        # The turns first: a key whose turn is not there yet reads as a pruned turn's.
        async with conn.transaction():
            rows = await conn.fetch(TURNS_INSERT, *turns_insert(inserts))
            for i in keyed:
                assert i.idempotency is not None
                await take_key(conn, i.record["id"], i.idempotency)
            for sql, args in runs(extra):
                await conn.executemany(sql, args)
    else:
        rows = await conn.fetch(TURNS_INSERT, *turns_insert(inserts))
    seqs = {r["id"]: r["seq"] for r in rows if r["id"] is not None}
    missing = [i.record["id"] for i in inserts if i.record["id"] not in seqs]
    if missing:  # committed by an attempt whose answer was lost: the rows there are these
        seqs.update((r["id"], r["seq"]) for r in await conn.fetch(SEQ_OF, missing))
    for i in inserts:
        i.record["seq"] = int(seqs[i.record["id"]])


class IntakeWriter(GroupCommitWriter[TurnInsert]):
    """The group commit of submits, on its own connection (`connection`), sharing the
    store's outage state (`outage`): while the server cannot be reached the batch waits
    and is sent again, up to the store's `fatal_after`."""

    def __init__(self, clock: Clock, connection: Dedicated, outage: StoreOutage,
                 where: str, is_open: Callable[[], bool]) -> None:
        super().__init__(clock)
        self.is_open = is_open
        self.clock = clock
        self.connection = connection
        self.outage = outage
        self.where = where
        self.commits = 0
        self.reconnects = 0

    async def _commit(self, batch: list[Write[TurnInsert]]) -> None:
        self._answer(batch, await commit_until_reachable(
            lambda: self._commit_batch(batch), len(batch), outage=self.outage,
            clock=self.clock, where=self.where,
            closed=lambda: self._closed or not self.is_open(),
            reconnected=self._reconnected))

    def _reconnected(self) -> None:
        self.reconnects += 1

    async def _commit_batch(self, batch: list[Write[TurnInsert]]
                            ) -> list[BaseException | None]:
        """The batch at once; refused by the server, each write alone, so one bad write
        fails alone. A lost connection is raised (the whole batch is sent again)."""
        conn = await self.connection.get()
        try:
            try:
                await insert(conn, [op for w in batch for op in w.ops])
                self.commits += 1
                return [None] * len(batch)
            except Exception as exc:
                if lost(exc) or len(batch) == 1:
                    if lost(exc):
                        raise
                    return [exc]
            errors: list[BaseException | None] = []
            for w in batch:
                try:
                    await insert(conn, w.ops)
                    self.commits += 1
                    errors.append(None)
                except Exception as exc:
                    if lost(exc):
                        raise
                    errors.append(exc)
            return errors
        except BaseException as exc:
            self.connection.after(exc)
            raise
