"""A tool call's outcome, told: to the agent (the call's result in the conversation), to
the guards (the loop detector, the failure loop, the effect ledger), to the turn's
partial work and open issues, and as events and log lines.

A failure is told to the agent whatever it was, so it can change what it sends; the
failure loop counts it. An unknown outcome (the effect may have happened and nothing
says whether) is neither: the agent is told to check, not to repeat, and the turn's
result lists it as an open issue.
"""

from __future__ import annotations

from typing import Any

from turnkeeper import event_types as ev
from turnkeeper.policy.classify import CallFailure, classify
from turnkeeper.policy.effects import EffectOutcome
from turnkeeper.policy.loops import Action
from turnkeeper.policy.outcome import Stop
from turnkeeper.providers.base import ToolCall
from turnkeeper.tools.registry import ToolOutcome
from turnkeeper.turn.context import TurnContext


class ToolReport:
    def __init__(self, ctx: TurnContext) -> None:
        self.ctx = ctx

    def outcome(self, call: ToolCall, args: dict[str, Any], key: str, outcome: ToolOutcome,
                action: Action, *, idempotent: bool
                ) -> Stop | tuple[str | None, str | None]:
        """A call's outcome told to the agent, its guards and its events."""
        ctx = self.ctx
        if not idempotent:
            ctx.effects.record(call.name, args, outcome.kind)
        ctx.loops.after_action(action, classify(outcome.failure) if outcome.failure else None)
        if outcome.unknown:  # `kind` is UNKNOWN (read without the property)
            return self.unknown(call, args, key, outcome)
        if outcome.failure is not None:
            return self.failed(call, args, outcome.failure, key=key)
        ctx.failures.record_success(call.name, args)
        ctx.conv.add_tool_result(call, outcome.content)
        ctx.partial.append(f"step {ctx.record.counters.steps}: {call.name} "
                           f"{_short(call.arguments)} -> ok")
        ctx.emit(ev.ToolResult(tool=call.name, call_id=call.id, key=key, ok=True,
                               content=outcome.content[:2000], state=outcome.state))
        return (outcome.content, outcome.state)

    def unknown(self, call: ToolCall, args: dict[str, Any], key: str,
                outcome: ToolOutcome) -> tuple[str | None, str | None]:
        """The effect may have happened and nothing says whether. It is not a failure to
        retry: the agent is told to check, not to repeat; the turn's result lists it as
        an open issue. The failure loop does not count it (a repeat is refused, and
        that refusal is what it counts)."""
        ctx = self.ctx
        assert outcome.failure is not None
        reason = outcome.failure.describe()
        issue = unknown_issue(call.name, call.arguments, key)
        if issue not in ctx.open_issues:
            ctx.open_issues.append(issue)
        ctx.conv.add_tool_result(call, (
            f"OUTCOME UNKNOWN: {call.name} may have done its effect ({reason}), and no "
            "answer says whether. It was not repeated. Check whether it happened before "
            f"doing it again (Idempotency-Key {key})."))
        ctx.partial.append(f"step {ctx.record.counters.steps}: {call.name} "
                           f"{_short(call.arguments)} -> outcome unknown")
        ctx.emit(ev.ToolResult(tool=call.name, call_id=call.id, key=key, ok=None,
                               outcome=str(EffectOutcome.UNKNOWN)))
        ctx.emit(ev.ToolOutcomeUnknown(tool=call.name, call_id=call.id, key=key,
                                       arguments=args, reason=reason))
        ctx.log.info("tool.outcome_unknown", tool=call.name, key=key, reason=reason,
                     **ctx.counter_values())
        return (f"unknown:{key}", None)

    def failed(self, call: ToolCall, args: dict[str, Any] | None, failure: CallFailure, *,
               key: str | None = None) -> Stop | tuple[str | None, str | None]:
        """The agent is told every failure (so it can change what it sends); the failure
        loop counts it."""
        ctx = self.ctx
        cls = classify(failure)
        text = f"ERROR ({cls.value}): {failure.describe()}"
        ctx.conv.add_tool_result(call, text)
        ctx.partial.append(f"step {ctx.record.counters.steps}: {call.name} "
                           f"{_short(call.arguments)} -> failed ({cls.value})")
        stop = ctx.failures.record_failure(call.name, args if args is not None
                                           else call.arguments, cls)
        stop = ctx.gate(stop) if stop is not None else None
        streak, limit = ctx.failures.streak, ctx.failures.thresholds[cls]
        ctx.emit(ev.ToolResult(tool=call.name, call_id=call.id, key=key, ok=False,
                               class_=cls.value, error=failure.describe()[:500],
                               failure_streak=streak, limit=limit))
        ctx.log.info("tool.failed", tool=call.name, failure_class=cls.value,
                     error=failure.describe()[:300], failure_streak=streak, limit=limit,
                     **ctx.counter_values())
        if stop is not None:
            return stop
        return (None, None)


def unknown_issue(tool: str, arguments: str, key: str) -> str:
    """The open issue an unknown outcome leaves in the turn's result: the same words
    whatever cut the call (a timeout, a reset, cancel --now, a stop, a crash)."""
    return f"outcome unknown: {tool} {arguments} (Idempotency-Key {key})"


def unknown_outcome(exception: str, message: str) -> ToolOutcome:
    """The outcome of a call cut with nothing to say whether its effect happened."""
    return ToolOutcome(content="", unknown=True,
                       failure=CallFailure(exception=(exception,), message=message))


def _short(arguments: str, limit: int = 120) -> str:
    return arguments if len(arguments) <= limit else arguments[:limit] + "..."
