"""The OpenTelemetry tracer on its own, its spans handed to an in-memory exporter: the
parent of each span, the parent-based sampling, the traceparent each attempt sends."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from turnkeeper.config import Config
from turnkeeper.otel import OtelTracer, error_type, traces_url
from turnkeeper.policy.classify import CallFailure
from turnkeeper.policy.outcome import Stop, StopCode, TurnResult
from turnkeeper.providers.base import ModelReply, ModelRequest, Usage
from turnkeeper.tools.outcome import ToolOutcome
from turnkeeper.tracecontext import parse_traceparent
from turnkeeper.turn.record import TurnRecord

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER = "00f067aa0ba902b7"
CONFIG = Config(providers=[{"name": "p", "kind": "anthropic", "model": "claude-x"}])
REQUEST = ModelRequest(system="sys", messages=(), tools=(), max_output_tokens=64,
                       timeout_s=1.0, turn_id="t1", step=1)


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    yield InMemorySpanExporter()


def tracer(exporter: InMemorySpanExporter, ratio: float = 1.0) -> OtelTracer:
    return OtelTracer(endpoint="http://127.0.0.1:4318", service_name="svc",
                      sample_ratio=ratio, capture_content=False, exporter=exporter)


def record(traceparent: str | None) -> TurnRecord:
    return TurnRecord(id="t1", session="s", message="hi", created_at=0.0, updated_at=0.0,
                      traceparent=traceparent)


def run_turn(t: OtelTracer, rec: TurnRecord) -> tuple[str | None, str | None]:
    """One turn of one model attempt and one tool attempt; what each sent."""
    turn = t.turn(rec, resumed=False)
    chat = t.chat(turn, provider="p", attempt=1, config=CONFIG)
    t.chat_ended(chat, REQUEST, ModelReply(text=None, tool_calls=(), usage=Usage(10, 3),
                                           finish_reason="tool_calls"), None)
    tool = t.tool(turn, tool="lookup", call_id="c1", key="k1", attempt=1, arguments={})
    t.tool_ended(tool, ToolOutcome(content="ok"))
    t.turn_ended(turn, rec, TurnResult(Stop(StopCode.COMPLETED, "answered")))
    return chat.traceparent, tool.traceparent


def test_a_turn_s_spans_hang_under_the_caller_s_span_and_each_attempt_sends_its_own(
        spans: InMemorySpanExporter) -> None:
    sent_chat, sent_tool = run_turn(tracer(spans), record(f"00-{TRACE}-{CALLER}-01"))
    by_name = {s.name: s for s in spans.get_finished_spans()}
    assert set(by_name) == {"invoke_agent svc", "chat claude-x", "execute_tool lookup"}
    agent, chat, tool = (by_name["invoke_agent svc"], by_name["chat claude-x"],
                         by_name["execute_tool lookup"])
    assert agent.parent is not None and f"{agent.parent.span_id:016x}" == CALLER
    assert {f"{s.context.trace_id:032x}" for s in (agent, chat, tool)} == {TRACE}
    assert chat.parent is not None and chat.parent.span_id == agent.context.span_id
    assert tool.parent is not None and tool.parent.span_id == agent.context.span_id
    assert chat.attributes is not None and tool.attributes is not None
    assert chat.attributes["gen_ai.provider.name"] == "anthropic"
    assert chat.attributes["gen_ai.usage.input_tokens"] == 10
    assert tool.attributes["turnkeeper.tool.idempotency_key"] == "k1"
    assert sent_chat is not None and sent_tool is not None
    assert parse_traceparent(sent_chat).span_id == f"{chat.context.span_id:016x}"
    assert parse_traceparent(sent_tool).span_id == f"{tool.context.span_id:016x}"


def test_an_unsampled_caller_gets_no_span_but_its_trace_is_still_passed_on(
        spans: InMemorySpanExporter) -> None:
    sent_chat, sent_tool = run_turn(tracer(spans), record(f"00-{TRACE}-{CALLER}-00"))
    assert spans.get_finished_spans() == ()
    for sent in (sent_chat, sent_tool):
        assert sent is not None
        tp = parse_traceparent(sent)
        assert tp.trace_id == TRACE and not tp.sampled


def test_a_sampled_caller_is_followed_whatever_the_ratio(
        spans: InMemorySpanExporter) -> None:
    run_turn(tracer(spans, ratio=0.0), record(f"00-{TRACE}-{CALLER}-01"))
    assert len(spans.get_finished_spans()) == 3


def test_a_turn_without_a_caller_keeps_its_first_span_as_the_parent_of_later_runs(
        spans: InMemorySpanExporter) -> None:
    t = tracer(spans)
    rec = record(None)
    first = t.turn(rec, resumed=False)
    assert rec.traceparent == first.traceparent is not None
    t.turn_ended(first, rec, None)  # suspended
    again = t.turn(rec, resumed=True)
    t.turn_ended(again, rec, TurnResult(Stop(StopCode.BUDGET_STEPS, "steps")))
    one, two = spans.get_finished_spans()
    assert two.parent is not None and two.parent.span_id == one.context.span_id
    assert one.attributes is not None and one.attributes["turnkeeper.turn.suspended"]
    assert two.attributes is not None and two.attributes["error.type"] == "budget.steps"


def test_a_failed_attempt_names_its_error_type(spans: InMemorySpanExporter) -> None:
    t = tracer(spans)
    turn = t.turn(record(None), resumed=False)
    chat = t.chat(turn, provider="p", attempt=2, config=CONFIG)
    t.chat_ended(chat, REQUEST, None, CallFailure(status=429, message="slow down"))
    tool = t.tool(turn, tool="x", call_id="c", key="k", attempt=1, arguments={})
    t.tool_ended(tool, None)
    failed_chat, cut_tool = spans.get_finished_spans()
    assert failed_chat.attributes is not None and cut_tool.attributes is not None
    assert failed_chat.attributes["error.type"] == "429"
    assert cut_tool.attributes["error.type"] == "cancelled"


def test_the_traces_url_and_error_type_rules() -> None:
    assert traces_url("http://127.0.0.1:4318") == "http://127.0.0.1:4318/v1/traces"
    assert traces_url("http://c:4318/") == "http://c:4318/v1/traces"
    assert traces_url("http://c:4318/v1/traces") == "http://c:4318/v1/traces"
    assert error_type(CallFailure(exception=("ClientConnectorError", "OSError"))) == (
        "ClientConnectorError")
    assert error_type(CallFailure(error_type="overloaded")) == "overloaded"
    assert error_type(CallFailure()) == "_OTHER"


def test_the_turn_span_names_its_named_agent_else_the_service(
        spans: InMemorySpanExporter) -> None:
    rec = record(None)
    rec.agent = "support"
    run_turn(tracer(spans), rec)
    run_turn(tracer(spans), record(None))
    agents = [s for s in spans.get_finished_spans() if s.name.startswith("invoke_agent")]
    assert [s.name for s in agents] == ["invoke_agent support", "invoke_agent svc"]
    assert [(s.attributes or {})["gen_ai.agent.name"] for s in agents] == ["support", "svc"]
