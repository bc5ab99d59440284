"""What a step costs the PostgreSQL store's group commit: statements and milliseconds.

K turns, claimed by the store as a fleet node claims them (so every write is fenced by
its epoch), each runs S steps at once with the others; a step is what the runner writes:
an event queued (`append_event`), then the checkpoint awaited (`save_turn` with the
record, the checkpoint, the step's two conversation rows and a `turn.step` event). Every
statement the store sends is counted with asyncpg's query logger on each of its
connections, pooled and its own (BEGIN and COMMIT counted apart), and the wall time of
the steps measured.
Rounds alternate nothing (one store); the figure is the median of the rounds.

    python bench/bench_pg_commit.py [--turns 200] [--steps 10] [--rounds 3]

Needs a PostgreSQL server: TURNKEEPER_TEST_PG or postgresql://postgres@127.0.0.1:5432/postgres.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import asyncpg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "daemon"))

from tests.pg import create_database, drop_database

from turnkeeper.events import Event
from turnkeeper.store.base import MessageRows
from turnkeeper.store.postgres import PostgresStore

SENT: Counter[str] = Counter()


def _count(query: Any) -> None:
    head = query.query.split(None, 1)[0].upper()
    SENT["tx" if head in ("BEGIN", "BEGIN;", "COMMIT", "COMMIT;", "ROLLBACK", "ROLLBACK;")
         else "statements"] += 1


_create_pool = asyncpg.create_pool


def _counting_pool(*args: Any, **kwargs: Any) -> Any:
    async def init(conn: asyncpg.Connection) -> None:
        conn.add_query_logger(_count)

    return _create_pool(*args, init=init, **kwargs)


_connect = asyncpg.connect


async def _counting_connect(*args: Any, **kwargs: Any) -> asyncpg.Connection:
    """The store's own connections (the writer's, the renewal's, the intake's), outside
    the pool, counted as well."""
    conn: asyncpg.Connection = await _connect(*args, **kwargs)
    conn.add_query_logger(_count)
    return conn


asyncpg.create_pool = _counting_pool
asyncpg.connect = _counting_connect  # type: ignore[assignment]


def record(turn_id: str, step: int) -> dict[str, Any]:
    return {"id": turn_id, "session": turn_id, "state": "running", "message": "m" * 80,
            "created_at": 1.0, "updated_at": 1.0 + step, "inbox": [],
            "counters": {"steps": step}, "usage": {"total_tokens": 100 * step}}


async def one_round(url: str, turns: int, steps: int) -> tuple[float, float, float]:
    """ms per step, statements per step, BEGIN/COMMIT per step."""
    store = PostgresStore(url, node_id=f"bench-{time.monotonic_ns()}")
    await store.open()
    async with anyio.create_task_group() as tg:
        await tg.start(store.run)
        ids = [f"t_{time.monotonic_ns()}_{n}" for n in range(turns)]
        for turn_id in ids:
            await store.insert_turn({**record(turn_id, 0), "state": "queued"}, {})
        await store.claim(turns)
        seq = [10**9 + time.monotonic_ns() % 10**9]

        def event(turn_id: str, kind: str) -> Event:
            seq[0] += 1
            return Event(seq=seq[0], ts=1.0, type=kind, turn=turn_id, data={"n": seq[0]})

        async def turn(turn_id: str) -> None:
            for step in range(1, steps + 1):
                store.append_event(event(turn_id, "model.response"))
                conv = {"conversation": {"count": 2 * step, "turn_start": 0}}
                rows = (json.dumps({"role": "assistant", "content": f"call {step}"}),
                        json.dumps({"role": "tool", "content": f"result {step}"}))
                await store.save_turn(record(turn_id, step), conv,
                                      messages=MessageRows(2 * step - 2, rows),
                                      events=[event(turn_id, "turn.step")])

        SENT.clear()
        started = time.perf_counter()
        async with anyio.create_task_group() as steps_tg:
            for turn_id in ids:
                steps_tg.start_soon(turn, turn_id)
        wall = time.perf_counter() - started
        await asyncio.sleep(0)  # the query loggers run from call_soon
        sent = dict(SENT)
        await store.close()
    n = turns * steps
    return wall * 1000 / n, sent.get("statements", 0) / n, sent.get("tx", 0) / n


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=200)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    url = await create_database()
    try:
        results = [await one_round(url, args.turns, args.steps)
                   for _ in range(args.rounds)]
    finally:
        await drop_database(url)
    ms, statements, tx = (statistics.median(r[i] for r in results) for i in range(3))
    print(f"{args.turns} turns x {args.steps} steps, median of {args.rounds} rounds: "
          f"{ms:.3f} ms/step, {statements:.2f} statements/step "
          f"(+ {tx:.2f} BEGIN/COMMIT/ROLLBACK per step)")


if __name__ == "__main__":
    asyncio.run(main())
