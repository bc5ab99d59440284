"""The async client: the same calls as `Client`, awaited, on anyio (so under asyncio or
trio), one connection a request over AF_UNIX."""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import AsyncIterator, Callable
from typing import Any
from urllib.parse import urlencode

import anyio
from anyio.abc import SocketStream
from anyio.streams.buffered import BufferedByteReceiveStream

from turnkeeper.client import _wire
from turnkeeper.client._sync import socket_path
from turnkeeper.client.errors import ClientError, Unreachable, WaitTimedOut
from turnkeeper.client.models import (
    ApprovalDecision,
    DeadLetter,
    Event,
    Health,
    PendingApproval,
    Status,
    Turn,
)

MAX_LINE = 65536
_BROKEN = (OSError, anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError,
           anyio.DelimiterNotFound, ValueError)


class _Response:
    """One HTTP/1.1 answer read from the stream: status, headers, then the body."""

    def __init__(self, stream: SocketStream) -> None:
        self._stream = stream
        self._reader = BufferedByteReceiveStream(stream)
        self.status = 0
        self.headers: dict[str, str] = {}
        self._length: int | None = None
        self._chunked = False
        self._done = False

    async def _line(self) -> bytes:
        return await self._reader.receive_until(b"\r\n", MAX_LINE)

    async def read_head(self) -> None:
        parts = (await self._line()).split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
            raise ValueError("not an HTTP response")
        self.status = int(parts[1])
        while line := await self._line():
            name, _, value = line.partition(b":")
            self.headers[name.strip().lower().decode("latin-1")] = \
                value.strip().decode("latin-1")
        self._length = int(self.headers["content-length"]) \
            if "content-length" in self.headers else None
        self._chunked = "chunked" in self.headers.get("transfer-encoding", "").lower()

    async def pieces(self) -> AsyncIterator[bytes]:
        """The body as it comes. A chunked body that stops before its last chunk (the
        daemon went away) raises: it did not end, it broke."""
        if self._chunked:
            while True:
                size = int((await self._line()).split(b";", 1)[0].strip() or b"0", 16)
                if size == 0:
                    return
                data = await self._reader.receive_exactly(size)
                await self._reader.receive_exactly(2)
                yield data
        elif self._length is not None:
            if self._length:
                yield await self._reader.receive_exactly(self._length)
        else:
            buffered = self._reader.buffer
            if buffered:
                yield bytes(buffered)
                await self._reader.receive_exactly(len(buffered))
            while True:
                try:
                    yield await self._stream.receive()
                except anyio.EndOfStream:
                    return

    async def read(self) -> bytes:
        return b"".join([piece async for piece in self.pieces()])

    async def aclose(self) -> None:
        await self._stream.aclose()


class AsyncClient:
    """An async client of one daemon's control socket; `async with AsyncClient() as tk`
    or plain. The calls are those of `Client`, awaited; `events` is an async iterator."""

    def __init__(self, socket: str | os.PathLike[str] | None = None, *,
                 timeout: float | None = 30.0) -> None:
        self.socket = socket_path(socket)
        self.timeout = timeout

    def __repr__(self) -> str:
        return f"AsyncClient(socket={str(self.socket)!r})"

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def aclose(self) -> None:
        return None

    # -- transport ------------------------------------------------------------------

    async def _open(self, method: str, target: str, body: Any = None, *,
                    headers: dict[str, str] | None = None) -> _Response:
        payload = None if body is None else _wire.encode(body)
        try:
            stream = await anyio.connect_unix(str(self.socket))
        except OSError as exc:
            raise Unreachable(f"control socket {self.socket}: {exc}") from None
        resp = _Response(stream)
        try:
            # Answered and closed before it read us: the answer is there all the same.
            with contextlib.suppress(OSError, anyio.BrokenResourceError):
                await stream.send(_wire.request_head(method, target, payload, headers)
                                  + (payload or b""))
            await resp.read_head()
        except _BROKEN as exc:
            await resp.aclose()
            raise Unreachable(f"control socket {self.socket}: {exc!r}") from None
        except BaseException:
            await resp.aclose()
            raise
        return resp

    async def _call(self, method: str, target: str, body: Any = None, *,
                    limit_s: float | None = None,
                    ok_statuses: tuple[int, ...] = ()) -> tuple[int, Any]:
        limit = limit_s if limit_s is not None else self.timeout
        try:
            with anyio.fail_after(math.inf if limit is None else limit):
                resp = await self._open(method, target, body)
                try:
                    raw = await resp.read()
                finally:
                    await resp.aclose()
        except TimeoutError:
            raise Unreachable(f"control socket {self.socket}: no answer within "
                              f"{limit} s") from None
        except _BROKEN as exc:
            raise Unreachable(f"control socket {self.socket}: {exc!r}") from None
        data = _wire.decode(raw)
        if resp.status in ok_statuses:
            return resp.status, data
        return resp.status, _wire.checked(resp.status, resp.headers, data)

    # -- turns ----------------------------------------------------------------------

    async def submit(self, message: str, *, session: str | None = None,
                     budget: dict[str, Any] | None = None, profile: str | None = None,
                     model: str | None = None, deadline: float | str | None = None,
                     idempotency_key: str | None = None, traceparent: str | None = None,
                     agent: str | None = None,
                     output_schema: dict[str, Any] | None = None,
                     retry_for: float = _wire.SUBMIT_RETRY_FOR_S,
                     on_retry: Callable[[ClientError, float], object] | None = None
                     ) -> Turn:
        """As `Client.submit`: retried with one Idempotency-Key, at most one turn."""
        body = _wire.submit_body(message, session=session, budget=budget, profile=profile,
                                 model=model, deadline=deadline, agent=agent,
                                 idempotency_key=idempotency_key
                                 or _wire.new_idempotency_key(), traceparent=traceparent,
                                 output_schema=output_schema)
        give_up_at = anyio.current_time() + retry_for
        attempt = 0
        while True:
            try:
                return Turn.from_json((await self._call("POST", "/v1/turns", body))[1]["turn"])
            except ClientError as exc:
                delay = _wire.retry_delay(exc, attempt, give_up_at - anyio.current_time())
                if delay is None:
                    raise
                if on_retry is not None:
                    on_retry(exc, delay)
            attempt += 1
            await anyio.sleep(delay)

    async def get(self, turn_id: str) -> Turn:
        return Turn.from_json((await self._call("GET", _wire.turn_path(turn_id)))[1]["turn"])

    async def turns(self, *, state: str | None = None, session: str | None = None,
                    limit: int = 100) -> list[Turn]:
        query = urlencode({k: v for k, v in (("state", state), ("session", session),
                                             ("limit", limit)) if v is not None})
        _, data = await self._call("GET", f"/v1/turns?{query}")
        return [Turn.from_json(t) for t in data["turns"]]

    # `timeout` as in Client.wait: the same call, awaited.
    async def wait(self, turn_id: str, timeout: float | None = None) -> Turn:  # noqa: ASYNC109
        """As `Client.wait`: through a daemon restart; `WaitTimedOut` after `timeout`."""
        give_up_at = None if timeout is None else anyio.current_time() + timeout
        attempt = 0
        while True:
            left = _wire.WAIT_PIECE_S if give_up_at is None \
                else give_up_at - anyio.current_time()
            piece = max(0.0, min(left, _wire.WAIT_PIECE_S))
            try:
                _, data = await self._call(
                    "GET", _wire.turn_path(turn_id, f"?wait={piece:.3f}"), limit_s=piece + 30)
                attempt = 0
            except Unreachable:
                data = None
                attempt += 1
            if data is not None:
                turn = Turn.from_json(data["turn"])
                if turn.finished:
                    return turn
            if give_up_at is not None and anyio.current_time() >= give_up_at:
                raise WaitTimedOut(f"turn {turn_id} did not end within {timeout} s")
            if data is None:
                await anyio.sleep(_wire.reconnect_delay(attempt))

    async def events(self, turn_id: str | None = None, *, after: int | None = None,
                     types: str | None = None,
                     reconnect_for: float = _wire.RECONNECT_FOR_S) -> AsyncIterator[Event]:
        """As `Client.events`: reopened after a drop, from the last `seq` seen."""
        state = _wire.StreamState(turn_id, after)
        keep = _wire.type_filter(types)
        reconnects = _wire.Reconnects(self.socket, reconnect_for)
        while True:
            try:
                async for raw in self._stream(state.path(None if turn_id else types)):
                    reconnects.connected()
                    if state.take(raw) and keep(state.last_type):
                        yield Event.from_json(raw)
            except Unreachable:
                pass
            if state.ended:
                return
            await anyio.sleep(reconnects.delay(anyio.current_time()))

    async def _stream(self, target: str) -> AsyncIterator[dict[str, Any]]:
        resp = await self._open("GET", target)
        try:
            if resp.status != 200:
                _wire.checked(resp.status, resp.headers, _wire.decode(await resp.read()))
            buffer = b""
            try:
                async for piece in resp.pieces():
                    buffer += piece
                    *lines, buffer = buffer.split(b"\n")
                    for line in lines:
                        data = _wire.decode(line.strip())
                        if isinstance(data, dict):
                            yield data
            except _BROKEN as exc:
                raise Unreachable(f"control socket {self.socket}: {exc!r}") from None
        finally:
            await resp.aclose()

    async def cancel(self, turn_id: str, *, now: bool = False) -> dict[str, Any]:
        _, data = await self._call("POST", _wire.turn_path(turn_id, "/cancel"),
                                   {"now": now} if now else None)
        return data  # type: ignore[no-any-return]

    async def steer(self, turn_id: str, text: str, *, redirect: bool = False
                    ) -> dict[str, Any]:
        return await self._message(turn_id, "steer", text, redirect)

    async def answer(self, turn_id: str, text: str) -> dict[str, Any]:
        return await self._message(turn_id, "answer", text, False)

    async def _message(self, turn_id: str, kind: str, text: str, redirect: bool
                       ) -> dict[str, Any]:
        _, data = await self._call("POST", _wire.turn_path(turn_id, "/messages"),
                                   {"kind": kind, "text": text, "redirect": redirect})
        return data  # type: ignore[no-any-return]

    # -- approvals ------------------------------------------------------------------

    async def approvals(self) -> list[PendingApproval]:
        """Every tool call waiting for a person's approval, oldest first."""
        _, data = await self._call("GET", "/v1/approvals")
        return [PendingApproval.from_json(a) for a in data["approvals"]]

    async def approve(self, turn_id: str, call_id: str, *,
                      arguments: dict[str, Any] | None = None) -> ApprovalDecision:
        """Let a held call run once; `arguments` replace the call's."""
        _, data = await self._call("POST", _wire.turn_path(turn_id, "/approvals"),
                                   _wire.approval_body(call_id, "approve",
                                                       arguments=arguments))
        return ApprovalDecision.from_json(data)

    async def deny(self, turn_id: str, call_id: str, *, reason: str) -> ApprovalDecision:
        """Refuse a held call: it never runs; the agent reads the reason."""
        _, data = await self._call("POST", _wire.turn_path(turn_id, "/approvals"),
                                   _wire.approval_body(call_id, "deny", reason=reason))
        return ApprovalDecision.from_json(data)

    # -- the daemon -----------------------------------------------------------------

    async def status(self) -> Status:
        return Status.from_json((await self._call("GET", "/v1/status"))[1])

    async def health(self) -> Health:
        return Health.from_json((await self._call("GET", "/v1/health",
                                                  ok_statuses=(503,)))[1])

    async def pause(self) -> dict[str, Any]:
        return (await self._call("POST", "/v1/intake", {"open": False}))[1]  # type: ignore[no-any-return]

    async def resume(self) -> dict[str, Any]:
        return (await self._call("POST", "/v1/intake", {"open": True}))[1]  # type: ignore[no-any-return]

    async def dead_letters(self) -> list[DeadLetter]:
        _, data = await self._call("GET", "/v1/dead-letters")
        return [DeadLetter.from_json(d) for d in data["dead_letters"]]

    async def replay(self, turn_id: str) -> Turn:
        path = f"/v1/dead-letters/{_wire.turn_path(turn_id)[len('/v1/turns/'):]}/replay"
        return Turn.from_json((await self._call("POST", path))[1]["turn"])
