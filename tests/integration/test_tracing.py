"""OpenTelemetry traces on the real daemon: an OTLP/HTTP receiver on 127.0.0.1 decodes the
spans the daemon exports (protobuf, with the official `opentelemetry-proto` messages);
a turn submitted with a traceparent is a child of the caller's span, its model and tool
attempts are children of the turn's, and the provider (a fake OpenAI-compatible server),
the http tool and the MCP server each receive a traceparent of the same trace. A turn
killed with -9 mid-turn and resumed continues the same trace. A malformed traceparent
is a 400 naming the field."""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from tests.integration.fault_server import FaultServer, ok
from tests.integration.harness import Daemon, post_raw, script_file
from tests.integration.tool_server import ToolServer

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE}-{CALLER}-01"
MCP_SERVER = Path(__file__).parent / "mcp_servers" / "stdio_server.py"


@dataclass(frozen=True)
class SpanSeen:
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: int
    attributes: dict[str, Any]
    status_code: int


def _value(v: Any) -> Any:
    which = v.WhichOneof("value")
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, which) if which else None


class Receiver:
    """An OTLP/HTTP trace receiver: POST /v1/traces, protobuf in, protobuf out."""

    def __init__(self) -> None:
        self.spans: list[SpanSeen] = []
        self.resources: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                receiver.take(request)
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def take(self, request: ExportTraceServiceRequest) -> None:
        with self.lock:
            for rs in request.resource_spans:
                self.resources.append({a.key: _value(a.value) for a in rs.resource.attributes})
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        self.spans.append(SpanSeen(
                            name=s.name, trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                            parent_id=s.parent_span_id.hex(), kind=s.kind,
                            attributes={a.key: _value(a.value) for a in s.attributes},
                            status_code=s.status.code))

    def named(self, prefix: str) -> list[SpanSeen]:
        with self.lock:
            return [s for s in self.spans if s.name.startswith(prefix)]

    def wait_for(self, pred: Callable[[Receiver], bool], what: str,
                 timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if pred(self):
                return
            time.sleep(0.05)
        raise AssertionError(f"no {what} in {timeout} s; spans: "
                             f"{[(s.name, s.attributes) for s in self.spans]}")

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


@pytest.fixture
def faults() -> Iterator[FaultServer]:
    server = FaultServer().start()
    yield server
    server.stop()


def post(sock_path: Path, body: Any, headers: dict[str, str] | None = None
         ) -> tuple[int, Any]:
    """POST /v1/turns with these headers (the harness's client sends none of its own)."""
    status, _, data = post_raw(sock_path, "/v1/turns", body, headers)
    return status, data


def config(receiver: Receiver, faults: FaultServer, tools: ToolServer, *,
           capture: bool = False) -> str:
    return f"""
[retry]
base_delay = 0.01
max_delay = 0.05

[tracing]
enabled = true
endpoint = "http://127.0.0.1:{receiver.port}"
service_name = "tk-test"
capture_content = {"true" if capture else "false"}

[[providers]]
name = "p"
kind = "openai"
base_url = "{faults.base_url("p")}"
model = "model-p"
stream = false
timeout = 10.0

[[tools]]
name = "lookup"
kind = "http"
url = "{tools.url("/lookup")}"
idempotent = true
parameters = {{ type = "object", properties = {{ q = {{ type = "string" }} }} }}
"""


# The daemon's batch processor sends what it has every 50 ms instead of every 5 s.
ENV = {"OTEL_BSP_SCHEDULE_DELAY": "50"}


def start(tmp_path: Path, daemons: list[Daemon], body: str) -> Daemon:
    d = Daemon(tmp_path, body, env=ENV)
    daemons.append(d)
    return d.start()


def parent_of(headers: dict[str, str]) -> tuple[str, str]:
    """(trace id, parent id) of the traceparent header a request carried."""
    (tp,) = [v for k, v in headers.items() if k.lower() == "traceparent"]
    _v, trace_id, span_id, _f = tp.split("-")
    return trace_id, span_id


def test_a_turn_s_spans_join_the_caller_s_trace_and_every_request_carries_it(
        tmp_path: Path, daemons: list[Daemon], receiver: Receiver, faults: FaultServer,
        tool_server: ToolServer) -> None:
    faults.script("p", ok(tool_calls=(("lookup", {"q": "weather"}),)), then=ok("sunny"))
    d = start(tmp_path, daemons, config(receiver, faults, tool_server))
    status, data = post(d.socket, {"message": "weather?", "session": "s1"},
                        {"traceparent": TRACEPARENT})
    assert status == 202, data
    assert data["turn"]["traceparent"] == TRACEPARENT
    turn = d.wait(data["turn"]["id"])
    assert turn["state"] == "completed", turn["result"]
    receiver.wait_for(lambda r: len(r.named("invoke_agent")) == 1
                      and len(r.named("chat")) == 2 and len(r.named("execute_tool")) == 1,
                      "turn, two chat and one tool span")

    (agent,) = receiver.named("invoke_agent")
    chats = receiver.named("chat")
    (tool,) = receiver.named("execute_tool")
    assert {s.trace_id for s in (agent, *chats, tool)} == {TRACE}
    assert agent.name == "invoke_agent tk-test" and agent.parent_id == CALLER
    assert agent.attributes["gen_ai.operation.name"] == "invoke_agent"
    assert agent.attributes["gen_ai.conversation.id"] == "s1"
    assert agent.attributes["turnkeeper.turn.id"] == turn["id"]
    assert agent.attributes["turnkeeper.stop.code"] == "completed"
    assert agent.attributes["turnkeeper.counters.steps"] == 2
    assert agent.attributes["turnkeeper.turn.resumed"] is False
    assert "error.type" not in agent.attributes

    for chat in chats:
        assert chat.name == "chat model-p" and chat.parent_id == agent.span_id
        assert chat.kind == 3  # SPAN_KIND_CLIENT
        a = chat.attributes
        assert a["gen_ai.operation.name"] == "chat"
        assert a["gen_ai.provider.name"] == "openai"
        assert a["gen_ai.request.model"] == "model-p"
        assert a["gen_ai.usage.input_tokens"] > 0 and a["gen_ai.usage.output_tokens"] > 0
        assert a["turnkeeper.provider"] == "p" and a["turnkeeper.attempt"] == 1
    assert sorted(c.attributes["gen_ai.response.finish_reasons"][0] for c in chats) == [
        "stop", "tool_calls"]

    assert tool.name == "execute_tool lookup" and tool.parent_id == agent.span_id
    assert tool.attributes["gen_ai.operation.name"] == "execute_tool"
    assert tool.attributes["gen_ai.tool.name"] == "lookup"
    call = next(e for e in d.events(turn["id"]) if e["type"] == "tool.call")
    assert tool.attributes["gen_ai.tool.call.id"] == call["call_id"]
    assert tool.attributes["turnkeeper.tool.idempotency_key"] == call["key"]
    # Without capture_content, no prompt, answer or argument is in any span.
    for s in (agent, *chats, tool):
        assert not [k for k in s.attributes if k.startswith(("gen_ai.input", "gen_ai.output",
                                                            "gen_ai.tool.call.arg",
                                                            "gen_ai.tool.call.res",
                                                            "gen_ai.system"))]
    assert {"service.name": "tk-test"}.items() <= receiver.resources[0].items()

    # The provider saw each attempt's own span as the parent, in the caller's trace...
    sent = [parent_of(r.headers) for r in faults.requests("p")]
    assert sent == [(TRACE, c.span_id) for c in sorted(
        chats, key=lambda c: c.attributes["gen_ai.response.finish_reasons"][0] != "tool_calls")]
    # ...and so did the http tool.
    (tool_call,) = tool_server.calls("/lookup")
    assert parent_of(tool_call.headers) == (TRACE, tool.span_id)


def test_capture_content_puts_the_prompt_answer_and_arguments_in_the_spans(
        tmp_path: Path, daemons: list[Daemon], receiver: Receiver, faults: FaultServer,
        tool_server: ToolServer) -> None:
    faults.script("p", ok(tool_calls=(("lookup", {"q": "weather"}),)), then=ok("sunny"))
    d = start(tmp_path, daemons, config(receiver, faults, tool_server, capture=True))
    turn = d.run("weather in Lisbon?")
    assert turn["state"] == "completed"
    receiver.wait_for(lambda r: len(r.named("invoke_agent")) == 1
                      and len(r.named("chat")) == 2 and len(r.named("execute_tool")) == 1,
                      "the turn's spans")
    (agent,) = receiver.named("invoke_agent")
    # Submitted without a traceparent: the turn's span starts a trace of its own.
    assert agent.parent_id == ""
    assert "weather in Lisbon?" in agent.attributes["gen_ai.input.messages"]
    assert "sunny" in agent.attributes["gen_ai.output.messages"]
    (tool,) = receiver.named("execute_tool")
    assert json.loads(tool.attributes["gen_ai.tool.call.arguments"]) == {"q": "weather"}
    assert "gen_ai.tool.call.result" in tool.attributes
    last = next(c for c in receiver.named("chat")
            if c.attributes["gen_ai.response.finish_reasons"] == ["stop"])
    assert "weather in Lisbon?" in last.attributes["gen_ai.input.messages"]
    assert "sunny" in last.attributes["gen_ai.output.messages"]


@pytest.mark.parametrize("submitted", [TRACEPARENT, None], ids=["caller", "own"])
def test_a_turn_killed_mid_turn_continues_its_trace_after_the_restart(
        tmp_path: Path, daemons: list[Daemon], receiver: Receiver, faults: FaultServer,
        tool_server: ToolServer, submitted: str | None) -> None:
    """kill -9 while the tool call is in flight; the restarted daemon resumes the turn
    (the idempotent call is sent again) in the same trace: a new invoke_agent span, a
    child of the caller's span, or of the turn's first span when none was submitted."""
    faults.script("p", ok(tool_calls=(("lookup", {"q": "weather"}),)), then=ok("sunny"))
    d = start(tmp_path, daemons, config(receiver, faults, tool_server))
    tool_server.hold("/lookup")
    status, data = post(d.socket, {"message": "weather?", **(
        {"traceparent": submitted} if submitted else {})})
    assert status == 202, data
    (first,) = tool_server.wait_for_calls("/lookup", 1)
    # The chat span of the first life has been exported before the kill.
    receiver.wait_for(lambda r: len(r.named("chat")) == 1, "the first chat span")
    trace = parent_of(first.headers)[0]
    if submitted:
        assert trace == TRACE
    d.kill()
    tool_server.release("/lookup")
    d.start()
    turn = d.wait(data["turn"]["id"])
    assert turn["state"] == "completed", turn["result"]
    receiver.wait_for(lambda r: bool(r.named("invoke_agent")), "the resumed turn's span")
    (resumed,) = receiver.named("invoke_agent")  # the first life's never ended
    assert resumed.attributes["turnkeeper.turn.resumed"] is True
    assert resumed.trace_id == trace
    if submitted:
        assert resumed.parent_id == CALLER
    else:  # a child of the first life's span, the one the killed chat span had
        (chat1,) = [c for c in receiver.named("chat") if c.parent_id != resumed.span_id]
        assert resumed.parent_id == chat1.parent_id != ""
    second = tool_server.calls("/lookup")[-1]
    assert second.idempotency_key == first.idempotency_key
    assert parent_of(second.headers)[0] == trace
    assert {parent_of(r.headers)[0] for r in faults.requests("p")} == {trace}


@pytest.mark.parametrize("bad", [
    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
    "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
    "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
    "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
])
def test_a_malformed_traceparent_is_a_400_naming_the_field_and_queues_nothing(
        tmp_path: Path, daemons: list[Daemon], bad: str) -> None:
    d = Daemon(tmp_path, "")
    daemons.append(d)
    d.start()
    for body, headers in (({"message": "hi", "traceparent": bad}, {}),
                          ({"message": "hi"}, {"traceparent": bad}),
                          ([{"message": "hi"}], {"traceparent": bad})):
        status, data = post(d.socket, body, headers)
        assert status == 400, (body, headers, data)
        assert data["field"] == "traceparent", data
    assert d.get("/v1/turns")[1]["turns"] == []
    # A valid one is taken, with tracing off too, and kept with the turn.
    status, data = post(d.socket, {"message": "hi"}, {"traceparent": TRACEPARENT})
    assert status == 202 and data["turn"]["traceparent"] == TRACEPARENT


MCP_SCRIPT = """
[[scenarios]]
[[scenarios.steps]]
tool_calls = [{ name = "srv__trace_meta", arguments = {} }]
[[scenarios.steps]]
reply = "meta: $last_tool_result"
"""


def test_an_mcp_server_receives_the_traceparent_in_the_request_meta(
        tmp_path: Path, daemons: list[Daemon], receiver: Receiver) -> None:
    work = tmp_path / "mcp-work"
    script = script_file(tmp_path / "script.toml", MCP_SCRIPT)
    d = start(tmp_path, daemons, f"""
[tracing]
enabled = true
endpoint = "http://127.0.0.1:{receiver.port}"

[[providers]]
name = "scripted"
kind = "scripted"
script = "{script}"

[[tools]]
name = "srv"
kind = "mcp"
command = "{sys.executable}"
args = ["{MCP_SERVER}"]
env = {{ MCP_TEST_DIR = "{work}", MCP_NAME = "srv" }}
""")
    try:
        status, data = post(d.socket, {"message": "go"}, {"traceparent": TRACEPARENT})
        assert status == 202, data
        turn = d.wait(data["turn"]["id"])
        assert turn["state"] == "completed", turn["result"]
        receiver.wait_for(lambda r: bool(r.named("execute_tool")), "the tool span")
        (tool,) = receiver.named("execute_tool")
        assert tool.attributes["gen_ai.tool.name"] == "srv__trace_meta"
        assert turn["result"]["answer"] == f"meta: 00-{TRACE}-{tool.span_id}-01"
    finally:
        d.stop()
