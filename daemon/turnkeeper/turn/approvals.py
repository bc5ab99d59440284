"""Tool calls held for a person's approval (`[[tools]] approval`, decided by
`policy/approvals.py`).

Before any call of a step runs, the calls that need approval are listed in the turn's
record (`pending_approvals`, with the Idempotency-Key each would be sent with) and
announced (`tool.approval_requested`); the turn then parks in `waiting` exactly as for a
`clarify` question: checkpointed, its slot given back, woken by a message in its inbox.
A decision is such a message (kind `approval`, from `POST /v1/turns/{id}/approvals`,
carried by fleet mail to the node that holds the turn); it is taken here, recorded in
the checkpoint (`TurnContext.decided`) and announced (`tool.approval_decided`).

The whole step waits: no call of it runs, not even one that needs no approval, until
every held call is decided, and then they all run in the model's order. A later call
may depend on an earlier one, and a person deciding sees the step before any of it has
happened. The decisions are checkpointed (awaited) before the first call runs, so a
crash afterwards runs the step again as decided, from the journal: an approved call is
sent at most once, and a denied one never.
"""

from __future__ import annotations

from typing import Any

from turnkeeper.config import BUILTIN_TOOL_NAMES
from turnkeeper.event_types import ToolApprovalDecided, ToolApprovalRequested
from turnkeeper.policy.approvals import (
    ApprovalWait,
    TimeoutDeny,
    denial_text,
    needs_approval,
)
from turnkeeper.policy.budget import CLOCK_STOPS
from turnkeeper.policy.effects import Refuse
from turnkeeper.policy.outcome import Stop, TurnResult
from turnkeeper.policy.turn_state import TurnState
from turnkeeper.providers.base import ToolCall
from turnkeeper.turn.context import TurnContext


class ApprovalRoom:
    def __init__(self, ctx: TurnContext) -> None:
        self.ctx = ctx

    def may_hold(self) -> bool:
        """Whether a call of the step may be held: calls are pending, or the turn's agent
        or the tools' settings hold some. The usual step: no, and `settle` is not
        asked."""
        ctx = self.ctx
        return bool(ctx.record.pending_approvals or ctx.agent.approval
                    or ctx.settings.tools.approval_by_tool)

    async def settle(self, calls: list[tuple[ToolCall, str]], *, resuming: bool
                     ) -> TurnResult | None:
        """Hold the step (its calls, each with its place `<turn>.<step>.<index>`) until
        every call that needs approval is decided. None: the step runs (each call's
        decision in `ctx.decided`); a result: the turn ended while it waited (the
        approval timeout with `on_timeout = "stop"`, the deadline, the wall clock)."""
        ctx = self.ctx
        record = ctx.record
        if not self.may_hold():
            return None  # nothing is held, nor can be (the usual step: no lookups)
        asked = {p["call_id"] for p in record.pending_approvals}
        new = [h for h in await self._held(calls, resuming=resuming)
               if h["call_id"] not in asked]
        if not record.pending_approvals and not new:
            return None
        wait = ctx.settings.approvals
        now = ctx.clock.time()
        for held in new:
            held["requested_at"] = now
            record.pending_approvals.append(held)
        timeout_at = wait.deadline(p["requested_at"] for p in record.pending_approvals)
        for held in new:
            held["timeout_at"] = timeout_at
            ctx.emit(ToolApprovalRequested(
                tool=held["tool"], call_id=held["call_id"], key=held["key"],
                arguments=held["arguments"], requested_at=now, timeout_at=timeout_at))
            ctx.log.info("tool.approval_requested", tool=held["tool"],
                         call_id=held["call_id"], key=held["key"])
        while not self.take_decisions():
            verdict = wait.at((p["requested_at"] for p in record.pending_approvals),
                              now=ctx.clock.time())
            spent = ctx.time_spent()
            if spent is not None and (verdict is None or spent.code in CLOCK_STOPS):
                return await self._stopped(calls, spent)
            if isinstance(verdict, Stop):
                return await self._stopped(calls, verdict)
            if isinstance(verdict, TimeoutDeny):
                for pending in list(record.pending_approvals):
                    self._decide(pending, "deny", verdict.reason, None, by="timeout")
                break
            await ctx.park(TurnState.WAITING, until=self._deadline(wait),
                           done=self.take_decisions)
        ctx.user_message_arrived()
        # The decisions are durable before any call of the step is sent.
        await ctx.checkpoint()
        return None

    def _deadline(self, wait: ApprovalWait) -> float:
        return wait.deadline(p["requested_at"] for p in self.ctx.record.pending_approvals)

    async def _held(self, calls: list[tuple[ToolCall, str]], *, resuming: bool
                    ) -> list[dict[str, Any]]:
        """The calls of the step that need approval and have no decision yet: calls of a
        tool whose setting holds them, with arguments it takes, that would be sent (not a
        repeat the effect ledger refuses, not one the journal shows sent already)."""
        ctx = self.ctx
        toolbox = ctx.runtime.toolbox
        out: list[dict[str, Any]] = []
        for call, place in calls:
            if (call.name in BUILTIN_TOOL_NAMES or call.cut_at is not None
                    or call.id in ctx.decided):
                continue
            setting = (ctx.agent.approval_for(call.name)
                       or ctx.settings.tools.approval(call.name))
            if setting == "never":
                continue
            tool = ctx.tool(call.name)  # one its agent is not offered is refused unsent
            if tool is None or not needs_approval(
                    setting, idempotent=tool.idempotent,
                    destructive=bool(getattr(tool, "destructive", False))):
                continue
            args, _ = toolbox.check_arguments(call.name, call.arguments)
            if args is None:  # refused before anything is sent, as any bad call
                continue
            key = place
            if not tool.idempotent:
                plan = ctx.effects.plan(call.name, args,
                                        dedupes_keys=ctx.settings.tools.dedupes_keys(call.name))
                if isinstance(plan, Refuse):
                    continue
                key = plan.key
            if resuming and await ctx.store.journal_get(key) is not None:
                continue  # sent before the turn was cut: what the journal says stands
            out.append({"call_id": call.id, "tool": call.name, "arguments": args,
                        "key": key})
        return out

    def take_decisions(self) -> bool:
        """Take the decisions waiting in the inbox; True when no call is pending."""
        record = self.ctx.record
        for message in [m for m in record.inbox if m["kind"] == "approval"]:
            record.inbox.remove(message)
            pending = next((p for p in record.pending_approvals
                            if p["call_id"] == message.get("call_id")), None)
            if pending is None:  # decided already (a second decision sent by mail)
                self.ctx.log.info("tool.approval_ignored", call_id=message.get("call_id"))
                continue
            self._decide(pending, str(message["decision"]), str(message.get("text") or ""),
                         message.get("arguments"), by="operator")
        return not record.pending_approvals

    def _decide(self, pending: dict[str, Any], decision: str, reason: str,
                arguments: dict[str, Any] | None, *, by: str) -> None:
        ctx = self.ctx
        ctx.record.pending_approvals.remove(pending)
        edited = arguments if decision == "approve" else None
        ctx.decided[pending["call_id"]] = {"decision": decision, "reason": reason,
                                           "arguments": edited}
        waited = round(max(0.0, ctx.clock.time() - float(pending["requested_at"])), 3)
        ctx.emit(ToolApprovalDecided(
            tool=pending["tool"], call_id=pending["call_id"], decision=decision, by=by,
            requested_arguments=pending["arguments"],
            arguments=edited if edited is not None else pending["arguments"],
            waited_s=waited, reason=reason if decision == "deny" else None))
        ctx.log.info("tool.approval_decided", tool=pending["tool"],
                     call_id=pending["call_id"], decision=decision, by=by,
                     edited=edited is not None, waited_s=waited)

    def denied(self, call: ToolCall, reason: str) -> str:
        """A call a person denied: never sent. The agent reads the reason as its result;
        it is a decision, not a failure (the failure loop and the tool's counters do not
        see it). Returns the text, the step's observation."""
        ctx = self.ctx
        text = denial_text(reason)
        ctx.conv.add_tool_result(call, text)
        arguments = call.arguments if len(call.arguments) <= 120 else call.arguments[:120] + "..."
        ctx.partial.append(f"step {ctx.record.counters.steps}: {call.name} {arguments} "
                           "-> denied by the operator")
        return text

    async def _stopped(self, calls: list[tuple[ToolCall, str]], stop: Stop) -> TurnResult:
        """The turn ends while calls wait: none of the step's calls ran."""
        ctx = self.ctx
        pending = {c.id for c in ctx.conv.pending_tool_calls()}
        for call, _ in calls:
            if call.id in pending:
                ctx.conv.add_tool_result(call, "not run: the turn stops here")
        held = ", ".join(f"{p['tool']} ({p['call_id']})" for p in ctx.record.pending_approvals)
        if held:
            ctx.open_issues.append(f"not approved, not run: {held}")
        ctx.record.pending_approvals.clear()
        ctx.decided.clear()
        await ctx.checkpoint()
        return ctx.stop(stop)
