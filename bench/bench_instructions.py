"""Instructions a step of the whole daemon, counted, not timed: the real daemon (`python
-m turnkeeper serve`) under valgrind's callgrind, turns submitted through its socket in
batches, their events followed on `/v1/events`, the model a loopback server answering
at once (bench/fake_model.py, in a process of its own that is not counted).

On a shared machine a timed run of the same tree moves by tens of percent; an
instruction count moves by about 1%. The daemon runs twice, for `--turns A,B`; the
difference between the two counts divided by the steps between them is a step's cost,
start-up and shutdown cancelled out. It covers what `bench_step` leaves out: the HTTP
model call, the control socket (submits, the event stream) and the daemon's timers.
Valgrind runs the daemon about fifty times slower: the default runs take a few minutes.

    python bench/bench_instructions.py [--turns 200,400] [--steps 3]

Needs `valgrind` on the PATH.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shutil
import sys
import tempfile
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bytecode import use_bytecode_cache
from bench.fake_model import daemon_config, start_model, wait_port
from tests.integration.harness import Daemon

CALLGRIND = ("valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null")
START_TIMEOUT_S = 600.0
BATCH = 100


async def run_turns(d: Daemon, turns: int) -> int:
    """Submit `turns` turns in batches and wait for each one's `turn.finished`; the number
    that completed."""
    conn = aiohttp.UnixConnector(path=str(d.socket))
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        completed = finished = 0
        subscribed = asyncio.Event()

        async def follow() -> None:
            nonlocal completed, finished
            async with session.get("http://turnkeeper/v1/events") as resp:
                subscribed.set()
                async for line in resp.content:
                    if b'"turn.finished"' in line:
                        finished += 1
                        completed += b'"status":"completed"' in line
                        if finished >= turns:
                            return

        follower = asyncio.create_task(follow())
        await subscribed.wait()
        for first in range(0, turns, BATCH):
            body = [{"message": f"turn {i}"} for i in range(first, min(turns, first + BATCH))]
            async with session.post("http://turnkeeper/v1/turns", json=body) as resp:
                assert resp.status == 202, await resp.text()
        await follower
        return completed


def count(tmp: Path, port: int, turns: int, steps: int) -> int:
    """The daemon's instructions from its start to its exit, having run `turns` turns."""
    d = Daemon(tmp, f"""
[daemon]
max_concurrent_turns = {turns}
max_queued_turns = {turns * 2}
log_level = "warning"
# Under valgrind the event loop lags as a matter of course: intake stays open.
overload_lag = 0.0

[budget]
max_seconds = 3600.0

""" + daemon_config(port, timeout=3600.0), name=f"d{turns}", wrapper=CALLGRIND)
    d.start(wait=False)
    try:
        d.wait_ready(timeout=START_TIMEOUT_S)
        completed = asyncio.run(run_turns(d, turns))
        if completed != turns:
            raise RuntimeError(f"{turns - completed} of {turns} turns did not complete")
    finally:
        d.stop(timeout=START_TIMEOUT_S)
    found = re.findall(r"Collected : (\d+)", d.log_text())
    if not found:
        raise RuntimeError(f"no callgrind total in the daemon's log:\n{d.log_text()[-2000:]}")
    return int(found[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", default="200,400", help="two turn counts, A,B (A < B)")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    print(use_bytecode_cache())
    a, b = sorted(int(n) for n in args.turns.split(","))
    if shutil.which("valgrind") is None:
        sys.exit("bench_instructions: valgrind is not on the PATH")
    model, port = start_model(latency=0.0, steps=args.steps)
    tmp = Path(tempfile.mkdtemp(prefix="tk-bench-instr-"))
    try:
        asyncio.run(wait_port(port))
        counts = {n: count(tmp, port, n, args.steps) for n in (a, b)}
    finally:
        model.terminate()
        model.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    per_step = (counts[b] - counts[a]) / ((b - a) * args.steps)
    print(f"daemon instructions: {a} turns x {args.steps} steps {counts[a]:,}, "
          f"{b} turns {counts[b]:,}")
    print(f"  a step: {per_step / 1e6:.3f} M instructions "
          f"(the difference over {(b - a) * args.steps} steps)")


if __name__ == "__main__":
    main()
