"""The restart counter: rebuilds up to max_restarts go on, one more stops the turn."""

from __future__ import annotations

import pytest

from turnkeeper.policy.outcome import StopCode
from turnkeeper.policy.restarts import RestartCounter


def test_restarts_up_to_max_restarts_go_on() -> None:
    counter = RestartCounter(2)
    assert counter.restart("overflow") is None
    assert counter.restart("overflow") is None
    assert counter.count == 2


def test_restart_beyond_max_restarts_stops_with_restarts_exhausted() -> None:
    counter = RestartCounter(2)
    counter.restart("a")
    counter.restart("b")
    stop = counter.restart("c")
    assert stop is not None
    assert stop.code is StopCode.RESTARTS_EXHAUSTED
    assert (stop.value, stop.limit) == (3, 2)
    assert "more than max_restarts = 2" in stop.message


def test_zero_max_restarts_stops_at_the_first_rebuild() -> None:
    stop = RestartCounter(0).restart("overflow")
    assert stop is not None and stop.code is StopCode.RESTARTS_EXHAUSTED


def test_a_user_message_resets_the_restart_count() -> None:
    counter = RestartCounter(1)
    counter.restart("a")
    counter.reset()
    assert counter.count == 0
    assert counter.restart("b") is None


def test_a_restored_count_goes_on_from_where_it_was() -> None:
    counter = RestartCounter(3, count=3)
    stop = counter.restart("after resume")
    assert stop is not None and stop.value == 4


def test_nothing_left_to_compact_stops_whatever_the_count() -> None:
    counter = RestartCounter(5, count=1)
    stop = counter.nothing_to_compact()
    assert stop.code is StopCode.RESTARTS_EXHAUSTED
    assert (stop.value, stop.limit) == (1, 5)


def test_a_negative_limit_is_refused() -> None:
    with pytest.raises(ValueError):
        RestartCounter(-1)
