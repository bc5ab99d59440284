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


def test_under_load_the_young_generation_is_only_frozen() -> None:
    pace = CollectorPace(0.0, quiet_turns=10, quiet_after_s=30.0, thaw_every_s=300.0)
    assert pace.look(0.05, running=5000) is Pass.FREEZE
    assert pace.look(31.0, running=11) is Pass.FREEZE  # not quiet: no full pass yet


def test_while_quiet_the_young_generation_is_collected_first() -> None:
    pace = CollectorPace(0.0, quiet_turns=10, quiet_after_s=30.0, thaw_every_s=300.0)
    assert pace.look(1.0, running=10) is Pass.YOUNG
    assert pace.look(2.0, running=0) is Pass.YOUNG


def test_a_full_pass_once_quiet_after_quiet_after_s() -> None:
    pace = CollectorPace(0.0, quiet_turns=10, quiet_after_s=30.0, thaw_every_s=300.0)
    assert pace.look(29.9, running=0) is Pass.YOUNG
    assert pace.look(30.0, running=0) is Pass.FULL
    assert pace.look(30.05, running=0) is Pass.YOUNG  # counted from the last full pass
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
@pytest.mark.parametrize("running, freed", [(5000, False), (0, True)])
async def test_a_cycle_made_under_load_waits_for_the_full_pass(running: int,
                                                                freed: bool) -> None:
    cycle = _Cycle()
    gone = weakref.ref(cycle)
    del cycle
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(pace_collector, _Sup(running), SystemClock())
            await anyio.sleep(0.2)  # a few looks: frozen, or collected first while quiet
            assert (gone() is None) is freed
            tg.cancel_scope.cancel()
    finally:
        gc.unfreeze()  # what the test froze is the collector's again
    gc.collect()
    assert gone() is None  # a full pass frees it
