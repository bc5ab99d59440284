"""Adaptive concurrency against a provider's concurrency quota: 1,000 turns submitted at
once through the real daemon to a model server that admits N requests at once and
answers 429 (Retry-After 1 s) to any request above that. The same run twice, in the same
process, the only difference `[adaptive_concurrency] enabled`:

  off: today's behaviour, every turn sends its call when it is ready and handles its own
       429s (retries with backoff, the breaker, recovery cycles);
  on:  each provider's in-flight limit is cut on a 429 and grows on success, and calls
       over it wait their turn in the daemon.

Everything else is the daemon's default resilience settings (api_max_retries 3, breaker
5 / 30 s, retry budget 0.2 / 3, recovery schedule 15-60 s), so this is what an operator
gets from flipping the one switch. Each turn is an agent of S steps (S-1 `echo` calls,
then the answer), each model call holding its slot `--latency` seconds.

Figures, counted at the model server and from the turns' results:
  completed turns per minute (from the first submit to the last result);
  429s the provider answered; turns that did not complete (and why).

    python bench/bench_adaptive.py [--turns 1000] [--capacity 32] [--steps 3]
                                   [--latency 0.2] [--order off,on]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bytecode import use_bytecode_cache
from tests.integration.fault_server import FaultServer, ok
from tests.integration.harness import Daemon


def daemon_config(server: FaultServer, turns: int, adaptive: bool) -> str:
    return f"""
[daemon]
max_concurrent_turns = {turns}
max_queued_turns = {turns * 10}
watch_config = false
log_level = "warning"

[adaptive_concurrency]
enabled = {"true" if adaptive else "false"}

[budget]
max_seconds = 3600.0

[[tools]]
name = "echo"
kind = "echo"
description = "Echo the arguments back"
parameters = {{ type = "object", properties = {{ text = {{ type = "string" }} }} }}
idempotent = true

[[providers]]
name = "primary"
kind = "openai"
base_url = "{server.base_url("primary")}"
model = "model-primary"
stream = false
timeout = 30.0
max_connections = {turns + 50}
"""


async def run_turns(d: Daemon, n: int) -> tuple[list[dict[str, Any]], float]:
    connector = aiohttp.UnixConnector(path=str(d.socket), limit=0)
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        t0 = time.monotonic()
        gate = asyncio.Semaphore(64)

        async def submit(i: int) -> str:
            async with gate, session.post("http://turnkeeper/v1/turns",
                                          json={"message": f"task {i}"}) as resp:
                assert resp.status == 202, await resp.text()
                return str((await resp.json())["turn"]["id"])

        ids = await asyncio.gather(*(submit(i) for i in range(n)))

        # Long polls, at most 200 at once (the control socket's connections are
        # limited too); a connection closed under us is asked again.
        polls = asyncio.Semaphore(200)

        async def wait(turn_id: str) -> dict[str, Any]:
            async with polls:
                while True:
                    try:
                        async with session.get(
                                f"http://turnkeeper/v1/turns/{turn_id}?wait=60") as resp:
                            turn: dict[str, Any] = (await resp.json())["turn"]
                    except (aiohttp.ClientError, KeyError):
                        await asyncio.sleep(0.1)
                        continue
                    if turn.get("result") is not None:
                        return turn

        turns = await asyncio.gather(*(wait(i) for i in ids))
        return list(turns), time.monotonic() - t0


def one(server: FaultServer, args: argparse.Namespace, adaptive: bool) -> dict[str, Any]:
    server.clear()
    tmp = Path(tempfile.mkdtemp(prefix="tk-adaptive-"))
    d = Daemon(tmp, daemon_config(server, args.turns, adaptive),
               name=f"adaptive-{'on' if adaptive else 'off'}").start()
    try:
        turns, took = asyncio.run(run_turns(d, args.turns))
        status = d.get("/v1/status")[1]
    finally:
        d.stop(timeout=120)
    seen = server.requests("primary")
    codes = collections.Counter(
        (t["result"]["stopped_because"]["code"]) for t in turns)
    completed = codes.pop("completed", 0)
    return {"adaptive": adaptive, "took": took, "completed": completed,
            "per_minute": completed / took * 60.0,
            "429s": sum(1 for s in seen if s.status == 429),
            "requests": len(seen), "other": dict(codes),
            "gate": status.get("in_flight", {}).get("primary", {})}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=1000)
    ap.add_argument("--capacity", type=int, default=32)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--latency", type=float, default=0.2)
    ap.add_argument("--order", default="off,on",
                    help="the runs, in order (alternate to check the order does not matter)")
    args = ap.parse_args()
    print(use_bytecode_cache())
    server = FaultServer().start()
    server.script("primary", then=ok("done", delay=args.latency,
                                     tool_steps=args.steps - 1))
    server.capacity("primary", args.capacity, retry_after="1")
    results = []
    try:
        for name in args.order.split(","):
            print(f"run: adaptation {name} ...", flush=True)
            results.append(one(server, args, name.strip() == "on"))
    finally:
        server.stop()
    print()
    print(f"{args.turns} turns at once, {args.steps} steps each, {args.latency:g} s per model "
          f"call; the model admits {args.capacity} calls at once, 429 + Retry-After 1 s "
          "above that; the daemon's default resilience settings")
    print(f"{'adaptation':<11}{'completed':>10}{'per min':>10}{'wall s':>9}{'429s':>8}"
          f"{'requests':>10}  not completed / final limit")
    for r in results:
        gate = r["gate"]
        limit = (f"limit {gate.get('limit')}, lowest {gate.get('lowest')}, "
                 f"{gate.get('decreases')} cuts" if r["adaptive"] else "-")
        print(f"{'on' if r['adaptive'] else 'off':<11}{r['completed']:>10}"
              f"{r['per_minute']:>10.0f}{r['took']:>9.1f}{r['429s']:>8}{r['requests']:>10}"
              f"  {r['other'] or 'none'} / {limit}")
    by = {r["adaptive"]: r for r in results}
    if True in by and False in by and by[False]["per_minute"]:
        on, off = by[True], by[False]
        print(f"ratio on/off: turns per minute {on['per_minute'] / off['per_minute']:.2f}x, "
              f"429s {on['429s'] / max(1, off['429s']):.3f}x")


if __name__ == "__main__":
    main()
