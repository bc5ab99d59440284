"""An outage of the primary under load: N concurrent turns through the real daemon while
the primary is down for D seconds (then recovers), with a healthy fallback.

The daemon (`python -m turnkeeper serve`, a subprocess, on its default resilience
settings: api_max_retries 3, breaker failure_threshold 5 / cooldown 30 s, retry budget
0.2 / 3, full-jitter backoff from 0.5 s) has two providers on one loopback model server
(tests/integration/fault_server.py, in this process): `primary` and `fallback`. Each turn
is an agent of S steps: the model asks for the `echo` tool S-1 times, then answers; every
model call takes `--latency` seconds. A closed loop keeps N turns in flight: when one
ends, the next is submitted; the first N arrive spread over one turn's length, as
independent users do, not in one lock-step wave. Timeline: `--warmup` s healthy once all
N are in flight, then the primary answers 503 to everything for `--outage` s, then it is
healthy again; the run goes on until the primary has served again and `--tail` s more
(at most the breaker cooldown + 15 s).

Figures (counted at the model server, not from the daemon's own account):
  primary attempts during the outage, against the naive figure: every turn exposed to
  the outage retrying on its own, `turns x (api_max_retries + 1)` attempts (a turn is
  exposed when it ran while the primary was down);
  turns completed, of all submitted (and of those exposed);
  time to recover: from the primary coming back to its first answered call, and to the
  first second in which it serves 90 % of the model calls again.

    python bench/bench_outage.py [--turns 1000] [--outage 30] [--steps 3] [--latency 1.0]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bytecode import use_bytecode_cache
from tests.integration.fault_server import FaultServer, fail, ok
from tests.integration.harness import Daemon

ATTEMPTS_PER_PROVIDER = 4  # the default api_max_retries (3) + 1


@dataclass
class Done:
    submitted: float
    finished: float
    state: str
    provider: str | None


def daemon_config(server: FaultServer, turns: int, cooldown: float | None) -> str:
    providers = "\n".join(f"""
[[providers]]
name = "{name}"
kind = "openai"
base_url = "{server.base_url(name)}"
model = "model-{name}"
stream = false
timeout = 30.0
max_connections = {turns + 50}
""" for name in ("primary", "fallback"))
    breaker = f"\n[circuit_breaker]\ncooldown = {cooldown}\n" if cooldown is not None else ""
    return f"""
[daemon]
max_concurrent_turns = {turns + 50}
max_queued_turns = 100000
watch_config = false
log_level = "warning"
{breaker}
[[tools]]
name = "echo"
kind = "echo"
description = "Echo the arguments back"
parameters = {{ type = "object", properties = {{ text = {{ type = "string" }} }} }}
idempotent = true
{providers}
"""


async def worker(session: aiohttp.ClientSession, stop: asyncio.Event, out: list[Done],
                 n: int, stagger_s: float) -> None:
    # Turns arrive spread over one turn's length, as independent users do, not in one
    # lock-step wave that sends every model call of a step at the same instant.
    await asyncio.sleep(random.uniform(0.0, stagger_s))
    i = 0
    while not stop.is_set():
        i += 1
        t0 = time.monotonic()
        try:
            async with session.post("http://turnkeeper/v1/turns",
                                    json={"message": f"worker {n} turn {i}"}) as resp:
                if resp.status != 202:
                    await asyncio.sleep(0.1)
                    continue
                turn_id = (await resp.json())["turn"]["id"]
        except aiohttp.ClientError:  # a kept-alive connection closed under us: again
            await asyncio.sleep(0.05)
            continue
        while True:
            try:
                async with session.get(
                        f"http://turnkeeper/v1/turns/{turn_id}?wait=60") as resp:
                    turn = (await resp.json())["turn"]
            except aiohttp.ClientError:
                await asyncio.sleep(0.05)
                continue
            if turn.get("result") is not None:
                break
        out.append(Done(t0, time.monotonic(), turn["state"], turn.get("provider")))


async def sample_lag(session: aiohttp.ClientSession, stop: asyncio.Event,
                     out: list[tuple[float, float]]) -> None:
    """The daemon's own event-loop lag gauge, every 0.5 s: how late the daemon is."""
    while not stop.is_set():
        try:
            async with session.get("http://turnkeeper/metrics") as resp:
                text = await resp.text()
            for line in text.splitlines():
                if line.startswith("turnkeeper_event_loop_lag_seconds "):
                    out.append((time.monotonic(), float(line.split()[1])))
        except (aiohttp.ClientError, ValueError):
            pass
        await asyncio.sleep(0.5)


def first_second_at_share(calls: list[Any], since: float, share: float) -> float | None:
    """Seconds after `since` of the first 1-second bucket whose model calls (answered,
    either provider) went to the primary for at least `share` of them."""
    buckets: dict[int, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for c in calls:
        if c.status == 200 and c.started >= since:
            buckets[int(c.started - since)][c.provider] += 1
    for second in sorted(buckets):
        b = buckets[second]
        total = b["primary"] + b["fallback"]
        if total and b["primary"] / total >= share:
            return float(second)
    return None


async def run(args: argparse.Namespace) -> None:
    server = FaultServer().start()
    answer = ok("done", delay=args.latency, tool_steps=args.steps - 1)
    server.script("primary", then=answer).script("fallback", then=answer)
    tmp = Path(tempfile.mkdtemp(prefix="tk-outage-"))
    d = Daemon(tmp, daemon_config(server, args.turns, args.cooldown), name="outage").start()
    done: list[Done] = []
    stop = asyncio.Event()
    connector = aiohttp.UnixConnector(path=str(d.socket), limit=0)
    timeout = aiohttp.ClientTimeout(total=None)
    try:
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            stagger = args.steps * args.latency
            workers = [asyncio.create_task(worker(session, stop, done, n, stagger))
                       for n in range(args.turns)]
            lags: list[tuple[float, float]] = []
            workers.append(asyncio.create_task(sample_lag(session, stop, lags)))
            await asyncio.sleep(stagger + args.warmup)
            t_down = time.monotonic()
            server.script("primary", then=fail(503))
            print(f"primary down at +{args.warmup:.0f} s for {args.outage:.0f} s ...",
                  flush=True)
            await asyncio.sleep(args.outage)
            t_up = time.monotonic()
            server.script("primary", then=answer)
            print("primary back; waiting for the daemon to use it again ...", flush=True)
            give_up = t_up + (args.cooldown or 30.0) + 15.0
            recovered_at: float | None = None
            while time.monotonic() < give_up:
                ok_calls = [c for c in server.requests("primary")
                            if c.status == 200 and c.started >= t_up]
                if ok_calls:
                    recovered_at = min(c.started for c in ok_calls)
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(args.tail)
            stop.set()
            print("draining the turns in flight ...", flush=True)
            await asyncio.gather(*workers)
    finally:
        d.stop(timeout=120)
        server.stop()

    calls = server.requests()
    during = [c for c in server.requests("primary") if t_down <= c.started < t_up]
    attempts = sum(1 for c in during if c.status != 200)
    exposed = [x for x in done if x.submitted < t_up and x.finished > t_down]
    naive = len(exposed) * ATTEMPTS_PER_PROVIDER
    states = collections.Counter(x.state for x in done)
    exposed_ok = sum(1 for x in exposed if x.state == "completed")
    share = first_second_at_share(calls, t_up, 0.9)
    fallback_during = sum(1 for c in server.requests("fallback")
                          if t_down <= c.started < t_up and c.status == 200)
    print()
    print(f"turns in flight             {args.turns} (closed loop), {args.steps} steps each, "
          f"model latency {args.latency:g} s")
    print(f"outage                      primary answers 503 for {args.outage:g} s; fallback "
          "healthy")
    failed = sorted(c.started for c in during if c.status != 200)
    burst = [t for t in failed if t < (failed[0] if failed else t_down) + 5.0]
    print(f"primary attempts in outage  {attempts}  ({len(burst)} in the first burst, over "
          f"{(burst[-1] - burst[0]) if burst else 0:.2f} s, before the breaker opened; "
          f"then {attempts - len(burst)} probes)")
    print(f"naive figure                {naive}  ({len(exposed)} turns exposed x "
          f"{ATTEMPTS_PER_PROVIDER} attempts)")
    if naive:
        print(f"ratio                       {attempts / naive:.4f}  "
              f"({naive / max(attempts, 1):.0f}x fewer)")
    print(f"fallback calls in outage    {fallback_during}")
    print(f"turns completed             {states['completed']} of {len(done)} "
          f"(exposed: {exposed_ok} of {len(exposed)}); other states: "
          f"{dict((k, v) for k, v in states.items() if k != 'completed') or 'none'}")
    if recovered_at is not None:
        print(f"time to recover             {recovered_at - t_up:.2f} s to the primary's "
              "first answered call after it came back")
    else:
        print("time to recover             the primary was not used again within "
              f"{give_up - t_up:.0f} s")
    lag_out = sorted(v for t, v in lags if t_down <= t < t_down + 5.0)
    if lag_out:
        print(f"daemon event-loop lag       {lag_out[len(lag_out) // 2]:.2f} s median, "
              f"{lag_out[-1]:.2f} s max in the outage's first 5 s (the breaker learns of a "
              "failure that late)")
    if share is not None:
        print(f"                            {share:.0f} s to the first second with >= 90 % of "
              "model calls on the primary")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=1000)
    ap.add_argument("--outage", type=float, default=30.0)
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--tail", type=float, default=3.0)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--latency", type=float, default=1.0)
    ap.add_argument("--cooldown", type=float, default=None,
                    help="circuit_breaker.cooldown (default: the daemon's, 30 s)")
    args = ap.parse_args()
    print(use_bytecode_cache())
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
