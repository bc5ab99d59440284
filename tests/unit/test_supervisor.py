"""The real supervisor, driven in fake time on the in-memory store: no sockets, no sleeps.

The model is a gate the test holds: a turn whose message says "slow" blocks in its first
model call until the test opens the gate, then asks for one tool call; the next call
answers. Everything else about the turn (runner, checkpoints, policy, events) is real.
"""

from __future__ import annotations

import gc
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import pytest
from anyio.abc import TaskGroup

from turnkeeper.clock import FakeClock
from turnkeeper.config import PolicyVersion, load_config
from turnkeeper.lifecycle.systemd import Notifier
from turnkeeper.messages import ToolCall, dumps_arguments
from turnkeeper.providers.base import DeltaSink, ModelReply, ModelRequest, Usage
from turnkeeper.store.memory import MemoryStore
from turnkeeper.supervisor import IntakeRefused, Supervisor

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@dataclass
class GatedModel:
    """Speaks the provider protocol. `gates[message]` holds that turn's first call."""

    gates: dict[str, anyio.Event] = field(default_factory=dict)
    calls: list[tuple[str, int]] = field(default_factory=list)  # (message, step)
    in_flight: set[str] = field(default_factory=set)

    @property
    def name(self) -> str:
        return "m"

    async def complete(self, request: ModelRequest, on_delta: DeltaSink | None = None
                       ) -> ModelReply:
        message = next(str(m.content) for m in reversed(request.messages)
                       if m.role == "user")
        self.calls.append((message, request.step))
        if "slow" in message and not any(m.role == "tool" for m in request.messages):
            gate = self.gates.setdefault(message, anyio.Event())
            self.in_flight.add(message)
            try:
                await gate.wait()
            finally:
                self.in_flight.discard(message)
            return ModelReply(text=None, tool_calls=(ToolCall(
                id="c1", name="echo", arguments=dumps_arguments({"text": "x"})),),
                usage=Usage(10, 5), finish_reason="tool_calls", model="gated")
        return ModelReply(text=f"answer to {message}", tool_calls=(), usage=Usage(10, 5),
                          finish_reason="stop", model="gated")

    def open(self, message: str) -> None:
        self.gates.setdefault(message, anyio.Event()).set()

    async def aclose(self) -> None:
        return None


def write_config(path: Path, *, max_concurrent: int = 4, max_queued: int = 100,
                 max_steps: int = 10) -> None:
    config: dict[str, Any] = {
        "daemon": {"max_concurrent_turns": max_concurrent, "max_queued_turns": max_queued,
                   "drain_timeout": 5.0, "shutdown_timeout": 5.0,
                   "state_dir": str(path.parent)},
        "budget": {"max_steps": max_steps},
        "providers": [{"name": "m", "kind": "scripted"}],
        "tools": [{"name": "echo", "kind": "echo", "idempotent": True,
                   "description": "Echo the arguments back",
                   "parameters": {"type": "object",
                                  "properties": {"text": {"type": "string"}}}}],
    }
    lines: list[str] = []
    for table, values in config.items():
        if isinstance(values, dict):
            lines.append(f"[{table}]")
            lines += [f"{k} = {json.dumps(v)}" for k, v in values.items()]
        else:
            for item in values:
                lines.append(f"[[{table}]]")
                for k, v in item.items():
                    if isinstance(v, dict):
                        lines.append(f"{k} = {_inline(v)}")
                    else:
                        lines.append(f"{k} = {json.dumps(v)}")
    path.write_text("\n".join(lines) + "\n")


def _inline(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_inline(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)


@dataclass
class Harness:
    sup: Supervisor
    clock: FakeClock
    store: MemoryStore
    model: GatedModel
    config_path: Path
    tg: TaskGroup

    async def settle(self) -> None:
        """Let every task run until all are blocked (fake time does not move)."""
        for _ in range(3):
            await anyio.wait_all_tasks_blocked()

    async def until(self, condition: Any) -> None:
        """Yield until `condition()` holds (a config read runs in a worker thread)."""
        for _ in range(100_000):
            if condition():
                return
            await anyio.lowlevel.checkpoint()
        raise AssertionError("condition never held")

    async def state(self, turn_id: str) -> str:
        return str((await self.sup.get_turn(turn_id))["state"])


@pytest.fixture
async def h(tmp_path: Path) -> AsyncIterator[Harness]:
    config_path = tmp_path / "turnkeeper.toml"
    write_config(config_path, max_concurrent=2, max_queued=3)
    config, digest = load_config(config_path)
    policy = PolicyVersion(version=1, config=config, source_path=str(config_path),
                    content_hash=digest)
    clock, store, model = FakeClock(), MemoryStore(), GatedModel()
    await store.open()
    sup = Supervisor(policy=policy, store=store, clock=clock, notifier=Notifier(None),
                     config_path=str(config_path))
    sup.runtime.providers["m"] = model  # kept across reloads: its config does not change
    async with anyio.create_task_group() as tg:
        await sup.start(tg)
        yield Harness(sup, clock, store, model, config_path, tg)
        for message in list(model.gates):
            model.open(message)
        await sup.stop()
        tg.cancel_scope.cancel()
    await store.close()


async def test_a_submitted_turn_runs_and_finishes(h: Harness) -> None:
    record = await h.sup.submit(message="hello", session=None, budget={}, deadline=None)
    await h.settle()
    done = await h.sup.wait_turn(record.id, 1.0)
    assert done["state"] == "completed"
    assert done["result"]["answer"] == "answer to hello"
    stored = await h.store.get_turn(record.id)
    assert stored is not None and stored["state"] == "completed"
    types = [e["type"] for e in await h.store.events(turn=record.id)]
    assert types[0] == "turn.queued" and types[-1] == "turn.finished"


async def test_a_finished_turn_is_freed_without_the_cyclic_collector(h: Harness) -> None:
    """Nothing of a finished turn is left in a reference cycle: with thousands of turns a
    minute, what only the collector can free makes its pauses longer."""
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        record = await h.sup.submit(message="freed", session=None, budget={}, deadline=None)
        await h.settle()
        assert (await h.sup.wait_turn(record.id, 1.0))["state"] == "completed"
        assert record.id not in h.sup.live
        gc.collect()
        cyclic = {type(o).__name__ for o in gc.garbage}
        assert not cyclic & {"LiveTurn", "TurnControl", "TurnRecord", "TurnRunner"}
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


async def test_turns_of_one_session_run_in_order_beside_another_session(h: Harness
                                                                       ) -> None:
    a1 = await h.sup.submit(message="slow a1", session="A", budget={}, deadline=None)
    a2 = await h.sup.submit(message="a2", session="A", budget={}, deadline=None)
    b1 = await h.sup.submit(message="b1", session="B", budget={}, deadline=None)
    await h.settle()
    assert await h.state(a1.id) == "running"
    assert await h.state(a2.id) == "queued"  # its session is busy
    assert await h.state(b1.id) == "completed"  # another session is not held back
    h.model.open("slow a1")
    await h.settle()
    assert await h.state(a1.id) == "completed"
    assert await h.state(a2.id) == "completed"
    order = [m for m, _ in h.model.calls]
    assert order.index("a2") > max(i for i, m in enumerate(order) if m == "slow a1")


async def test_no_more_than_max_concurrent_turns_run(h: Harness) -> None:
    turns = [await h.sup.submit(message=f"slow {i}", session=None, budget={},
                                deadline=None) for i in range(3)]
    await h.settle()
    states = [await h.state(t.id) for t in turns]
    assert states == ["running", "running", "queued"]
    assert h.sup.active == 2 and len(h.model.in_flight) == 2
    h.model.open("slow 0")
    await h.settle()
    assert await h.state(turns[0].id) == "completed"
    assert await h.state(turns[2].id) == "running"


async def test_a_full_queue_refuses_with_a_retry_after(h: Harness) -> None:
    for i in range(5):  # two run, three wait: the queue is full
        await h.sup.submit(message=f"slow {i}", session=None, budget={}, deadline=None)
    await h.settle()
    assert len(h.sup.queue) == 3
    with pytest.raises(IntakeRefused) as refused:
        await h.sup.submit(message="one too many", session=None, budget={}, deadline=None)
    assert refused.value.retry_after_s == 1  # 3 queued, 2 running
    assert "queue is full" in str(refused.value)


async def test_cancel_of_a_queued_turn(h: Harness) -> None:
    await h.sup.submit(message="slow x", session="S", budget={}, deadline=None)
    queued = await h.sup.submit(message="later", session="S", budget={}, deadline=None)
    await h.settle()
    assert await h.sup.cancel(queued.id) == {"turn": queued.id, "state": "cancelled"}
    stored = await h.store.get_turn(queued.id)
    assert stored is not None and stored["state"] == "cancelled"
    assert stored["result"]["stopped_because"]["code"] == "cancelled"
    assert queued.id not in h.sup.queue
    h.model.open("slow x")
    await h.settle()
    assert ("later", 1) not in h.model.calls


async def test_a_reload_past_its_drain_cuts_a_model_call_and_resumes_it_under_the_new_policy(
        h: Harness) -> None:
    turn = await h.sup.submit(message="slow r", session=None, budget={}, deadline=None)
    await h.settle()
    assert "slow r" in h.model.in_flight
    write_config(h.config_path, max_concurrent=2, max_queued=3, max_steps=7)
    outcome: list[Any] = []

    async def reload() -> None:
        outcome.append(await h.sup.reload("test"))

    h.tg.start_soon(reload)
    await h.until(lambda: h.sup.state == "reloading")
    await h.settle()
    assert h.sup.state == "reloading" and h.sup.policy.version == 1
    h.clock.advance(5.0)  # the drain timeout passes in fake time
    # The model call has no effect: it is cut, the turn suspended, the policy swapped,
    # without waiting for the call (which never ends while the gate is shut).
    await h.until(lambda: bool(outcome))
    await h.settle()
    assert outcome[0].ok and outcome[0].policy_version == 2 and h.sup.state == "ready"
    assert h.sup.policy.config.budget.max_steps == 7
    assert "slow r" in h.model.in_flight  # asked again, under the new policy
    assert [c for c in h.model.calls if c[0] == "slow r"] == [("slow r", 1), ("slow r", 1)]
    h.model.open("slow r")
    done = await h.sup.wait_turn(turn.id, 1.0)
    assert done["state"] == "completed" and done["policy_version"] == 2
    assert done["counters"]["steps"] == 2  # the cut step is not counted twice
    types = [e["type"] for e in await h.store.events(turn=turn.id)]
    assert types.index("turn.suspended") < types.index("turn.resumed") < types.index(
        "turn.finished")
    assert types.count("tool.call") == 1


async def test_stop_cuts_running_turns_at_the_timeout_and_leaves_queued_ones(h: Harness) -> None:
    running = await h.sup.submit(message="slow s", session="S", budget={}, deadline=None)
    queued = await h.sup.submit(message="next", session="S", budget={}, deadline=None)
    await h.settle()

    async def stop() -> None:
        await h.sup.stop()

    h.tg.start_soon(stop)
    await h.settle()
    h.clock.advance(5.0)  # past the shutdown timeout: the turn is cut at once
    await h.settle()
    assert h.sup.state == "stopping" and h.sup.running == 0
    # Cut mid-step: the store keeps its last checkpoint, from which the next start
    # resumes it; the queued turn never started.
    assert [(r["id"], r["state"]) for r, _ in await h.store.unfinished_turns()] == [
        (running.id, "running"), (queued.id, "queued")]
    assert ("next", 1) not in h.model.calls


async def test_replay_of_a_dead_letter(h: Harness) -> None:
    dead = {"id": "t_dead", "session": "S", "message": "try again", "state": "queued",
            "created_at": 1.0, "updated_at": 1.0, "inbox": [], "budget": {},
            "deadline": None}
    await h.store.insert_turn(dead, {})
    await h.store.save_turn({**dead, "state": "failed", "updated_at": 2.0, "result": {
        "status": "failed", "stopped_because": {"code": "providers.rejected"}}})
    replay = await h.sup.replay("t_dead")
    # The same turn resumes: no new turn, and it leaves the dead-letter list at once.
    assert replay.id == "t_dead" and replay.session == "S"
    assert await h.store.dead_letters() == []
    await h.settle()
    done = await h.sup.wait_turn(replay.id, 1.0)
    assert done["state"] == "completed" and done["result"]["answer"] == "answer to try again"
    assert [r["stopped_because"]["code"] for r in done["previous_results"]] == [
        "providers.rejected"]
    types = [e["type"] for e in await h.store.events(turn="t_dead")]
    assert types.index("turn.replayed") < types.index("turn.finished")
    with pytest.raises(Exception, match="not a dead letter"):
        await h.sup.replay("t_dead")


async def test_replay_refuses_a_turn_that_is_no_dead_letter(h: Harness) -> None:
    from turnkeeper.supervisor import TurnFinished

    turn = await h.sup.submit(message="fine", session=None, budget={}, deadline=None)
    await h.settle()
    with pytest.raises(TurnFinished):
        await h.sup.replay(turn.id)


async def test_status_says_which_prices_are_in_force_for_each_provider(h: Harness) -> None:
    prices = h.sup.status()["prices"]
    assert set(prices) == {"m"}
    assert prices["m"]["source"] == "none"  # a scripted provider with no prices configured
