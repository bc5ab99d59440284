"""What durability costs: checkpoint cost per step, and resume time after a kill -9.

1. Checkpoint cost per step, in this process. The real Supervisor and TurnRunner run K
   turns x S steps against a zero-latency model and the `echo` tool, once with the real
   SQLiteStore (WAL, synchronous=FULL, group commit; every step checkpoints the model's
   reply and journals each tool call) and once with a store that discards every write (the
   baseline: the same runtime, nothing persisted). Sequential turns show the latency
   that fsync adds to a step; concurrent turns show what group commit makes of it. The
   figures: wall time and CPU (`time.process_time()`, SQLite's threads included) per
   step, the ratio SQLite / discard, and how many writes shared one commit.

2. Resume time, with the real daemon as a subprocess. N turns are parked (each waits on
   a clarify question) and the daemon is killed with SIGKILL; then the time from spawn
   to READY (the socket answers `ready`) and to every turn resumed (back to `waiting`)
   is measured against the start-up time of the same daemon on an empty store, rounds
   alternating, medians reported.

    python bench/bench_durability.py [--turns 200] [--steps 5] [--concurrent 100]
                                     [--resume 1000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bytecode import use_bytecode_cache
from bench.daemon_proc import DaemonProc
from bench.discard_store import discard_store

from turnkeeper import logging as tk_logging
from turnkeeper.clock import SystemClock
from turnkeeper.config import PolicyVersion, build_config
from turnkeeper.lifecycle.systemd import Notifier
from turnkeeper.policy.outcome import StopCode, TurnResult
from turnkeeper.store.base import Store
from turnkeeper.store.sqlite import SQLiteStore
from turnkeeper.supervisor import Supervisor
from turnkeeper.turn.record import TurnRecord

# -- 1. checkpoint cost per step ---------------------------------------------------------


def write_script(path: Path, steps: int) -> Path:
    script = {"scenarios": [{"steps": [
        {"tool_calls": [{"name": "echo", "arguments": {"text": "$turn step $step"}}]}
        for _ in range(1, steps)] + [{"reply": "done"}]}]}
    path.write_text(json.dumps(script))
    return path


async def steps_round(kind: str, turns: int, steps: int, concurrent: int,
                      tmp: Path) -> dict[str, float]:
    """Wall and CPU seconds per step for `turns` turns, `concurrent` at a time."""
    config = build_config({
        "daemon": {"max_concurrent_turns": concurrent, "max_queued_turns": turns + 1,
                   "state_dir": str(tmp), "log_level": "warning"},
        "providers": [{"name": "scripted", "kind": "scripted",
                       "script": str(write_script(tmp / "script.json", steps))}],
        "tools": [{"name": "echo", "kind": "echo", "idempotent": True,
                   "description": "Echo the arguments back",
                   "parameters": {"type": "object",
                                  "properties": {"text": {"type": "string"}}}}],
    })
    policy = PolicyVersion(version=1, config=config, source_path=None, content_hash="")
    sqlite = SQLiteStore(tmp / "turnkeeper.sqlite3") if kind == "sqlite" else None
    store: Store = sqlite if sqlite is not None else discard_store()
    await store.open()
    sup = Supervisor(policy=policy, store=store, clock=SystemClock(),
                     notifier=Notifier(None), config_path=None)
    finished: list[tuple[TurnRecord, TurnResult]] = []
    all_done = anyio.Event()

    def on_finished(record: TurnRecord, result: TurnResult) -> None:
        finished.append((record, result))
        if len(finished) >= turns:
            all_done.set()

    sup.on_turn_finished.append(on_finished)
    async with anyio.create_task_group() as tg:
        if sqlite is not None:
            await tg.start(sqlite.run)
        await sup.start(tg)
        gc.collect()
        commits0 = sqlite.commits if sqlite is not None else 0
        writes0 = sqlite.durable_writes if sqlite is not None else 0
        wall0, cpu0 = time.perf_counter(), time.process_time()
        for i in range(turns):
            await sup.submit(message=f"turn {i}", session=None, budget={}, deadline=None)
        await all_done.wait()
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        commits = (sqlite.commits - commits0) if sqlite is not None else 0
        writes = (sqlite.durable_writes - writes0) if sqlite is not None else 0
        await sup.stop()
        await store.close()
        tg.cancel_scope.cancel()
    bad = [(r.counters.steps, res.stopped_because.code.value) for r, res in finished
           if res.stopped_because.code is not StopCode.COMPLETED
           or r.counters.steps != steps]
    if bad:
        raise RuntimeError(f"turns did not run as scripted: {bad[:3]}")
    n = turns * steps
    return {"wall": wall / n, "cpu": cpu / n, "commits": commits, "writes": writes}


def checkpoint_cost(turns: int, steps: int, concurrent: int, rounds: int) -> None:
    tk_logging.configure(log_format="json", log_level="warning")
    results: dict[tuple[str, int], list[dict[str, float]]] = {}
    for _ in range(rounds):
        for conc in (1, concurrent):
            n = turns if conc > 1 else max(10, turns // 10)
            for kind in ("discard", "sqlite"):
                tmp = Path(tempfile.mkdtemp(prefix="tk-bench-"))
                try:
                    results.setdefault((kind, conc), []).append(anyio.run(
                        steps_round, kind, n, steps, conc, tmp, backend="asyncio",
                        backend_options={"use_uvloop": True}))
                finally:
                    shutil.rmtree(tmp, ignore_errors=True)

    def med(kind: str, conc: int, key: str) -> float:
        return statistics.median(r[key] for r in results[(kind, conc)])

    print(f"checkpoint cost per step ({steps} steps a turn; median of {rounds} rounds)")
    print(f"  {'turns at once':>14} {'store':>8} {'wall/step':>11} {'CPU/step':>10}")
    for conc in (1, concurrent):
        for kind in ("discard", "sqlite"):
            print(f"  {conc:>14} {kind:>8} {med(kind, conc, 'wall') * 1e3:>8.3f} ms"
                  f" {med(kind, conc, 'cpu') * 1e3:>7.3f} ms")
        wall = med("sqlite", conc, "wall") / med("discard", conc, "wall")
        cpu = med("sqlite", conc, "cpu") / med("discard", conc, "cpu")
        writes = med("sqlite", conc, "writes")
        commits = med("sqlite", conc, "commits")
        n = turns if conc > 1 else max(10, turns // 10)
        print(f"  {conc:>14} ratio sqlite/discard: wall x{wall:.2f}, CPU x{cpu:.2f};"
              f" {writes / (n * steps):.1f} durable writes a step,"
              f" {writes / max(1.0, commits):.1f} per commit (fsync)")


# -- 2. resume time -----------------------------------------------------------------------

CLARIFY_SCRIPT = """
[[scenarios]]
[[scenarios.steps]]
tool_calls = [{ name = "clarify", arguments = { question = "which one?" } }]
[[scenarios.steps]]
reply = "thanks"
"""


class Proc(DaemonProc):
    """A daemon whose turns park on a clarify question (the scripted provider)."""

    def __init__(self, root: Path, turns: int) -> None:
        root.mkdir(parents=True, exist_ok=True)
        script = root / "script.toml"
        script.write_text(CLARIFY_SCRIPT)
        super().__init__(
            root, f"max_concurrent_turns = {turns + 10}\nmax_queued_turns = {turns + 10}\n",
            f'[[providers]]\nname = "scripted"\nkind = "scripted"\nscript = "{script}"\n',
            timeout=30.0)


def resume_time(turns: int, rounds: int) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="tk-bench-resume-"))
    try:
        parked = Proc(tmp / "parked", turns)
        parked.spawn()
        parked.until(lambda s: s["state"] == "ready")
        for i in range(turns):
            code, data = parked.client.request("POST", "/v1/turns", {"message": f"t{i}"})
            if code != 202:
                raise RuntimeError(f"submit {i}: {code} {data}")
        parked.until(lambda s: s["turns"]["waiting"] == turns)
        parked.kill()
        db = tmp / "parked" / "state" / "turnkeeper.sqlite3"
        size = sum(p.stat().st_size for p in db.parent.glob("turnkeeper.sqlite3*"))
        empty_ready: list[float] = []
        resume_ready: list[float] = []
        resume_all: list[float] = []
        for r in range(rounds):
            empty = Proc(tmp / f"empty{r}", turns)
            t0 = empty.spawn()
            empty_ready.append(empty.until(lambda s: s["state"] == "ready") - t0)
            empty.kill()
            # A resumed turn is back when it has asked its question again: the time of
            # its new `turn.waiting` event, read from the store.
            before = parked.max_seq()
            wall0 = time.time()
            t0 = parked.spawn()
            resume_ready.append(parked.until(lambda s: s["state"] == "ready") - t0)
            deadline = time.monotonic() + 120
            while (done := parked.count("turn.waiting", before))[0] < turns:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"only {done[0]} of {turns} turns resumed")
                time.sleep(0.02)
            resume_all.append(done[1] - wall0)
            parked.kill()
        e, rr, ra = (statistics.median(x) for x in (empty_ready, resume_ready, resume_all))
        print(f"resume after kill -9 ({turns} turns parked on clarify, "
              f"{size / 1e6:.1f} MB of state; median of {rounds} rounds)")
        print(f"  start-up, empty store:          {e * 1e3:8.1f} ms to READY")
        print(f"  start-up, {turns} unfinished turns: {rr * 1e3:8.1f} ms to READY"
              f"   (x{rr / e:.2f} the empty start)")
        print(f"  every turn resumed (waiting):   {ra * 1e3:8.1f} ms"
              f"   (x{ra / e:.2f} the empty start; "
              f"{(ra - e) / turns * 1e3:.2f} ms a turn beyond it)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--concurrent", type=int, default=100)
    parser.add_argument("--resume", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(use_bytecode_cache())
    checkpoint_cost(args.turns, args.steps, args.concurrent, args.rounds)
    print()
    resume_time(args.resume, args.rounds)


if __name__ == "__main__":
    main()
