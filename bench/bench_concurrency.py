"""Concurrency: N concurrent turns of S steps through the control socket, against a
loopback model server with fixed latency, compared with a bare aiohttp loop making the
same N x S calls in the same run.

Figures: wall time of each and their ratio, the time the submits took, the daemon's CPU
per step against the bare loop's per call, control-socket latency under load (a
`GET /v1/status` every 50 ms on a new connection, from a process of its own as an
operator's `turnkeeper status` would be, so this client's loop, busy with the submits
and the event stream, is not what is timed: p50/p99), the daemon's event-loop lag during the run
(p50/p99 from its /metrics histogram, read before and after) against the bare loop's own
lag (the daemon's probe, run on the bare loop and put in the same buckets), how many
times steps were held for a later turn of the daemon's event loop (its share for turn
work: `turnkeeper_loop_held_total`), peak RSS per turn (VmHWM over the idle RSS), and
the CPU the model server and this client used (a run slowed by a starved machine shows
there, not in the daemon's CPU), and the machine's load average at the start and the
end of the daemon's run.

`--profile FILE` runs the daemon under cProfile (TURNKEEPER_PROFILE): read it with
`python -m pstats FILE` (the profiler slows the daemon: its figures are not comparable).

Submits go one per request (`--submit single`, 100 at a time) or as JSON lists of
`--batch` turns (`--submit batch`, 10 requests at a time). A submit refused while the
daemon is overloaded (503) is sent again after its Retry-After; the refusals are counted.

    python bench/bench_concurrency.py [--turns 5000] [--steps 3] [--latency 0.2]
                                      [--submit single|batch] [--batch 100]
                                      [--profile FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bytecode import use_bytecode_cache
from bench.fake_model import daemon_config, start_model, wait_port
from tests.integration.harness import Daemon

from turnkeeper.metrics import LAG_BUCKETS_S, LAG_INTERVAL_S

CONNECTIONS = 1000

# `GET /v1/status` every 50 ms, each on a new connection, until a line on stdin; then the
# latencies (seconds) as a JSON list on stdout. Run as a process of its own.
STATUS_PROBE = """
import json, socket, sys, threading, time
path, lat, stop = sys.argv[1], [], threading.Event()
threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
while not stop.is_set():
    t = time.perf_counter()
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(path)
        s.sendall(b"GET /v1/status HTTP/1.1\\r\\nHost: t\\r\\nConnection: close\\r\\n\\r\\n")
        while s.recv(65536):
            pass
    lat.append(time.perf_counter() - t)
    stop.wait(0.05)
print(json.dumps(lat))
"""


async def lag_probe(samples: list[float], stop: asyncio.Event) -> None:
    """The daemon's lag probe run on this loop: sleep LAG_INTERVAL_S, record how late the
    wake-up was, until `stop`."""
    while not stop.is_set():
        start = time.monotonic()
        await asyncio.sleep(LAG_INTERVAL_S)
        samples.append(max(0.0, time.monotonic() - start - LAG_INTERVAL_S))


async def bare(port: int, turns: int, steps: int) -> tuple[float, float, list[float]]:
    """The floor: each 'turn' makes `steps` sequential calls with a growing history.
    Returns wall and CPU seconds and the loop's lag samples during the run."""
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    conn = aiohttp.TCPConnector(limit=CONNECTIONS)
    async with aiohttp.ClientSession(connector=conn) as session:
        async def one(i: int) -> None:
            messages: list[dict[str, Any]] = [{"role": "user", "content": f"turn {i}"}]
            for _ in range(steps):
                async with session.post(url, json={"model": "bench", "messages": messages,
                                                   "max_tokens": 256}) as resp:
                    data = await resp.json()
                msg = data["choices"][0]["message"]
                messages.append(msg)
                for call in msg.get("tool_calls") or ():
                    messages.append({"role": "tool", "tool_call_id": call["id"],
                                     "content": call["function"]["arguments"]})

        lags: list[float] = []
        stop = asyncio.Event()
        prober = asyncio.create_task(lag_probe(lags, stop))
        t0, cpu0 = time.perf_counter(), time.process_time()
        await asyncio.gather(*(one(i) for i in range(turns)))
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        stop.set()
        await prober
        return wall, cpu, lags


def bucketed(samples: list[float]) -> dict[float, float]:
    """Samples as the daemon's histogram holds them: cumulative count by upper bound."""
    bounds = (*LAG_BUCKETS_S, float("inf"))
    return {le: float(sum(1 for s in samples if s <= le)) for le in bounds}


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_kb(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


async def through_daemon(d: Daemon, turns: int, batch: int) -> dict[str, Any]:
    conn = aiohttp.UnixConnector(path=str(d.socket), limit=200)
    async with aiohttp.ClientSession(connector=conn) as session:
        finished = 0
        all_done = asyncio.Event()
        subscribed = asyncio.Event()
        statuses: list[str] = []

        async def watch() -> None:
            nonlocal finished
            async with session.get("http://turnkeeper/v1/events",
                                   timeout=aiohttp.ClientTimeout(total=None)) as resp:
                subscribed.set()
                async for line in resp.content:
                    if b'"turn.finished"' in line:
                        ev = json.loads(line)
                        statuses.append(ev["result"]["status"])
                        finished += 1
                        if finished >= turns:
                            all_done.set()
                            return

        watcher = asyncio.create_task(watch())
        await subscribed.wait()
        sem = asyncio.Semaphore(100 if batch == 1 else 10)
        refused = 0

        async def submit(first: int) -> None:
            nonlocal refused
            n = min(batch, turns - first)
            body: Any = ({"message": f"turn {first}"} if batch == 1 else
                         [{"message": f"turn {first + k}"} for k in range(n)])
            while True:
                async with sem, session.post("http://turnkeeper/v1/turns", json=body) as resp:
                    if resp.status == 503:  # overloaded: come back when it says
                        refused += n
                        retry_after = float(resp.headers.get("Retry-After", "1"))
                    else:
                        assert resp.status == 202, await resp.text()
                        return
                await asyncio.sleep(retry_after)

        lag_before = await lag_buckets(session)
        prober = await asyncio.create_subprocess_exec(
            sys.executable, "-c", STATUS_PROBE, str(d.socket),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        t0 = time.perf_counter()
        await asyncio.gather(*(submit(i) for i in range(0, turns, batch)))
        submitted = time.perf_counter() - t0
        await asyncio.wait_for(all_done.wait(), timeout=600)
        wall = time.perf_counter() - t0
        out, _ = await prober.communicate(b"stop\n")
        status_lat = json.loads(out)
        watcher.cancel()
        lag = lag_quantiles(lag_before, await lag_buckets(session))
        held = await metric_value(session, "turnkeeper_loop_held_total")
        q = statistics.quantiles(status_lat, n=100) if len(status_lat) > 2 else [0.0] * 99
        return {"wall": wall, "submitted": submitted, "completed": statuses.count("completed"),
                "status_p50_ms": q[49] * 1000, "status_p99_ms": q[98] * 1000,
                "status_n": len(status_lat), "lag": lag, "held": held,
                "refused": refused}


async def lag_buckets(session: aiohttp.ClientSession) -> dict[float, float]:
    """The daemon's event-loop lag histogram now: cumulative count by upper bound."""
    async with session.get("http://turnkeeper/metrics") as resp:
        if resp.status != 200:
            return {}
        text = await resp.text()
    buckets: dict[float, float] = {}
    for line in text.splitlines():
        if line.startswith("turnkeeper_event_loop_lag_observed_seconds_bucket{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            buckets[float("inf") if le == "+Inf" else float(le)] = float(
                line.rsplit(" ", 1)[1])
    return buckets


async def metric_value(session: aiohttp.ClientSession, name: str) -> float | None:
    """An unlabelled metric's value from the daemon's /metrics now (None: not exported)."""
    async with session.get("http://turnkeeper/metrics") as resp:
        if resp.status != 200:
            return None
        text = await resp.text()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


def lag_quantiles(before: dict[float, float], after: dict[float, float]) -> str:
    """p50 and p99 of the lag samples taken between the two reads (each quantile is the
    upper bound of the bucket it falls in)."""
    buckets = sorted((le, n - before.get(le, 0.0)) for le, n in after.items())
    if not buckets or buckets[-1][1] == 0:
        return "not exported"
    total = buckets[-1][1]

    def q(p: float) -> str:
        bound = next(le for le, n in buckets if n >= p * total)
        return "over the last bucket" if bound == float("inf") else f"<= {bound * 1e3:g} ms"

    return f"p50 {q(0.5)}, p99 {q(0.99)} ({total:.0f} samples during the run)"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", type=int, default=5000)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--latency", type=float, default=0.2)
    ap.add_argument("--submit", choices=("single", "batch"), default="single")
    ap.add_argument("--batch", type=int, default=100)
    ap.add_argument("--profile", metavar="FILE", help="run the daemon under cProfile, its "
                    "statistics written to FILE (`python -m pstats FILE`)")
    args = ap.parse_args()
    print(use_bytecode_cache())
    batch = 1 if args.submit == "single" else max(1, args.batch)
    try:
        import uvloop
        uvloop.install()
    except ImportError:  # pragma: no cover
        pass
    model, port = start_model(latency=args.latency, steps=args.steps)
    tmp = Path(tempfile.mkdtemp(prefix="tk-bench-"))
    d: Daemon | None = None
    try:
        asyncio.run(wait_port(port))
        model_cpu0 = cpu_s(model.pid)
        bare_s, bare_cpu, bare_lags = asyncio.run(bare(port, args.turns, args.steps))
        model_cpu_bare = cpu_s(model.pid) - model_cpu0
        d = Daemon(tmp, f"""
[daemon]
max_concurrent_turns = {args.turns}
max_queued_turns = {args.turns * 2}
log_level = "warning"
# A starved machine (a load average of 17 on 2 cores) made the SQLite writer take over
# the default 5 s for a batch's commit: the run died on a 507 instead of measuring.
submit_timeout = 60.0

[budget]
max_seconds = 600.0

""" + daemon_config(port, max_connections=CONNECTIONS),
                   env={"TURNKEEPER_PROFILE": str(Path(args.profile).resolve())}
                   if args.profile else None)
        d.start()
        assert d.proc is not None
        idle_kb = rss_kb(d.proc.pid, "VmRSS")
        cpu0 = cpu_s(d.proc.pid)
        client_cpu0, model_cpu0 = time.process_time(), cpu_s(model.pid)
        load_before = os.getloadavg()
        res = asyncio.run(through_daemon(d, args.turns, batch))
        load_after = os.getloadavg()
        client_cpu = time.process_time() - client_cpu0
        model_cpu = cpu_s(model.pid) - model_cpu0
        overload = d.get("/v1/status")[1].get("overload", {})
        daemon_cpu = cpu_s(d.proc.pid) - cpu0
        peak_kb = rss_kb(d.proc.pid, "VmHWM")
        d.stop()
        calls = args.turns * args.steps
        floor = args.steps * args.latency
        print(f"concurrency: {args.turns} turns x {args.steps} steps = {calls} model calls, "
              f"{args.latency * 1000:.0f} ms latency (floor {floor:.1f} s), {os.cpu_count()} "
              f"cores")
        print(f"  bare aiohttp loop        {bare_s:8.2f} s")
        how = "one per request" if batch == 1 else f"in batches of {batch}"
        print(f"  turnkeeper (socket)      {res['wall']:8.2f} s   ratio {res['wall'] / bare_s:.2f}x"
              f"   (submits {how} took {res['submitted']:.2f} s; {res['completed']} "
              f"completed)")
        print(f"  overload: {res['refused']} submits refused 503 and sent again; guard "
              f"{overload.get('state', 'absent')}, {overload.get('spells', 0)} spells, worst "
              f"lag in a spell {overload.get('max_lag_s', 0.0):.3f} s")
        print(f"  CPU: bare loop {bare_cpu:.2f} s ({bare_cpu / calls * 1e3:.3f} ms/call), daemon "
              f"{daemon_cpu:.2f} s ({daemon_cpu / calls * 1e3:.3f} ms/step), ratio "
              f"{daemon_cpu / bare_cpu:.2f}x (the daemon's includes the control socket: "
              f"submits, the /v1/events stream, status probes)")
        print(f"  other CPU: model server {model_cpu_bare:.2f} s (bare run), {model_cpu:.2f} s "
              f"(daemon run); this client in the daemon run {client_cpu:.2f} s (submits, "
              f"the event stream, probes)")
        print(f"  status latency under load p50 {res['status_p50_ms']:.1f} ms, p99 "
              f"{res['status_p99_ms']:.1f} ms ({res['status_n']} requests)")
        print(f"  event-loop lag, daemon   {res['lag']}")
        held = res["held"]
        print("  steps held for the event loop's share: " + (
            "not exported" if held is None else
            f"{held:.0f} ({held / calls:.2f} a step; a step may be held more than once)"))
        print(f"  event-loop lag, bare     {lag_quantiles({}, bucketed(bare_lags))} (the same "
              f"{LAG_INTERVAL_S * 1e3:g} ms probe on the bare loop; worst "
              f"{max(bare_lags, default=0.0) * 1e3:.0f} ms)")
        print(f"  machine load (/proc/loadavg 1, 5, 15 min) at the daemon run's start "
              f"{' '.join(f'{x:.2f}' for x in load_before)}, at its end "
              f"{' '.join(f'{x:.2f}' for x in load_after)} ({os.cpu_count()} cores: over "
              f"that, processes wait for a core and every latency above with them)")
        print(f"  RSS idle {idle_kb / 1024:.0f} MiB, peak {peak_kb / 1024:.0f} MiB: "
              f"{(peak_kb - idle_kb) / args.turns:.1f} KiB per turn")
    finally:
        model.terminate()
        model.wait()
        if d is not None:
            d.kill()  # a no-op after d.stop(); a daemon left by an error does not outlive us
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
