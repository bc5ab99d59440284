"""The Retry-After memory: what a peer asked for holds for every turn until it passes."""

from __future__ import annotations

from turnkeeper.policy.classify import FailureClass, classify
from turnkeeper.policy.retry_after import RetryAfterMemory, WindowOpened, not_sent


def test_a_retry_after_keeps_the_peer_unasked_until_it_passes() -> None:
    memory = RetryAfterMemory()
    assert memory.heard("provider:p", 30.0, now=100.0, max_retry_after_s=120.0) == 30.0
    assert memory.window("provider:p", 100.0) == 30.0
    assert memory.window("provider:p", 129.5) == 0.5
    assert memory.window("provider:p", 130.0) is None  # passed: forgotten
    assert memory.names() == []
    assert memory.window("provider:other", 100.0) is None


def test_a_retry_after_above_max_retry_after_is_not_remembered() -> None:
    memory = RetryAfterMemory()
    assert memory.heard("provider:p", 300.0, now=0.0, max_retry_after_s=120.0) is None
    assert memory.window("provider:p", 0.0) is None
    # At the limit it is honoured, so remembered.
    assert memory.heard("provider:p", 120.0, now=0.0, max_retry_after_s=120.0) == 120.0


def test_no_zero_or_negative_retry_after_opens_a_window() -> None:
    memory = RetryAfterMemory()
    for ra in (None, 0.0, -5.0):
        assert memory.heard("tool:t", ra, now=0.0, max_retry_after_s=120.0) is None
    assert memory.names() == []


def test_a_shorter_retry_after_never_shortens_an_open_window() -> None:
    memory = RetryAfterMemory()
    memory.heard("tool:t", 30.0, now=0.0, max_retry_after_s=120.0)
    memory.heard("tool:t", 5.0, now=1.0, max_retry_after_s=120.0)
    assert memory.window("tool:t", 1.0) == 29.0
    memory.heard("tool:t", 60.0, now=2.0, max_retry_after_s=120.0)
    assert memory.window("tool:t", 2.0) == 60.0


def test_the_observer_hears_each_window_this_node_opens_not_those_it_is_told() -> None:
    memory = RetryAfterMemory()
    seen: list[WindowOpened] = []
    memory.observer = seen.append
    memory.heard("provider:p", 30.0, now=0.0, max_retry_after_s=120.0)
    memory.heard("provider:p", 10.0, now=1.0, max_retry_after_s=120.0)  # changes nothing
    assert memory.remember("provider:q", 50.0, now=0.0)  # from another node
    assert seen == [WindowOpened("provider:p", 30.0)]
    assert memory.window("provider:q", 10.0) == 40.0


def test_a_window_from_another_node_that_has_passed_changes_nothing() -> None:
    memory = RetryAfterMemory()
    assert not memory.remember("provider:p", 10.0, now=10.0)
    assert memory.window("provider:p", 10.0) is None


def test_a_peer_whose_config_changed_is_forgotten() -> None:
    memory = RetryAfterMemory()
    memory.heard("provider:p", 30.0, now=0.0, max_retry_after_s=120.0)
    memory.forget("provider:p")
    assert memory.window("provider:p", 0.0) is None


def test_a_call_refused_inside_a_window_is_retryable_and_says_how_long_to_wait() -> None:
    failure = not_sent("tool search", 27.25)
    assert classify(failure) is FailureClass.RETRYABLE
    assert failure.retry_after_s == 27.25
    assert "not sent" in failure.describe() and "27.2 more seconds" in failure.describe()


def test_the_open_windows_are_listed_with_the_seconds_left() -> None:
    memory = RetryAfterMemory()
    memory.heard("provider:p", 30.0, now=0.0, max_retry_after_s=120.0)
    memory.heard("tool:t", 5.0, now=0.0, max_retry_after_s=120.0)
    assert memory.windows(10.0) == {"provider:p": 20.0}
