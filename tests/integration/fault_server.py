"""A tiny OpenAI-compatible model server on 127.0.0.1 whose answers are scripted per
provider, for the tests (and benchmarks) that need exact control of the faults.

Each provider of a daemon's chain gets its own path prefix on one server
(`server.base_url("primary")` is `http://127.0.0.1:PORT/primary/v1`), so one server plays
a whole chain. What a provider answers is a queue of `Answer`s, consumed one a request,
then a default (`then`) that answers forever:

    server.script("primary", fail(503), fail(429, retry_after="0.3"), then=ok("hi"))
    server.script("fallback", then=fail(503))          # a persistent outage

Every request is recorded with its arrival and end time (`time.monotonic()`, the same
clock as the daemon's on this machine), its status and its JSON body: the tests count
attempts and measure waits here, at the server, not from the daemon's own account.

The server runs its own event loop in a thread, so synchronous tests drive it while the
daemon (a subprocess) talks to it.

It answers Anthropic's Messages path too (`server.anthropic_url("primary")` as the
provider's base_url: `/primary/v1/messages`), OpenAI's Responses path
(`/primary/v1/responses`) and Gemini's (`server.gemini_url("primary")`), for `replay`ed
answers: a vendor's reply as recorded, byte for byte, whole or in small pieces. On
Anthropic's path it checks the two rules of Anthropic's extended thinking that a request
can break, and answers 400 as Anthropic does when one is broken.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from aiohttp import web


@dataclass(frozen=True)
class Answer:
    """One scripted answer. `status` 200 is a completion (JSON, or SSE when the request
    asked to stream); anything else is an error body with the given headers. `delay`
    holds the answer that long first. `break_after` (streams only) sends that many text
    chunks and then drops the connection; `stream_error` (streams only) sends the text,
    then an error event of that type inside the HTTP 200 stream. `tool_steps` makes an
    agent: while the conversation holds fewer than that many tool results, the answer is
    a call of the `echo` tool (its text padded with `pad` characters, so the conversation
    grows by that much twice a step: the call and the tool's echo); then the text.
    `trickle` (streams only) sends one word every that many seconds, forever;
    `keepalive` sends only SSE comments and empty events, every that many seconds,
    forever: streams a per-read timeout never ends.

    The usage reported counts the request's message text at four characters a token
    (plus one) and the answer's text likewise, or `output_tokens` (a model that writes
    that many tokens); the completion never counts more than the output cap the request
    asked for, as a provider stops there. `usage` replaces the whole usage object, as
    sent (a broken counter)."""

    status: int = 200
    text: str = "ok"
    tool_calls: tuple[tuple[str, dict[str, Any]], ...] = ()
    headers: tuple[tuple[str, str], ...] = ()
    error_type: str | None = None
    message: str = "injected failure"
    delay: float = 0.0
    break_after: int | None = None
    stream_error: str | None = None
    tool_steps: int = 0
    # A recorded reply sent as it is: a JSON body (with `status`, an error's), or the
    # text of an event stream, sent `piece` bytes at a time (0: at once) and cut (the
    # connection dropped) after `cut_at` bytes.
    raw_json: dict[str, Any] | list[Any] | None = None
    raw_sse: str | None = None
    trickle: float | None = None
    keepalive: float | None = None
    pad: int = 0
    output_tokens: int | None = None
    usage: dict[str, Any] | None = None
    piece: int = 0
    cut_at: int | None = None


def ok(text: str = "ok", *, tool_calls: tuple[tuple[str, dict[str, Any]], ...] = (),
       delay: float = 0.0, tool_steps: int = 0, pad: int = 0,
       output_tokens: int | None = None, usage: dict[str, Any] | None = None) -> Answer:
    return Answer(text=text, tool_calls=tool_calls, delay=delay, tool_steps=tool_steps,
                  pad=pad, output_tokens=output_tokens, usage=usage)


def fail(status: int, *, retry_after: str | None = None, retry_after_ms: str | None = None,
         error_type: str | None = None, message: str = "injected failure",
         delay: float = 0.0) -> Answer:
    headers: list[tuple[str, str]] = []
    if retry_after is not None:
        headers.append(("Retry-After", retry_after))
    if retry_after_ms is not None:
        headers.append(("retry-after-ms", retry_after_ms))
    return Answer(status=status, headers=tuple(headers), error_type=error_type,
                  message=message, delay=delay)


def replay(recorded: dict[str, Any] | str, *, piece: int = 0, cut_at: int | None = None,
           status: int = 200) -> Answer:
    """A vendor's recorded reply, sent as it is: a JSON body (a dict; with `status`, an
    error's) or an event stream's text (a str), `piece` bytes a write and dropped after
    `cut_at` bytes when given."""
    if isinstance(recorded, str):
        return Answer(raw_sse=recorded, piece=piece, cut_at=cut_at)
    return Answer(status=status, raw_json=recorded)


def broken_stream(after_chunks: int, text: str = "partial answer that never ends") -> Answer:
    return Answer(text=text, break_after=after_chunks)


def stream_error(error_type: str, text: str = "a start") -> Answer:
    return Answer(text=text, stream_error=error_type)


def trickle(every: float = 0.2) -> Answer:
    """A stream that sends one token every `every` seconds and never finishes."""
    return Answer(trickle=every)


def keepalive(every: float = 0.2) -> Answer:
    """A stream that sends nothing but keepalives (comments, empty events), forever."""
    return Answer(keepalive=every)


def redirect(location: str, status: int = 307) -> Answer:
    """A redirect to `location` (a 307 keeps the method and the body)."""
    return Answer(status=status, headers=(("Location", location),), message="moved")


@dataclass(frozen=True)
class Seen:
    """One request as the server saw it."""

    provider: str
    started: float
    ended: float
    status: int
    body: dict[str, Any]
    path: str = ""  # with its query
    headers: dict[str, str] = field(default_factory=dict)

    def user_texts(self) -> list[str]:
        return [str(m.get("content")) for m in self.body.get("messages", ())
                if m.get("role") == "user"]


@dataclass
class _Provider:
    queue: deque[Answer] = field(default_factory=deque)
    then: Answer = field(default_factory=ok)


class FaultServer:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._providers: dict[str, _Provider] = {}
        self._seen: list[Seen] = []
        self._arrived: dict[str, int] = {}
        self._in_flight = 0
        self.max_in_flight = 0
        # A provider with a capacity admits that many requests at once and answers 429
        # (with Retry-After) to any request above it, as a provider's concurrency limit.
        self._capacity: dict[str, tuple[int, str]] = {}
        self._busy: dict[str, int] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopped: asyncio.Event | None = None
        self.port = 0

    # -- scripting ---------------------------------------------------------------------

    def script(self, provider: str, *answers: Answer, then: Answer | None = None
               ) -> FaultServer:
        """Replace what `provider` answers: `answers` in order, then `then` forever (a
        plain "ok" by default)."""
        with self._lock:
            self._providers[provider] = _Provider(queue=deque(answers),
                                                  then=then if then is not None else ok())
        return self

    def capacity(self, provider: str, n: int | None, *, retry_after: str = "1"
                 ) -> FaultServer:
        """`provider` admits `n` requests at once; one more is answered 429 with this
        Retry-After, at once. None: no limit."""
        with self._lock:
            if n is None:
                self._capacity.pop(provider, None)
            else:
                self._capacity[provider] = (n, retry_after)
        return self

    def base_url(self, provider: str) -> str:
        return f"http://127.0.0.1:{self.port}/{provider}/v1"

    def gemini_url(self, provider: str) -> str:
        """The base_url of a gemini provider (its adapter appends /models/...)."""
        return f"http://127.0.0.1:{self.port}/{provider}/v1beta"

    def anthropic_url(self, provider: str) -> str:
        """The base_url of an anthropic provider (its adapter appends /v1/messages)."""
        return f"http://127.0.0.1:{self.port}/{provider}"

    def requests(self, provider: str | None = None) -> list[Seen]:
        with self._lock:
            return [s for s in self._seen if provider is None or s.provider == provider]

    def count(self, provider: str) -> int:
        """Requests `provider` has answered (or dropped)."""
        return len(self.requests(provider))

    def arrived(self, provider: str) -> int:
        """Requests that reached `provider`, answered or still being held."""
        with self._lock:
            return self._arrived.get(provider, 0)

    def clear(self) -> None:
        with self._lock:
            self._seen.clear()
            self._arrived.clear()
            self.max_in_flight = 0

    def wait_for(self, provider: str, n: int, timeout: float = 10.0) -> list[Seen]:
        """Block until `provider` has seen at least `n` requests."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            seen = self.requests(provider)
            if len(seen) >= n:
                return seen
            time.sleep(0.01)
        raise AssertionError(f"{provider} saw {self.count(provider)} requests, not {n}, "
                             f"in {timeout} s")

    # -- serving -----------------------------------------------------------------------

    def _next(self, provider: str) -> Answer:
        with self._lock:
            p = self._providers.setdefault(provider, _Provider())
            return p.queue.popleft() if p.queue else p.then

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        started = time.monotonic()
        provider = request.match_info["provider"]
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError:
            body = {}
        refused = (anthropic_thinking_error(body)
                   if request.path.endswith("/v1/messages") else None)
        answer = (fail(400, error_type="invalid_request_error", message=refused)
                  if refused is not None else self._next(provider))
        if answer.status == 200 and answer.tool_steps:
            done = sum(1 for m in body.get("messages", ()) if m.get("role") == "tool")
            if done < answer.tool_steps:
                text = f"step {done + 1} " + "x" * answer.pad
                answer = replace(answer, text="", tool_calls=(("echo", {"text": text}),))
        with self._lock:
            self._arrived[provider] = self._arrived.get(provider, 0) + 1
            self._in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self._in_flight)
            cap = self._capacity.get(provider)
            admitted = cap is None or self._busy.get(provider, 0) < cap[0]
            if admitted:
                self._busy[provider] = self._busy.get(provider, 0) + 1
            else:
                assert cap is not None
                answer = fail(429, retry_after=cap[1])
        status = answer.status
        try:
            if answer.delay:
                await asyncio.sleep(answer.delay)
            if status != 200 and answer.raw_json is not None:
                resp: web.StreamResponse = web.json_response(
                    answer.raw_json, status=status, headers=dict(answer.headers))
            elif status != 200:
                resp = web.json_response(
                    {"error": {"type": answer.error_type or f"http_{status}",
                               "message": answer.message}},
                    status=status, headers=dict(answer.headers))
            elif answer.raw_sse is not None and (answer.piece or answer.cut_at is not None):
                resp = await _pieces(request, answer)
            elif answer.raw_sse is not None:
                resp = web.Response(body=answer.raw_sse.encode(),
                                    content_type="text/event-stream")
            elif answer.raw_json is not None:
                resp = web.json_response(answer.raw_json)
            elif body.get("stream") or request.path.endswith(":streamGenerateContent"):
                resp = await self._stream(request, body, answer)
            else:
                resp = web.json_response(_completion(body, answer))
            return resp
        finally:
            with self._lock:
                self._in_flight -= 1
                if admitted:
                    self._busy[provider] -= 1
                self._seen.append(Seen(provider, started, time.monotonic(), status, body,
                                       request.path_qs, dict(request.headers)))

    async def _stream(self, request: web.Request, body: dict[str, Any], answer: Answer
                      ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        if answer.trickle is not None or answer.keepalive is not None:
            return await self._endless(resp, answer)
        split = answer.text.split(" ")
        words = [w + " " for w in split[:-1]] + split[-1:]
        for i, word in enumerate(words):
            if answer.break_after is not None and i >= answer.break_after:
                await asyncio.sleep(0.02)  # let the chunks reach the client first
                assert request.transport is not None
                request.transport.abort()
                return resp
            await resp.write(_sse({"choices": [{"index": 0, "delta": {"content": word},
                                                "finish_reason": None}]}))
        if answer.stream_error is not None:
            await resp.write(_sse({"error": {"type": answer.stream_error,
                                             "message": answer.message}}))
            await resp.write_eof()
            return resp
        for i, (name, args) in enumerate(answer.tool_calls):
            await resp.write(_sse({"choices": [{"index": 0, "delta": {"tool_calls": [
                {"index": i, "id": f"call_{i}", "type": "function",
                 "function": {"name": name, "arguments": json.dumps(args)}}]},
                "finish_reason": None}]}))
        finish = "tool_calls" if answer.tool_calls else "stop"
        await resp.write(_sse({"choices": [{"index": 0, "delta": {}, "finish_reason": finish}],
                               "usage": _usage(body, answer)}))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _endless(self, resp: web.StreamResponse, answer: Answer) -> web.StreamResponse:
        """Keep the stream alive until the client goes away."""
        n = 0
        with contextlib.suppress(ConnectionError):
            while True:
                n += 1
                if answer.trickle is not None:
                    await resp.write(_sse({"choices": [{"index": 0, "delta": {
                        "content": f"w{n} "}, "finish_reason": None}]}))
                    await asyncio.sleep(answer.trickle)
                else:
                    assert answer.keepalive is not None
                    await resp.write(b": keepalive\n\n" if n % 2 else b"data:\n\n")
                    await asyncio.sleep(answer.keepalive)
        return resp

    def start(self) -> FaultServer:
        ready = threading.Event()
        errors: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(self._serve(ready))
            except BaseException as exc:  # pragma: no cover - reported to start()
                errors.append(exc)
                ready.set()
            finally:
                loop.close()

        self._thread = threading.Thread(target=run, name="fault-server", daemon=True)
        self._thread.start()
        ready.wait(10)
        if errors:
            raise errors[0]
        return self

    async def _serve(self, ready: threading.Event) -> None:
        app = web.Application()
        app.router.add_post("/{provider}/v1/chat/completions", self._handle)
        app.router.add_post("/{provider}/v1/messages", self._handle)
        app.router.add_post("/{provider}/v1/responses", self._handle)
        # Gemini: /{provider}/v1beta/models/{model}:generateContent (or
        # :streamGenerateContent?alt=sse)
        app.router.add_post("/{provider}/v1beta/models/{call}", self._handle)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.2)
        await runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        site = web.SockSite(runner, sock, backlog=4096)
        await site.start()
        self.port = sock.getsockname()[1]
        self._stopped = asyncio.Event()
        ready.set()
        try:
            await self._stopped.wait()
        finally:
            await runner.cleanup()

    def stop(self) -> None:
        if self._loop is not None and self._stopped is not None:
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._stopped.set)
        if self._thread is not None:
            self._thread.join(5)


async def _pieces(request: web.Request, answer: Answer) -> web.StreamResponse:
    """A recorded stream written `piece` bytes at a time (split anywhere: inside an
    event, a line, a UTF-8 character), the connection dropped after `cut_at` bytes."""
    assert answer.raw_sse is not None
    data = answer.raw_sse.encode()
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    end = len(data) if answer.cut_at is None else answer.cut_at
    step = answer.piece or end or 1
    for at in range(0, end, step):
        await resp.write(data[at:min(at + step, end)])
    if answer.cut_at is not None:
        await asyncio.sleep(0.02)  # let the bytes reach the client first
        assert request.transport is not None
        request.transport.abort()
        return resp
    await resp.write_eof()
    return resp


def anthropic_thinking_error(body: dict[str, Any]) -> str | None:
    """What Anthropic answers (400) to a request with extended thinking on that breaks
    one of its rules: an output cap not above the thinking budget, or a tool-use
    continuation whose assistant message does not start with its thinking block."""
    thinking = body.get("thinking")
    if not isinstance(thinking, dict) or thinking.get("type") != "enabled":
        return None
    budget = int(thinking.get("budget_tokens") or 0)
    if int(body.get("max_tokens") or 0) <= budget:
        return "`max_tokens` must be greater than `thinking.budget_tokens`"
    messages = body.get("messages") or []
    for i, m in enumerate(messages):
        content = m.get("content")
        if m.get("role") != "assistant" or not isinstance(content, list) or not content:
            continue
        uses_tools = any(b.get("type") == "tool_use" for b in content)
        last_with_tools = not any(
            n.get("role") == "assistant" for n in messages[i + 1:])
        if uses_tools and last_with_tools and content[0].get("type") not in (
                "thinking", "redacted_thinking"):
            return (f"messages.{i}.content.0.type: Expected `thinking` or "
                    f"`redacted_thinking`, but found `{content[0].get('type')}`. When "
                    "`thinking` is enabled, a final `assistant` message must start with a "
                    "thinking block")
    return None


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _usage(body: dict[str, Any], answer: Answer) -> dict[str, Any]:
    if answer.usage is not None:
        return answer.usage
    prompt = sum(len(str(m.get("content") or "")) for m in body.get("messages", ())) // 4 + 1
    completion = (len(answer.text) // 4 + 1 if answer.output_tokens is None
                  else answer.output_tokens)
    cap = body.get("max_tokens") or body.get("max_completion_tokens")
    if isinstance(cap, int):
        completion = min(completion, cap)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def _completion(body: dict[str, Any], answer: Answer) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": answer.text}
    if answer.tool_calls:
        message["tool_calls"] = [
            {"id": f"call_{i}", "type": "function",
             "function": {"name": name, "arguments": json.dumps(args)}}
            for i, (name, args) in enumerate(answer.tool_calls)]
    return {"id": "chatcmpl-fault", "object": "chat.completion", "created": 1,
            "model": body.get("model", ""),
            "choices": [{"index": 0, "message": message,
                         "finish_reason": "tool_calls" if answer.tool_calls else "stop"}],
            "usage": _usage(body, answer)}


@contextlib.contextmanager
def running() -> Iterator[FaultServer]:
    server = FaultServer().start()
    try:
        yield server
    finally:
        server.stop()
