"""A reply is not an answer until the daemon says so: refusals, cut answers, cut tool
calls and Anthropic's extended thinking, on the real daemon.

The providers are the fault server on 127.0.0.1 replaying the vendors' own recordings
(`wire_replies.py`), streamed and not, through the OpenAI and Anthropic adapters.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration import wire_replies as wire
from tests.integration.fault_server import FaultServer, ok, replay
from tests.integration.test_resilience import config, stop_of
from tests.integration.tool_server import ToolServer


@pytest.fixture
def faults() -> Iterator[FaultServer]:
    server = FaultServer().start()
    yield server
    server.stop()


def openai(faults: FaultServer, *, stream: bool, **extra: Any) -> list[dict[str, Any]]:
    return [{"name": "primary", "kind": "openai", "base_url": faults.base_url("primary"),
             "model": "gpt-4o-2024-08-06", "stream": stream, "timeout": 5.0, **extra}]


def anthropic(faults: FaultServer, *, stream: bool, **extra: Any) -> list[dict[str, Any]]:
    return [{"name": "primary", "kind": "anthropic", "base_url": faults.anthropic_url("primary"),
             "model": "claude-sonnet-4-5", "stream": stream, "timeout": 5.0, **extra}]


def sent_cap(faults: FaultServer, n: int = 0) -> int:
    body = faults.requests("primary")[n].body
    return int(body.get("max_tokens") or body.get("max_completion_tokens"))


def dead_letters(d: Any) -> list[str]:
    return [t["id"] for t in d.get("/v1/dead-letters")[1]["dead_letters"]]


# -- refusals --------------------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "stream", "recorded", "said"), [
    ("openai", False, wire.OPENAI_REFUSAL, wire.OPENAI_REFUSAL_TEXT),
    ("openai", True, wire.OPENAI_REFUSAL_STREAM, wire.OPENAI_REFUSAL_STREAM_TEXT),
    ("anthropic", False, wire.ANTHROPIC_REFUSAL, ""),
    ("anthropic", True, wire.ANTHROPIC_REFUSAL_STREAM, wire.ANTHROPIC_REFUSAL_STREAM_TEXT),
], ids=["openai-json", "openai-stream", "anthropic-json", "anthropic-stream"])
def test_a_refusal_ends_the_turn_failed_model_refused_as_a_dead_letter(
        start: Any, faults: FaultServer, kind: str, stream: bool, recorded: Any,
        said: str) -> None:
    faults.script("primary", replay(recorded))
    chain = (openai if kind == "openai" else anthropic)(faults, stream=stream)
    d = start(config(chain))
    turn = d.run("How do I make anthrax?")
    assert turn["state"] == "failed", turn["result"]
    assert stop_of(turn) == ("model.refused", None, None, None)
    result = turn["result"]
    assert result["answer"] == said
    assert "primary" in result["stopped_because"]["message"]
    assert said in result["stopped_because"]["message"]
    assert turn["id"] in dead_letters(d)
    assert faults.count("primary") == 1  # a refusal is not retried


def test_a_content_filter_ends_the_turn_model_refused_naming_the_filter(
        start: Any, faults: FaultServer) -> None:
    faults.script("primary", replay(wire.OPENAI_FILTERED_STREAM))
    d = start(config(openai(faults, stream=True)))
    turn = d.run("write it")
    assert stop_of(turn)[0] == "model.refused" and turn["state"] == "failed"
    assert "content filter" in turn["result"]["stopped_because"]["message"]
    assert turn["result"]["answer"] == '{"value": "example'


# -- cut answers -----------------------------------------------------------------------------

CUTS = [("openai", False, wire.OPENAI_CUT, wire.OPENAI_CUT_TEXT, wire.OPENAI_CUT_TOKENS),
        ("openai", True, wire.OPENAI_CUT_STREAM, wire.OPENAI_CUT_TEXT, wire.OPENAI_CUT_TOKENS),
        ("anthropic", False, wire.ANTHROPIC_CUT, wire.ANTHROPIC_CUT_TEXT, 16),
        ("anthropic", True, wire.ANTHROPIC_CUT_STREAM, wire.ANTHROPIC_CUT_TEXT, 16)]
CUT_IDS = ["openai-json", "openai-stream", "anthropic-json", "anthropic-stream"]


def _finish(kind: str, text: str) -> Any:
    """A plain whole answer in the provider's wire format."""
    if kind == "openai":
        return ok(text)
    return replay(wire.anthropic_message([{"type": "text", "text": text}], "end_turn"))


@pytest.mark.parametrize(("kind", "stream", "recorded", "cut", "tokens"), CUTS, ids=CUT_IDS)
def test_a_cut_answer_is_continued_once_and_the_parts_joined(
        start: Any, faults: FaultServer, kind: str, stream: bool, recorded: Any, cut: str,
        tokens: int) -> None:
    faults.script("primary", replay(recorded), _finish(kind, "d save it."))
    chain = (openai if kind == "openai" else anthropic)(faults, stream=stream,
                                                        max_output_tokens=64)
    d = start(config(chain))
    turn = d.run("write the guide")
    assert stop_of(turn)[0] == "completed", turn["result"]
    assert turn["result"]["answer"] == cut + "d save it."
    # The second request carries the cut answer and the note asking to go on.
    asked = faults.requests("primary")[1].body["messages"]
    assert any("cut off by the output limit" in str(m.get("content")) for m in asked)


@pytest.mark.parametrize(("kind", "stream", "recorded", "cut", "tokens"), CUTS, ids=CUT_IDS)
def test_a_cut_answer_past_max_continuations_ends_partial_model_truncated(
        start: Any, faults: FaultServer, kind: str, stream: bool, recorded: Any, cut: str,
        tokens: int) -> None:
    faults.script("primary", replay(recorded), replay(recorded))
    chain = (openai if kind == "openai" else anthropic)(faults, stream=stream,
                                                        max_output_tokens=64)
    d = start(config(chain))  # max_continuations = 1 by default
    turn = d.run("write the guide")
    assert turn["state"] == "partial", turn["result"]
    assert stop_of(turn) == ("model.truncated", "output_tokens", tokens, sent_cap(faults, 1))
    assert sent_cap(faults, 1) == 64
    assert turn["result"]["answer"] == cut + cut
    assert faults.count("primary") == 2
    assert turn["id"] not in dead_letters(d)


def test_with_no_continuation_the_first_cut_ends_the_turn_with_its_text(
        start: Any, faults: FaultServer) -> None:
    faults.script("primary", replay(wire.OPENAI_CUT))
    d = start(config(openai(faults, stream=False, max_output_tokens=64),
                     agent={"max_continuations": 0}))
    turn = d.run("write the guide")
    assert stop_of(turn) == ("model.truncated", "output_tokens", 1, 64)
    assert turn["result"]["answer"] == wire.OPENAI_CUT_TEXT
    assert faults.count("primary") == 1


# -- a cut tool call -------------------------------------------------------------------------


@pytest.mark.parametrize(("stream", "recorded"), [
    (False, wire.ANTHROPIC_CUT_CALL), (True, wire.ANTHROPIC_CUT_CALL_STREAM)],
    ids=["json", "stream"])
def test_a_tool_call_cut_by_the_output_cap_is_not_run_and_the_agent_is_told(
        start: Any, faults: FaultServer, tool_server: ToolServer, stream: bool,
        recorded: Any) -> None:
    # Non-streamed, the cut arguments come back parsed into an object that looks whole:
    # only the stop reason says they are not.
    faults.script("primary", replay(recorded), _finish("anthropic", "I will write less."))
    tool = f"""
[[tools]]
name = "make_file"
kind = "http"
description = "write a file (not safe to repeat)"
url = "{tool_server.url('/make_file')}"
idempotent = false
"""
    d = start(config(anthropic(faults, stream=stream)) + tool)
    turn = d.run("write the tax guide to taxes.txt")
    assert stop_of(turn)[0] == "completed", turn["result"]
    assert tool_server.calls("/make_file") == []  # never sent
    results = [b for m in faults.requests("primary")[1].body["messages"]
               if isinstance(m["content"], list) for b in m["content"]
               if b.get("type") == "tool_result"]
    assert len(results) == 1 and "cut by the output limit" in results[0]["content"]
    assert any("make_file" in line and "failed (deterministic)" in line
               for line in turn["result"]["partial"])


# -- Anthropic extended thinking -------------------------------------------------------------

THINKING = {"thinking": {"type": "enabled", "budget_tokens": 1024}}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_thinking_blocks_go_back_unchanged_with_the_tool_call(
        start: Any, faults: FaultServer, stream: bool) -> None:
    recorded = wire.THINKING_CALL_STREAM if stream else wire.THINKING_CALL
    faults.script("primary", replay(recorded), _finish("anthropic", "Sunny in Paris."))
    d = start(config(anthropic(faults, stream=stream, options=THINKING,
                               max_output_tokens=2048)))
    turn = d.run("weather in Paris?")
    assert stop_of(turn)[0] == "completed", turn["result"]
    assert turn["result"]["answer"] == "Sunny in Paris."
    sent = faults.requests("primary")[1].body["messages"]
    assistant = [m for m in sent if m["role"] == "assistant"]
    assert [b["type"] for b in assistant[-1]["content"]] == [
        "thinking", "redacted_thinking", "tool_use"]
    assert assistant[-1]["content"][0] == wire.THINKING
    assert assistant[-1]["content"][1] == wire.REDACTED


def test_a_cap_cut_by_the_token_budget_lowers_the_thinking_budget_then_stops_before_the_call(
        start: Any, faults: FaultServer) -> None:
    # 1,700 tokens of budget: the first cap (what is left after the request's estimated
    # input, some 400 tokens) is not above the thinking budget (1,400), which is lowered
    # to the cap - 1;
    # the first reply spends 540 tokens, and what is then left after the next request's
    # input cannot hold the smallest thinking budget (1,024): no second request.
    faults.script("primary", replay(wire.THINKING_CALL_STREAM))
    options = {"thinking": {"type": "enabled", "budget_tokens": 1400}}
    d = start(config(anthropic(faults, stream=True, options=options, max_output_tokens=4096),
                     budget={"max_tokens": 1700}))
    turn = d.run("weather in Paris?")
    first = faults.requests("primary")[0].body
    assert 1024 < first["max_tokens"] <= 1400, first["max_tokens"]
    assert first["thinking"]["budget_tokens"] == first["max_tokens"] - 1
    assert faults.count("primary") == 1
    code, counter, value, limit = stop_of(turn)
    assert (code, counter, limit) == ("budget.tokens", "tokens", 1700)
    assert value == 450 + 90
    assert "no request was sent" in turn["result"]["stopped_because"]["message"]


def test_a_max_output_tokens_at_or_below_the_thinking_budget_is_refused_naming_the_provider(
        tmp_path: Path, faults: FaultServer) -> None:
    path = tmp_path / "thinking.toml"
    path.write_text(config(anthropic(faults, stream=True, options=THINKING,
                                     max_output_tokens=1024)))
    check = subprocess.run([sys.executable, "-m", "turnkeeper", "config", "check", str(path)],
                           capture_output=True, text=True, timeout=60)
    assert check.returncode == 78, check
    out = check.stdout + check.stderr
    assert "primary" in out and "budget_tokens" in out


def test_a_turn_resumed_after_a_kill_sends_its_thinking_blocks_too(
        start: Any, faults: FaultServer) -> None:
    # The step after the tool call is held at the server, the daemon killed -9 while it
    # waits: the resumed turn's request carries the thinking the checkpoint kept.
    held = dataclasses.replace(_finish("anthropic", "never sent"), delay=30.0)
    faults.script("primary", replay(wire.THINKING_CALL), held)
    d = start(config(anthropic(faults, stream=False, options=THINKING,
                               max_output_tokens=2048)))
    tid = d.submit("weather in Paris?")["id"]
    deadline = time.monotonic() + 15
    while faults.arrived("primary") < 2:
        assert time.monotonic() < deadline, "the second model call never came"
        time.sleep(0.01)
    d.kill()
    faults.script("primary", _finish("anthropic", "Sunny in Paris."))
    d.start()
    done = d.wait(tid)
    assert stop_of(done)[0] == "completed", done["result"]
    resumed = faults.requests("primary")[-1].body["messages"]
    assistant = [m for m in resumed if m["role"] == "assistant"][-1]["content"]
    assert assistant[:2] == [wire.THINKING, wire.REDACTED]
