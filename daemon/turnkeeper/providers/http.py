"""What the HTTP adapters (OpenAI, OpenAI Responses, Anthropic, Gemini) share: one
aiohttp session, SSE framing, and the translation of everything that can go wrong on
the wire into one `CallFailure`. Reading an event stream is `providers/sse.py`'s.

Rules kept here so every adapter obeys them alike:

- one attempt per call: no library-level retries, no sleeping;
- every failure leaves as `ProviderError(CallFailure)`, never a bare exception and never a
  shortened answer; `CancelledError` is never caught;
- the API key (and any secret header or query value) never appears in a failure message:
  it is redacted from anything a server or an exception says;
- no redirect is followed: it would carry the key and the whole conversation to another
  host and take that host's answer as the model's. A 3xx answer is a deterministic
  failure naming where it pointed;
- a started stream that brings no progress for `idle_timeout`, whatever keepalives it
  sends, is cut (`IdleWatch`); the call's total bound is the turn's (`turn/model_call`);
- low CPU per call: the URL, headers and timeouts are built once and reused, JSON is
  parsed once, and SSE is split on bytes without a per-line coroutine.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import aiohttp
from yarl import URL

from turnkeeper import jsonwire
from turnkeeper.policy.classify import (
    CallFailure,
    Redactor,
    exception_names,
    is_context_overflow,
    local_exhaustion,
    parse_retry_after,
    redirect_refused,
    retry_after_of,
)
from turnkeeper.providers.base import DeltaSink, ModelReply, ModelRequest, ProviderError
from turnkeeper.providers.structured import answer_from_tool

# What a broken transport raises: aiohttp's own errors, timeouts (asyncio.TimeoutError is
# the builtin TimeoutError on 3.11) and socket errors.
TRANSPORT_ERRORS: tuple[type[BaseException], ...] = (aiohttp.ClientError, TimeoutError, OSError)

MESSAGE_LIMIT = 500
_ERROR_BODY_LIMIT = 64 * 1024

INCOMPLETE = ("IncompleteStream",)
CORRUPT = ("CorruptStream",)
STALLED = ("StalledStream", "TimeoutError")
STREAM_ERROR = ("StreamError",)


class HttpClient:
    """One aiohttp session per provider, created lazily inside the running loop.

    Timeouts follow the request: `connect = min(10, t)`, `sock_read = t` (so a stream that
    sends nothing for `t` seconds fails), no total (a long stream is fine while it moves).
    The `ClientTimeout` is cached per distinct `t` value: most calls reuse the last one.
    """

    __slots__ = ("_headers", "_limit", "_redactor", "_secret", "_session", "_timeout",
                 "_timeout_s", "url")

    def __init__(self, url: str, headers: Mapping[str, str], *, max_connections: int,
                 secret: str | None = None, secrets: Sequence[str] = (),
                 query: Mapping[str, str] | None = None) -> None:
        self.url = URL(url).update_query(dict(query)) if query else URL(url)
        self._headers = dict(headers)
        self._limit = max_connections
        self._secret = secret or None  # the API key
        self._redactor = Redactor((secret, *secrets))
        self._session: aiohttp.ClientSession | None = None
        self._timeout_s = -1.0
        self._timeout = aiohttp.ClientTimeout(total=None)

    def session(self) -> aiohttp.ClientSession:
        s = self._session
        if s is None or s.closed:
            connector = aiohttp.TCPConnector(limit=self._limit)
            s = self._session = aiohttp.ClientSession(
                connector=connector, headers=self._headers, raise_for_status=False,
                trust_env=False, timeout=aiohttp.ClientTimeout(total=None))
        return s

    def timeout(self, timeout_s: float) -> aiohttp.ClientTimeout:
        t = max(float(timeout_s), 0.001)
        if t != self._timeout_s:
            self._timeout = aiohttp.ClientTimeout(total=None, connect=min(10.0, t), sock_read=t)
            self._timeout_s = t
        return self._timeout

    async def post(self, body: bytes, timeout_s: float, traceparent: str | None = None
                   ) -> aiohttp.ClientResponse:
        """Send one request; a transport failure before the status line is a `ProviderError`.
        The caller owns the response and must `release()` it. `traceparent`: the W3C
        trace context header of the call, when it has one."""
        try:
            return await self.session().post(
                self.url, data=body, allow_redirects=False, timeout=self.timeout(timeout_s),
                headers=None if traceparent is None else {"traceparent": traceparent})
        except TRANSPORT_ERRORS as exc:
            raise ProviderError(self.transport_failure(exc)) from exc

    async def aclose(self) -> None:
        s, self._session = self._session, None
        if s is not None and not s.closed:
            await s.close()

    # -- failures ------------------------------------------------------------------------

    def redact(self, text: str) -> str:
        return self._redactor.redact(text)[:MESSAGE_LIMIT]

    def transport_failure(self, exc: BaseException) -> CallFailure:
        """Always a message: a bare TimeoutError says nothing, so it is named instead."""
        return CallFailure(exception=exception_names(exc),
                           message=self.redact(str(exc) or repr(exc)),
                           local=local_exhaustion(exc))

    def stream_read_failure(self, exc: BaseException) -> CallFailure:
        """A fault while reading the body of a started stream: a timeout is a stall."""
        if isinstance(exc, TimeoutError):
            return CallFailure(exception=STALLED,
                               message="no data within the read timeout")
        return self.transport_failure(exc)

    def stream_failure(self, names: tuple[str, ...], message: str) -> CallFailure:
        return CallFailure(exception=names, message=self.redact(message))

    def stream_error_event(self, obj: Mapping[str, Any]) -> CallFailure:
        """An error the server sent inside a started (HTTP 200) stream."""
        error_type, message = error_fields(obj)
        return CallFailure(error_type=error_type, exception=STREAM_ERROR,
                           message=self.redact(message or "error event in stream"))

    def redirect_failure(self, resp: aiohttp.ClientResponse) -> CallFailure:
        """A 3xx answer: not followed, named with where it pointed (redacted: a Location
        may carry a key in its query)."""
        location = resp.headers.get("Location")
        target = None
        if location:
            try:
                target = str(resp.url.join(URL(location)))
            except ValueError:
                target = location
        return redirect_refused("provider", resp.status,
                                self.redact(target) if target else None,
                                "a provider follows no redirect")

    async def http_failure(self, resp: aiohttp.ClientResponse) -> CallFailure:
        """An HTTP status >= 400: the server's own word on type, message and Retry-After."""
        status = resp.status
        try:
            raw = await resp.content.read(_ERROR_BODY_LIMIT)
        except TRANSPORT_ERRORS as exc:
            return CallFailure(status=status, exception=exception_names(exc),
                               message=self.redact(str(exc)),
                               retry_after_s=retry_after_header(resp.headers))
        text = raw.decode("utf-8", "replace")
        parsed = loads(raw)
        error_type, message = error_fields(parsed)
        retry_after = retry_after_header(resp.headers)
        if retry_after is None:
            retry_after = retry_after_of(resp.headers, parsed, now_epoch=time.time())
        return CallFailure(
            status=status, error_type=error_type,
            message=self.redact(message or text.strip() or (resp.reason or "")),
            retry_after_s=retry_after, context_overflow=is_context_overflow(status, text))


def retry_after_header(headers: Mapping[str, str]) -> float | None:
    """`retry-after-ms` (sent by OpenAI and Anthropic, and honoured by their SDKs) is the
    precise form of Retry-After; `classify.retry_after_of` reads the standard header."""
    ms = headers.get("retry-after-ms")
    if ms is None:
        return None
    seconds = parse_retry_after(ms, now_epoch=0.0)
    return None if seconds is None else seconds / 1000.0


def error_fields(body: object) -> tuple[str | None, str]:
    """`error.type` (else Google's `error.status`, else `error.code`) and `error.message`
    of an OpenAI, Anthropic or Gemini error body; a bare string `error` is the message.
    A body that is a list (Gemini's stream answers errors as a one-element array) is
    read by its first element."""
    if isinstance(body, list) and body:
        body = body[0]
    if not isinstance(body, Mapping):
        return None, ""
    err = body.get("error")
    if isinstance(err, str):
        return None, err
    if not isinstance(err, Mapping):
        msg = body.get("message")
        return None, msg if isinstance(msg, str) else ""
    # Google's errors name their kind in `status` ("RESOURCE_EXHAUSTED"); `code` is
    # the HTTP status there, a word on OpenAI's.
    status = err.get("status")
    etype = err.get("type") or (status if isinstance(status, str) else None) \
        or err.get("code")
    msg = err.get("message")
    return (str(etype) if etype else None), (msg if isinstance(msg, str) else "")


def loads(data: bytes) -> Any:
    """JSON from the wire, or None when it is not valid JSON (the caller names the fault)."""
    try:
        return jsonwire.loads(data)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError are both ValueErrors
        return None


def dumps(body: Mapping[str, Any]) -> bytes:
    """A request body: compact JSON in UTF-8 (orjson; a `Fragment` goes in as it is)."""
    return jsonwire.dumps(body)


def shape_failure(what: str) -> CallFailure:
    return CallFailure(exception=CORRUPT, message=what)


async def exchange(client: HttpClient, body: bytes, timeout_s: float, *, stream: bool,
                   parse: Callable[[Any], ModelReply],
                   read_stream: Callable[[aiohttp.ClientResponse, DeltaSink | None],
                                         Awaitable[ModelReply]],
                   on_delta: DeltaSink | None, traceparent: str | None = None) -> ModelReply:
    """One attempt: POST, check the status, then read a JSON body (bounded as a whole by
    `timeout_s`) or hand a started stream to `read_stream`. The response is always
    released, also when the call is cancelled."""
    if stream:
        resp = await client.post(body, timeout_s, traceparent)
        try:
            if resp.status >= 300:
                raise ProviderError(await _status_failure(client, resp))
            if resp.content_type != "application/json":
                return await read_stream(resp, on_delta)
            # A server that ignored `stream` and answered with one JSON body.
            raw = await _read_body(client, resp)
        finally:
            resp.release()
        return _parse_body(raw, parse)
    try:
        async with asyncio.timeout(timeout_s):
            resp = await client.post(body, timeout_s, traceparent)
            try:
                if resp.status >= 300:
                    raise ProviderError(await _status_failure(client, resp))
                raw = await _read_body(client, resp)
            finally:
                resp.release()
    except TimeoutError as exc:
        raise ProviderError(client.transport_failure(exc)) from exc
    return _parse_body(raw, parse)


async def _status_failure(client: HttpClient, resp: aiohttp.ClientResponse) -> CallFailure:
    """What an answer other than 2xx says: a redirect not followed, or the error."""
    if resp.status < 400:
        return client.redirect_failure(resp)
    return await client.http_failure(resp)


async def _read_body(client: HttpClient, resp: aiohttp.ClientResponse) -> bytes:
    try:
        return await resp.read()
    except TRANSPORT_ERRORS as exc:
        raise ProviderError(client.transport_failure(exc)) from exc


def _parse_body(raw: bytes, parse: Callable[[Any], ModelReply]) -> ModelReply:
    obj = loads(raw)
    if not isinstance(obj, dict):
        raise ProviderError(shape_failure("response body is not a JSON object"))
    try:
        return parse(obj)
    except (KeyError, IndexError, TypeError, AttributeError, ValueError) as exc:
        raise ProviderError(shape_failure(
            f"unexpected response shape: {type(exc).__name__}")) from exc


def request_headers(base: Mapping[str, str], extra: Mapping[str, str]) -> dict[str, str]:
    """The adapter's headers with the provider's own `headers` on top (case-insensitive:
    a configured `Authorization` or `Accept` replaces the adapter's)."""
    out = {k: v for k, v in base.items() if k.lower() not in {e.lower() for e in extra}}
    out.update(extra)
    return out


class HttpAdapter:
    """What every HTTP adapter does alike: a call is one `exchange` of its encoded
    request, read whole (`_parse`) or streamed (`_read_stream`); closing closes its
    session. An adapter sets `_client`, `_stream` and `_structured` (its
    `structured_output` mode, resolved) and writes those three. In the `tool` mode the
    answer tool's call becomes the reply's text here, for every adapter alike."""

    _client: HttpClient
    _stream: bool
    _structured: str = "native"

    def encode(self, request: ModelRequest) -> bytes:
        raise NotImplementedError

    def _parse(self, obj: dict[str, Any]) -> ModelReply:
        raise NotImplementedError

    async def _read_stream(self, resp: aiohttp.ClientResponse, on_delta: DeltaSink | None
                           ) -> ModelReply:
        raise NotImplementedError

    async def complete(self, request: ModelRequest, on_delta: DeltaSink | None = None
                       ) -> ModelReply:
        reply = await exchange(self._client, self.encode(request), request.timeout_s,
                               stream=self._stream, parse=self._parse,
                               read_stream=self._read_stream, on_delta=on_delta,
                               traceparent=request.traceparent)
        if request.output_schema is not None and self._structured == "tool":
            return answer_from_tool(reply)
        return reply

    async def aclose(self) -> None:
        await self._client.aclose()
