"""The live view of `turnkeeper follow`: what it shows for a given turn and events, read
back as text from a rich console (no terminal, no daemon: the view is a pure function of
its state and the time)."""

from __future__ import annotations

from typing import Any

from rich.console import Console, RenderableType

from turnkeeper.cli.follow import render, render_result
from turnkeeper.cli.follow_state import FollowState

TURN: dict[str, Any] = {
    "id": "t_1", "session": "s1", "policy_version": 3, "state": "running",
    "counters": {"steps": 1, "fallback_hops": 0, "restarts": 0, "recovery_cycles": 0},
    "usage": {"total_tokens": 0, "seconds": 2.0, "cost_usd": 0.0},
    "limits": {"max_tokens": 1000, "max_seconds": 10.0, "max_steps": 4,
               "max_cost_usd": 0.0, "deadline": None},
}


def text(renderable: RenderableType) -> str:
    console = Console(width=120, record=True, force_terminal=False, color_system=None)
    console.print(renderable)
    return console.export_text()


def line(screen: str, start: str) -> str:
    return next(ln for ln in screen.splitlines() if ln.startswith(start))


def state(**turn: Any) -> FollowState:
    st = FollowState("t_1")
    st.seen_turn({**TURN, **turn})
    return st


def test_bars_measure_the_turn_s_own_limits() -> None:
    st = state()
    st.apply({"type": "step.started", "ts": 100.0, "step": 2, "provider": "p"}, None)
    st.apply({"type": "model.response", "ts": 100.5, "provider": "p",
              "usage": {"input_tokens": 200, "output_tokens": 50}}, None)
    screen = text(render(st, 101.0))
    assert "250 / 1,000" in line(screen, "tokens") and "25%" in line(screen, "tokens")
    assert "2 / 4" in line(screen, "steps") and "50%" in line(screen, "steps")
    assert line(screen, "tokens").count("█") == 8  # 25% of 30 cells, rounded
    assert "no cost limit" in line(screen, "cost")


def test_seconds_run_while_the_turn_is_active_and_stop_with_the_result() -> None:
    st = state(active_since=100.0)
    assert "5 / 10 s" in line(text(render(st, 103.0)), "seconds")  # 2 s stored + 3 s open
    st.apply({"type": "turn.finished", "ts": 104.0, "result": {
        "status": "completed", "stopped_because": {"code": "completed"}}}, None)
    assert "2 / 10 s" in line(text(render(st, 200.0)), "seconds")


def test_a_retry_counts_down_and_clears_when_the_next_attempt_starts() -> None:
    st = state()
    st.apply({"type": "model.retry_scheduled", "ts": 100.0, "provider": "p", "attempt": 2,
              "delay": 1.5, "class": "retryable", "status": 503}, None)
    screen = text(render(st, 100.5))
    assert "retry in 1.0 s" in screen and "503 retryable" in screen
    assert "retry in 0.0 s" in text(render(st, 105.0))  # late: never negative
    st.apply({"type": "model.request", "ts": 101.5, "provider": "p", "attempt": 2}, None)
    screen = text(render(st, 101.6))
    assert "retry in" not in screen and "attempt 2" in screen


def test_a_recovery_cycle_counts_down_to_its_next_attempt() -> None:
    st = state()
    st.apply({"type": "turn.recovering", "ts": 100.0, "cycle": 2, "of": 5, "wait": 30.0,
              "next_attempt_at": 130.0}, None)
    screen = text(render(st, 110.0))
    assert "recovery in 20.0 s" in screen and "cycle 2 of 5" in screen
    assert "recovering" in screen.splitlines()[0]


def test_a_recovery_wait_stretched_to_a_breaker_cooldown_says_why() -> None:
    st = state()
    st.apply({"type": "turn.recovering", "ts": 100.0, "cycle": 1, "of": 5, "wait": 30.0,
              "next_attempt_at": 130.0, "waits_for": "breaker",
              "reason": "no provider could be asked; a circuit breaker lets a probe "
                        "through in 30 s (the schedule said 1.5 s)"}, None)
    screen = text(render(st, 100.0))
    assert "circuit breaker" in screen and "1.5 s" in screen


def test_a_clarify_question_counts_down_to_its_timeout_until_answered() -> None:
    st = state()
    st.apply({"type": "turn.waiting", "ts": 100.0, "question": "which one?",
              "timeout_at": 3700.0}, None)
    screen = text(render(st, 700.0))
    assert "clarify in 3000.0 s" in screen and "which one?" in screen
    st.apply({"type": "turn.message", "ts": 701.0, "kind": "answer", "text": "this"}, None)
    assert "clarify in" not in text(render(st, 701.0))


def test_a_call_held_for_approval_shows_what_the_turn_waits_on_until_decided() -> None:
    st = state()
    for call_id, tool in (("call_0", "pay"), ("call_1", "delete_branch")):
        st.apply({"type": "tool.approval_requested", "ts": 100.0, "tool": tool,
                  "call_id": call_id, "key": "k", "arguments": {}, "requested_at": 100.0,
                  "timeout_at": 3700.0}, None)
    screen = text(render(st, 700.0))
    assert "approval in 3000.0 s" in screen
    assert "pay (call_0), delete_branch (call_1)" in screen
    assert "turnkeeper approve t_1 CALL_ID" in screen
    st.apply({"type": "tool.approval_decided", "ts": 701.0, "tool": "pay",
              "call_id": "call_0", "decision": "approve", "by": "operator",
              "requested_arguments": {}, "arguments": {}, "waited_s": 601.0}, None)
    screen = text(render(st, 701.0))
    assert "delete_branch (call_1)" in screen and "pay (call_0)" not in screen
    st.apply({"type": "tool.approval_decided", "ts": 702.0, "tool": "delete_branch",
              "call_id": "call_1", "decision": "deny", "by": "operator", "reason": "no",
              "requested_arguments": {}, "arguments": {}, "waited_s": 602.0}, None)
    assert "approval in" not in text(render(st, 702.0))


def test_top_shows_the_calls_a_turn_waits_to_have_approved() -> None:
    from turnkeeper.cli.top import state_of

    turn = {"state": "waiting", "pending_approvals": [
        {"tool": "pay", "call_id": "call_0"}, {"tool": "delete_branch", "call_id": "c1"}]}
    assert state_of(turn) == "waiting: approval of pay call_0, delete_branch c1"
    assert state_of({"state": "running"}) == "running"


def test_streamed_text_shows_and_a_new_attempt_starts_it_over() -> None:
    st = state()
    for chunk in ("Hello ", "there"):
        st.apply({"type": "model.delta", "ts": 100.0, "text": chunk}, None)
    assert "Hello there" in text(render(st, 100.0))
    st.apply({"type": "model.request", "ts": 101.0, "provider": "p", "attempt": 1}, None)
    assert "Hello there" not in text(render(st, 101.0))


def test_the_result_names_code_counter_value_and_limit() -> None:
    screen = text(render_result({
        "status": "partial", "answer": None, "partial": ["step 1: search -> ok"],
        "open_issues": ["stopped early: token budget of 1000 spent"],
        "stopped_because": {"code": "budget.tokens", "counter": "tokens", "value": 1204,
                            "limit": 1000, "message": "token budget of 1000 spent"}}))
    assert "partial: budget.tokens" in screen
    assert "tokens = 1204 of limit 1000" in screen
    assert "token budget of 1000 spent" in screen
    assert "step 1: search -> ok" in screen


def test_a_queued_turn_says_its_budget_is_not_known_yet() -> None:
    st = FollowState("t_1")
    st.seen_turn({**TURN, "state": "queued", "limits": {}})
    assert "known once the turn starts" in text(render(st, 0.0))
