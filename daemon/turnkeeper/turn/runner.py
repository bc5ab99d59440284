"""One turn, step by step. The runner only moves data between the pure decisions of
`turnkeeper.policy` and the world (providers, tools, store, events); every rule it
applies lives there.

Each step: absorb user messages, run the guards (before anything is spent), call the
model through the provider chain (`model_call`), checkpoint its reply, run the tools it
asked for (`tool_step`, with `builtins` for report_blocked and clarify); the step
boundary checkpoints too unless the tools just ran (their outcomes are in the journal,
and a turn resumed before its next reply runs them again from it). Those rooms share one
`TurnContext` and never call back up into this loop. Every way out, including a bug,
becomes one `TurnResult`; a turn asked to suspend returns None after its checkpoint.
"""

from __future__ import annotations

import random
import traceback
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import anyio

from turnkeeper import event_types as ev
from turnkeeper.clock import Clock
from turnkeeper.events import EventBus
from turnkeeper.policy.budget import BudgetUsage, Preflight
from turnkeeper.policy.chain import Phase
from turnkeeper.policy.outcome import COUNTER_OF, Stop, StopCode, TurnResult
from turnkeeper.policy.output import Invalid, Retry, check_output
from turnkeeper.policy.replies import (
    ANSWERED,
    Continue,
    CutCall,
    Refused,
    Truncated,
    judge_reply,
)
from turnkeeper.policy.turn_state import TurnState
from turnkeeper.providers.base import ModelReply, ToolCall
from turnkeeper.runtime import Runtime, Shared
from turnkeeper.store.base import Store, StoreUnavailable
from turnkeeper.store.fleet import StaleLease
from turnkeeper.turn.builtins import Builtins
from turnkeeper.turn.context import Redirected, Suspended, TurnContext
from turnkeeper.turn.control import TurnControl
from turnkeeper.turn.extension import ProgressRoom
from turnkeeper.turn.model_call import ModelCall
from turnkeeper.turn.record import TurnRecord
from turnkeeper.turn.tool_step import ToolStep

__all__ = ["TurnControl", "TurnRunner"]

# The chain's phases in which a model call cut by the time budget may be left, to run
# the step again after an extension (a chain that gave up keeps its word).
_PHASES_A_STEP_MAY_RERUN = frozenset({Phase.READY, Phase.ATTEMPTING, Phase.BACKING_OFF,
                                      Phase.RECOVERING})


class TurnRunner:
    def __init__(self, record: TurnRecord, control: TurnControl, *, runtime: Runtime,
                 shared: Shared, store: Store, bus: EventBus, clock: Clock,
                 checkpoint: dict[str, Any], history: list[dict[str, Any]],
                 rand: Callable[[float, float], float] = random.uniform) -> None:
        self.ctx = (TurnContext.restore(record, control, checkpoint, runtime=runtime,
                                        shared=shared, store=store, bus=bus, clock=clock,
                                        history=history, rand=rand) if checkpoint
                    else TurnContext.new(record, control, runtime=runtime, shared=shared,
                                         store=store, bus=bus, clock=clock, history=history,
                                         rand=rand))
        self.model = ModelCall(self.ctx)
        self.progress = ProgressRoom(self.ctx)
        self.builtins = Builtins(self.ctx)
        self.tools = ToolStep(self.ctx, self.builtins)
        self._offered: frozenset[str] | None = None  # tool names of the last offer

    def checkpoint_data(self) -> dict[str, Any]:
        """What a resume needs, as saved with each checkpoint."""
        return self.ctx.to_checkpoint()

    async def run(self) -> TurnResult | None:
        """Run to a result; None when suspended (the checkpoint is saved)."""
        ctx = self.ctx
        scope = anyio.CancelScope()
        ctx.control.scope = scope
        result: TurnResult | None = None
        tracer = ctx.shared.tracer
        ctx.begin_span(tracer)
        try:
            with scope:
                result = await self._run()
            if scope.cancelled_caught or result is None:
                if ctx.control.cancel_requested:
                    result = ctx.finish(Stop(StopCode.CANCELLED, "cancelled by request"))
                elif ctx.control.suspend_requested:
                    return None
        except Suspended:
            return None
        except (StoreUnavailable, StaleLease):
            # The store cannot keep what the turn did (unwritable, or another node holds
            # the turn now): no result it does not hold. The turn resumes from its last
            # stored checkpoint, here after a restart or on the node that holds it.
            raise
        except Exception as exc:  # a daemon bug: still a result, with the partial work
            error_id = uuid.uuid4().hex[:12]
            ctx.log.error("turn.internal_error", error_id=error_id,
                          error=f"{type(exc).__name__}: {exc}",
                          traceback=traceback.format_exc())
            ctx.record.last_error = f"{type(exc).__name__}: {exc}"
            result = ctx.finish(Stop(StopCode.INTERNAL,
                                     f"internal error {error_id}; see the daemon log"),
                                error_id=error_id)
        finally:
            ctx.control.scope = None
            ctx.stop_active()
            if result is None:  # suspended here: a later run is a new span of its trace
                tracer.turn_ended(ctx.span, ctx.record, None)
        assert result is not None
        ctx.record.pending_approvals.clear()  # an ended turn waits on nobody
        result = self.progress.finish(result)
        tracer.turn_ended(ctx.span, ctx.record, result)
        return result

    async def _run(self) -> TurnResult:
        ctx = self.ctx
        if ctx.restore_error is not None:
            raise RuntimeError(ctx.restore_error)
        self._begin()
        reenter_step = False
        if ctx.resumed:
            answered = self._resumed_answer()
            if answered is not None:
                return answered
            # Parked in a recovery wait: the same step goes on, in the same cycle, with
            # the same next attempt time; nothing is counted again.
            reenter_step = ctx.chain.phase is Phase.RECOVERING
        outcome = await self._finish_cut_step()
        if outcome is not None:
            return outcome
        tools_ran = False
        passed = -1  # the loop gate's turn when this turn's last step went through
        while True:
            # The loop's share (`policy/loop_share.py`): `loop_gate.through()`, with no
            # coroutine made for a step that goes through at once.
            loop_gate = ctx.shared.loop_gate
            if not loop_gate.passes(passed):
                await loop_gate.held_through()
            passed = loop_gate.turn
            ended = await self._boundary(tools_ran)
            if ended is not None:
                return ended
            tools_ran = False
            if reenter_step:  # resumed in a recovery wait: that step goes on
                reenter_step = False
            else:
                ctx.record.counters.steps += 1
            step = ctx.record.counters.steps
            ctx.bus.publish(ev.StepStarted(step=step, provider=ctx.chain.next_provider),
                            turn=ctx.record.id)  # not through `_publish`: every step
            try:
                reply = await self.model.call()
            except Redirected:
                ctx.record.counters.steps -= 1
                continue
            if isinstance(reply, Stop):
                stop = self._out_of_time(reply)
                if stop is None:  # the step runs again
                    continue
                return ctx.stop(stop)
            if reply is None:  # context overflow rebuilt: run the step again
                ctx.record.counters.steps -= 1
                continue
            judged = self._judged(reply, step)
            if isinstance(judged, TurnResult):
                return judged
            if not judged:  # asked to continue a cut answer, or to read a steer
                continue
            # Checkpoint the model's reply before any tool runs, so a crash here resumes
            # with the same calls and the same idempotency keys.
            await ctx.checkpoint()
            outcome = await self.tools.run(judged, resuming=False)
            if outcome is not None:
                return outcome
            tools_ran = True

    def _begin(self) -> None:
        """`turn.started` (or `turn.resumed`), a removed agent said, the turn running."""
        ctx = self.ctx
        if ctx.control.resume_announced:  # by the reload that let its wait go on
            ctx.control.resume_announced = False
        elif ctx.resumed:
            self._publish(ev.TurnResumed(state=ctx.record.state,
                                         step=ctx.record.counters.steps,
                                         policy_version=ctx.record.policy_version))
            ctx.log.info("turn.resumed", state=ctx.record.state,
                         **ctx.record.counters.to_json())
        else:
            self._publish(ev.TurnStarted(policy_version=ctx.record.policy_version,
                                         provider=ctx.chain.current_provider))
        if ctx.agent_removed is not None:  # it goes on as the default agent, and says so
            ctx.emit(ctx.agent_removed)
        ctx.move(TurnState.RUNNING)
        ctx.start_active()

    async def _finish_cut_step(self) -> TurnResult | None:
        """A step cut short between the model's reply and the next one's: its tools run
        again from the journal first (what they reported is not reported twice), then a
        clarify question it was waiting on. A result: the turn ended there."""
        ctx = self.ctx
        if ctx.conv.pending_tool_calls():
            async with ctx.replaying():
                outcome = await self.tools.run(ctx.conv.pending_tool_calls(),
                                               resuming=True)
            if outcome is not None:
                return outcome
        waited_on = self.builtins.pending_clarify_call()
        if waited_on is not None:
            return await self.builtins.clarify(waited_on)
        return None

    async def _boundary(self, tools_ran: bool) -> TurnResult | None:
        """The step boundary: steers joined, progress recorded, a decided or reached stop
        (or the extension it earns), the pre-flight, the watch, a suspend, the
        checkpoint, the soft note and the offer's note. A result: the turn ends here."""
        ctx = self.ctx
        ctx.absorb_messages()
        self.progress.step_boundary()
        # A decided stop wins over a suspend: a turn that is over stays over. A step or
        # time limit reached while the turn makes progress may be extended. The step
        # boundary's checks read the usage and the time once, here.
        usage, now = ctx.usage(), ctx.clock.time()
        stop = ctx.pending_stop or ctx.guard.check(usage, now=now)
        while stop is not None:  # each grant is counted: this ends
            kept = self.progress.extend(stop)
            if kept is not None:
                return ctx.stop(kept)
            stop = ctx.guard.check(usage, now=now)
        # A budget is a ceiling: a model call that cannot fit in what is left is not
        # made (the call checks again for the provider it is made on).
        fits = self.model.meter.preflight(ctx.chain.current_provider, usage=usage)
        if isinstance(fits, Stop):
            return ctx.stop(fits)
        if ctx.watch is not None:
            for reached in ctx.watch.violations(usage, now=now):
                ctx.gate(reached)
        if ctx.control.suspend_requested:
            await ctx.suspend()
        if not tools_ran:
            # Queued, not awaited: the next durable write (the reply's checkpoint, or
            # the result) is awaited and commits after it; a crash before then runs this
            # step again from the checkpoint before, which nothing acknowledged since
            # depends on. (No checkpoint after a step's tools: each call's outcome is in
            # the journal, and its result goes with the next checkpoint, the reply's.)
            await ctx.checkpoint(TurnState.RUNNING, queued=True)
        self._soft_warning(usage, now, fits)
        toolbox = ctx.runtime.toolbox
        if self._offered is None or not toolbox.offer_fixed:  # else: nothing to tell
            self._offered, note = toolbox.offer_note(self._offered, ctx.agent.tools)
            if note is not None:  # MCP tools left or came back: the agent is told
                ctx.conv.add_note(note)
                ctx.log.info("tool.offer_changed", note=note)
        return None

    def _out_of_time(self, stop: Stop) -> Stop | None:
        """The model call ended the turn with `stop`. Time that ran out inside the call
        may earn an extension, which runs the step again (None); else the stop."""
        ctx = self.ctx
        if (stop.code is not StopCode.BUDGET_SECONDS
                or ctx.chain.phase not in _PHASES_A_STEP_MAY_RERUN
                or ctx.recover_until is not None):
            return stop
        kept = self.progress.extend(stop)  # None: an extension is granted
        if kept is not None:
            return kept
        if ctx.chain.phase in (Phase.ATTEMPTING, Phase.BACKING_OFF):
            ctx.chain.abandon()
        # A recovery decided but not begun: the call starts a new pass, no cycle
        # counted, as after a steer.
        ctx.record.counters.steps -= 1
        return None

    def _judged(self, reply: ModelReply, step: int) -> TurnResult | tuple[ToolCall, ...]:
        """The reply joins the conversation as `policy.replies` judges it: the result of
        a turn it ends (an answer, a refusal, a cut answer past its continuations), the
        tool calls to run (a cut reply's last one marked so it is not run), or () for
        another step (a cut answer to continue, a steer to read first)."""
        ctx = self.ctx
        continued = ctx.conv.continued_parts()
        verdict = judge_reply(
            finish_reason=reply.finish_reason, tool_calls=len(reply.tool_calls),
            text=reply.text, refusal=reply.refusal, provider=self.model.sent_to,
            # A whole number: a reply reaches here only once its usage was checked.
            output_tokens=int(reply.usage.output_tokens),
            output_cap=self.model.sent_output_cap,
            continuations=len(continued), max_continuations=ctx.settings.max_continuations)
        calls, text = reply.tool_calls, reply.text
        if verdict is ANSWERED:  # the usual verdict: the reply joins as it is
            pass
        elif isinstance(verdict, Refused):
            if not ctx.has_unread_steer():  # not kept: a replay asks the step again
                ctx.partial.append(f"step {step}: {verdict.stop.message}")
                ctx.open_issues.append(f"stopped early: {verdict.stop.message}")
                return ctx.finish(verdict.stop, answer=verdict.text)
            calls, text = (), verdict.text  # a declined reply's calls are never run
        elif isinstance(verdict, CutCall):
            cut = calls[verdict.index]
            calls = (*calls[:verdict.index], replace(cut, cut_at=verdict.output_cap))
        ctx.conv.add_assistant(text, calls, reply.opaque)
        if calls:
            return calls
        # Nothing is awaited from here to the result: a steer that arrived during the
        # call is read now, or never slips in (the supervisor refuses messages once the
        # result is set).
        if ctx.has_unread_steer():
            ctx.partial.append(f"step {step}: answered, then read a steer message")
            return ()
        if isinstance(verdict, Continue):
            ctx.conv.add_note(verdict.note)
            ctx.partial.append(f"step {step}: answer cut by the output cap "
                               f"({self.model.sent_output_cap} tokens); asked to continue "
                               f"({verdict.number} of {verdict.of})")
            ctx.log.info("turn.answer_continued", number=verdict.number, of=verdict.of,
                         output_cap=self.model.sent_output_cap, **ctx.counter_values())
            return ()
        answer = "".join(continued) + (reply.text or "")
        if isinstance(verdict, Truncated):
            ctx.partial.append(f"step {step}: answer cut by the output cap "
                               f"({self.model.sent_output_cap} tokens)")
            ctx.open_issues.append(f"stopped early: {verdict.stop.message}")
            return ctx.finish(verdict.stop, answer=answer)
        return self._answered(answer, step, fenced=self._sent_mode() == "prompt")

    def _sent_mode(self) -> str:
        """The structured-output mode of the provider that gave the last reply."""
        sent = self.ctx.settings.providers.get(self.model.sent_to)
        return sent.structured_output if sent is not None else ""

    def _answered(self, answer: str, step: int, *, fenced: bool
                  ) -> TurnResult | tuple[ToolCall, ...]:
        """The turn's end with its final answer, or () for another step: an answer that
        does not match the turn's output schema goes back to the agent with what failed
        (`policy.output`), until `max_output_attempts` answers have failed."""
        ctx = self.ctx
        extra: dict[str, Any] = {}
        if ctx.output_schema is not None:
            checked = check_output(answer, ctx.output_schema,
                                   attempts=ctx.record.counters.output_attempts,
                                   max_attempts=ctx.settings.max_output_attempts,
                                   fenced=fenced)
            ctx.record.counters.output_attempts = checked.attempts
            if isinstance(checked, Retry):
                ctx.partial.append(f"step {step}: answer did not match the output schema "
                                   f"({checked.errors[0]}); asked again "
                                   f"({checked.attempts} of "
                                   f"{ctx.settings.max_output_attempts})")
                ctx.conv.add_user(checked.message)
                ctx.log.info("turn.output_invalid", errors=list(checked.errors),
                             **ctx.counter_values())
                return ()
            if isinstance(checked, Invalid):
                ctx.partial.append(f"step {step}: answer did not match the output schema "
                                   f"({checked.errors[0]})")
                ctx.open_issues.append(f"stopped early: {checked.stop.message}")
                ctx.open_issues.extend(f"output: {e}" for e in checked.errors)
                return ctx.finish(checked.stop, answer=answer)
            extra["output"] = checked.value
        ctx.partial.append(f"step {step}: answered")
        # The answer's checkpoint is written with the result, in one transaction.
        ctx.checkpoint_with_result()
        return ctx.finish(Stop(StopCode.COMPLETED, "the agent answered"), answer=answer,
                          extra=extra)

    def _publish(self, body: ev.EventBody) -> None:
        self.ctx.bus.publish(body, turn=self.ctx.record.id)

    def _soft_warning(self, usage: BudgetUsage, now: float, fits: Preflight) -> None:
        """The soft-limit note, at `soft_limit` or as soon as the next call would not fit
        whole (`fits.short`), whichever is first. With a watched budget (warn/observe)
        the note comes from the real limits: in warn mode the agent reads it, in observe
        mode only the event is emitted, unless the step backstop (which always enforces)
        is among them."""
        ctx = self.ctx
        guard = ctx.watch or ctx.guard
        short = fits.short
        if ctx.watch is not None:
            watched = self.model.meter.preflight(ctx.chain.current_provider, ctx.watch)
            short = watched.short if isinstance(watched, Preflight) else (
                (COUNTER_OF[watched.code] or ""),)
        warning = guard.soft_warning(usage, now=now, short=short)
        if warning is None:
            return
        mode = ctx.modes["budget"]
        if mode != "observe" or "steps" in warning.dimensions:
            ctx.conv.add_note(warning.message)
        self._publish(ev.BudgetWarning(dimensions=list(warning.dimensions),
                                       message=warning.message, mode=mode,
                                       **ctx.counter_values()))
        ctx.log.info("guard.budget_warning", dimensions=list(warning.dimensions),
                     mode=mode, **ctx.counter_values())

    def _resumed_answer(self) -> TurnResult | None:
        """A turn checkpointed with its final answer and stopped before its result was
        saved ends with that answer: the step is not asked again. (This version writes an
        answer's checkpoint with the result; an earlier one queued it just before.)"""
        ctx = self.ctx
        msgs = ctx.conv.messages
        if (len(msgs) > ctx.conv.turn_start + 1 and msgs[-1].role == "assistant"
                and not msgs[-1].tool_calls and not ctx.has_unread_steer()):
            answer = "".join(ctx.conv.continued_parts(end=len(msgs) - 1)) + (
                msgs[-1].content or "")
            if ctx.output_schema is None:
                return ctx.finish(Stop(StopCode.COMPLETED, "the agent answered"),
                                  answer=answer)
            # Checked as when it came (a fence is let through: which provider gave it is
            # not kept); one that fails goes back to the agent, and the turn goes on.
            ended = self._answered(answer, ctx.record.counters.steps, fenced=True)
            return ended if isinstance(ended, TurnResult) else None
        return None
