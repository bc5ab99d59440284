"""What the shared PostgreSQL store and the fleet cost and give, with real daemons.

1. Throughput. N turns of S steps (S-1 calls of a real HTTP tool, then the answer;
   scripted model) submitted to: one daemon on its SQLite file (the baseline), one
   daemon on PostgreSQL, three daemons on one PostgreSQL database (submitted
   round-robin). Wall time from the first submit to the last turn finished, as turns/s
   and as a ratio to the baseline measured in the same run; rounds alternate, medians.
2. Take-over. Three daemons (lease L s) run turns whose calls take 0.5 s; one is killed
   with SIGKILL; the time from the kill until every turn it held is finished elsewhere,
   against the lease (a node must wait for the lease to expire before it may claim).

    python bench/bench_fleet.py [--turns 300] [--steps 5] [--rounds 3] [--lease 5]

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
from pathlib import Path
from typing import Any

import asyncpg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.integration.harness import Daemon, scripted_provider
from tests.integration.tool_server import Reply, ToolServer
from tests.pg import create_database, drop_database

TERMINAL = "('completed', 'partial', 'failed', 'blocked', 'cancelled')"


def script(steps: int) -> str:
    calls = "".join(f'[[scenarios.steps]]\ntool_calls = [{{ name = "effect", arguments = '
                    f"{{ step = {n} }} }}]\n" for n in range(1, steps))
    return "[[scenarios]]\n" + calls + '[[scenarios.steps]]\nreply = "done"\n'


def config(tmp: Path, server: ToolServer, steps: int, *, db: str | None, node: str,
           lease: float) -> str:
    path = tmp / "script.toml"
    path.write_text(script(steps))
    store = f'[store]\nurl = "{db}"\n[fleet]\nnode_id = "{node}"\nlease_seconds = {lease}\n' \
        if db else ""
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
        """) + store + scripted_provider(path)


def count_finished(db: str) -> int:
    async def run() -> int:
        conn = await asyncpg.connect(db)
        try:
            return int(await conn.fetchval(f"SELECT count(*) FROM turns WHERE state IN {TERMINAL}"))
        finally:
            await conn.close()
    return asyncio.run(run())


def run_round(server: ToolServer, *, turns: int, steps: int, nodes: int, pg: bool,
              lease: float) -> float:
    db = asyncio.run(create_database()) if pg else None
    with tempfile.TemporaryDirectory(prefix="tk-bench-fleet-") as tmp:
        daemons = [Daemon(Path(tmp), config(Path(tmp), server, steps, db=db, node=f"n{i}",
                                            lease=lease), name=f"n{i}").start()
                   for i in range(nodes)]
        try:
            started = time.perf_counter()
            ids = [daemons[i % nodes].submit(f"work {i}")["id"] for i in range(turns)]
            if db is not None:
                while count_finished(db) < turns:
                    time.sleep(0.05)
            else:
                for tid in ids:
                    daemons[0].wait(tid, timeout=600)
            return time.perf_counter() - started
        finally:
            for d in daemons:
                d.kill()
            if db is not None:
                asyncio.run(drop_database(db))


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
    ap.add_argument("--turns", type=int, default=300)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--lease", type=float, default=5.0)
    args = ap.parse_args()
    server = ToolServer().start()
    try:
        setups = {"sqlite, 1 daemon": (1, False), "postgres, 1 daemon": (1, True),
                  "postgres, 3 daemons": (3, True)}
        walls: dict[str, list[float]] = {name: [] for name in setups}
        for _ in range(args.rounds):
            for name, (nodes, pg) in setups.items():
                walls[name].append(run_round(server, turns=args.turns, steps=args.steps,
                                             nodes=nodes, pg=pg, lease=args.lease))
        base = statistics.median(walls["sqlite, 1 daemon"])
        print(f"{args.turns} turns x {args.steps} steps, median of {args.rounds} rounds")
        for name, values in walls.items():
            wall = statistics.median(values)
            print(f"  {name:<22} {wall:7.2f} s  {args.turns / wall:7.1f} turns/s"
                  f"  x{base / wall:.2f} of the SQLite baseline's rate")
        took, n = takeover(server, steps=args.steps, lease=args.lease)
        print(f"take-over after kill -9: {n} turns finished elsewhere {took:.2f} s after "
              f"the kill (lease {args.lease:g} s: x{took / args.lease:.2f} of the lease)")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
