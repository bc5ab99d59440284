"""What a provider's server cannot make the adapters do: hold a stream open with keepalives
alone, or send the request (its key, its conversation) to another host by a redirect.
Real servers on 127.0.0.1."""

from __future__ import annotations

import json
from typing import Any

import anyio
import pytest
from aiohttp import web
from tests.providers.conftest import SECRET
from tests.providers.test_openai import Serve, chunk, failure_of, sse

from turnkeeper.messages import Message
from turnkeeper.policy.classify import FailureClass, classify

pytestmark = pytest.mark.anyio

HI = [Message(role="user", content="hi")]


def anthropic_event(obj: dict[str, Any]) -> bytes:
    return (f"event: {obj['type']}\n".encode() + b"data: " + json.dumps(obj).encode()
            + b"\n\n")


async def test_an_openai_stream_of_keepalives_only_fails_after_idle_timeout(
        web_server: Serve, make_provider: Any, make_request: Any) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        # Comments and empty events, every 0.05 s: the per-read timeout never fires.
        return await sse(request, [chunk({"role": "assistant", "content": ""})]
                         + [b": keepalive\n\n", b"data:\n\n"] * 400, pause=0.05)

    p = make_provider("openai", await web_server(handler) + "/v1", idle_timeout=0.5)
    f = await failure_of(p.complete(make_request(HI, timeout_s=5.0)))
    assert f.exception == ("IdleStream", "TimeoutError")
    assert "idle_timeout = 0.5 s" in f.describe()
    assert classify(f) is FailureClass.RETRYABLE


async def test_an_anthropic_stream_of_pings_only_fails_after_idle_timeout(
        web_server: Serve, make_provider: Any, make_request: Any) -> None:
    start = {"type": "message_start", "message": {"model": "m", "usage": {
        "input_tokens": 3, "output_tokens": 0}}}

    async def handler(request: web.Request) -> web.StreamResponse:
        return await sse(request, [anthropic_event(start)]
                         + [anthropic_event({"type": "ping"})] * 400, pause=0.05)

    p = make_provider("anthropic", await web_server(handler), idle_timeout=0.5)
    f = await failure_of(p.complete(make_request(HI, timeout_s=5.0)))
    assert f.exception == ("IdleStream", "TimeoutError")


async def test_a_stream_that_keeps_making_progress_is_not_idle(
        web_server: Serve, make_provider: Any, make_request: Any) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        # 1.2 s in all, a word every 0.1 s: never idle for its 0.4 s.
        words = [chunk({"content": f"w{i} "}) for i in range(12)]
        return await sse(request, [*words, chunk({}, "stop"), b"data: [DONE]\n\n"],
                         pause=0.1)

    p = make_provider("openai", await web_server(handler) + "/v1", idle_timeout=0.4)
    reply = await p.complete(make_request(HI, timeout_s=5.0))
    assert reply.text is not None and reply.text.startswith("w0 w1") and "w11" in reply.text


async def test_a_redirect_is_never_followed_and_fails_deterministically_naming_it(
        web_server: Serve, make_provider: Any, make_request: Any) -> None:
    seen: list[dict[str, str]] = []

    async def elsewhere(request: web.Request) -> web.StreamResponse:
        seen.append(dict(request.headers))
        return await sse(request, [chunk({"content": "stolen"}, "stop"),
                                   b"data: [DONE]\n\n"])

    other = await web_server(elsewhere)
    target = f"{other}/v1/chat/completions"

    async def moved(request: web.Request) -> web.StreamResponse:
        await request.read()
        return web.Response(status=307, headers={"Location": target})

    for kind, base in (("openai", "/v1"), ("anthropic", "")):
        p = make_provider(kind, await web_server(moved) + base)
        f = await failure_of(p.complete(make_request(HI)))
        assert f.status == 307 and f.exception == ("RedirectNotFollowed",)
        assert classify(f) is FailureClass.DETERMINISTIC
        assert target in f.describe()
        assert SECRET not in f.describe()
    await anyio.sleep(0.05)
    assert seen == []  # the other host never saw the request, nor the key
