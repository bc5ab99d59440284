"""Room that follows progress, for one turn: progress recorded at each step boundary,
the budget's step or time stop turned into an extension when `policy/extension.py`
grants one, and the result told what the agent's plan got done.

The state (grants, progress marks, the plan) lives in `ctx.extension` and travels in the
checkpoint; the limits a guard compares with are the base ones plus every grant, so a
resumed turn keeps what it earned.
"""

from __future__ import annotations

from dataclasses import replace

from turnkeeper import event_types as ev
from turnkeeper.policy.outcome import Stop, TurnResult
from turnkeeper.turn.context import TurnContext


class ProgressRoom:
    def __init__(self, ctx: TurnContext) -> None:
        self.ctx = ctx

    def step_boundary(self) -> None:
        """Record the progress of the step that just ended (if any)."""
        ctx = self.ctx
        ctx.extension.after_step(ctx.record.counters.steps,
                                 observations=ctx.loops.observations_seen,
                                 states=ctx.loops.states_seen)

    def extend(self, stop: Stop) -> Stop | None:
        """None when the stop was turned into an extension (the turn goes on); else the
        stop, naming the base limit too when the turn was extended before."""
        ctx = self.ctx
        grant = ctx.extension.decide(stop, steps=ctx.record.counters.steps)
        if grant is None:
            return ctx.extension.final_stop(stop, ctx.limits)
        ctx.apply_limits()
        limits = ctx.in_force.current
        ctx.conv.add_note(grant.message)
        ctx.partial.append(f"step {ctx.record.counters.steps}: {grant.reason} limit reached "
                           f"while making progress; extended ({grant.number} of "
                           f"{grant.of})")
        body = ev.BudgetExtended(number=grant.number, of=grant.of, reason=grant.reason,
                                 added_steps=grant.steps, added_seconds=grant.seconds,
                                 max_steps=limits.max_steps,
                                 max_seconds=limits.max_seconds,
                                 step=ctx.record.counters.steps,
                                 last_progress_step=grant.progress_step)
        ctx.emit(body)
        ctx.log.info("guard.budget_extended", number=grant.number, of=grant.of,
                     reason=grant.reason, max_steps=body.max_steps,
                     max_seconds=body.max_seconds, **ctx.counter_values())
        return None

    def finish(self, result: TurnResult) -> TurnResult:
        """The result with the plan's done items and open items, the extensions used,
        and a final budget stop naming both limits."""
        ext = self.ctx.extension
        stop = ext.final_stop(result.stopped_because, self.ctx.limits)
        if not ext.plan.items and ext.granted == 0 and stop is result.stopped_because:
            return result
        extra = dict(result.extra)
        issues = result.open_issues
        if ext.plan.items:
            extra["done"] = list(ext.plan.done)
            issues = issues + tuple(f"plan item not done: {t}" for t in ext.plan.open)
        if ext.granted:
            extra["extensions"] = ext.granted
        return replace(result, stopped_because=stop, open_issues=issues, extra=extra)
