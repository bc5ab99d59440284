"""The PostgreSQL store's writes (`PgWrites`): the ops each call of the store interface
makes, fenced by the fleet part's claims, handed to the steps' writer (or the intake's).

The shared store: a PostgreSQL database (`[store] url = "postgresql://..."`).

The same calls and the same write semantics as the embedded SQLite store. One writer
task commits in groups: every write queued while the previous transaction was
committing goes into the next one, so concurrent turns share a commit, and the commit
sends a few set-based statements, not one per write (`store/postgres_batch.py`): every
turn row of the batch in one UPDATE, every conversation row in one statement and every
trail row in another, the rest (journal entries, events) as pipelined `executemany`. A
caller that awaits a write resumes only after its transaction committed. `append_event`,
and the journal of an idempotent call, are not awaited: they commit, in order, with the
next durable write.
Events that must never be kept without their state (`turn.queued`, `turn.finished`,
`turn.message`) are in the row's transaction. A transaction that fails takes none of its
neighbours down: a write whose claim no longer holds fails alone inside it, and when the
server refuses the transaction the batch is retried write by write, and only the write
that fails reports the error.

A turn keeps two lists as rows, each row written once: its conversation (`messages`, one
row per message) and its trail (`trail`, its partial-work lines, loop guard keys and
side effects' outcomes, a few kilobytes of them a row). Its checkpoint counts the rows of
each; reads put them back into the checkpoint from the same snapshot as the checkpoint
itself. The message the turn was submitted with is a column of its row (`message`),
written when the row is inserted and never after: an UPDATE of the rest of the row
leaves it as stored, not rewritten.

Event numbers: an event row keeps the number the daemon's bus gave it as its key, as
in SQLite, so `events(after_seq=...)` reads the same on both backends and a client
deduplicates by `seq` as before. In a fleet each node's bus numbers from a block of 2**32
reserved at its start (`event_block_start`), so nodes never share a number without a
round trip per event (a sequence per event row was the other choice: it would make
every `append_event` wait for the database, or the bus renumber events after publishing
them). Every row also gets `pos`, an identity assigned at insert: the order in which
the rows of every node reached the database.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from turnkeeper.events import Event
from turnkeeper.policy.idempotency import IdempotencyKey
from turnkeeper.policy.turn_state import TERMINAL_STATES
from turnkeeper.store.base import (
    DEAD_LETTER_SQL,
    TERMINAL_SQL,
    MessageRows,
    StoreError,
    stored_message,
    stored_record,
)
from turnkeeper.store.fleet import CHANNEL_TURNS, MailTaken
from turnkeeper.store.postgres_batch import (
    EVENT_INSERT,
    EVENT_INSERT_FENCED,
    Conn,
    FencedIntent,
    Op,
    Statement,
    TurnCall,
    TurnUpdate,
)
from turnkeeper.store.postgres_conn import PgConnection, dumps
from turnkeeper.store.postgres_fleet import PgFleet
from turnkeeper.store.postgres_fused import (
    JOURNAL_INTENT,
    JOURNAL_OUTCOME,
    JOURNAL_OUTCOME_OF,
    MAIL_TAKEN,
)
from turnkeeper.store.postgres_intake import IntakeWriter, TurnInsert
from turnkeeper.store.postgres_outbox import PgOutbox
from turnkeeper.store.postgres_writer import StepWriter
from turnkeeper.store.writer import message_write


def _stop_code(record: dict[str, Any]) -> str | None:
    result = record.get("result")
    if not isinstance(result, dict):
        return None
    stopped = result.get("stopped_because")
    code = stopped.get("code") if isinstance(stopped, dict) else None
    return code if isinstance(code, str) else None


def _event_statement(event: Event) -> Statement:
    return (EVENT_INSERT, (event.seq, event.turn, event.ts, event.type,
                           dumps(event.to_json())))


_NOTIFY_TURNS: Statement = ("SELECT pg_notify($1, '')", (CHANNEL_TURNS,))


class PgWrites:
    """The store's writes: the steps' through `writer`, the submits' through `intake`,
    each write of a claimed turn fenced by `fleet`'s claim, each event with its outbox
    rows (`outbox`)."""

    def __init__(self, db: PgConnection, writer: StepWriter, intake: IntakeWriter,
                 fleet: PgFleet, outbox: PgOutbox) -> None:
        self.db = db
        self.writer = writer
        self.intake = intake
        self.fleet = fleet
        self.outbox = outbox
        self.node_id = db.node_id
        self._key_turn: dict[str, str] = {}  # journal keys of claimed turns in flight

    async def insert_turn(self, record: dict[str, Any], checkpoint: dict[str, Any], *,
                          events: Sequence[Event] = (), within_s: float | None = None,
                          idempotency: IdempotencyKey | None = None) -> int:
        """The turn's row, durable when this returns; `events` commit with it, and the
        key's row when given (`take_key`). Its number comes from a sequence, so turns
        submitted on any daemon share one order. Written by the intake's own group
        commit (`postgres_intake.py`), not queued behind the steps' writes."""
        stored = stored_record(record)
        stored.pop("seq", None)  # the insert puts the number the sequence gives first
        row = (record["id"], record["session"], record["state"], record["created_at"],
               record["updated_at"], dumps(stored), stored_message(record),
               dumps(checkpoint), _stop_code(record))
        self.writer.durable_writes += 1  # the store's counts hold the intake's writes too
        try:
            await self.intake.write([TurnInsert(
                record, row, [(e.seq, e.turn, e.ts, e.type, dumps(e.to_json()))
                              for e in events], idempotency,
                [op for e in events for op in self.outbox.outbox_ops(e, None)
                 if isinstance(op, tuple)])], within_s=within_s)
        except StoreError:
            self.writer.failed_writes += 1
            raise
        return int(record["seq"])

    async def save_turn(self, record: dict[str, Any],
                        checkpoint: dict[str, Any] | None = None, *,
                        messages: MessageRows | None = None,
                        trail: MessageRows | None = None,
                        events: Sequence[Event] = ()) -> None:
        """The record (and the checkpoint and the changed rows of its conversation and
        its trail, when given) in one transaction with `events`. A turn this node
        claimed is written only while its claim's epoch is still the turn's (StaleLease
        otherwise, nothing written)."""
        turn_id = record["id"]
        ops: list[Op] = [self.turn_update(record, checkpoint),
                         *message_write(turn_id, messages, trail),
                         *self.event_ops(events)]
        if record["state"] in TERMINAL_STATES:
            # Its end takes the turn's mail (a cancel waits there until now: see
            # `append_message`), in its transaction, and only if the claim holds.
            ops.append((MAIL_TAKEN, (turn_id,)))
        await self.writer.write(ops, supersedes=None if checkpoint is None else turn_id)
        if record["state"] in TERMINAL_STATES:
            self.fleet.claims.pop(turn_id, None)

    def queue_turn(self, record: dict[str, Any], checkpoint: dict[str, Any], *,
                   messages: MessageRows | None = None,
                   trail: MessageRows | None = None) -> bool:
        """`save_turn` of a record and checkpoint, queued and not awaited (the rules are
        `QueuesTurns`' in the store interface): it commits with the next durable write,
        before any later write of the turn, and a newer checkpoint of the turn arriving
        first drops it. Fenced like `save_turn`: a turn this node lost raises StaleLease
        here; one lost while it waits is refused in its commit, and the turn's next
        awaited write hears it. False when the store takes no more writes."""
        return self.writer.enqueue_turn(record["id"], [
            self.turn_update(record, checkpoint),
            *message_write(record["id"], messages, trail)])

    def turn_update(self, record: dict[str, Any], checkpoint: dict[str, Any] | None
                     ) -> TurnUpdate:
        """The turn's row, fenced by this node's claim when it holds the turn."""
        epoch = self.fleet.fence(record["id"])
        return TurnUpdate(record["id"], record["state"], record["updated_at"],
                          dumps(stored_record(record)), _stop_code(record),
                          None if checkpoint is None else dumps(checkpoint),
                          None if epoch is None else self.node_id, epoch)

    async def append_message(self, turn_id: str, message: dict[str, Any], *,
                             updated_at: float, events: Sequence[Event] = (),
                             mail_id: int | None = None) -> None:
        """Add a user message to the stored inbox of a turn, leaving the rest of its
        record as of its last checkpoint (the row is locked while it is changed).

        `mail_id`: the message came from another node by mail. The transaction first
        takes the mail (`DELETE ... RETURNING`), only while this node's claim of the
        turn holds, then adds the message: the take and its effect commit together, so
        a crash between them is impossible and a second delivery (or a node whose claim
        was taken over) finds the mail gone and writes nothing (MailTaken). A message's
        effect is a row, so it can share the take's transaction; a cancel's effect is
        the turn's end, so its mail is taken by the turn's last `save_turn` instead."""
        epoch = self.fleet.fence(turn_id) if mail_id is not None else None

        async def append(conn: Conn) -> None:
            if mail_id is not None:
                taken = await conn.fetchval(
                    "DELETE FROM mail m WHERE m.id = $1 AND m.turn = $2 AND ($4::bigint IS"
                    " NULL OR EXISTS (SELECT 1 FROM turns t WHERE t.id = m.turn AND"
                    " t.owner = $3 AND t.epoch = $4)) RETURNING m.id",
                    mail_id, turn_id, self.node_id, epoch)
                if taken is None:
                    raise MailTaken(f"turn {turn_id}: mail {mail_id} was already taken, or"
                                    f" node {self.node_id} no longer holds the turn;"
                                    " not applied")
            stored = await conn.fetchval("SELECT record FROM turns WHERE id = $1 FOR UPDATE",
                                         turn_id)
            if stored is None:
                return
            record = json.loads(stored)
            inbox = record.get("inbox")
            record["inbox"] = [*(inbox if isinstance(inbox, list) else []), message]
            record["updated_at"] = updated_at
            await conn.execute("UPDATE turns SET updated_at = $1, record = $2 WHERE id = $3",
                               updated_at, dumps(record), turn_id)

        await self.writer.write([TurnCall(turn_id, append), *self.event_ops(events)])

    def append_event(self, event: Event) -> None:
        if event.turn is not None and event.turn in self.fleet.lost:
            return  # a turn another node now runs: its events are that node's
        for op in self.event_ops((event,)):  # its outbox rows join the event's write
            self.writer.enqueue_event(op)

    def event_ops(self, events: Sequence[Event]) -> list[Op]:
        """The events' rows, each with its webhook outbox rows (if any); those of a
        claimed turn are written only while the claim holds."""
        ops: list[Op] = []
        for event in events:
            epoch = self.fleet.claims.get(event.turn) if event.turn is not None else None
            ops.append(_event_statement(event) if epoch is None else (
                EVENT_INSERT_FENCED, (event.seq, event.turn, event.ts, event.type,
                                      dumps(event.to_json()), epoch)))
            if self.outbox.route is not None:
                ops.extend(self.outbox.outbox_ops(event, epoch))
        return ops

    def reserve_event_seqs(self, upto: int) -> None:
        self.writer.enqueue([(
            "INSERT INTO meta (key, value) VALUES ('event_seq_reserved', $1) ON CONFLICT (key)"
            " DO UPDATE SET value = GREATEST(meta.value, excluded.value)", (upto,))])

    async def journal_intent(self, key: str, *, turn: str, tool: str, arguments: str,
                             idempotent: bool) -> None:
        """Queued or awaited as `StepWriter.journal_intent` says; a non-idempotent call's intent on
        a claimed turn only while its lease holds. See `Store.journal_intent`."""
        ops: list[Op] = [(JOURNAL_INTENT, (key, turn, tool, arguments, idempotent))]
        epoch = self.fleet.fence(turn)
        if epoch is not None:
            self._key_turn[key] = turn
            if not idempotent:  # the lease checked in the statement that writes it
                ops = [FencedIntent(key, turn, tool, arguments, self.node_id, epoch)]
        await self.writer.journal_intent(key, ops, idempotent=idempotent)

    async def journal_outcome(self, key: str, outcome: dict[str, Any]) -> None:
        turn = self._key_turn.pop(key, None)
        if turn is not None:
            self.fleet.fence(turn)  # a lost turn's outcome is the new holder's to write
        ops: list[Op] = [(JOURNAL_OUTCOME, (dumps(outcome), key)) if turn is None
                         else (JOURNAL_OUTCOME_OF, (dumps(outcome), key, turn))]
        await self.writer.journal_outcome(key, ops)

    async def requeue_turn(self, record: dict[str, Any], checkpoint: dict[str, Any], *,
                           messages: MessageRows | None = None,
                           trail: MessageRows | None = None,
                           events: Sequence[Event] = ()) -> None:
        self.fleet.claims.pop(record["id"], None)
        self.fleet.lost.discard(record["id"])
        await self.writer.write([*message_write(record["id"], messages, trail), (
            "UPDATE turns SET state = $1, updated_at = $2, record = $3, checkpoint = $4,"
            " stop_code = $5, replayed_by = NULL, owner = NULL, lease_until = NULL"
            " WHERE id = $6",
            (record["state"], record["updated_at"], dumps(stored_record(record)),
             dumps(checkpoint), _stop_code(record), record["id"])),
            *self.event_ops(events), _NOTIFY_TURNS])

    async def mark_replayed(self, turn_id: str, new_turn_id: str) -> None:
        await self.writer.write([("UPDATE turns SET replayed_by = $1 WHERE id = $2",
                            (new_turn_id, turn_id))])

    async def prune(self, *, finished_before: float, dead_letters: bool = False,
                    limit: int) -> int:
        keep_dead = "" if dead_letters else (
            f" AND COALESCE(stop_code, '') NOT IN {DEAD_LETTER_SQL}")
        rows = await self.db.fetch(
            f"SELECT id FROM turns WHERE state IN {TERMINAL_SQL} AND updated_at < $1"
            f"{keep_dead} ORDER BY seq LIMIT $2", finished_before, limit)
        ids = [r[0] for r in rows]
        # Checked again inside the transaction: a dead letter replayed since the read is
        # queued again, and keeps everything.
        due = f"SELECT id FROM turns WHERE id = ANY($1::text[]) AND state IN {TERMINAL_SQL}"
        ops: list[Op] = [
            (f"DELETE FROM events WHERE turn IN ({due})", (ids,)),
            (f"DELETE FROM journal WHERE turn IN ({due})", (ids,)),
            (f"DELETE FROM messages WHERE turn IN ({due})", (ids,)),
            (f"DELETE FROM trail WHERE turn IN ({due})", (ids,)),
            (f"DELETE FROM mail WHERE turn IN ({due})", (ids,)),
            (f"DELETE FROM turns WHERE id IN ({due})", (ids,)),
        ] if ids else []
        ops.append(("DELETE FROM events WHERE turn IS NULL AND ts < $1", (finished_before,)))
        await self.writer.write(ops)
        return len(ids)

    async def prune_idempotency_keys(self, *, created_before: float, limit: int) -> int:
        rows = await self.db.fetch("SELECT key FROM idempotency_keys WHERE created_at < $1"
                                   " ORDER BY created_at LIMIT $2", created_before, limit)
        keys = [r[0] for r in rows]
        if keys:
            await self.writer.write([("DELETE FROM idempotency_keys WHERE key ="
                                       " ANY($1::text[]) AND created_at < $2",
                                       (keys, created_before))])
        return len(keys)
