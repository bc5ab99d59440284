"""The event bus's live subscribers: a follower of one turn gets that turn's events and
no other's, a follower of every turn gets all of them, and one that falls behind its
buffer is dropped (its stream closed, counted once) without touching the others."""

from __future__ import annotations

import anyio
import pytest
from anyio.streams.memory import MemoryObjectReceiveStream

from turnkeeper.clock import FakeClock
from turnkeeper.events import Event, EventBus


def drain(stream: MemoryObjectReceiveStream[Event]) -> list[str | None]:
    """The turns of the events waiting in `stream`."""
    turns: list[str | None] = []
    while True:
        try:
            turns.append(stream.receive_nowait().turn)
        except (anyio.WouldBlock, anyio.EndOfStream):
            return turns


def test_followers_get_their_turn_and_followers_of_all_get_everything() -> None:
    bus = EventBus(clock=FakeClock())
    with bus.subscribe() as everything, bus.subscribe("a") as of_a, \
            bus.subscribe("a") as of_a_too, bus.subscribe("b") as of_b:
        for turn in ("a", "b", None, "c", "a"):
            bus.publish("turn.message", turn=turn)
        assert drain(everything) == ["a", "b", None, "c", "a"]
        assert drain(of_a) == ["a", "a"] and drain(of_a_too) == ["a", "a"]
        assert drain(of_b) == ["b"]
    bus.publish("turn.message", turn="a")  # nobody follows any more: nothing to offer to
    assert bus.dropped_subscribers == 0


def test_a_follower_behind_its_buffer_is_dropped_once_and_the_others_go_on() -> None:
    bus = EventBus(clock=FakeClock(), subscriber_buffer=2)
    with bus.subscribe("a") as slow, bus.subscribe("a") as reader, \
            bus.subscribe() as everything:
        for _ in range(3):
            bus.publish("turn.message", turn="a")
            assert drain(reader) == ["a"]
            assert drain(everything) == ["a"]
        assert bus.dropped_subscribers == 1
        assert drain(slow) == ["a", "a"]  # what it had, then the end of its stream
        with pytest.raises(anyio.EndOfStream):
            slow.receive_nowait()
        bus.publish("turn.message", turn="a")
        assert drain(reader) == ["a"] and bus.dropped_subscribers == 1
