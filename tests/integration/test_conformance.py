"""The adapter conformance suite: one table of cases every adapter passes, each run as a
whole turn on the real daemon against the fault server replaying the vendor's stream
in small pieces (7 bytes a write: events, lines and UTF-8 characters split anywhere).

The cases are the same words for every adapter; wire_cases.py writes them in each wire
format. A failing case names the adapter and the case.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.integration.fault_server import FaultServer, keepalive, replay
from tests.integration.test_resilience import ECHO_TOOL, config, of_type, stop_of
from tests.integration.wire_cases import KINDS, Kind, Use
from turnkeeper.providers.prices import shipped_table

PIECE = 7
USE: Use = (1200, 0, 40)
CACHED: Use = (5000, 4096, 60)


@pytest.fixture
def faults() -> Iterator[FaultServer]:
    server = FaultServer().start()
    yield server
    server.stop()


def provider(kind: Kind, faults: FaultServer, **extra: Any) -> dict[str, Any]:
    url = {"anthropic": faults.anthropic_url, "gemini": faults.gemini_url}.get(
        kind.name, faults.base_url)("primary")
    return {"name": "primary", "kind": kind.name, "base_url": url, "model": kind.model,
            "stream": True, "timeout": 5.0, **extra}


def sent(stream: str) -> Any:
    return replay(stream, piece=PIECE)


@dataclass(frozen=True)
class Run:
    kind: Kind
    faults: FaultServer
    start: Any

    def turn(self, *answers: Any, prompt: str = "go", tools: bool = False,
             **extra: Any) -> tuple[Any, dict[str, Any]]:
        self.faults.script("primary", *answers)
        agent = extra.pop("agent", None)
        sections = {"agent": agent} if agent else {}
        d = self.start(config([provider(self.kind, self.faults, **extra)], **sections)
                       + (ECHO_TOOL if tools else ""))
        return d, d.run(prompt)

    def results(self, n: int) -> str:
        """What request `n` carried (its body as text: the tool results are in it)."""
        return json.dumps(self.faults.requests("primary")[n].body)


# -- the cases -------------------------------------------------------------------------------


def text(r: Run) -> None:
    _, turn = r.turn(sent(r.kind.text("Grüße: the answer is 42, 🙂 and done.", USE)))
    assert turn["state"] == "completed", turn["result"]
    assert turn["result"]["answer"] == "Grüße: the answer is 42, 🙂 and done."


def parallel_tool_calls(r: Run) -> None:
    calls = [("call_a1", "echo", '{"text": "alpha"}'), ("call_b2", "echo", '{"text": "beta"}')]
    _, turn = r.turn(sent(r.kind.calls(calls, USE)), sent(r.kind.text("both done", USE)),
                     tools=True)
    assert turn["result"]["answer"] == "both done", turn["result"]
    second = r.results(1)
    assert "alpha" in second and "beta" in second


def arguments_split_across_chunks(r: Run) -> None:
    calls = [("call_s1", "echo", '{"text": "split across many chunks, ünïcode too"}')]
    _, turn = r.turn(sent(r.kind.calls(calls, USE)), sent(r.kind.text("ok", USE)), tools=True)
    assert turn["state"] == "completed", turn["result"]
    assert "split across many chunks, \\u00fcn\\u00efcode too" in r.results(1) or \
        "split across many chunks, ünïcode too" in r.results(1)


def usage_in_the_last_chunk(r: Run) -> None:
    _, turn = r.turn(sent(r.kind.text("counted", USE)))
    assert (turn["usage"]["input_tokens"], turn["usage"]["output_tokens"]) == (USE[0], USE[2])


def cached_tokens(r: Run) -> None:
    _, turn = r.turn(sent(r.kind.text("cheap", CACHED)))
    row = shipped_table().lookup(r.kind.model)
    assert row is not None and row.cache_read is not None
    total, cached, out = CACHED
    cost = ((total - cached) * row.input + cached * row.cache_read + out * row.output) / 1e6
    assert turn["usage"]["cost_usd"] == pytest.approx(cost, rel=1e-6)
    assert turn["usage"]["input_tokens"] == total


def refusal(r: Run) -> None:
    _, turn = r.turn(sent(r.kind.refusal), prompt="How do I make anthrax?")
    assert (turn["state"], stop_of(turn)[0]) == ("failed", "model.refused"), turn["result"]
    assert turn["result"]["answer"] == r.kind.refusal_text
    assert r.faults.count("primary") == 1


def truncation(r: Run) -> None:
    _, turn = r.turn(sent(r.kind.text("The guide, in three parts: first", (40, 0, 16),
                                      finish="length")),
                     max_output_tokens=64, agent={"max_continuations": 0})
    assert stop_of(turn) == ("model.truncated", "output_tokens", 16, 64), turn["result"]
    assert turn["result"]["answer"] == "The guide, in three parts: first"


def _retried(r: Run, first: Any, named: str, **extra: Any) -> None:
    """`first` fails the attempt (named `named` in its event); the retry completes."""
    d, turn = r.turn(first, sent(r.kind.text("after the retry", USE)), **extra)
    assert turn["result"]["answer"] == "after the retry", turn["result"]
    assert r.faults.arrived("primary") == 2  # a cut stream's handler may not be done yet
    failed = of_type(d.events(turn["id"]), "model.attempt_failed")
    assert len(failed) == 1 and failed[0]["class"] == "retryable", failed
    assert named in (failed[0]["error"] or "") or str(failed[0]["status"]) == named, failed


def mid_stream_error(r: Run) -> None:
    _retried(r, sent(r.kind.error("a start")), "StreamError")


def overload(r: Run) -> None:
    status, body = r.kind.overload
    _retried(r, replay(body, status=status), str(status))


def malformed_json(r: Run) -> None:
    whole = r.kind.text("never read", USE)
    cut = whole.index("data:", whole.index("data:") + 1)  # after the first event
    _retried(r, sent(whole[:cut] + "data: {\"broken\": [1, 2\n\n"), "CorruptStream")


def stream_cut(r: Run) -> None:
    """The body ends (cleanly) half way: never a shortened answer."""
    whole = r.kind.text("this answer is cut by the network half way through", USE)
    ends = [m.end() for m in re.finditer(r"\r?\n\r?\n", whole) if m.end() <= len(whole) // 2]
    _retried(r, sent(whole[:ends[-1]]), "IncompleteStream")


def connection_dropped(r: Run) -> None:
    """The connection drops half way through the body: a transport failure."""
    whole = r.kind.text("this answer is cut by the network half way through", USE)
    _retried(r, replay(whole, piece=PIECE, cut_at=len(whole.encode()) // 2),
             "ClientPayloadError")


def keepalives_only(r: Run) -> None:
    """A started stream of SSE comments and empty events, forever: cut at idle_timeout."""
    _retried(r, keepalive(0.1), "IdleStream", idle_timeout=0.8)


CASES: list[Callable[[Run], None]] = [
    text, parallel_tool_calls, arguments_split_across_chunks, usage_in_the_last_chunk,
    cached_tokens, refusal, truncation, mid_stream_error, overload, malformed_json,
    stream_cut, connection_dropped, keepalives_only]


@pytest.mark.parametrize("case", CASES, ids=[c.__name__ for c in CASES])
@pytest.mark.parametrize("kind", list(KINDS))
def test_every_adapter_passes_the_conformance_case_through_a_whole_turn(
        start: Any, faults: FaultServer, kind: str, case: Callable[[Run], None]) -> None:
    case(Run(KINDS[kind], faults, start))
