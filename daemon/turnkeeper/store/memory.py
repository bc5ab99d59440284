"""A store held in memory: the same semantics as the SQLite store, with nothing on disk.

It is a real backend, not a mock: the unit tests run the runner and the supervisor on it
and expect what SQLite gives (the conformance suite runs the same tests against both).
The benchmarks do not use it: they measure the SQLite store, or a stand-in that keeps
nothing (bench/discard_store.py) where the store is to be left out.

Every record, checkpoint and event goes through a JSON round trip on the way in and out,
as it does through SQLite's text columns, so a caller that keeps mutating its dict after
a write cannot change what was stored, and tuples come back as lists.

Message rows are kept per turn as the SQLite table holds them (JSON text by index) and
put back into a checkpoint when it is read.

What it does not have is durability: a write is "committed" when its call returns, and
everything is gone with the process. `append_event` and `reserve_event_seqs` apply at
once instead of riding along with the next durable write, which only makes the stored
events a longer prefix of those published than SQLite would keep after a crash.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio

from turnkeeper.events import Event
from turnkeeper.policy.idempotency import IdempotencyKey, StoredKey
from turnkeeper.policy.limits import FinishedTurn
from turnkeeper.policy.outcome import goes_to_dead_letters
from turnkeeper.policy.store_outage import StoreOutage
from turnkeeper.policy.turn_state import TERMINAL_STATES
from turnkeeper.store.base import (
    DEAD_LETTERS_SHOWN,
    KeyTaken,
    MessageRows,
    StoreError,
    dead_letter_entry,
    usage_of,
    with_messages,
)
from turnkeeper.store.outbox import MemoryOutbox, OutboxFront

_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, check_circular=False)


def _copy(value: Any) -> Any:
    """What a JSON column would give back for `value`."""
    return json.loads(_ENCODER.encode(value))


def _head(items: list[Any], limit: int) -> list[Any]:
    """The first `limit` items; a negative limit is none, as SQL's LIMIT -1."""
    return items if limit < 0 else items[:limit]


@dataclass(slots=True)
class _Row:
    seq: int
    session: str
    state: str
    updated_at: float
    record: dict[str, Any]
    checkpoint: dict[str, Any]
    replayed_by: str | None = None
    messages: dict[int, str] = field(default_factory=dict)  # index -> JSON text
    trail: dict[int, str] = field(default_factory=dict)  # index -> row of trail lines

    def write_rows(self, messages: MessageRows | None, trail: MessageRows | None) -> None:
        for table, rows in ((self.messages, messages), (self.trail, trail)):
            if rows is None:
                continue
            for idx in [i for i in table if i >= rows.start]:
                del table[idx]
            for idx, text in enumerate(rows.rows, rows.start):
                table[idx] = text

    def saved(self, record: dict[str, Any]) -> dict[str, Any]:
        """`record` as a later save stores it: with the message the turn was inserted
        with, as the SQL stores keep it (written once, apart)."""
        out: dict[str, Any] = _copy(record)
        if "message" in self.record:
            out["message"] = self.record["message"]
        return out

    def read_checkpoint(self) -> dict[str, Any]:
        return with_messages(_copy(self.checkpoint),
                             [self.messages[i] for i in sorted(self.messages)],
                             [self.trail[i] for i in sorted(self.trail)])


class MemoryStore(OutboxFront):
    """The `Store` (and `Outbox`) held in memory; its webhook outbox is its `outbox`."""

    outbox: MemoryOutbox

    def __init__(self) -> None:
        self.outbox = MemoryOutbox()
        self._turns: dict[str, _Row] = {}
        self._events: dict[int, dict[str, Any]] = {}
        self._event_turn: dict[int, str | None] = {}
        self._journal: dict[str, dict[str, Any]] = {}
        self._keys: dict[str, StoredKey] = {}
        self._reserved = 0
        self._next_seq = 0
        self._open = False
        self._closed = anyio.Event()
        self.durable_writes = 0
        self.outage = StoreOutage()  # memory never fails a write

    def __repr__(self) -> str:
        return f"MemoryStore(turns={len(self._turns)}, events={len(self._events)})"

    # -- lifecycle ----------------------------------------------------------------

    async def open(self) -> None:
        self._open = True

    async def close(self) -> None:
        self._open = False
        self._closed.set()

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
                  ) -> None:
        """Stands in for the SQLite writer task (the daemon starts one): returns once the
        store is closed."""
        task_status.started()
        await self._closed.wait()

    def _check_open(self) -> None:
        if not self._open:
            raise StoreError("state store is closed: the write was not made")
        self.durable_writes += 1

    def _rows(self) -> list[_Row]:
        return sorted(self._turns.values(), key=lambda r: r.seq)

    # -- writing ------------------------------------------------------------------

    async def flush(self) -> None:
        self._check_open()

    def _add_events(self, events: Sequence[Event]) -> None:
        for event in events:
            if event.seq not in self._events:  # as INSERT OR IGNORE: the first one stays
                self._events[event.seq] = _copy(event.to_json())
                self.outbox.add(event)
                self._event_turn[event.seq] = event.turn

    async def insert_turn(self, record: dict[str, Any], checkpoint: dict[str, Any], *,
                          events: Sequence[Event] = (), within_s: float | None = None,
                          idempotency: IdempotencyKey | None = None) -> int:
        self._check_open()
        if record["id"] in self._turns:
            raise StoreError(f"state store write failed: turn {record['id']} exists")
        if idempotency is not None:
            held = self._keys.get(idempotency.key)
            if held is not None and held.created_at >= idempotency.stale_before \
                    and held.turn in self._turns:
                raise KeyTaken(f"idempotency key {idempotency.key!r} is held by turn "
                               f"{held.turn}")
            self._keys[idempotency.key] = StoredKey(
                key=idempotency.key, turn=record["id"], fingerprint=idempotency.fingerprint,
                created_at=idempotency.created_at)
        self._next_seq += 1
        record["seq"] = self._next_seq
        self._turns[record["id"]] = _Row(
            seq=self._next_seq, session=record["session"], state=record["state"],
            updated_at=record["updated_at"], record=_copy(record), checkpoint=_copy(checkpoint))
        self._add_events(events)
        return self._next_seq

    async def save_turn(self, record: dict[str, Any],
                        checkpoint: dict[str, Any] | None = None, *,
                        messages: MessageRows | None = None,
                        trail: MessageRows | None = None,
                        events: Sequence[Event] = ()) -> None:
        self._check_open()
        self._write_turn(record, checkpoint, messages, trail)
        self._add_events(events)

    def queue_turn(self, record: dict[str, Any], checkpoint: dict[str, Any], *,
                   messages: MessageRows | None = None,
                   trail: MessageRows | None = None) -> bool:
        """`save_turn` without the await: applied at once (memory has nothing to queue
        behind), so it is never superseded. False once the store is closed."""
        if not self._open:
            return False
        self._write_turn(record, checkpoint, messages, trail)
        return True

    def _write_turn(self, record: dict[str, Any], checkpoint: dict[str, Any] | None,
                    messages: MessageRows | None, trail: MessageRows | None) -> None:
        row = self._turns.get(record["id"])
        if row is not None:  # as an UPDATE that matches no row: nothing changes
            row.state, row.updated_at = record["state"], record["updated_at"]
            row.record = row.saved(record)
            if checkpoint is not None:
                row.checkpoint = _copy(checkpoint)
            row.write_rows(messages, trail)

    async def append_message(self, turn_id: str, message: dict[str, Any], *,
                             updated_at: float, events: Sequence[Event] = ()) -> None:
        """The message joins the stored inbox; the rest of the stored record stays as of
        its last checkpoint (see the store interface for why)."""
        self._check_open()
        row = self._turns.get(turn_id)
        if row is not None:
            inbox = row.record.get("inbox") or []
            row.record["inbox"] = [*inbox, _copy(message)]
            row.record["updated_at"] = updated_at
            row.updated_at = updated_at
        self._add_events(events)

    def append_event(self, event: Event) -> None:
        if self._open:
            self._add_events([event])

    def reserve_event_seqs(self, upto: int) -> None:
        if self._open:
            self._reserved = max(self._reserved, upto)

    async def journal_intent(self, key: str, *, turn: str, tool: str, arguments: str,
                             idempotent: bool) -> None:
        self._check_open()
        entry = self._journal.setdefault(key, {"turn": turn, "tool": tool,
                                               "arguments": arguments,
                                               "idempotent": idempotent})
        entry["outcome"] = None

    async def journal_outcome(self, key: str, outcome: dict[str, Any]) -> None:
        self._check_open()
        entry = self._journal.get(key)
        if entry is not None:
            entry["outcome"] = _copy(outcome)

    async def requeue_turn(self, record: dict[str, Any], checkpoint: dict[str, Any], *,
                           messages: MessageRows | None = None,
                           trail: MessageRows | None = None,
                           events: Sequence[Event] = ()) -> None:
        self._check_open()
        row = self._turns.get(record["id"])
        if row is not None:
            row.state, row.updated_at = record["state"], record["updated_at"]
            row.record, row.checkpoint = row.saved(record), _copy(checkpoint)
            row.replayed_by = None
            row.write_rows(messages, trail)
        self._add_events(events)

    async def mark_replayed(self, turn_id: str, new_turn_id: str) -> None:
        self._check_open()
        row = self._turns.get(turn_id)
        if row is not None:
            row.replayed_by = new_turn_id

    async def prune(self, *, finished_before: float, dead_letters: bool = False,
                    limit: int) -> int:
        self._check_open()
        due = [turn_id for turn_id, row in sorted(self._turns.items(),
                                                  key=lambda kv: kv[1].seq)
               if row.state in TERMINAL_STATES and row.updated_at < finished_before
               and (dead_letters or not goes_to_dead_letters(row.record.get("result")))
               ][:limit]
        gone = set(due)
        for turn_id in due:
            del self._turns[turn_id]
        for key in [k for k, e in self._journal.items() if e["turn"] in gone]:
            del self._journal[key]
        for seq in [s for s, t in self._event_turn.items()
                    if t in gone or (t is None and self._events[s]["ts"] < finished_before)]:
            del self._events[seq]
            del self._event_turn[seq]
        self.durable_writes += 1
        return len(due)

    async def prune_idempotency_keys(self, *, created_before: float, limit: int) -> int:
        self._check_open()
        due = [k for k, row in self._keys.items() if row.created_at < created_before][:limit]
        for key in due:
            del self._keys[key]
        return len(due)

    # -- reading ------------------------------------------------------------------

    async def idempotency_key(self, key: str) -> StoredKey | None:
        self._check_open()
        return self._keys.get(key)

    async def max_event_seq(self) -> int:
        return max(max(self._events, default=0), self._reserved)

    async def get_turn(self, turn_id: str) -> dict[str, Any] | None:
        row = self._turns.get(turn_id)
        if row is None:
            return None
        record: dict[str, Any] = _copy(row.record)
        if row.replayed_by:
            record["replayed_by"] = row.replayed_by
        return record

    async def get_checkpoint(self, turn_id: str) -> dict[str, Any] | None:
        row = self._turns.get(turn_id)
        return None if row is None else row.read_checkpoint()

    async def list_turns(self, *, state: str | None = None, session: str | None = None,
                         limit: int = 100, since: float | None = None,
                         before_seq: int | None = None) -> list[dict[str, Any]]:
        rows = [r for r in reversed(self._rows())
                if (not state or r.state == state) and (not session or r.session == session)
                and (since is None or r.record["created_at"] >= since)
                and (before_seq is None or r.seq < before_seq)]
        return [_copy(r.record) for r in _head(rows, limit)]

    async def unfinished_turns(self) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        return [(_copy(r.record), r.read_checkpoint()) for r in self._rows()
                if r.state not in TERMINAL_STATES]

    async def session_history(self, session: str, *, before_seq: int) -> list[dict[str, Any]]:
        return [_copy(r.record) for r in self._rows()
                if r.session == session and r.seq < before_seq and r.state in TERMINAL_STATES]

    async def events(self, *, turn: str | None = None, after_seq: int = 0,
                     limit: int = 10_000) -> list[dict[str, Any]]:
        seqs = sorted(s for s in self._events
                      if s > after_seq and (turn is None or self._event_turn[s] == turn))
        return [_copy(self._events[s]) for s in _head(seqs, limit)]

    async def journal_get(self, key: str) -> dict[str, Any] | None:
        entry = self._journal.get(key)
        if entry is None:
            return None
        return {"key": key, "tool": entry["tool"], "arguments": entry["arguments"],
                "idempotent": bool(entry["idempotent"]),
                "outcome": _copy(entry["outcome"]) if entry["outcome"] else None}

    async def finished_usage(self, *, since: float | None = None,
                             limit: int = 100_000) -> list[FinishedTurn]:
        floor = since if since is not None else 0.0
        rows = [r for r in reversed(self._rows())
                if r.state in TERMINAL_STATES and r.updated_at >= floor
                and r.record.get("result")]
        return [usage_of(r.record.get("profile") or "default", r.state,
                         r.record["result"]["stopped_because"]["code"],
                         r.record["usage"]["total_tokens"], r.record["usage"]["seconds"],
                         r.record["counters"]["steps"], r.record["usage"]["cost_usd"],
                         r.record.get("would_have_stopped") or (),
                         r.record["result"].get("extensions"))
                for r in _head(rows, limit)]

    async def dead_letters(self) -> list[dict[str, Any]]:
        out = []
        for row in reversed(self._rows()):
            result = row.record.get("result") or {}
            if not goes_to_dead_letters(result):
                continue
            out.append(dead_letter_entry(_copy(row.record), row.replayed_by))
            if len(out) >= DEAD_LETTERS_SHOWN:
                break
        return out
