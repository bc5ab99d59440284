"""One turn, step by step. The runner only moves data between the pure decisions of
`turnkeeper.policy` and the world (providers, tools, store, events); every rule it
applies lives there.

Each step: absorb user messages, checkpoint, run the guards (before anything is spent),
call the model through the provider chain, run the tools it asked for. Every way out,
including a bug, becomes one `TurnResult`; a turn asked to suspend returns None after
its checkpoint.
"""

from __future__ import annotations

import json
import random
import traceback
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import structlog

from turnkeeper.clock import Clock
from turnkeeper.events import EventBus
from turnkeeper.policy.budget import BudgetGuard, BudgetLimits, BudgetUsage, cost_usd
from turnkeeper.policy.chain import Attempt, FailOver, Phase, Recover, RetryIn
from turnkeeper.policy.classify import CallFailure, classify
from turnkeeper.policy.gate import ModeGate, WouldStop
from turnkeeper.policy.loops import Action, LoopWarning, action_key
from turnkeeper.policy.outcome import Stop, StopCode, TurnResult
from turnkeeper.policy.restarts import RestartCounter
from turnkeeper.policy.tool_retry import attempts_for
from turnkeeper.policy.turn_state import TurnState
from turnkeeper.providers.base import ModelReply, ModelRequest, ProviderError, ToolCall
from turnkeeper.runtime import Runtime, Shared
from turnkeeper.store.base import Store
from turnkeeper.tools.registry import ToolOutcome
from turnkeeper.turn.conversation import Conversation
from turnkeeper.turn.record import TurnRecord
from turnkeeper.turn.settings import failure_loop, loop_detector

log = structlog.get_logger("turnkeeper.turn")


class _Suspend(Exception):
    """Internal: the turn is to stop here and resume later from its checkpoint."""


class _Redirect(Exception):
    """Internal: a steer with redirect cut the model call; the step starts over."""


@dataclass(slots=True)
class TurnControl:
    """What the outside world can do to a running turn. The supervisor holds it; the
    runner reads it at step boundaries and while parked."""

    wake: anyio.Event = field(default_factory=anyio.Event)
    cancel_requested: bool = False
    suspend_requested: bool = False
    redirect_requested: bool = False
    parked: bool = False
    scope: anyio.CancelScope | None = None
    call_scope: anyio.CancelScope | None = None
    # A non-idempotent tool call is on the wire: a suspend that would cut the step short
    # waits for it instead, so its outcome is journalled and never "unknown" after a
    # plain stop. The runner suspends right after it (`suspend_now`).
    effect_in_flight: bool = False
    suspend_now: bool = False
    # A parked turn (recovering, waiting) gives its slot of max_concurrent_turns back and
    # takes one again when it wakes: a thousand turns waiting for answers must not block new
    # work. Set by the supervisor; None: no slot accounting.
    release_slot: Callable[[], None] | None = None
    acquire_slot: Callable[[], Awaitable[None]] | None = None

    def _wake(self) -> None:
        self.wake.set()
        self.wake = anyio.Event()

    def wake_up(self) -> None:
        """Wake whatever the turn waits on, to look at this control again."""
        self._wake()

    def park(self) -> None:
        self.parked = True
        if self.release_slot is not None:
            self.release_slot()

    async def unpark(self) -> bool:
        """Take a slot again (waiting for one if need be). False when the turn is to suspend
        instead: a reload or a stop came while it was parked."""
        try:
            if self.acquire_slot is not None and not self.suspend_requested:
                await self.acquire_slot()
        finally:
            self.parked = False
        return not self.suspend_requested

    def message_arrived(self, *, redirect: bool) -> None:
        if redirect:
            self.redirect_requested = True
            if self.call_scope is not None:
                self.call_scope.cancel()
        self._wake()

    def cancel(self) -> None:
        self.cancel_requested = True
        if self.scope is not None:
            self.scope.cancel()

    def suspend(self, *, now: bool = False) -> None:
        """At the next step boundary; a parked turn at once (it wakes and checkpoints as
        `suspended`, its question or recovery wait kept); with `now`, cut the step short."""
        self.suspend_requested = True
        if now:
            self.suspend_now = True
        if now and not self.parked and not self.effect_in_flight and self.scope is not None:
            self.scope.cancel()
        self._wake()


class TurnRunner:
    def __init__(self, record: TurnRecord, control: TurnControl, *, runtime: Runtime,
                 shared: Shared, store: Store, bus: EventBus, clock: Clock,
                 checkpoint: dict[str, Any], history: list[dict[str, Any]],
                 rand: Callable[[float, float], float] = random.uniform) -> None:
        self.record = record
        self.control = control
        self.runtime = runtime
        self.shared = shared
        self.store = store
        self.bus = bus
        self.clock = clock
        self.rand = rand
        cfg = runtime.config
        self.log = log.bind(turn=record.id, session=record.session,
                            policy_version=record.policy_version)
        if record.profile is not None and record.profile not in cfg.budget.profiles:
            # A reload removed the profile this turn was submitted with: it goes on under
            # the plain sections, and says so.
            self.log.warning("turn.profile_gone", profile=record.profile)
            record.profile = None
        guards = cfg.guards(record.profile)
        self.modes = guards.modes
        self.gate = ModeGate(guards.modes)
        self.settings = runtime.settings
        self.restarts = RestartCounter(self.settings.max_restarts,
                                       count=record.counters["restarts"])
        limits = BudgetLimits.from_config(guards.budget, overrides=record.budget,
                                          deadline=record.deadline)
        self.limits = limits
        record.limits = limits.snapshot()
        # A budget in warn/observe mode only enforces the backstop and the deadline; its
        # real limits are watched by a second guard that records what would have stopped.
        enforced = limits if self.modes["budget"] == "enforce" else limits.backstop_only()
        self.watch: BudgetGuard | None = None
        chain_settings = self.settings.chain
        self._pending_stop: Stop | None = None
        # A checkpoint this code cannot read (damaged, or written by an incompatible
        # version) ends the turn `internal` with what is known, never leaves it hanging.
        self._restore_error: str | None = None
        if checkpoint.get("conversation"):
            try:
                self.conv = Conversation.from_json(checkpoint["conversation"])
                self.guard = BudgetGuard.restore(checkpoint["budget"], limits=enforced)
                if enforced is not limits:
                    self.watch = BudgetGuard.restore(
                        checkpoint.get("budget_watch") or {"warned": []}, limits=limits)
                self.loops = loop_detector(guards.loop_detection, checkpoint["loops"])
                self.failures = failure_loop(guards.failure_loop, checkpoint["failures"])
                self.chain = chain_settings.restore_chain(checkpoint.get("chain"), rand)
                self.partial: list[str] = list(checkpoint.get("partial", ()))
                self.open_issues: list[str] = list(checkpoint.get("open_issues", ()))
                self.waiting_since: float | None = checkpoint.get("waiting_since")
                self.recover_until: float | None = checkpoint.get("recover_until")
                pending = checkpoint.get("pending_stop")
                self._pending_stop = Stop.from_json(pending) if pending else None
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                self._restore_error = f"checkpoint unreadable: {type(exc).__name__}: {exc}"
                checkpoint = {"partial": checkpoint.get("partial")}
        if self._restore_error is None and checkpoint.get("conversation"):
            self.resumed = True
        else:
            self.conv = Conversation.start(history, record.message)
            self.guard = BudgetGuard(enforced)
            self.watch = None if enforced is limits else BudgetGuard(limits)
            self.loops = loop_detector(guards.loop_detection)
            self.failures = failure_loop(guards.failure_loop)
            self.chain = chain_settings.new_chain(rand)
            self.partial = []
            self.open_issues = []
            self.waiting_since = None
            self.recover_until = None
            self.resumed = False
            if self._restore_error is not None:
                self.partial = [str(x) for x in checkpoint.get("partial") or ()]
        self._active_since: float | None = None
        self._offered: frozenset[str] | None = None  # tool names of the last offer

    # -- time -----------------------------------------------------------------------

    def _start_active(self) -> None:
        if self._active_since is None:
            self._active_since = self.clock.monotonic()
            self.record.active_since = self.clock.time()

    def _stop_active(self) -> None:
        if self._active_since is not None:
            self.record.usage["seconds"] = round(
                self.record.usage["seconds"] + self.clock.monotonic() - self._active_since, 6)
            self._active_since = None
            self.record.active_since = None

    def _usage(self) -> BudgetUsage:
        seconds = self.record.usage["seconds"]
        if self._active_since is not None:
            seconds += self.clock.monotonic() - self._active_since
        return BudgetUsage(tokens=self.record.usage["total_tokens"], seconds=seconds,
                           steps=self.record.counters["steps"],
                           cost_usd=self.record.usage["cost_usd"])

    def remaining_s(self) -> float:
        return self.guard.remaining_seconds(self._usage(), now=self.clock.time())

    # -- events and checkpoints -----------------------------------------------------

    def emit(self, type: str, **data: Any) -> None:
        self.bus.publish(type, turn=self.record.id, **data)

    def _sync_counters(self) -> None:
        c = self.record.counters
        c["provider_attempts"] = self.chain.provider_attempts
        c["fallback_hops"] = self.chain.fallback_hops
        c["recovery_cycles"] = self.chain.recovery_cycles
        c["restarts"] = self.restarts.count
        self.record.provider = self.chain.current_provider

    def checkpoint_data(self) -> dict[str, Any]:
        return {
            "conversation": self.conv.to_json(),
            "budget": self.guard.snapshot(),
            "budget_watch": self.watch.snapshot() if self.watch is not None else None,
            "loops": self.loops.snapshot(),
            "failures": self.failures.snapshot(),
            "chain": {**self.chain.snapshot(),
                      "providers": list(self.settings.chain.providers)},
            "partial": list(self.partial),
            "open_issues": list(self.open_issues),
            "waiting_since": self.waiting_since,
            "recover_until": self.recover_until,
            # A guard's stop decided after a step's tools (loop detection) and not yet
            # applied: without it a crash would let the turn run one step too many.
            "pending_stop": self._pending_stop.to_json() if self._pending_stop else None,
        }

    def _move(self, new: TurnState) -> None:
        """Change the turn's state through the transition table: an illegal move raises
        instead of leaving the turn in two places at once."""
        self.record.state = TurnState(self.record.state).to(new).value

    async def checkpoint(self, state: TurnState | None = None) -> None:
        if state is not None:
            self._move(state)
        self._sync_counters()
        if self._active_since is not None:  # fold the running active time into the record
            self._stop_active()
            self._start_active()
        self.record.updated_at = self.clock.time()
        await self.store.save_turn(self.record.to_json(), self.checkpoint_data())

    # -- the turn -------------------------------------------------------------------

    async def run(self) -> TurnResult | None:
        """Run to a result; None when suspended (the checkpoint is saved)."""
        scope = anyio.CancelScope()
        self.control.scope = scope
        result: TurnResult | None = None
        try:
            with scope:
                result = await self._run()
            if scope.cancelled_caught or result is None:
                if self.control.cancel_requested:
                    result = self._finish(Stop(StopCode.CANCELLED, "cancelled by request"))
                elif self.control.suspend_requested:
                    return None
        except _Suspend:
            return None
        except Exception as exc:  # a daemon bug: still a result, with the partial work
            error_id = uuid.uuid4().hex[:12]
            self.log.error("turn.internal_error", error_id=error_id,
                           error=f"{type(exc).__name__}: {exc}",
                           traceback=traceback.format_exc())
            self.record.last_error = f"{type(exc).__name__}: {exc}"
            result = self._finish(Stop(StopCode.INTERNAL,
                                       f"internal error {error_id}; see the daemon log"),
                                  error_id=error_id)
        finally:
            self.control.scope = None
            self._stop_active()
        assert result is not None
        return result

    def _finish(self, stop: Stop, *, answer: str | None = None,
                error_id: str | None = None, extra: dict[str, Any] | None = None
                ) -> TurnResult:
        return TurnResult(stopped_because=stop, answer=answer, partial=tuple(self.partial),
                          open_issues=tuple(self.open_issues), error_id=error_id,
                          extra=extra or {})

    async def _run(self) -> TurnResult:
        if self._restore_error is not None:
            raise RuntimeError(self._restore_error)
        if self.resumed:
            self.emit("turn.resumed", state=self.record.state,
                      step=self.record.counters["steps"],
                      policy_version=self.record.policy_version)
            self.log.info("turn.resumed", state=self.record.state,
                          **self.record.counters)
        else:
            self.emit("turn.started", policy_version=self.record.policy_version,
                      provider=self.chain.current_provider)
        self._move(TurnState.RUNNING)
        self._start_active()
        reenter_step = False
        if self.resumed:
            answered = self._resumed_answer()
            if answered is not None:
                return answered
            # Parked in a recovery wait: the same step goes on, in the same cycle, with
            # the same next attempt time; nothing is counted again.
            reenter_step = self.chain.phase is Phase.RECOVERING
        # A step cut short between the model's reply and its tools finishes first.
        if self.conv.pending_tool_calls():
            outcome = await self._run_tools(self.conv.pending_tool_calls(), resuming=True)
            if outcome is not None:
                return outcome
        if self.waiting_since is not None and self._pending_clarify() is not None:
            outcome = await self._clarify(self._pending_clarify_call())
            if outcome is not None:
                return outcome
        while True:
            self._absorb_messages()
            # A decided stop wins over a suspend: a turn that is over stays over.
            stop = self._pending_stop or self.guard.check(self._usage(), now=self.clock.time())
            if stop is not None:
                return self._stop(stop)
            if self.watch is not None:
                for reached in self.watch.violations(self._usage(), now=self.clock.time()):
                    self._gate(reached)
            if self.control.suspend_requested:
                await self._suspend()
            await self.checkpoint(TurnState.RUNNING)
            self._soft_warning()
            self._offered, note = self.runtime.toolbox.offer_note(self._offered)
            if note is not None:  # MCP tools left or came back: the agent is told
                self.conv.add_note(note)
                self.log.info("tool.offer_changed", note=note)
            if reenter_step:  # resumed in a recovery wait: that step goes on
                reenter_step = False
            else:
                self.record.counters["steps"] += 1
            step = self.record.counters["steps"]
            self.emit("step.started", step=step, provider=self.chain.current_provider)
            try:
                reply = await self._call_model()
            except _Redirect:
                self.record.counters["steps"] -= 1
                continue
            if isinstance(reply, Stop):
                return self._stop(reply)
            if reply is None:  # context overflow rebuilt: run the step again
                self.record.counters["steps"] -= 1
                continue
            self.conv.add_assistant(reply.text, reply.tool_calls)
            if not reply.tool_calls:
                await self.checkpoint()
                # Checked after the last await: nothing can slip in between this and the
                # result (the supervisor refuses messages once the result is set).
                if self._has_unread_steer():
                    self.partial.append(f"step {step}: answered, then read a steer message")
                    continue
                self.partial.append(f"step {step}: answered")
                return self._finish(Stop(StopCode.COMPLETED, "the agent answered"),
                                    answer=reply.text or "")
            # Checkpoint the model's reply before any tool runs, so a crash here resumes
            # with the same calls and the same idempotency keys.
            await self.checkpoint()
            outcome = await self._run_tools(reply.tool_calls, resuming=False)
            if outcome is not None:
                return outcome

    def _soft_warning(self) -> None:
        """The soft-limit note. With a watched budget (warn/observe) the note comes from
        the real limits: in warn mode the agent reads it, in observe mode only the event
        is emitted, unless the step backstop (which always enforces) is among them."""
        guard = self.watch or self.guard
        warning = guard.soft_warning(self._usage(), now=self.clock.time())
        if warning is None:
            return
        mode = self.modes["budget"]
        if mode != "observe" or "steps" in warning.dimensions:
            self.conv.add_note(warning.message)
        self.emit("budget.warning", dimensions=list(warning.dimensions),
                  message=warning.message, mode=mode, **self._counter_values())
        self.log.info("guard.budget_warning", dimensions=list(warning.dimensions),
                      mode=mode, **self._counter_values())

    def _gate(self, stop: Stop) -> Stop | None:
        """Apply the mode of the stop's guard family: `enforce` returns the stop; `warn`
        and `observe` record it once per code in `would_have_stopped` (warn also tells
        the agent) and return None. Stops outside the families (the step backstop, the
        deadline, every non-guard code) always come back."""
        decision = self.gate.decide(
            stop, recorded={w["code"] for w in self.record.would_have_stopped})
        if not isinstance(decision, WouldStop):
            return decision
        entry = {"code": stop.code.value, "counter": stop.counter, "value": stop.value,
                 "limit": stop.limit, "step": self.record.counters["steps"],
                 "mode": decision.mode, "message": stop.message}
        self.record.would_have_stopped.append(entry)
        self.emit("guard.would_stop", **entry)
        self.log.info("guard.would_stop", **entry, **self._counter_values())
        if decision.note is not None:
            self.conv.add_note(decision.note)
        return None

    def _resumed_answer(self) -> TurnResult | None:
        """A turn checkpointed with its final answer and stopped before its result was
        saved ends with that answer: the step is not asked again."""
        msgs = self.conv.messages
        if (len(msgs) > self.conv.turn_start + 1 and msgs[-1].role == "assistant"
                and not msgs[-1].tool_calls and not self._has_unread_steer()):
            return self._finish(Stop(StopCode.COMPLETED, "the agent answered"),
                                answer=msgs[-1].content or "")
        return None

    def _counter_values(self) -> dict[str, Any]:
        self._sync_counters()
        u = self._usage()
        return {**self.record.counters, "tokens": u.tokens, "seconds": round(u.seconds, 3),
                "cost_usd": round(u.cost_usd, 6)}

    def _stop(self, stop: Stop) -> TurnResult:
        if stop.code not in (StopCode.COMPLETED, StopCode.BLOCKED):
            self.open_issues.append(f"stopped early: {stop.message}")
        return self._finish(stop, answer=self.conv.last_assistant_text()
                            if stop.code is not StopCode.INTERNAL else None)

    async def _suspend(self, *, parked: bool = False) -> None:
        """Stop here; the supervisor requeues the turn. A parked turn (waiting, recovering)
        was checkpointed when it parked and has not moved since: that checkpoint is what a
        resume needs, so only its state changes, in memory (after a crash the stored row
        resumes it the same way). A thousand parked turns then cost a reload no writes."""
        self._stop_active()
        if parked:
            self._move(TurnState.SUSPENDED)
        else:
            await self.checkpoint(TurnState.SUSPENDED)
        self.emit("turn.suspended", step=self.record.counters["steps"])
        raise _Suspend

    # -- user messages ----------------------------------------------------------------

    def _has_unread_steer(self) -> bool:
        return any(m["kind"] == "steer" for m in self.record.inbox)

    def _absorb_messages(self) -> None:
        """Steers join the conversation at the step boundary. A user message is never
        charged to any counter; it resets `restarts`."""
        steers = [m for m in self.record.inbox if m["kind"] == "steer"]
        if not steers:
            return
        self.record.inbox = [m for m in self.record.inbox if m["kind"] != "steer"]
        for m in steers:
            self.conv.add_user(m["text"])
        self.restarts.reset()
        self.record.counters["restarts"] = 0
        self.control.redirect_requested = False
        self._pending_stop = None

    # -- the model call ---------------------------------------------------------------

    def _request(self) -> ModelRequest:
        provider_cfg = self.settings.providers[self.chain.current_provider]
        usage = self._usage()
        return ModelRequest(
            system=self.settings.system_prompt, messages=tuple(self.conv.messages),
            tools=self.runtime.toolbox.specs,
            max_output_tokens=self.guard.max_output_tokens(usage,
                                                           provider_cfg.max_output_tokens),
            timeout_s=max(0.001, min(provider_cfg.timeout_s, self.remaining_s())),
            turn_id=self.record.id, step=self.record.counters["steps"],
            metadata={"turn_message": self.record.message})

    async def _call_model(self) -> ModelReply | Stop | None:
        """Through the chain: retries, failovers and recovery cycles. Returns the reply,
        a Stop, or None after a context-overflow rebuild."""
        decision: Any
        self._streamed_from = None
        # A chain restored parked in recovery goes on with its wait; any other starts.
        decision = self.chain.resume(now=self.clock.time(), recover_until=self.recover_until)
        retry_held: str | None = None
        first = True  # the step's guards have just checked the time
        try:
            while True:
                # The active time or the deadline ran out during this call: that is the
                # budget's stop, not a reason to fail over, park in recovery or give up on
                # the providers.
                if not first:
                    spent = self.guard.check_time(self._usage(), now=self.clock.time())
                    if spent is not None:
                        return spent
                first = False
                if isinstance(decision, Attempt):
                    held, retry_held = retry_held, None
                    result = await self._attempt(decision, held)
                    if isinstance(result, ModelReply):
                        return result
                    if result is None:
                        return await self._rebuild()
                    decision = result
                elif isinstance(decision, RetryIn):
                    breaker = self.shared.breakers[f"provider:{decision.provider}"]
                    reopens_in = breaker.open_for(self.clock.monotonic())
                    if reopens_in is not None:  # opened meanwhile: hop now, do not sleep
                        self.log.info("model.breaker_open", provider=decision.provider)
                        decision = self.chain.on_breaker_open(reopens_in_s=reopens_in)
                        continue
                    budget = self.shared.retry_budgets[decision.provider]
                    if not budget.try_begin_retry():
                        self.log.info("model.retry_refused", provider=decision.provider,
                                      **self._counter_values())
                        decision = self.chain.on_retry_refused()
                        continue
                    retry_held = decision.provider
                    self.emit("model.retry_scheduled", provider=decision.provider,
                              attempt=decision.attempt_next, delay=round(decision.seconds, 3),
                              **{"class": decision.failure_class.value},
                              status=self._last_failure.status,
                              retry_after=decision.retry_after_s)
                    self.log.info("model.retry_scheduled", provider=decision.provider,
                                  delay=round(decision.seconds, 3),
                                  failure_class=decision.failure_class.value,
                                  **self._counter_values())
                    self.record.next_attempt_at = self.clock.time() + decision.seconds
                    await self._sleep_active(decision.seconds)
                    self.record.next_attempt_at = None
                    decision = self.chain.retry_ready()
                elif isinstance(decision, FailOver):
                    self.emit("model.failover", **{"from": decision.from_provider},
                              to=decision.to_provider, reason=decision.reason)
                    self.log.info("model.failover", from_provider=decision.from_provider,
                                  to=decision.to_provider, reason=decision.reason,
                                  **self._counter_values())
                    decision = self.chain.begin_call()
                elif isinstance(decision, Recover):
                    outcome = await self._recover(decision)
                    if isinstance(outcome, Stop):
                        return outcome
                    if outcome:  # a steer cut the wait short: a new pass, no cycle charged
                        self.chain.user_message()
                        decision = self.chain.begin_call()
                    else:
                        decision = self.chain.recovery_done()
                elif isinstance(decision, Stop):
                    return decision
                else:  # pragma: no cover - the chain's decisions are a closed set
                    raise AssertionError(f"unexpected chain decision {decision!r}")
        finally:
            if retry_held is not None:
                self.shared.retry_budgets[retry_held].end_retry()
            self._sync_counters()

    _last_failure: CallFailure = CallFailure()
    # The provider whose stream broke after sending text in this model call, if any.
    _streamed_from: str | None = None

    async def _attempt(self, attempt: Attempt, retry_held: str | None
                       ) -> ModelReply | Any | None:
        name = attempt.provider
        breaker = self.shared.breakers[f"provider:{name}"]
        now = self.clock.monotonic()
        if not breaker.try_acquire(now):
            if retry_held is not None:
                self.shared.retry_budgets[retry_held].end_retry()
            self.log.info("model.breaker_open", provider=name)
            return self.chain.on_breaker_open(reopens_in_s=breaker.open_for(now))
        if self._streamed_from not in (None, name):
            # The step's partial output came from another provider: it is rebuilt for
            # this one, which counts as a restart. A retry on the same provider is not a rebuild.
            self._streamed_from = None
            stop = self._count_restart("a partially streamed step was rebuilt for "
                                       f"provider {name}")
            if stop is not None:
                breaker.release(self.clock.monotonic())
                if retry_held is not None:
                    self.shared.retry_budgets[retry_held].end_retry()
                self.chain.abandon()
                return stop
        self._sync_counters()
        provider = self.runtime.providers[name]
        request = self._request()
        budget = self.shared.retry_budgets[name]
        self.emit("model.request", provider=name, attempt=attempt.attempt,
                  step=request.step, messages=len(request.messages))
        budget.begin_request()
        streamed = False
        call_scope = anyio.CancelScope()
        self.control.call_scope = call_scope
        failure: CallFailure | None = None
        reply: ModelReply | None = None

        async def on_delta(text: str) -> None:
            nonlocal streamed
            streamed = True
            self.emit("model.delta", text=text)

        try:
            with call_scope:
                try:
                    reply = await provider.complete(request, on_delta)
                except ProviderError as exc:
                    failure = exc.failure
        except BaseException:
            breaker.release(self.clock.monotonic())
            raise
        finally:
            self.control.call_scope = None
            budget.end_request()
            if retry_held is not None:
                self.shared.retry_budgets[retry_held].end_retry()
        if call_scope.cancelled_caught:
            breaker.release(self.clock.monotonic())
            self.chain.abandon()
            self.emit("model.redirected", provider=name)
            raise _Redirect
        if reply is not None:
            self._streamed_from = None
            breaker.record_success(self.clock.monotonic())
            self.chain.on_success()
            self._charge(name, reply)
            return reply
        assert failure is not None
        self._last_failure = failure
        self.record.last_error = f"{name}: {failure.describe()}"
        if failure.context_overflow:
            breaker.record_success(self.clock.monotonic())
            self.chain.abandon()  # not a failure: the step is rebuilt and called afresh
            self.emit("model.attempt_failed", provider=name, attempt=attempt.attempt,
                      **{"class": "context_overflow"}, status=failure.status)
            return None
        cls = classify(failure)
        breaker.record_failure(self.clock.monotonic(), cls, retry_after_s=failure.retry_after_s)
        self.emit("model.attempt_failed", provider=name, attempt=attempt.attempt,
                  **{"class": cls.value}, status=failure.status)
        self.log.info("model.attempt_failed", provider=name, failure_class=cls.value,
                      status=failure.status, error=failure.describe(),
                      **self._counter_values())
        if streamed:
            self._streamed_from = name  # counted if the step moves to another provider
        return self.chain.on_failure(cls, retry_after_s=failure.retry_after_s,
                                     remaining_s=self.remaining_s(), rand=self.rand)

    def _charge(self, provider: str, reply: ModelReply) -> None:
        u = self.record.usage
        u["input_tokens"] += reply.usage.input_tokens
        u["output_tokens"] += reply.usage.output_tokens
        u["total_tokens"] = u["input_tokens"] + u["output_tokens"]
        pcfg = self.settings.providers[provider]
        cost = cost_usd(reply.usage.input_tokens, reply.usage.output_tokens,
                        price_input_per_mtok=pcfg.price_input_per_mtok,
                        price_output_per_mtok=pcfg.price_output_per_mtok)
        u["cost_usd"] = round(u["cost_usd"] + cost, 9)
        self.emit("model.response", provider=provider,
                  usage={"input_tokens": reply.usage.input_tokens,
                         "output_tokens": reply.usage.output_tokens},
                  cost_usd=round(cost, 9),
                  finish_reason=reply.finish_reason, tool_calls=len(reply.tool_calls))

    def _count_restart(self, why: str) -> Stop | None:
        stop = self.restarts.restart(why)
        self.log.info("turn.restart", why=why, **self._counter_values())
        return stop

    async def _rebuild(self) -> Stop | None:
        stop = self._count_restart("context overflow: older history compacted")
        if stop is not None:
            return stop
        if not self.conv.compact():
            return self.restarts.nothing_to_compact()
        return None

    async def _sleep_active(self, seconds: float) -> None:
        """A backoff wait: active time (it counts toward max_seconds), cut short by a
        redirect steer."""
        with self.clock.move_on_after(seconds):
            while not self.control.redirect_requested:
                await self.control.wake.wait()
        if self.control.redirect_requested:
            self.chain.abandon()
            raise _Redirect

    async def _recover(self, decision: Recover) -> Stop | bool:
        """Park for a recovery cycle: not active time; cancel, steer and suspend work.
        True when a steer cut the wait short (it has joined the conversation)."""
        now = self.clock.time()
        if self.recover_until is None:
            self.recover_until = now + decision.wait_s
        wait = max(0.0, self.recover_until - now)
        if self.limits.deadline is not None:
            wait = min(wait, max(0.0, self.limits.deadline - now))
        self.record.next_attempt_at = self.recover_until
        self.emit("turn.recovering", cycle=decision.cycle, of=decision.of_cycles,
                  wait=round(decision.wait_s, 3), next_attempt_at=self.recover_until)
        self.log.warning("turn.recovering", cycle=decision.cycle, of=decision.of_cycles,
                         wait=round(decision.wait_s, 3), **self._counter_values())
        self._stop_active()
        await self.checkpoint(TurnState.RECOVERING)
        self.control.park()
        try:
            with self.clock.move_on_after(wait):
                while not (self.control.redirect_requested or self.control.suspend_requested
                           or self._has_unread_steer()):
                    await self.control.wake.wait()
        except BaseException:  # cancelled: no slot to take back
            self.control.parked = False
            raise
        if not await self.control.unpark():
            await self._suspend(parked=True)
        self.recover_until = None
        self.record.next_attempt_at = None
        self._move(TurnState.RUNNING)
        self._start_active()
        stop = self.guard.check(self._usage(), now=self.clock.time())
        if stop is not None and stop.code is StopCode.DEADLINE:
            return stop
        # A steer that cut the wait short joins the conversation before the next pass,
        # checkpointed at once: its inbox entry is gone from the record from now on.
        if self._has_unread_steer():
            self._absorb_messages()
            await self.checkpoint()
            return True
        return False

    # -- tools ------------------------------------------------------------------------

    def _pending_clarify(self) -> str | None:
        return self.record.question

    def _pending_clarify_call(self) -> ToolCall:
        return ToolCall(id="clarify", name="clarify",
                        arguments=json.dumps({"question": self.record.question}))

    def _call_positions(self) -> dict[str, int]:
        last = next((m for m in reversed(self.conv.messages) if m.role == "assistant"), None)
        calls = last.tool_calls if last is not None else ()
        position = {c.id: i for i, c in enumerate(calls)}
        return position if len(position) == len(calls) else {}

    async def _run_tools(self, calls: tuple[ToolCall, ...], *, resuming: bool
                         ) -> TurnResult | None:
        step = self.record.counters["steps"]
        observations: list[str] = []
        states: list[str] = []
        all_polling = True
        # A call's Idempotency-Key names its place in the model's reply, not in `calls`,
        # which on resume holds only the calls still without a result.
        position = self._call_positions()
        for n, call in enumerate(calls):
            index = position.get(call.id, n)
            if call.name == "report_blocked":
                if not self._has_unread_steer():
                    return self._blocked(call)
                # The agent gave up without reading what the user just sent: it reads it
                # first (a turn never ends with an unread steer).
                self.conv.add_tool_result(call, "not ended: the user sent a message; read "
                                                "it, then answer or call report_blocked")
                all_polling = False
                continue
            if call.name == "clarify":
                outcome = await self._clarify(call)
                if outcome is not None:
                    return outcome
                all_polling = False
                continue
            key = f"{self.record.id}.{step}.{index}"
            tool = self.runtime.toolbox.get(call.name)
            polling = bool(tool and tool.polling)
            all_polling = all_polling and polling
            result = await self._tool_call(call, key, resuming=resuming)
            if self.control.suspend_now and not isinstance(result, Stop):
                # A stop waited for this call's effect: its outcome is in the journal and
                # the conversation; the calls after it run on resume.
                await self._suspend()
            if isinstance(result, Stop):
                if any(c.id == call.id for c in self.conv.pending_tool_calls()):
                    self.conv.add_tool_result(call, "not run: the turn stops here")
                await self.checkpoint()
                return self._stop(result)
            content, state = result
            if content is not None:
                observations.append(content)
            if state is not None:
                states.append(state)
        if observations:
            stop = self.loops.after_step(observations,
                                         state="|".join(states) if states else None,
                                         polling_only=all_polling)
            stop = self._gate(stop) if stop is not None else None
            if stop is not None:
                self._pending_stop = stop
                self.log.info("guard.loop_stop", code=stop.code.value, value=stop.value,
                              limit=stop.limit, no_progress=self.loops.no_progress,
                              **self._counter_values())
        # No checkpoint here: the caller's next step boundary takes one before anything
        # else is awaited (or the turn ends and its result is saved). A second one here
        # cost ~15% of a step's CPU and a commit round trip.
        self._sync_counters()
        return None

    def _blocked(self, call: ToolCall) -> TurnResult:
        try:
            args = json.loads(call.arguments or "{}")
        except json.JSONDecodeError:
            args = {"reason": call.arguments}
        if not isinstance(args, dict):
            args = {"reason": str(args)}
        reason = str(args.get("reason") or "blocked")
        tried = [str(x) for x in args.get("tried") or []]
        found = [str(x) for x in args.get("found") or []]
        self.partial.extend(f"tried: {t}" for t in tried)
        self.partial.extend(f"found: {f}" for f in found)
        self.open_issues.append(reason)
        return self._finish(Stop(StopCode.BLOCKED, reason), answer=None,
                            extra={"blocked": {"reason": reason, "tried": tried,
                                               "found": found}})

    async def _clarify(self, call: ToolCall) -> TurnResult | None:
        try:
            question = str(json.loads(call.arguments or "{}").get("question") or "")
        except (json.JSONDecodeError, AttributeError):
            question = call.arguments
        timeout = self.settings.clarify_timeout_s
        now = self.clock.time()
        if self.waiting_since is None:
            self.waiting_since = now
        self.record.question = question
        self.emit("turn.waiting", question=question, timeout_at=self.waiting_since + timeout)
        self._stop_active()
        await self.checkpoint(TurnState.WAITING)
        self.control.park()

        def first_answer() -> dict[str, Any] | None:
            return next((m for m in self.record.inbox if m["kind"] == "answer"), None)

        wait_s = max(0.0, self.waiting_since + timeout - now)
        if self.limits.deadline is not None:  # the deadline counts every wait
            wait_s = min(wait_s, max(0.0, self.limits.deadline - now))
        try:
            with self.clock.move_on_after(wait_s):
                while first_answer() is None and not self.control.suspend_requested:
                    await self.control.wake.wait()
        except BaseException:  # cancelled: no slot to take back
            self.control.parked = False
            raise
        if not await self.control.unpark():  # an answer that came stays in the inbox
            await self._suspend(parked=True)
        answer: str | None = None
        message = first_answer()
        if message is not None:
            answer = message["text"]
            self.record.inbox.remove(message)
        waited = self.clock.time() - self.waiting_since
        self.waiting_since = None
        self.record.question = None
        self._move(TurnState.RUNNING)
        self._start_active()
        if answer is None:
            self.conv.add_tool_result(call, "no answer came")
            stop = self.guard.check_time(self._usage(), now=self.clock.time())
            if stop is not None and stop.code is StopCode.DEADLINE:
                return self._stop(stop)
            return self._stop(Stop(StopCode.CLARIFY_TIMEOUT,
                                   f"no answer to the clarify question within {timeout:g} s",
                                   value=round(waited, 3), limit=timeout))
        self.conv.add_tool_result(call, answer)
        self.restarts.reset()
        self.record.counters["restarts"] = 0
        self.partial.append(f"step {self.record.counters['steps']}: asked the user: "
                            f"{question[:200]}")
        await self.checkpoint()
        return None

    async def _tool_call(self, call: ToolCall, key: str, *, resuming: bool
                         ) -> Stop | tuple[str | None, str | None]:
        """One tool call with its guards, journal, breaker and retries. Returns the
        observation (content, state), content None for a failure (the failure loop
        governs those, not the progress and state rules), or a Stop."""
        toolbox = self.runtime.toolbox
        tool = toolbox.get(call.name)
        if tool is None:
            failure = CallFailure(exception=("UnknownTool",),
                                  message=f"there is no tool named {call.name!r}")
            return self._tool_failed(call, None, failure)
        args, problem = toolbox.check_arguments(call.name, call.arguments)
        if problem is not None:
            return self._tool_failed(call, None, problem.failure)
        assert args is not None
        action = Action(tool=call.name, key=action_key(call.name, args), polling=tool.polling)
        verdict = self.loops.before_action(action)
        if isinstance(verdict, Stop):
            verdict = self._gate(verdict)
            if verdict is not None:
                return verdict
        if isinstance(verdict, LoopWarning):
            if self.modes["loop_detection"] != "observe":
                self.conv.add_note(verdict.message)
            self.emit("loop.warning", code=verdict.code, count=verdict.count,
                      limit=verdict.limit, tool=call.name)
            self.log.info("guard.loop_warning", tool=call.name, code=verdict.code,
                          repeats=verdict.count, limit=verdict.limit,
                          **self._counter_values())
        # No time left for even a request: do not send one (a cut non-idempotent call
        # would leave an effect of unknown outcome behind).
        spent = self.guard.check_time(self._usage(), now=self.clock.time())
        if spent is not None:
            return spent
        self.emit("tool.call", tool=call.name, call_id=call.id, key=key,
                  arguments=args)
        outcome: ToolOutcome | None = None
        if resuming:
            entry = await self.store.journal_get(key)
            if entry is not None and entry["outcome"] is not None:
                outcome = ToolOutcome.from_json(entry["outcome"])
            elif entry is not None and not entry["idempotent"]:
                msg = (f"the call {call.name} ({key}) was in flight when the daemon stopped; "
                       "it is not idempotent, so it was not run again and its outcome is "
                       "unknown. Check before doing it again.")
                self.open_issues.append(f"outcome unknown: {call.name} {call.arguments} "
                                        f"(Idempotency-Key {key})")
                self.conv.add_tool_result(call, "OUTCOME UNKNOWN: " + msg)
                self.emit("tool.result", tool=call.name, call_id=call.id, key=key,
                          ok=None, outcome="unknown")
                return (f"unknown:{key}", None)
        if outcome is None:
            await self.store.journal_intent(key, turn=self.record.id, tool=call.name,
                                            arguments=call.arguments,
                                            idempotent=tool.idempotent)
            outcome = await self._execute(call.name, args, key, idempotent=tool.idempotent)
            await self.store.journal_outcome(key, outcome.to_json())
        self.loops.after_action(action, classify(outcome.failure) if outcome.failure else None)
        if outcome.failure is not None:
            return self._tool_failed(call, args, outcome.failure, key=key)
        self.failures.record_success(call.name, args)
        self.conv.add_tool_result(call, outcome.content)
        self.partial.append(f"step {self.record.counters['steps']}: {call.name} "
                            f"{_short(call.arguments)} -> ok")
        self.emit("tool.result", tool=call.name, call_id=call.id, key=key, ok=True,
                  content=outcome.content[:2000], state=outcome.state)
        return (outcome.content, outcome.state)

    def _tool_failed(self, call: ToolCall, args: dict[str, Any] | None,
                     failure: CallFailure, *, key: str | None = None
                     ) -> Stop | tuple[str | None, str | None]:
        """The agent is told every failure (so it can change what it sends); the failure
        loop counts it."""
        cls = classify(failure)
        text = f"ERROR ({cls.value}): {failure.describe()}"
        self.conv.add_tool_result(call, text)
        self.partial.append(f"step {self.record.counters['steps']}: {call.name} "
                            f"{_short(call.arguments)} -> failed ({cls.value})")
        stop = self.failures.record_failure(call.name, args if args is not None
                                            else call.arguments, cls)
        stop = self._gate(stop) if stop is not None else None
        streak, limit = self.failures.streak, self.failures.thresholds[cls]
        self.emit("tool.result", tool=call.name, call_id=call.id, key=key, ok=False,
                  **{"class": cls.value}, error=failure.describe()[:500],
                  failure_streak=streak, limit=limit)
        self.log.info("tool.failed", tool=call.name, failure_class=cls.value,
                      error=failure.describe()[:300], failure_streak=streak, limit=limit,
                      **self._counter_values())
        if stop is not None:
            return stop
        return (None, None)

    async def _execute(self, name: str, args: dict[str, Any], key: str, *,
                       idempotent: bool) -> ToolOutcome:
        """Attempts of one call: idempotent tools retry retryable failures with backoff
        (one Idempotency-Key for all attempts); others get exactly one attempt."""
        tool = self.runtime.toolbox.get(name)
        assert tool is not None
        breaker = self.shared.breakers.get(tool.breaker)
        rule = self.settings.tool_retry
        max_attempts = attempts_for(idempotent=idempotent,
                                    max_attempts=self.settings.tool_max_attempts)
        previous: float | None = None
        attempt = 0
        while True:
            attempt += 1
            if breaker is not None and not breaker.try_acquire(self.clock.monotonic()):
                return ToolOutcome(content="", failure=CallFailure(
                    exception=("CircuitOpen", "ConnectionError"),
                    message=f"the circuit breaker {tool.breaker} is open"))
            remaining = self.remaining_s()
            self.control.effect_in_flight = not idempotent
            try:
                outcome = await self.runtime.toolbox.call(
                    name, args, idempotency_key=key,
                    timeout_s=max(0.001, min(tool.timeout, remaining)))
            except BaseException:
                if breaker is not None:
                    breaker.release(self.clock.monotonic())
                raise
            finally:
                self.control.effect_in_flight = False
            if outcome.failure is None:
                if breaker is not None:
                    breaker.record_success(self.clock.monotonic())
                return outcome
            cls = classify(outcome.failure)
            if breaker is not None and not outcome.attempted:  # e.g. its server is down
                breaker.release(self.clock.monotonic())
            elif breaker is not None:
                breaker.record_failure(self.clock.monotonic(), cls,
                                       retry_after_s=outcome.failure.retry_after_s)
            delay = rule.next_delay(attempt=attempt, max_attempts=max_attempts,
                                    failure_class=cls,
                                    retry_after_s=outcome.failure.retry_after_s,
                                    remaining_s=self.remaining_s(), previous_s=previous,
                                    rand=self.rand)
            if delay is None:
                return outcome
            previous = delay
            self.emit("tool.retry_scheduled", tool=name, key=key, attempt=attempt + 1,
                      delay=round(delay, 3), **{"class": cls.value},
                      status=outcome.failure.status)
            await self.clock.sleep(delay)


def _short(arguments: str, limit: int = 120) -> str:
    return arguments if len(arguments) <= limit else arguments[:limit] + "..."

