"""Metrics counted from catalogue events, without a daemon: the bus's listener turns
each event class into its counter."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from turnkeeper import event_types as ev
from turnkeeper import metrics as metrics_module
from turnkeeper.clock import FakeClock
from turnkeeper.events import EventBus
from turnkeeper.metrics import UNKNOWN_TOOL, Metrics


class _NoState:
    def __init__(self, *args: Any) -> None:
        pass

    def collect(self) -> list[Any]:
        return []


@pytest.fixture
def bus(monkeypatch: pytest.MonkeyPatch) -> tuple[EventBus, Metrics]:
    monkeypatch.setattr(metrics_module, "StateCollector", _NoState)
    supervisor = SimpleNamespace(
        config=SimpleNamespace(providers=[SimpleNamespace(name="primary")]),
        runtime=SimpleNamespace(toolbox=SimpleNamespace(
            get=lambda name: object() if name == "echo" else None)))
    clock = FakeClock()
    m = Metrics(supervisor, clock=clock)  # type: ignore[arg-type]
    b = EventBus(clock=clock, strict=True)
    b.listeners.append(m.on_event)
    return b, m


def _value(m: Metrics, name: str, **labels: str) -> float:
    v = m.registry.get_sample_value(name, labels)
    return 0.0 if v is None else v


def test_model_events_count_requests_attempts_tokens_and_cost(
        bus: tuple[EventBus, Metrics]) -> None:
    b, m = bus
    b.publish(ev.ModelRequest(provider="primary", attempt=1, step=1, messages=2), turn="t")
    b.publish(ev.ModelAttemptFailed(provider="primary", attempt=1, class_="retryable",
                                    status=503), turn="t")
    b.publish(ev.ModelRetryScheduled(provider="primary", attempt=2, delay=0.5,
                                     class_="retryable", status=503, retry_after=None),
              turn="t")
    b.publish(ev.ModelResponse(provider="primary", usage={"input_tokens": 10,
                                                          "output_tokens": 4},
                               cost_usd=0.25, finish_reason="stop", tool_calls=0), turn="t")
    b.publish(ev.ModelFailover(from_="primary", to="backup", reason="breaker_open"),
              turn="t")
    assert _value(m, "turnkeeper_provider_requests_total", provider="primary") == 1
    assert _value(m, "turnkeeper_provider_attempts_total", provider="primary",
                  **{"class": "retryable"}) == 1
    assert _value(m, "turnkeeper_provider_attempts_total", provider="primary",
                  **{"class": "success"}) == 1
    assert _value(m, "turnkeeper_tokens_total", provider="primary", direction="input") == 10
    assert _value(m, "turnkeeper_cost_usd_total", provider="primary") == 0.25
    assert _value(m, "turnkeeper_failovers_total", to="backup", reason="breaker_open",
                  **{"from": "primary"}) == 1
    assert _value(m, "turnkeeper_retries_scheduled_total", provider="primary",
                  **{"class": "retryable"}) == 1


def test_tool_results_by_outcome_and_unknown_tool_names(
        bus: tuple[EventBus, Metrics]) -> None:
    b, m = bus
    base = {"call_id": "c", "key": "k"}
    b.publish(ev.ToolResult(tool="echo", ok=True, content="hi", state=None, **base))
    b.publish(ev.ToolResult(tool="echo", ok=None, outcome="unknown", **base))
    b.publish(ev.ToolResult(tool="made_up", ok=False, class_="deterministic", error="x",
                            failure_streak=1, limit=3, **base))
    calls = "turnkeeper_tool_calls_total"
    assert _value(m, calls, tool="echo", outcome="ok") == 1
    assert _value(m, calls, tool="echo", outcome="outcome_unknown") == 1
    assert _value(m, calls, tool=UNKNOWN_TOOL, outcome="deterministic") == 1


def test_turn_lifecycle_counts_submitted_finished_and_step_durations(
        bus: tuple[EventBus, Metrics]) -> None:
    b, m = bus
    b.publish(ev.TurnQueued(session="s", message="m", policy_version=1), turn="t")
    b.publish(ev.StepStarted(step=1, provider="primary"), turn="t")
    b.publish(ev.TurnFinished(result={"status": "completed", "stopped_because": {
        "code": "completed"}}), turn="t")
    assert _value(m, "turnkeeper_turns_submitted_total") == 1
    assert _value(m, "turnkeeper_turns_finished_total", status="completed",
                  code="completed") == 1
    assert _value(m, "turnkeeper_step_duration_seconds_count") == 1


def test_old_string_form_counts_the_same(bus: tuple[EventBus, Metrics]) -> None:
    b, m = bus
    b.publish("model.failover", turn="t", **{"from": "a"}, to="b", reason="r")
    b.publish("daemon.reload_failed", trigger="sighup", error="bad", policy_version=1)
    assert _value(m, "turnkeeper_failovers_total", to="b", reason="r", **{"from": "a"}) == 1
    assert _value(m, "turnkeeper_reloads_total", result="failed") == 1


def test_counts_reach_every_scrape_that_follows_them(bus: tuple[EventBus, Metrics]) -> None:
    """Counts are added to the counters when the registry is read: each scrape shows
    every event published before it, and a count is added once, not at every scrape."""
    b, m = bus
    request = ev.ModelRequest(provider="primary", attempt=1, step=1, messages=2)
    for _ in range(2):
        b.publish(request, turn="t")
    text, _ = m.render(None)
    assert b'turnkeeper_provider_requests_total{provider="primary"} 2.0' in text
    b.publish(request, turn="t")
    for _ in range(2):  # a second read adds nothing more
        text, _ = m.render(None)
        assert b'turnkeeper_provider_requests_total{provider="primary"} 3.0' in text


def test_a_negative_count_is_refused_at_the_event_and_the_scrape_still_works(
        bus: tuple[EventBus, Metrics]) -> None:
    b, m = bus
    b.publish(ev.ModelResponse(provider="primary", usage={"input_tokens": -5,
                                                          "output_tokens": 1},
                               cost_usd=0.0, finish_reason="stop", tool_calls=0), turn="t")
    assert b.listener_errors == 0  # the listener logs its own failures, never raises
    text, _ = m.render(None)
    assert b"turnkeeper_tokens_total" in text
    assert _value(m, "turnkeeper_tokens_total", provider="primary", direction="input") == 0
