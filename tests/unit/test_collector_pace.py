"""The cyclic collector's pace (`policy/collector.py`) and its edge
(`daemon.pace_collector`): under load the young generation is only frozen, while quiet
it is collected first, and a full pass comes when quiet (not sooner than
`quiet_after_s`) or under load every `thaw_every_s`; cyclic garbage made under load is
freed by the full pass."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import anyio
import pytest

from turnkeeper.clock import SystemClock
from turnkeeper.daemon import pace_collector
from turnkeeper.policy.collector import CollectorPace, Pass


def test_under_load_the_young_generation_is_frozen() -> None:
    pace = CollectorPace(0.0, quiet_turns=10, quiet_after_s=30.0, thaw_every_s=300.0)
    assert pace.look(0.05, running=5000) is Pass.FREEZE
    assert pace.look(31.0, running=11) is Pass.FREEZE


def test_while_quiet_with_nothing_frozen_the_collector_runs_on_its_own() -> None:
    pace = CollectorPace(0.0, quiet_turns=10, quiet_after_s=30.0, thaw_every_s=300.0)
    assert pace.look(1.0, running=10) is Pass.NONE
    assert pace.look(400.0, running=0) is Pass.NONE  # nothing frozen: no full pass


def test_a_full_pass_once_quiet_after_load_not_sooner_than_quiet_after_s() -> None:
    pace = CollectorPace(0.0, quiet_turns=10, quiet_after_s=30.0, thaw_every_s=300.0)
    assert pace.look(10.0, running=5000) is Pass.FREEZE
    assert pace.look(20.0, running=0) is Pass.NONE  # quiet, but too soon
    assert pace.look(30.0, running=0) is Pass.FULL
    assert pace.look(30.05, running=0) is Pass.NONE  # nothing frozen since
    assert pace.look(31.0, running=50) is Pass.FREEZE
    assert pace.look(40.0, running=0) is Pass.NONE  # 10 s after the last full pass
    assert pace.look(60.0, running=0) is Pass.FULL


def test_under_load_a_full_pass_every_thaw_every_s() -> None:
    pace = CollectorPace(0.0, quiet_turns=10, quiet_after_s=30.0, thaw_every_s=300.0)
    assert pace.look(299.9, running=5000) is Pass.FREEZE
    assert pace.look(300.0, running=5000) is Pass.FULL
    assert pace.look(599.0, running=5000) is Pass.FREEZE
    assert pace.look(600.0, running=5000) is Pass.FULL


def test_the_intervals_must_nest() -> None:
    with pytest.raises(ValueError):
        CollectorPace(0.0, every_s=0.0)
    with pytest.raises(ValueError):
        CollectorPace(0.0, quiet_after_s=400.0, thaw_every_s=300.0)


class _Cycle:
    def __init__(self) -> None:
        self.me = self


class _Sup:
    def __init__(self, running: int) -> None:
        self.live: dict[str, Any] = {str(i): None for i in range(running)}


@pytest.mark.anyio
async def test_a_cycle_frozen_under_load_is_freed_by_the_full_pass() -> None:
    # No automatic pass before the pace's first look freezes the cycle (other tests'
    # allocations could trigger one within those 50 ms and free it first).
    was_enabled = gc.isenabled()
    gc.disable()
    cycle = _Cycle()
    gone = weakref.ref(cycle)
    del cycle
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(pace_collector, _Sup(5000), SystemClock())
            await anyio.sleep(0.2)  # a few looks: the cycle frozen
            tg.cancel_scope.cancel()
        gc.collect()
        assert gone() is not None  # no pass walks it while frozen
    finally:
        gc.unfreeze()  # what the test froze is the collector's again
        if was_enabled:
            gc.enable()
    gc.collect()
    assert gone() is None  # the full pass's thaw and collection free it
