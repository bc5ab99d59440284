"""Backoff curves: full jitter by default, decorrelated on request."""

from __future__ import annotations

import pytest

from turnkeeper.config import RetryConfig
from turnkeeper.policy.backoff import Backoff


def upper(a: float, b: float) -> float:
    return b


def lower(a: float, b: float) -> float:
    return a


class Recorder:
    """A rand that returns its upper bound and remembers every (a, b) it was asked for."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, float]] = []

    def __call__(self, a: float, b: float) -> float:
        self.calls.append((a, b))
        return b


def test_full_jitter_draws_from_zero_to_base_times_two_to_the_attempt() -> None:
    rec = Recorder()
    b = Backoff(base_delay_s=0.5, max_delay_s=30.0)
    assert [b.delay(attempt=n, previous_s=None, rand=rec) for n in range(4)] == [
        0.5, 1.0, 2.0, 4.0]
    assert rec.calls == [(0.0, 0.5), (0.0, 1.0), (0.0, 2.0), (0.0, 4.0)]


def test_full_jitter_window_is_capped_at_max_delay() -> None:
    b = Backoff(base_delay_s=0.5, max_delay_s=30.0)
    assert b.delay(attempt=6, previous_s=None, rand=upper) == 30.0  # 0.5 * 64 = 32
    assert b.delay(attempt=5, previous_s=None, rand=upper) == 16.0


def test_full_jitter_can_be_zero() -> None:
    b = Backoff(base_delay_s=0.5, max_delay_s=30.0)
    assert b.delay(attempt=3, previous_s=None, rand=lower) == 0.0


def test_huge_attempt_numbers_clamp_to_max_delay_instead_of_overflowing() -> None:
    b = Backoff(base_delay_s=0.5, max_delay_s=30.0)
    assert b.delay(attempt=10_000, previous_s=None, rand=upper) == 30.0
    assert b.ceiling(1_000_000) == 30.0


def test_zero_base_delay_never_waits_even_for_huge_attempts() -> None:
    b = Backoff(base_delay_s=0.0, max_delay_s=30.0)
    assert b.delay(attempt=5000, previous_s=None, rand=upper) == 0.0


def test_full_jitter_ignores_previous() -> None:
    b = Backoff(base_delay_s=1.0, max_delay_s=30.0)
    assert b.delay(attempt=1, previous_s=25.0, rand=upper) == 2.0


def test_a_rand_outside_the_window_is_clamped_into_it() -> None:
    b = Backoff(base_delay_s=1.0, max_delay_s=30.0)
    assert b.delay(attempt=1, previous_s=None, rand=lambda a, c: 99.0) == 2.0
    assert b.delay(attempt=1, previous_s=None, rand=lambda a, c: -5.0) == 0.0


def test_decorrelated_first_retry_draws_between_base_and_three_base() -> None:
    rec = Recorder()
    b = Backoff(base_delay_s=0.5, max_delay_s=30.0, jitter="decorrelated")
    assert b.delay(attempt=0, previous_s=None, rand=rec) == 1.5
    assert rec.calls == [(0.5, 1.5)]


def test_decorrelated_grows_from_the_previous_delay_up_to_max_delay() -> None:
    rec = Recorder()
    b = Backoff(base_delay_s=0.5, max_delay_s=30.0, jitter="decorrelated")
    assert b.delay(attempt=7, previous_s=4.0, rand=rec) == 12.0
    assert rec.calls == [(0.5, 12.0)]
    assert b.delay(attempt=0, previous_s=12.0, rand=upper) == 30.0  # 36 capped
    assert b.delay(attempt=0, previous_s=12.0, rand=lower) == 0.5


def test_decorrelated_sequence_with_upper_bound_rand() -> None:
    b = Backoff(base_delay_s=1.0, max_delay_s=50.0, jitter="decorrelated")
    prev: float | None = None
    seen = []
    for n in range(5):
        prev = b.delay(attempt=n, previous_s=prev, rand=upper)
        seen.append(prev)
    assert seen == [3.0, 9.0, 27.0, 50.0, 50.0]


def test_negative_attempt_is_refused() -> None:
    with pytest.raises(ValueError, match="attempt"):
        Backoff().delay(attempt=-1, previous_s=None, rand=upper)


@pytest.mark.parametrize("kwargs", [{"base_delay_s": -1.0}, {"max_delay_s": float("nan")},
                                    {"jitter": "equal"}])
def test_invalid_curves_are_refused_at_construction(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        Backoff(**kwargs)  # type: ignore[arg-type]


def test_from_config_reads_the_retry_section() -> None:
    b = Backoff.from_config(RetryConfig(base_delay=0.25, max_delay=8.0, jitter="decorrelated"))
    assert b == Backoff(base_delay_s=0.25, max_delay_s=8.0, jitter="decorrelated")
    assert Backoff.from_config(RetryConfig()) == Backoff(base_delay_s=0.5, max_delay_s=30.0,
                                                        jitter="full")


def test_repr_names_the_curve() -> None:
    assert repr(Backoff()) == "Backoff(base_delay_s=0.5, max_delay_s=30.0, jitter='full')"
