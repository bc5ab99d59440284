"""The mode gate: enforce stops, warn and observe record once per code."""

from __future__ import annotations

from turnkeeper.policy.gate import ModeGate, WouldStop
from turnkeeper.policy.outcome import Stop, StopCode

MODES = {"budget": "enforce", "loop_detection": "warn", "failure_loop": "observe"}
LOOP = Stop(StopCode.LOOP_REPEATED_ACTION, "the same action 5 times", value=5, limit=5)
FAILURE = Stop(StopCode.FAILURE_UNKNOWN, "3 failures in a row", value=3, limit=3)


def test_an_enforced_family_stop_ends_the_turn() -> None:
    stop = Stop(StopCode.BUDGET_TOKENS, "tokens spent", value=10, limit=10)
    assert ModeGate(MODES).decide(stop, recorded=()) is stop


def test_a_stop_outside_every_family_ends_the_turn_in_any_mode() -> None:
    gate = ModeGate({"budget": "observe", "loop_detection": "observe",
                     "failure_loop": "observe"})
    for code in (StopCode.BUDGET_STEPS, StopCode.DEADLINE, StopCode.PROVIDERS_EXHAUSTED):
        stop = Stop(code, "over")
        assert gate.decide(stop, recorded=()) is stop


def test_warn_mode_records_would_have_stopped_and_tells_the_agent() -> None:
    decision = ModeGate(MODES).decide(LOOP, recorded=())
    assert isinstance(decision, WouldStop)
    assert decision.mode == "warn" and decision.stop is LOOP
    assert decision.note is not None
    assert decision.note.startswith("the same action 5 times. This limit is in warn mode")


def test_observe_mode_records_would_have_stopped_without_telling_the_agent() -> None:
    decision = ModeGate(MODES).decide(FAILURE, recorded=())
    assert isinstance(decision, WouldStop)
    assert decision.mode == "observe" and decision.note is None



def test_a_would_stop_is_recorded_once_per_code() -> None:
    assert ModeGate(MODES).decide(LOOP, recorded=(LOOP.code.value,)) is None
