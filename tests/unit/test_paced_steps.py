"""Steps ask for the event loop's share before they start (`runtime.LoopGate`), so a
burst of ready turns runs a slice of their steps a turn of the loop, and a control
request read meanwhile is answered while the rest wait, through a real run (SQLite
store, the supervisor, the turn runner)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from tests.unit.test_dispatch_chunks import H, supervised, until

from turnkeeper.policy.loop_share import LoopShare
from turnkeeper.runtime import LoopGate
from turnkeeper.supervisor.intake import SubmitRequest
from turnkeeper.supervisor.scheduling import START_CHUNK

TURNS = 60  # under one chunk of starts: they all start in one turn of the loop
assert TURNS < START_CHUNK


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def h(tmp_path: Path) -> AsyncIterator[H]:
    # A slice any second step overruns: what goes through a turn of the loop does not
    # depend on this machine's speed.
    async with supervised(tmp_path, TURNS, LoopGate(LoopShare(slice_s=1e-12))) as harness:
        yield harness


@pytest.mark.anyio
async def test_a_burst_of_steps_runs_a_slice_a_turn_and_a_request_is_answered_between(
        h: H) -> None:
    sup, model = h.sup, h.model
    sup.scheduling.set_paused(True)
    await sup.intake.submit_batch([SubmitRequest(message=f"slow {i}", session=None)
                                   for i in range(TURNS)])
    loop = asyncio.get_running_loop()
    calls_by_turn: list[int] = []  # model calls made so far, at each turn of the loop
    answered: list[tuple[int, dict[str, int]]] = []

    def each_turn() -> None:
        calls_by_turn.append(len(model.calls))
        if sup.shared.loop_gate.waiting and not answered:  # a status request meanwhile
            answered.append((len(model.calls), dict(sup.status()["turns"])))
        if len(model.calls) < TURNS:
            loop.call_soon(each_turn)

    sup.scheduling.set_paused(False)  # every turn's task starts in this turn of the loop
    loop.call_soon(each_turn)
    await until(lambda: len(model.in_flight) == TURNS)  # all at their first call
    counts = [0, *calls_by_turn]  # none before the release
    steps = [b - a for a, b in itertools.pairwise(counts)]
    # Without the share every ready turn started its step in the same turn of the loop;
    # with it, one piece a turn goes through, then what the rule lets out.
    assert max(steps) <= 2, steps
    assert answered, "no request met turns held"
    calls_then, turns_then = answered[0]
    assert calls_then < TURNS // 2  # answered while most steps still waited
    assert turns_then["running"] == TURNS
    for i in range(TURNS):
        model.open(f"slow {i}")
    await until(lambda: not sup.live)  # every held step went on to the end
    assert sup.shared.loop_gate.waiting == 0
    assert sum(1 for _, step in model.calls if step == 2) == TURNS
