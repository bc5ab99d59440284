"""The OpenTelemetry tracer: spans of turns, model attempts and tool attempts, exported
over OTLP/HTTP (protobuf) to `[tracing] endpoint`. Imported only when `[tracing] enabled
= true` (the `otel` extra); the no-op tracer in `tracing.py` stands in otherwise.

The spans follow the GenAI semantic conventions: `invoke_agent {agent}` (internal) for a
turn's run in this process, `chat {model}` (client) for each model attempt and
`execute_tool {tool}` (internal) for each tool attempt, with the `gen_ai.*` attributes
and ours under `turnkeeper.`. Prompts, answers and tool arguments and results are put in
span attributes (`gen_ai.input.messages`, `gen_ai.output.messages`,
`gen_ai.system_instructions`, `gen_ai.tool.call.arguments`, `gen_ai.tool.call.result`)
only with `capture_content = true`.

A turn's span is a child of the traceparent the turn holds (the caller's, or else its
first span's, kept with the turn): a turn resumed after a restart, a reload or on another
fleet node starts a new `invoke_agent` span in the same trace. Parents are passed
explicitly, never through the context variables; the tracer provider is the daemon's
own, not the process-wide global. Spans are sent by the SDK's batch processor (its own
thread), so a step never waits on the collector.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, StatusCode, TraceFlags

from turnkeeper import __version__
from turnkeeper.messages import Message
from turnkeeper.tracecontext import format_traceparent, parse_traceparent
from turnkeeper.tracing import Span, TracedTurn, Tracer

if TYPE_CHECKING:
    from turnkeeper.config import Config, ProviderConfig
    from turnkeeper.policy.classify import CallFailure
    from turnkeeper.policy.outcome import TurnResult
    from turnkeeper.providers.base import ModelReply, ModelRequest
    from turnkeeper.tools.outcome import ToolOutcome

# `gen_ai.provider.name` of each provider kind (the conventions' well-known values).
PROVIDER_NAMES = {"openai": "openai", "openai-responses": "openai",
                  "anthropic": "anthropic", "gemini": "gcp.gemini",
                  "scripted": "turnkeeper.scripted"}
# A captured text longer than this is cut (a span attribute is not a transcript store).
CONTENT_LIMIT = 64 * 1024


class OtelSpan(Span):
    __slots__ = ("span",)

    def __init__(self, span: trace.Span) -> None:
        ctx = span.get_span_context()
        super().__init__(format_traceparent(f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}",
                                            int(ctx.trace_flags)))
        self.span = span


def traces_url(endpoint: str) -> str:
    """The exporter's URL: the endpoint as the OTLP environment variable names it (the
    collector's base URL, `/v1/traces` added), or a URL already ending in `/v1/traces`."""
    base = endpoint.rstrip("/")
    return base if base.endswith("/v1/traces") else base + "/v1/traces"


def error_type(failure: CallFailure) -> str:
    """`error.type`: low cardinality: the HTTP status, else the exception's name, else
    the provider's error type."""
    if failure.status is not None:
        return str(failure.status)
    if failure.exception:
        return failure.exception[0]
    return failure.error_type or "_OTHER"


def _cut(text: str) -> str:
    return text if len(text) <= CONTENT_LIMIT else text[:CONTENT_LIMIT]


def _parts(message: Message) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = []
    if message.role == "tool":
        parts.append({"type": "tool_call_response", "id": message.tool_call_id,
                      "response": _cut(message.content or "")})
        return parts
    if message.content:
        parts.append({"type": "text", "content": _cut(message.content)})
    parts.extend({"type": "tool_call", "id": c.id, "name": c.name,
                  "arguments": _cut(c.arguments)} for c in message.tool_calls)
    return parts


def messages_json(messages: Sequence[Message]) -> str:
    return json.dumps([{"role": m.role, "parts": _parts(m)} for m in messages],
                      ensure_ascii=False)


class OtelTracer(Tracer):
    enabled = True

    def __init__(self, *, endpoint: str, service_name: str, sample_ratio: float,
                 capture_content: bool, node: str | None = None,
                 exporter: SpanExporter | None = None) -> None:
        """`exporter`: spans handed to it as each ends, instead of batched to the
        endpoint (the tests)."""
        attributes: dict[str, Any] = {"service.name": service_name,
                                      "service.version": __version__}
        if node:
            attributes["service.instance.id"] = node
        self.provider = TracerProvider(
            resource=Resource.create(attributes),
            sampler=ParentBased(root=TraceIdRatioBased(sample_ratio)))
        self.provider.add_span_processor(
            BatchSpanProcessor(OTLPSpanExporter(endpoint=traces_url(endpoint)))
            if exporter is None else SimpleSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("turnkeeper", __version__)
        self.capture_content = capture_content
        self.service_name = service_name
        # (the config, its providers by name): read again only after a reload.
        self._providers: tuple[object, dict[str, ProviderConfig]] = (None, {})

    # -- a turn ------------------------------------------------------------------------

    def turn(self, record: TracedTurn, *, resumed: bool) -> Span:
        # The agent: the one the turn was submitted to, else the service's name.
        agent = record.agent or self.service_name
        context = None
        try:
            parent = (parse_traceparent(record.traceparent)
                      if record.traceparent is not None else None)
        except ValueError:  # checked at submit: a stored one is never refused, but
            parent = None  # a trace is not worth a turn (a new one starts)
            record.traceparent = None
        if parent is not None:
            context = trace.set_span_in_context(NonRecordingSpan(SpanContext(
                trace_id=int(parent.trace_id, 16), span_id=int(parent.span_id, 16),
                is_remote=True, trace_flags=TraceFlags(parent.flags))))
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": agent,
            "gen_ai.conversation.id": record.session, "turnkeeper.turn.id": record.id,
            "turnkeeper.turn.resumed": resumed,
            "turnkeeper.policy_version": record.policy_version}
        if self.capture_content:
            attributes["gen_ai.input.messages"] = json.dumps(
                [{"role": "user", "parts": [{"type": "text", "content": _cut(record.message)}]}],
                ensure_ascii=False)
        span = OtelSpan(self.tracer.start_span(f"invoke_agent {agent}", context=context,
                                               kind=SpanKind.INTERNAL,
                                               attributes=attributes))
        if record.traceparent is None:
            # The turn's trace: its later runs (after a restart, on another node) are
            # children of this first one.
            record.traceparent = span.traceparent
        return span

    def turn_ended(self, span: Span, record: TracedTurn, result: TurnResult | None) -> None:
        assert isinstance(span, OtelSpan)
        s = span.span
        if s.is_recording():
            attributes: dict[str, Any] = {
                f"turnkeeper.counters.{name}": value
                for name, value in record.counters.to_json().items()}
            attributes["gen_ai.usage.input_tokens"] = record.usage.input_tokens
            attributes["gen_ai.usage.output_tokens"] = record.usage.output_tokens
            attributes["turnkeeper.usage.cost_usd"] = record.usage.cost_usd
            if result is None:
                attributes["turnkeeper.turn.suspended"] = True
            else:
                code = result.stopped_because.code.value
                attributes["turnkeeper.stop.code"] = code
                attributes["turnkeeper.turn.status"] = result.status.value
                if result.status.value != "completed":
                    attributes["error.type"] = code
                    s.set_status(StatusCode.ERROR, result.stopped_because.message)
                if self.capture_content and result.answer is not None:
                    attributes["gen_ai.output.messages"] = json.dumps(
                        [{"role": "assistant", "parts": [
                            {"type": "text", "content": _cut(result.answer)}]}],
                        ensure_ascii=False)
            s.set_attributes(attributes)
        s.end()

    # -- a model attempt -----------------------------------------------------------------

    def _provider(self, config: Config, name: str) -> ProviderConfig | None:
        if self._providers[0] is not config:
            self._providers = (config, {p.name: p for p in config.providers})
        return self._providers[1].get(name)

    def chat(self, turn: Span, *, provider: str, attempt: int, config: Config) -> Span:
        assert isinstance(turn, OtelSpan)
        cfg = self._provider(config, provider)
        kind = cfg.kind if cfg is not None else "unknown"
        model = (cfg.model if cfg is not None else "") or provider
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": "chat",
            "gen_ai.provider.name": PROVIDER_NAMES.get(kind, kind),
            "gen_ai.request.model": model,
            "turnkeeper.provider": provider, "turnkeeper.attempt": attempt}
        return OtelSpan(self.tracer.start_span(
            f"chat {model}", context=trace.set_span_in_context(turn.span),
            kind=SpanKind.CLIENT, attributes=attributes))

    def chat_ended(self, span: Span, request: ModelRequest, reply: ModelReply | None,
                   failure: CallFailure | None) -> None:
        assert isinstance(span, OtelSpan)
        s = span.span
        if s.is_recording():
            s.set_attributes({"gen_ai.request.max_tokens": request.max_output_tokens,
                              "turnkeeper.step": request.step,
                              "turnkeeper.turn.id": request.turn_id})
            if self.capture_content:
                if request.system:
                    s.set_attribute("gen_ai.system_instructions", json.dumps(
                        [{"type": "text", "content": _cut(request.system)}],
                        ensure_ascii=False))
                s.set_attribute("gen_ai.input.messages", messages_json(request.messages))
            if reply is not None:
                attributes: dict[str, Any] = {
                    "gen_ai.usage.input_tokens": int(reply.usage.input_tokens),
                    "gen_ai.usage.output_tokens": int(reply.usage.output_tokens),
                    "gen_ai.response.finish_reasons": [reply.finish_reason]}
                if reply.model:
                    attributes["gen_ai.response.model"] = reply.model
                if self.capture_content:
                    attributes["gen_ai.output.messages"] = messages_json([Message(
                        role="assistant", content=reply.text, tool_calls=reply.tool_calls)])
                s.set_attributes(attributes)
            elif failure is not None:
                s.set_attribute("error.type", error_type(failure))
                s.set_status(StatusCode.ERROR, failure.describe())
            else:
                s.set_attribute("error.type", "cancelled")
        s.end()

    # -- a tool attempt ------------------------------------------------------------------

    def tool(self, turn: Span, *, tool: str, call_id: str, key: str, attempt: int,
             arguments: dict[str, Any]) -> Span:
        assert isinstance(turn, OtelSpan)
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": tool,
            "gen_ai.tool.call.id": call_id, "gen_ai.tool.type": "function",
            "turnkeeper.tool.idempotency_key": key, "turnkeeper.attempt": attempt}
        if self.capture_content:
            attributes["gen_ai.tool.call.arguments"] = _cut(
                json.dumps(arguments, ensure_ascii=False))
        return OtelSpan(self.tracer.start_span(
            f"execute_tool {tool}", context=trace.set_span_in_context(turn.span),
            kind=SpanKind.INTERNAL, attributes=attributes))

    def tool_ended(self, span: Span, outcome: ToolOutcome | None) -> None:
        assert isinstance(span, OtelSpan)
        s = span.span
        if s.is_recording():
            if outcome is None:
                s.set_attribute("error.type", "cancelled")
            else:
                s.set_attribute("turnkeeper.tool.outcome", outcome.kind.value)
                if outcome.failure is not None:
                    s.set_attribute("error.type", error_type(outcome.failure))
                    s.set_status(StatusCode.ERROR, outcome.failure.describe())
                elif self.capture_content:
                    s.set_attribute("gen_ai.tool.call.result", _cut(outcome.content))
        s.end()

    async def aclose(self) -> None:
        import anyio

        await anyio.to_thread.run_sync(self.provider.shutdown)
