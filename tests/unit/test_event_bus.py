"""The event bus's live subscribers: a follower of one turn gets that turn's events and
no other's, a follower of every turn gets all of them, and one that falls behind its
buffer is dropped (its stream closed, counted once) without touching the others."""

from __future__ import annotations

import json

import anyio
import pytest

from turnkeeper.clock import FakeClock
from turnkeeper.events import EventBus, Follower
from turnkeeper.policy.admission import FollowerBacklog


def drain(stream: Follower) -> list[str | None]:
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


def test_a_follower_is_dropped_by_the_bytes_waiting_for_it_as_the_rule_says() -> None:
    """What waits for a follower is counted in bytes of its events' lines (shared by
    every follower), plus what its socket holds; past the rule's bound it is dropped and
    told so through `on_drop`, and the reader that keeps up is not."""
    clock = FakeClock()
    bus = EventBus(clock=clock)
    bus.follower_rule = FollowerBacklog(max_bytes=300, stall_timeout_s=60.0)
    with bus.subscribe() as slow, bus.subscribe() as reader:
        told: list[str | None] = []
        slow.on_drop = lambda: told.append(slow.dropped)
        slow.pending = lambda: 50  # bytes its socket has not sent
        line = 0
        while not told:
            bus.publish("turn.message", turn="a", text="x" * 40)
            got = reader.receive_nowait()
            assert got.line.endswith(b"\n") and json.loads(got.line)["seq"] == got.seq
            line = len(got.line)
            assert reader.queued_bytes == 0
        assert told == ["buffer"] and slow.dropped == "buffer"
        assert slow.queued_bytes + 50 > 300 >= slow.queued_bytes + 50 - line
        assert bus.followers()["open"] == 1 and bus.followers()["dropped"] == 1
        assert slow.discard() == 1  # what waited, let go of: the lowest seq among it
        assert slow.queued_bytes == 0


def test_a_follower_behind_for_the_stall_timeout_is_dropped() -> None:
    clock = FakeClock()
    bus = EventBus(clock=clock)
    bus.follower_rule = FollowerBacklog(max_bytes=1000, stall_timeout_s=10.0)
    with bus.subscribe() as slow:
        slow.pending = lambda: 600  # over half the bound, and it never sends
        bus.publish("turn.message", turn="a")
        assert slow.dropped is None and slow.behind_since == clock.monotonic()
        clock.advance(10.0)
        bus.publish("turn.message", turn="a")
        assert slow.dropped == "stalled"


def test_a_dropped_stream_reopens_below_any_event_still_owed_to_it() -> None:
    """Events prepared to commit with their state are delivered when the write is
    done, so later numbers can go out first: a reopen point never skips one."""
    bus = EventBus(clock=FakeClock())
    queued = bus.prepare("turn.queued", turn="a")  # seq 1, its write under way
    bus.publish("turn.message", turn="a")  # seq 2, out first
    assert bus.resume_point(2, None) == 0
    bus.deliver(queued)
    assert bus.resume_point(2, None) == 2
    assert bus.resume_point(2, 2) == 1  # seq 2 still waiting in the follower's queue
    withdrawn = bus.prepare("turn.message", turn="a")  # its write failed
    bus.withdraw(withdrawn)
    assert bus.resume_point(3, None) == 3


def test_a_listener_of_some_types_hears_those_only_and_a_failing_one_is_counted() -> None:
    bus = EventBus(clock=FakeClock())
    heard: list[str] = []
    everything: list[str] = []
    bus.listeners.append(lambda e: everything.append(e.type))
    bus.listen(lambda e: heard.append(e.type), types=("turn.waiting", "turn.recovering"))

    def broken(_event: object) -> None:
        raise RuntimeError("a listener's bug")

    bus.listen(broken, types=("turn.recovering",))
    for kind in ("turn.message", "turn.waiting", "step.started", "turn.recovering"):
        bus.publish(kind, turn="a")
    assert heard == ["turn.waiting", "turn.recovering"]
    assert everything == ["turn.message", "turn.waiting", "step.started", "turn.recovering"]
    assert bus.listener_errors == 1
