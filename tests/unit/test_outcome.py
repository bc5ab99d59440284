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
def test_dead_letters_are_provider_failures_deterministic_failures_refusals_and_internal_errors(
        code: StopCode) -> None:
    expected = code in (StopCode.PROVIDERS_REJECTED, StopCode.PROVIDERS_EXHAUSTED,
                        StopCode.FAILURE_DETERMINISTIC, StopCode.MODEL_REFUSED,
                        StopCode.OUTPUT_INVALID, StopCode.INTERNAL)
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


def test_context_exhausted_is_a_closed_code_naming_the_context_tokens() -> None:
    stop = Stop(StopCode("context.exhausted"), "no room", value=9000, limit=8192)
    assert stop.counter == "context_tokens"
    assert TurnResult(stopped_because=stop).status is Status.PARTIAL
    assert not goes_to_dead_letters(stop)


def test_a_refusal_fails_the_turn_naming_no_counter() -> None:
    stop = Stop(StopCode("model.refused"), "the model declined")
    assert stop.counter is None
    assert TurnResult(stopped_because=stop).status is Status.FAILED


def test_an_answer_that_never_matched_its_schema_fails_naming_output_attempts() -> None:
    stop = Stop(StopCode("output.invalid"), "not JSON", value=3, limit=3)
    assert stop.counter == "output_attempts"
    assert TurnResult(stopped_because=stop).status is Status.FAILED
    assert goes_to_dead_letters(stop)


def test_a_truncated_answer_is_partial_work_naming_the_output_tokens() -> None:
    stop = Stop(StopCode("model.truncated"), "cut", value=64, limit=64)
    assert stop.counter == "output_tokens"
    assert TurnResult(stopped_because=stop).status is Status.PARTIAL
    assert not goes_to_dead_letters(stop)


def test_a_providers_stop_carries_each_providers_last_error() -> None:
    stop = Stop(StopCode.PROVIDERS_EXHAUSTED, "down", value=5, limit=5,
                last_error={"primary": "ClientConnectorError: Cannot connect"})
    data = stop.to_json()
    assert data["last_error"] == {"primary": "ClientConnectorError: Cannot connect"}
    assert Stop.from_json(data).last_error == stop.last_error
    assert "last_error" not in Stop(StopCode.COMPLETED, "ok").to_json()
