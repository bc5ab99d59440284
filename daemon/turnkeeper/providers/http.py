"""What the HTTP adapters (OpenAI, OpenAI Responses, Anthropic, Gemini) share: one
aiohttp session, SSE framing, and the translation of everything that can go wrong on
the wire into one `CallFailure`.

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
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any

import aiohttp
from yarl import URL

from turnkeeper import jsonwire
from turnkeeper.policy.call_bound import idle_failure
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
from turnkeeper.providers.base import DeltaSink, ModelReply, ProviderError

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

    async def post(self, body: bytes, timeout_s: float) -> aiohttp.ClientResponse:
        """Send one request; a transport failure before the status line is a `ProviderError`.
        The caller owns the response and must `release()` it."""
        try:
            return await self.session().post(self.url, data=body, allow_redirects=False,
                                             timeout=self.timeout(timeout_s))
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


class SSEDecoder:
    """Server-sent events, sans I/O: feed raw bytes, get the `data` payload of each
    complete event (multi-line data joined with newlines, comments and other fields
    skipped). Lines may end in LF, CRLF or a lone CR, as the SSE format allows, and a
    UTF-8 byte order mark at the start of the stream is dropped (else the first line,
    the first event's data, would not read as `data:`)."""

    __slots__ = ("_at_start", "_buf", "_data", "_skip_lf")

    def __init__(self) -> None:
        self._buf = b""
        self._data: list[bytes] = []
        self._at_start = True
        # The last chunk ended in CR: an LF opening the next one is that CRLF's second half.
        self._skip_lf = False

    def feed(self, chunk: bytes) -> list[bytes]:
        buf = self._buf + chunk if self._buf else chunk
        if self._at_start:
            if len(buf) < len(_BOM) and _BOM.startswith(buf):
                self._buf = buf  # maybe a BOM cut across chunks: wait for the rest
                return []
            self._at_start = False
            if buf.startswith(_BOM):
                buf = buf[len(_BOM):]
        if self._skip_lf:
            self._skip_lf = False
            if buf.startswith(b"\n"):
                buf = buf[1:]
        if b"\r" in buf:
            self._skip_lf = buf.endswith(b"\r")
            buf = buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        lines = buf.split(b"\n")
        self._buf = lines.pop()
        out: list[bytes] = []
        data = self._data
        for line in lines:
            if not line:
                if data:
                    out.append(data[0] if len(data) == 1 else b"\n".join(data))
                    data.clear()
            elif line.startswith(b"data:"):
                payload = line[5:]
                data.append(payload[1:] if payload.startswith(b" ") else payload)
        return out

    def flush(self) -> list[bytes]:
        """At end of stream: an event whose blank line never came still counts."""
        out = self.feed(b"\n\n") if (self._buf or self._data) else []
        self._buf = b""
        return out


_BOM = b"\xef\xbb\xbf"


def loads(data: bytes) -> Any:
    """JSON from the wire, or None when it is not valid JSON (the caller names the fault)."""
    try:
        return jsonwire.loads(data)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError are both ValueErrors
        return None


def dumps(body: Mapping[str, Any]) -> bytes:
    """A request body: compact JSON in UTF-8 (orjson; a `Fragment` goes in as it is)."""
    return jsonwire.dumps(body)


async def send_new_text(text: list[str], sent: int, on_delta: DeltaSink | None) -> int:
    """Hand `on_delta` the pieces of `text` after the first `sent`, joined; return how
    many pieces have been sent. A stream reader calls it once per network read (and
    before it returns its reply), so what one read brought is one `model.delta` event:
    a piece a read while the daemon keeps up, several when it is busy and reads fall
    behind, instead of an event per token whatever the load."""
    if on_delta is not None and len(text) > sent:
        await on_delta("".join(text[sent:]))
    return len(text)


def shape_failure(what: str) -> CallFailure:
    return CallFailure(exception=CORRUPT, message=what)


async def exchange(client: HttpClient, body: bytes, timeout_s: float, *, stream: bool,
                   parse: Callable[[Any], ModelReply],
                   read_stream: Callable[[aiohttp.ClientResponse, DeltaSink | None],
                                         Awaitable[ModelReply]],
                   on_delta: DeltaSink | None) -> ModelReply:
    """One attempt: POST, check the status, then read a JSON body (bounded as a whole by
    `timeout_s`) or hand a started stream to `read_stream`. The response is always
    released, also when the call is cancelled."""
    if stream:
        resp = await client.post(body, timeout_s)
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
            resp = await client.post(body, timeout_s)
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


class IdleWatch:
    """Cuts a started stream that brings no progress for `idle_s`, however many bytes
    (keepalive comments, empty events, pings) it sends meanwhile: the per-read timeout
    never fires on those. Around the reading loop: `async with IdleWatch(s) as idle:`,
    `idle.progressed()` when a read brought text, a tool call or a finish; an idle stream
    leaves as `ProviderError(idle_failure)`.

    One timer per idle period, not one per read: it fires at the last progress plus
    `idle_s` as it knew it, and looks again when progress came since. The cut itself is
    `asyncio.timeout`'s (expired at once), which keeps any other cancellation apart."""

    __slots__ = ("_expired", "_handle", "_idle_s", "_last", "_loop", "_timeout")

    def __init__(self, idle_s: float) -> None:
        self._idle_s = idle_s
        self._expired = False
        self._handle: asyncio.TimerHandle | None = None
        self._loop = asyncio.get_running_loop()
        self._last = self._loop.time()
        self._timeout = asyncio.timeout(None)

    async def __aenter__(self) -> IdleWatch:
        await self._timeout.__aenter__()
        self._handle = self._loop.call_at(self._last + self._idle_s, self._check)
        return self

    def progressed(self) -> None:
        self._last = self._loop.time()

    def _check(self) -> None:
        due = self._last + self._idle_s
        now = self._loop.time()
        if now < due:
            self._handle = self._loop.call_at(due, self._check)
            return
        self._expired = True
        self._timeout.reschedule(now)

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: Any) -> None:
        if self._handle is not None:
            self._handle.cancel()
        try:
            await self._timeout.__aexit__(exc_type, exc, tb)
        except TimeoutError as cut:
            if self._expired:
                raise ProviderError(idle_failure(self._idle_s)) from cut
            raise


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


# What `sse_reads` yields for the event whose data is its `done` marker (OpenAI's
# `[DONE]`); compared by identity.
SSE_DONE: dict[str, Any] = {}


async def sse_reads(client: HttpClient, resp: aiohttp.ClientResponse, *,
                    done: bytes | None = None) -> AsyncIterator[list[dict[str, Any]]]:
    """The JSON objects of an event stream, a list per network read (so a reader hands
    on its text once a read, see `send_new_text`), until the body ends; an empty event
    (a keepalive) is skipped, and an event whose data is `done` is `SSE_DONE`. A read
    that fails is a `ProviderError`; so is an event whose data is not a JSON object. The
    reader keeps its `IdleWatch` around the loop (not in here: a cut must reach the
    reader inside its own `async with`)."""
    read = resp.content.readany
    decoder = SSEDecoder()
    eof = False
    while not eof:
        try:
            chunk = await read()
        except TRANSPORT_ERRORS as exc:
            raise ProviderError(client.stream_read_failure(exc)) from exc
        if chunk:
            events = decoder.feed(chunk)
        else:
            events, eof = decoder.flush(), True
        out: list[dict[str, Any]] = []
        for data in events:
            if not data:
                continue
            if data == done:
                out.append(SSE_DONE)
                continue
            obj = loads(data)
            if not isinstance(obj, dict):
                raise ProviderError(client.stream_failure(
                    CORRUPT, "stream event is not a JSON object"))
            out.append(obj)
        yield out
