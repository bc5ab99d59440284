"""When a failed call counts against its peer: not when the process stalled, or its
fleet lease lapsed, while the call was out (policy/stall.py). Plain numbers for the
clock."""

from __future__ import annotations

import pytest

from turnkeeper.policy.stall import Excuse, StallWatch

TICK = 0.1


def watched(until: float, *, start: float = 0.0) -> StallWatch:
    """A watch that woke on time every TICK from `start` to `until`."""
    watch = StallWatch(stall_s=2.0)
    t = start
    while t <= until:
        watch.tick(t, tick_s=TICK)
        t += TICK
    return watch


def test_a_failure_on_a_process_that_ran_on_time_counts() -> None:
    watch = watched(10.0)
    assert watch.excuse(started_at=2.0, now=10.0) is None


def test_the_lag_of_a_busy_loop_is_not_a_stall() -> None:
    watch = watched(5.0)
    assert watch.tick(6.9, tick_s=TICK) is None  # 1.8 s late: lag, not a stall
    assert watch.excuse(started_at=4.0, now=6.9) is None


def test_a_failure_handled_before_the_watch_wakes_from_a_pause_is_excused() -> None:
    # Stopped from 5.0 to 35.0: the call's timeout fired first, the watch has not woken.
    watch = watched(5.0)
    assert watch.excuse(started_at=4.0, now=35.0) is Excuse.STALLED


def test_a_failure_of_a_call_that_overlapped_a_stall_is_excused_after_the_watch_woke() -> None:
    watch = watched(5.0)
    assert watch.tick(35.0, tick_s=TICK) == pytest.approx(30.0)
    assert watch.stalls == 1
    assert watch.excuse(started_at=4.0, now=35.01) is Excuse.STALLED


def test_a_call_that_started_after_the_stall_counts_again() -> None:
    watch = watched(5.0)
    t = 35.0
    while t <= 40.0:
        watch.tick(t, tick_s=TICK)
        t += TICK
    assert watch.excuse(started_at=35.05, now=40.0) is None


def test_without_a_watch_running_nothing_is_excused() -> None:
    # A test's fake clock jumps; no watch ticks, so no jump is taken for a stall.
    assert StallWatch().excuse(started_at=0.0, now=1000.0) is None


def test_a_failure_while_the_fleet_lease_is_lapsed_is_excused() -> None:
    watch = watched(20.0)
    watch.lease(15.0, now=2.0)
    assert watch.excuse(started_at=14.0, now=14.9) is None
    assert watch.excuse(started_at=14.0, now=16.0) is Excuse.LEASE_LAPSED


def test_a_call_out_across_a_lapse_that_ended_is_excused_and_a_later_one_counts() -> None:
    watch = watched(30.0)
    watch.lease(15.0, now=2.0)
    watch.lease(40.0, now=20.0)  # the renewal after the database came back
    assert watch.excuse(started_at=12.0, now=21.0) is Excuse.LEASE_LAPSED
    assert watch.excuse(started_at=20.5, now=25.0) is None


def test_a_stall_must_be_positive() -> None:
    with pytest.raises(ValueError):
        StallWatch(stall_s=0.0)
