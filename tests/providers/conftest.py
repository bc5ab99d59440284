"""Fixtures for the provider adapters: real servers on 127.0.0.1 only.

- `llmock` (from llmock's own pytest plugin): one LLMock server per session, reset before
  each test; `llmock.base_url("openai")` is ".../v1", `llmock.base_url("anthropic")` is
  ".../anthropic" (the adapter appends /v1/messages).
- `web_server`: a tiny aiohttp.web server of our own, for exact bytes and headers.
- `make_provider`: builds an adapter from a ProviderConfig and closes it after the test.
  Its providers have `cache = "off"` unless a test passes `cache="auto"`, so the tests of
  the wire encoding pin the plain shapes and the cache tests pin the marks.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web

from turnkeeper.config import ProviderConfig
from turnkeeper.providers.anthropic import AnthropicProvider
from turnkeeper.providers.base import Message, ModelReply, ModelRequest, ToolSpec
from turnkeeper.providers.openai import OpenAIProvider

SECRET = "sk-test-SECRET-never-shown-0123456789"
KEY_ENV = "TURNKEEPER_TEST_PROVIDER_KEY"

WEATHER = ToolSpec(
    name="get_weather",
    description="Get the current weather for a city",
    parameters={"type": "object", "properties": {"city": {"type": "string"}},
                "required": ["city"]},
)

Provider = OpenAIProvider | AnthropicProvider
MakeProvider = Callable[..., Provider]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def api_key(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv(KEY_ENV, SECRET)
    return SECRET


@pytest.fixture
def weather_tool() -> ToolSpec:
    return WEATHER


@pytest.fixture
def make_request() -> Callable[..., ModelRequest]:
    """`make_request(messages, tools=(WEATHER,), timeout_s=5.0, ...)`."""

    def build(messages: list[Message], *, tools: tuple[ToolSpec, ...] = (WEATHER,),
              timeout_s: float = 5.0, system: str = "You are terse.",
              max_output_tokens: int = 256) -> ModelRequest:
        return ModelRequest(system=system, messages=messages, tools=tools,
                            max_output_tokens=max_output_tokens, timeout_s=timeout_s)

    return build


@pytest.fixture
async def make_provider(api_key: str) -> AsyncIterator[MakeProvider]:
    made: list[Provider] = []

    def make(kind: str, base_url: str, *, stream: bool = True, with_key: bool = True,
             **extra: Any) -> Provider:
        extra.setdefault("cache", "off")
        cfg = ProviderConfig(name=f"test-{kind}", kind=kind,  # type: ignore[arg-type]
                             base_url=base_url, model="test-model", stream=stream,
                             api_key_env=KEY_ENV if with_key else "", **extra)
        p: Provider = OpenAIProvider(cfg) if kind == "openai" else AnthropicProvider(cfg)
        made.append(p)
        return p

    yield make
    for p in made:
        await p.aclose()


@pytest.fixture
def complete_streaming() -> Callable[[Provider, ModelRequest],
                                     Awaitable[tuple[ModelReply, list[str]]]]:
    """`reply, deltas = await complete_streaming(provider, request)`: the reply and the
    pieces of text the provider handed on while it read the stream."""
    async def complete(provider: Provider, request: ModelRequest
                       ) -> tuple[ModelReply, list[str]]:
        deltas: list[str] = []

        async def on_delta(text: str) -> None:
            deltas.append(text)

        return await provider.complete(request, on_delta), deltas

    return complete


@pytest.fixture
async def web_server() -> AsyncIterator[Callable[[Handler], Awaitable[str]]]:
    """`url = await web_server(handler)`: every POST goes to `handler`; the root URL is
    returned (http://127.0.0.1:<port>)."""
    runners: list[web.AppRunner] = []

    async def start(handler: Handler) -> str:
        app = web.Application()
        app.router.add_route("POST", "/{tail:.*}", handler)
        runner = web.AppRunner(app, shutdown_timeout=0.5)
        await runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        site = web.SockSite(runner, sock)
        await site.start()
        runners.append(runner)
        return f"http://127.0.0.1:{sock.getsockname()[1]}"

    yield start
    for r in runners:
        await r.cleanup()
