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
from turnkeeper.turn.trail import TAIL_CHARS, Trail, read, split

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# -- the trail on its own -----------------------------------------------------------------

def fresh() -> tuple[Trail, list[str], list[str], list[str]]:
    partial: list[str] = []
    loops: list[str] = []
    effects: list[str] = []
    return Trail((partial, loops, effects)), partial, loops, effects


def test_a_short_trail_rides_in_the_checkpoint_and_writes_no_row() -> None:
    trail, partial, loops, _ = fresh()
    partial.append("step 1: a")
    loops += ["rk1", "vk2"]
    assert trail.save() == ({"count": 0, "tail": ["pstep 1: a", "lrk1", "lvk2"]}, None)
    trail.mark_saved()
    assert trail.save() == ({"count": 0, "tail": ["pstep 1: a", "lrk1", "lvk2"]}, None)


def test_a_tail_that_reaches_its_size_is_written_as_one_row_and_starts_again() -> None:
    trail, partial, _, effects = fresh()
    line, n = "x" * 99, TAIL_CHARS // 100 + 1
    partial.extend([line] * n)
    effects.append("kabc")
    part, row = trail.save()
    assert row is not None and row.start == 0 and len(row.rows) == 1
    assert json.loads(row.rows[0]) == ["p" + line] * n + ["ekabc"]
    assert part == {"count": 1, "tail": []}
    trail.mark_saved()
    partial.append("step 42: b")
    assert trail.save() == ({"count": 1, "tail": ["pstep 42: b"]}, None)
    trail.mark_saved()
    partial.extend([line] * n)
    again = trail.save()[1]
    assert again is not None and again.start == 1


def test_a_row_whose_write_did_not_return_is_written_again_with_what_came_since() -> None:
    trail, partial, _, _ = fresh()
    partial.extend(["y" * 99] * (TAIL_CHARS // 100 + 1))
    first = trail.save()[1]
    assert first is not None
    # the write failed: no mark_saved()
    partial.append("more")
    second = trail.save()[1]
    assert second is not None and second.start == first.start == 0
    assert json.loads(second.rows[0])[-1] == "pmore"


def test_lines_added_while_a_save_is_in_flight_stay_in_the_next_tail() -> None:
    trail, partial, _, _ = fresh()
    partial.extend(["z" * 99] * (TAIL_CHARS // 100 + 1))
    assert trail.save()[1] is not None
    partial.append("late")  # after the row was taken, before the write returned
    trail.mark_saved()
    assert trail.save() == ({"count": 1, "tail": ["plate"]}, None)


def test_rows_and_tail_read_back_as_the_three_lists_in_their_order() -> None:
    stored = {"count": 2, "rows": ['["pa","lr1"]', '["ek2","pb"]'], "tail": ["lv3", "pc"]}
    assert read(stored) == ((["a", "b", "c"], ["r1", "v3"], ["k2"]), 2, (2, 1, 1))
    with pytest.raises(ValueError, match="not a trail line"):
        split(["pa", "zq"])
    with pytest.raises(ValueError, match="not a trail line"):
        split([""])
    with pytest.raises(ValueError, match="not a trail row"):
        read({"count": 1, "rows": ['{"p": 1}'], "tail": []})
    # A row the checkpoint counts and the store lost: the turn must not go on without it.
    with pytest.raises(ValueError, match="counts 2 trail rows but the store gave back 1"):
        read({"count": 2, "rows": ['["pa"]'], "tail": []})


def test_the_in_memory_form_keeps_what_the_store_holds() -> None:
    trail, partial, loops, _ = fresh()
    partial.extend(["w" * 99] * (TAIL_CHARS // 100 + 1))
    loops.append("r1")
    trail.save()
    trail.mark_saved()
    partial.append("b")
    lists, rows, spilled = read(json.loads(json.dumps(trail.to_json())))
    assert lists == (partial, loops, []) and rows == 1
    resumed = Trail(lists, rows=rows, spilled=spilled)
    assert resumed.save() == ({"count": 1, "tail": ["pb"]}, None)


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


async def test_a_long_turn_s_checkpoints_stay_small_and_its_lines_go_in_a_few_rows() -> None:
    """A hundred steps: no checkpoint carries more than one tail of lines, the lines go to
    the store a row at a time (a step of one call adds about 100 characters of lines: a
    row every 40 steps or so), and nothing is written twice."""
    h = long_turn(100)
    writes = record_writes(h)
    result = await h.run()
    assert result is not None and result.answer == "done"
    sizes = [len(json.dumps(cp)) for cp, _ in writes]
    assert max(sizes) < TAIL_CHARS + 2000, max(sizes)
    last = writes[-1][0]
    assert "partial" not in last
    assert set(last["loops"]) == {"last_outcome", "no_progress"}
    rows = [r for _, written in writes if written is not None for r in written.rows]
    assert len(rows) == last["trail"]["count"] == 2
    lines = [line for row in rows for line in json.loads(row)] + last["trail"]["tail"]
    assert split(lines) == (h.runner.ctx.partial, h.runner.ctx.loops.lines, [])
    assert len(result.partial) == 101


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
    # the rebuilt turn's next save carries what it adds after the stored tail
    part, row = again.trail.save()
    assert row is None and part["count"] == stored["trail"]["count"] == 0
    assert sorted(part["tail"]) == sorted(stored["trail"]["tail"])
    again.partial.append("one more")
    after, row = again.trail.save()
    assert row is None and after["count"] == stored["trail"]["count"]
    assert sorted(after["tail"]) == sorted([*stored["trail"]["tail"], "pone more"])


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
    assert len(reread["trail"]["tail"]) == len(live.partial) + len(live.loops.lines)
    assert read(reread["trail"])[0][0] == live.partial


async def test_a_damaged_trail_ends_the_turn_internal_with_its_partial_work() -> None:
    h = long_turn(2)
    await h.run()
    stored = await h.store.get_checkpoint("t1")
    assert stored is not None
    stored["trail"]["tail"].append("?not a line")
    again = TurnRunner(h.record, h.control, runtime=h.runtime, shared=h.shared,
                       store=h.store, bus=h.bus, clock=h.clock, checkpoint=stored,
                       history=[]).ctx
    assert again.restore_error is not None and "not a trail line" in again.restore_error
    assert again.partial == []  # the lines could not be read apart: none are claimed
