from __future__ import annotations

import pytest

from turnkeeper.policy.outcome import (
    DEAD_LETTER_CODES,
    Status,
    Stop,
    StopCode,
    TurnResult,
    goes_to_dead_letters,
)


@pytest.mark.parametrize("code", list(StopCode))
def test_dead_letters_are_the_provider_failures_and_internal_errors(code: StopCode) -> None:
    expected = code in (StopCode.PROVIDERS_REJECTED, StopCode.PROVIDERS_EXHAUSTED,
                        StopCode.INTERNAL)
    stop = Stop(code, "why")
    result = TurnResult(stopped_because=stop)
    assert goes_to_dead_letters(stop) is expected
    assert goes_to_dead_letters(result) is expected
    assert goes_to_dead_letters(result.to_json()) is expected
    assert (code in DEAD_LETTER_CODES) is expected


def test_a_dead_letter_failed_or_returned_partial_work() -> None:
    assert {Stop(c, "").code and TurnResult(stopped_because=Stop(c, "")).status
            for c in DEAD_LETTER_CODES} == {Status.FAILED, Status.PARTIAL}


def test_no_result_is_no_dead_letter() -> None:
    assert not goes_to_dead_letters(None)
    assert not goes_to_dead_letters({})
