"""A real HTTP tool server on 127.0.0.1 for the daemon's `[[tools]]` of kind http.

It runs aiohttp on its own event loop in a thread, so the synchronous integration tests
(which drive the daemon as a subprocess) can script it and read what it saw:

    server.respond("/search", Reply(503), Reply(503), Reply(200, {"hits": 1}))
    ...
    [c.idempotency_key for c in server.calls("/search")]

Each path answers its scripted replies in order, the last one repeating; a path with no
script answers 200 with `{"ok": true, "call": n}`. Every request is recorded (method,
path, headers, JSON body, time) before the reply, including requests whose client gave
up while the server was still waiting (`Reply(delay=...)`).

`redirect_loop = True` answers a 302 to the same path: the client gives up with
TooManyRedirects, a failure with no status and no recognisable shape (class unknown).

`echo_headers = ("Authorization", ...)` adds those request headers, as received, to the
reply's JSON body under "headers": a tool that hands its credentials back.

`hold(path)` keeps every call to `path` waiting until `release(path)`: with
`wait_for_calls` a test acts while a call is certainly in flight, without racing a timer.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web


@dataclass(frozen=True, slots=True)
class Reply:
    status: int = 200
    body: Any = None
    delay: float = 0.0
    headers: dict[str, str] = field(default_factory=dict)
    redirect_loop: bool = False
    echo_headers: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Call:
    method: str
    path: str
    headers: dict[str, str]
    body: Any
    at: float
    raw: bytes = b""  # the body as received (what a signature covers)

    @property
    def idempotency_key(self) -> str | None:
        return self.headers.get("Idempotency-Key")


class ToolServer:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._scripts: dict[str, list[Reply]] = {}
        self._served: dict[str, int] = {}
        self._calls: list[Call] = []
        self._gates: dict[str, threading.Event] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self.port: int = self._sock.getsockname()[1]

    def __repr__(self) -> str:
        return f"ToolServer(127.0.0.1:{self.port}, calls={len(self._calls)})"

    # -- the test's side --------------------------------------------------------------

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def respond(self, path: str, *replies: Reply) -> None:
        """Script `path`: one reply per call in order, the last one repeating."""
        with self._lock:
            self._scripts[path] = list(replies)
            self._served[path] = 0

    def calls(self, path: str | None = None) -> list[Call]:
        with self._lock:
            return [c for c in self._calls if path is None or c.path == path]

    def wait_for_calls(self, path: str, n: int = 1, timeout: float = 10.0) -> list[Call]:
        deadline = time.monotonic() + timeout
        while len(calls := self.calls(path)) < n:
            if time.monotonic() > deadline:
                raise AssertionError(f"{path}: {len(calls)} calls of {n} in {timeout} s")
            time.sleep(0.005)
        return calls

    def hold(self, path: str) -> None:
        """Calls to `path` wait (after being recorded) until `release(path)`."""
        with self._lock:
            self._gates[path] = threading.Event()

    def release(self, path: str) -> None:
        with self._lock:
            gate = self._gates.pop(path, None)
        if gate is not None:
            gate.set()

    # -- the server -------------------------------------------------------------------

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body: Any = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode(errors="replace")
        if body is None and request.query:
            body = dict(request.query)
        path = request.path
        with self._lock:
            self._calls.append(Call(method=request.method, path=path,
                                    headers=dict(request.headers), body=body,
                                    at=time.monotonic(), raw=raw))
            n = self._served.get(path, 0)
            self._served[path] = n + 1
            script = self._scripts.get(path)
            reply = script[min(n, len(script) - 1)] if script else None
            gate = self._gates.get(path)
        if gate is not None:
            await asyncio.to_thread(gate.wait, 30.0)
        if reply is None:
            return web.json_response({"ok": True, "call": n + 1})
        if reply.delay:
            await asyncio.sleep(reply.delay)
        if reply.redirect_loop:
            raise web.HTTPFound(location=path)
        if reply.echo_headers:
            payload = {**(reply.body or {}), "headers": {
                h: request.headers.get(h) for h in reply.echo_headers}}
            return web.json_response(payload, status=reply.status, headers=reply.headers)
        payload = reply.body if reply.body is not None else (
            {"ok": True, "call": n + 1} if reply.status < 400
            else {"error": {"type": f"http_{reply.status}", "message": "scripted failure"}})
        return web.json_response(payload, status=reply.status, headers=reply.headers)

    def start(self) -> ToolServer:
        ready = threading.Event()
        errors: list[BaseException] = []

        async def serve() -> None:
            app = web.Application()
            app.router.add_route("*", "/{tail:.*}", self._handle)
            self._runner = web.AppRunner(app, shutdown_timeout=0.2, access_log=None)
            await self._runner.setup()
            await web.SockSite(self._runner, self._sock).start()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(serve())
            except BaseException as exc:  # pragma: no cover - reported to start()
                errors.append(exc)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self._cleanup())
            loop.close()

        self._thread = threading.Thread(target=run, name=f"tool-server:{self.port}",
                                        daemon=True)
        self._thread.start()
        ready.wait(10)
        if errors:
            raise errors[0]
        return self

    async def _cleanup(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def stop(self) -> None:
        with self._lock:
            for gate in self._gates.values():
                gate.set()
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        self._sock.close()


def _serve() -> Iterator[ToolServer]:
    server = ToolServer().start()
    try:
        yield server
    finally:
        server.stop()


tool_server = pytest.fixture(_serve, name="tool_server")
# One server for a module whose tests share one daemon (they tell their calls apart by
# the key or the path each uses).
module_tool_server = pytest.fixture(_serve, scope="module", name="module_tool_server")
