"""What the shared PostgreSQL store and the fleet cost and give, with real daemons.

1. Nodes against a model with latency. N turns of S model calls each (the model asks
   for the `echo` tool S-1 times, then answers) against a real OpenAI-compatible model
   server on 127.0.0.1 that takes `--latency` s a call (bench/fake_model.py, its own
   process), each daemon running at most `--slots` turns at once: one daemon on its
   SQLite file (the baseline), then 1, 2 and 3 daemons on one PostgreSQL database.
   Wall time from the first submit to the last turn finished, against the floor
   (N / (slots x nodes) waves of S x latency), the CPU the daemon processes spent per
   model step (utime + stime from /proc/PID/stat, before and after) and the CPU the
   database's backends spent (their processes sampled while the round runs).
2. The store's cost per step. The same with a model that costs nothing (the scripted
   provider) and S-1 calls of a real HTTP tool (non-idempotent, so each is journalled
   before and after): one daemon on SQLite, one, two and three on PostgreSQL. Here the
   store is most of the work: wall, node CPU and database CPU per step (and the ceiling
   the database CPU implies: steps a second per database core), and in a round of its
   own through a counting proxy (tests/pg_wire.py), the statements, round trips and
   commits a step.
3. Take-over. Three daemons (lease L s) run turns whose calls take 0.5 s; one is killed
   with SIGKILL while it holds turns; the time from the kill until every turn it held is
   finished elsewhere, against the lease (a node must wait for the lease to expire
   before it may claim). No ratio when the killed node held none.
4. A slow link (bench/bench_fleet_link.py). Two daemons (lease 1.5 s) reach the
   database through a proxy that delays each way by each of `--delays`: per delay, a
   submit's median with ten clients at once, the time a step takes more than with no
   delay, the statements and round trips a step on the wire, the node's and the
   database's CPU a step, the leases that lapsed; with `--before DIR`, the same again
   with another daemon source tree, alternating, to compare in one run.

Turns are submitted in batches of 25 (`POST /v1/turns` of a list), one client a node at
once, so intake does not decide the result. Every daemon runs with a bytecode cache
(bench/bytecode.py). Rounds alternate the setups; medians. `--only 2,4` runs some parts.

    python bench/bench_fleet.py [--turns 200] [--steps 5] [--rounds 2] [--lease 5]
                                [--model-turns 150] [--slots 25] [--latency 0.2]
                                [--delays 0,0.001,0.005,0.02] [--before DIR]
                                [--only 1,2,3,4] [--top N]

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_concurrency import cpu_s
from bench.bench_fleet_link import (
    BackendCpu,
    count_finished,
    over_slow_link,
    report,
    submit_all,
)
from bench.bytecode import use_bytecode_cache
from bench.fake_model import daemon_config, start_model, wait_port
from tests.integration.harness import Daemon, scripted_provider
from tests.integration.tool_server import Reply, ToolServer
from tests.pg import create_database, drop_database, server_url
from tests.pg_wire import CountingProxy, Counts

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


@dataclass
class Round:
    wall: float
    node_cpu: float  # the daemons' CPU seconds
    db_cpu: float  # the database backends' CPU seconds (0 for SQLite)
    counts: Counts | None = None  # on the wire, in a counting round
    new_backends: float = 0.0  # the backends started during the round
    new_backends_cpu: float = 0.0  # their CPU seconds (in db_cpu)


Configure = Callable[[Path, str | None, str], str]  # (tmp, db, node) -> config


def run_round(configure: Configure, *, turns: int, nodes: int, pg: bool,
              proxy: CountingProxy | None = None) -> Round:
    """From the first submit to the last turn finished: wall seconds, the daemons' CPU
    and the database backends' CPU; through `proxy`, what went over the wire."""
    db = asyncio.run(create_database()) if pg else None
    with tempfile.TemporaryDirectory(prefix="tk-bench-fleet-") as tmp:
        url = proxy.url(db) if proxy is not None and db is not None else db
        daemons = [Daemon(Path(tmp), configure(Path(tmp), url, f"n{i}"), name=f"n{i}").start()
                   for i in range(nodes)]
        try:
            db_cpu = BackendCpu(db) if db is not None else None
            cpu0 = sum(cpu_s(d.pid) for d in daemons)
            counts0 = proxy.snapshot() if proxy is not None else None
            started = time.perf_counter()
            if db is not None:
                submit_all(daemons, turns)
                while count_finished(db) < turns:
                    assert db_cpu is not None
                    db_cpu.sample()
                    time.sleep(0.05)
            else:
                ids = [daemons[0].submit(f"work {i}")["id"] for i in range(turns)]
                for tid in ids:
                    daemons[0].wait(tid, timeout=600)
            wall = time.perf_counter() - started
            node_cpu = sum(cpu_s(d.pid) for d in daemons) - cpu0
            counts = proxy.snapshot() - counts0 if proxy is not None and counts0 else None
            if db_cpu is not None:
                db_cpu.sample()
            born, born_cpu = db_cpu.new if db_cpu is not None else (0, 0.0)
            return Round(wall, node_cpu, db_cpu.spent if db_cpu else 0.0, counts, born,
                         born_cpu)
        finally:
            for d in daemons:
                d.kill()
            if db is not None:
                asyncio.run(drop_database(db))


def measure(setups: dict[str, tuple[int, bool]], configure: Configure, *, turns: int,
            rounds: int, count: bool = False) -> dict[str, Round]:
    """Each setup's median wall, daemon CPU and database CPU, the setups alternating
    round by round; with `count`, one more round of each PostgreSQL setup through the
    counting proxy for what it sends (its wall and CPU not used)."""
    runs: dict[str, list[Round]] = {name: [] for name in setups}
    for _ in range(rounds):
        for name, (nodes, pg) in setups.items():
            runs[name].append(run_round(configure, turns=turns, nodes=nodes, pg=pg))
    counted: dict[str, Counts] = {}
    if count:
        proxy = CountingProxy(server_url()).start()
        try:
            for name, (nodes, pg) in setups.items():
                if pg:
                    got = run_round(configure, turns=turns, nodes=nodes, pg=pg, proxy=proxy)
                    assert got.counts is not None
                    counted[name] = got.counts
        finally:
            proxy.stop()
    return {name: Round(statistics.median(r.wall for r in rs),
                        statistics.median(r.node_cpu for r in rs),
                        statistics.median(r.db_cpu for r in rs), counted.get(name),
                        statistics.median(r.new_backends for r in rs),
                        statistics.median(r.new_backends_cpu for r in rs))
            for name, rs in runs.items()}


def takeover(server: ToolServer, *, steps: int, lease: float) -> tuple[float, int]:
    server.respond("/effect", Reply(200, delay=0.5))
    db = asyncio.run(create_database())
    try:
        with tempfile.TemporaryDirectory(prefix="tk-bench-fleet-") as tmp:
            daemons = [Daemon(Path(tmp), config(Path(tmp), server, steps, db=db,
                                                node=f"n{i}", lease=lease),
                              name=f"n{i}").start() for i in range(3)]
            try:
                submit_all(daemons, 120, batch=10)

                async def held() -> list[Any]:
                    conn = await asyncpg.connect(db)
                    try:
                        return [r[0] for r in await conn.fetch(
                            f"SELECT id FROM turns WHERE owner = 'n0' AND state NOT IN"
                            f" {TERMINAL}")]
                    finally:
                        await conn.close()

                # n0 is killed while it holds turns in the middle of their calls.
                deadline = time.monotonic() + 30
                while not asyncio.run(held()) and time.monotonic() < deadline:
                    time.sleep(0.05)
                time.sleep(1.0)
                daemons[0].kill()
                killed = time.perf_counter()
                victims = asyncio.run(held())  # n0 is dead: the set is final

                async def left() -> int:
                    conn = await asyncpg.connect(db)
                    try:
                        return int(await conn.fetchval(
                            f"SELECT count(*) FROM turns WHERE id = ANY($1::text[]) AND"
                            f" state NOT IN {TERMINAL}", victims))
                    finally:
                        await conn.close()

                while victims and asyncio.run(left()) > 0:
                    time.sleep(0.05)
                return time.perf_counter() - killed, len(victims)
            finally:
                for d in daemons:
                    d.kill()
    finally:
        server.respond("/effect", Reply(200))
        asyncio.run(drop_database(db))


# What a statement is for, by the start of its text (the first that matches).
KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("renew", ("WITH n AS (UPDATE nodes SET heartbeat_at",)),
    ("claim", ("WITH c AS (SELECT t.id FROM turns t", "SELECT turn, data FROM messages",
               "SELECT turn, data FROM trail")),
    ("backlog poll", ("SELECT count(*) FROM turns",)),
    ("nodes poll", ("SELECT node_id, pid, host",)),
    ("budgets", ("WITH u AS (UPDATE nodes SET budgets",)),
    ("breakers", ("SELECT name, failures", "INSERT INTO breakers", "WITH b AS (INSERT INTO "
                  "breakers", "UPDATE breakers")),
    ("retry-after", ("SELECT name, extract(epoch FROM until", "WITH w AS (INSERT INTO "
                     "retry_after")),
    ("mail", ("SELECT id, turn, kind, body FROM mail", "INSERT INTO mail", "DELETE FROM mail")),
    ("notify", ("SELECT pg_notify",)),
    ("events read", ("SELECT tx::text", "SELECT pg_snapshot_xmin")),
    ("intake", ("INSERT INTO turns",)),
    ("begin/commit", ("BEGIN", "COMMIT", "ROLLBACK")),
)


def kind_of(text: str) -> str:
    for kind, starts in KINDS:
        if text.startswith(starts):
            return kind
    return "step writes and other"


def statement_lines(counts: Counts, steps: int, top: int) -> list[str]:
    """The statements of a counted round by what they are for: each kind's statements
    and milliseconds (send to completion) a step; then the `top` texts by time."""
    by: dict[str, list[float]] = {}
    for text, n in counts.queries.items():
        row = by.setdefault(kind_of(text), [0.0, 0.0])
        row[0] += n
        row[1] += counts.query_s.get(text, 0.0)
    lines = ["      " + "  ".join(
        f"{kind} {n / steps:.3f}/{s / steps * 1e3:.3f}"
        for kind, (n, s) in sorted(by.items(), key=lambda kv: -kv[1][1]))
        + "  (statements/ms a step)"]
    for text, s in sorted(counts.query_s.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"      {counts.queries[text] / steps:7.3f} {s / steps * 1e3:7.3f} ms  "
                     f"{text[:100]}")
    return lines


def per_step_line(name: str, r: Round, base: Round, steps: int) -> str:
    line = (f"  {name:<22} {r.wall:6.2f} s  {r.wall / steps * 1e3:5.2f} ms/step"
            f" (x{r.wall / base.wall:.2f})  node CPU {r.node_cpu / steps * 1e3:5.2f} ms/step"
            f" (x{r.node_cpu / base.node_cpu:.2f})")
    if r.db_cpu:
        line += (f"  DB CPU {r.db_cpu / steps * 1e3:5.2f} ms/step (ceiling"
                 f" {steps / r.db_cpu:,.0f} steps/s a database core; of it"
                 f" {r.new_backends_cpu / steps * 1e3:.2f} ms by {r.new_backends:g}"
                 " backends started during the round)")
    if r.counts is not None:
        c = r.counts
        line += (f"  {c.statements / steps:5.1f} statements, {c.round_trips / steps:5.1f}"
                 f" round trips, {c.commits / steps:4.2f} commits a step")
    return line


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
    ap.add_argument("--delays", default="0,0.001,0.005,0.02",
                    help="seconds each way of the slow link in part 4 ('': no part 4)")
    ap.add_argument("--before", type=Path, default=None,
                    help="part 4 again with this daemon source tree (its daemon/ directory)")
    ap.add_argument("--only", default="1,2,3,4", help="the parts to run")
    ap.add_argument("--top", type=int, default=0,
                    help="part 2: also the N statements that took longest, by text")
    args = ap.parse_args()
    lease = args.lease
    parts = set(args.only.split(","))
    print(use_bytecode_cache())

    if "1" in parts:
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
        base = got["sqlite, 1 daemon"]
        for name, r in got.items():
            nodes = setups[name][0]
            waves = -(-args.model_turns // (args.slots * nodes))
            floor = waves * args.model_steps * args.latency
            db_cpu = f"  DB CPU {r.db_cpu / steps * 1e3:5.2f} ms/step" if r.db_cpu else ""
            print(f"  {name:<22} {r.wall:6.2f} s (floor {floor:4.1f} s, x{base.wall / r.wall:.2f}"
                  f" of the SQLite daemon's rate)  node CPU {r.node_cpu / steps * 1e3:5.2f}"
                  f" ms/step (x{r.node_cpu / base.node_cpu:.2f}){db_cpu}")

    server = ToolServer().start()
    try:
        if "2" in parts:
            setups = {"sqlite, 1 daemon": (1, False), "postgres, 1 daemon": (1, True),
                      "postgres, 2 daemons": (2, True), "postgres, 3 daemons": (3, True)}
            got = measure(setups, lambda tmp, db, node: config(
                tmp, server, args.steps, db=db, node=node, lease=lease),
                turns=args.turns, rounds=args.rounds, count=True)
            steps = args.turns * args.steps
            print(f"2. the store's cost: {args.turns} turns x {args.steps} steps ({args.steps - 1}"
                  f" journalled HTTP tool calls, a scripted model), submitted in batches by"
                  f" one client a node at once, median of {args.rounds} rounds; statements,"
                  f" round trips and commits counted on the wire in a round of their own")
            base = got["sqlite, 1 daemon"]
            for name, r in got.items():
                print(per_step_line(name, r, base, steps))
                if r.counts is not None:
                    print("\n".join(statement_lines(r.counts, steps, args.top)))
        if "3" in parts:
            took, n = takeover(server, steps=args.steps, lease=lease)
            ratio = f" (lease {lease:g} s: x{took / lease:.2f} of the lease)" if n else (
                ": the killed node held no turn, nothing to take over")
            print(f"3. take-over after kill -9: {n} turns finished elsewhere {took:.2f} s after "
                  f"the kill{ratio}")
        if "4" in parts and args.delays:
            delays = [float(d) for d in args.delays.split(",")]
            got4 = over_slow_link(lambda tmp, db, node: config(
                tmp, server, args.steps, db=db, node=node, lease=1.5), delays=delays,
                turns=40, steps=args.steps, before=args.before)
            report(got4, turns=40, steps=args.steps)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
