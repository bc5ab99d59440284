"""A loopback OpenAI-compatible model server for benchmarks: fixed latency, a fixed
number of steps per conversation (tool calls to `echo`, then a final answer).

The step is read from the request: the number of assistant messages so far. Run it as a
process so its CPU is not counted with the daemon's:

    python bench/fake_model.py --port 0 --latency 0.2 --steps 3   (prints the port)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
from typing import Any

from aiohttp import web


def reply_for(body: dict[str, Any], steps: int) -> dict[str, Any]:
    done = sum(1 for m in body.get("messages", ()) if m.get("role") == "assistant")
    if done + 1 < steps:
        message: dict[str, Any] = {
            "role": "assistant", "content": None,
            "tool_calls": [{"id": f"call_{done}", "type": "function",
                            "function": {"name": "echo",
                                         "arguments": json.dumps({"text": f"step {done}"})}}]}
        finish = "tool_calls"
    else:
        message = {"role": "assistant", "content": f"done after {done + 1} steps"}
        finish = "stop"
    return {"id": "chatcmpl-bench", "object": "chat.completion", "created": 1,
            "model": "bench", "choices": [{"index": 0, "message": message,
                                           "finish_reason": finish}],
            "usage": {"prompt_tokens": 50 + 10 * done, "completion_tokens": 12,
                      "total_tokens": 62 + 10 * done}}


def make_app(latency_s: float, steps: int) -> web.Application:
    async def complete(request: web.Request) -> web.Response:
        body = await request.json()
        if latency_s:
            await asyncio.sleep(latency_s)
        return web.json_response(reply_for(body, steps))

    async def traces(request: web.Request) -> web.Response:
        """An OTLP/HTTP sink (bench_step's tracing row): read, answer an empty export
        response."""
        await request.read()
        return web.Response(body=b"", content_type="application/x-protobuf")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", complete)
    app.router.add_post("/v1/traces", traces)
    return app


def daemon_config(port: int, *, max_connections: int | None = None,
                  timeout: float = 120.0) -> str:
    """The daemon's provider and tool for this model: the `loopback` provider at `port`
    and the `echo` tool its conversations call (TOML, to follow a `[daemon]` table)."""
    connections = "" if max_connections is None else f"max_connections = {max_connections}\n"
    return (f'[[providers]]\nname = "loopback"\nkind = "openai"\n'
            f'base_url = "http://127.0.0.1:{port}/v1"\nmodel = "bench"\nstream = false\n'
            f"{connections}timeout = {timeout}\n\n"
            '[[tools]]\nname = "echo"\nkind = "echo"\nidempotent = true\n')


def start_model(*, latency: float, steps: int) -> tuple[subprocess.Popen[str], int]:
    """This server as a child process (its CPU is not the caller's), and its port."""
    proc = subprocess.Popen([sys.executable, __file__, "--latency", str(latency),
                             "--steps", str(steps)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


async def wait_port(port: int) -> None:
    for _ in range(200):
        try:
            _, w = await asyncio.open_connection("127.0.0.1", port)
            w.close()
            return
        except OSError:
            await asyncio.sleep(0.05)
    raise RuntimeError("loopback model server did not start")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--latency", type=float, default=0.2)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    port = args.port or free_port()
    print(port, flush=True)
    try:
        import uvloop
        uvloop.install()
    except ImportError:  # pragma: no cover
        pass
    web.run_app(make_app(args.latency, args.steps), host="127.0.0.1", port=port,
                print=None, access_log=None, backlog=4096)


if __name__ == "__main__":
    main()
