"""A replayed dead letter resumes from its checkpoint; only the guard that stopped it
starts afresh."""

from __future__ import annotations

from typing import Any

from turnkeeper.policy.outcome import StopCode
from turnkeeper.policy.replay import resume_state

RESULT = {"status": "partial", "stopped_because": {"code": "providers.exhausted"}}


def _record(**extra: Any) -> dict[str, Any]:
    return {"id": "t_1", "state": "partial", "result": RESULT, "updated_at": 1.0,
            "counters": {"steps": 2, "provider_attempts": 1, "fallback_hops": 2,
                         "recovery_cycles": 5, "restarts": 1},
            "usage": {"total_tokens": 70}, **extra}


CHECKPOINT = {"conversation": {"messages": ["kept"]}, "chain": {"recovery_cycles": 5},
              "recover_until": 99.0, "failures": {"signature": "x", "streak": 2},
              "loops": {"repeats": {"a": 1}}, "pending_stop": {"code": "budget.steps"}}


def test_providers_exhausted_gets_a_fresh_chain_and_runs_its_failed_step_again() -> None:
    rec, cp = resume_state(StopCode.PROVIDERS_EXHAUSTED, _record(), CHECKPOINT, now=5.0)
    assert rec["state"] == "queued" and rec["result"] is None and rec["updated_at"] == 5.0
    assert rec["previous_results"] == [RESULT]
    assert cp["chain"] is None and cp["recover_until"] is None
    assert rec["counters"] == {"steps": 1, "provider_attempts": 0, "fallback_hops": 0,
                               "recovery_cycles": 0, "restarts": 1}
    assert cp["failures"] == CHECKPOINT["failures"] and cp["loops"] == CHECKPOINT["loops"]
    assert cp["conversation"] == CHECKPOINT["conversation"]
    assert rec["usage"] == {"total_tokens": 70}
    assert cp["pending_stop"] is None


def test_failure_deterministic_gets_a_fresh_streak_and_keeps_the_chain() -> None:
    rec, cp = resume_state(StopCode.FAILURE_DETERMINISTIC, _record(), CHECKPOINT, now=5.0)
    assert cp["failures"] == {"signature": None, "streak": 0}
    assert cp["chain"] == CHECKPOINT["chain"]
    assert rec["counters"]["steps"] == 2 and rec["counters"]["recovery_cycles"] == 5


def test_each_replay_keeps_the_results_before_it() -> None:
    rec, _ = resume_state(StopCode.INTERNAL, _record(previous_results=[{"n": 1}]), {},
                          now=5.0)
    assert rec["previous_results"] == [{"n": 1}, RESULT]


def test_a_replay_starts_the_wall_clock_again_and_keeps_the_spent_budget() -> None:
    rec, _ = resume_state(StopCode.PROVIDERS_EXHAUSTED, _record(started_at=1.0), CHECKPOINT,
                          now=86_400.0)
    assert "started_at" not in rec  # set again when the replay starts running
    assert rec["usage"] == {"total_tokens": 70}


def test_output_invalid_counts_its_answers_again_and_keeps_the_rest() -> None:
    record = {**_record(), "counters": {"steps": 4, "output_attempts": 3, "restarts": 1}}
    rec, cp = resume_state(StopCode.OUTPUT_INVALID, record, CHECKPOINT, now=5.0)
    assert rec["counters"] == {"steps": 4, "output_attempts": 0, "restarts": 1}
    assert cp["chain"] == CHECKPOINT["chain"] and cp["failures"] == CHECKPOINT["failures"]
    assert cp["conversation"] == CHECKPOINT["conversation"]
