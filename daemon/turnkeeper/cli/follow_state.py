"""What the live view of `turnkeeper follow` knows about its turn: the state the view is
drawn from, moved by the turn's events (`FollowState.apply`, one small method per event
type, picked by the table at the end) and by polls of the turn's JSON (`seen_turn`).

Plain data and no drawing: rich is imported by follow.py alone, which draws this state
and runs the loop that feeds it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from turnkeeper import event_types as ev
from turnkeeper.event_types import parse
from turnkeeper.policy.turn_state import TurnState

EVENT_LINES = 6


@dataclass(frozen=True, slots=True)
class Wait:
    """What the turn is waiting for, and until when (epoch seconds)."""

    kind: str  # retry | recovery | clarify | approval
    until: float | None
    detail: str


@dataclass(slots=True)
class FollowState:
    """Everything the view shows, updated from events (`apply`) and polls (`turn`)."""

    turn_id: str
    turn: dict[str, Any] = field(default_factory=dict)
    state: str = TurnState.QUEUED
    step: int = 0
    provider: str | None = None
    attempt: int = 0
    tokens: int = 0
    cost_usd: float = 0.0
    activity: str = ""
    wait: Wait | None = None
    answer: str = ""
    events: deque[str] = field(default_factory=lambda: deque(maxlen=EVENT_LINES))
    result: dict[str, Any] | None = None

    def apply(self, event: dict[str, Any], line: str | None) -> None:
        if line is not None:
            self.events.append(line)
        body = parse(event)
        handler = None if body is None else _APPLY.get(type(body))
        if handler is not None:
            handler(self, body, float(event.get("ts") or 0.0))

    def _started(self, e: ev.TurnStarted, ts: float) -> None:
        self.state = TurnState.RUNNING
        self.provider = e.provider or self.provider

    def _resumed(self, e: ev.TurnResumed, ts: float) -> None:
        self.state = TurnState.RUNNING
        self.wait = None

    def _suspended(self, e: ev.TurnSuspended, ts: float) -> None:
        self.state = TurnState.SUSPENDED
        self.activity = "suspended: it resumes by itself after the reload or restart"

    def _step(self, e: ev.StepStarted, ts: float) -> None:
        self.step = max(self.step, int(e.step or 0))
        self.provider = e.provider or self.provider
        self.wait = None
        self.activity = "calling the model"

    def _request(self, e: ev.ModelRequest, ts: float) -> None:
        self.state = TurnState.RUNNING
        self.provider = e.provider
        self.attempt = int(e.attempt or 1)
        self.wait = None
        self.answer = ""
        self.activity = f"waiting for {self.provider} (attempt {self.attempt})"

    def _queued(self, e: ev.ModelQueued, ts: float) -> None:
        self.activity = (f"waiting for an in-flight slot on {e.provider}: limit {e.limit}, "
                         f"{e.in_flight} in flight, {e.waiting} waiting")

    def _delta(self, e: ev.ModelDelta, ts: float) -> None:
        self.answer += str(e.text or "")
        self.activity = f"{self.provider} is answering"

    def _response(self, e: ev.ModelResponse, ts: float) -> None:
        usage = e.usage or {}
        self.tokens += int(usage.get("input_tokens", 0)) + int(usage.get("output_tokens", 0))
        self.cost_usd += float(e.cost_usd or 0.0)
        calls = int(e.tool_calls or 0)
        self.activity = f"{calls} tool call(s) asked" if calls else "answered"

    def _attempt_failed(self, e: ev.ModelAttemptFailed, ts: float) -> None:
        status = f" {e.status}" if e.status else ""
        self.activity = f"{e.provider} attempt {e.attempt} failed:{status} {e.class_}"

    def _retry(self, e: ev.ModelRetryScheduled, ts: float) -> None:
        status = f"{e.status} " if e.status else ""
        self.wait = Wait("retry", ts + float(e.delay or 0.0),
                         f"retry on {e.provider} (attempt {e.attempt}) after "
                         f"{status}{e.class_}")

    def _failover(self, e: ev.ModelFailover, ts: float) -> None:
        self.provider = e.to
        self.attempt = 0
        self.activity = f"failover {e.from_} -> {e.to} ({e.reason})"

    def _recovering(self, e: ev.TurnRecovering, ts: float) -> None:
        self.state = TurnState.RECOVERING
        until = e.next_attempt_at or ts + float(e.wait or 0.0)
        stretched = f" ({e.reason})" if e.waits_for != "schedule" and e.reason else ""
        self.wait = Wait("recovery", until,
                         f"recovery cycle {e.cycle} of {e.of}: every "
                         f"provider failed; next pass from the primary{stretched}")

    def _waiting(self, e: ev.TurnWaiting, ts: float) -> None:
        self.state = TurnState.WAITING
        self.wait = Wait("clarify", e.timeout_at,
                         f"clarify: {e.question}  (answer with `turnkeeper answer "
                         f"{self.turn_id} TEXT`)")

    def _approval_requested(self, e: ev.ToolApprovalRequested, ts: float) -> None:
        self.state = TurnState.WAITING
        held = f"{e.tool} ({e.call_id})"
        if self.wait is not None and self.wait.kind == "approval":
            held = self.wait.detail.split(": ", 1)[1].split("  (", 1)[0] + ", " + held
        self.wait = Wait("approval", e.timeout_at,
                         f"approval: {held}  (`turnkeeper approve {self.turn_id} CALL_ID`"
                         " or `deny`)")

    def _approval_decided(self, e: ev.ToolApprovalDecided, ts: float) -> None:
        self.activity = f"tool {e.tool} ({e.call_id}): {e.decision}d by {e.by}"
        if self.wait is not None and self.wait.kind == "approval":
            held = [h for h in self.wait.detail.split(": ", 1)[1].split("  (", 1)[0]
                    .split(", ") if h != f"{e.tool} ({e.call_id})"]
            self.wait = None if not held else Wait(
                "approval", self.wait.until, f"approval: {', '.join(held)}  "
                f"(`turnkeeper approve {self.turn_id} CALL_ID` or `deny`)")

    def _message(self, e: ev.TurnMessage, ts: float) -> None:
        if e.kind == "answer":
            self.wait = None

    def _tool_call(self, e: ev.ToolCalled, ts: float) -> None:
        self.activity = f"tool {e.tool} running"

    def _tool_retry(self, e: ev.ToolRetryScheduled, ts: float) -> None:
        self.wait = Wait("retry", ts + float(e.delay or 0.0),
                         f"retry of tool {e.tool} after {e.class_}")

    def _tool_result(self, e: ev.ToolResult, ts: float) -> None:
        self.wait = None
        self.activity = f"tool {e.tool}: " + (
            "ok" if e.ok else "outcome unknown" if e.ok is None else f"failed ({e.class_})")

    def _finished(self, e: ev.TurnFinished, ts: float) -> None:
        self.result = e.result
        self.state = e.result["status"]
        self.wait = None

    def seen_turn(self, turn: dict[str, Any]) -> None:
        self.turn = turn
        if self.result is None and turn.get("state"):
            self.state = turn["state"]
        self.step = max(self.step, int(turn.get("counters", {}).get("steps", 0)))
        self.tokens = max(self.tokens, int(turn.get("usage", {}).get("total_tokens", 0)))
        self.cost_usd = max(self.cost_usd, float(turn.get("usage", {}).get("cost_usd", 0.0)))
        if self.provider is None:
            self.provider = turn.get("provider")

    def seconds(self, now: float) -> float:
        usage = self.turn.get("usage") or {}
        seconds = float(usage.get("seconds", 0.0))
        since = self.turn.get("active_since")
        if since is not None and self.result is None:
            seconds += max(0.0, now - float(since))
        return seconds


# How each event type moves the view; a type not listed only adds its line.
_APPLY: dict[type[ev.EventBody], Callable[[FollowState, Any, float], None]] = {
    ev.TurnStarted: FollowState._started,
    ev.TurnResumed: FollowState._resumed,
    ev.TurnSuspended: FollowState._suspended,
    ev.StepStarted: FollowState._step,
    ev.ModelQueued: FollowState._queued,
    ev.ModelRequest: FollowState._request,
    ev.ModelDelta: FollowState._delta,
    ev.ModelResponse: FollowState._response,
    ev.ModelAttemptFailed: FollowState._attempt_failed,
    ev.ModelRetryScheduled: FollowState._retry,
    ev.ModelFailover: FollowState._failover,
    ev.TurnRecovering: FollowState._recovering,
    ev.TurnWaiting: FollowState._waiting,
    ev.TurnMessage: FollowState._message,
    ev.ToolApprovalRequested: FollowState._approval_requested,
    ev.ToolApprovalDecided: FollowState._approval_decided,
    ev.ToolCalled: FollowState._tool_call,
    ev.ToolRetryScheduled: FollowState._tool_retry,
    ev.ToolResult: FollowState._tool_result,
    ev.TurnFinished: FollowState._finished,
}
