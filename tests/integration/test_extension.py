"""Room that follows progress, through the real daemon: a turn that keeps finding new
things earns more steps past its base limit; a turn going round in circles under the
same limits stops at its base limit. The model is our loopback fault server."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.integration.fault_server import FaultServer, ok
from tests.integration.test_resilience import chain, config, of_type

# Loop detection out of the way: only the budget may stop these turns.
LOOSE_LOOPS = {"max_repeats": 100, "warn_repeats": 100, "max_state_revisits": 100,
               "max_no_progress": 100}
LIMITS = {"budget": {"max_steps": 4},
          "budget.extension": {"enabled": True, "window": 2, "steps": 3,
                               "max_extensions": 2},
          "loop_detection": LOOSE_LOOPS}


@pytest.fixture
def faults() -> Iterator[FaultServer]:
    server = FaultServer().start()
    yield server
    server.stop()


def _stop(turn: dict[str, Any]) -> dict[str, Any]:
    return turn["result"]["stopped_because"]  # type: ignore[no-any-return]


def test_a_turn_making_progress_finishes_past_its_base_step_limit(
        start: Any, faults: FaultServer) -> None:
    # Eight echo calls, each with new text (a new observation), then the answer: 9 steps
    # against a base limit of 4.
    faults.script("primary", then=ok("all eight pages read", tool_steps=8))
    d = start(config(chain(faults, "primary"), **LIMITS))
    turn = d.run("read every page")
    assert turn["state"] == "completed", turn["result"]
    assert turn["counters"]["steps"] == 9
    extended = of_type(d.events(turn["id"]), "budget.extended")
    assert [(e["number"], e["of"], e["reason"], e["max_steps"]) for e in extended] == [
        (1, 2, "steps", 7), (2, 2, "steps", 10)]
    assert turn["result"]["extensions"] == 2
    # The agent was told, in the conversation the model saw.
    last = faults.requests("primary")[-1].body["messages"]
    notes = [m["content"] for m in last
             if isinstance(m.get("content"), str) and "the turn was extended" in m["content"]]
    assert len(notes) == 2

    # The limits report counts the turn among those extended.
    status, report = d.get("/v1/limits/report")
    assert status == 200, report
    default = next(p for p in report["profiles"] if p["profile"] == "default")
    assert default["extended_turns"] == {"completed": 1}


def test_a_looping_turn_with_the_same_limits_stops_at_its_base_limit(
        start: Any, faults: FaultServer) -> None:
    same = ok("", tool_calls=(("echo", {"text": "the same page"}),))
    faults.script("primary", then=same)
    d = start(config(chain(faults, "primary"), **LIMITS))
    turn = d.run("read every page")
    stop = _stop(turn)
    assert (stop["code"], stop["counter"], stop["value"], stop["limit"]) == (
        "budget.steps", "steps", 4, 4)
    assert "base_limit" not in stop
    assert of_type(d.events(turn["id"]), "budget.extended") == []
    assert faults.count("primary") == 4


def test_the_stop_that_ends_an_extended_turn_names_both_limits(
        start: Any, faults: FaultServer) -> None:
    faults.script("primary", then=ok("never reached", tool_steps=50))
    d = start(config(chain(faults, "primary"), **LIMITS))
    turn = d.run("read every page")
    stop = _stop(turn)
    assert (stop["code"], stop["value"], stop["limit"], stop["base_limit"]) == (
        "budget.steps", 10, 10, 4)
    assert "base limit 4 steps, extended to 10 steps by 2 extensions" in stop["message"]


def test_update_plan_is_offered_and_its_items_reach_the_result(
        start: Any, faults: FaultServer) -> None:
    plan = {"items": [{"text": "look", "done": True}, {"text": "fix", "done": False}]}
    faults.script("primary", ok("", tool_calls=(("update_plan", plan),)),
                  then=ok("looked, not fixed"))
    d = start(config(chain(faults, "primary")))
    turn = d.run("look and fix")
    assert turn["state"] == "completed"
    assert turn["result"]["done"] == ["look"]
    assert "plan item not done: fix" in turn["result"]["open_issues"]
    offered = [t["function"]["name"] for t in faults.requests("primary")[0].body["tools"]]
    assert "update_plan" in offered
    told = [m for m in faults.requests("primary")[-1].body["messages"] if m["role"] == "tool"]
    assert json.dumps(told[-1]["content"]) == json.dumps("plan updated: 1 of 2 items done")
