"""An http tool's attempt against a real server on 127.0.0.1: what is known of the effect
(ok, failed, unknown) and the answers the daemon refuses to take."""

from __future__ import annotations

import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import pytest
from aiohttp import web

from turnkeeper.config import ToolConfig
from turnkeeper.policy.classify import FailureClass, classify
from turnkeeper.policy.effects import EffectOutcome
from turnkeeper.tools.outcome import ToolOutcome
from turnkeeper.tools.registry import ToolBox

pytestmark = pytest.mark.anyio

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[dict[str, Handler]], Awaitable[str]]]:
    """`base = await serve({"/path": handler})`: a server on 127.0.0.1, any method."""
    runners: list[web.AppRunner] = []

    async def start(routes: dict[str, Handler]) -> str:
        app = web.Application()
        for path, handler in routes.items():
            app.router.add_route("*", path, handler)
        runner = web.AppRunner(app, shutdown_timeout=0.2)
        await runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        await web.SockSite(runner, sock).start()
        runners.append(runner)
        return f"http://127.0.0.1:{sock.getsockname()[1]}"

    yield start
    for r in runners:
        await r.cleanup()


async def call(url: str, *, timeout_s: float = 5.0, **cfg: Any) -> ToolOutcome:
    tool = ToolConfig(name="create_ticket", url=url, **cfg)
    box = ToolBox((tool,))
    try:
        return await box.call("create_ticket", {"title": "x"}, idempotency_key="t.1.0",
                              timeout_s=timeout_s)
    finally:
        await box.aclose()


def json_reply(body: Any, status: int = 200) -> Handler:
    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        return web.json_response(body, status=status)
    return handler


async def test_an_answer_is_ok_and_the_outcome_says_so(serve: Any) -> None:
    base = await serve({"/t": json_reply({"id": 7})})
    outcome = await call(base + "/t")
    assert outcome.kind is EffectOutcome.OK and outcome.content == '{"id": 7}'


async def test_timeout_after_send_of_a_non_idempotent_call_is_unknown(serve: Any) -> None:
    seen: list[str] = []

    async def slow(request: web.Request) -> web.StreamResponse:
        seen.append(request.headers["Idempotency-Key"])
        await anyio.sleep(0.6)
        return web.json_response({"id": 1})

    base = await serve({"/t": slow})
    outcome = await call(base + "/t", timeout_s=0.2)
    assert seen == ["t.1.0"]
    assert outcome.kind is EffectOutcome.UNKNOWN
    assert outcome.failure is not None and "TimeoutError" in outcome.failure.exception


async def test_timeout_of_an_idempotent_call_is_a_plain_failure(serve: Any) -> None:
    async def slow(request: web.Request) -> web.StreamResponse:
        await anyio.sleep(0.6)
        return web.json_response({"id": 1})

    base = await serve({"/t": slow})
    outcome = await call(base + "/t", timeout_s=0.2, idempotent=True)
    assert outcome.kind is EffectOutcome.FAILED


@pytest.mark.parametrize("status", [408, 500, 502, 503, 504])
async def test_a_gateway_status_to_a_non_idempotent_call_is_an_unknown_outcome(
        serve: Any, status: int) -> None:
    """The gateway answered; the server behind it may have done the work."""
    base = await serve({"/t": json_reply({"error": "upstream timed out"}, status)})
    outcome = await call(base + "/t")
    assert outcome.kind is EffectOutcome.UNKNOWN
    assert outcome.failure is not None and outcome.failure.status == status
    assert (await call(base + "/t", idempotent=True)).kind is EffectOutcome.FAILED


@pytest.mark.parametrize("status", [501, 400, 409, 422, 429])
async def test_a_status_that_says_what_happened_is_a_failure(serve: Any, status: int
                                                              ) -> None:
    base = await serve({"/t": json_reply({"error": "no"}, status)})
    assert (await call(base + "/t")).kind is EffectOutcome.FAILED


async def test_refused_connection_is_failed_retryable_not_unknown() -> None:
    outcome = await call("http://127.0.0.1:1/t")
    assert outcome.kind is EffectOutcome.FAILED
    assert outcome.failure is not None
    assert classify(outcome.failure) is FailureClass.RETRYABLE


@pytest.mark.parametrize(("field", "body"), [
    ("", {"error": "quota exceeded"}),
    ("/result/error", {"result": {"error": "quota exceeded"}}),
])
async def test_an_error_in_a_2xx_body_is_a_failure_of_class_unknown(
        serve: Any, field: str, body: Any) -> None:
    base = await serve({"/t": json_reply(body)})
    outcome = await call(base + "/t", error_field=field)
    assert outcome.kind is EffectOutcome.FAILED
    assert outcome.failure is not None
    assert classify(outcome.failure) is FailureClass.UNKNOWN
    assert "quota exceeded" in outcome.failure.describe()


async def test_a_null_error_or_one_elsewhere_is_ok(serve: Any) -> None:
    base = await serve({"/t": json_reply({"error": None, "other": {"error": "x"}})})
    assert (await call(base + "/t")).kind is EffectOutcome.OK


async def test_a_redirect_is_not_followed_by_default(serve: Any) -> None:
    hits: list[str] = []

    async def moved(request: web.Request) -> web.StreamResponse:
        raise web.HTTPTemporaryRedirect(location="/elsewhere")

    async def elsewhere(request: web.Request) -> web.StreamResponse:
        hits.append(request.method)
        return web.json_response({})

    base = await serve({"/t": moved, "/elsewhere": elsewhere})
    outcome = await call(base + "/t")
    assert hits == []
    assert outcome.failure is not None
    assert classify(outcome.failure) is FailureClass.DETERMINISTIC
    assert "not followed" in outcome.failure.describe()


async def test_a_followed_redirect_keeps_to_the_allowed_hosts(serve: Any) -> None:
    async def same_host(request: web.Request) -> web.StreamResponse:
        raise web.HTTPTemporaryRedirect(location="/done")

    async def off_host(request: web.Request) -> web.StreamResponse:
        raise web.HTTPTemporaryRedirect(location="http://localhost:1/x")

    base = await serve({"/t": same_host, "/done": json_reply({"id": 2}), "/off": off_host})
    assert (await call(base + "/t", follow_redirects=True)).content == '{"id": 2}'
    outcome = await call(base + "/off", follow_redirects=True)
    assert outcome.failure is not None
    assert outcome.failure.exception == ("HostNotAllowed",)
    assert classify(outcome.failure) is FailureClass.DETERMINISTIC


async def test_a_host_not_allowed_is_never_contacted(serve: Any) -> None:
    hits: list[str] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        hits.append(request.path)
        return web.json_response({})

    base = await serve({"/t": handler})
    outcome = await call(base + "/t", allowed_hosts=("tickets.example",))
    assert hits == []
    assert outcome.failure is not None and "allowed_hosts" in outcome.failure.describe()


@pytest.mark.parametrize("chunked", [False, True])
async def test_an_oversize_body_is_refused(serve: Any, chunked: bool) -> None:
    async def big(request: web.Request) -> web.StreamResponse:
        if not chunked:
            return web.Response(body=b"x" * 5000)
        resp = web.StreamResponse()
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        for _ in range(10):
            await resp.write(b"y" * 1000)
        await resp.write_eof()
        return resp

    base = await serve({"/t": big})
    outcome = await call(base + "/t", max_response_bytes=1024)
    assert outcome.failure is not None
    assert outcome.failure.exception == ("ResponseTooLarge",)
    assert classify(outcome.failure) is FailureClass.DETERMINISTIC


def test_journal_json_keeps_the_kind_and_old_rows_still_load() -> None:
    from turnkeeper.policy.classify import CallFailure
    unknown = ToolOutcome(content="", failure=CallFailure(exception=("TimeoutError",)),
                          unknown=True)
    assert ToolOutcome.from_json(unknown.to_json()) == unknown
    old = {"content": "", "state": None,
           "failure": {"status": 503, "exception": [], "message": "down"}}
    assert ToolOutcome.from_json(old).kind is EffectOutcome.FAILED
    assert ToolOutcome.from_json({"content": "{}"}).kind is EffectOutcome.OK


async def test_a_secret_the_tool_echoes_is_redacted_from_its_result(
        serve: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its own Authorization value (from the environment), the token alone, and a
    provider's key the ToolBox was given: none comes back in content or failure."""
    monkeypatch.setenv("TICKET_AUTH", "Bearer tk-0123456789abcdef")

    async def echo(request: web.Request) -> web.StreamResponse:
        await request.read()
        return web.json_response({"auth": request.headers["Authorization"],
                                  "token": "tk-0123456789abcdef", "key": "sk-provider-key-1",
                                  "short": "x"}, status=int(request.query.get("s", 200)))

    base = await serve({"/t": echo})
    tool = ToolConfig(name="create_ticket", url=base + "/t",
                      headers={"Authorization": "env:TICKET_AUTH"})
    box = ToolBox((tool,), secrets=("sk-provider-key-1", "x"))
    try:
        ok = await box.call("create_ticket", {}, idempotency_key="t.1.0", timeout_s=5)
        box_failed = ToolBox((tool.model_copy(update={"url": base + "/t?s=400"}),),
                             secrets=("sk-provider-key-1",))
        failed = await box_failed.call("create_ticket", {}, idempotency_key="t.1.1",
                                       timeout_s=5)
        await box_failed.aclose()
    finally:
        await box.aclose()
    assert ok.kind is EffectOutcome.OK
    assert json.loads(ok.content) == {"auth": "[redacted]", "token": "[redacted]",
                                      "key": "[redacted]", "short": "x"}
    assert failed.failure is not None
    for text in (failed.content, failed.failure.message):
        assert "0123456789abcdef" not in text and "sk-provider-key-1" not in text
