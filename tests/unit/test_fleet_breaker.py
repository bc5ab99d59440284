"""A breaker opened by another node of the fleet (policy/breaker.py `open_from_peer`)."""

from __future__ import annotations

from turnkeeper.policy.breaker import BreakerState, CircuitBreaker
from turnkeeper.policy.classify import FailureClass


def test_a_peer_opens_a_closed_breaker_for_the_time_it_says() -> None:
    b = CircuitBreaker("tool:x", failure_threshold=5, cooldown_s=30.0)
    assert b.open_from_peer(100.0, 12.0)
    assert b.state(100.0) is BreakerState.OPEN and b.open_for(100.0) == 12.0
    assert b.state(112.0) is BreakerState.HALF_OPEN  # then a probe, as after its own
    assert b.try_acquire(112.0)
    b.record_success(112.5)
    assert b.state(112.5) is BreakerState.CLOSED


def test_a_peer_never_shortens_an_open_period() -> None:
    b = CircuitBreaker("tool:x", failure_threshold=1, cooldown_s=30.0)
    b.try_acquire(0.0)
    b.record_failure(0.0, FailureClass.RETRYABLE)
    assert b.open_for(0.0) == 30.0
    assert not b.open_from_peer(1.0, 5.0)
    assert b.open_for(1.0) == 29.0
    assert b.open_from_peer(1.0, 60.0)
    assert b.open_for(1.0) == 60.0
