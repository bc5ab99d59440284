"""One request of a model call and its reply: the request built from the turn's
conversation (the messages as the adapter encoded them for the last request kept, so
only new ones are encoded again), sent once the provider's in-flight gate has a slot,
within the call's bound and in the one scope a steer's redirect or a reload's suspend
cuts; the reply charged to the turn's meter (`turn/metering.py`).

`ModelCall` (turn/model_call.py) decides whether an attempt is made and what follows it.
"""

from __future__ import annotations

from turnkeeper import event_types as ev
from turnkeeper.messages import ToolSpec
from turnkeeper.policy.call_bound import CallBound
from turnkeeper.policy.classify import CallFailure
from turnkeeper.providers.base import MessageCache, ModelReply, ModelRequest, ProviderError
from turnkeeper.tracing import Span
from turnkeeper.turn.claims import Claims
from turnkeeper.turn.context import TurnContext
from turnkeeper.turn.metering import Meter


class Exchange:
    def __init__(self, ctx: TurnContext, meter: Meter) -> None:
        self.ctx = ctx
        self.meter = meter
        # The turn's messages as the adapter encoded them for the last request.
        self._encoded = MessageCache()
        # The tools offered to the turn's agent, when the offer is fixed (no MCP server):
        # the same tuple for the whole turn, as the agent and its toolbox are.
        self._fixed_tools: tuple[ToolSpec, ...] | None = None

    def _publish(self, body: ev.EventBody) -> None:
        self.ctx.bus.publish(body, turn=self.ctx.record.id)

    async def _on_delta(self, text: str) -> None:
        self._publish(ev.ModelDelta(text=text))

    def request(self, max_output_tokens: int, left_s: float, timeout_s: float,
                traceparent: str | None) -> ModelRequest:
        """The request of an attempt: the provider's `timeout_s`, bounded by `left_s`,
        the turn's time left."""
        ctx = self.ctx
        tools = self._fixed_tools
        if tools is None:
            tools = ctx.tool_specs()
            if ctx.runtime.toolbox.offer_fixed:
                self._fixed_tools = tools
        return ModelRequest(
            system=ctx.agent.system_prompt, messages=tuple(ctx.conv.messages),
            tools=tools, max_output_tokens=max_output_tokens,
            timeout_s=max(0.001, min(timeout_s, left_s)),
            turn_id=ctx.record.id, step=ctx.record.counters.steps,
            metadata={"turn_message": ctx.record.message}, cache=self._encoded,
            traceparent=traceparent,
            output_schema=ctx.output_schema)

    async def send(self, name: str, request: ModelRequest, left_s: float, bound: CallBound,
                   claims: Claims, span: Span
                   ) -> tuple[ModelReply | None, CallFailure | None, bool]:
        """The request sent to provider `name`: its reply (charged), or the call's
        failure, and whether the call was cut from outside (a steer's redirect or a
        reload's suspend: `model_call_cut`). It waits for an in-flight slot (up to
        `left_s`) first; the call's `bound` cuts it (a failure) however its reply
        trickles in. The retry the call claimed (`claims`) ends with it, whichever way."""
        ctx = self.ctx
        provider = ctx.runtime.providers[name]
        budget = ctx.shared.retry_budgets[name]
        budget.begin_request()
        failure: CallFailure | None = None
        reply: ModelReply | None = None
        cut = False
        try:
            # One scope for the call: a steer's redirect or a reload's suspend cut it
            # (`model_call_cut`), and so does the call's bound (anything else).
            with ctx.clock.scope() as call_scope:
                ctx.control.call_scope = call_scope
                if ctx.control.model_call_cut:
                    call_scope.cancel()
                # The whole call, however it trickles in: a per-read timeout never ends
                # a stream that keeps sending something. Its bound starts once a slot is
                # had (the wait for one has its own): the call's scope is cut at it.
                call = provider.complete(request, self._on_delta)
                try:
                    reply = await ctx.shared.gates.run(
                        name, call, clock=ctx.clock, wait_s=left_s,
                        on_wait=lambda limit, busy, queued: self._publish(ev.ModelQueued(
                            provider=name, limit=limit, in_flight=busy, waiting=queued)),
                        bound=(call_scope, bound.seconds))
                except ProviderError as exc:
                    failure = exc.failure
                if reply is not None:
                    wrong = self.meter.charge(name, reply)
                    if wrong is not None:  # a broken counter: nothing of it is counted
                        reply, failure = None, CallFailure(
                            error_type="invalid_usage", exception=("InvalidUsage",),
                            message=wrong)
            if call_scope.cancelled_caught:
                cut = ctx.control.model_call_cut
                if not cut:
                    failure = bound.failure()  # the call's bound ran out
        finally:
            ctx.control.call_scope = None
            budget.end_request()
            claims.end_retry()
            tracer = ctx.shared.tracer
            if tracer.enabled:
                tracer.chat_ended(span, request, reply, failure)
        return reply, failure, cut
