"""The turn's trail: the lines that grow with a turn (partial work, the loop guard's keys,
the effect ledger's outcomes) are written once each as rows, so a checkpoint stays the
same size however long the turn runs, and a turn rebuilt from the store holds the same
lines and judges the next step alike."""

from __future__ import annotations

import json
from typing import Any

import pytest
from tests.unit.test_runner import Harness, answer, calls

from turnkeeper.store.base import MessageRows
from turnkeeper.turn.runner import TurnRunner
from turnkeeper.turn.trail import Trail, read, split

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# -- the trail on its own -----------------------------------------------------------------

def test_a_save_writes_the_lines_added_since_the_last_one_after_the_stored_rows() -> None:
    partial, loops, effects = ["step 1: a"], ["rk1", "vk2"], []
    trail = Trail(partial, loops, effects)
    assert trail.unsaved_rows() == MessageRows(0, ("pstep 1: a", "lrk1", "lvk2"))
    trail.mark_saved()
    assert trail.unsaved_rows() is None
    trail.mark_saved()
    partial.append("step 2: b")
    effects.append("kabc")
    assert trail.unsaved_rows() == MessageRows(3, ("pstep 2: b", "ekabc"))
    assert trail.stored_json() == {"count": 5}


def test_a_save_that_did_not_return_is_written_again_with_what_came_since() -> None:
    partial: list[str] = []
    trail = Trail(partial, [], [])
    partial.append("one")
    assert trail.unsaved_rows() == MessageRows(0, ("pone",))
    # the write failed: no mark_saved()
    partial.append("two")
    assert trail.unsaved_rows() == MessageRows(0, ("pone", "ptwo"))


def test_lines_added_while_a_save_is_in_flight_stay_unsaved() -> None:
    partial: list[str] = []
    trail = Trail(partial, [], [])
    partial.append("one")
    rows = trail.unsaved_rows()
    partial.append("two")  # after the rows were taken, before the write returned
    trail.mark_saved()
    assert rows == MessageRows(0, ("pone",))
    assert trail.unsaved_rows() == MessageRows(1, ("ptwo",))


def test_rows_read_back_split_into_the_three_lists_in_their_order() -> None:
    rows = ["pa", "lr1", "ek2", "pb", "lv3"]
    assert split(rows) == (["a", "b"], ["r1", "v3"], ["k2"])
    assert read({"count": 5, "rows": rows})[3] == (2, 2, 1)
    with pytest.raises(ValueError, match="not a trail row"):
        split(["pa", "zq"])
    with pytest.raises(ValueError, match="not a trail row"):
        split([""])


def test_the_in_memory_form_keeps_what_the_store_holds() -> None:
    partial, loops = ["a"], ["r1"]
    trail = Trail(partial, loops, [])
    trail.unsaved_rows()
    trail.mark_saved()
    partial.append("b")
    again = json.loads(json.dumps(trail.to_json()))
    p, lo, e, saved = read(again)
    resumed = Trail(p, lo, e, saved=saved)
    assert resumed.unsaved_rows() == MessageRows(2, ("pb",))


# -- a turn's checkpoints ------------------------------------------------------------------

def long_turn(steps: int) -> Harness:
    script: list[Any] = [calls("echo", json.dumps({"text": f"step {n}"}))
                         for n in range(steps)]
    return Harness([*script, answer()], budget={"max_steps": steps + 5})


def record_writes(h: Harness) -> list[tuple[dict[str, Any], MessageRows | None]]:
    """Every checkpoint the turn writes (awaited or queued: the memory store applies
    both through `_write_turn`), with its trail rows."""
    writes: list[tuple[dict[str, Any], MessageRows | None]] = []
    write = h.store._write_turn

    def write_turn(record: dict[str, Any], checkpoint: dict[str, Any] | None,
                   messages: MessageRows | None, trail: MessageRows | None) -> None:
        if checkpoint is not None:
            writes.append((checkpoint, trail))
        write(record, checkpoint, messages, trail)

    h.store._write_turn = write_turn  # type: ignore[method-assign]
    return writes


async def test_a_long_turn_s_checkpoints_stay_the_same_size() -> None:
    """Thirty steps: the last checkpoint is no bigger than the tenth (give or take the
    digits of its counters), and each step's trail rows are only the lines it added."""
    h = long_turn(30)
    writes = record_writes(h)
    result = await h.run()
    assert result is not None and result.answer == "done"
    sizes = [len(json.dumps(cp)) for cp, _ in writes]
    assert max(sizes[10:]) - min(sizes[10:]) < 100, sizes
    assert "partial" not in writes[-1][0]
    assert set(writes[-1][0]["loops"]) == {"last_outcome", "no_progress"}
    written = [r for _, rows in writes if rows is not None for r in rows.rows]
    assert len(written) == writes[-1][0]["trail"]["count"]
    assert max(len(rows.rows) for _, rows in writes if rows is not None) <= 4
    assert len(result.partial) == 31


async def test_a_turn_rebuilt_from_the_store_holds_the_same_lines() -> None:
    h = long_turn(12)
    await h.run()
    live = h.runner.ctx
    stored = await h.store.get_checkpoint("t1")
    assert stored is not None
    again = TurnRunner(h.record, h.control, runtime=h.runtime, shared=h.shared,
                       store=h.store, bus=h.bus, clock=h.clock, checkpoint=stored,
                       history=[]).ctx
    assert again.restore_error is None
    assert again.partial == live.partial and len(again.partial) == 13
    assert again.loops.lines == live.loops.lines
    assert again.loops.snapshot() == live.loops.snapshot()
    assert again.loops.observations_seen == live.loops.observations_seen == 12
    # the rebuilt turn's next save writes only what it adds
    assert again.trail.unsaved_rows() is None
    again.partial.append("one more")
    assert again.trail.unsaved_rows() == MessageRows(stored["trail"]["count"],
                                                     ("pone more",))


async def test_a_checkpoint_from_before_the_trail_resumes_and_its_first_save_writes_it(
        ) -> None:
    """An older daemon wrote the partial work, the loop guard's counts and the ledger's
    actions into every checkpoint: such a turn resumes with the same state, and its next
    checkpoint moves all of it into trail rows."""
    h = long_turn(3)
    await h.run()
    live = h.runner.ctx
    stored = await h.store.get_checkpoint("t1")
    assert stored is not None
    lines = live.loops.lines
    older = {k: v for k, v in stored.items() if k != "trail"}
    older["partial"] = list(live.partial)
    older["loops"] = {
        **stored["loops"],
        "repeats": {line[1:]: lines.count(line) for line in lines if line[0] == "r"},
        "state_visits": {line[1:]: lines.count(line) for line in lines if line[0] == "v"},
        "seen": sorted(line[1:] for line in lines if line[0] == "o")}
    again = TurnRunner(h.record, h.control, runtime=h.runtime, shared=h.shared,
                       store=h.store, bus=h.bus, clock=h.clock, checkpoint=older,
                       history=[]).ctx
    assert again.restore_error is None and again.partial == live.partial
    assert sorted(again.loops.lines) == sorted(live.loops.lines)
    await again.checkpoint()
    reread = await h.store.get_checkpoint("t1")
    assert reread is not None and "partial" not in reread
    assert reread["trail"]["count"] == len(live.partial) + len(live.loops.lines)
    assert read(reread["trail"])[0] == live.partial


async def test_a_damaged_trail_ends_the_turn_internal_with_its_partial_work() -> None:
    h = long_turn(2)
    await h.run()
    stored = await h.store.get_checkpoint("t1")
    assert stored is not None
    stored["trail"]["rows"].append("?not a row")
    again = TurnRunner(h.record, h.control, runtime=h.runtime, shared=h.shared,
                       store=h.store, bus=h.bus, clock=h.clock, checkpoint=stored,
                       history=[]).ctx
    assert again.restore_error is not None and "not a trail row" in again.restore_error
    assert again.partial == []  # the rows could not be read apart: none are claimed
