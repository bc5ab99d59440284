"""The event bus: every event gets a daemon-wide sequence number, fans out in memory to
live subscribers, and is handed to the store.

A subscriber that cannot keep up is dropped (its stream closes) rather than allowed to
stall the turns that publish: publishing never awaits. What waits for a subscriber is
each event's NDJSON line, made once and shared by all of them, counted in bytes; with
what its socket holds, that is its backlog, and `policy/admission.py`'s
`FollowerBacklog` says when it is too much (the bus is handed the rule: it does not
import `policy/`). `model.delta` events (streamed
text) are live only; everything else is persisted so a turn's events survive restarts.

Listeners are synchronous in-process hooks called on every event as it is published
(metrics derive their counters here, so the runner is not sprinkled with metric calls).
A listener must be quick and must not raise; one that does is counted, never propagated.

What an event carries is fixed by its class in `turnkeeper.event_types`: publish one
(`bus.publish(ModelFailover(...), turn=...)`). The older form, a type name and keyword
fields, is still accepted while publishers move over; a name the catalogue does not know
is a bug, raised by a strict bus (tests) and logged by the daemon's, which must never
fail a turn over how it reports it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import anyio
import structlog
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from turnkeeper import jsonwire
from turnkeeper.clock import Clock
from turnkeeper.errors import TurnkeeperError
from turnkeeper.event_types import EVENT_TYPES, EventBody, ModelDelta, TurnFinished

if TYPE_CHECKING:
    from turnkeeper.policy.admission import FollowerBacklog

log = structlog.get_logger("turnkeeper.events")

LIVE_ONLY_TYPES = frozenset({ModelDelta.TYPE})
TERMINAL_EVENT = TurnFinished.TYPE


class UnknownEventType(TurnkeeperError):
    """An event published under a type name the catalogue does not list."""


@dataclass(slots=True)
class Event:
    """One published event. Never changed once made (the wire form is filled in once, on
    first use); not frozen only because a frozen dataclass pays a call per field to be
    built, five events a step."""

    seq: int
    ts: float
    type: str
    turn: str | None
    data: dict[str, Any]
    # The catalogue event it was published as, kept so a listener (metrics) reads typed
    # fields without parsing the wire form back.
    typed: EventBody | None = field(default=None, compare=False, repr=False)
    # The wire form, encoded once on first use: the store's row and every stream that
    # carries the event write these same bytes.
    _wire: bytes | None = field(default=None, init=False, compare=False, repr=False)

    def encoded_bytes(self) -> bytes:
        """`to_json()` as compact JSON in UTF-8, encoded once."""
        wire = self._wire
        if wire is None:
            wire = self._wire = jsonwire.dumps(self.to_json())
        return wire

    def encoded(self) -> str:
        """`to_json()` as compact JSON text: the same JSON as `encoded_bytes()`."""
        return self.encoded_bytes().decode()

    def to_json(self) -> dict[str, Any]:
        # One dict display, the time rounded as `to_micros` does, in its line (five
        # events a step: a call and three stores fewer each).
        turn = self.turn
        if turn is None:
            return {"seq": self.seq, "ts": round(self.ts * 1_000_000) / 1_000_000,
                    "type": self.type, **self.data}
        return {"seq": self.seq, "ts": round(self.ts * 1_000_000) / 1_000_000,
                "turn": turn, "type": self.type, **self.data}

    @property
    def body(self) -> EventBody | None:
        """The typed fields, from the catalogue; None for a type it does not list (an
        event stored by another daemon version)."""
        if self.typed is not None:
            return self.typed
        cls = EVENT_TYPES.get(self.type)
        return None if cls is None else cls.from_json(self.data)


class Live(NamedTuple):
    """An event as a live stream sends it: what a stream skips or filters by, and its
    NDJSON line (the encoded event and a newline). Made once per event and shared by
    every follower: the event's data and typed fields are not kept alive by a follower
    that has not read it yet, only these bytes."""

    seq: int
    type: str
    turn: str | None
    line: bytes


class Follower:
    """One live subscriber: the events waiting for it and their bytes, and what the
    stream that reads it tells the bus (`pending`: the bytes its socket holds unsent;
    `on_drop`: how to stop the stream at once, even one stuck writing to a client that
    reads nothing)."""

    __slots__ = ("_receive", "_send", "behind_since", "dropped", "on_drop", "pending",
                 "queued_bytes", "turn")

    def __init__(self, turn: str | None, send: MemoryObjectSendStream[Live],
                 receive: MemoryObjectReceiveStream[Live]) -> None:
        self.turn = turn
        self._send = send
        self._receive = receive
        self.queued_bytes = 0
        self.pending: Callable[[], int] | None = None
        self.on_drop: Callable[[], None] | None = None
        self.behind_since: float | None = None
        self.dropped: str | None = None  # why the bus dropped it ("buffer", "stalled")

    @property
    def backlog_bytes(self) -> int:
        """Every byte held for this follower: its queue and its socket's unsent bytes."""
        pending = self.pending
        return self.queued_bytes + (pending() if pending is not None else 0)

    def receive_nowait(self) -> Live:
        live = self._receive.receive_nowait()
        self.queued_bytes -= len(live.line)
        return live

    async def receive(self) -> Live:
        live = await self._receive.receive()
        self.queued_bytes -= len(live.line)
        return live

    def __aiter__(self) -> Follower:
        return self

    async def __anext__(self) -> Live:
        try:
            return await self.receive()
        except anyio.EndOfStream:
            raise StopAsyncIteration from None

    def discard(self) -> int | None:
        """Let go of the events still waiting (a dropped follower's): the lowest seq
        among them, or None when none was."""
        low: int | None = None
        while True:
            try:
                seq = self.receive_nowait().seq
            except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                return low
            low = seq if low is None else min(low, seq)

    def _drop(self, why: str) -> None:
        self.dropped = why
        self._send.close()
        if self.on_drop is not None:
            self.on_drop()

    def _close(self) -> None:
        self._send.close()
        self._receive.close()
        self.queued_bytes = 0


def _offer(live: Live, followers: list[Follower], dead: list[Follower],
           rule: FollowerBacklog | None, now: float) -> None:
    """Send `live` to each of `followers`; one whose buffer is full, whose reader left,
    or whose backlog the rule refuses goes on `dead`."""
    size = len(live.line)
    for sub in followers:
        try:
            sub._send.send_nowait(live)
        except (anyio.WouldBlock, anyio.BrokenResourceError, anyio.ClosedResourceError):
            sub.dropped = "buffer"
            dead.append(sub)
            continue
        sub.queued_bytes += size
        if rule is not None:
            why, sub.behind_since = rule.judge(sub.backlog_bytes, sub.behind_since, now)
            if why is not None:
                sub.dropped = why
                dead.append(sub)


class EventBus:
    def __init__(self, *, clock: Clock, start_seq: int = 0,
                 persist: Callable[[Event], None] | None = None,
                 reserve: Callable[[int], None] | None = None, reserve_block: int = 10_000,
                 subscriber_buffer: int = 10_000, strict: bool = False) -> None:
        self._clock = clock
        self._seq = start_seq
        self._persist = persist
        self._reserve = reserve
        self._reserve_block = reserve_block
        self._reserved = start_seq
        self._reserve_from = self._reserve_threshold()
        # Live subscribers by what they follow: an event is offered to the followers of
        # every turn and of its own turn, not to every follower there is (500 `submit
        # --follow` clients made each event 500 checks).
        self._of_all: list[Follower] = []
        self._of_turn: dict[str, list[Follower]] = {}
        self._buffer = subscriber_buffer
        # When a follower is too far behind (set from the policy in force; None: only
        # the event count of `subscriber_buffer` bounds it).
        self.follower_rule: FollowerBacklog | None = None
        self._undelivered: set[int] = set()  # prepared, not delivered or withdrawn yet
        self.dropped_subscribers = 0
        self.listeners: list[Callable[[Event], None]] = []
        # Listeners of a few types only (`listen`), by type: an event of any other type
        # costs them one dict lookup, not a call each.
        self._listeners_of: dict[str, list[Callable[[Event], None]]] = {}
        self.listener_errors = 0
        self.strict = strict
        self.unknown_types = 0

    @property
    def clock(self) -> Clock:
        return self._clock

    @property
    def last_seq(self) -> int:
        return self._seq

    def start_at(self, seq: int) -> None:
        """Continue numbering after `seq`: the store's highest persisted or reserved
        number, so no number a live subscriber may have seen is handed out twice."""
        self._seq = self._reserved = seq
        self._reserve_from = self._reserve_threshold()

    def publish(self, event: EventBody | str, turn: str | None = None,
                **data: Any) -> Event:
        prepared = self._prepare(event, turn, data)
        if self._persist is not None and prepared.type not in LIVE_ONLY_TYPES:
            self._persist(prepared)
        self.deliver(prepared)
        return prepared

    def prepare(self, event: EventBody | str, turn: str | None = None,
                **data: Any) -> Event:
        """An event with its sequence number, not yet persisted or delivered: for an
        event that must commit in the same transaction as the state it reports (a turn's
        `turn.queued` with its row, `turn.finished` with its result), so a crash can
        never keep one without the other. The caller writes it, then `deliver`s it, or
        `withdraw`s it when the write failed. Events numbered after it may be delivered
        first: until it is, a follower's stream cannot be reopened past its seq."""
        prepared = self._prepare(event, turn, data)
        self._undelivered.add(prepared.seq)
        return prepared

    def withdraw(self, event: Event) -> None:
        """A prepared event that will never be delivered (its write failed)."""
        self._undelivered.discard(event.seq)

    def resume_point(self, sent: int, waiting: int | None) -> int:
        """The seq a dropped follower's stream may be reopened after: at most the last
        it was sent, and below any event still owed to it (`waiting`: the lowest seq left
        in its queue) or not delivered yet (prepared, its write under way), since events
        are not always delivered in the order of their numbers."""
        low = min(self._undelivered, default=None)
        for seq in (waiting, low):
            if seq is not None and seq <= sent:
                sent = seq - 1
        return sent

    def _prepare(self, event: EventBody | str, turn: str | None,
                 data: dict[str, Any]) -> Event:
        typed: EventBody | None = None
        if isinstance(event, EventBody):
            if data:
                raise TypeError("a catalogue event carries its own fields")
            type, data, typed = event.TYPE, event.to_json(), event
        else:
            type = event
            if type not in EVENT_TYPES:
                self._unknown(type)
        seq = self._seq = self._seq + 1
        if seq > self._reserve_from:
            self._reserve_ahead(seq)
        # seq, ts, type, turn, data, typed: by position, 0.3 us less than by keyword
        return Event(seq, self._clock.time(), type, turn, data, typed)

    def _reserve_ahead(self, seq: int) -> None:
        """Reserve numbers ahead, in the store, before they are handed out: events
        delivered live but lost in a crash (and live-only ones) are then never
        renumbered after the restart, and a client deduplicating by seq misses none."""
        if self._reserve is not None:
            self._reserved = seq + self._reserve_block
            self._reserve(self._reserved)
        self._reserve_from = self._reserve_threshold()

    def _reserve_threshold(self) -> float:
        """The seq past which numbers are reserved again: half a block before the end of
        the numbers reserved (never, without a store to reserve them in)."""
        if self._reserve is None:
            return math.inf
        return self._reserved - self._reserve_block // 2

    def _unknown(self, type: str) -> None:
        self.unknown_types += 1
        if self.strict:
            raise UnknownEventType(f"event type {type!r} is not in the catalogue")
        if self.unknown_types <= 10:
            log.error("events.unknown_type", event_type=type)

    def listen(self, listener: Callable[[Event], None], *, types: Iterable[str]) -> None:
        """Call `listener` with every event of `types` delivered (of any type: append it
        to `listeners`)."""
        for type in types:
            self._listeners_of.setdefault(type, []).append(listener)

    def deliver(self, event: Event) -> None:
        """Fan an event out to listeners and live subscribers (no persistence)."""
        if self._undelivered:
            self._undelivered.discard(event.seq)
        for listener in self.listeners:
            try:
                listener(event)
            except Exception:
                self.listener_errors += 1
        if self._listeners_of:
            for listener in self._listeners_of.get(event.type, ()):
                try:
                    listener(event)
                except Exception:
                    self.listener_errors += 1
        if self._of_all or self._of_turn:  # else no stream follows anything
            self._stream(event)

    def _stream(self, event: Event) -> None:
        """Offer the event to the live followers of every turn and of its own."""
        of_turn = self._of_turn.get(event.turn) if event.turn is not None else None
        if not self._of_all and of_turn is None:
            return
        # One line for every follower; a copy of orjson's output, which sits in a
        # buffer of at least 4 KiB that it never gives back: kept in a queue, each event
        # held 4 KiB, whatever its size.
        live = Live(event.seq, event.type, event.turn, event.encoded_bytes() + b"\n")
        rule = self.follower_rule
        now = self._clock.monotonic() if rule is not None else 0.0
        dead: list[Follower] = []
        if self._of_all:
            _offer(live, self._of_all, dead, rule, now)
        if of_turn is not None:
            _offer(live, of_turn, dead, rule, now)
        for sub in dead:
            if self._remove(sub):
                self.dropped_subscribers += 1
                log.warning("events.follower_dropped", reason=sub.dropped,
                            backlog_bytes=sub.backlog_bytes, turn=sub.turn)
            sub._drop(sub.dropped or "buffer")

    def followers(self) -> dict[str, int]:
        """The live followers now: how many, the bytes held for them (all, and the
        largest backlog), and how many were dropped for falling behind since the start."""
        backlogs = [sub.backlog_bytes for sub in itertools.chain(self._of_all,
                                                                 *self._of_turn.values())]
        rule = self.follower_rule
        return {"open": len(backlogs), "backlog_bytes": sum(backlogs),
                "largest_backlog_bytes": max(backlogs, default=0),
                "max_backlog_bytes": rule.max_bytes if rule is not None else 0,
                "dropped": self.dropped_subscribers}

    def _add(self, sub: Follower) -> None:
        if sub.turn is None:
            self._of_all.append(sub)
        else:
            self._of_turn.setdefault(sub.turn, []).append(sub)

    def _remove(self, sub: Follower) -> bool:
        """False when it was gone already."""
        followers = self._of_all if sub.turn is None else self._of_turn.get(sub.turn)
        if followers is None or sub not in followers:
            return False
        followers.remove(sub)
        if sub.turn is not None and not followers:
            del self._of_turn[sub.turn]
        return True

    def close_subscribers(self) -> None:
        """End every live stream, as the daemon stops: a reader sees its stream end (and
        reconnects to the next daemon) instead of holding the shutdown up."""
        of_all, of_turn = self._of_all, self._of_turn
        self._of_all, self._of_turn = [], {}
        for sub in itertools.chain(of_all, *of_turn.values()):
            sub._send.close()

    @contextmanager
    def subscribe(self, turn: str | None = None) -> Iterator[Follower]:
        """Live events from now on (for one turn, or all). Subscribe *before* reading the
        history from the store so nothing falls in the gap; dedupe by `seq`."""
        send, receive = anyio.create_memory_object_stream[Live](
            self._buffer if self._buffer > 0 else math.inf)
        sub = Follower(turn, send, receive)
        self._add(sub)
        try:
            yield sub
        finally:
            self._remove(sub)
            sub._close()
