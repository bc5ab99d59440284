"""Submit throughput: N turns submitted concurrently through the control socket, one
per request and in batches, against a bare aiohttp server on a Unix socket answering the
same requests in the same run.

The daemon's intake is paused (`POST /v1/intake {"open": false}`), so the turns are
checked, written with their `turn.queued` event (SQLite, WAL, synchronous=FULL) and
queued, but none runs: what is measured is the cost of taking work in. The bare server
parses each body as JSON and answers 202 with a body of the same shape (a turn of the
same fields per submit), nothing else: the floor of HTTP over a Unix socket in Python.

Figures: accepted per second for each (wall), the daemon's CPU per submit, and the
ratio to the bare server.

    python bench/bench_submit.py [--turns 5000] [--concurrency 100] [--batch 100]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_concurrency import cpu_s
from bench.bytecode import use_bytecode_cache
from tests.integration.harness import Daemon

BARE_SERVER = r'''
import asyncio, json, sys, time
from aiohttp import web

def turn(body, i):
    now = time.time()
    tid = "t_%016x" % i
    return {"id": tid, "session": body.get("session") or tid, "message": body["message"],
            "state": "queued", "policy_version": 1, "created_at": now, "updated_at": now,
            "provider": "bench", "budget": body.get("budget") or {}, "deadline": None,
            "counters": {"provider_attempts": 0, "fallback_hops": 0, "restarts": 0,
                         "recovery_cycles": 0, "steps": 0},
            "usage": {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0,
                      "seconds": 0.0, "cost_usd": 0.0}, "result": None, "seq": i}

count = 0

async def submit(request):
    global count
    data = json.loads(await request.read())
    if isinstance(data, list):
        out = []
        for body in data:
            count += 1
            out.append({"status": 202, "turn": turn(body, count)})
        return web.json_response({"results": out}, status=202)
    count += 1
    return web.json_response({"turn": turn(data, count)}, status=202)

async def main():
    app = web.Application()
    app.router.add_post("/v1/turns", submit)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.UnixSite(runner, sys.argv[1]).start()
    print("ready", flush=True)
    await asyncio.Event().wait()

try:
    import uvloop
    uvloop.install()
except ImportError:
    pass
asyncio.run(main())
'''


async def flood(path: Path, turns: int, concurrency: int, batch: int) -> tuple[float, int]:
    """Submit `turns` turns, `batch` per request (1: a plain object), `concurrency`
    requests at a time. Returns (wall seconds, accepted)."""
    conn = aiohttp.UnixConnector(path=str(path), limit=concurrency)
    accepted = 0
    async with aiohttp.ClientSession(connector=conn) as session:
        sem = asyncio.Semaphore(concurrency)

        async def one(first: int) -> None:
            nonlocal accepted
            n = min(batch, turns - first)
            body: Any = ({"message": f"turn {first}"} if batch == 1 else
                         [{"message": f"turn {first + k}"} for k in range(n)])
            async with sem, session.post("http://turnkeeper/v1/turns", json=body) as resp:
                data = await resp.json()
                assert resp.status == 202, data
            accepted += 1 if batch == 1 else sum(r["status"] == 202 for r in data["results"])

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(0, turns, batch)))
        return time.perf_counter() - t0, accepted


def start_bare(tmp: Path) -> tuple[subprocess.Popen[str], Path]:
    path = tmp / "bare.sock"
    proc = subprocess.Popen([sys.executable, "-c", BARE_SERVER, str(path)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    return proc, path


def run_mode(label: str, path: Path, pid: int, turns: int, concurrency: int,
             batch: int) -> tuple[float, float]:
    cpu0 = cpu_s(pid)
    wall, accepted = asyncio.run(flood(path, turns, concurrency, batch))
    cpu = cpu_s(pid) - cpu0
    assert accepted == turns, f"{label}: {accepted} of {turns} accepted"
    return turns / wall, cpu / turns * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", type=int, default=5000)
    ap.add_argument("--concurrency", type=int, default=100)
    ap.add_argument("--batch", type=int, default=100)
    args = ap.parse_args()
    print(use_bytecode_cache())
    try:
        import uvloop
        uvloop.install()
    except ImportError:  # pragma: no cover
        pass
    tmp = Path(tempfile.mkdtemp(prefix="tk-bench-submit-"))
    d: Daemon | None = None
    bare: subprocess.Popen[str] | None = None
    try:
        bare, bare_path = start_bare(tmp)
        d = Daemon(tmp, f"""
[daemon]
max_queued_turns = {args.turns * 5}
max_connections = {args.concurrency * 2}
log_level = "warning"
""")
        d.start()
        assert d.proc is not None
        status, _ = d.post("/v1/intake", {"open": False})
        assert status == 200
        # A warm-up of each, not counted: imports, first connections, the store's pages.
        warm = min(500, args.turns)
        run_mode("warm-up", bare_path, bare.pid, warm, args.concurrency, 1)
        run_mode("warm-up", d.socket, d.proc.pid, warm, args.concurrency, 1)
        rows = []
        for batch in (1, args.batch):
            b_rate, b_cpu = run_mode("bare", bare_path, bare.pid, args.turns,
                                     args.concurrency, batch)
            t_rate, t_cpu = run_mode("turnkeeper", d.socket, d.proc.pid, args.turns,
                                     args.concurrency, batch)
            rows.append((batch, b_rate, b_cpu, t_rate, t_cpu))
        queued = d.get("/v1/status")[1]["queue"]["depth"]
        d.stop()
        print(f"submit: {args.turns} turns through the socket, {args.concurrency} requests at "
              f"a time, intake paused (written and queued, none run), {os.cpu_count()} cores")
        for batch, b_rate, b_cpu, t_rate, t_cpu in rows:
            what = "one per request " if batch == 1 else f"{batch} per request"
            print(f"  {what}: bare aiohttp {b_rate:8.0f}/s ({b_cpu:.3f} ms CPU each)   "
                  f"turnkeeper {t_rate:8.0f}/s ({t_cpu:.3f} ms CPU each)   "
                  f"ratio {b_rate / t_rate:.2f}x slower, CPU {t_cpu / b_cpu:.2f}x")
        single, batched = rows[0][3], rows[1][3]
        print(f"  batches of {args.batch} take turns {batched / single:.1f}x faster than single "
              f"submits; {queued} turns queued in all (warm-up included)")
    finally:
        if bare is not None:
            bare.terminate()
            bare.wait()
        if d is not None:
            d.kill()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
