"""A breaker in a fleet: opened by another node (policy/breaker.py `open_from_peer`), its
changes told to an observer, the fleet's streak counted on from, and the changes folded
for the store (policy/breaker_share.py)."""

from __future__ import annotations

from turnkeeper.policy.breaker import BreakerChange, BreakerState, ChangeKind, CircuitBreaker
from turnkeeper.policy.breaker_share import StreakDelta, StreakShare
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


def observed(b: CircuitBreaker) -> list[BreakerChange]:
    seen: list[BreakerChange] = []
    b.observer = seen.append
    return seen


def test_the_observer_hears_each_failure_the_reset_and_the_opening() -> None:
    b = CircuitBreaker("provider:p", failure_threshold=2, cooldown_s=30.0)
    seen = observed(b)
    b.record_success(0.0)  # no streak to break: nothing to tell
    b.record_failure(0.0, FailureClass.RETRYABLE)
    b.record_success(0.1)
    b.record_failure(0.2, FailureClass.UNKNOWN)
    b.record_failure(0.3, FailureClass.RETRYABLE)
    assert [c.kind for c in seen] == [ChangeKind.FAILURE, ChangeKind.RESET,
                                      ChangeKind.FAILURE, ChangeKind.FAILURE,
                                      ChangeKind.OPENED]
    assert seen[-1].open_for_s == 30.0 and {c.name for c in seen} == {"provider:p"}
    seen.clear()
    b.record_failure(1.0, FailureClass.RETRYABLE)  # a straggler while open: nothing
    b.open_from_peer(1.0, 60.0)  # a peer's opening is not this node's to tell
    b.share_streak(5, 1.0)
    assert seen == []


def test_the_fleets_streak_is_counted_on_from() -> None:
    b = CircuitBreaker("provider:p", failure_threshold=8, cooldown_s=30.0)
    b.share_streak(7, 0.0)  # the other nodes failed 7 times in a row
    b.record_failure(0.0, FailureClass.RETRYABLE)
    assert b.state(0.0) is BreakerState.OPEN


def test_a_share_folds_changes_into_one_delta_per_breaker() -> None:
    share = StreakShare()
    for kind in (ChangeKind.FAILURE, ChangeKind.FAILURE):
        share.record(BreakerChange("a", kind))
    share.record(BreakerChange("b", ChangeKind.FAILURE))
    share.record(BreakerChange("b", ChangeKind.RESET))
    share.record(BreakerChange("b", ChangeKind.FAILURE))
    share.record(BreakerChange("b", ChangeKind.OPENED, 30.0))
    taken = share.take()
    assert taken == {"a": StreakDelta(failures=2),
                     "b": StreakDelta(reset=True, failures=1, opened_for_s=30.0)}
    assert not share
    share.record(BreakerChange("a", ChangeKind.FAILURE))
    share.put_back("a", taken["a"])  # a failed flush goes first
    assert share.take() == {"a": StreakDelta(failures=3)}
    share.record(BreakerChange("a", ChangeKind.RESET))
    share.put_back("a", StreakDelta(failures=4))  # a reset since wins over it
    assert share.take() == {"a": StreakDelta(reset=True)}
