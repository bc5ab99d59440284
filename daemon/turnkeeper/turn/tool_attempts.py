"""The attempts of one tool call: idempotent tools retry retryable failures with backoff
(one Idempotency-Key for all attempts); others get exactly one attempt. Each attempt
passes the tool's Retry-After window and breaker first, and its failure feeds them after,
unless nothing reached the tool, the failure was our own (descriptors, memory), or the
process stalled while the call was out.
"""

from __future__ import annotations

from typing import Any

from turnkeeper import event_types as ev
from turnkeeper.policy.breaker import CircuitBreaker
from turnkeeper.policy.classify import CallFailure, FailureClass, classify
from turnkeeper.policy.retry_after import not_sent
from turnkeeper.policy.tool_retry import attempts_for
from turnkeeper.tools.registry import ToolOutcome
from turnkeeper.tracing import Tracer
from turnkeeper.turn.context import TurnContext


class ToolAttempts:
    def __init__(self, ctx: TurnContext) -> None:
        self.ctx = ctx

    async def run(self, name: str, args: dict[str, Any], key: str, *,
                  idempotent: bool, call_id: str = "") -> ToolOutcome:
        ctx = self.ctx
        tool = ctx.runtime.toolbox.get(name)
        assert tool is not None
        peer = tool.breaker
        breaker = ctx.shared.breakers.get(peer)
        # The retry rule and the attempts allowed are read at the first failure: most
        # calls have none.
        max_attempts = 0
        previous: float | None = None
        attempt = 0
        tracer = ctx.shared.tracer
        toolbox = ctx.runtime.toolbox
        while True:
            attempt += 1
            ctx.record.counters.tool_attempts = attempt
            refused = self._refused(name, peer, breaker, first=attempt == 1)
            if refused is not None:
                return refused
            started_at = ctx.clock.monotonic()
            timeout_s = max(0.001, min(tool.timeout, ctx.remaining_s()))
            try:
                if tracer.enabled:
                    outcome = await self._traced(tracer, name, args, key, attempt, call_id,
                                                 timeout_s=timeout_s)
                else:  # the turn's span, whose traceparent goes out; no tracer call
                    outcome = await toolbox.call(
                        name, args, idempotency_key=key, timeout_s=timeout_s,
                        traceparent=ctx.span.traceparent)
            except BaseException:
                if breaker is not None:
                    breaker.release(ctx.clock.monotonic())
                raise
            if outcome.failure is None:
                if breaker is not None:
                    breaker.record_success(ctx.clock.monotonic())
                return outcome
            cls = classify(outcome.failure)
            self._failed(name, peer, breaker, outcome, cls, started_at=started_at)
            max_attempts = max_attempts or attempts_for(
                idempotent=idempotent, max_attempts=ctx.settings.tools.max_attempts(name))
            delay = ctx.settings.tools.retry.next_delay(
                attempt=attempt, max_attempts=max_attempts, failure_class=cls,
                retry_after_s=outcome.failure.retry_after_s,
                remaining_s=ctx.remaining_s(), previous_s=previous, rand=ctx.rand)
            if delay is None:
                return outcome
            previous = delay
            ctx.emit(ev.ToolRetryScheduled(tool=name, key=key, attempt=attempt + 1,
                                           delay=round(delay, 3), class_=cls.value,
                                           status=outcome.failure.status))
            await self._backoff(delay)

    async def _traced(self, tracer: Tracer, name: str, args: dict[str, Any], key: str,
                      attempt: int, call_id: str, *, timeout_s: float) -> ToolOutcome:
        """One attempt in its span, tracing on (off, `run` makes the attempt itself)."""
        ctx = self.ctx
        span = tracer.tool(ctx.span, tool=name, call_id=call_id, key=key,
                           attempt=attempt, arguments=args)
        try:
            outcome = await ctx.runtime.toolbox.call(
                name, args, idempotency_key=key, timeout_s=timeout_s,
                traceparent=span.traceparent)
        except BaseException:
            tracer.tool_ended(span, None)
            raise
        tracer.tool_ended(span, outcome)
        return outcome

    def _refused(self, name: str, peer: str, breaker: CircuitBreaker | None, *,
                 first: bool) -> ToolOutcome | None:
        """Not sent: inside a Retry-After window the tool opened (for any turn; a retry
        is not asked, its sleep honoured the Retry-After), or its breaker is open."""
        ctx = self.ctx
        memory = ctx.shared.retry_after
        window = memory.window(peer, ctx.clock.monotonic()) if first and memory.until else None
        if window is not None:
            return ToolOutcome(content="", attempted=False,
                               failure=not_sent(f"tool {name}", window))
        if breaker is not None and not breaker.try_acquire(ctx.clock.monotonic()):
            return ToolOutcome(content="", failure=CallFailure(
                exception=("CircuitOpen", "ConnectionError"),
                message=f"the circuit breaker {peer} is open"))
        return None

    def _failed(self, name: str, peer: str, breaker: CircuitBreaker | None,
                outcome: ToolOutcome, cls: FailureClass, *, started_at: float) -> None:
        """What a failed attempt tells the tool's breaker and its Retry-After window."""
        ctx = self.ctx
        failure = outcome.failure
        assert failure is not None
        now = ctx.clock.monotonic()
        excuse = ctx.shared.stalls.excuse(started_at=started_at, now=now)
        if excuse is not None:
            ctx.log.info("tool.failure_not_counted", tool=name, why=excuse.value)
        if breaker is not None and (not outcome.attempted or failure.local
                                    or excuse is not None):
            # nothing reached the tool (its server is down), we ran out of descriptors
            # or memory, or the process stalled (or its fleet lease lapsed) while the
            # call was out: the peer's breaker learns nothing
            breaker.release(now)
        elif breaker is not None:
            breaker.record_failure(now, cls, retry_after_s=failure.retry_after_s)
        if outcome.attempted:
            ctx.shared.retry_after.heard(
                peer, failure.retry_after_s, now=now,
                max_retry_after_s=ctx.settings.tools.retry.max_retry_after_s)

    async def _backoff(self, delay: float) -> None:
        """The wait before an idempotent call's next attempt. Nothing is on the wire: a
        reload that is done waiting suspends the turn here (the call goes again on
        resume, with the same Idempotency-Key), rather than after more attempts."""
        ctx = self.ctx
        control = ctx.control
        with ctx.clock.move_on_after(delay):
            while not control.suspend_now:
                await control.wake.wait()
        if control.suspend_now:
            await ctx.suspend()
