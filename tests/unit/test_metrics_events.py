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
    assert m.failovers.labels("primary", "backup", "breaker_open")._value.get() == 1
    assert m.retries_scheduled.labels("primary", "retryable")._value.get() == 1


def test_tool_results_by_outcome_and_unknown_tool_names(
        bus: tuple[EventBus, Metrics]) -> None:
    b, m = bus
    base = {"call_id": "c", "key": "k"}
    b.publish(ev.ToolResult(tool="echo", ok=True, content="hi", state=None, **base))
    b.publish(ev.ToolResult(tool="echo", ok=None, outcome="unknown", **base))
    b.publish(ev.ToolResult(tool="made_up", ok=False, class_="deterministic", error="x",
                            failure_streak=1, limit=3, **base))
    assert m.tool_calls.labels("echo", "ok")._value.get() == 1
    assert m.tool_calls.labels("echo", "outcome_unknown")._value.get() == 1
    assert m.tool_calls.labels(UNKNOWN_TOOL, "deterministic")._value.get() == 1


def test_turn_lifecycle_counts_submitted_finished_and_step_durations(
        bus: tuple[EventBus, Metrics]) -> None:
    b, m = bus
    b.publish(ev.TurnQueued(session="s", message="m", policy_version=1), turn="t")
    b.publish(ev.StepStarted(step=1, provider="primary"), turn="t")
    b.publish(ev.TurnFinished(result={"status": "completed", "stopped_because": {
        "code": "completed"}}), turn="t")
    assert m.turns_submitted._value.get() == 1
    assert m.turns_finished.labels("completed", "completed")._value.get() == 1
    assert _value(m, "turnkeeper_step_duration_seconds_count") == 1


def test_old_string_form_counts_the_same(bus: tuple[EventBus, Metrics]) -> None:
    b, m = bus
    b.publish("model.failover", turn="t", **{"from": "a"}, to="b", reason="r")
    b.publish("daemon.reload_failed", trigger="sighup", error="bad", policy_version=1)
    assert m.failovers.labels("a", "b", "r")._value.get() == 1
    assert m.reloads.labels("failed")._value.get() == 1
