"""The retry budget per provider: retries in flight may not exceed
max(min_concurrency, ratio * requests in flight)."""

from __future__ import annotations

import pytest

from turnkeeper.config import RetryBudgetConfig
from turnkeeper.policy.retry_budget import RetryBudget, RetryBudgetError


def admitted(budget: RetryBudget, tries: int) -> int:
    return sum(budget.try_begin_retry() for _ in range(tries))


def test_retry_budget_admits_min_concurrency_when_quiet() -> None:
    budget = RetryBudget(ratio=0.2, min_concurrency=3)
    budget.begin_request()
    assert admitted(budget, 10) == 3
    assert budget.retries_in_flight == 3


def test_retry_budget_refuses_beyond_ratio() -> None:
    budget = RetryBudget(ratio=0.2, min_concurrency=3)
    for _ in range(50):
        budget.begin_request()
    assert budget.limit == 10.0
    assert admitted(budget, 100) == 10
    assert not budget.try_begin_retry()


def test_a_fractional_limit_admits_while_retries_are_below_it() -> None:
    budget = RetryBudget(ratio=0.5, min_concurrency=0)
    for _ in range(5):
        budget.begin_request()
    assert budget.limit == 2.5
    assert admitted(budget, 10) == 3  # 0, 1 and 2 are below 2.5


def test_zero_min_concurrency_and_no_traffic_admits_no_retry() -> None:
    budget = RetryBudget(ratio=0.2, min_concurrency=0)
    assert not budget.try_begin_retry()


def test_ending_a_retry_makes_room_for_another() -> None:
    budget = RetryBudget(ratio=0.0, min_concurrency=1)
    assert budget.try_begin_retry()
    assert not budget.try_begin_retry()
    budget.end_retry()
    assert budget.try_begin_retry()


def test_a_retry_sleeping_in_backoff_counts_against_the_budget() -> None:
    # Admitted, not yet sent (no begin_request): still in flight for the budget.
    budget = RetryBudget(ratio=0.2, min_concurrency=1)
    assert budget.try_begin_retry()
    assert budget.requests_in_flight == 0
    assert not budget.try_begin_retry()


def test_the_limit_follows_requests_in_flight_down() -> None:
    budget = RetryBudget(ratio=0.5, min_concurrency=1)
    for _ in range(6):
        budget.begin_request()
    assert admitted(budget, 3) == 3
    for _ in range(6):
        budget.end_request()
    assert budget.limit == 1.0
    assert not budget.try_begin_retry()


def test_end_request_without_a_request_is_an_error_and_counts_stay_at_zero() -> None:
    budget = RetryBudget(name="openai")
    with pytest.raises(RetryBudgetError, match="'openai': end_request"):
        budget.end_request()
    assert budget.requests_in_flight == 0


def test_end_retry_without_a_retry_is_an_error_and_counts_stay_at_zero() -> None:
    budget = RetryBudget()
    with pytest.raises(RetryBudgetError, match="end_retry"):
        budget.end_retry()
    assert budget.retries_in_flight == 0


def test_reconfigure_keeps_the_counts_and_applies_the_new_limits() -> None:
    budget = RetryBudget(ratio=0.2, min_concurrency=3)
    budget.begin_request()
    assert admitted(budget, 3) == 3
    budget.reconfigure(min_concurrency=5)
    assert budget.retries_in_flight == 3
    assert budget.requests_in_flight == 1
    assert admitted(budget, 10) == 2
    budget.reconfigure(ratio=1.0, min_concurrency=0)
    assert budget.limit == 1.0
    assert (budget.ratio, budget.min_concurrency) == (1.0, 0)


def test_snapshot_is_the_counts_and_the_limit() -> None:
    budget = RetryBudget(ratio=0.2, min_concurrency=3, name="p")
    budget.begin_request()
    budget.try_begin_retry()
    assert budget.snapshot() == {"name": "p", "requests_in_flight": 1,
                                 "retries_in_flight": 1, "limit": 3.0, "ratio": 0.2,
                                 "min_concurrency": 3}


def test_from_config_reads_the_retry_budget_section() -> None:
    budget = RetryBudget.from_config(RetryBudgetConfig(ratio=0.5, min_concurrency=7), name="x")
    assert (budget.name, budget.ratio, budget.min_concurrency) == ("x", 0.5, 7)


@pytest.mark.parametrize("kwargs", [{"ratio": -0.1}, {"ratio": float("nan")},
                                    {"min_concurrency": -1}])
def test_invalid_limits_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        RetryBudget(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        RetryBudget().reconfigure(**kwargs)  # type: ignore[arg-type]


def test_repr_shows_the_counts() -> None:
    assert repr(RetryBudget(name="p")) == (
        "RetryBudget(name='p', requests_in_flight=0, retries_in_flight=0, ratio=0.2, "
        "min_concurrency=3)")
