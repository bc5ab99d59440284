"""Prompt caching on the wire: Anthropic's cache_control marks on the stable prefix, cache
reads and writes read back from both wire formats and priced at the cache prices."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web

from turnkeeper.config import ProviderConfig
from turnkeeper.policy.budget import cost_usd
from turnkeeper.providers.base import Message, ToolCall, Usage
from turnkeeper.providers.prices import prices_in_force

pytestmark = pytest.mark.anyio

Serve = Callable[[Callable[[web.Request], Awaitable[web.StreamResponse]]], Awaitable[str]]
EPHEMERAL = {"type": "ephemeral"}


def marks(body: Any) -> int:
    """How many cache breakpoints a request body carries."""
    if isinstance(body, dict):
        return (body.get("cache_control") is not None) + sum(marks(v) for v in body.values())
    if isinstance(body, list):
        return sum(marks(v) for v in body)
    return 0


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_anthropic_marks_system_tools_and_latest_message(
        llmock, make_provider, make_request, stream: bool) -> None:
    p = make_provider("anthropic", llmock.base_url("anthropic"), stream=stream, cache="auto")
    history = [Message(role="user", content="What is the weather in Paris?")]
    first = await p.complete(make_request(history))
    sent = llmock.last_request.body
    assert sent["system"] == [{"type": "text", "text": "You are terse.",
                               "cache_control": EPHEMERAL}]
    assert sent["tools"][-1]["cache_control"] == EPHEMERAL
    assert sent["messages"] == [{"role": "user", "content": [
        {"type": "text", "text": "What is the weather in Paris?", "cache_control": EPHEMERAL}]}]

    call = first.tool_calls[0]
    history += [Message(role="assistant", content=None, tool_calls=first.tool_calls),
                Message(role="tool", content="21C", tool_call_id=call.id, name="get_weather")]
    final = await p.complete(make_request(history))
    assert final.finish_reason == "stop"
    sent = llmock.last_request.body
    # The latest message (the tool results) carries the history's one mark; the earlier
    # messages carry none, and the request stays within Anthropic's four breakpoints.
    assert sent["messages"][-1]["content"][-1]["cache_control"] == EPHEMERAL
    assert marks(sent["messages"][:-1]) == 0
    assert marks(sent) == 3


async def test_the_tool_list_is_marked_once_and_reused(llmock, make_provider,
                                                        make_request) -> None:
    p = make_provider("anthropic", llmock.base_url("anthropic"), stream=False, cache="auto")
    request = make_request([Message(role="user", content="hi")])
    await p.complete(request)
    await p.complete(request)
    assert marks(llmock.last_request.body["tools"]) == 1


async def test_cache_off_sends_no_marks(llmock, make_provider, make_request) -> None:
    p = make_provider("anthropic", llmock.base_url("anthropic"), stream=False, cache="off")
    await p.complete(make_request([Message(role="user", content="hi")]))
    assert marks(llmock.last_request.body) == 0


async def test_openai_needs_no_marks(llmock, make_provider, make_request) -> None:
    p = make_provider("openai", llmock.base_url("openai"), stream=False, cache="auto")
    await p.complete(make_request([Message(role="user", content="hi")]))
    assert marks(llmock.last_request.body) == 0


# -- cache usage read back and priced ------------------------------------------------------

ANTHROPIC_USAGE = {"input_tokens": 50, "cache_creation_input_tokens": 1000,
                   "cache_read_input_tokens": 9000, "output_tokens": 200}


def anthropic_sse() -> bytes:
    events = [
        {"type": "message_start", "message": {"model": "claude-sonnet-4-5", "usage": {
            **ANTHROPIC_USAGE, "output_tokens": 1}}},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text",
                                                                      "text": ""}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta",
                                                              "text": "ok"}},
        {"type": "content_block_stop", "index": 0},
        {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
         "usage": {"output_tokens": 200}},
        {"type": "message_stop"}]
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)


OPENAI_USAGE = {"prompt_tokens": 10_000, "completion_tokens": 200,
                "prompt_tokens_details": {"cached_tokens": 8_192}}


def openai_sse() -> bytes:
    chunks = [
        {"model": "gpt-4.1-mini", "choices": [{"index": 0, "delta": {"content": "ok"},
                                               "finish_reason": None}]},
        {"model": "gpt-4.1-mini", "choices": [{"index": 0, "delta": {},
                                               "finish_reason": "stop"}]},
        {"model": "gpt-4.1-mini", "choices": [], "usage": OPENAI_USAGE}]
    return (b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks)
            + b"data: [DONE]\n\n")


async def serve_usage(web_server: Serve, kind: str, stream: bool) -> str:
    async def handler(request: web.Request) -> web.StreamResponse:
        if stream:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(anthropic_sse() if kind == "anthropic" else openai_sse())
            return resp
        if kind == "anthropic":
            return web.json_response({"type": "message", "model": "claude-sonnet-4-5",
                                      "stop_reason": "end_turn", "usage": ANTHROPIC_USAGE,
                                      "content": [{"type": "text", "text": "ok"}]})
        return web.json_response({"model": "gpt-4.1-mini", "usage": OPENAI_USAGE,
                                  "choices": [{"message": {"content": "ok"},
                                               "finish_reason": "stop"}]})

    url = await web_server(handler)
    return url if kind == "anthropic" else url + "/v1"


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_anthropic_cache_reads_and_writes_are_kept_apart_and_priced(
        web_server: Serve, make_provider, make_request, stream: bool) -> None:
    p = make_provider("anthropic", await serve_usage(web_server, "anthropic", stream),
                      stream=stream)
    reply = await p.complete(make_request([Message(role="user", content="x")]))
    assert reply.usage == Usage(10_050, 200, cache_read_tokens=9000, cache_write_tokens=1000)
    # Priced with the shipped table's Sonnet prices: 3 in, 15 out, 0.30 read, 3.75 write.
    prices = prices_in_force(ProviderConfig(name="a", kind="anthropic",
                                            model="claude-sonnet-4-5-20250929"))
    u = reply.usage
    cost = cost_usd(u.input_tokens, u.output_tokens,
                    price_input_per_mtok=prices.price_input_per_mtok,
                    price_output_per_mtok=prices.price_output_per_mtok,
                    cache_read_tokens=u.cache_read_tokens,
                    cache_write_tokens=u.cache_write_tokens,
                    price_cache_read_per_mtok=prices.price_cache_read_per_mtok,
                    price_cache_write_per_mtok=prices.price_cache_write_per_mtok)
    assert cost == pytest.approx((50 * 3.0 + 9000 * 0.3 + 1000 * 3.75 + 200 * 15.0) / 1e6)
    full = cost_usd(u.input_tokens, u.output_tokens, price_input_per_mtok=3.0,
                    price_output_per_mtok=15.0)
    assert cost < full


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
async def test_openai_cached_tokens_are_a_cache_read_and_priced_as_one(
        web_server: Serve, make_provider, make_request, stream: bool) -> None:
    p = make_provider("openai", await serve_usage(web_server, "openai", stream),
                      stream=stream)
    reply = await p.complete(make_request([Message(role="user", content="x")]))
    assert reply.usage == Usage(10_000, 200, cache_read_tokens=8_192)
    prices = prices_in_force(ProviderConfig(name="o", kind="openai", model="gpt-4.1-mini"))
    u = reply.usage
    cost = cost_usd(u.input_tokens, u.output_tokens,
                    price_input_per_mtok=prices.price_input_per_mtok,
                    price_output_per_mtok=prices.price_output_per_mtok,
                    cache_read_tokens=u.cache_read_tokens,
                    price_cache_read_per_mtok=prices.price_cache_read_per_mtok,
                    price_cache_write_per_mtok=prices.price_cache_write_per_mtok)
    assert cost == pytest.approx((1808 * 0.4 + 8192 * 0.1 + 200 * 1.6) / 1e6)


def test_an_empty_latest_message_carries_no_mark() -> None:
    from turnkeeper.providers.anthropic import encode_messages, mark_cache
    _, messages = encode_messages("", [Message(role="user", content="")])
    mark_cache(messages)
    assert messages == [{"role": "user", "content": ""}]
    _, messages = encode_messages("", [
        Message(role="assistant", content="a", tool_calls=(ToolCall("t", "f", "{}"),))])
    mark_cache(messages)
    assert messages[-1]["content"][-1]["cache_control"] == EPHEMERAL
