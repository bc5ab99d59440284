"""The event bus: every event gets a daemon-wide sequence number, fans out in memory to
live subscribers, and is handed to the store.

A subscriber that cannot keep up is dropped (its stream closes) rather than allowed to
stall the turns that publish: publishing never awaits. `model.delta` events (streamed
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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import structlog
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from turnkeeper import jsonwire
from turnkeeper.clock import Clock, to_micros
from turnkeeper.errors import TurnkeeperError
from turnkeeper.event_types import EVENT_TYPES, EventBody, ModelDelta, TurnFinished

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
        out: dict[str, Any] = {"seq": self.seq, "ts": to_micros(self.ts)}
        if self.turn is not None:
            out["turn"] = self.turn
        out["type"] = self.type
        out.update(self.data)
        return out

    @property
    def body(self) -> EventBody | None:
        """The typed fields, from the catalogue; None for a type it does not list (an
        event stored by another daemon version)."""
        if self.typed is not None:
            return self.typed
        cls = EVENT_TYPES.get(self.type)
        return None if cls is None else cls.from_json(self.data)


@dataclass(slots=True)
class _Subscriber:
    send: MemoryObjectSendStream[Event]
    turn: str | None


def _offer(event: Event, subscribers: list[_Subscriber], dead: list[_Subscriber]) -> None:
    """Send `event` to each of `subscribers`; one whose buffer is full, or whose reader
    left, goes on `dead`."""
    for sub in subscribers:
        try:
            sub.send.send_nowait(event)
        except (anyio.WouldBlock, anyio.BrokenResourceError, anyio.ClosedResourceError):
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
        # Live subscribers by what they follow: an event is offered to the followers of
        # every turn and of its own turn, not to every follower there is (500 `submit
        # --follow` clients made each event 500 checks).
        self._of_all: list[_Subscriber] = []
        self._of_turn: dict[str, list[_Subscriber]] = {}
        self._buffer = subscriber_buffer
        self.dropped_subscribers = 0
        self.listeners: list[Callable[[Event], None]] = []
        self.listener_errors = 0
        self.strict = strict
        self.unknown_types = 0

    @property
    def last_seq(self) -> int:
        return self._seq

    def start_at(self, seq: int) -> None:
        """Continue numbering after `seq`: the store's highest persisted or reserved
        number, so no number a live subscriber may have seen is handed out twice."""
        self._seq = self._reserved = seq

    def publish(self, event: EventBody | str, turn: str | None = None,
                **data: Any) -> Event:
        prepared = self.prepare(event, turn, **data)
        if self._persist is not None and prepared.type not in LIVE_ONLY_TYPES:
            self._persist(prepared)
        self.deliver(prepared)
        return prepared

    def prepare(self, event: EventBody | str, turn: str | None = None,
                **data: Any) -> Event:
        """An event with its sequence number, not yet persisted or delivered: for an
        event that must commit in the same transaction as the state it reports (a turn's
        `turn.queued` with its row, `turn.finished` with its result), so a crash can
        never keep one without the other. The caller writes it, then `deliver`s it."""
        typed: EventBody | None = None
        if isinstance(event, EventBody):
            if data:
                raise TypeError("a catalogue event carries its own fields")
            type, data, typed = event.TYPE, event.to_json(), event
        else:
            type = event
            if type not in EVENT_TYPES:
                self._unknown(type)
        self._seq += 1
        if self._reserve is not None and self._seq > self._reserved - self._reserve_block // 2:
            # Reserve numbers ahead, in the store, before they are handed out: events
            # delivered live but lost in a crash (and live-only ones) are then never
            # renumbered after the restart, and a client deduplicating by seq misses none.
            self._reserved = self._seq + self._reserve_block
            self._reserve(self._reserved)
        # seq, ts, type, turn, data, typed: by position, 0.3 us less than by keyword
        return Event(self._seq, self._clock.time(), type, turn, data, typed)

    def _unknown(self, type: str) -> None:
        self.unknown_types += 1
        if self.strict:
            raise UnknownEventType(f"event type {type!r} is not in the catalogue")
        if self.unknown_types <= 10:
            log.error("events.unknown_type", event_type=type)

    def deliver(self, event: Event) -> None:
        """Fan an event out to listeners and live subscribers (no persistence)."""
        for listener in self.listeners:
            try:
                listener(event)
            except Exception:
                self.listener_errors += 1
        dead: list[_Subscriber] = []
        if self._of_all:
            _offer(event, self._of_all, dead)
        if self._of_turn and event.turn is not None:
            of_turn = self._of_turn.get(event.turn)
            if of_turn is not None:
                _offer(event, of_turn, dead)
        for sub in dead:
            if self._remove(sub):
                self.dropped_subscribers += 1
            sub.send.close()

    def _add(self, sub: _Subscriber) -> None:
        if sub.turn is None:
            self._of_all.append(sub)
        else:
            self._of_turn.setdefault(sub.turn, []).append(sub)

    def _remove(self, sub: _Subscriber) -> bool:
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
            sub.send.close()

    @contextmanager
    def subscribe(self, turn: str | None = None) -> Iterator[MemoryObjectReceiveStream[Event]]:
        """Live events from now on (for one turn, or all). Subscribe *before* reading the
        history from the store so nothing falls in the gap; dedupe by `seq`."""
        send, receive = anyio.create_memory_object_stream[Event](
            self._buffer if self._buffer > 0 else math.inf)
        sub = _Subscriber(send=send, turn=turn)
        self._add(sub)
        try:
            yield receive
        finally:
            self._remove(sub)
            send.close()
            receive.close()
