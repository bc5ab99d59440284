"""Reading a model's event stream, for every adapter alike: the SSE framing (sans I/O),
the JSON objects of each network read, the text handed on once a read, and the cut of a
stream that brings no progress for `idle_timeout` whatever keepalives it sends.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from turnkeeper.policy.call_bound import idle_failure
from turnkeeper.providers.base import DeltaSink, ProviderError
from turnkeeper.providers.http import CORRUPT, TRANSPORT_ERRORS, HttpClient, loads


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


async def send_new_text(text: list[str], sent: int, on_delta: DeltaSink | None) -> int:
    """Hand `on_delta` the pieces of `text` after the first `sent`, joined; return how
    many pieces have been sent. A stream reader calls it once per network read (and
    before it returns its reply), so what one read brought is one `model.delta` event:
    a piece a read while the daemon keeps up, several when it is busy and reads fall
    behind, instead of an event per token whatever the load."""
    if on_delta is not None and len(text) > sent:
        await on_delta("".join(text[sent:]))
    return len(text)


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
