"""The restart counter: rebuilds up to max_restarts go on, one more stops the turn."""

from __future__ import annotations

import pytest

from turnkeeper.policy.outcome import StopCode
from turnkeeper.policy.restarts import RestartCounter, context_exhausted, overflow_numbers


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


def test_nothing_left_to_compact_is_context_exhausted_with_the_providers_numbers() -> None:
    stop = context_exhausted(
        message="This model's maximum context length is 8192 tokens. However, you "
                "requested 9000 tokens (8000 in the messages, 1000 in the completion).",
        estimate_tokens=5)
    assert stop.code is StopCode.CONTEXT_EXHAUSTED
    assert stop.counter == "context_tokens"
    assert (stop.value, stop.limit) == (9000, 8192)


def test_context_exhausted_reads_anthropics_numbers() -> None:
    stop = context_exhausted(message="prompt is too long: 210000 tokens > 200000 maximum",
                             estimate_tokens=5)
    assert (stop.value, stop.limit) == (210000, 200000)


def test_context_exhausted_without_numbers_uses_the_estimate_and_no_limit() -> None:
    stop = context_exhausted(message="context_length_exceeded", estimate_tokens=1234)
    assert stop.code is StopCode.CONTEXT_EXHAUSTED
    assert (stop.value, stop.limit) == (1234, None)


def test_overflow_numbers_are_none_for_an_unknown_wording() -> None:
    assert overflow_numbers("too long") is None


def test_a_negative_limit_is_refused() -> None:
    with pytest.raises(ValueError):
        RestartCounter(-1)
