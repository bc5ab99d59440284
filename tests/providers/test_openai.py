"""OpenAIProvider against real servers on 127.0.0.1: llmock for the conversation and the
faults it can inject, a tiny aiohttp server where the exact bytes matter. The faults
every adapter must meet alike (a stream cut or dropped, a corrupt event, an error event
inside the stream, an overload) are run for all of them, as whole turns, by the
conformance suite (tests/integration/test_conformance.py)."""

from __future__ import annotations

import json
import socket
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


async def sse(request: web.Request, events: list[bytes], *, pause: float = 0.0
              ) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for e in events:
        await resp.write(e)
        if pause:
            await anyio.sleep(pause)
    return resp


def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
    obj = {"id": "c1", "object": "chat.completion.chunk", "model": "test-model",
           "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


# -- the conversation --------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_tool_calling_conversation_completes(llmock, make_provider, make_request,
                                                   stream: bool) -> None:
    p = make_provider("openai", llmock.base_url("openai"), stream=stream)
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
    assert sent["messages"][0] == {"role": "system", "content": "You are terse."}
    assert sent["tools"][0]["type"] == "function"
    assert sent["tools"][0]["function"]["name"] == "get_weather"
    assert sent["tools"][0]["function"]["parameters"]["required"] == ["city"]
    assert sent["max_tokens"] == 256 and sent["stream"] is stream
    assert ("stream_options" in sent) is stream

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
    assert sent["messages"][2]["tool_calls"] == [
        {"id": call.id, "type": "function",
         "function": {"name": "get_weather", "arguments": call.arguments}}]
    assert sent["messages"][3] == {"role": "tool", "tool_call_id": call.id,
                                   "content": "21C and sunny"}
    if stream:
        assert "".join(deltas) == final.text
    else:
        assert deltas == []


async def test_headers_and_url(web_server: Serve, make_provider, make_request) -> None:
    seen: list[tuple[str, str | None]] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        seen.append((request.path, request.headers.get("Authorization")))
        return web.json_response({"model": "m", "choices": [
            {"message": {"content": "hi"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1}})

    url = await web_server(handler)
    with_key = make_provider("openai", url + "/v1/", stream=False)
    without = make_provider("openai", url + "/v1", stream=False, with_key=False)
    reply = await with_key.complete(make_request([Message(role="user", content="x")]))
    await without.complete(make_request([Message(role="user", content="x")]))
    assert reply.text == "hi" and reply.usage.total_tokens == 4
    assert seen[0][0] == "/v1/chat/completions"
    assert seen[0][1] == f"Bearer {with_key._client._secret}"
    assert seen[1][1] is None


async def test_stream_reassembles_interleaved_tool_calls_split_anywhere(
        web_server: Serve, make_provider, make_request) -> None:
    body = b"".join([
        chunk({"role": "assistant", "content": None}),
        chunk({"tool_calls": [{"index": 0, "id": "a", "type": "function",
                               "function": {"name": "get_weather", "arguments": ""}}]}),
        chunk({"tool_calls": [{"index": 1, "id": "b", "type": "function",
                               "function": {"name": "get_weather", "arguments": '{"ci'}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city":"Oslo"}'}}]}),
        chunk({"tool_calls": [{"index": 1, "function": {"arguments": 'ty":"Rome"}'}}]}),
        chunk({}, "tool_calls"),
        b": keep-alive comment\r\n\r\n",
        b'data: {"choices":[],"usage":{"prompt_tokens":11,"completion_tokens":7}}\r\n\r\n',
        b"data: [DONE]\n\n",
    ])
    pieces = [body[i:i + 37] for i in range(0, len(body), 37)]  # cut mid-line, mid-event

    async def handler(request: web.Request) -> web.StreamResponse:
        return await sse(request, pieces, pause=0.001)

    p = make_provider("openai", await web_server(handler) + "/v1")
    reply = await p.complete(make_request([Message(role="user", content="two cities")]))
    assert reply.tool_calls == (ToolCall("a", "get_weather", '{"city":"Oslo"}'),
                                ToolCall("b", "get_weather", '{"city":"Rome"}'))
    assert reply.finish_reason == "tool_calls"
    assert (reply.usage.input_tokens, reply.usage.output_tokens) == (11, 7)


async def test_length_finish_is_normalised(llmock, make_provider, make_request) -> None:
    from llmock.scenarios import Reply

    llmock.add(Reply(text="cut short", finish_reason="length"))
    p = make_provider("openai", llmock.base_url("openai"), stream=True)
    reply = await p.complete(make_request([Message(role="user", content="go")], tools=()))
    assert (reply.text, reply.finish_reason) == ("cut short", "length")


# -- HTTP failures -----------------------------------------------------------------------


async def test_429_reports_status_and_retry_after_and_is_one_attempt(
        llmock, make_provider, make_request) -> None:
    llmock.rate_limit(retry_after=1.5)
    p = make_provider("openai", llmock.base_url("openai"))
    f = await failure_of(p.complete(make_request([Message(role="user", content="hi")])))
    assert f.status == 429
    assert f.retry_after_s == 1.5  # retry-after-ms; the whole-second header says 2
    assert f.error_type and f.message
    assert classify(f) is FailureClass.RETRYABLE
    assert len(llmock.requests) == 1




@pytest.mark.parametrize(("headers", "body", "expected"), [
    ({"Retry-After": "7"}, {"error": {"message": "slow down"}}, 7.0),
    ({}, {"error": {"message": "slow down", "retry_after": 3}}, 3.0),
    ({"Retry-After": "soon"}, {"error": {"message": "slow down"}}, None),
], ids=["header", "body", "unreadable"])
async def test_retry_after_header_or_body(web_server: Serve, make_provider, make_request,
                                          headers: dict[str, str], body: dict[str, Any],
                                          expected: float | None) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        return web.json_response(body, status=429, headers=headers)

    p = make_provider("openai", await web_server(handler) + "/v1")
    f = await failure_of(p.complete(make_request([Message(role="user", content="hi")])))
    assert (f.status, f.retry_after_s, f.message) == (429, expected, "slow down")


async def test_context_length_exceeded_is_an_overflow(llmock, make_provider,
                                                      make_request) -> None:
    llmock.limits(context_window=5)
    p = make_provider("openai", llmock.base_url("openai"))
    f = await failure_of(p.complete(make_request(
        [Message(role="user", content="a prompt much longer than five tokens " * 4)])))
    assert f.status == 400
    assert f.error_type == "invalid_request_error"
    assert f.context_overflow is True


async def test_plain_400_is_not_an_overflow(llmock, make_provider, make_request) -> None:
    llmock.fail(400, message="messages[0].role is invalid")
    p = make_provider("openai", llmock.base_url("openai"))
    f = await failure_of(p.complete(make_request([Message(role="user", content="hi")])))
    assert (f.status, f.context_overflow) == (400, False)
    assert classify(f) is FailureClass.DETERMINISTIC


async def test_api_key_never_appears_in_a_failure(web_server: Serve, make_provider,
                                                  make_request, api_key: str) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        auth = request.headers["Authorization"]
        return web.json_response({"error": {"message": f"Incorrect API key provided: {auth}",
                                            "type": "invalid_request_error",
                                            "code": "invalid_api_key"}}, status=401)

    p = make_provider("openai", await web_server(handler) + "/v1")
    with pytest.raises(ProviderError) as info:
        await p.complete(make_request([Message(role="user", content="hi")]))
    f = info.value.failure
    assert f.status == 401 and f.error_type == "invalid_request_error"
    assert "Incorrect API key provided" in f.message
    for text in (f.message, str(info.value), json.dumps(f.to_json()), repr(f)):
        assert api_key not in text


# -- transport and stream faults ---------------------------------------------------------


async def test_connection_refused_names_the_transport_error(make_provider,
                                                            make_request) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = make_provider("openai", f"http://127.0.0.1:{port}/v1")
    f = await failure_of(p.complete(make_request([Message(role="user", content="hi")])))
    assert f.status is None
    assert f.exception[0] == "ClientConnectorError"
    assert classify(f) is FailureClass.RETRYABLE






@pytest.mark.parametrize("pause", [0.0, 0.02], ids=["one-write", "a-write-a-piece"])
async def test_streamed_text_is_one_delta_per_network_read(
        web_server: Serve, make_provider, make_request, complete_streaming,
        pause: float) -> None:
    """What one read brings is one delta: a piece a read when the pieces come apart, far
    fewer deltas than pieces when they arrive together (a busy daemon reading late)."""
    words = [f"word{i} " for i in range(20)]
    events = [chunk({"role": "assistant", "content": ""}),
              *(chunk({"content": w}) for w in words), chunk({}, "stop"), b"data: [DONE]\n\n"]

    async def handler(request: web.Request) -> web.StreamResponse:
        return await sse(request, events if pause else [b"".join(events)], pause=pause)

    p = make_provider("openai", await web_server(handler) + "/v1")
    reply, deltas = await complete_streaming(
        p, make_request([Message(role="user", content="hi")]))
    assert "".join(deltas) == reply.text == "".join(words)
    if pause:
        assert deltas == words
    else:
        assert len(deltas) < len(words)


async def test_stream_without_done_is_incomplete(web_server: Serve, make_provider,
                                                 make_request) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        return await sse(request, [chunk({"content": "all"}), chunk({}, "stop")])

    p = make_provider("openai", await web_server(handler) + "/v1")
    f = await failure_of(p.complete(make_request([Message(role="user", content="hi")])))
    assert f.exception == ("IncompleteStream",)




async def test_stalled_stream_fails_after_the_chunk_timeout(web_server: Serve, make_provider,
                                                            make_request) -> None:
    """The stream stops after two chunks and stays silent until the test is over: only the
    0.3 s read timeout can end the call, so getting a failure at all is the proof (the
    guard below only turns a hang into a failure)."""
    released = anyio.Event()

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = await sse(request, [chunk({"role": "assistant", "content": ""}),
                                   chunk({"content": "half"})])
        await released.wait()
        return resp

    p = make_provider("openai", await web_server(handler) + "/v1")
    try:
        with anyio.fail_after(30):
            f = await failure_of(p.complete(make_request(
                [Message(role="user", content="hi")], tools=(), timeout_s=0.3)))
    finally:
        released.set()
    assert f.exception == ("StalledStream", "TimeoutError")
    assert classify(f) is FailureClass.RETRYABLE




async def test_non_json_200_is_corrupt(web_server: Serve, make_provider,
                                       make_request) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        return web.Response(text="<html>proxy says hi</html>", content_type="text/html")

    p = make_provider("openai", await web_server(handler) + "/v1", stream=False)
    f = await failure_of(p.complete(make_request([Message(role="user", content="hi")])))
    assert (f.status, f.exception) == (None, ("CorruptStream",))


async def test_non_streaming_call_is_bounded_as_a_whole(web_server: Serve, make_provider,
                                                        make_request) -> None:
    """A byte every 0.1 s until the test is over: never a read timeout, never done, so only
    the 0.4 s bound on the whole call can end it (the guard only turns a hang into a
    failure)."""
    released = anyio.Event()

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        while not released.is_set():
            await resp.write(b" ")
            await anyio.sleep(0.1)  # the trickle's pace, not a wait for state
        return resp

    p = make_provider("openai", await web_server(handler) + "/v1", stream=False)
    try:
        with anyio.fail_after(30):
            f = await failure_of(p.complete(make_request(
                [Message(role="user", content="hi")], timeout_s=0.4)))
    finally:
        released.set()
    assert "TimeoutError" in f.exception


async def test_cancellation_propagates_and_closes_the_response(web_server: Serve,
                                                               make_provider,
                                                               make_request) -> None:
    gone = anyio.Event()

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            while True:
                await resp.write(chunk({"content": "."}))
                await anyio.sleep(0.05)
        except (ConnectionError, OSError):
            gone.set()
        finally:
            gone.set()
        return resp

    p = make_provider("openai", await web_server(handler) + "/v1")
    with anyio.move_on_after(0.3) as scope:
        await p.complete(make_request([Message(role="user", content="hi")], timeout_s=10))
    assert scope.cancelled_caught
    with anyio.fail_after(3):
        await gone.wait()


async def test_json_answer_to_a_stream_request_and_object_arguments_are_read(
        web_server: Serve, make_provider, make_request) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        return web.json_response({"model": "m", "choices": [{"finish_reason": "tool_calls",
            "message": {"content": None, "tool_calls": [{"id": "a", "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]}}],
            "usage": {"prompt_tokens": 9, "completion_tokens": 4}})

    p = make_provider("openai", await web_server(handler) + "/v1", stream=True)
    reply = await p.complete(make_request([Message(role="user", content="x")]))
    assert reply.tool_calls == (ToolCall("a", "get_weather", '{"city":"Oslo"}'),)
    assert (reply.finish_reason, reply.usage.total_tokens) == ("tool_calls", 13)
