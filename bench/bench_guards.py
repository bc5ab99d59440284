"""The guards' CPU per step, against the same step with no guards, measured in one run.

A step here is the real `TurnRunner` step (messages, checkpoint data, events, request
building, the tool call and its journal calls): steps 1..S-1 the model asks for
`echo(text="step N", n=N)` and the daemon's own `echo` tool answers, step S answers in
text. Three rows, harshest first:

  zero model, null store      a Provider whose replies are precomputed (no CPU of its
                              own) and a store whose writes do nothing: the guards
                              against the runner's own work alone;
  scripted model, null store  the offline `scripted` provider with zero delay (its
                              templating and token estimates are part of the step);
  zero model, sqlite store    the daemon's SQLiteStore (WAL, group commit, each
                              checkpoint durable) in a temp dir: the step as the daemon
                              runs it (CPU includes the writer thread).

  guards on   the runner as the daemon runs it: BudgetGuard (check, soft note, time left,
              max_output_tokens), LoopDetector (action key = sha256 of canonical JSON,
              before/after action, after step, snapshot in every checkpoint), FailureLoop.
  guards off  the same runner with those three replaced by objects that decide nothing
              (return None / the configured value; the loop guards' action keys, the
              sha256 of each call, go with them); the cost of calling them stays, so
              what differs is the guards' own work.

Rounds come in pairs, on and off back to back (the order alternating); each runs K turns
of S steps concurrently in one task group on one uvloop event loop; CPU is
`time.process_time()` over the round divided by K x S. The figure is the median of the
pairs' ratios (a shared machine drifts more between pairs than within one), with its
quartiles. The last line times the pure guard objects alone in a tight loop with the
same inputs (what one step asks of them).

    python bench/bench_guards.py [--turns 100] [--steps 10] [--rounds 15] [--only ROW]
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.discard_store import discard_store

from turnkeeper import logging as tk_logging
from turnkeeper.clock import SystemClock
from turnkeeper.config import PolicyVersion, build_config
from turnkeeper.events import EventBus
from turnkeeper.messages import ToolCall, dumps_arguments
from turnkeeper.policy.budget import BudgetGuard, BudgetLimits, BudgetUsage, Preflight
from turnkeeper.policy.classify import FailureClass
from turnkeeper.policy.failure_loop import FailureLoop
from turnkeeper.policy.loops import Action, LoopDetector, action_key
from turnkeeper.policy.outcome import Stop, StopCode
from turnkeeper.policy.usage import Prices
from turnkeeper.providers.base import (
    DeltaSink,
    ModelReply,
    ModelRequest,
    Usage,
)
from turnkeeper.runtime import Runtime, Shared
from turnkeeper.store.sqlite import SQLiteStore
from turnkeeper.turn.record import TurnRecord
from turnkeeper.turn.runner import TurnControl, TurnRunner

# -- the model and the store -----------------------------------------------------------

class ZeroModel:
    """Precomputed replies: no CPU of its own beyond a list lookup."""

    def __init__(self, steps: int) -> None:
        self._replies = [
            ModelReply(text=None, tool_calls=(ToolCall(
                id=f"call_{n}", name="echo",
                arguments=dumps_arguments({"text": f"step {n}", "n": n})),),
                usage=Usage(input_tokens=120 + 30 * n, output_tokens=20),
                finish_reason="tool_calls")
            for n in range(1, steps)
        ] + [ModelReply(text="done", tool_calls=(), usage=Usage(input_tokens=400,
                                                                 output_tokens=10),
                        finish_reason="stop")]

    @property
    def name(self) -> str:
        return "bench"

    async def complete(self, request: ModelRequest, on_delta: DeltaSink | None = None
                       ) -> ModelReply:
        return self._replies[min(request.step, len(self._replies)) - 1]

    async def aclose(self) -> None:
        return None


# -- guards that decide nothing ----------------------------------------------------------

class NoBudget(BudgetGuard):
    """A budget that stops nothing and warns of nothing. (Subclasses of the real guards:
    what the runner reads of them and they do not decide is theirs, so a guard that
    gains a method still runs here.)"""

    def __init__(self) -> None:
        super().__init__(BudgetLimits(max_tokens=10**9, max_seconds=1e9, max_steps=10**6))

    def check(self, usage: BudgetUsage, *, now: float) -> Stop | None:
        return None

    def check_time(self, usage: BudgetUsage, *, now: float, reserve_s: float = 0.0
                   ) -> Stop | None:
        return None

    def soft_warning(self, usage: BudgetUsage, *, now: float,
                     short: tuple[str, ...] = ()) -> None:
        return None

    def remaining_seconds(self, usage: BudgetUsage, *, now: float) -> float:
        return math.inf

    def preflight(self, usage: BudgetUsage, *, input_tokens: int, max_output_tokens: int,
                  prices: Prices | None = None) -> Preflight:
        return Preflight(max_output_tokens)

    def snapshot(self) -> dict[str, Any]:
        return {}


class NoLoops(LoopDetector):
    """A loop detector that records and decides nothing."""

    def before_action(self, action: Action) -> None:
        return None

    def after_action(self, action: Action, outcome: FailureClass | None) -> None:
        return None

    def after_step(self, observations: Sequence[str], *, state: str | None = None,
                   polling_only: bool = False) -> None:
        return None

    def snapshot(self) -> dict[str, Any]:
        return {}


class NoFailures(FailureLoop):
    """A failure loop that counts nothing."""

    def record_failure(self, tool: str, arguments: object, failure_class: FailureClass
                       ) -> None:
        return None

    def record_success(self, tool: str, arguments: object) -> None:
        return None

    def snapshot(self) -> dict[str, Any]:
        return {}


# (model, store) rows: the harshest first (nothing but the runner around the guards).
ROWS = (("zero", "null"), ("scripted", "null"), ("zero", "sqlite"))


# -- one round -----------------------------------------------------------------------------

def _script(steps: int, directory: str) -> str:
    """The same conversation for the scripted provider (its templating and token
    estimates are then part of every step)."""
    call = ('[[scenarios.steps]]\ntool_calls = [{ name = "echo", arguments = '
            '{ text = "step $step", n = "$step" } }]\n')
    path = Path(directory) / f"script-{steps}.toml"
    path.write_text("[[scenarios]]\n" + call * (steps - 1)
                    + '[[scenarios.steps]]\nreply = "done"\n')
    return str(path)


def _policy(steps: int, model: str, directory: str) -> PolicyVersion:
    provider: dict[str, Any] = {"name": "bench", "kind": "scripted"}
    if model == "scripted":
        provider["script"] = _script(steps, directory)
    config = build_config({"providers": [provider], "budget": {"max_steps": steps + 5}})
    return PolicyVersion(version=1, config=config, source_path=None, content_hash="")


async def _round(turns: int, steps: int, *, guards: bool, store_kind: str,
                 model: str = "zero") -> float:
    with tempfile.TemporaryDirectory(prefix="bench-guards-") as tmp:
        return await _round_in(tmp, turns, steps, guards=guards, store_kind=store_kind,
                               model=model)


async def _round_in(tmp: str, turns: int, steps: int, *, guards: bool, store_kind: str,
                    model: str) -> float:
    policy = _policy(steps, model, tmp)
    runtime = Runtime.build(policy)
    if model == "zero":
        runtime.providers["bench"] = ZeroModel(steps)
    shared = Shared()
    shared.apply(policy.config)
    clock = SystemClock()
    async with anyio.create_task_group() as daemon_tg:  # what the daemon runs in
        store: Any
        if store_kind == "sqlite":
            store = SQLiteStore(Path(tmp) / "turnkeeper.sqlite3")
            await store.open()
            await daemon_tg.start(store.run)
        else:
            store = discard_store()
        try:
            cpu = await _measure(turns, steps, runtime=runtime, shared=shared,
                                 clock=clock, store=store, guards=guards)
        finally:
            if store_kind == "sqlite":
                await store.close()
    return cpu


async def _measure(turns: int, steps: int, *, runtime: Runtime, shared: Shared,
                   clock: SystemClock, store: Any, guards: bool) -> float:
    bus = EventBus(clock=clock, persist=store.append_event)
    records = []
    for i in range(turns):
        now = clock.time()
        record = TurnRecord(id=f"t_{i}", session=f"s_{i}", message="run the steps",
                            created_at=now, updated_at=now, state="running",
                            policy_version=1, provider="bench")
        await store.insert_turn(record.to_json(), {})
        records.append(record)

    async def one(record: TurnRecord) -> None:
        runner = TurnRunner(record, TurnControl(), runtime=runtime, shared=shared,
                            store=store, bus=bus, clock=clock, checkpoint={},
                            history=[])
        if not guards:
            runner.ctx.guard = NoBudget()
            runner.ctx.loops = NoLoops()
            runner.ctx.failures = NoFailures()
        result = await runner.run()
        assert result is not None and result.stopped_because.code is \
            StopCode.COMPLETED, result
        assert record.counters.steps == steps

    gc.collect()
    cpu0 = time.process_time()
    async with anyio.create_task_group() as tg:
        for record in records:
            tg.start_soon(one, record)
    cpu = time.process_time() - cpu0
    return cpu / (turns * steps)


# -- the pure objects alone ----------------------------------------------------------------

def _pure(steps: int, turns: int) -> float:
    """What one step asks of the guards, with the same inputs (built before the clock
    starts), in a tight loop."""
    limits = BudgetLimits()
    inputs = []
    tokens = 0
    for n in range(1, steps + 1):
        args = {"text": f"step {n}", "n": n}
        inputs.append((BudgetUsage(tokens=tokens, seconds=0.001 * n, steps=n - 1), args,
                       [dumps_arguments(args)], n < steps))
        tokens += 150 + 30 * n
    cpu0 = time.process_time()
    for _ in range(turns):
        guard, loops, failures = BudgetGuard(limits), LoopDetector(), FailureLoop()
        for usage, args, observations, calls_tool in inputs:
            guard.check(usage, now=1.0)
            guard.soft_warning(usage, now=1.0)
            guard.check_time(usage, now=1.0)
            guard.preflight(usage, input_tokens=200 + 40 * usage.steps,
                            max_output_tokens=4096)
            guard.remaining_seconds(usage, now=1.0)
            if calls_tool:
                guard.check_time(usage, now=1.0)
                action = Action(tool="echo", key=action_key("echo", args))
                loops.before_action(action)
                loops.after_action(action, None)
                failures.record_success("echo", args)
                loops.after_step(observations)
            for _ in range(3):  # the runner checkpoints three times a step
                guard.snapshot()
                loops.snapshot()
                failures.snapshot()
    return (time.process_time() - cpu0) / (turns * steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--turns", type=int, default=100)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--only", choices=[f"{m}/{s}" for m, s in ROWS],
                    help="run one row (model/store)")
    args = ap.parse_args()
    rows = [r for r in ROWS if args.only in (None, f"{r[0]}/{r[1]}")]
    with open(os.devnull, "w") as devnull:  # the daemon's default: info, JSON lines
        tk_logging.configure(log_format="json", log_level="info", stream=devnull)
        try:
            import uvloop
            backend_options: dict[str, Any] = {"use_uvloop": True}
            del uvloop
        except ImportError:  # pragma: no cover
            backend_options = {}

        async def run_all(model: str, kind: str) -> tuple[list[float], list[float]]:
            on: list[float] = []
            off: list[float] = []
            for guards in (True, False):  # warm up both paths
                await _round(20, args.steps, guards=guards, store_kind=kind, model=model)
            for r in range(args.rounds):
                for guards in ((True, False) if r % 2 == 0 else (False, True)):
                    (on if guards else off).append(await _round(
                        args.turns, args.steps, guards=guards, store_kind=kind,
                        model=model))
            return on, off

        figures = {row: anyio.run(run_all, *row, backend="asyncio",
                                  backend_options=backend_options) for row in rows}
        pure = statistics.median(_pure(args.steps, args.turns) for _ in range(args.rounds))

    print(f"turns {args.turns} (concurrent) x steps {args.steps}, {args.rounds} pairs of "
          "rounds; CPU per step, median of rounds")
    base = None
    for (model, kind), (on, off) in figures.items():
        m_on, m_off = statistics.median(on), statistics.median(off)
        # Each pair ran back to back: its ratio is free of the machine's slower drift.
        ratio = statistics.median(a / b for a, b in zip(on, off, strict=True))
        q = statistics.quantiles([a / b for a, b in zip(on, off, strict=True)], n=4)
        base = m_off if base is None else base
        name = f"{model} model, {kind} store"
        print(f"  {name:<27} guards off {m_off * 1e6:6.1f} us  on {m_on * 1e6:6.1f} us  "
              f"guards add {(ratio - 1) * 100:+5.1f}%  (quartiles {(q[0] - 1) * 100:+.1f}% "
              f".. {(q[2] - 1) * 100:+.1f}%)")
    assert base is not None
    first = f"{rows[0][0]} model, {rows[0][1]} store"
    print(f"  pure guard objects alone   {pure * 1e6:6.1f} us a step = "
          f"{pure / base * 100:.1f}% of the {first} step without guards")
    print("  target: the guards add under 10% to a step against a zero-latency provider")


if __name__ == "__main__":
    main()
