"""The store interface. Everything the daemon persists goes through these calls, so a
shared PostgreSQL store can later let several daemons share the work.

Writes that the caller awaits are durable when the await returns (a submit answered 202
is on disk). `append_event` is the one write that is not awaited: events are batched
with the next durable write, in order, so the events that survive a crash are a prefix
of those published. `insert_turn` and `save_turn` take events that must commit in the
same transaction as the row (`turn.queued`, `turn.finished`, `turn.message`).

A turn's record and checkpoint are written together and describe the same moment; a
user message reaches the stored record through `append_message`, which touches nothing
else, so the stored inbox always holds every message the stored checkpoint has not.

A step's writes are appended, not rewritten. A turn keeps two lists as rows, each row
written once: its conversation (one row per message) and its trail (what the turn must
remember for the rest of its run: partial-work lines, loop guard keys, side effects'
outcomes, a few kilobytes of them to a row). A checkpoint holds counters and positions:
its "conversation" value is `{"count", "turn_start", "held_notes"}`, its "trail" value
`{"count", "tail"}` (the lines not yet in a row). `save_turn` / `requeue_turn` take the
`MessageRows` of each list that changed since the last save, in the same transaction. A
step that adds two messages writes two small rows and a checkpoint of a few kilobytes at
most, whatever the length of the turn. Reading a checkpoint gives the rows back inline
(`conversation["messages"]`, `trail["rows"]`, rows `0 .. count-1` in order), so the turn
rebuilds from it as from one written whole; a checkpoint written before rows existed
(messages inline, no "count"; no "trail") is read as it was stored.

A turn's message (what it was submitted with) never changes, and may be long. The store
writes it once, when the turn is inserted, apart from the record and as JSON
(`stored_message`); a record saved later (with each checkpoint, every step) is written
without it (`stored_record`), and every read puts it back (`record_of`). A record written
before the message was kept apart holds it itself.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import orjson

from turnkeeper import exits
from turnkeeper.errors import TurnkeeperError
from turnkeeper.events import Event
from turnkeeper.messages import json_text
from turnkeeper.policy.idempotency import IdempotencyKey, StoredKey
from turnkeeper.policy.limits import FinishedTurn
from turnkeeper.policy.outcome import DEAD_LETTER_CODES
from turnkeeper.policy.store_outage import StoreOutage
from turnkeeper.policy.turn_state import TERMINAL_STATES
from turnkeeper.store.outbox import Outbox
from turnkeeper.values import value_class


def sql_set(values: Iterable[str]) -> str:
    """A constant set as an SQL list: `('a','b')` (the values are our own enum names)."""
    return "(" + ",".join(f"'{v}'" for v in sorted(values)) + ")"


# The states of a finished turn and the stop codes of a dead letter, for both SQL stores.
TERMINAL_SQL = sql_set(TERMINAL_STATES)
DEAD_LETTER_SQL = sql_set(DEAD_LETTER_CODES)
# The most dead letters a listing shows, newest first (`Store.dead_letters`).
DEAD_LETTERS_SHOWN = 1000


def list_turns_sql(*, state: str | None, session: str | None, since: float | None,
                   before_seq: int | None, placeholder: Callable[[int], str],
                   source: str = "turns") -> tuple[str, list[Any]]:
    """The query of a turn listing (newest first, its LIMIT the last parameter) and its
    parameters but the limit, for either SQL store; `placeholder(n)` is the marker of
    the n-th parameter (`?` for SQLite, `$n` for PostgreSQL). It selects each turn's
    `record` and `message` (for `record_of`) from `source`, the store's turns and where
    it keeps their messages."""
    where: list[str] = []
    params: list[Any] = []
    for condition, value in (("state =", state), ("session =", session),
                             ("created_at >=", since), ("seq <", before_seq)):
        if value is not None and value != "":
            params.append(value)
            where.append(f"{condition} {placeholder(len(params))}")
    sql = f"SELECT record, message FROM {source}" + (" WHERE " + " AND ".join(where)
                                                     if where else "")
    return sql + f" ORDER BY seq DESC LIMIT {placeholder(len(params) + 1)}", params


class StoreError(TurnkeeperError):
    """The store cannot be used: the message says why and where."""

    exit_code = exits.IOERR


class KeyTaken(StoreError):
    """A submit's Idempotency-Key is held by another turn: nothing of the write was
    made. The caller reads the key again and answers with the turn that holds it."""


class StoreUnavailable(StoreError):
    """The store could not take a write for its own reasons (a disk full for longer than
    `store.fatal_after`, or closing while unwritable). The turn that made the write stays
    as the store holds it: it gets no result the store could not keep."""


class StoreInUse(StoreError):
    """Another daemon holds the store: this one must not run the same turns."""

    exit_code = exits.UNAVAILABLE


def journal_entry(key: str, tool: str, arguments: str, idempotent: Any,
                  outcome: str | None) -> dict[str, Any]:
    """A journal row (its outcome as JSON text, or NULL) as `Store.journal_get` answers
    it, the same from every store that keeps rows."""
    return {"key": key, "tool": tool, "arguments": arguments,
            "idempotent": bool(idempotent),
            "outcome": json.loads(outcome) if outcome else None}


def dead_letter_entry(record: dict[str, Any], replayed_by: str | None) -> dict[str, Any]:
    """One line of the dead-letter list, the same from every store: what a replay needs
    and what the operator reads to decide on one."""
    result = record.get("result") or {}
    return {"id": record["id"], "turn": record["id"], "session": record["session"],
            "message": record["message"], "budget": record.get("budget"),
            "deadline": record.get("deadline"),
            "stopped_because": result.get("stopped_because"),
            "last_error": record.get("last_error"), "finished_at": record["updated_at"],
            "replayed_by": replayed_by}


def usage_of(profile: str, state: str, code: str, tokens: Any, seconds: Any, steps: Any,
             cost: Any, would_have_stopped: Iterable[Mapping[str, Any]],
             extensions: Any = 0) -> FinishedTurn:
    """One finished turn's line of the limits report, from the fields of its record, the
    same from every store."""
    return FinishedTurn(profile=profile, status=state, code=code, tokens=int(tokens or 0),
                     seconds=float(seconds or 0.0), steps=int(steps or 0),
                     cost_usd=float(cost or 0.0),
                     would_have_stopped=tuple(str(w["code"]) for w in would_have_stopped),
                     extensions=int(extensions or 0))


@value_class
class MessageRows:
    """The rows of one of a turn's lists (its conversation, or its trail) a checkpoint
    writes. After the write the turn holds exactly `start + len(rows)` rows of that list:
    rows at index >= start are replaced by `rows`. `trims` False says the store holds no
    row past `start + len(rows)` (a step's write only adds rows), so there is nothing to
    delete; True (the safe default) has the write delete any it finds."""

    start: int
    rows: tuple[str, ...]  # a message as JSON text (encoded once), or a trail row
    trims: bool = True


def stored_record(record: Mapping[str, Any]) -> dict[str, Any]:
    """`record` as a turn's row holds it: without the turn's message, which the store
    writes once, apart, when the turn is inserted."""
    out = dict(record)
    out.pop("message", None)
    return out


def stored_message(record: Mapping[str, Any]) -> str:
    """The turn's message as the store keeps it apart: a JSON string, which any text
    column holds (PostgreSQL's text refuses a NUL character, JSON escapes it)."""
    return orjson.dumps(record["message"]).decode()


def stored_message_of(record_json: str) -> str | None:
    """`stored_message` of a record written before the message was kept apart, read from
    its row's JSON (what a migration moves out); None for a record without one."""
    record = json.loads(record_json)
    return stored_message(record) if "message" in record else None


def record_of(record_json: str, message_json: str | None) -> dict[str, Any]:
    """A turn's record read back: its row's JSON, with the turn's message (`stored_message`)
    put back; None for a row written before the message was kept apart, which holds it
    itself."""
    record: dict[str, Any] = json.loads(record_json)
    if message_json is not None:
        record["message"] = json.loads(message_json)
    return record


# A checkpoint as the store keeps it, with its message rows and its trail rows.
SavedCheckpoint = tuple[dict[str, Any], MessageRows | None, MessageRows | None]


def _counted(rows: Sequence[str], count: object) -> Sequence[str]:
    return rows[:count] if isinstance(count, int) and len(rows) > count else rows


def with_messages(checkpoint: dict[str, Any], rows: Sequence[str],
                  trail: Sequence[str] = ()) -> dict[str, Any]:
    """`checkpoint` (as read back, a fresh dict the caller owns) with its conversation's
    messages re-attached from the turn's message rows and its trail's rows (all of each,
    in index order: those at index 0 .. count-1 are kept). A checkpoint with no "count"
    in a list (written before rows existed) keeps that list as it was stored."""
    conv = checkpoint.get("conversation")
    if isinstance(conv, dict) and "count" in conv:
        conv["messages"] = orjson.loads("[" + ",".join(_counted(rows, conv["count"])) + "]")
    kept = checkpoint.get("trail")
    if isinstance(kept, dict) and "count" in kept:
        kept["rows"] = list(_counted(trail, kept["count"]))
    return checkpoint


def rows_by_turn(rows: Iterable[Iterable[Any]]) -> dict[str, list[str]]:
    """(turn, data) rows of one list (messages or trail), in index order within each
    turn, as each turn's list of data: what `with_messages` takes, for many turns read in
    one query."""
    out: dict[str, list[str]] = {}
    for turn_id, data in rows:
        out.setdefault(turn_id, []).append(data)
    return out


def rows_of(checkpoint: dict[str, Any]
            ) -> tuple[dict[str, Any], MessageRows | None, MessageRows | None]:
    """A checkpoint holding its rows inline (as read back) in the shape a write takes:
    the checkpoint with counts in place of its messages and trail rows, and every
    message and every trail row as a row from index 0. A checkpoint without a
    conversation (or a trail) comes back without rows for it."""
    out = dict(checkpoint)
    messages = trail = None
    conv = checkpoint.get("conversation")
    if isinstance(conv, dict) and "messages" in conv:
        stored = {k: v for k, v in conv.items() if k not in ("messages", "saved")}
        stored["count"] = len(conv["messages"])
        out["conversation"] = stored
        messages = MessageRows(0, tuple(json_text(m) for m in conv["messages"]))
    kept = checkpoint.get("trail")
    if isinstance(kept, dict) and "rows" in kept:
        out["trail"] = {**{k: v for k, v in kept.items() if k != "rows"},
                        "count": len(kept["rows"])}
        trail = MessageRows(0, tuple(str(r) for r in kept["rows"]))
    return out, messages, trail


@runtime_checkable
class QueuesTurns(Protocol):
    """A store that can take a turn's checkpoint without the caller waiting for it.

    `queue_turn` is `save_turn` of a record and its checkpoint (and rows), queued and not
    awaited: it commits in order, before any later write of the same turn, with the next
    durable write; one superseded by a newer checkpoint of the turn before its commit is
    dropped (its rows go with the newer one). It returns False when
    nothing was queued (the store is closing); the caller then awaits `save_turn`.

    What it promises, and so when a caller may use it: nothing that was acknowledged is
    lost, because a queued checkpoint acknowledges nothing. A crash before it commits
    leaves the turn at its previous checkpoint, and the turn runs that part again on
    resume, under the journal's rules: an idempotent tool call runs again with the same
    key, a non-idempotent one whose intent was stored without an outcome ends as outcome
    unknown, one with a stored outcome is not run again. A user message is in the stored
    inbox until a committed checkpoint holds it. So a caller queues a checkpoint only
    where the next durable thing the turn does is awaited (the model reply's checkpoint,
    a non-idempotent call's intent, the result), never before an effect that only that
    checkpoint would record."""

    def queue_turn(self, record: dict[str, Any], checkpoint: dict[str, Any], *,
                   messages: MessageRows | None = None,
                   trail: MessageRows | None = None) -> bool: ...


@functools.cache
def queues_turns(store_type: type) -> bool:
    """Whether stores of this type are `QueuesTurns`: asked for every turn, and the
    protocol check walks its members each time (4.4 us)."""
    return issubclass(store_type, QueuesTurns)


class Store(Outbox, Protocol):
    # Whether writes are going through; a backend retries the writes it cannot make for
    # its own reasons and reports here (see policy/store_outage.py).
    outage: StoreOutage

    async def open(self) -> None: ...

    async def close(self) -> None: ...

    async def max_event_seq(self) -> int:
        """The highest event number persisted or reserved: the bus continues after it."""
        ...

    def reserve_event_seqs(self, upto: int) -> None:
        """Record (with the next durable write, like an event) that numbers up to `upto`
        may be in use."""
        ...

    async def insert_turn(self, record: dict[str, Any], checkpoint: dict[str, Any], *,
                          events: Sequence[Event] = (), within_s: float | None = None,
                          idempotency: IdempotencyKey | None = None) -> int:
        """The turn's row and its message, durable on return, with `events`. With
        `within_s`: not made within that long, the write is withdrawn (`WriteWithdrawn`)
        and never commits, unless a commit holding it is under way, whose answer is
        then awaited. A submit is answered within a bound, and what it is answered is
        what the store holds. With `idempotency`: the key's row in the same transaction,
        replacing one of the same key written before its `stale_before` (or whose turn
        is gone); a live row of the key held by another turn fails the whole write
        (`KeyTaken`, or a StoreError), so one key makes one turn."""
        ...

    async def idempotency_key(self, key: str) -> StoredKey | None:
        """The row of `key`, expired or not (the caller's policy decides)."""
        ...

    async def prune_idempotency_keys(self, *, created_before: float, limit: int) -> int:
        """Delete up to `limit` key rows written before `created_before`; how many went."""
        ...

    async def save_turn(self, record: dict[str, Any],
                        checkpoint: dict[str, Any] | None = None, *,
                        messages: MessageRows | None = None,
                        trail: MessageRows | None = None,
                        events: Sequence[Event] = ()) -> None:
        """The record, the checkpoint when given and the message and trail rows when
        given (rows at index >= `start` replaced, in each list), in one transaction with
        `events`. Nothing is written for a turn that was never inserted."""
        ...

    async def append_message(self, turn_id: str, message: dict[str, Any], *,
                             updated_at: float, events: Sequence[Event] = ()) -> None: ...

    async def get_turn(self, turn_id: str) -> dict[str, Any] | None: ...

    async def get_checkpoint(self, turn_id: str) -> dict[str, Any] | None:
        """The turn's checkpoint with its messages and trail re-attached (see
        `with_messages`)."""
        ...

    async def list_turns(self, *, state: str | None = None, session: str | None = None,
                         limit: int = 100, since: float | None = None,
                         before_seq: int | None = None) -> list[dict[str, Any]]:
        """Newest first: submitted at or after `since`, numbered below `before_seq` (the
        cursor of the next page: the last `seq` of the one before)."""
        ...

    async def unfinished_turns(self) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        """Every turn not in a terminal state, in submission order, with its checkpoint
        as `get_checkpoint` gives it; read in one pass, not one query per turn."""
        ...

    async def session_history(self, session: str, *, before_seq: int
                              ) -> list[dict[str, Any]]: ...

    def append_event(self, event: Event) -> None: ...

    async def events(self, *, turn: str | None = None, after_seq: int = 0,
                     limit: int = 10_000) -> list[dict[str, Any]]: ...

    async def journal_intent(self, key: str, *, turn: str, tool: str, arguments: str,
                             idempotent: bool) -> None:
        """A call with this key is about to be sent. The first intent of a key keeps its
        row; a later one (the same action sent again with the same key, after a failure
        or an unknown outcome) clears the outcome an earlier attempt left, so a call cut
        in flight is never reported with the answer of the attempt before it."""
        ...

    async def journal_outcome(self, key: str, outcome: dict[str, Any]) -> None: ...

    async def journal_get(self, key: str) -> dict[str, Any] | None: ...

    async def finished_usage(self, *, since: float | None = None,
                             limit: int = 100_000) -> list[FinishedTurn]:
        """What each finished turn used and how it ended (newest first, finished at or
        after `since`), for the limits report: only those fields, never whole records,
        so a report over 50,000 turns builds 50,000 small objects, not millions."""
        ...

    async def dead_letters(self) -> list[dict[str, Any]]: ...

    async def mark_replayed(self, turn_id: str, new_turn_id: str) -> None: ...

    async def requeue_turn(self, record: dict[str, Any], checkpoint: dict[str, Any], *,
                           messages: MessageRows | None = None,
                           trail: MessageRows | None = None,
                           events: Sequence[Event] = ()) -> None:
        """Put a finished turn back in the queue (a dead letter replayed): its record
        (queued, no result), the checkpoint it resumes from and its rows (the same rule
        as `save_turn`), in one transaction with `events` (`turn.replayed`), so
        a crash leaves it either finished or queued with its event. It leaves the
        dead-letter list, which reads the record's result."""
        ...

    async def prune(self, *, finished_before: float, dead_letters: bool = False,
                    limit: int) -> int:
        """Delete up to `limit` turns that finished before `finished_before` (oldest
        first) with everything kept for them (checkpoint, rows, events, journal), in one
        transaction, and the daemon's own events older than that; dead letters only when
        `dead_letters`. Returns how many turns went: fewer than `limit` when no more are
        due."""
        ...

    async def flush(self) -> None: ...
