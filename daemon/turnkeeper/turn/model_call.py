"""One model call of a step, through the provider chain: each attempt (its request and
reply: `turn/exchange.py`), the retry sleeps, the failovers and the recovery waits.

`ProviderChain` decides every move; this room carries them out. The shared protection
a call claims on the way (a provider breaker's slot, a retry from the provider's retry
budget) is held by one `Claims` (turn/claims.py) for the whole call, so every way out, a
reply, a stop, a redirect, a cancellation, gives back exactly what it took.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from turnkeeper import event_types as ev
from turnkeeper.policy.breaker import CircuitBreaker
from turnkeeper.policy.budget import CLOCK_STOPS, Preflight
from turnkeeper.policy.call_bound import CALL_TIMEOUT, CallBound
from turnkeeper.policy.chain import Attempt, FailOver, Recover, RetryIn
from turnkeeper.policy.classify import CallFailure, FailureClass, classify
from turnkeeper.policy.outcome import Stop, StopCode
from turnkeeper.policy.replies import thinking_stop
from turnkeeper.policy.restarts import context_exhausted
from turnkeeper.policy.turn_state import TurnState
from turnkeeper.providers.base import ModelReply
from turnkeeper.turn.claims import Claims
from turnkeeper.turn.context import Redirected, TurnContext
from turnkeeper.turn.exchange import Exchange
from turnkeeper.turn.metering import Meter

# What `_last_failure` holds before any (a CallFailure is immutable: one for every turn).
NO_FAILURE = CallFailure()


class ModelCall:
    def __init__(self, ctx: TurnContext) -> None:
        self.ctx = ctx
        self._last_failure = NO_FAILURE
        # Each provider's last failure in this model call, one line: what a providers
        # stop tells in its result instead of leaving the cause to the daemon's log.
        self._last_errors: dict[str, str] = {}
        # The provider and the output cap of the last request: whose reply it is, and
        # the limit of a cut one.
        self.sent_to = ""
        self.sent_output_cap = 0
        # The size of the next request, and the charge of each reply.
        self.meter = Meter(ctx)
        # The request of each attempt, and its reply.
        self.exchange = Exchange(ctx, self.meter)
        # What each model call holds of the shared protection, given back at its end.
        self._claims = Claims(ctx.shared, ctx.clock)

    def _breaker(self, provider: str) -> CircuitBreaker:
        return self.ctx.shared.breakers[f"provider:{provider}"]

    def _window(self, provider: str) -> float | None:
        """Seconds left of the Retry-After window the provider opened (for any turn)."""
        return self.ctx.shared.retry_after.window(f"provider:{provider}",
                                                  self.ctx.clock.monotonic())

    def _publish(self, body: ev.EventBody) -> None:
        self.ctx.bus.publish(body, turn=self.ctx.record.id)

    async def call(self) -> ModelReply | Stop | None:
        """Returns the reply, a Stop, or None after a context-overflow rebuild (the step
        is to run again). Raises `Redirected` when a steer cut it short."""
        ctx = self.ctx
        self._last_errors = {}
        # A chain restored parked in recovery goes on with its wait; any other starts.
        decision: Any = ctx.chain.resume(now=ctx.clock.time(), recover_until=ctx.recover_until)
        first = True  # the step's guards have just checked the time
        claims = self._claims
        try:
            while True:
                # The active time or the deadline ran out during this call: that is
                # the budget's stop, not a reason to fail over, park in recovery or
                # give up on the providers.
                if not first:
                    spent = ctx.time_spent()
                    if spent is not None:
                        return spent
                first = False
                if isinstance(decision, Attempt):
                    result = await self._attempt(decision, claims)
                    if isinstance(result, ModelReply):
                        return result
                    if result is None:
                        return self._rebuild()
                    decision = result
                elif isinstance(decision, RetryIn):
                    decision = await self._retry(decision, claims)
                elif isinstance(decision, FailOver):
                    self._publish(ev.ModelFailover(from_=decision.from_provider,
                                                   to=decision.to_provider,
                                                   reason=decision.reason))
                    ctx.log.info("model.failover", from_provider=decision.from_provider,
                                 to=decision.to_provider, reason=decision.reason,
                                 **ctx.counter_values())
                    decision = ctx.chain.begin_call()
                elif isinstance(decision, Recover):
                    outcome = await self._recover(decision)
                    if isinstance(outcome, Stop):
                        return outcome
                    if outcome:  # a steer cut the wait short: a new pass, no cycle
                        ctx.chain.user_message()
                        decision = ctx.chain.begin_call()
                    else:
                        decision = ctx.chain.recovery_done()
                elif isinstance(decision, Stop):
                    if "no_time" in ctx.chain.pass_exits and ctx.guard.clock_binds(
                            ctx.usage(), now=ctx.clock.time()):
                        # A wait the wall clock or the deadline could not hold: the
                        # turn stops when it runs out, with its code.
                        return await self._out_of_time(decision)
                    return self._gave_up(decision)
                else:  # pragma: no cover - the chain's decisions are a closed set
                    raise AssertionError(f"unexpected chain decision {decision!r}")
        finally:
            claims.give_back()
            ctx.sync_counters()

    async def _retry(self, decision: RetryIn, claims: Claims) -> Any:
        """Sleep before a retry on the same provider, unless its breaker opened meanwhile
        or its retry budget refuses: then the chain moves on at once."""
        ctx = self.ctx
        reopens_in = self._breaker(decision.provider).open_for(ctx.clock.monotonic())
        if reopens_in is not None:  # opened meanwhile: hop now, do not sleep
            ctx.log.info("model.breaker_open", provider=decision.provider)
            return ctx.chain.on_breaker_open(reopens_in_s=reopens_in)
        window = self._window(decision.provider)
        if window is not None and window > decision.seconds:
            # Another turn heard a longer Retry-After than this sleep honours: hop now.
            ctx.log.info("model.retry_after_window", provider=decision.provider,
                         wait=round(window, 3))
            return ctx.chain.on_retry_after(wait_s=window)
        if not claims.begin_retry(decision.provider):
            ctx.log.info("model.retry_refused", provider=decision.provider,
                         **ctx.counter_values())
            return ctx.chain.on_retry_refused()
        self._publish(ev.ModelRetryScheduled(
            provider=decision.provider, attempt=decision.attempt_next,
            delay=round(decision.seconds, 3), class_=decision.failure_class.value,
            status=self._last_failure.status, retry_after=decision.retry_after_s))
        ctx.log.info("model.retry_scheduled", provider=decision.provider,
                     delay=round(decision.seconds, 3),
                     failure_class=decision.failure_class.value, **ctx.counter_values())
        ctx.record.next_attempt_at = ctx.clock.time() + decision.seconds
        await self._sleep_active(decision.seconds)
        ctx.record.next_attempt_at = None
        return ctx.chain.retry_ready()

    async def _attempt(self, attempt: Attempt, claims: Claims) -> ModelReply | Any | None:
        ctx = self.ctx
        name = attempt.provider
        if ctx.control.confirm_lease is not None:
            # A node whose lease lapsed asks nothing until a renewal confirms the lease:
            # another node may run the turn by then, and would pay for the call again.
            await ctx.control.confirm_lease()
        cleared = self._cleared(attempt, claims)
        if not isinstance(cleared, Preflight):
            return cleared  # not sent: the chain's decision, or a stop
        fits = cleared
        ctx.sync_counters()
        settings = ctx.settings.providers[name]
        self.sent_to, self.sent_output_cap = name, fits.max_output_tokens
        thinking = settings.thinking_budget_tokens
        if thinking is not None:
            stop = thinking_stop(output_cap=fits.max_output_tokens, budget_tokens=thinking,
                                 tokens_spent=ctx.usage().tokens,
                                 max_tokens=ctx.guard.limits.max_tokens)
            if stop is not None:  # no request: the cap left cannot hold the thinking
                ctx.chain.abandon()
                return stop
        # The attempt's span (the turn's own with tracing off): its traceparent goes out.
        tracer = ctx.shared.tracer
        span = tracer.chat(ctx.span, provider=name, attempt=attempt.attempt,
                           config=ctx.runtime.config) if tracer.enabled else ctx.span
        # The turn's time left, read once: the request's timeout, the call's total bound
        # and the wait for an in-flight slot are all taken from here.
        left_s = ctx.remaining_s()
        request = self.exchange.request(fits.max_output_tokens, left_s, settings.timeout_s,
                                span.traceparent)
        ctx.bus.publish(ev.ModelRequest(provider=name, attempt=attempt.attempt, step=request.step,
                                        messages=len(request.messages)), turn=ctx.record.id)
        started_at = ctx.clock.monotonic()
        bound = CallBound.of(turn_left_s=left_s, max_call_s=settings.max_call_s)
        reply, failure, cut = await self.exchange.send(name, request, left_s, bound, claims,
                                                       span)
        if cut:
            raise self._cut(name)
        if failure is not None and failure.exception == CALL_TIMEOUT and bound.by_turn:
            spent = ctx.time_spent()
            if spent is not None:  # the turn's time ran out: its stop, not the provider's
                claims.failed(FailureClass.RETRYABLE, None, local=True)
                ctx.log.info("model.call_cut", provider=name, reason=spent.code.value,
                             **ctx.counter_values())
                return spent
        if reply is not None:
            claims.succeeded()
            ctx.chain.on_success()
            return reply
        assert failure is not None
        return self._failed(attempt, failure, started_at, claims)

    def _cleared(self, attempt: Attempt, claims: Claims) -> Preflight | Any:
        """Whether the attempt may be sent (its lease confirmed): no Retry-After window
        open, the budget's pre-flight (what fits: the output cap), the breaker. Anything
        but a Preflight: not sent (the chain's decision, or a stop)."""
        ctx = self.ctx
        name = attempt.provider
        # A provider that asked (any turn) not to be called yet is skipped, no attempt.
        # A retry is not asked again: its sleep honoured the Retry-After (`_retry`).
        window = (self._window(name) if attempt.attempt == 1 and ctx.shared.retry_after.until
                  else None)
        if window is not None:
            claims.end_retry()
            ctx.log.info("model.retry_after_window", provider=name, wait=round(window, 3))
            return ctx.chain.on_retry_after(wait_s=window)
        # The budget is a ceiling: a request that cannot fit is not sent, and one that
        # fits is sent with the output cap cut to what is left.
        fits = self.meter.preflight(name)
        if isinstance(fits, Stop):
            ctx.chain.abandon()
            return fits
        breaker = self._breaker(name)
        if not claims.acquire(breaker):
            claims.end_retry()
            ctx.log.info("model.breaker_open", provider=name)
            return ctx.chain.on_breaker_open(
                reopens_in_s=breaker.open_for(ctx.clock.monotonic()))
        return fits

    def _failed(self, attempt: Attempt, failure: CallFailure, started_at: float,
                claims: Claims) -> Any:
        """The attempt failed: classified, counted (unless a stall excuses it), the
        provider's Retry-After remembered for every turn, and the chain's decision. A
        context overflow is no failure: None, the step is rebuilt and asked afresh."""
        ctx = self.ctx
        name = attempt.provider
        self._last_failure = failure
        error = failure.describe()
        self._last_errors[name] = error
        ctx.record.last_error = f"{name}: {error}"
        if failure.context_overflow:
            claims.succeeded()
            ctx.chain.abandon()  # not a failure: the step is rebuilt and called afresh
            self._publish(ev.ModelAttemptFailed(provider=name, attempt=attempt.attempt,
                                                class_="context_overflow",
                                                status=failure.status, error=error))
            return None
        cls = classify(failure)
        excuse = ctx.shared.stalls.excuse(started_at=started_at, now=ctx.clock.monotonic())
        if excuse is not None:
            ctx.log.info("model.failure_not_counted", provider=name, why=excuse.value)
        claims.failed(cls, failure.retry_after_s, local=failure.local,
                      excused=excuse is not None)
        # What the provider asked for holds for every turn until it passes.
        ctx.shared.retry_after.heard(f"provider:{name}", failure.retry_after_s,
                                     now=ctx.clock.monotonic(),
                                     max_retry_after_s=ctx.chain.max_retry_after_s)
        self._publish(ev.ModelAttemptFailed(provider=name, attempt=attempt.attempt,
                                            class_=cls.value, status=failure.status,
                                            error=error))
        ctx.log.info("model.attempt_failed", provider=name, failure_class=cls.value,
                     status=failure.status, error=error, **ctx.counter_values())
        # A stream that broke part-way is a failure of this provider like any other: the
        # step is asked again, here or on the next provider, and counts in
        # provider_attempts and fallback_hops, never in restarts (a context rebuild).
        return ctx.chain.on_failure(cls, retry_after_s=failure.retry_after_s,
                                    remaining_s=ctx.remaining_s(), rand=ctx.rand)

    def _cut(self, provider: str) -> Redirected:
        """The model call was cut from outside: a steer with redirect (the step starts
        over with it), or a reload's suspend (the step starts over at its boundary, where
        the turn suspends; the call is asked again on resume)."""
        ctx = self.ctx
        ctx.chain.abandon()
        if ctx.control.redirect_requested:
            self._publish(ev.ModelRedirected(provider=provider))
        else:
            ctx.log.info("model.call_cut", provider=provider, reason="suspend",
                         **ctx.counter_values())
        return Redirected()

    def _count_restart(self, why: str) -> Stop | None:
        stop = self.ctx.restarts.restart(why)
        self.ctx.log.info("turn.restart", why=why, **self.ctx.counter_values())
        return stop

    def _rebuild(self) -> Stop | None:
        stop = self._count_restart("context overflow: older history compacted")
        if stop is not None:
            return stop
        if not self.ctx.conv.compact():
            return context_exhausted(message=self._last_failure.message,
                                     estimate_tokens=self.meter.input_tokens())
        return None

    def _gave_up(self, stop: Stop) -> Stop:
        """A providers stop says why: each provider's last failure in its result, and in
        `open_issues` what was attempted (not in `partial`: it is not work done)."""
        if stop.code not in (StopCode.PROVIDERS_EXHAUSTED, StopCode.PROVIDERS_REJECTED):
            return stop
        ctx = self.ctx
        tried = ", ".join(f"{p} ({e})" for p, e in self._last_errors.items()) or "none"
        ctx.open_issues.append(
            f"step {ctx.record.counters.steps}: the model call was attempted on "
            f"{len(ctx.chain.providers)} provider(s) over {ctx.chain.recovery_cycles} "
            f"recovery cycle(s) and none answered; last errors: {tried}")
        # The message is what `turnkeeper show` prints: it names the causes too.
        causes = "; ".join(f"{p}: {e}" for p, e in self._last_errors.items())
        message = f"{stop.message}; last error: {causes}" if causes else stop.message
        return replace(stop, message=message, last_error=dict(self._last_errors))

    async def _out_of_time(self, gave_up: Stop) -> Stop:
        """The chain gave up after a wait was refused because the wall clock or the
        deadline would pass first: the turn waits out what is left (as a backoff wait
        is: active time, its slot kept) and stops with the code of the limit reached,
        not a provider code. The providers' last errors stay in the stop."""
        ctx = self.ctx
        # The chain has stopped: nothing is left to redirect, so only a cancel cuts it.
        await ctx.clock.sleep(ctx.remaining_s())
        stop = ctx.time_spent()
        if stop is None:  # pragma: no cover - the wait above lasted the time left
            return self._gave_up(gave_up)
        return replace(stop, last_error=dict(self._last_errors) or None)

    async def _sleep_active(self, seconds: float) -> None:
        """A backoff wait: active time (it counts toward max_seconds), cut short by a
        redirect steer or a reload's suspend."""
        control = self.ctx.control
        with self.ctx.clock.move_on_after(seconds):
            while not control.model_call_cut:
                await control.wake.wait()
        if control.model_call_cut:
            raise self._cut(self.ctx.chain.current_provider)

    async def _recover(self, decision: Recover) -> Stop | bool:
        """Park for a recovery cycle: not active time; cancel, steer and suspend work.
        True when a steer cut the wait short (it has joined the conversation)."""
        ctx = self.ctx
        now = ctx.clock.time()
        # A turn resumed in its wait (a restart, a reload) waits out what is left of it:
        # that, not the cycle's full wait, is what the event reports. One whose wait is
        # over already (woken by its timer after a reload let it wait on) goes on at
        # once: the wait was announced, and there is nothing left of it to announce.
        resumed = ctx.recover_until is not None
        until = ctx.begin_recovery(decision.wait_s)
        wait = round(max(0.0, until - now), 3)
        ctx.record.next_attempt_at = until
        if wait > 0 or not resumed:
            self._publish(ev.TurnRecovering(cycle=decision.cycle, of=decision.of_cycles,
                                            wait=wait, next_attempt_at=until,
                                            waits_for=decision.waits_for,
                                            reason=decision.why))
            ctx.log.warning("turn.recovering", cycle=decision.cycle, of=decision.of_cycles,
                            wait=wait, waits_for=decision.waits_for, reason=decision.why,
                            **ctx.counter_values())
        await ctx.park(TurnState.RECOVERING, until=until,
                       done=lambda: ctx.control.redirect_requested or ctx.has_unread_steer())
        ctx.end_recovery()
        ctx.record.next_attempt_at = None
        stop = ctx.time_spent()
        if stop is not None and stop.code in CLOCK_STOPS:
            return stop
        # A steer that cut the wait short joins the conversation before the next pass,
        # checkpointed at once: its inbox entry is gone from the record from now on.
        if ctx.has_unread_steer():
            ctx.absorb_messages()
            await ctx.checkpoint()
            return True
        return False
