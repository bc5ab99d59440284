"""A turn's conversation as the store keeps it, message rows written once: after a real
turn (a tool step, a compaction after an overflow) the stored rows are its conversation,
and a turn resumed from a checkpoint with its messages inline writes them all again."""

from __future__ import annotations

from typing import Any

import pytest
from tests.unit.test_runner import OVERFLOW, Harness, answer, calls

from turnkeeper.policy.outcome import StopCode
from turnkeeper.turn.runner import TurnRunner

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


EARLIER = [{"message": f"earlier {i}", "result": {"answer": f"answer {i}"}} for i in range(4)]


async def stored_messages(h: Harness) -> list[dict[str, Any]]:
    checkpoint = await h.store.get_checkpoint(h.record.id)
    assert checkpoint is not None
    conv = checkpoint["conversation"]
    assert "count" in conv and len(conv["messages"]) == conv["count"]
    messages: list[dict[str, Any]] = conv["messages"]
    return messages


async def test_the_stored_rows_are_the_conversation_after_a_step_and_a_compaction(
        ) -> None:
    h = Harness([calls("echo", '{"text": "hi"}'), OVERFLOW, answer()], history=EARLIER)
    result = await h.run()
    assert result is not None and result.stopped_because.code is StopCode.COMPLETED
    conv = h.runner.ctx.conv
    assert conv.turn_start < 8  # the overflow dropped history: every row moved
    assert await stored_messages(h) == [m.to_json() for m in conv.messages]
    held = h.runner.ctx.result_checkpoint  # written with the result: up to the answer
    assert held is not None and held[1].start + len(held[1].rows) == len(conv.messages)


async def test_a_checkpoint_with_its_messages_inline_is_written_as_rows_on_resume(
        ) -> None:
    first = Harness([calls("echo", '{"text": "hi"}'), answer()])
    await first.run()
    legacy = first.runner.checkpoint_data()
    legacy["conversation"] = {"messages": legacy["conversation"]["messages"],
                              "turn_start": legacy["conversation"]["turn_start"]}
    before = legacy["conversation"]["messages"]
    # The same turn, resumed from that checkpoint in a store that holds no rows for it.
    h = Harness([answer("again")])
    h.record.counters.steps = first.record.counters.steps
    h.runner = TurnRunner(h.record, h.control, runtime=h.runtime, shared=h.shared,
                          store=h.store, bus=h.bus, clock=h.clock, checkpoint=legacy,
                          history=[], rand=lambda a, b: b)
    h.record.inbox = [{"kind": "steer", "text": "once more", "redirect": False, "at": 0.0}]
    result = await h.run()
    assert result is not None and result.answer == "again"
    stored = await stored_messages(h)
    assert stored[:len(before)] == before
    assert [m["content"] for m in stored[len(before):]] == ["once more", "again"]
