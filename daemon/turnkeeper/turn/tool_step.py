"""The tools of one step: each call's guards (loop detection, time left), its journal
entry (so a resumed turn never runs a side effect twice), its attempts (retries only for
idempotent tools) and its outcome, told to the agent and to the guards
(`turn/tool_report.py`). `report_blocked`, `clarify` and `update_plan` go to the
builtins, their arguments checked first like any tool's.

A non-idempotent call is planned by the turn's effect ledger (its key, or a refusal when
the same action's last outcome is unknown) and recorded in it afterwards. An unknown
outcome is neither a success nor a failure to retry: it is told to the agent as
something to check, and left in the result as an open issue."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import anyio

from turnkeeper import event_types as ev
from turnkeeper.config import BUILTIN_TOOL_NAMES, ToolConfig
from turnkeeper.policy.classify import CallFailure, classify
from turnkeeper.policy.effects import Refuse
from turnkeeper.policy.loops import Action, LoopWarning, action_key
from turnkeeper.policy.outcome import Stop, StopCode, TurnResult
from turnkeeper.policy.replies import cut_call_message
from turnkeeper.providers.base import ToolCall
from turnkeeper.tools.arguments import ArgumentProblem
from turnkeeper.tools.mcp_tool import McpTool
from turnkeeper.tools.registry import ToolOutcome
from turnkeeper.turn.approvals import ApprovalRoom
from turnkeeper.turn.builtins import Builtins
from turnkeeper.turn.context import TurnContext
from turnkeeper.turn.tool_attempts import ToolAttempts
from turnkeeper.turn.tool_report import ToolReport, unknown_outcome


class ToolStep:
    def __init__(self, ctx: TurnContext, builtins: Builtins) -> None:
        self.ctx = ctx
        self.builtins = builtins
        self.attempts = ToolAttempts(ctx)
        self.approvals = ApprovalRoom(ctx)
        self.report = ToolReport(ctx)

    def _call_positions(self) -> dict[str, int]:
        calls: tuple[ToolCall, ...] = ()
        for m in reversed(self.ctx.conv.messages):  # the last reply's (a loop: no generator)
            if m.role == "assistant":
                calls = m.tool_calls
                break
        position = {c.id: i for i, c in enumerate(calls)}
        return position if len(position) == len(calls) else {}

    async def run(self, calls: tuple[ToolCall, ...], *, resuming: bool
                  ) -> TurnResult | None:
        ctx = self.ctx
        step = ctx.record.counters.steps
        observations: list[str] = []
        states: list[str] = []
        all_polling = True
        # A call's Idempotency-Key names its place in the model's reply, not in `calls`,
        # which on resume holds only the calls still without a result. (A step's own
        # run has the reply's calls themselves, in order: each one's place is its index.)
        position = self._call_positions() if resuming else {}
        places = [(call, f"{ctx.record.id}.{step}.{position.get(call.id, n)}")
                  for n, call in enumerate(calls)]
        # Calls held for a person's approval: the whole step waits for the decisions.
        if self.approvals.may_hold():
            held = await self.approvals.settle(places, resuming=resuming)
            if held is not None:
                return held
        for call, key in places:
            # A call the output cap cut is refused like malformed arguments, a built-in
            # too (a cut report_blocked would end the turn with half its reason).
            if call.name in BUILTIN_TOOL_NAMES and call.cut_at is None:
                all_polling = False
                ended = await self._builtin(call)
                if ended is not None:
                    return ended
                continue
            decided = ctx.decided.get(call.id)
            if decided is not None and decided["decision"] == "deny":
                observations.append(self.approvals.denied(call, decided["reason"]))
                all_polling = False
                continue
            if decided is not None and decided["arguments"] is not None:
                call = replace(call, arguments=json.dumps(decided["arguments"]))
            tool = ctx.tool(call.name)
            all_polling = all_polling and bool(tool and tool.polling)
            result = await self._tool_call(call, tool, key, resuming=resuming)
            control = ctx.control
            if isinstance(result, Stop) or control.cancel_requested or control.suspend_now:
                return await self._cut_short(call, result)
            content, state = result
            if content is not None:
                observations.append(content)
            if state is not None:
                states.append(state)
        if observations:
            self._after_step(observations, states, polling_only=all_polling)
        # No checkpoint here, nor at the next step boundary: every call's outcome is in
        # the journal, and the results go with the model reply's checkpoint (or the
        # result). One here cost ~15% of a step's CPU and a commit round trip; one at
        # the boundary 8% of the instructions of a step and a write of the turn's row.
        # (The step's approval decisions go with it: that checkpoint holds their results.)
        ctx.decided.clear()
        if resuming:
            # The record shows the chain's counters as restored (a reload may have moved
            # the chain to a new provider list). A step that follows a model call needs
            # no copy: nothing in the tools moves the chain, and the call copied them.
            ctx.sync_counters()
        return None

    async def _cut_short(self, call: ToolCall,
                         result: Stop | tuple[str | None, str | None]) -> TurnResult:
        """The step ends after `call`: a plain cancel waited for the call's effect (its
        real outcome is known); a stop waited for it (its outcome is in the journal and
        the conversation, the calls after it run on resume: the turn suspends); or the
        call stopped the turn."""
        ctx = self.ctx
        if ctx.control.cancel_requested:
            return ctx.finish(Stop(StopCode.CANCELLED, "cancelled by request"))
        if not isinstance(result, Stop):
            await ctx.suspend()
        if any(c.id == call.id for c in ctx.conv.pending_tool_calls()):
            ctx.conv.add_tool_result(call, "not run: the turn stops here")
        await ctx.checkpoint()
        return ctx.stop(result)

    def _after_step(self, observations: list[str], states: list[str], *,
                    polling_only: bool) -> None:
        """The loop guard's word on the step's observations: a stop is held for the step
        boundary (`hold_stop`)."""
        ctx = self.ctx
        stop = ctx.loops.after_step(observations, state="|".join(states) if states else None,
                                    polling_only=polling_only)
        stop = ctx.gate(stop) if stop is not None else None
        if stop is not None:
            ctx.hold_stop(stop)
            ctx.log.info("guard.loop_stop", code=stop.code.value, value=stop.value,
                         limit=stop.limit, no_progress=ctx.loops.no_progress,
                         **ctx.counter_values())

    async def _builtin(self, call: ToolCall) -> TurnResult | None:
        """A built-in call, its arguments checked like any tool's: malformed ones (cut
        JSON, a wrong type) are a deterministic failure told to the agent and counted
        by the failure loop, so it can send them again (unless the failure loop stops
        the turn); only a well-formed report_blocked ends the turn. None: the step goes
        on."""
        ctx = self.ctx
        args, problem = ctx.runtime.toolbox.check_arguments(call.name, call.arguments)
        failure: CallFailure | None = None
        if args is None:
            assert problem is not None
            failure = problem.failure
        elif call.name == "report_blocked":
            if not ctx.has_unread_steer():
                return self.builtins.blocked(args)
            # The agent gave up without reading what the user just sent: it reads it
            # first (a turn never ends with an unread steer).
            ctx.conv.add_tool_result(call, "not ended: the user sent a message; read "
                                           "it, then answer or call report_blocked")
        elif call.name == "update_plan":
            failure = self.builtins.update_plan(call, args)
        else:
            return await self.builtins.clarify(call, str(args.get("question") or ""))
        if failure is None:
            return None
        stop = self.report.failed(call, args, failure)
        if not isinstance(stop, Stop):
            return None
        await ctx.checkpoint()
        return ctx.stop(stop)

    async def _tool_call(self, call: ToolCall, tool: ToolConfig | McpTool | None, key: str,
                         *, resuming: bool) -> Stop | tuple[str | None, str | None]:
        """One tool call with its guards, journal, breaker and retries. `tool`: the
        turn's agent's (`ctx.tool`); one it is not offered is unknown to it, whoever else
        has it. `key` is the call's place (`<turn>.<step>.<index>`), the Idempotency-Key
        of an idempotent tool; a non-idempotent one takes its key from the turn's effect
        ledger, which keeps it across steps for the same action until its outcome is
        known. Returns the observation (content, state), content None for a failure (the
        failure loop governs those, not the progress and state rules), or a Stop."""
        ctx = self.ctx
        place = key
        if call.cut_at is not None:
            tool = None
        args, problem = (None, None) if tool is None else ctx.runtime.toolbox.check_arguments(
            call.name, call.arguments)
        if tool is None or problem is not None:
            return await self._refused(call, key, problem, resuming=resuming)
        assert args is not None
        action = Action(tool=call.name, key=action_key(call.name, args), polling=tool.polling)
        verdict = ctx.loops.before_action(action)
        if verdict is not None:  # the usual call: nothing to say, and no call to say it
            stop = self._before_action(call, verdict)
            if stop is not None:
                return stop
        if not tool.idempotent:
            plan = ctx.effects.plan(call.name, args,
                                    dedupes_keys=ctx.settings.tools.dedupes_keys(call.name))
            if isinstance(plan, Refuse):  # nothing is sent: the effect may have happened
                ctx.record.counters.tool_attempts = 0
                ctx.loops.after_action(action, classify(plan.failure))
                return self.report.failed(call, args, plan.failure)
            key = plan.key
        # Resumed: the journal says whether the call was sent, and how it went.
        journalled = await self._journalled(call, args, place,
                                            idempotent=tool.idempotent) if resuming else None
        entry = None
        # A call sent before the cut is idempotent only if it was sent as one and its
        # tool still is: the stricter word of the two governs a repeat and the ledger.
        idempotent = tool.idempotent
        if journalled is not None:
            key, entry = journalled
            idempotent = idempotent and bool(entry["idempotent"])
        if entry is None or (entry["outcome"] is None and idempotent):
            # A request is to be sent: not with no time left for even a request (a cut
            # non-idempotent call would leave an effect of unknown outcome behind).
            spent = ctx.time_spent()
            if spent is not None:
                return spent
        ctx.emit(ev.ToolCalled(tool=call.name, call_id=call.id, key=key, arguments=args))
        outcome = None if entry is None else await self._stored_outcome(
            key, entry, idempotent=idempotent)
        if outcome is None:
            outcome = await self._send(call, args, key, idempotent=idempotent)
        return self.report.outcome(call, args, key, outcome, action, idempotent=idempotent)

    async def _refused(self, call: ToolCall, key: str, problem: ArgumentProblem | None, *,
                       resuming: bool) -> Stop | tuple[str | None, str | None]:
        """A call the turn does not take: cut by the output cap, naming a tool the agent
        is not offered, or with arguments its tool refuses (`problem`). A resumed call
        the journal already holds an outcome of is reported as it went (`_recalled`)."""
        if call.cut_at is not None:
            return self.report.failed(call, None, CallFailure(
                exception=("MalformedArguments",), message=cut_call_message(call.cut_at)))
        recalled = await self._recalled(call, key) if resuming else None
        if recalled is not None:
            return recalled
        if problem is not None:
            return self.report.failed(call, None, problem.failure)
        return self.report.failed(call, None, CallFailure(
            exception=("UnknownTool",), message=f"there is no tool named {call.name!r}"))

    def _before_action(self, call: ToolCall, verdict: Stop | LoopWarning) -> Stop | None:
        """The loop guard's word before the call is made (`verdict`): a stop (when its
        family enforces), or a warning told to the agent (unless observed only)."""
        ctx = self.ctx
        if isinstance(verdict, Stop):
            return ctx.gate(verdict)
        if ctx.modes["loop_detection"] != "observe":
            ctx.conv.add_note(verdict.message)
        ctx.emit(ev.LoopWarning(code=verdict.code, count=verdict.count,
                                limit=verdict.limit, tool=call.name))
        ctx.log.info("guard.loop_warning", tool=call.name, code=verdict.code,
                     repeats=verdict.count, limit=verdict.limit, **ctx.counter_values())
        return None

    async def _journalled(self, call: ToolCall, args: dict[str, Any], place: str, *,
                          idempotent: bool | None) -> tuple[str, dict[str, Any]] | None:
        """A resumed call's journal entry and the key it is journalled under; None when
        it was never sent. An idempotent call is journalled under its place in the
        step (`place`), another under the key the effect ledger plans for it. The tool's
        flag now (`idempotent`; None: no tool takes the call now) says where to look
        first, and the other key is asked too: a new policy may have flipped the flag
        since the call was sent, and what the journal holds of it still stands."""
        ctx = self.ctx
        plan = ctx.effects.plan(call.name, args,
                                dedupes_keys=ctx.settings.tools.dedupes_keys(call.name))
        planned = None if isinstance(plan, Refuse) else plan.key
        keys = (planned, place) if idempotent is False else (place, planned)
        for key in (k for k in keys if k is not None):
            entry = await ctx.store.journal_get(key)
            if entry is not None:
                return key, entry
        return None

    async def _recalled(self, call: ToolCall, key: str
                        ) -> Stop | tuple[str | None, str | None] | None:
        """A call made before the turn was cut, that the toolbox no longer takes as it
        did: its tool gone (a new policy, an MCP server not back yet) or its arguments
        refused (a new schema). What the journal holds of it still stands: its outcome,
        reported and counted as it would have been, found by the call's place (an
        idempotent call's key) or by the effect ledger (a non-idempotent one's). None
        when the journal has nothing to say (the call is refused as any other)."""
        ctx = self.ctx
        args, _ = ctx.runtime.toolbox.parse_arguments(call.name, call.arguments)
        if args is None:
            return None
        journalled = await self._journalled(call, args, key, idempotent=None)
        if journalled is None:
            return None
        key, entry = journalled
        # With no tool now, the flag the call was sent with is the only word on it.
        outcome = await self._stored_outcome(key, entry, idempotent=bool(entry["idempotent"]))
        if outcome is None:
            return None
        action = Action(tool=call.name, key=action_key(call.name, args), polling=False)
        ctx.loops.before_action(action)  # counted as when it was let through
        ctx.emit(ev.ToolCalled(tool=call.name, call_id=call.id, key=key, arguments=args))
        return self.report.outcome(call, args, key, outcome, action,
                            idempotent=entry["idempotent"])

    async def _stored_outcome(self, key: str, entry: dict[str, Any], *,
                              idempotent: bool) -> ToolOutcome | None:
        """What the journal entry of a call sent before the turn was cut says: its
        outcome; None for an idempotent call (`idempotent`: as it was sent and as its
        tool is now) with no outcome: it may be sent again with its key. Any other call
        sent with no answer is unknown (and journalled so), never sent again: it was sent
        as an effect that must not repeat, or its tool is now said not to be idempotent."""
        if entry["outcome"] is not None:
            return ToolOutcome.from_json(entry["outcome"])
        if idempotent:
            return None
        outcome = unknown_outcome("DaemonStopped", "the daemon stopped while it was in flight")
        await self.ctx.store.journal_outcome(key, outcome.to_json())
        return outcome

    async def _send(self, call: ToolCall, args: dict[str, Any], key: str, *,
                    idempotent: bool) -> ToolOutcome:
        """Journal the intent, make the attempts, journal the outcome. A non-idempotent
        call is an effect in flight from its intent to its outcome: a stop or a plain
        cancel waits for it; one that cuts it anyway (cancel --now, the daemon's last
        resort) leaves the outcome unknown, journalled and reported before the cut goes on."""
        ctx = self.ctx
        if ctx.control.confirm_lease is not None:
            await ctx.control.confirm_lease()  # a lapsed lease: wait, send nothing yet
        # Set before the intent's write, so a plain cancel cannot cut between the write
        # and the request; a cut during the write sends nothing (nothing to report).
        ctx.control.effect_in_flight = not idempotent
        try:
            await ctx.store.journal_intent(key, turn=ctx.record.id, tool=call.name,
                                           arguments=call.arguments, idempotent=idempotent)
        except BaseException:
            ctx.control.effect_in_flight = False
            raise
        try:
            outcome = await self.attempts.run(call.name, args, key, idempotent=idempotent,
                                              call_id=call.id)
            await ctx.store.journal_outcome(key, outcome.to_json())
        except anyio.get_cancelled_exc_class():
            if not idempotent:
                with anyio.CancelScope(shield=True):
                    why = ("cancelled with --now while it was in flight"
                           if ctx.control.cancel_now else "cut while it was in flight")
                    cut = unknown_outcome("Cancelled", why)
                    await ctx.store.journal_outcome(key, cut.to_json())
                    ctx.effects.record(call.name, args, cut.kind)
                    self.report.unknown(call, args, key, cut)
            raise
        finally:
            ctx.control.effect_in_flight = False
        return outcome

