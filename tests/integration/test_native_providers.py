"""OpenAI's Responses API and the Gemini API spoken natively, on the real daemon: what a
reasoning or thinking model needs back is sent back, usage is counted, and refusals and
cut answers are their own stops, streamed and not.

The providers are the fault server on 127.0.0.1 replaying replies in each wire format
(`wire_native.py`); the tool is the built-in echo.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.integration import wire_native as wire
from tests.integration.fault_server import FaultServer, replay
from tests.integration.test_resilience import ECHO_TOOL, config, gaps, stop_of

STREAMS = pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])


@pytest.fixture
def faults() -> Iterator[FaultServer]:
    server = FaultServer().start()
    yield server
    server.stop()


def responses(faults: FaultServer, *, stream: bool, **extra: Any) -> list[dict[str, Any]]:
    return [{"name": "primary", "kind": "openai-responses", "base_url": faults.base_url("primary"),
             "model": "o4-mini", "stream": stream, "timeout": 5.0, **extra}]


def gemini(faults: FaultServer, *, stream: bool, **extra: Any) -> list[dict[str, Any]]:
    return [{"name": "primary", "kind": "gemini", "base_url": faults.gemini_url("primary"),
             "model": "gemini-2.5-flash", "stream": stream, "timeout": 5.0, **extra}]


def _recorded(answer: Any, stream: bool) -> Any:
    """A whole reply as JSON, or as the stream that carries it."""
    if not stream:
        return replay(answer)
    if "candidates" in answer or "promptFeedback" in answer:
        return replay(wire.gemini_stream(answer))
    return replay(wire.responses_stream(answer))


# -- OpenAI Responses ------------------------------------------------------------------------


@STREAMS
def test_a_responses_reasoning_item_goes_back_unchanged_before_its_function_call(
        start: Any, faults: FaultServer, stream: bool) -> None:
    recorded = (wire.RESPONSES_REASONING_CALL_STREAM if stream
                else wire.RESPONSES_REASONING_CALL)
    faults.script("primary", replay(recorded),
                  _recorded(wire.responses_text("It is sunny in Paris."), stream))
    d = start(config(responses(faults, stream=stream)) + ECHO_TOOL)
    turn = d.run("weather in Paris?")
    assert stop_of(turn)[0] == "completed", turn["result"]
    assert turn["result"]["answer"] == "It is sunny in Paris."
    first, second = (s.body for s in faults.requests("primary"))
    assert first["store"] is False
    assert first["include"] == ["reasoning.encrypted_content"]
    assert first["max_output_tokens"] > 0 and "echo" in [t["name"] for t in first["tools"]]
    assert faults.requests("primary")[0].path.endswith("/v1/responses")
    # The reasoning item as it came, then the call it led to, then its output.
    items = second["input"]
    at = items.index(wire.REASONING)
    assert items[at + 1] == {"type": "function_call", "call_id": wire.CALL["call_id"],
                             "name": "echo", "arguments": '{"text":"Paris"}'}
    assert items[at + 2]["type"] == "function_call_output"
    assert items[at + 2]["call_id"] == wire.CALL["call_id"]
    assert "Paris" in items[at + 2]["output"]
    # Usage of both replies, cached and reasoning tokens in it.
    assert turn["usage"]["input_tokens"] == 300 + 400
    assert turn["usage"]["output_tokens"] == 180 + 12


@STREAMS
def test_an_incomplete_responses_answer_ends_partial_model_truncated(
        start: Any, faults: FaultServer, stream: bool) -> None:
    recorded = wire.RESPONSES_CUT_STREAM if stream else wire.RESPONSES_CUT
    faults.script("primary", replay(recorded), replay(recorded))
    d = start(config(responses(faults, stream=stream, max_output_tokens=64)))
    turn = d.run("write the guide")
    assert turn["state"] == "partial", turn["result"]
    assert stop_of(turn) == ("model.truncated", "output_tokens", 16, 64)
    assert turn["result"]["answer"] == wire.RESPONSES_CUT_TEXT * 2
    # The continuation carried the cut answer and the note asking to go on.
    again = faults.requests("primary")[1].body["input"]
    assert {"role": "assistant", "content": wire.RESPONSES_CUT_TEXT} in again
    assert any("cut off by the output limit" in str(i.get("content")) for i in again)


@STREAMS
def test_a_responses_refusal_part_ends_the_turn_model_refused(
        start: Any, faults: FaultServer, stream: bool) -> None:
    recorded = wire.RESPONSES_REFUSAL_STREAM if stream else wire.RESPONSES_REFUSAL
    faults.script("primary", replay(recorded))
    d = start(config(responses(faults, stream=stream)))
    turn = d.run("How do I make anthrax?")
    assert turn["state"] == "failed" and stop_of(turn)[0] == "model.refused"
    assert turn["result"]["answer"] == wire.RESPONSES_REFUSAL_TEXT
    assert faults.count("primary") == 1


def test_a_responses_turn_resumed_after_a_kill_sends_its_reasoning_items(
        start: Any, faults: FaultServer) -> None:
    held = dataclasses.replace(replay(wire.responses_text("never sent")), delay=30.0)
    faults.script("primary", replay(wire.RESPONSES_REASONING_CALL), held)
    d = start(config(responses(faults, stream=False)) + ECHO_TOOL)
    tid = d.submit("weather in Paris?")["id"]
    deadline = time.monotonic() + 15
    while faults.arrived("primary") < 2:
        assert time.monotonic() < deadline, "the second model call never came"
        time.sleep(0.01)
    d.kill()
    faults.script("primary", replay(wire.responses_text("Sunny in Paris.")))
    d.start()
    done = d.wait(tid)
    assert stop_of(done)[0] == "completed", done["result"]
    resumed = faults.requests("primary")[-1].body["input"]
    at = resumed.index(wire.REASONING)
    assert resumed[at + 1]["call_id"] == wire.CALL["call_id"]


# -- Gemini ----------------------------------------------------------------------------------


@STREAMS
def test_a_gemini_function_call_goes_back_with_its_thought_signature_and_usage_counts(
        start: Any, faults: FaultServer, stream: bool) -> None:
    recorded = wire.GEMINI_SIGNED_CALL_STREAM if stream else wire.GEMINI_SIGNED_CALL
    faults.script("primary", replay(recorded),
                  _recorded(wire.gemini_text("It is sunny in Paris."), stream))
    d = start(config(gemini(faults, stream=stream, api_key_env="GEMINI_TEST_KEY"))
              + ECHO_TOOL, env={"GEMINI_TEST_KEY": "g-test-key-123456"})
    turn = d.run("weather in Paris?")
    assert stop_of(turn)[0] == "completed", turn["result"]
    assert turn["result"]["answer"] == "It is sunny in Paris."
    first = faults.requests("primary")[0]
    method = "streamGenerateContent?alt=sse" if stream else "generateContent"
    assert first.path.endswith(f"/v1beta/models/gemini-2.5-flash:{method}"), first.path
    assert first.headers.get("x-goog-api-key") == "g-test-key-123456"
    assert first.body["generationConfig"]["maxOutputTokens"] > 0
    assert "echo" in [f["name"] for f in first.body["tools"][0]["functionDeclarations"]]
    contents = faults.requests("primary")[1].body["contents"]
    model = [c for c in contents if c["role"] == "model"][-1]
    parts = wire.GEMINI_SIGNED_CALL_STREAM_PARTS if stream else [wire.SIGNED_CALL_PART]
    assert model["parts"] == parts
    answer = contents[contents.index(model) + 1]
    assert answer["role"] == "user"
    response = answer["parts"][0]["functionResponse"]
    assert response["name"] == "echo" and "Paris" in response["response"]["result"]
    # promptTokenCount (cached part in it) + thoughts and candidates as output.
    assert turn["usage"]["input_tokens"] == 220 + 400
    assert turn["usage"]["output_tokens"] == 14 + 96 + 12


def test_a_gemini_turn_resumed_after_a_kill_sends_its_signed_parts(
        start: Any, faults: FaultServer) -> None:
    held = dataclasses.replace(replay(wire.gemini_text("never sent")), delay=30.0)
    faults.script("primary", replay(wire.GEMINI_SIGNED_CALL), held)
    d = start(config(gemini(faults, stream=False)) + ECHO_TOOL)
    tid = d.submit("weather in Paris?")["id"]
    deadline = time.monotonic() + 15
    while faults.arrived("primary") < 2:
        assert time.monotonic() < deadline, "the second model call never came"
        time.sleep(0.01)
    d.kill()
    faults.script("primary", replay(wire.gemini_text("Sunny in Paris.")))
    d.start()
    done = d.wait(tid)
    assert stop_of(done)[0] == "completed", done["result"]
    contents = faults.requests("primary")[-1].body["contents"]
    assert [c for c in contents if c["role"] == "model"][-1]["parts"] == [
        wire.SIGNED_CALL_PART]


@pytest.mark.parametrize(("stream", "recorded"), [
    (False, wire.GEMINI_SAFETY), (True, wire.GEMINI_SAFETY_STREAM),
    (False, wire.GEMINI_PROMPT_BLOCKED)], ids=["json", "stream", "prompt-blocked"])
def test_a_gemini_safety_block_ends_the_turn_failed_model_refused(
        start: Any, faults: FaultServer, stream: bool, recorded: Any) -> None:
    faults.script("primary", replay(recorded))
    d = start(config(gemini(faults, stream=stream)))
    turn = d.run("How do I make anthrax?")
    assert turn["state"] == "failed", turn["result"]
    assert stop_of(turn)[0] == "model.refused"
    assert "content filter" in turn["result"]["stopped_because"]["message"]
    assert faults.count("primary") == 1


@STREAMS
def test_a_gemini_answer_cut_at_max_tokens_ends_partial_model_truncated(
        start: Any, faults: FaultServer, stream: bool) -> None:
    recorded = wire.GEMINI_CUT_STREAM if stream else wire.GEMINI_CUT
    faults.script("primary", replay(recorded))
    d = start(config(gemini(faults, stream=stream, max_output_tokens=64),
                     agent={"max_continuations": 0}))
    turn = d.run("write the guide")
    assert stop_of(turn) == ("model.truncated", "output_tokens", 16, 64)
    assert turn["result"]["answer"] == wire.GEMINI_CUT_TEXT


def test_a_gemini_429_retry_delay_is_waited_like_retry_after(
        start: Any, faults: FaultServer) -> None:
    faults.script("primary", replay(wire.GEMINI_RATE_LIMITED, status=429),
                  replay(wire.gemini_text("after the wait")))
    d = start(config(gemini(faults, stream=False)))
    turn = d.run("hello")
    assert turn["result"]["answer"] == "after the wait", turn["result"]
    (gap,) = gaps(faults.requests("primary"))
    assert gap >= 0.4, gap
    retries = [e for e in d.events(turn["id"]) if e["type"] == "model.retry_scheduled"]
    assert [(e["status"], e["retry_after"]) for e in retries] == [(429, 0.4)]
