"""The daemon-wide circuit breaker, driven by a fake clock (plain floats)."""

from __future__ import annotations

import pytest

from turnkeeper.config import CircuitBreakerConfig
from turnkeeper.policy.breaker import BreakerState, CircuitBreaker
from turnkeeper.policy.classify import FailureClass

R = FailureClass.RETRYABLE
U = FailureClass.UNKNOWN
D = FailureClass.DETERMINISTIC


def fail_n(b: CircuitBreaker, n: int, now: float, fc: FailureClass = R,
           retry_after_s: float | None = None) -> None:
    for _ in range(n):
        assert b.try_acquire(now)
        b.record_failure(now, fc, retry_after_s)


def opened(now: float = 0.0, **kwargs: int | float) -> CircuitBreaker:
    b = CircuitBreaker("p", **kwargs)  # type: ignore[arg-type]
    fail_n(b, b.failure_threshold, now)
    return b


def test_new_breaker_is_closed_and_admits() -> None:
    b = CircuitBreaker("p")
    assert b.state(0.0) is BreakerState.CLOSED
    assert b.try_acquire(0.0)


def test_breaker_opens_after_threshold_consecutive_retryable_failures() -> None:
    b = CircuitBreaker("p", failure_threshold=3)
    fail_n(b, 2, 0.0)
    assert b.state(0.0) is BreakerState.CLOSED
    assert b.consecutive_failures == 2
    fail_n(b, 1, 1.0)
    assert b.state(1.0) is BreakerState.OPEN
    assert not b.try_acquire(1.0)


def test_unknown_failures_count_like_retryable_ones() -> None:
    b = CircuitBreaker("p", failure_threshold=2)
    fail_n(b, 1, 0.0, R)
    fail_n(b, 1, 0.0, U)
    assert b.state(0.0) is BreakerState.OPEN


def test_a_success_zeroes_the_streak() -> None:
    b = CircuitBreaker("p", failure_threshold=3)
    fail_n(b, 2, 0.0)
    assert b.try_acquire(0.0)
    b.record_success(0.0)
    assert b.consecutive_failures == 0
    fail_n(b, 2, 0.0)
    assert b.state(0.0) is BreakerState.CLOSED


def test_a_deterministic_failure_resets_the_streak_because_the_peer_answered() -> None:
    b = CircuitBreaker("p", failure_threshold=3)
    fail_n(b, 2, 0.0)
    fail_n(b, 1, 0.0, D)
    assert b.consecutive_failures == 0
    fail_n(b, 2, 0.0)
    assert b.state(0.0) is BreakerState.CLOSED


def test_breaker_stays_open_for_the_cooldown_then_reads_half_open() -> None:
    b = opened(10.0, failure_threshold=5, cooldown_s=30.0)
    assert b.state(39.999) is BreakerState.OPEN
    assert b.state(40.0) is BreakerState.HALF_OPEN


def test_retry_after_longer_than_cooldown_extends_the_open_period() -> None:
    b = CircuitBreaker("p", failure_threshold=1, cooldown_s=30.0)
    fail_n(b, 1, 0.0, retry_after_s=90.0)
    assert b.state(89.0) is BreakerState.OPEN
    assert b.state(90.0) is BreakerState.HALF_OPEN


def test_retry_after_shorter_than_cooldown_does_not_shorten_it() -> None:
    b = CircuitBreaker("p", failure_threshold=1, cooldown_s=30.0)
    fail_n(b, 1, 0.0, retry_after_s=5.0)
    assert b.state(29.0) is BreakerState.OPEN


def test_breaker_half_open_admits_at_most_probes() -> None:
    b = opened(0.0, failure_threshold=1, cooldown_s=10.0, half_open_probes=2)
    assert b.try_acquire(10.0)
    assert b.try_acquire(10.0)
    assert not b.try_acquire(10.0)
    assert b.probes_in_flight == 2


def test_a_successful_probe_closes_the_breaker_and_zeroes_the_streak() -> None:
    b = opened(0.0, failure_threshold=2, cooldown_s=10.0)
    assert b.try_acquire(10.0)
    b.record_success(10.5)
    assert b.state(10.5) is BreakerState.CLOSED
    assert b.consecutive_failures == 0
    assert b.probes_in_flight == 0
    fail_n(b, 1, 11.0)
    assert b.state(11.0) is BreakerState.CLOSED


def test_a_deterministic_answer_to_a_probe_closes_the_breaker() -> None:
    b = opened(0.0, failure_threshold=1, cooldown_s=10.0)
    assert b.try_acquire(10.0)
    b.record_failure(10.0, D)
    assert b.state(10.0) is BreakerState.CLOSED


def test_a_failed_probe_reopens_for_the_cooldown() -> None:
    b = opened(0.0, failure_threshold=1, cooldown_s=10.0)
    assert b.try_acquire(12.0)
    b.record_failure(13.0, R)
    assert b.state(22.9) is BreakerState.OPEN
    assert not b.try_acquire(22.9)
    assert b.state(23.0) is BreakerState.HALF_OPEN
    assert b.try_acquire(23.0)


def test_a_failed_probe_with_retry_after_reopens_for_the_longer_of_the_two() -> None:
    b = opened(0.0, failure_threshold=1, cooldown_s=10.0)
    assert b.try_acquire(10.0)
    b.record_failure(10.0, U, retry_after_s=60.0)
    assert b.state(69.0) is BreakerState.OPEN
    assert b.state(70.0) is BreakerState.HALF_OPEN


def test_release_frees_the_probe_slot_and_changes_nothing_else() -> None:
    b = opened(0.0, failure_threshold=1, cooldown_s=10.0)
    assert b.try_acquire(10.0)
    assert not b.try_acquire(10.0)
    b.release(10.0)
    assert b.state(10.0) is BreakerState.HALF_OPEN
    assert b.consecutive_failures == 1
    assert b.try_acquire(10.0)


def test_release_in_closed_state_changes_nothing() -> None:
    b = CircuitBreaker("p", failure_threshold=3)
    fail_n(b, 2, 0.0)
    assert b.try_acquire(0.0)
    b.release(0.0)
    assert b.consecutive_failures == 2
    assert b.state(0.0) is BreakerState.CLOSED


def test_a_straggler_reporting_while_open_does_not_move_the_cooldown() -> None:
    b = CircuitBreaker("p", failure_threshold=2, cooldown_s=10.0)
    assert b.try_acquire(0.0)  # a slow call admitted while closed
    fail_n(b, 2, 1.0)
    assert b.state(1.0) is BreakerState.OPEN
    b.record_success(5.0)  # the slow call finally answers
    assert b.state(5.0) is BreakerState.OPEN
    assert b.state(11.0) is BreakerState.HALF_OPEN


def test_reconfigure_keeps_the_current_state() -> None:
    b = opened(0.0, failure_threshold=2, cooldown_s=10.0)
    b.reconfigure(failure_threshold=4, cooldown_s=60.0, half_open_probes=3)
    assert b.state(5.0) is BreakerState.OPEN
    assert b.state(10.0) is BreakerState.HALF_OPEN  # the open period already set stands
    assert b.consecutive_failures == 2
    assert (b.failure_threshold, b.cooldown_s, b.half_open_probes) == (4, 60.0, 3)
    for _ in range(3):
        assert b.try_acquire(10.0)
    assert not b.try_acquire(10.0)
    b.record_failure(10.0, R)
    assert b.state(69.0) is BreakerState.OPEN  # the new cooldown applies to the next open


def test_reconfigure_with_a_lower_threshold_opens_at_the_next_failure() -> None:
    b = CircuitBreaker("p", failure_threshold=5)
    fail_n(b, 3, 0.0)
    b.reconfigure(failure_threshold=2)
    assert b.state(0.0) is BreakerState.CLOSED
    fail_n(b, 1, 0.0)
    assert b.state(0.0) is BreakerState.OPEN


def test_snapshot_reports_state_streak_and_time_until_half_open() -> None:
    b = CircuitBreaker("p", failure_threshold=2, cooldown_s=30.0)
    fail_n(b, 1, 0.0)
    assert b.snapshot(0.0) == {"name": "p", "state": "closed", "consecutive_failures": 1,
                               "open_until_in_s": None, "probes_in_flight": 0}
    fail_n(b, 1, 100.0)
    assert b.snapshot(110.0) == {"name": "p", "state": "open", "consecutive_failures": 2,
                                 "open_until_in_s": 20.0, "probes_in_flight": 0}
    assert b.snapshot(130.0)["state"] == "half_open"
    assert b.snapshot(130.0)["open_until_in_s"] is None


def test_from_config_reads_the_circuit_breaker_section() -> None:
    b = CircuitBreaker.from_config("p", CircuitBreakerConfig(failure_threshold=7, cooldown=3.0,
                                                             half_open_probes=2))
    assert (b.name, b.failure_threshold, b.cooldown_s, b.half_open_probes) == ("p", 7, 3.0, 2)


@pytest.mark.parametrize("kwargs", [{"failure_threshold": 0}, {"cooldown_s": -1.0},
                                    {"half_open_probes": 0}])
def test_invalid_limits_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        CircuitBreaker("p", **kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        CircuitBreaker("p").reconfigure(**kwargs)  # type: ignore[arg-type]


def test_repr_shows_the_breaker_state() -> None:
    assert repr(CircuitBreaker("openai")) == (
        "CircuitBreaker('openai', consecutive_failures=0, open_until=None, "
        "probes_in_flight=0, failure_threshold=5, cooldown_s=30.0, half_open_probes=1)")


def test_open_for_is_the_time_until_a_probe_may_go_and_none_unless_open() -> None:
    b = CircuitBreaker("p", failure_threshold=1, cooldown_s=30.0)
    assert b.open_for(0.0) is None
    fail_n(b, 1, 100.0, retry_after_s=45.0)
    assert b.open_for(110.0) == 35.0  # max(cooldown, Retry-After) from the opening
    assert b.open_for(145.0) is None  # half-open
