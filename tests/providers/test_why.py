"""Every failed provider attempt says why in one line, and never says a secret."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web

from turnkeeper.policy.classify import CallFailure, redact_secrets
from turnkeeper.providers.base import Message, ModelReply, ProviderError

pytestmark = pytest.mark.anyio

KINDS = ["openai", "anthropic"]


async def why(call: Awaitable[ModelReply], secret: str) -> str:
    with pytest.raises(ProviderError) as info:
        await call
    failure: CallFailure = info.value.failure
    line = failure.describe()
    assert "\n" not in line and secret not in line
    return line


@pytest.mark.parametrize("kind", KINDS)
async def test_a_refused_connection_names_the_exception_and_the_host(
        kind: str, api_key: str, make_provider: Any, make_request: Callable[..., Any]) -> None:
    p = make_provider(kind, "http://127.0.0.1:1/v1")
    line = await why(p.complete(make_request([Message(role="user", content="hi")])), api_key)
    assert line.startswith("ClientConnectorError: Cannot connect to host 127.0.0.1:1")


@pytest.mark.parametrize("kind", KINDS)
async def test_an_http_failure_gives_the_status_and_the_providers_own_message(
        kind: str, api_key: str, make_provider: Any, make_request: Callable[..., Any],
        web_server: Any) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        return web.json_response({"error": {"type": "invalid_request_error",
                                            "message": "model foo does not exist"}},
                                 status=404)

    base = await web_server(handler)
    p = make_provider(kind, base + "/v1", stream=False)
    line = await why(p.complete(make_request([Message(role="user", content="hi")])), api_key)
    assert line == "HTTP 404: invalid_request_error: model foo does not exist"


@pytest.mark.parametrize("kind", KINDS)
async def test_secrets_a_server_echoes_are_redacted(
        kind: str, api_key: str, make_provider: Any, make_request: Callable[..., Any],
        web_server: Any) -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        seen = request.headers.get("Authorization") or request.headers.get("x-api-key")
        return web.json_response({"error": {
            "type": "authentication_error",
            "message": f"bad key {seen}; Authorization: Bearer other-token-123; "
                       "see https://x.test/v1?key=AIzaSECRET&alt=json"}}, status=401)

    base = await web_server(handler)
    p = make_provider(kind, base + "/v1", stream=False)
    line = await why(p.complete(make_request([Message(role="user", content="hi")])), api_key)
    assert line.startswith("HTTP 401: authentication_error: bad key ")
    assert "other-token-123" not in line and "AIzaSECRET" not in line
    assert "key=[redacted]&alt=json" in line


@pytest.mark.parametrize(("text", "expected"), [
    ("Authorization: Bearer abc.def", "Authorization: Bearer [redacted]"),
    ("headers={'x-api-key': 'sk-1'}", "headers={'x-api-key': '[redacted]'}"),
    ("GET /v1/models?key=abc123&x=1", "GET /v1/models?key=[redacted]&x=1"),
    ("Cannot connect to host 127.0.0.1:1", "Cannot connect to host 127.0.0.1:1"),
])
def test_redact_secrets(text: str, expected: str) -> None:
    assert redact_secrets(text) == expected
