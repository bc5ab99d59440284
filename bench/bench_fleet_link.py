"""Part 4 of bench/bench_fleet.py: the fleet over a slow link.

Two daemons (lease 1.5 s) reach the database through a proxy that delays each way by
each of `delays` seconds (tests/pg.py's CuttableProxy, 0 included: the same hops without
the delay), behind a counting proxy (tests/pg_wire.py). For each delay: a submit's
median with ten clients submitting at once (two single submits each; after one submit a
node, so a connection's first use is not in it), then T turns of
S steps (S-1 journalled calls of a non-idempotent HTTP tool) submitted in batches (and
before them one such turn alone: its time a step, the round trips a step meanwhile); the
time a step takes (the turns' own stored times: queueing for a slot not in it) and what
it takes more than with no delay, the statements and round trips a step on the wire,
the daemons' and the database backends' CPU a step, and the leases that lapsed
(`fleet.lease_lapsed` in the daemons' logs).

`before`: a daemon source tree (its `daemon` directory) the same rounds run again with
(PYTHONPATH), alternating with this checkout's, so the two compare in one run.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import asyncpg
from bench.bench_concurrency import cpu_s
from tests.integration.harness import Daemon
from tests.pg import CuttableProxy, create_database, drop_database, server_url
from tests.pg_wire import CountingProxy

Configure = Callable[[Path, str, str], str]  # (tmp, db url, node) -> config
TERMINAL = "('completed', 'partial', 'failed', 'blocked', 'cancelled')"


def count_finished(db: str) -> int:
    async def run() -> int:
        conn = await asyncpg.connect(db)
        try:
            return int(await conn.fetchval(f"SELECT count(*) FROM turns WHERE state IN {TERMINAL}"))
        finally:
            await conn.close()
    return asyncio.run(run())


def backends(db: str) -> list[int]:
    """The server processes serving the database's sessions (this one's excepted)."""
    async def run() -> list[int]:
        conn = await asyncpg.connect(db)
        try:
            return [int(r[0]) for r in await conn.fetch(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
                " AND pid <> pg_backend_pid()")]
        finally:
            await conn.close()
    return asyncio.run(run())


class BackendCpu:
    """The CPU the database's backends spent: each backend's CPU as last seen, less what
    it had spent when first seen at the start; sampled while the round runs, so a
    backend that ends before the round does still counts up to its last sample."""

    def __init__(self, db: str) -> None:
        self.db = db
        self.first: dict[int, float] = {pid: cpu_s(pid) for pid in backends(db)}
        self.last = dict(self.first)
        self.old = set(self.first)  # the backends there at the start

    def sample(self) -> None:
        for pid in backends(self.db):
            with contextlib.suppress(OSError):
                seen = cpu_s(pid)
                self.first.setdefault(pid, 0.0)
                self.last[pid] = seen

    @property
    def spent(self) -> float:
        return sum(self.last[p] - self.first.get(p, 0.0) for p in self.last)

    @property
    def new(self) -> tuple[int, float]:
        """The backends started during the round (connections the daemons opened) and
        the CPU they spent, counted in `spent`."""
        born = [p for p in self.last if p not in self.old]
        return len(born), sum(self.last[p] for p in born)


def wait_all(db: str, n: int) -> None:
    while count_finished(db) < n:
        time.sleep(0.05)


async def _step_s(db: str, steps: int, only: str | None = None) -> float:
    """The median time a turn took, from its first write after the claim to its end, a
    step: the turns' own stored times (queueing for a slot not in it). The turns of the
    batches, or the one whose message holds `only`."""
    conn = await asyncpg.connect(db)
    try:
        rows = (await conn.fetch("SELECT record FROM turns WHERE message LIKE $1", f"%{only}%")
                if only is not None else
                await conn.fetch("SELECT record FROM turns WHERE message NOT LIKE '%alone %'"))
    finally:
        await conn.close()
    spans = []
    for r in rows:
        rec = json.loads(r[0])
        begun = rec.get("started_at") or rec.get("created_at")
        spans.append((rec["updated_at"] - begun) / steps)
    return float(statistics.median(spans))


@dataclass
class Link:
    step_s: float
    submit_p50_s: float
    lapses: int
    statements: float  # a step
    round_trips: float  # a step
    node_cpu_ms: float  # a step
    db_cpu_ms: float  # a step
    alone_step_s: float = 0.0  # one turn running alone on a node: its time a step
    alone_round_trips: float = 0.0  # and the round trips a step while it ran


def concurrent_submits(daemons: list[Daemon], clients: int = 10, each: int = 2
                       ) -> list[float]:
    """`clients` threads at once, each submitting `each` turns one at a time: the
    seconds each submit took."""
    took: list[float] = []
    lock = threading.Lock()

    def client(c: int) -> None:
        for k in range(each):
            t0 = time.perf_counter()
            daemons[c % len(daemons)].submit(f"alone {c}.{k}")
            with lock:
                took.append(time.perf_counter() - t0)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return took


def submit_all(daemons: list[Daemon], turns: int, *, batch: int = 25) -> None:
    """Every turn submitted in batches (`POST /v1/turns` of a list), one client thread
    per node at once, so intake is not what the round measures."""
    def client(i: int) -> None:
        mine = list(range(i, turns, len(daemons)))
        for at in range(0, len(mine), batch):
            status, data = daemons[i].post(
                "/v1/turns", [{"message": f"work {n}"} for n in mine[at:at + batch]])
            assert status == 202, (status, data)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(daemons))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def one_link(configure: Configure, counter: CountingProxy, *, delay: float, turns: int,
             steps: int, env: dict[str, str]) -> Link:
    db = asyncio.run(create_database())
    link = CuttableProxy(counter.url(db), delay=delay).start()
    try:
        with tempfile.TemporaryDirectory(prefix="tk-bench-link-") as tmp:
            daemons = [Daemon(Path(tmp), configure(Path(tmp), link.url(), f"n{i}"),
                              name=f"n{i}", env=env).start() for i in range(2)]
            try:
                for d in daemons:  # each node's intake connection made, its statement prepared
                    d.submit("alone warm")
                took = concurrent_submits(daemons)
                wait_all(db, len(took) + len(daemons))
                counts0 = counter.snapshot()
                daemons[0].submit("alone solo")
                wait_all(db, len(took) + len(daemons) + 1)
                alone_rt = (counter.snapshot() - counts0).round_trips / steps
                alone = asyncio.run(_step_s(db, steps, "alone solo"))
                db_cpu = BackendCpu(db)
                cpu0 = sum(cpu_s(d.pid) for d in daemons)
                counts0 = counter.snapshot()
                submit_all(daemons, turns, batch=10)
                while not _all_done(db, len(took) + len(daemons) + 1 + turns, db_cpu):
                    time.sleep(0.05)
                counts = counter.snapshot() - counts0
                node_cpu = sum(cpu_s(d.pid) for d in daemons) - cpu0
                db_cpu.sample()
                per_step = asyncio.run(_step_s(db, steps))
                lapses = sum(d.log_text().count("fleet.lease_lapsed") for d in daemons)
            finally:
                for d in daemons:
                    d.kill()
    finally:
        link.cut()
        asyncio.run(drop_database(db))
    n = turns * steps
    return Link(per_step, statistics.median(took), lapses, counts.statements / n,
                counts.round_trips / n, node_cpu / n * 1e3, db_cpu.spent / n * 1e3,
                alone, alone_rt)


def _all_done(db: str, n: int, cpu: BackendCpu) -> bool:
    cpu.sample()
    return count_finished(db) >= n


def over_slow_link(configure: Configure, *, delays: list[float], turns: int, steps: int,
                   before: Path | None) -> dict[str, dict[float, Link]]:
    """Each code (this checkout's, and `before`'s when given) at each delay, the codes
    alternating at each delay."""
    codes: dict[str, dict[str, str]] = {"after": {}}
    if before is not None:
        codes = {"before": {"PYTHONPATH": str(before)}, **codes}
    out: dict[str, dict[float, Link]] = {code: {} for code in codes}
    counter = CountingProxy(server_url()).start()
    try:
        for delay in delays:
            for code, env in codes.items():
                out[code][delay] = one_link(configure, counter, delay=delay, turns=turns,
                                            steps=steps, env=env)
    finally:
        counter.stop()
    return out


def report(got: dict[str, dict[float, Link]], *, turns: int, steps: int) -> None:
    print(f"4. two nodes (lease 1.5 s), the database D ms away each way, 10 clients"
          f" submitting at once, then {turns} turns x {steps} steps")
    for code, links in got.items():
        base = links.get(0.0)
        for delay, r in links.items():
            added = (r.step_s - base.step_s) * 1e3 if base is not None else float("nan")
            rtt = 2 * delay * 1e3
            in_rtt = f" = {added / rtt:.1f} RTT" if rtt else ""
            sub_rtt = f" = {r.submit_p50_s * 1e3 / rtt:.1f} RTT" if rtt else ""
            print(f"  {code:<6} D {delay * 1e3:4.0f} ms: step {r.step_s * 1e3:6.1f} ms"
                  f" (+{added:5.1f} ms{in_rtt}), submit p50 {r.submit_p50_s * 1e3:6.1f} ms"
                  f"{sub_rtt}, {r.round_trips:5.2f} round trips and {r.statements:5.2f}"
                  f" statements a step, node CPU {r.node_cpu_ms:5.2f} ms and DB CPU"
                  f" {r.db_cpu_ms:5.2f} ms a step, leases lapsed {r.lapses}; one turn alone:"
                  f" {r.alone_step_s * 1e3:6.1f} ms and {r.alone_round_trips:5.2f} round trips"
                  " a step")

