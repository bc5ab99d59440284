"""CPU per model call: OpenAIProvider.complete against a bare aiohttp loop, same run.

A loopback aiohttp server in a separate process (its CPU is not counted) answers a fixed
OpenAI chat completion, as one JSON body or as an SSE stream. In this process we measure
`time.process_time()` per call for

  (a) bare: a plain aiohttp loop posting the same request body and reading the JSON
      (for streams: reading the `data:` lines and parsing each one);
  (b) provider: `OpenAIProvider.complete` (request encoding, status check, parsing,
      stream reassembly, usage, ModelReply);
  (c) for streams, the provider with the daemon's delta events: each piece of text it
      hands on is published as a `model.delta` on an EventBus, as a turn does (the
      "deltas/call" column counts them: one per network read, so fewer than the text's
      40 pieces when reads bring several, as they do at 1,000 concurrent calls).

at 10 and at 1,000 concurrent calls (both with the provider's connection pool of
`max_connections` = 100, so at 1,000 most calls wait on the pool). Rounds alternate bare
and provider; the figure kept for each is the median of the rounds.

    python bench/bench_providers.py [--rounds 3] [--calls-10 2000] [--calls-1000 4000]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import multiprocessing as mp
import socket
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web

from turnkeeper import event_types as ev
from turnkeeper.clock import SystemClock
from turnkeeper.config import ProviderConfig
from turnkeeper.events import EventBus
from turnkeeper.providers.base import Message, ModelRequest, ToolCall, ToolSpec
from turnkeeper.providers.openai import OpenAIProvider

try:
    import uvloop
except ImportError:  # pragma: no cover
    uvloop = None  # type: ignore[assignment]

MAX_CONNECTIONS = 100
TEXT = ("The weather in Paris is 21C and sunny, with a light breeze from the west and "
        "no rain expected before the evening. Enjoy your walk along the Seine.")


def _json_reply() -> bytes:
    return json.dumps({
        "id": "chatcmpl-bench", "object": "chat.completion", "created": 1, "model": "bench",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": TEXT},
                     "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 120, "completion_tokens": 40, "total_tokens": 160},
    }).encode()


def _stream_reply() -> list[bytes]:
    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        obj = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 1,
               "model": "bench", "choices": [{"index": 0, "delta": delta,
                                              "finish_reason": finish}]}
        return b"data: " + json.dumps(obj).encode() + b"\n\n"

    words = TEXT.split(" ")
    events = [chunk({"role": "assistant", "content": ""})]
    events += [chunk({"content": w + " "}) for w in words]
    events.append(chunk({}, "stop"))
    usage = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 1,
             "model": "bench", "choices": [],
             "usage": {"prompt_tokens": 120, "completion_tokens": 40, "total_tokens": 160}}
    events.append(b"data: " + json.dumps(usage).encode() + b"\n\n")
    events.append(b"data: [DONE]\n\n")
    return events


def _serve(port_out: Any) -> None:
    """The loopback server (child process)."""
    json_body = _json_reply()
    stream_events = _stream_reply()
    connections: set[int] = set()

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        connections.add(id(request.transport))
        if b'"stream":true' not in body and b'"stream": true' not in body:
            return web.Response(body=json_body, content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for e in stream_events:
            await resp.write(e)
        await resp.write_eof()
        return resp

    async def stats(request: web.Request) -> web.Response:
        n = len(connections)
        connections.clear()
        return web.json_response({"connections": n})

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        app.router.add_get("/stats", stats)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        site = web.SockSite(runner, sock, backlog=4096)
        await site.start()
        port_out.send(sock.getsockname()[1])
        await asyncio.Event().wait()

    if uvloop is not None:
        uvloop.run(main())
    else:
        asyncio.run(main())


def _request() -> ModelRequest:
    tools = (ToolSpec("get_weather", "Get the current weather for a city",
                      {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}),)
    call = ToolCall("call_1", "get_weather", '{"city":"Paris"}')
    messages = (
        Message(role="user", content="What is the weather in Paris?"),
        Message(role="assistant", content=None, tool_calls=(call,)),
        Message(role="tool", content="21C, sunny", tool_call_id="call_1", name="get_weather"),
    )
    return ModelRequest(system="You are a helpful assistant.", messages=messages,
                        tools=tools, max_output_tokens=512, timeout_s=30.0)


Call = Callable[[], Awaitable[Any]]


async def _run(call: Call, concurrency: int, total: int) -> tuple[float, float]:
    """CPU seconds and wall seconds for `total` calls made by `concurrency` workers."""
    per_worker = total // concurrency

    async def worker() -> None:
        for _ in range(per_worker):
            await call()

    gc.collect()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.process_time() - cpu0, time.perf_counter() - wall0


Row = tuple[str, int, int, float, float, float, float, int, int, float | None, float | None]


async def bench_mode(port: int, stream: bool, rounds: int, plan: list[tuple[int, int]]
                     ) -> list[Row]:
    base = f"http://127.0.0.1:{port}/v1"
    stats_url = f"http://127.0.0.1:{port}/stats"
    request = _request()
    cfg = ProviderConfig(name="bench", kind="openai", base_url=base, model="bench",
                         stream=stream, max_connections=MAX_CONNECTIONS)
    provider = OpenAIProvider(cfg)
    payload = json.loads(provider.encode(request))  # the very same request, as a dict
    url = base + "/chat/completions"
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=MAX_CONNECTIONS),
        timeout=aiohttp.ClientTimeout(total=None, connect=10, sock_read=30))

    async def bare_json() -> Any:
        async with session.post(url, json=payload) as r:
            r.raise_for_status()
            return await r.json()

    async def bare_stream() -> Any:
        last = None
        async with session.post(url, json=payload) as r:
            r.raise_for_status()
            async for line in r.content:
                if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                    last = json.loads(line[6:])
        return last

    async def via_provider() -> Any:
        return await provider.complete(request)

    bus = EventBus(clock=SystemClock())
    deltas = 0

    async def on_delta(text: str) -> None:
        nonlocal deltas
        deltas += 1
        bus.publish(ev.ModelDelta(text=text), turn="t_bench")

    async def with_events() -> Any:
        return await provider.complete(request, on_delta)

    async def connections_since_last() -> int:
        async with session.get(stats_url) as r:
            return int((await r.json())["connections"])

    bare = bare_stream if stream else bare_json
    paths = [("bare", bare), ("provider", via_provider)]
    if stream:
        paths.append(("events", with_events))
    rows: list[Row] = []
    try:
        # Warm every path (connections, caches) before measuring.
        for _, fn in paths:
            await _run(fn, 10, 200)
        await connections_since_last()
        for concurrency, total in plan:
            cpu: dict[str, list[float]] = {label: [] for label, _ in paths}
            wall: dict[str, list[float]] = {label: [] for label, _ in paths}
            conns = {"bare": 0, "provider": 0}
            deltas_per_call: list[float] = []
            for _ in range(rounds):
                for label, fn in paths:
                    deltas = 0
                    c, w = await _run(fn, concurrency, total)
                    cpu[label].append(c / total)
                    wall[label].append(w)
                    # Read after every path, so none's connections count for the next.
                    used = await connections_since_last()
                    if label == "events":
                        deltas_per_call.append(deltas / total)
                    else:
                        conns[label] = max(conns[label], used)
            events_ms = statistics.median(cpu["events"]) * 1e3 if stream else None
            rows.append(("stream" if stream else "json", concurrency, total,
                         statistics.median(cpu["bare"]) * 1e3,
                         statistics.median(cpu["provider"]) * 1e3,
                         statistics.median(wall["bare"]), statistics.median(wall["provider"]),
                         conns["bare"], conns["provider"], events_ms,
                         statistics.median(deltas_per_call) if stream else None))
    finally:
        await session.close()
        await provider.aclose()
    return rows


async def bench(port: int, rounds: int, plan: list[tuple[int, int]]) -> None:
    rows = [row for stream in (False, True)
            for row in await bench_mode(port, stream, rounds, plan)]
    print(f"loop: {'uvloop' if uvloop is not None else 'asyncio'}, aiohttp "
          f"{aiohttp.__version__}, pool limit {MAX_CONNECTIONS}, median of {rounds} rounds")
    print(f"{'mode':<7}{'conc':>6}{'calls':>7}{'bare ms/call':>14}{'provider ms/call':>18}"
          f"{'ratio':>7}{'bare wall s':>13}{'prov wall s':>13}{'conns b/p':>11}"
          f"{'+events ms/call':>17}{'ratio':>7}{'deltas/call':>13}")
    for mode, conc, total, b, p, bw, pw, cb, cp, e, d in rows:
        events = "" if e is None or d is None else f"{e:>17.3f}{e / b:>7.2f}{d:>13.1f}"
        print(f"{mode:<7}{conc:>6}{total:>7}{b:>14.3f}{p:>18.3f}{p / b:>7.2f}"
              f"{bw:>13.2f}{pw:>13.2f}{f'{cb}/{cp}':>11}{events}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls-10", type=int, default=2000)
    ap.add_argument("--calls-1000", type=int, default=4000)
    args = ap.parse_args()

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    server = ctx.Process(target=_serve, args=(child,), daemon=True, name="bench-server")
    server.start()
    try:
        if not parent.poll(20):
            raise SystemExit("bench server did not start")
        port = parent.recv()
        plan = [(10, args.calls_10), (1000, args.calls_1000)]
        if uvloop is not None:
            uvloop.run(bench(port, args.rounds, plan))
        else:
            asyncio.run(bench(port, args.rounds, plan))
    finally:
        server.terminate()
        server.join(5)


if __name__ == "__main__":
    main()
