"""Per-step orchestration cost: K turns x S steps against an in-process zero-latency
model and a no-op tool, CPU per step, against the CPU of one raw aiohttp model call to a
loopback server measured in the same run, and against LangGraph and pydantic-ai running
the same scripted conversation.

The conversation (every system runs the same one): the user's message; steps 1..S-1
the model asks for `echo(text="step N")` and the tool answers; at step S the model
answers in text. The model is a function in this process that returns the canned reply
at once, so what is measured is the runtime around it.

  raw call     the baseline: `aiohttp.ClientSession.post` of a chat completion request
               to a loopback server (bench/fake_model.py in a child process, so its CPU
               is not counted) and `resp.json()`, 10 calls in flight.
  turnkeeper   the real Supervisor and TurnRunner in this process (no control socket),
               with the real SQLiteStore (WAL, synchronous=FULL, group commit) in a temp
               dir, the event bus with the daemon's metrics listener, structlog at the
               daemon's default level (info, to /dev/null), the guards, and the `echo`
               tool of kind echo. Rows: a zero-CPU model (the Provider protocol, replies
               precomputed), the same on a store that discards every write (`unkept`:
               bench/discard_store.py, so no row is encoded or written: the runner, its
               guards, events and metrics alone), the offline `scripted` provider
               (its own templating and token estimates included), and the zero-CPU
               model with tracing on (`traced`: the OpenTelemetry tracer, every span
               sent over OTLP/HTTP to a sink in the loopback model's process; the `otel`
               extra).
  floor        the same turns hand-written with nothing but their durable writes: the
               rows the daemon's SQLite store writes for them (its schema, the same
               statements, JSON documents of the same shapes and sizes: the turn's row
               and checkpoint, five events a step, the conversation's rows, the tool
               call's journal entry), committed by a bare group commit in a worker
               thread (WAL, synchronous=FULL), a submit and each model reply awaited
               until committed, as the daemon does. No guards, no event bus, no metrics,
               no logs: what a step costs that only keeps what the daemon keeps, and so
               the least a step of this daemon could cost in this runtime.
  langgraph    StateGraph(MessagesState): an async "agent" node (the canned model) and
               the prebuilt ToolNode with an async echo tool, compiled with
               AsyncSqliteSaver (its SQLite checkpointer, WAL) in a temp dir, default
               durability ("async": every superstep checkpointed).
  pydantic-ai  Agent(FunctionModel(...)) with an async echo tool. It has no built-in
               checkpointer, so its figure carries no persistence at all.

The process runs with the cyclic collector's thresholds and the interpreter's switch
interval the daemon serves with (`turnkeeper.daemon.GC_THRESHOLD`, `SWITCH_INTERVAL_S`),
every system and the baseline alike.

All turns of a round run concurrently on one uvloop event loop; CPU is
`time.process_time()` (every thread of the process: SQLite writer threads included)
over the round divided by K x S; the part the SQLite writer thread spent in its commits
(`commit_cpu_s`, user and system time) is printed apart. Rounds alternate the systems;
each figure is the median of the rounds. A peer that cannot be imported is reported as
not run, with the reason.

    python bench/bench_step.py [--turns 200] [--steps 5] [--rounds 3] [--only turnkeeper]

`--profile N` runs one round of the zero-CPU-model turnkeeper under cProfile instead
(after the warm-up round, no baseline, no peers) and prints the N functions with the most
own time, then the N with the most cumulative time: where a step's CPU goes.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import importlib.metadata
import itertools
import json
import os
import pstats
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import orjson

from turnkeeper import logging as tk_logging
from turnkeeper.clock import SystemClock
from turnkeeper.config import PolicyVersion, build_config
from turnkeeper.daemon import GC_THRESHOLD, SWITCH_INTERVAL_S
from turnkeeper.lifecycle.systemd import Notifier
from turnkeeper.messages import ToolCall, dumps_arguments
from turnkeeper.policy.outcome import StopCode, TurnResult
from turnkeeper.providers.base import (
    DeltaSink,
    ModelReply,
    ModelRequest,
    Usage,
)
from turnkeeper.store.base import Store
from turnkeeper.store.sqlite import SQLiteStore
from turnkeeper.store.sqlite_schema import prepare
from turnkeeper.supervisor import Supervisor
from turnkeeper.turn.record import TurnRecord

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.discard_store import discard_store
from bench.fake_model import start_model, wait_port

RAW_CONCURRENCY = 10

Round = Callable[[int, int, Path], Awaitable[float]]


# -- the conversation -------------------------------------------------------------------

def tool_args(step: int) -> dict[str, str]:
    return {"text": f"step {step}"}


def final_text(steps: int) -> str:
    return f"done after {steps} steps"


# -- baseline: one raw aiohttp call -----------------------------------------------------

async def raw_calls(port: int, calls: int) -> float:
    """CPU seconds per call: a mid-conversation chat request (user, one tool step), the
    JSON answer read and parsed, RAW_CONCURRENCY calls in flight."""
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    call = {"id": "call_0", "type": "function",
            "function": {"name": "echo", "arguments": json.dumps(tool_args(0))}}
    body = {"model": "bench", "max_tokens": 256, "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "turn 0"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": json.dumps(tool_args(0))}],
        "tools": [{"type": "function", "function": {
            "name": "echo", "description": "Echo the arguments back",
            "parameters": {"type": "object", "properties": {"text": {"type": "string"}}}}}]}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=100)) as session:
        async def worker(n: int) -> None:
            for _ in range(n):
                async with session.post(url, json=body) as resp:
                    resp.raise_for_status()
                    await resp.json()

        await asyncio.gather(*(worker(20) for _ in range(RAW_CONCURRENCY)))  # warm up
        gc.collect()
        cpu0 = time.process_time()
        await asyncio.gather(*(worker(calls // RAW_CONCURRENCY)
                               for _ in range(RAW_CONCURRENCY)))
        return (time.process_time() - cpu0) / (calls // RAW_CONCURRENCY * RAW_CONCURRENCY)


# -- turnkeeper -------------------------------------------------------------------------

class ZeroModel:
    """A zero-latency, near-zero-CPU model speaking the Provider protocol: the replies of
    the conversation are built once, the step number picks one."""

    def __init__(self, steps: int) -> None:
        self._replies = [ModelReply(text=None, tool_calls=(ToolCall(
            id=f"call_{s}", name="echo", arguments=dumps_arguments(tool_args(s))),),
            usage=Usage(50 + 10 * s, 12), finish_reason="tool_calls", model="zero")
            for s in range(1, steps)]
        self._replies.append(ModelReply(text=final_text(steps), tool_calls=(),
                                        usage=Usage(50 + 10 * steps, 12),
                                        finish_reason="stop", model="zero"))

    @property
    def name(self) -> str:
        return "zero"

    async def complete(self, request: ModelRequest, on_delta: DeltaSink | None = None
                       ) -> ModelReply:
        reply = self._replies[min(request.step, len(self._replies)) - 1]
        if on_delta is not None and reply.text:
            await on_delta(reply.text)
        return reply

    async def aclose(self) -> None:
        return None


def write_script(path: Path, steps: int) -> Path:
    script = {"scenarios": [{"steps": [
        {"tool_calls": [{"name": "echo", "arguments": {"text": "step $step"}}]}
        for _ in range(1, steps)] + [{"reply": final_text(steps)}]}]}
    path.write_text(json.dumps(script))
    return path


# The SQLite writer thread's CPU in a turnkeeper round (its transactions, off the event
# loop; part of the round's CPU), by the round that ran it, until `bench` reads it.
WRITER_CPU: dict[Round, float] = {}


def turnkeeper_round(provider: str, *, keep: bool = True,
                     trace_port: int | None = None) -> Round:
    """`keep=False`: on a store that discards every write (and so encodes nothing).
    `trace_port`: with the OpenTelemetry tracer, its spans sent over OTLP/HTTP to the
    loopback model's sink on that port (the batch processor's thread and the flush of
    the round's last spans counted)."""
    async def run(turns: int, steps: int, tmp: Path) -> float:
        kind = "scripted"
        script = write_script(tmp / "script.json", steps)
        config = build_config({
            "daemon": {"max_concurrent_turns": turns, "max_queued_turns": turns,
                       "state_dir": str(tmp), "log_level": "info"},
            # Limits well past the run: the bench measures steps, not the guards' stops.
            "budget": {"max_steps": max(40, 2 * steps), "max_tokens": 100 * 200_000,
                       "max_seconds": 3600.0},
            "providers": [{"name": provider, "kind": kind, "script": str(script)}],
            "tools": [{"name": "echo", "kind": "echo", "idempotent": True,
                       "description": "Echo the arguments back",
                       "parameters": {"type": "object",
                                      "properties": {"text": {"type": "string"}}}}],
        })
        policy = PolicyVersion(version=1, config=config, source_path=None, content_hash="")
        clock = SystemClock()
        sqlite = SQLiteStore(tmp / "turnkeeper.sqlite3") if keep else None
        store: Store = sqlite if sqlite is not None else discard_store()
        await store.open()
        sup = Supervisor(policy=policy, store=store, clock=clock, notifier=Notifier(None),
                         config_path=None)
        if provider == "zero":
            sup.runtime.providers["zero"] = ZeroModel(steps)
        tracer = None
        if trace_port is not None:
            from turnkeeper.otel import OtelTracer
            tracer = OtelTracer(endpoint=f"http://127.0.0.1:{trace_port}",
                                service_name="bench", sample_ratio=1.0,
                                capture_content=False)
            sup.shared.tracer = tracer
        try:  # the daemon's metrics listener, when this tree has one
            from turnkeeper.metrics import Metrics
            metrics = Metrics(sup, clock=clock)
            sup.bus.listeners.append(metrics.on_event)
        except ImportError:
            pass
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
            cpu0 = time.process_time()
            writer0 = getattr(sqlite, "commit_cpu_s", None)  # None: a tree without it
            for i in range(turns):
                tg.start_soon(_submit, sup, f"turn {i}")
            await all_done.wait()
            if tracer is not None:  # every span of the round sent
                await anyio.to_thread.run_sync(tracer.provider.force_flush)
            cpu = time.process_time() - cpu0
            if sqlite is not None and writer0 is not None:
                WRITER_CPU[run] = sqlite.commit_cpu_s - writer0
            await sup.stop()
            await store.close()
            if tracer is not None:
                await tracer.aclose()
            tg.cancel_scope.cancel()
        bad = [(r.counters.steps, res.stopped_because.code.value) for r, res in finished
               if res.stopped_because.code is not StopCode.COMPLETED
               or r.counters.steps != steps]
        if bad:
            raise RuntimeError(f"turnkeeper turns did not run as scripted: {bad[:3]}")
        return cpu

    return run


async def _submit(sup: Supervisor, message: str) -> None:
    await sup.submit(message=message, session=None, budget={}, deadline=None)


# -- the floor: the same durable writes, nothing else -----------------------------------

class FloorWriter:
    """The daemon's group commit at its barest: statements queued on the event loop, one
    transaction in a worker thread for everything queued while the last one committed,
    the awaited writes answered after it."""

    def __init__(self, path: Path) -> None:
        self.conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        prepare(self.conn, path)  # the daemon's schema, WAL, synchronous=FULL
        self.queue: list[tuple[str, tuple[Any, ...]]] = []
        self.waiters: list[asyncio.Future[None]] = []
        self.wake = asyncio.Event()
        self.cpu_s = 0.0  # the worker thread's CPU in its transactions

    def put(self, sql: str, *args: Any) -> None:
        self.queue.append((sql, args))
        self.wake.set()

    def commit(self) -> asyncio.Future[None]:
        """Resolved once everything queued so far has committed."""
        done = asyncio.get_running_loop().create_future()
        self.waiters.append(done)
        self.wake.set()
        return done

    def _transaction(self, batch: list[tuple[str, tuple[Any, ...]]]) -> None:
        started = time.thread_time()
        self.conn.execute("BEGIN IMMEDIATE")
        for sql, args in batch:
            self.conn.execute(sql, args)
        self.conn.execute("COMMIT")
        self.cpu_s += time.thread_time() - started

    async def run(self) -> None:
        while True:
            await self.wake.wait()
            self.wake.clear()
            batch, self.queue = self.queue, []
            waiters, self.waiters = self.waiters, []
            await asyncio.to_thread(self._transaction, batch)
            for done in waiters:
                done.set_result(None)


_EVENT = ("INSERT OR IGNORE INTO events (seq, turn, turn_no, ts, type, data) "
          "VALUES (?, ?, ?, ?, ?, ?)")
_SAVE = "UPDATE turns SET state = ?, updated_at = ?, record = ?, checkpoint = ? WHERE id = ?"


async def floor_turn(w: FloorWriter, no: int, steps: int, seqs: Iterator[int]) -> None:
    """One turn of the conversation, its rows as the daemon writes them (the same
    statements, the same JSON documents' shapes) and nothing else: no guards, no
    counters but the record's, no event bus, no metrics, no logs."""
    tid = f"t_{no:016x}"
    now = time.time()
    counters = {"provider_attempts": 0, "fallback_hops": 0, "restarts": 0,
                "recovery_cycles": 0, "steps": 0, "tool_attempts": 0}
    usage = {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0, "seconds": 0.0,
             "cost_usd": 0.0}
    record: dict[str, Any] = {
        "id": tid, "session": tid, "state": "queued", "policy_version": 1,
        "created_at": now, "updated_at": now, "provider": "zero", "counters": counters,
        "usage": usage, "budget": {}, "deadline": None, "result": None, "seq": no,
        "limits": {"max_tokens": 20_000_000, "max_seconds": 3600.0, "max_steps": 40,
                   "max_cost_usd": 0.0, "soft_limit": 0.8, "deadline": None},
        "profile": None, "model": None, "would_have_stopped": []}
    tail: list[str] = []
    checkpoint: dict[str, Any] = {
        "conversation": {"count": 1, "turn_start": 0}, "trail": {"count": 0, "tail": tail},
        "budget": {"warned": []}, "budget_watch": None,
        "loops": {"last_outcome": {}, "no_progress": 0},
        "failures": {"signature": None, "streak": 0},
        "chain": {"version": 1, "providers": ["zero"], "phase": "ready",
                  "current_provider": "zero", "provider_attempts": 0, "fallback_hops": 0,
                  "recovery_cycles": 0, "pass_exits": [], "pass_retry_after_s": None,
                  "pass_reopen_s": None, "previous_delay_s": None, "pass_done": True},
        "open_issues": [], "waiting_since": None, "recover_until": None,
        "pending_stop": None, "effects": {"turn": tid},
        "extension": {"granted": 0, "last_progress_step": 0, "marks": [0, 0, 0],
                      "plan": [], "completed": []}, "event_seq": 0}

    def event(kind: str, **fields: Any) -> None:
        seq, ts = next(seqs), time.time()
        checkpoint["event_seq"] = seq
        w.put(_EVENT, seq, tid, no, ts, kind,
              orjson.dumps({"seq": seq, "ts": ts, "turn": tid, "type": kind, **fields}))

    def save(state: str) -> None:
        record["state"], record["updated_at"] = state, time.time()
        w.put(_SAVE, state, record["updated_at"], orjson.dumps(record),
              orjson.dumps(checkpoint), tid)

    message = f"turn {no}"
    w.put("INSERT INTO turns (id, seq, session, state, created_at, updated_at, record, "
          "checkpoint) VALUES (?, ?, ?, ?, ?, ?, ?, ?)", tid, no, tid, "queued", now, now,
          orjson.dumps(record), "{}")
    w.put("INSERT INTO turn_input (turn, message) VALUES (?, ?)", tid, message)
    event("turn.queued", session=tid, message=message, policy_version=1)
    await w.commit()  # a submit is answered once its turn is stored
    event("turn.started", policy_version=1, provider="zero")
    conversation = [{"role": "user", "content": message}]
    written = 0
    for step in range(1, steps + 1):
        counters["steps"] = step
        event("step.started", step=step, provider="zero")
        event("model.request", provider="zero", attempt=1, step=step,
              messages=len(conversation))
        args = tool_args(step)
        if step < steps:
            calls = [{"id": f"call_{step}", "name": "echo", "arguments": args}]
            reply: dict[str, Any] = {"role": "assistant", "content": None,
                                     "tool_calls": calls}
        else:
            reply = {"role": "assistant", "content": final_text(steps), "tool_calls": []}
        usage["input_tokens"] += 50 + 10 * step
        usage["output_tokens"] += 12
        usage["total_tokens"] = usage["input_tokens"] + usage["output_tokens"]
        event("model.response", provider="zero",
              usage={"input_tokens": 50 + 10 * step, "output_tokens": 12}, cost_usd=0.0,
              finish_reason="tool_calls" if reply["tool_calls"] else "stop",
              tool_calls=len(reply["tool_calls"]))
        conversation.append(reply)
        rows = [orjson.dumps(m).decode() for m in conversation[written:]]
        w.put("INSERT OR REPLACE INTO messages (turn_no, idx, data) VALUES "
              + ",".join(["(?,?,?)"] * len(rows)),
              *(v for i, row in enumerate(rows) for v in (no, written + i, row)))
        written = len(conversation)
        checkpoint["conversation"]["count"] = written
        if not reply["tool_calls"]:
            record["result"] = {
                "status": "completed",
                "stopped_because": {"code": "completed", "counter": None, "value": None,
                                    "limit": None, "message": "the agent answered"},
                "answer": reply["content"],
                "partial": [line[1:] for line in tail if line[0] == "p"],
                "open_issues": []}
            save("completed")
            event("turn.finished", result=record["result"])
            await w.commit()
            return
        save("running")
        await w.commit()  # the reply is stored before any tool runs
        for call in reply["tool_calls"]:
            key = f"{tid}.{step}.0"
            arguments = orjson.dumps(call["arguments"]).decode()
            w.put("INSERT OR IGNORE INTO journal (key, turn, tool, arguments, idempotent) "
                  "VALUES (?, ?, ?, ?, ?)", key, tid, "echo", arguments, 1)
            event("tool.call", tool="echo", call_id=call["id"], key=key,
                  arguments=call["arguments"])
            content = json.dumps(call["arguments"])
            w.put("UPDATE journal SET outcome = ? WHERE key = ?",
                  orjson.dumps({"content": content, "state": None, "kind": "ok",
                                "failure": None}), key)
            event("tool.result", tool="echo", call_id=call["id"], key=key, ok=True,
                  content=content)
            conversation.append({"role": "tool", "tool_call_id": call["id"],
                                 "content": content})
            # The partial-work line and, of the same size as the loop guard's, three
            # key lines (the guard's hashing is the daemon's work, not a row's).
            tail += [f"pstep {step}: echo {arguments} -> ok", f"lr{no:08x}{step:08x}",
                     f"lv{no:08x}{step:08x}", f"lo{no:08x}{step:08x}"]


def floor_round() -> Round:
    async def run(turns: int, steps: int, tmp: Path) -> float:
        w = FloorWriter(tmp / "floor.sqlite3")
        seqs = itertools.count(1)
        writer = asyncio.ensure_future(w.run())
        try:
            gc.collect()
            cpu0 = time.process_time()
            writer0 = w.cpu_s
            await asyncio.gather(*(floor_turn(w, i + 1, steps, seqs) for i in range(turns)))
            cpu = time.process_time() - cpu0
            WRITER_CPU[run] = w.cpu_s - writer0
        finally:
            writer.cancel()
            w.conn.close()
        return cpu

    return run


# -- LangGraph --------------------------------------------------------------------------

def langgraph_round() -> Round:
    from langchain_core.messages import AIMessage, AnyMessage, HumanMessage
    from langchain_core.tools import tool
    from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver
    from langgraph.graph import START, MessagesState, StateGraph
    from langgraph.prebuilt import ToolNode, tools_condition

    @tool  # type: ignore[untyped-decorator, unused-ignore]  # typed where it is installed
    async def echo(text: str) -> str:
        """Echo the arguments back."""
        return json.dumps({"text": text}, sort_keys=True)

    async def run(turns: int, steps: int, tmp: Path) -> float:
        async def agent(state: MessagesState) -> dict[str, list[AnyMessage]]:
            done = sum(1 for m in state["messages"] if isinstance(m, AIMessage))
            step = done + 1
            if step < steps:
                return {"messages": [AIMessage(content="", tool_calls=[
                    {"name": "echo", "args": tool_args(step), "id": f"call_{step}"}])]}
            return {"messages": [AIMessage(content=final_text(steps))]}

        graph = StateGraph(MessagesState)
        graph.add_node("agent", agent)
        graph.add_node("tools", ToolNode([echo]))
        graph.add_edge(START, "agent")
        graph.add_conditional_edges("agent", tools_condition)
        graph.add_edge("tools", "agent")
        async with AsyncSqliteSaver.from_conn_string(str(tmp / "langgraph.sqlite3")) as saver:
            await saver.setup()
            app = graph.compile(checkpointer=saver)

            async def one(i: int) -> Any:
                return await app.ainvoke({"messages": [HumanMessage(f"turn {i}")]},
                                         {"configurable": {"thread_id": f"t{i}"},
                                          "recursion_limit": 4 * steps + 10})

            gc.collect()
            cpu0 = time.process_time()
            results = await asyncio.gather(*(one(i) for i in range(turns)))
            cpu = time.process_time() - cpu0
        for r in results:
            ais = [m for m in r["messages"] if isinstance(m, AIMessage)]
            if len(ais) != steps or ais[-1].content != final_text(steps):
                raise RuntimeError("langgraph turns did not run as scripted")
        return cpu

    return run


# -- pydantic-ai ------------------------------------------------------------------------

def pydantic_ai_round() -> Round:
    from pydantic_ai import Agent
    from pydantic_ai.messages import ModelMessage, ModelResponse, TextPart, ToolCallPart
    from pydantic_ai.models.function import AgentInfo, FunctionModel

    async def run(turns: int, steps: int, tmp: Path) -> float:
        async def model(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
            done = sum(1 for m in messages if isinstance(m, ModelResponse))
            step = done + 1
            if step < steps:
                return ModelResponse(parts=[ToolCallPart("echo", tool_args(step),
                                                         tool_call_id=f"call_{step}")])
            return ModelResponse(parts=[TextPart(final_text(steps))])

        agent = Agent(FunctionModel(model))

        @agent.tool_plain  # type: ignore[untyped-decorator, unused-ignore]  # as above
        async def echo(text: str) -> str:
            """Echo the arguments back."""
            return json.dumps({"text": text}, sort_keys=True)

        gc.collect()
        cpu0 = time.process_time()
        results = await asyncio.gather(*(agent.run(f"turn {i}") for i in range(turns)))
        cpu = time.process_time() - cpu0
        for r in results:
            if r.output != final_text(steps):
                raise RuntimeError("pydantic-ai turns did not run as scripted")
        return cpu

    return run


# -- main -------------------------------------------------------------------------------

def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def systems(only: set[str] | None, port: int | None = None
            ) -> tuple[list[tuple[str, str, Round]], list[str]]:
    out: list[tuple[str, str, Round]] = []
    missing: list[str] = []

    def wanted(key: str) -> bool:
        return only is None or key in only

    if wanted("floor"):
        out.append(("floor", "floor: the same rows, nothing else", floor_round()))
    if wanted("turnkeeper"):
        out.append(("turnkeeper", "turnkeeper (zero-CPU model)", turnkeeper_round("zero")))
    if wanted("traced"):
        try:
            import turnkeeper.otel  # noqa: F401 - the `otel` extra, or not run
        except ImportError as exc:
            missing.append(f"traced: not run ({exc}); pip install -e '.[otel]'")
        else:
            if port is None:
                missing.append("traced: not run (--no-baseline: no loopback sink)")
            else:
                out.append(("traced", "turnkeeper, tracing on (OTLP to loopback)",
                            turnkeeper_round("zero", trace_port=port)))
    if wanted("unkept"):
        out.append(("unkept", "turnkeeper keeping nothing", turnkeeper_round("zero",
                                                                            keep=False)))
    if wanted("scripted"):
        out.append(("scripted", "turnkeeper (scripted provider)",
                    turnkeeper_round("scripted")))
    if wanted("langgraph"):
        try:
            out.append(("langgraph", f"langgraph {_version('langgraph')} (AsyncSqliteSaver)",
                        langgraph_round()))
        except ImportError as exc:
            missing.append(f"langgraph: not run ({exc}); pip install -e '.[bench]'")
    if wanted("pydantic-ai"):
        try:
            out.append(("pydantic-ai", f"pydantic-ai {_version('pydantic-ai-slim')} "
                        "(FunctionModel, no checkpoint)", pydantic_ai_round()))
        except ImportError as exc:
            missing.append(f"pydantic-ai: not run ({exc}); pip install -e '.[bench]'")
    return out, missing


async def bench(args: argparse.Namespace, port: int | None) -> None:
    only = set(args.only.split(",")) if args.only else None
    chosen, missing = systems(only, port)
    total_steps = args.turns * args.steps
    raw: list[float] = []
    cpu: dict[str, list[float]] = {key: [] for key, _, _ in chosen}
    writer: dict[str, list[float]] = {}
    for key, _, run in chosen:  # warm up: imports, first-call caches, not measured
        tmp = Path(tempfile.mkdtemp(prefix=f"tk-bench-step-{key}-"))
        try:
            await run(min(20, args.turns), args.steps, tmp)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    for r in range(args.rounds):
        if port is not None:
            raw.append(await raw_calls(port, args.raw_calls))
        order = chosen if r % 2 == 0 else list(reversed(chosen))
        for key, _, run in order:
            tmp = Path(tempfile.mkdtemp(prefix=f"tk-bench-step-{key}-"))
            try:
                cpu[key].append(await run(args.turns, args.steps, tmp) / total_steps)
                if run in WRITER_CPU:
                    writer.setdefault(key, []).append(WRITER_CPU.pop(run) / total_steps)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    base = statistics.median(raw) * 1e3 if raw else None
    print(f"per-step orchestration: {args.turns} turns x {args.steps} steps = {total_steps} "
          f"steps per round, zero-latency in-process model, echo tool; median of "
          f"{args.rounds} rounds; {os.cpu_count()} cores, uvloop")
    print(f"  {'system':<48}{'CPU ms/step':>12}{'vs raw call':>13}")
    if base is not None:
        print(f"  {'raw aiohttp call to a loopback model (baseline)':<48}{base:>12.3f}"
              f"{1.0:>12.2f}x")
    figures = {key: statistics.median(v) * 1e3 for key, v in cpu.items()}
    for key, label, _ in chosen:
        ratio = f"{figures[key] / base:>12.2f}x" if base else f"{'-':>13}"
        print(f"  {label:<48}{figures[key]:>12.3f}{ratio}")
    for key, vals in writer.items():
        part = statistics.median(vals) * 1e3
        print(f"  of which {key}'s SQLite writer thread (its commits): {part:.3f} ms/step "
              f"({part / figures[key]:.0%})")
    for line in missing:
        print(f"  {line}")
    tk = figures.get("turnkeeper")
    if tk is not None and "floor" in figures:
        parts = {key: statistics.median(writer[key]) * 1e3 if key in writer else 0.0
                 for key in ("turnkeeper", "floor")}
        print(f"  turnkeeper / floor: {tk / figures['floor']:.2f}x; on the event loop "
              f"{tk - parts['turnkeeper']:.3f} against {figures['floor'] - parts['floor']:.3f}"
              f" ms/step, in the writer thread {parts['turnkeeper']:.3f} against "
              f"{parts['floor']:.3f}")
    if tk is not None:
        for key, label, _ in chosen:
            if key in ("langgraph", "pydantic-ai"):
                print(f"  turnkeeper / {label.split(' ')[0]}: {tk / figures[key]:.2f}x "
                      f"({figures[key] / tk:.1f}x less CPU per step)")
    print("  rounds (ms/step): " + "; ".join(
        f"{key} " + ",".join(f"{v * 1e3:.3f}" for v in vals) for key, vals in cpu.items())
        + ("; raw " + ",".join(f"{v * 1e3:.3f}" for v in raw) if raw else ""))


async def profile(args: argparse.Namespace) -> None:
    run = turnkeeper_round("zero")
    for measured in (False, True):
        tmp = Path(tempfile.mkdtemp(prefix="tk-bench-step-profile-"))
        try:
            if not measured:
                await run(min(20, args.turns), args.steps, tmp)
                continue
            prof = cProfile.Profile()
            prof.enable()
            try:
                await run(args.turns, args.steps, tmp)
            finally:
                prof.disable()
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    stats = pstats.Stats(prof, stream=sys.stdout)
    stats.strip_dirs()
    print(f"cProfile of one round: {args.turns} turns x {args.steps} steps "
          "(zero-CPU model); times are inflated by the profiler, compare shares")
    stats.sort_stats("tottime").print_stats(args.profile)
    stats.sort_stats("cumulative").print_stats(args.profile)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--turns", type=int, default=200)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--raw-calls", type=int, default=2000)
    ap.add_argument("--only", default="",
                    help="comma-separated: floor,turnkeeper,traced,unkept,scripted,"
                         "langgraph,pydantic-ai "
                         "(the raw-call baseline always runs unless --no-baseline)")
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="profile one turnkeeper round and print the top N functions")
    args = ap.parse_args()
    with open(os.devnull, "w") as devnull:  # the daemon's default level, output discarded
        tk_logging.configure(log_format="json", log_level="info", stream=devnull)
        # The collector's thresholds and the switch interval as the daemon sets them, for
        # every system alike.
        gc.set_threshold(*GC_THRESHOLD)
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        model: subprocess.Popen[str] | None = None
        port: int | None = None
        try:
            if args.profile:
                anyio.run(profile, args, backend="asyncio",
                          backend_options={"use_uvloop": True})
                return
            if not args.no_baseline:
                model, port = start_model(latency=0.0, steps=args.steps)
                asyncio.run(wait_port(port))
            anyio.run(bench, args, port, backend="asyncio",
                      backend_options={"use_uvloop": True})
        finally:
            if model is not None:
                model.terminate()
                model.wait()


if __name__ == "__main__":
    main()
