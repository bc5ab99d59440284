"""A turn of a named agent, run in fake time on the memory store: its system prompt and
only its tools are sent, a call of another tool is an unknown tool, and a turn whose
agent the policy no longer has runs as the default agent and says so."""

from __future__ import annotations

from typing import Any

import pytest
from tests.unit.test_runner import Harness, Script, answer, calls

from turnkeeper.policy.outcome import StopCode
from turnkeeper.turn.runner import TurnRunner

pytestmark = pytest.mark.anyio

BUILTINS = {"report_blocked", "clarify", "update_plan"}
CONFIG: dict[str, Any] = {
    "agent": {"system_prompt": "the default prompt"},
    "tools": [{"name": "search", "kind": "echo"}, {"name": "tickets", "kind": "echo"}],
    "agents": {"support": {"system_prompt": "the support prompt", "tools": ["tickets"]}},
}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def _harness(script: list[Script], agent: str | None) -> Harness:
    h = Harness(script, **CONFIG)
    h.record.agent = agent
    h.runner = TurnRunner(h.record, h.control, runtime=h.runtime, shared=h.shared,
                          store=h.store, bus=h.bus, clock=h.clock, checkpoint={},
                          history=[], rand=lambda a, b: b)
    return h


async def test_the_agents_prompt_and_only_its_tools_are_sent() -> None:
    h = _harness([calls("tickets", '{"title": "x"}'), answer()], "support")
    result = await h.run()
    assert result is not None and result.stopped_because.code is StopCode.COMPLETED
    for request in h.provider.requests:
        assert request.system == "the support prompt"
        assert {t.name for t in request.tools} == BUILTINS | {"tickets"}
    assert [r["ok"] for r in h.of_type("tool.result")] == [True]


async def test_a_tool_the_agent_is_not_offered_is_an_unknown_tool() -> None:
    h = _harness([calls("search", '{"q": "x"}'), answer()], "support")
    result = await h.run()
    assert result is not None and result.stopped_because.code is StopCode.COMPLETED
    [failed] = h.of_type("tool.result")
    assert failed["ok"] is False and failed["class"] == "deterministic"
    assert failed["error"] == "UnknownTool: there is no tool named 'search'"
    assert failed["key"] is None  # nothing was sent


async def test_a_turn_without_an_agent_runs_as_the_default_one_with_every_tool() -> None:
    h = _harness([answer()], None)
    await h.run()
    (request,) = h.provider.requests
    assert request.system == "the default prompt"
    assert {t.name for t in request.tools} == BUILTINS | {"search", "tickets"}
    assert h.of_type("turn.agent_removed") == []


async def test_a_turn_whose_agent_is_gone_runs_as_the_default_one_and_says_so() -> None:
    h = _harness([calls("search", '{"q": "x"}'), answer()], "retired")
    result = await h.run()
    assert result is not None and result.stopped_because.code is StopCode.COMPLETED
    assert h.of_type("turn.agent_removed") == [{"agent": "retired", "policy_version": 1}]
    assert h.record.agent is None and h.record.to_json()["agent"] is None
    assert h.provider.requests[0].system == "the default prompt"
    assert [r["ok"] for r in h.of_type("tool.result")] == [True]  # every tool again
    types = [e.type for e in h.events]
    assert types.index("turn.agent_removed") == types.index("turn.started") + 1
