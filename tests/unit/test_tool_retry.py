"""Tool retries: only idempotent tools, never a deterministic failure, never past the
longest honoured Retry-After or the time left."""

from __future__ import annotations

from turnkeeper.policy.backoff import Backoff
from turnkeeper.policy.classify import FailureClass
from turnkeeper.policy.tool_retry import ToolRetry, attempts_for

RULE = ToolRetry(backoff=Backoff(base_delay_s=1.0, max_delay_s=30.0), max_retry_after_s=60.0)


def upper(a: float, b: float) -> float:
    return b


def delay(**overrides: object) -> float | None:
    args: dict[str, object] = {"attempt": 1, "max_attempts": 3,
                               "failure_class": FailureClass.RETRYABLE,
                               "retry_after_s": None, "remaining_s": 1000.0,
                               "previous_s": None, "rand": upper}
    args.update(overrides)
    return RULE.next_delay(**args)  # type: ignore[arg-type]


def test_a_non_idempotent_tool_gets_exactly_one_attempt() -> None:
    assert attempts_for(idempotent=False, max_attempts=4) == 1


def test_an_idempotent_tool_gets_max_attempts() -> None:
    assert attempts_for(idempotent=True, max_attempts=4) == 4


def test_a_retryable_failure_is_retried_after_the_backoff() -> None:
    assert delay(attempt=1) == 1.0
    assert delay(attempt=2) == 2.0


def test_a_deterministic_failure_is_never_retried() -> None:
    assert delay(failure_class=FailureClass.DETERMINISTIC) is None


def test_the_last_attempt_gives_up() -> None:
    assert delay(attempt=3, max_attempts=3) is None


def test_a_single_attempt_gives_up_at_once() -> None:
    assert delay(attempt=1, max_attempts=1) is None


def test_retry_after_is_a_floor_on_the_wait() -> None:
    assert delay(retry_after_s=7.0) == 7.0


def test_retry_after_above_max_retry_after_gives_up() -> None:
    assert delay(retry_after_s=61.0) is None


def test_a_wait_longer_than_the_time_left_gives_up() -> None:
    assert delay(retry_after_s=7.0, remaining_s=5.0) is None
    assert delay(retry_after_s=5.0, remaining_s=5.0) == 5.0
