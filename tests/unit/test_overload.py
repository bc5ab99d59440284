"""The overload guard: new submits are refused while the event loop stays behind, and
taken again once it has caught up (with hysteresis), decided from lag samples and the
time alone."""

from __future__ import annotations

import pytest

from turnkeeper.clock import FakeClock
from turnkeeper.policy.overload import (
    CLEAR_RATIO,
    Cleared,
    OverloadGuard,
    OverloadSettings,
    OverloadState,
    Shed,
    batch_refusal,
)

SETTINGS = OverloadSettings(lag_threshold_s=0.5, enter_samples=2, clear_after_s=2.0)


def feed(guard: OverloadGuard, clock: FakeClock, *lags: float,
         every_s: float = 0.1) -> list[Shed | Cleared | None]:
    """Samples as the lag watcher takes them: each after its interval plus its lag."""
    out = []
    for lag in lags:
        clock.advance(every_s + lag)
        out.append(guard.observe(lag, now=clock.monotonic()))
    return out


def test_one_slow_sample_is_a_hiccup_not_an_overload() -> None:
    guard, clock = OverloadGuard(SETTINGS), FakeClock()
    assert feed(guard, clock, 0.9, 0.01, 0.9, 0.01) == [None] * 4
    assert guard.state is OverloadState.ACCEPTING
    assert guard.refusal() is None


def test_enter_samples_in_a_row_at_the_threshold_close_intake() -> None:
    guard, clock = OverloadGuard(SETTINGS), FakeClock()
    decisions = feed(guard, clock, 0.5, 0.7)
    assert decisions[0] is None
    assert decisions[1] == Shed(lag_s=0.7, threshold_s=0.5, samples=2)
    assert guard.shedding and guard.spells == 1


def test_a_refusal_names_the_setting_and_counts_itself() -> None:
    guard, clock = OverloadGuard(SETTINGS), FakeClock()
    feed(guard, clock, 0.8, 0.8)
    refusal = guard.refusal()
    assert refusal is not None
    assert "daemon.overload_lag" in refusal.reason and "0.800" in refusal.reason
    # Back once it can have cleared: the calm period (2 s) plus the lag, rounded up.
    assert refusal.retry_after_s == 3
    guard.refusal()
    assert guard.refused == 2 and guard.snapshot()["refused"] == 2


def test_retry_after_is_clamped_to_a_minute() -> None:
    guard = OverloadGuard(OverloadSettings(lag_threshold_s=0.1, enter_samples=1,
                                           clear_after_s=300.0))
    guard.observe(0.2, now=1.0)
    refusal = guard.refusal()
    assert refusal is not None and refusal.retry_after_s == 60


def test_lag_under_the_threshold_but_over_half_of_it_does_not_clear() -> None:
    guard, clock = OverloadGuard(SETTINGS), FakeClock()
    feed(guard, clock, 0.8, 0.8)
    just_under = SETTINGS.lag_threshold_s * CLEAR_RATIO + 0.01  # 0.26 s: still too slow
    assert feed(guard, clock, *[just_under] * 50) == [None] * 50
    assert guard.shedding


def test_intake_reopens_after_clear_after_s_of_calm_samples() -> None:
    guard, clock = OverloadGuard(SETTINGS), FakeClock()
    feed(guard, clock, 0.8, 0.8)
    decisions = feed(guard, clock, *[0.01] * 25)  # 0.11 s apart: 2.0 s after the first
    cleared = [d for d in decisions if d is not None]
    assert len(cleared) == 1 and isinstance(cleared[0], Cleared)
    # The calm run starts at the first calm sample; 2 s later is the 20th after it.
    assert decisions.index(cleared[0]) == 19
    assert guard.state is OverloadState.ACCEPTING and guard.refusal() is None


def test_a_slow_sample_during_the_calm_period_starts_it_again() -> None:
    guard, clock = OverloadGuard(SETTINGS), FakeClock()
    feed(guard, clock, 0.8, 0.8)
    feed(guard, clock, *[0.01] * 15)  # 1.65 s of calm
    feed(guard, clock, 0.3)  # over half the threshold: not calm
    assert feed(guard, clock, *[0.01] * 19) == [None] * 19  # 1.98 s after the first
    assert guard.shedding
    assert isinstance(feed(guard, clock, 0.01)[0], Cleared)


def test_cleared_reports_how_long_intake_was_closed_and_what_it_refused() -> None:
    guard = OverloadGuard(OverloadSettings(lag_threshold_s=0.5, enter_samples=1,
                                           clear_after_s=1.0))
    guard.observe(0.9, now=10.0)
    guard.refusal()
    guard.refusal()
    assert guard.observe(0.0, now=11.0) is None  # the calm run starts here
    assert guard.observe(0.0, now=12.0) == Cleared(lag_s=0.0, shed_for_s=2.0, refused=2)
    assert guard.snapshot()["refused_total"] == 2 and guard.snapshot()["max_lag_s"] == 0.9


def test_a_zero_threshold_turns_the_guard_off() -> None:
    guard, clock = OverloadGuard(OverloadSettings(lag_threshold_s=0.0)), FakeClock()
    assert feed(guard, clock, 5.0, 5.0, 5.0) == [None] * 3
    assert guard.refusal() is None
    assert guard.last_lag_s == 5.0  # still shown


def test_turning_the_guard_off_while_shedding_reopens_intake_at_once() -> None:
    guard, clock = OverloadGuard(SETTINGS), FakeClock()
    feed(guard, clock, 0.8, 0.8)
    assert isinstance(guard.configure(OverloadSettings(lag_threshold_s=0.0)), Cleared)
    assert guard.refusal() is None


def test_a_new_threshold_applies_to_the_next_sample() -> None:
    guard, clock = OverloadGuard(SETTINGS), FakeClock()
    assert guard.configure(OverloadSettings(lag_threshold_s=0.05, enter_samples=1)) is None
    assert isinstance(feed(guard, clock, 0.06)[0], Shed)


def test_a_nonsense_sample_is_read_as_no_lag() -> None:
    guard = OverloadGuard(OverloadSettings(lag_threshold_s=0.5, enter_samples=1))
    assert guard.observe(float("nan"), now=1.0) is None
    assert guard.observe(-3.0, now=2.0) is None
    assert guard.last_lag_s == 0.0


@pytest.mark.parametrize("bad", [
    {"lag_threshold_s": -1.0}, {"lag_threshold_s": float("inf")}, {"enter_samples": 0},
    {"clear_after_s": -0.1}])
def test_settings_out_of_range_are_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        OverloadSettings(**bad)  # type: ignore[arg-type]


def test_repr_shows_the_state_and_the_settings() -> None:
    text = repr(OverloadGuard(SETTINGS))
    assert "accepting" in text and "threshold_s=0.5" in text


def test_a_batch_is_taken_only_when_the_queue_has_room_for_all_of_it() -> None:
    assert batch_refusal(batch=3, queued=7, max_queued=10, running=2) is None
    refusal = batch_refusal(batch=4, queued=7, max_queued=10, running=2)
    assert refusal is not None
    assert "room for 3 more turns, not the 4" in refusal.reason
    assert "daemon.max_queued_turns" in refusal.reason
    assert refusal.retry_after_s >= 1


def test_a_batch_into_a_queue_over_its_limit_has_no_room_and_waits_at_most_a_minute() -> None:
    refusal = batch_refusal(batch=1, queued=50_000, max_queued=10, running=1)
    assert refusal is not None and "room for 0 more" in refusal.reason
    assert refusal.retry_after_s == 60
