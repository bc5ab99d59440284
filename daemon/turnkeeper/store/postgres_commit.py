"""A group commit's transaction on PostgreSQL: the statements `postgres_batch` builds, run
on one connection, segment by segment, with each write's fate (committed, or refused
because its claim no longer held) told apart.

A write whose claim turns out stale before any of its ops was sent is left out of the
rest of the transaction and fails alone (StaleLease); one found stale after part of it
was sent rolls the whole transaction back (the caller then commits the writes one by
one). The event rows go last, one `executemany` per shape: no other write depends on
them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from turnkeeper.store.postgres_batch import (
    EVENT_SQL,
    LOCK_TURNS,
    Conn,
    Op,
    Segment,
    Statement,
    batch_locks,
    intent_insert,
    lapsed_error,
    message_upsert,
    runs,
    segments,
    stale_error,
    stale_writes,
    turn_update,
)


@dataclass(slots=True)
class _Fates:
    """What the transaction knows of each write so far: its error (None: going well) and
    whether any of its ops has been sent."""

    errors: list[BaseException | None]
    started: set[int] = field(default_factory=set)
    events: dict[str, list[Sequence[Any]]] = field(default_factory=dict)

    def refuse(self, i: int, error: BaseException) -> None:
        """Write `i` cannot commit: left out, or, once part of it is sent, a rollback."""
        if i in self.started:
            raise error
        self.errors[i] = error


async def commit(conn: Conn, writes: Sequence[Sequence[Op]]) -> list[BaseException | None]:
    """The writes in one transaction: None for each that committed, StaleLease for each
    whose claim no longer held (nothing of it written). Any other failure is raised and
    the transaction rolled back; so is a StaleLease found after part of its write was
    sent (the caller then commits the writes one by one)."""
    fates = _Fates([None] * len(writes))
    parts = segments(writes)
    locks = batch_locks(parts)
    lock_all: list[str] | None = locks.turns if locks.up_front else None
    async with conn.transaction():
        if lock_all is not None and not locks.first_is_update:
            await conn.execute(LOCK_TURNS, lock_all)
            lock_all = None
        for part in parts:
            if isinstance(part, tuple):
                i, call = part
                if fates.errors[i] is None:
                    fates.started.add(i)
                    await call(conn)
                continue
            lock_all = await _segment(conn, part, fates, lock_all)
        for sql, rows in fates.events.items():
            await _send(conn, sql, rows)
    return fates.errors


async def _segment(conn: Conn, part: Segment, fates: _Fates,
                   lock_all: list[str] | None) -> list[str] | None:
    """One segment: its turn rows (locking every turn of the batch first when asked),
    conversation and trail rows, fenced intents, then its plain statements in order; its
    event rows are kept for the end. The turns still to lock (None once locked)."""
    errors = fates.errors
    updates = [(i, u) for i, u in part.updates if errors[i] is None]
    if updates:
        sql, args = turn_update([u for _, u in updates], lock_all)
        lock_all = None
        written = {r[0] for r in await conn.fetch(sql, *args)}
        for i, u in stale_writes(updates, written).items():
            fates.refuse(i, stale_error(u))
        fates.started.update(i for i, _ in updates)
    messages = [m for i, m in part.messages if errors[i] is None]
    fates.started.update(i for i, _ in part.messages if errors[i] is None)
    for sql, args in message_upsert(messages):
        await conn.execute(sql, *args)
    intents = [(i, f) for i, f in part.intents if errors[i] is None]
    if intents:
        sql, args = intent_insert([f for _, f in intents])
        written = {r[0] for r in await conn.fetch(sql, *args)}
        for i, f in intents:
            if f.key not in written:
                fates.refuse(i, lapsed_error(f))
        fates.started.update(i for i, _ in intents)
    plain: list[Statement] = []
    for i, (sql, args) in part.statements:
        if errors[i] is not None:
            continue
        fates.started.add(i)
        if sql in EVENT_SQL:
            fates.events.setdefault(sql, []).append(args)
        else:
            plain.append((sql, args))
    for sql, rows in runs(plain):
        await _send(conn, sql, rows)
    return lock_all


async def _send(conn: Conn, sql: str, rows: Sequence[Sequence[Any]]) -> None:
    if len(rows) == 1:
        await conn.execute(sql, *rows[0])
    else:
        await conn.executemany(sql, rows)
