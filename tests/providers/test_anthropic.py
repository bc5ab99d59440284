"""AnthropicProvider against real servers on 127.0.0.1: llmock for the conversation and the
faults it can inject, a tiny aiohttp server where the exact bytes matter. The faults
every adapter must meet alike are in the conformance suite
(tests/integration/test_conformance.py)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest
from aiohttp import web

from turnkeeper.policy.classify import CallFailure, FailureClass, classify
from turnkeeper.providers.base import Message, ModelReply, ProviderError, ToolCall

pytestmark = pytest.mark.anyio

Serve = Callable[[Callable[[web.Request], Awaitable[web.StreamResponse]]], Awaitable[str]]


async def failure_of(call: Awaitable[ModelReply]) -> CallFailure:
    with pytest.raises(ProviderError) as info:
        await call
    return info.value.failure


def event(obj: dict[str, Any]) -> bytes:
    return f"event: {obj['type']}\ndata: {json.dumps(obj)}\n\n".encode()


async def sse(request: web.Request, events: list[bytes], *, pause: float = 0.0
              ) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for e in events:
        await resp.write(e)
        if pause:
            await anyio.sleep(pause)
    return resp


START = event({"type": "message_start", "message": {
    "id": "msg_1", "type": "message", "role": "assistant", "content": [], "model": "claude-x",
    "usage": {"input_tokens": 20, "output_tokens": 1}}})


# -- the conversation --------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_tool_calling_conversation_completes(llmock, make_provider, make_request,
                                                   stream: bool) -> None:
    p = make_provider("anthropic", llmock.base_url("anthropic"), stream=stream)
    history = [Message(role="user", content="What is the weather in Paris?")]
    deltas: list[str] = []

    async def on_delta(text: str) -> None:
        deltas.append(text)

    first = await p.complete(make_request(history), on_delta)
    assert first.finish_reason == "tool_calls"
    assert [c.name for c in first.tool_calls] == ["get_weather"]
    assert json.loads(first.tool_calls[0].arguments) == {"city": "mock-city"}
    assert first.usage.input_tokens > 0 and first.usage.output_tokens > 0

    sent = llmock.last_request.body
    assert sent["system"] == "You are terse."
    assert sent["messages"] == [{"role": "user", "content": "What is the weather in Paris?"}]
    assert sent["tools"] == [{"name": "get_weather",
                              "description": "Get the current weather for a city",
                              "input_schema": {"type": "object",
                                               "properties": {"city": {"type": "string"}},
                                               "required": ["city"]}}]
    assert sent["max_tokens"] == 256 and sent["stream"] is stream

    call = first.tool_calls[0]
    history += [Message(role="assistant", content=first.text, tool_calls=first.tool_calls),
                Message(role="tool", content="21C and sunny", tool_call_id=call.id,
                        name="get_weather")]
    final = await p.complete(make_request(history), on_delta)
    assert final.finish_reason == "stop"
    assert final.text
    assert final.tool_calls == ()
    assert final.usage.input_tokens > 0 and final.usage.output_tokens > 0

    sent = llmock.last_request.body
    assert sent["messages"][1:] == [
        {"role": "assistant", "content": [{"type": "tool_use", "id": call.id,
                                           "name": "get_weather",
                                           "input": {"city": "mock-city"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                      "content": "21C and sunny"}]},
    ]
    if stream:
        assert "".join(deltas) == final.text
    else:
        assert deltas == []


async def test_history_encoding_merges_tool_results_and_repairs_bad_arguments(
        llmock, make_provider, make_request) -> None:
    p = make_provider("anthropic", llmock.base_url("anthropic"), stream=False)
    history = [
        Message(role="user", content="Weather in Oslo and Rome?"),
        Message(role="assistant", content="Checking both.", tool_calls=(
            ToolCall("t1", "get_weather", '{"city":"Oslo"}'),
            ToolCall("t2", "get_weather", '{"city": "Rome"'))),  # not valid JSON
        Message(role="tool", content="-3C", tool_call_id="t1", name="get_weather"),
        Message(role="tool", content="18C", tool_call_id="t2", name="get_weather"),
        Message(role="system", content="Answer in one line."),
        Message(role="user", content="And?"),
    ]
    await p.complete(make_request(history))
    sent = llmock.last_request.body
    assert sent["system"] == "You are terse.\n\nAnswer in one line."
    assert sent["messages"] == [
        {"role": "user", "content": "Weather in Oslo and Rome?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Checking both."},
            {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Oslo"}},
            {"type": "tool_use", "id": "t2", "name": "get_weather", "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": "-3C"},
            {"type": "tool_result", "tool_use_id": "t2", "content": "18C"}]},
        {"role": "user", "content": "And?"},
    ]


async def test_headers_url_and_cached_usage(web_server: Serve, make_provider, make_request,
                                            api_key: str) -> None:
    seen: list[tuple[str, str | None, str | None]] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        seen.append((request.path, request.headers.get("x-api-key"),
                     request.headers.get("anthropic-version")))
        return web.json_response({
            "type": "message", "model": "claude-x", "stop_reason": "max_tokens",
            "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}],
            "usage": {"input_tokens": 5, "cache_read_input_tokens": 100,
                      "cache_creation_input_tokens": 10, "output_tokens": 256}})

    url = await web_server(handler)
    with_key = make_provider("anthropic", url + "/", stream=False)
    without = make_provider("anthropic", url, stream=False, with_key=False)
    reply = await with_key.complete(make_request([Message(role="user", content="x")]))
    await without.complete(make_request([Message(role="user", content="x")]))
    assert (reply.text, reply.finish_reason, reply.model) == ("Hello", "length", "claude-x")
    assert (reply.usage.input_tokens, reply.usage.output_tokens) == (115, 256)
    assert seen == [("/v1/messages", api_key, "2023-06-01"),
                    ("/v1/messages", None, "2023-06-01")]


@pytest.mark.parametrize("pause", [0.0, 0.02], ids=["one-write", "a-write-a-piece"])
async def test_streamed_text_is_one_delta_per_network_read(
        web_server: Serve, make_provider, make_request, complete_streaming,
        pause: float) -> None:
    """What one read brings is one delta: a piece a read when the pieces come apart, far
    fewer deltas than pieces when they arrive together (a busy daemon reading late)."""
    words = [f"word{i} " for i in range(20)]
    events = [START, event({"type": "content_block_start", "index": 0,
                            "content_block": {"type": "text", "text": words[0]}}),
              *(event({"type": "content_block_delta", "index": 0,
                       "delta": {"type": "text_delta", "text": w}}) for w in words[1:]),
              event({"type": "content_block_stop", "index": 0}),
              event({"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                     "usage": {"output_tokens": 20}}),
              event({"type": "message_stop"})]

    async def handler(request: web.Request) -> web.StreamResponse:
        return await sse(request, events if pause else [b"".join(events)], pause=pause)

    p = make_provider("anthropic", await web_server(handler))
    reply, deltas = await complete_streaming(
        p, make_request([Message(role="user", content="hi")]))
    assert "".join(deltas) == reply.text == "".join(words)
    if pause:
        assert deltas == words
    else:
        assert len(deltas) < len(words)


async def test_stream_events_with_ping_and_thinking_are_read(web_server: Serve,
                                                             make_provider,
                                                             make_request) -> None:
    events = [
        START,
        event({"type": "ping"}),
        event({"type": "content_block_start", "index": 0,
               "content_block": {"type": "thinking", "thinking": ""}}),
        event({"type": "content_block_delta", "index": 0,
               "delta": {"type": "thinking_delta", "thinking": "hmm"}}),
        event({"type": "content_block_stop", "index": 0}),
        event({"type": "content_block_start", "index": 1,
               "content_block": {"type": "text", "text": ""}}),
        event({"type": "content_block_delta", "index": 1,
               "delta": {"type": "text_delta", "text": "Two "}}),
        event({"type": "content_block_delta", "index": 1,
               "delta": {"type": "text_delta", "text": "calls."}}),
        event({"type": "content_block_stop", "index": 1}),
        event({"type": "content_block_start", "index": 2, "content_block": {
            "type": "tool_use", "id": "a", "name": "get_weather", "input": {}}}),
        event({"type": "content_block_delta", "index": 2,
               "delta": {"type": "input_json_delta", "partial_json": '{"city":'}}),
        event({"type": "content_block_delta", "index": 2,
               "delta": {"type": "input_json_delta", "partial_json": '"Oslo"}'}}),
        event({"type": "content_block_stop", "index": 2}),
        event({"type": "content_block_start", "index": 3, "content_block": {
            "type": "tool_use", "id": "b", "name": "now", "input": {}}}),
        event({"type": "content_block_stop", "index": 3}),
        event({"type": "message_delta", "delta": {"stop_reason": "tool_use"},
               "usage": {"output_tokens": 42}}),
        event({"type": "message_stop"}),
    ]

    async def handler(request: web.Request) -> web.StreamResponse:
        return await sse(request, events)

    deltas: list[str] = []

    async def on_delta(text: str) -> None:
        deltas.append(text)

    p = make_provider("anthropic", await web_server(handler))
    reply = await p.complete(make_request([Message(role="user", content="x")]), on_delta)
    assert reply.text == "Two calls." == "".join(deltas)  # one delta per network read
    assert reply.tool_calls == (ToolCall("a", "get_weather", '{"city":"Oslo"}'),
                                ToolCall("b", "now", "{}"))
    assert reply.finish_reason == "tool_calls"
    assert (reply.usage.input_tokens, reply.usage.output_tokens) == (20, 42)
    # The thinking block is kept, as the stream built it, to go back with the calls.
    assert reply.opaque == ({"type": "thinking", "thinking": "hmm", "signature": ""},)


async def test_thinking_blocks_lead_the_assistant_message_and_the_budget_fits_the_cap(
        make_provider, make_request) -> None:
    thinking = {"type": "thinking", "thinking": "t", "signature": "sig=="}
    p = make_provider("anthropic", "http://127.0.0.1:9", stream=False,
                      options={"thinking": {"type": "enabled", "budget_tokens": 2000}},
                      max_output_tokens=4096)
    history = [Message(role="user", content="x"),
               Message(role="assistant", content="Let me look.",
                       tool_calls=(ToolCall("a", "now", "{}"),), opaque=(thinking,)),
               Message(role="tool", content="12:00", tool_call_id="a", name="now")]
    body = json.loads(p.encode(make_request(history, max_output_tokens=1500)))
    assert [b["type"] for b in body["messages"][1]["content"]] == [
        "thinking", "text", "tool_use"]
    assert body["messages"][1]["content"][0] == thinking
    assert (body["max_tokens"], body["thinking"]) == (
        1500, {"type": "enabled", "budget_tokens": 1499})
    body = json.loads(p.encode(make_request(history, max_output_tokens=4096)))
    assert body["thinking"] == {"type": "enabled", "budget_tokens": 2000}


# -- HTTP failures -----------------------------------------------------------------------


async def test_429_reports_status_and_retry_after_and_is_one_attempt(
        llmock, make_provider, make_request) -> None:
    llmock.rate_limit(retry_after=2.5)
    p = make_provider("anthropic", llmock.base_url("anthropic"))
    f = await failure_of(p.complete(make_request([Message(role="user", content="hi")])))
    assert (f.status, f.error_type, f.retry_after_s) == (429, "rate_limit_error", 2.5)
    assert classify(f) is FailureClass.RETRYABLE
    assert len(llmock.requests) == 1




async def test_prompt_is_too_long_is_an_overflow(llmock, make_provider,
                                                 make_request) -> None:
    llmock.limits(context_window=5)
    p = make_provider("anthropic", llmock.base_url("anthropic"))
    f = await failure_of(p.complete(make_request(
        [Message(role="user", content="a prompt much longer than five tokens " * 4)])))
    assert (f.status, f.error_type) == (400, "invalid_request_error")
    assert f.message.startswith("prompt is too long")
    assert f.context_overflow is True


async def test_api_key_never_appears_in_a_failure(web_server: Serve, make_provider,
                                                  make_request, api_key: str) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        key = request.headers["x-api-key"]
        return web.json_response({"type": "error", "error": {
            "type": "authentication_error", "message": f"invalid x-api-key {key}"}},
            status=401)

    p = make_provider("anthropic", await web_server(handler))
    with pytest.raises(ProviderError) as info:
        await p.complete(make_request([Message(role="user", content="hi")]))
    f = info.value.failure
    assert (f.status, f.error_type) == (401, "authentication_error")
    assert classify(f) is FailureClass.DETERMINISTIC
    for text in (f.message, str(info.value), json.dumps(f.to_json()), repr(f)):
        assert api_key not in text


# -- transport and stream faults ---------------------------------------------------------






async def test_stream_with_stop_reason_but_no_message_stop_is_incomplete(
        web_server: Serve, make_provider, make_request) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        return await sse(request, [START, event({
            "type": "message_delta", "delta": {"stop_reason": "end_turn"},
            "usage": {"output_tokens": 1}})])

    p = make_provider("anthropic", await web_server(handler))
    f = await failure_of(p.complete(make_request([Message(role="user", content="hi")])))
    assert f.exception == ("IncompleteStream",)




async def test_stalled_stream_fails_after_the_chunk_timeout(web_server: Serve, make_provider,
                                                            make_request) -> None:
    """The stream stops after two events and stays silent until the test is over: only the
    0.3 s read timeout can end the call, so getting a failure at all is the proof (the
    guard below only turns a hang into a failure)."""
    released = anyio.Event()

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = await sse(request, [START, event({
            "type": "content_block_start", "index": 0,
            "content_block": {"type": "text", "text": "half"}})])
        await released.wait()
        return resp

    p = make_provider("anthropic", await web_server(handler))
    try:
        with anyio.fail_after(30):
            f = await failure_of(p.complete(make_request(
                [Message(role="user", content="hi")], tools=(), timeout_s=0.3)))
    finally:
        released.set()
    assert f.exception == ("StalledStream", "TimeoutError")




async def test_non_json_200_is_corrupt(web_server: Serve, make_provider,
                                       make_request) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        return web.Response(body=b'{"type": "message", "content": [', content_type="text/plain")

    p = make_provider("anthropic", await web_server(handler), stream=False)
    f = await failure_of(p.complete(make_request([Message(role="user", content="hi")])))
    assert (f.status, f.exception) == (None, ("CorruptStream",))


async def test_cancellation_propagates_and_closes_the_response(web_server: Serve,
                                                               make_provider,
                                                               make_request) -> None:
    gone = anyio.Event()

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            await resp.write(START)
            while True:
                await resp.write(event({"type": "ping"}))
                await anyio.sleep(0.05)
        finally:
            gone.set()

    p = make_provider("anthropic", await web_server(handler))
    with anyio.move_on_after(0.3) as scope:
        await p.complete(make_request([Message(role="user", content="hi")], timeout_s=10))
    assert scope.cancelled_caught
    with anyio.fail_after(3):
        await gone.wait()
