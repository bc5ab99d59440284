"""The model call's meter keeps what it worked out (the offer's size, each message's, the
budget's last answer) and must answer exactly as if it had worked everything out again:
these tests change one input at a time and compare with a fresh estimate."""

from __future__ import annotations

import dataclasses

import pytest
from tests.unit.test_runner import Harness, answer

from turnkeeper.messages import Message, ToolSpec
from turnkeeper.policy.budget import BudgetGuard, Preflight
from turnkeeper.policy.outcome import Stop, StopCode
from turnkeeper.policy.usage import REQUEST_TOKENS, item_tokens
from turnkeeper.tools.offer import spec_texts
from turnkeeper.turn.conversation import message_texts
from turnkeeper.turn.metering import Meter


def fresh_estimate(h: Harness) -> int:
    """The request's size worked out from nothing, as the module describes it."""
    ctx = h.runner.ctx
    return (REQUEST_TOKENS + item_tokens((ctx.agent.system_prompt,))
            + sum(item_tokens(message_texts(m)) for m in ctx.conv.messages)
            + sum(item_tokens(spec_texts(s)) for s in ctx.tool_specs()))


def test_the_offer_is_sized_once_and_again_when_it_changes() -> None:
    h = Harness([answer()])
    box, tools = h.runtime.toolbox, h.runner.ctx.agent.tools
    specs = box.specs_for(tools)
    assert box.specs_tokens(tools) == sum(item_tokens(spec_texts(s)) for s in specs)
    assert box.specs_tokens(tools) == box.specs_tokens(tools)  # kept, same answer
    bigger = (*box.specs, ToolSpec(name="extra", description="x" * 400,
                                   parameters={"type": "object"}))
    box._offer._static = box._offer._specs = bigger  # an offer that changed (as MCP does)
    offered = box.specs_for(tools)
    assert offered is not specs
    assert box.specs_tokens(tools) == sum(item_tokens(spec_texts(s)) for s in offered)
    assert box.specs_tokens(tools) > sum(item_tokens(spec_texts(s)) for s in specs)


def test_the_estimate_follows_every_change_of_the_conversation() -> None:
    h = Harness([answer()])
    meter = h.runner.model.meter
    conv = h.runner.ctx.conv
    assert meter.input_tokens() == fresh_estimate(h)
    conv.add_note("a note " * 50)
    assert meter.input_tokens() == fresh_estimate(h)
    # A message replaced by another of a different size, the count unchanged: the
    # conversation says it changed (as a compaction does), and the estimate follows.
    conv.messages[-1] = Message(role="user", content="short")
    conv._changed_from(len(conv.messages) - 1)
    assert meter.input_tokens() == fresh_estimate(h)


def _near_the_limit(h: Harness) -> Meter:
    """A turn whose token budget leaves room for the request and a few hundred tokens."""
    ctx = h.runner.ctx
    ctx.guard = BudgetGuard(dataclasses.replace(
        ctx.guard.limits, max_tokens=h.runner.model.meter.input_tokens() + 300))
    return h.runner.model.meter


def test_the_pre_flight_answers_again_when_the_conversation_grows() -> None:
    h = Harness([answer()])
    meter = _near_the_limit(h)
    first = meter.preflight("main")
    assert isinstance(first, Preflight) and first.max_output_tokens == 300
    assert meter.preflight("main") is first  # nothing changed: the same answer
    h.runner.ctx.conv.add_note("x" * 800)  # 200 tokens more: the cap shrinks
    second = meter.preflight("main")
    assert isinstance(second, Preflight) and second.max_output_tokens < 300
    h.runner.ctx.conv.add_note("x" * 800)  # and now it does not fit at all
    third = meter.preflight("main")
    assert isinstance(third, Stop) and third.code is StopCode.BUDGET_TOKENS


def test_the_pre_flight_answers_again_after_a_charge_and_after_new_limits() -> None:
    h = Harness([answer()])
    meter = _near_the_limit(h)
    ctx = h.runner.ctx
    assert meter.preflight("main") == Preflight(max_output_tokens=300, short=("tokens",))
    ctx.record.usage.output_tokens += 100  # a reply was charged
    assert meter.preflight("main") == Preflight(max_output_tokens=200, short=("tokens",))
    # Limits extended (a new limits object on the same guard, as an extension does).
    ctx.guard.limits = dataclasses.replace(ctx.guard.limits,
                                           max_tokens=ctx.guard.limits.max_tokens + 1000)
    assert meter.preflight("main") == Preflight(max_output_tokens=1200, short=("tokens",))


@pytest.mark.parametrize("limit", [10, 10_000])
def test_the_pre_flight_asks_the_guard_it_is_given(limit: int) -> None:
    h = Harness([answer()])
    meter = h.runner.model.meter
    watched = BudgetGuard(dataclasses.replace(h.runner.ctx.guard.limits, max_tokens=limit))
    own = meter.preflight("main")
    other = meter.preflight("main", watched)
    assert isinstance(own, Preflight)
    assert isinstance(other, Stop) == (limit == 10)
    assert meter.preflight("main") == own
