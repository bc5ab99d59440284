"""The tools the daemon answers itself: `report_blocked` (the agent gives up and says
why), `clarify` (the agent asks the user and waits for the answer, parked) and
`update_plan` (the agent's checklist, whose finished items count as progress)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from turnkeeper.event_types import TurnWaiting
from turnkeeper.policy.budget import CLOCK_STOPS
from turnkeeper.policy.classify import CallFailure
from turnkeeper.policy.extension import Plan
from turnkeeper.policy.outcome import Stop, StopCode, TurnResult
from turnkeeper.policy.turn_state import TurnState
from turnkeeper.providers.base import ToolCall
from turnkeeper.turn.context import TurnContext


class Builtins:
    def __init__(self, ctx: TurnContext) -> None:
        self.ctx = ctx

    def blocked(self, args: Mapping[str, Any]) -> TurnResult:
        """End the turn `blocked` with the agent's reason, what it tried and found
        (`args` checked against the tool's schema by the caller)."""
        ctx = self.ctx
        reason = str(args.get("reason") or "blocked")
        tried = [str(x) for x in args.get("tried") or []]
        found = [str(x) for x in args.get("found") or []]
        ctx.partial.extend(f"tried: {t}" for t in tried)
        ctx.partial.extend(f"found: {f}" for f in found)
        ctx.open_issues.append(reason)
        return ctx.finish(Stop(StopCode.BLOCKED, reason), answer=None,
                          extra={"blocked": {"reason": reason, "tried": tried,
                                             "found": found}})

    def update_plan(self, call: ToolCall, args: Mapping[str, Any]) -> CallFailure | None:
        """Replace the agent's plan. A list the plan cannot take (too long, an empty
        item) is returned as the call's failure, the plan left as it was."""
        ctx = self.ctx
        items = Plan.parse(args)
        if isinstance(items, str):
            return CallFailure(exception=("SchemaViolation",),
                               message=f"{items}; plan unchanged")
        newly = ctx.extension.update_plan(items)
        plan = ctx.extension.plan
        ctx.conv.add_tool_result(call, plan.summary())
        if newly:
            ctx.partial.append(f"step {ctx.record.counters.steps}: plan: {newly} more item(s)"
                               f" done ({len(plan.done)} of {len(plan.items)})")
        ctx.log.info("turn.plan_updated", items=len(plan.items), done=len(plan.done))
        return None

    def pending_clarify_call(self) -> ToolCall | None:
        """The clarify call a resumed turn was waiting on, if any."""
        if self.ctx.waiting_since is None or self.ctx.record.question is None:
            return None
        return ToolCall(id="clarify", name="clarify",
                        arguments=json.dumps({"question": self.ctx.record.question}))

    async def clarify(self, call: ToolCall, question: str | None = None
                      ) -> TurnResult | None:
        """Ask `question` (None: the one a resumed turn was waiting on), park until the
        answer (or the clarify timeout, the deadline or the wall clock), and give the
        agent the answer. None: the turn goes on."""
        ctx = self.ctx
        resumed = ctx.waiting_since is not None  # a wait that goes on after a resume
        if question is None:
            question = ctx.record.question or ""
        timeout = ctx.settings.clarify_timeout_s
        began = ctx.begin_wait()
        ctx.record.question = question

        def first_answer() -> dict[str, Any] | None:
            return next((m for m in ctx.record.inbox if m["kind"] == "answer"), None)

        # A resumed wait whose answer came meanwhile (while suspended, or held through a
        # reload) is over: it was announced, and there is nothing left of it to announce.
        if first_answer() is None or not resumed:
            ctx.emit(TurnWaiting(question=question, timeout_at=began + timeout))

        # A suspend keeps an answer that came in the inbox, for the resumed wait.
        await ctx.park(TurnState.WAITING, until=began + timeout,
                       done=lambda: first_answer() is not None)
        answer: str | None = None
        message = first_answer()
        if message is not None:
            answer = message["text"]
            ctx.record.inbox.remove(message)
        waited = ctx.end_wait()
        ctx.record.question = None
        if answer is None:
            ctx.conv.add_tool_result(call, "no answer came")
            stop = ctx.time_spent()
            if stop is not None and stop.code in CLOCK_STOPS:
                return ctx.stop(stop)
            return ctx.stop(Stop(StopCode.CLARIFY_TIMEOUT,
                                 f"no answer to the clarify question within {timeout:g} s",
                                 value=round(waited, 3), limit=timeout))
        ctx.conv.add_tool_result(call, answer)
        ctx.user_message_arrived()
        ctx.partial.append(f"step {ctx.record.counters.steps}: asked the user: "
                           f"{question[:200]}")
        await ctx.checkpoint()
        return None
