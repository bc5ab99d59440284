"""What a model's reply means for the turn (policy/replies.py): refusals, cut answers,
cut tool calls, and the thinking budget under the output cap."""

from __future__ import annotations

from typing import Any

import pytest

from turnkeeper.policy.outcome import StopCode
from turnkeeper.policy.replies import (
    ANSWERED,
    MIN_THINKING_BUDGET,
    Continue,
    CutCall,
    Refused,
    Truncated,
    judge_reply,
    thinking_budget,
    thinking_stop,
)


def judge(**kw: Any) -> Any:
    args: dict[str, Any] = {"finish_reason": "stop", "tool_calls": 0, "text": "hi",
                            "refusal": None, "provider": "primary", "output_tokens": 10,
                            "output_cap": 64, "continuations": 0, "max_continuations": 1}
    args.update(kw)
    return judge_reply(**args)


def test_a_whole_answer_or_tool_calls_are_answered() -> None:
    assert judge() is ANSWERED
    assert judge(finish_reason="tool_calls", tool_calls=2, text=None) is ANSWERED
    assert judge(finish_reason="end_of_something_new") is ANSWERED


def test_a_refusal_text_ends_the_turn_model_refused_with_that_text() -> None:
    verdict = judge(text=None, refusal="I'm sorry, I cannot assist with that request.")
    assert isinstance(verdict, Refused)
    assert verdict.stop.code is StopCode.MODEL_REFUSED and verdict.stop.counter is None
    assert verdict.text == "I'm sorry, I cannot assist with that request."
    assert "primary" in verdict.stop.message and "cannot assist" in verdict.stop.message


def test_a_refusal_stop_reason_ends_the_turn_even_with_tool_calls_asked() -> None:
    verdict = judge(finish_reason="refusal", tool_calls=1, text="")
    assert isinstance(verdict, Refused)
    assert verdict.text == "" and "declined" in verdict.stop.message


def test_a_content_filter_is_a_refusal_that_names_the_provider_filter() -> None:
    verdict = judge(finish_reason="content_filter", text='{"value": "example')
    assert isinstance(verdict, Refused)
    assert verdict.stop.message.startswith("provider primary's content filter")
    assert verdict.text == '{"value": "example'


@pytest.mark.parametrize("done", [0, 1, 2])
def test_a_cut_answer_is_continued_while_continuations_are_left(done: int) -> None:
    verdict = judge(finish_reason="length", continuations=done, max_continuations=3)
    assert verdict == Continue(number=done + 1, of=3)


def test_a_cut_answer_past_its_continuations_is_truncated_counting_output_tokens() -> None:
    verdict = judge(finish_reason="length", output_tokens=64, output_cap=64,
                    continuations=1, max_continuations=1)
    assert isinstance(verdict, Truncated)
    stop = verdict.stop
    assert (stop.code, stop.counter, stop.value, stop.limit) == (
        StopCode.MODEL_TRUNCATED, "output_tokens", 64, 64)


def test_no_continuation_allowed_truncates_at_the_first_cut() -> None:
    verdict = judge(finish_reason="length", max_continuations=0)
    assert isinstance(verdict, Truncated)
    assert "no continuation allowed" in verdict.stop.message


def test_a_cut_reply_with_tool_calls_cuts_its_last_call() -> None:
    assert judge(finish_reason="length", tool_calls=3, output_cap=128) == CutCall(
        index=2, output_cap=128)


def test_the_thinking_budget_is_sent_as_configured_below_the_cap() -> None:
    assert thinking_budget(output_cap=4096, budget_tokens=2048) == 2048


@pytest.mark.parametrize(("cap", "sent"), [(2048, 2047), (1500, 1499), (1025, 1024)])
def test_a_cap_at_or_below_the_thinking_budget_lowers_the_budget_under_it(
        cap: int, sent: int) -> None:
    assert thinking_budget(output_cap=cap, budget_tokens=2048) == sent
    assert thinking_stop(output_cap=cap, budget_tokens=2048, tokens_spent=1,
                         max_tokens=10) is None


@pytest.mark.parametrize("cap", [MIN_THINKING_BUDGET, 1000, 1])
def test_a_cap_that_cannot_hold_the_smallest_thinking_budget_stops_budget_tokens(
        cap: int) -> None:
    assert thinking_budget(output_cap=cap, budget_tokens=2048) is None
    stop = thinking_stop(output_cap=cap, budget_tokens=2048, tokens_spent=19000,
                         max_tokens=20000)
    assert stop is not None
    assert (stop.code, stop.counter, stop.value, stop.limit) == (
        StopCode.BUDGET_TOKENS, "tokens", 19000, 20000)
    assert "no request was sent" in stop.message
