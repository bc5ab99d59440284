"""Room that follows progress: extensions earned by a turn still advancing, none for a
turn going round in circles, and the agent's plan in the result."""

from __future__ import annotations

import json

import pytest
from tests.unit.test_runner import SERVER_DOWN, Harness, answer, calls

from turnkeeper.policy.budget import BudgetLimits
from turnkeeper.policy.extension import Extension, Plan, PlanItem
from turnkeeper.policy.outcome import Stop, StopCode

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


STEPS = Stop(StopCode.BUDGET_STEPS, "step budget of 3 steps spent", value=3, limit=3)
SECONDS = Stop(StopCode.BUDGET_SECONDS, "time budget of 10 s of active time spent",
               value=10.0, limit=10.0)


def _ext(**kw: object) -> Extension:
    settings: dict[str, object] = {"enabled": True, "window": 2, "steps": 5,
                                   "seconds": 30.0, "max_extensions": 2}
    settings.update(kw)
    return Extension(**settings)  # type: ignore[arg-type]


def test_progress_in_the_window_earns_an_extension_up_to_the_ceiling() -> None:
    ext = _ext()
    ext.after_step(1, observations=1, states=1)
    ext.after_step(2, observations=1, states=1)
    ext.after_step(3, observations=2, states=2)  # something new at step 3
    grant = ext.decide(STEPS, steps=3)
    assert grant is not None and (grant.number, grant.of, grant.steps) == (1, 2, 5)
    assert "extended (1 of 2)" in grant.message
    limits = ext.extended(BudgetLimits(max_steps=3, max_seconds=10.0))
    assert (limits.max_steps, limits.max_seconds) == (8, 40.0)
    ext.after_step(8, observations=3, states=3)
    assert ext.decide(SECONDS, steps=8) is not None
    ext.after_step(9, observations=4, states=4)
    assert ext.decide(STEPS, steps=9) is None  # max_extensions reached


def test_no_progress_in_the_window_earns_nothing() -> None:
    ext = _ext()
    ext.after_step(1, observations=1, states=1)
    for step in (2, 3):  # the same observations again
        ext.after_step(step, observations=1, states=1)
    assert not ext.progressing(3)
    assert ext.decide(STEPS, steps=3) is None
    assert ext.granted == 0


def test_off_by_default_and_never_for_other_stops() -> None:
    ext = Extension()
    ext.after_step(1, observations=1, states=1)
    assert ext.decide(STEPS, steps=1) is None
    on = _ext()
    on.after_step(1, observations=1, states=1)
    assert on.decide(Stop(StopCode.BUDGET_TOKENS, "tokens"), steps=1) is None
    assert on.decide(Stop(StopCode.LOOP_NO_PROGRESS, "loop"), steps=1) is None


def test_a_completed_plan_item_is_progress() -> None:
    ext = _ext()
    ext.after_step(1, observations=1, states=1)
    ext.after_step(2, observations=1, states=1)
    assert ext.update_plan([PlanItem("read", True), PlanItem("write", False)]) == 1
    # The same item marked done again is not new progress.
    assert ext.update_plan([PlanItem("read", True), PlanItem("write", False)]) == 0
    assert ext.after_step(3, observations=1, states=1)
    assert ext.decide(STEPS, steps=3) is not None


def test_the_final_stop_names_the_base_and_the_extended_limit() -> None:
    ext = _ext()
    ext.after_step(1, observations=1, states=1)
    assert ext.decide(STEPS, steps=1) is not None
    final = ext.final_stop(Stop(StopCode.BUDGET_STEPS, "step budget of 8 steps spent",
                                value=8, limit=8), BudgetLimits(max_steps=3))
    assert final.base_limit == 3 and final.limit == 8
    assert "base limit 3 steps, extended to 8 steps by 1 extension" in final.message
    assert final.to_json()["base_limit"] == 3
    assert Stop.from_json(final.to_json()) == final
    assert ext.final_stop(final, BudgetLimits(max_steps=3)) is final  # once only


def test_the_state_survives_a_checkpoint() -> None:
    ext = _ext()
    ext.after_step(1, observations=1, states=1)
    ext.update_plan([PlanItem("a", True), PlanItem("b", False)])
    assert ext.decide(STEPS, steps=1) is not None
    data = json.loads(json.dumps(ext.snapshot()))
    back = _ext().restore_state(data)
    assert back.snapshot() == ext.snapshot()
    assert back.granted == 1 and back.plan.open == ("b",)


def test_a_malformed_plan_is_refused_with_the_reason() -> None:
    assert isinstance(Plan.parse({"items": [{"text": "x", "done": "yes"}]}), str)
    assert isinstance(Plan.parse({"items": [{"done": True}]}), str)
    assert isinstance(Plan.parse([]), str)
    assert Plan.parse({"items": [{"text": " a  b ", "done": True}]}) == (PlanItem("a b", True),)


# -- through the runner, in fake time -----------------------------------------------------

LOOSE_LOOPS = {"max_repeats": 100, "warn_repeats": 100, "max_state_revisits": 100,
               "max_no_progress": 100}


def _budget(**extension: object) -> dict[str, object]:
    return {"max_steps": 3, "extension": {"enabled": True, "window": 2, "steps": 2,
                                          "max_extensions": 2, **extension}}


async def test_a_turn_that_keeps_finding_new_things_finishes_past_its_base_limit() -> None:
    script = [calls("echo", json.dumps({"text": f"page {i}"})) for i in range(6)]
    h = Harness([*script, answer("all read")], budget=_budget(),
                loop_detection=LOOSE_LOOPS)
    result = await h.run()
    assert result is not None
    assert result.stopped_because.code is StopCode.COMPLETED
    assert h.record.counters.steps == 7
    extended = h.of_type("budget.extended")
    assert [(e["number"], e["max_steps"]) for e in extended] == [(1, 5), (2, 7)]
    assert result.extra["extensions"] == 2
    # The agent was told each time.
    notes = [m.content for m in h.provider.requests[-1].messages if m.content
             and "the turn was extended" in m.content]
    assert len(notes) == 2


async def test_a_looping_turn_with_the_same_limits_stops_at_its_base_limit() -> None:
    script = [calls("echo", json.dumps({"text": "same page"})) for _ in range(6)]
    h = Harness([*script, answer()], budget=_budget(), loop_detection=LOOSE_LOOPS)
    result = await h.run()
    assert result is not None
    stop = result.stopped_because
    assert (stop.code, stop.value, stop.limit, stop.base_limit) == (
        StopCode.BUDGET_STEPS, 3, 3, None)
    assert h.of_type("budget.extended") == []


async def test_the_stop_after_the_last_extension_names_both_limits() -> None:
    script = [calls("echo", json.dumps({"text": f"page {i}"})) for i in range(10)]
    h = Harness(script, budget=_budget(max_extensions=1), loop_detection=LOOSE_LOOPS)
    result = await h.run()
    assert result is not None
    stop = result.stopped_because
    assert (stop.code, stop.value, stop.limit, stop.base_limit) == (
        StopCode.BUDGET_STEPS, 5, 5, 3)
    assert "base limit 3 steps" in stop.message


async def test_update_plan_items_appear_in_done_and_open_issues() -> None:
    plan = {"items": [{"text": "find the file", "done": True},
                      {"text": "fix the bug", "done": False}]}
    h = Harness([calls("update_plan", json.dumps(plan)), answer("half done")])
    result = await h.run()
    assert result is not None
    assert result.extra["done"] == ["find the file"]
    assert "plan item not done: fix the bug" in result.open_issues
    assert result.to_json()["done"] == ["find the file"]
    told = [m.content for m in h.provider.requests[-1].messages if m.role == "tool"]
    assert told == ["plan updated: 1 of 2 items done"]


async def test_a_profile_may_turn_extensions_on() -> None:
    script = [calls("echo", json.dumps({"text": f"page {i}"})) for i in range(4)]
    h = Harness([*script, answer()], loop_detection=LOOSE_LOOPS,
                budget={"max_steps": 3, "profiles": {"long": {
                    "extension": {"enabled": True, "steps": 5}}}})
    h.record.profile = "long"
    h.runner = type(h.runner)(h.record, h.control, runtime=h.runtime, shared=h.shared,
                              store=h.store, bus=h.bus, clock=h.clock, checkpoint={},
                              history=[], rand=lambda a, b: b)
    result = await h.run()
    assert result is not None and result.stopped_because.code is StopCode.COMPLETED
    assert len(h.of_type("budget.extended")) == 1


async def test_a_resumed_turn_keeps_the_extensions_it_earned() -> None:
    script = [calls("echo", json.dumps({"text": f"page {i}"})) for i in range(4)]
    h = Harness([*script, answer()], budget=_budget(), loop_detection=LOOSE_LOOPS)
    result = await h.run()
    assert result is not None and len(h.of_type("budget.extended")) == 1
    assert h.record.limits["max_steps"] == 5 and h.record.limits["base_max_steps"] == 3
    checkpoint = json.loads(json.dumps(h.runner.checkpoint_data()))
    again = type(h.runner)(h.record, h.control, runtime=h.runtime, shared=h.shared,
                           store=h.store, bus=h.bus, clock=h.clock, checkpoint=checkpoint,
                           history=[], rand=lambda a, b: b)
    assert again.ctx.guard.limits.max_steps == 5
    assert again.ctx.limits.max_steps == 3
    assert again.ctx.extension.granted == 1


def test_the_limits_report_counts_the_turns_that_used_extensions() -> None:
    from turnkeeper.policy.limits import FinishedTurn, profile_report

    def turn(status: str, extensions: int) -> FinishedTurn:
        return FinishedTurn(profile="default", status=status, code="completed"
                         if status == "completed" else "budget.steps", tokens=10,
                         seconds=1.0, steps=5, cost_usd=0.0, extensions=extensions)

    report = profile_report("default", [turn("completed", 2), turn("completed", 0),
                                        turn("partial", 1)], limits={"max_steps": 3})
    assert report.to_json()["extended_turns"] == {"completed": 1, "partial": 1}


async def test_time_running_out_inside_a_model_call_is_extended_and_the_step_runs_again(
        ) -> None:
    h = Harness([calls("echo", json.dumps({"text": "page 1"})), SERVER_DOWN, answer("ok")],
                budget={"max_seconds": 10.0, "extension": {
                    "enabled": True, "window": 2, "seconds": 30.0, "max_extensions": 1}},
                loop_detection=LOOSE_LOOPS)
    requests = 0

    def slow_second_call() -> None:  # the 2nd call fails after 11 s of active time
        nonlocal requests
        requests += 1
        if requests == 2:
            h.clock.advance(11.0)

    h.provider.on_request = slow_second_call
    result = await h.run()
    assert result is not None
    assert result.stopped_because.code is StopCode.COMPLETED, result.stopped_because
    extended = h.of_type("budget.extended")
    assert [(e["reason"], e["max_seconds"]) for e in extended] == [("seconds", 40.0)]
    assert h.record.counters.steps == 2  # the cut step ran again, counted once
    assert h.record.counters.recovery_cycles == 0  # a new pass, no recovery waited out


def test_the_command_line_shows_the_plan_extensions_and_in_flight_limits() -> None:
    from turnkeeper.cli.render import limits_lines, result_lines, status_lines

    result = {"status": "completed", "answer": "half",
              "stopped_because": {"code": "completed", "counter": None, "value": None,
                                  "limit": None, "message": "the agent answered"},
              "partial": [], "open_issues": ["plan item not done: fix"], "done": ["look"]}
    assert "  plan    done: look" in result_lines(result)
    report = {"turns": 2, "factor": 2.5, "profiles": [
        {"profile": "default", "completed_turns": 1, "finished_turns": 2, "dimensions": {},
         "rules": {}, "extended_turns": {"completed": 1}}]}
    assert "  extended by progress: completed 1" in limits_lines(report)
    status = {"state": "ready", "policy_version": 1, "config_path": None, "version": "x",
              "uptime_s": 1.0, "last_reload_error": None, "mcp_servers": {},
              "turns": {}, "in_flight": {"primary": {
                  "limit": 8, "in_flight": 3, "max_in_flight": 16, "adaptive": True,
                  "waiting": 2, "decreases": 4}, "fallback": {"limit": None}}}
    lines = status_lines(status)
    assert ("in flight    primary 3 of 8 (adaptive, max 16), 2 waiting, 4 cuts") in lines
    assert not any("fallback" in line for line in lines)
