"""A queue let go at once starts its turns a chunk a turn of the event loop, so what else
waits on the loop (a control request, a timer) runs between the chunks instead of after
thousands of task starts; and the status counts the supervisor keeps as turns move are
the ones a walk over its turns finds, through a real run."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import anyio
import pytest
from tests.unit.test_supervisor import GatedModel, write_config

from turnkeeper.clock import FakeClock
from turnkeeper.config import PolicyVersion, load_config
from turnkeeper.lifecycle.systemd import Notifier
from turnkeeper.runtime import LoopGate
from turnkeeper.store.sqlite import SQLiteStore
from turnkeeper.supervisor import Supervisor
from turnkeeper.supervisor.intake import SubmitRequest
from turnkeeper.supervisor.scheduling import START_CHUNK
from turnkeeper.turn.record import LIVE_STATES

TURNS = 3 * START_CHUNK + 7


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@dataclass
class H:
    sup: Supervisor
    model: GatedModel


@contextlib.asynccontextmanager
async def supervised(tmp_path: Path, turns: int,
                     gate: LoopGate | None = None) -> AsyncIterator[H]:
    """A supervisor on a real SQLite store and a model that holds each call until the
    test opens it (`turns` slots and twice that queued); at the end every call is opened
    and the supervisor stopped."""
    config_path = tmp_path / "turnkeeper.toml"
    write_config(config_path, max_concurrent=turns, max_queued=2 * turns)
    config, digest = load_config(config_path)
    policy = PolicyVersion(version=1, config=config, source_path=str(config_path),
                           content_hash=digest)
    model = GatedModel()
    store = SQLiteStore(tmp_path / "state.sqlite3")
    await store.open()
    sup = Supervisor(policy=policy, store=store, clock=FakeClock(), notifier=Notifier(None),
                     config_path=str(config_path))
    sup.runtime.providers["m"] = model
    if gate is not None:
        sup.shared.loop_gate = gate
    async with anyio.create_task_group() as tg:
        await tg.start(store.run)
        await sup.start(tg)
        yield H(sup, model)
        for i in range(turns):
            model.open(f"slow {i}")
        await sup.stop()
        await store.close()
        tg.cancel_scope.cancel()


@pytest.fixture
async def h(tmp_path: Path) -> AsyncIterator[H]:
    async with supervised(tmp_path, TURNS) as harness:
        yield harness


async def until(condition: Callable[[], bool]) -> None:
    """Yield to the loop until `condition()` holds (the writer's thread commits)."""
    for _ in range(100_000):
        if condition():
            return
        await anyio.lowlevel.checkpoint()
    raise AssertionError("condition never held")


def turn_tasks() -> int:
    return sum(1 for t in asyncio.all_tasks() if t.get_name().startswith("turn "))


def recount(sup: Supervisor) -> dict[str, int]:
    return {s: sum(1 for t in sup.live.values() if t.record.state == s) for s in LIVE_STATES}


@pytest.mark.anyio
async def test_a_queue_let_go_at_once_starts_a_chunk_a_turn_of_the_loop(h: H) -> None:
    sup = h.sup
    sup.scheduling.set_paused(True)
    await sup.intake.submit_batch([SubmitRequest(message=f"slow {i}", session=None)
                                   for i in range(TURNS)])
    assert sup.turn_counts()["queued"] == TURNS
    served: list[int] = []  # turn tasks that existed when the "request" ran
    loop = asyncio.get_running_loop()
    sup.scheduling.set_paused(False)
    loop.call_soon(lambda: served.append(turn_tasks()))  # a request read meanwhile
    assert turn_tasks() == START_CHUNK  # the first chunk; the rest to follow
    await until(lambda: len(h.model.in_flight) == TURNS)  # all started, at their gates
    assert served and START_CHUNK <= served[0] < TURNS
    assert sup.turn_counts() == recount(sup)
    assert sup.turn_counts()["running"] == TURNS
    assert sup.status()["turns"] == recount(sup)


@pytest.mark.anyio
async def test_the_counts_follow_turns_to_their_end(h: H) -> None:
    sup = h.sup
    await sup.intake.submit_batch([SubmitRequest(message=f"slow {i}", session=None)
                                   for i in range(10)])
    await until(lambda: len(h.model.in_flight) == 10)
    assert sup.turn_counts() == {**recount(sup), "running": 10}
    for i in range(10):
        h.model.open(f"slow {i}")
    await until(lambda: not sup.live)
    assert sup.turn_counts() == dict.fromkeys(LIVE_STATES, 0)
