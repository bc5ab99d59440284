"""What the shared PostgreSQL store and the fleet cost and give, with real daemons.

1. Nodes against a model with latency. N turns of S model calls each (the model asks
   for the `echo` tool S-1 times, then answers) against a real OpenAI-compatible model
   server on 127.0.0.1 that takes `--latency` s a call (bench/fake_model.py, its own
   process), each daemon running at most `--slots` turns at once: one daemon on its
   SQLite file (the baseline), then 1, 2 and 3 daemons on one PostgreSQL database
   (submitted round-robin). Wall time from the first submit to the last turn finished,
   against the floor (N / (slots x nodes) waves of S x latency), and the CPU the daemon
   processes spent per model step (utime + stime from /proc/PID/stat, before and after;
   the database's own CPU is not in it).
2. The store's cost per step. The same with a model that costs nothing (the scripted
   provider) and S-1 calls of a real HTTP tool (non-idempotent, so each is journalled
   before and after): one daemon on SQLite, one and three on PostgreSQL. Here the store
   is most of the work: wall and daemon CPU per step, as ratios to SQLite's.
3. Take-over. Three daemons (lease L s) run turns whose calls take 0.5 s; one is killed
   with SIGKILL; the time from the kill until every turn it held is finished elsewhere,
   against the lease (a node must wait for the lease to expire before it may claim).

Rounds alternate the setups; medians. The default run took 67 s when last run.

    python bench/bench_fleet.py [--turns 200] [--steps 5] [--rounds 2] [--lease 5]
                                [--model-turns 150] [--slots 25] [--latency 0.2]

Needs a PostgreSQL server: TURNKEEPER_TEST_PG or postgresql://postgres@127.0.0.1:5432/postgres.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import asyncpg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_concurrency import cpu_s
from bench.fake_model import daemon_config, start_model, wait_port
from tests.integration.harness import Daemon, scripted_provider
from tests.integration.tool_server import Reply, ToolServer
from tests.pg import create_database, drop_database

TERMINAL = "('completed', 'partial', 'failed', 'blocked', 'cancelled')"


def script(steps: int) -> str:
    calls = "".join(f'[[scenarios.steps]]\ntool_calls = [{{ name = "effect", arguments = '
                    f"{{ step = {n} }} }}]\n" for n in range(1, steps))
    return "[[scenarios]]\n" + calls + '[[scenarios.steps]]\nreply = "done"\n'


def fleet_section(db: str | None, node: str, lease: float) -> str:
    return (f'[store]\nurl = "{db}"\n[fleet]\nnode_id = "{node}"\nlease_seconds = {lease}\n'
            if db else "")


def config(tmp: Path, server: ToolServer, steps: int, *, db: str | None, node: str,
           lease: float) -> str:
    """The store part's daemon: the scripted model, S-1 calls of the HTTP tool."""
    path = tmp / "script.toml"
    path.write_text(script(steps))
    return textwrap.dedent(f"""
        [daemon]
        max_concurrent_turns = 64
        max_queued_turns = 10000
        [budget]
        max_steps = {steps + 5}
        [[tools]]
        name = "effect"
        kind = "http"
        url = "{server.url('/effect')}"
        idempotent = false
        timeout = 30.0
        """) + fleet_section(db, node, lease) + scripted_provider(path)


def model_config(port: int, slots: int, *, db: str | None, node: str, lease: float) -> str:
    """The latency part's daemon: `slots` turns at once against the loopback model."""
    return textwrap.dedent(f"""
        [daemon]
        max_concurrent_turns = {slots}
        max_queued_turns = 10000
        log_level = "warning"
        """) + daemon_config(port, timeout=60.0) + fleet_section(db, node, lease)


def count_finished(db: str) -> int:
    async def run() -> int:
        conn = await asyncpg.connect(db)
        try:
            return int(await conn.fetchval(f"SELECT count(*) FROM turns WHERE state IN {TERMINAL}"))
        finally:
            await conn.close()
    return asyncio.run(run())


Configure = Callable[[Path, str | None, str], str]  # (tmp, db, node) -> config


def run_round(configure: Configure, *, turns: int, nodes: int, pg: bool
              ) -> tuple[float, float]:
    """Wall seconds from the first submit to the last turn finished, and the CPU seconds
    the daemon processes spent meanwhile."""
    db = asyncio.run(create_database()) if pg else None
    with tempfile.TemporaryDirectory(prefix="tk-bench-fleet-") as tmp:
        daemons = [Daemon(Path(tmp), configure(Path(tmp), db, f"n{i}"), name=f"n{i}").start()
                   for i in range(nodes)]
        try:
            cpu0 = sum(cpu_s(d.pid) for d in daemons)
            started = time.perf_counter()
            ids = [daemons[i % nodes].submit(f"work {i}")["id"] for i in range(turns)]
            if db is not None:
                while count_finished(db) < turns:
                    time.sleep(0.05)
            else:
                for tid in ids:
                    daemons[0].wait(tid, timeout=600)
            wall = time.perf_counter() - started
            return wall, sum(cpu_s(d.pid) for d in daemons) - cpu0
        finally:
            for d in daemons:
                d.kill()
            if db is not None:
                asyncio.run(drop_database(db))


def measure(setups: dict[str, tuple[int, bool]], configure: Configure, *, turns: int,
            rounds: int) -> dict[str, tuple[float, float]]:
    """Each setup's median wall and daemon CPU, the setups alternating round by round."""
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in setups}
    for _ in range(rounds):
        for name, (nodes, pg) in setups.items():
            runs[name].append(run_round(configure, turns=turns, nodes=nodes, pg=pg))
    return {name: (statistics.median(w for w, _ in r), statistics.median(c for _, c in r))
            for name, r in runs.items()}


def takeover(server: ToolServer, *, steps: int, lease: float) -> tuple[float, int]:
    server.respond("/effect", Reply(200, delay=0.5))
    db = asyncio.run(create_database())
    try:
        with tempfile.TemporaryDirectory(prefix="tk-bench-fleet-") as tmp:
            daemons = [Daemon(Path(tmp), config(Path(tmp), server, steps, db=db,
                                                node=f"n{i}", lease=lease),
                              name=f"n{i}").start() for i in range(3)]
            try:
                for i in range(120):
                    daemons[i % 3].submit(f"work {i}")
                time.sleep(1.5)  # every node is in the middle of its turns' calls
                daemons[0].kill()
                killed = time.perf_counter()

                async def held() -> list[Any]:
                    conn = await asyncpg.connect(db)
                    try:
                        return [r[0] for r in await conn.fetch(
                            f"SELECT id FROM turns WHERE owner = 'n0' AND state NOT IN"
                            f" {TERMINAL}")]
                    finally:
                        await conn.close()

                victims = asyncio.run(held())  # n0 is dead: the set is final

                async def left() -> int:
                    conn = await asyncpg.connect(db)
                    try:
                        return int(await conn.fetchval(
                            f"SELECT count(*) FROM turns WHERE id = ANY($1::text[]) AND"
                            f" state NOT IN {TERMINAL}", victims))
                    finally:
                        await conn.close()

                while asyncio.run(left()):
                    time.sleep(0.05)
                return time.perf_counter() - killed, len(victims)
            finally:
                for d in daemons:
                    d.kill()
    finally:
        server.respond("/effect", Reply(200))
        asyncio.run(drop_database(db))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=200, help="turns of the store part")
    ap.add_argument("--steps", type=int, default=5, help="steps of a store part's turn")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--lease", type=float, default=5.0)
    ap.add_argument("--model-turns", type=int, default=150)
    ap.add_argument("--model-steps", type=int, default=3)
    ap.add_argument("--slots", type=int, default=25,
                    help="daemon.max_concurrent_turns of each node in the latency part")
    ap.add_argument("--latency", type=float, default=0.2, help="seconds a model call takes")
    args = ap.parse_args()
    lease = args.lease

    model, port = start_model(latency=args.latency, steps=args.model_steps)
    try:
        asyncio.run(wait_port(port))
        setups = {"sqlite, 1 daemon": (1, False), "postgres, 1 daemon": (1, True),
                  "postgres, 2 daemons": (2, True), "postgres, 3 daemons": (3, True)}
        got = measure(setups, lambda tmp, db, node: model_config(
            port, args.slots, db=db, node=node, lease=lease),
            turns=args.model_turns, rounds=args.rounds)
    finally:
        model.terminate()
        model.wait()
    steps = args.model_turns * args.model_steps
    print(f"1. {args.model_turns} turns x {args.model_steps} model calls of "
          f"{args.latency * 1000:.0f} ms, {args.slots} turns at once per daemon, median "
          f"of {args.rounds} rounds")
    base_wall, base_cpu = got["sqlite, 1 daemon"]
    for name, (wall, cpu) in got.items():
        nodes = setups[name][0]
        waves = -(-args.model_turns // (args.slots * nodes))
        floor = waves * args.model_steps * args.latency
        print(f"  {name:<22} {wall:6.2f} s (floor {floor:4.1f} s, x{base_wall / wall:.2f} "
              f"of the SQLite daemon's rate)  daemon CPU {cpu / steps * 1e3:5.2f} ms/step "
              f"(x{cpu / base_cpu:.2f})")

    server = ToolServer().start()
    try:
        setups = {"sqlite, 1 daemon": (1, False), "postgres, 1 daemon": (1, True),
                  "postgres, 3 daemons": (3, True)}
        got = measure(setups, lambda tmp, db, node: config(
            tmp, server, args.steps, db=db, node=node, lease=lease),
            turns=args.turns, rounds=args.rounds)
        steps = args.turns * args.steps
        print(f"2. the store's cost: {args.turns} turns x {args.steps} steps ({args.steps - 1}"
              f" journalled HTTP tool calls, a scripted model), median of {args.rounds} rounds")
        base_wall, base_cpu = got["sqlite, 1 daemon"]
        for name, (wall, cpu) in got.items():
            print(f"  {name:<22} {wall:6.2f} s  {args.turns / wall:6.1f} turns/s  "
                  f"{wall / steps * 1e3:5.2f} ms/step (x{wall / base_wall:.2f} of SQLite's)"
                  f"  daemon CPU {cpu / steps * 1e3:5.2f} ms/step (x{cpu / base_cpu:.2f})")
        took, n = takeover(server, steps=args.steps, lease=lease)
        print(f"3. take-over after kill -9: {n} turns finished elsewhere {took:.2f} s after "
              f"the kill (lease {lease:g} s: x{took / lease:.2f} of the lease)")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
