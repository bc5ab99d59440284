"""Tracing at the edge: the no-op tracer hands a turn's attempts its own span (nothing
allocated on a step), `[tracing]` is checked at load (its collector's host, the `otel`
extra), and with tracing off nothing of OpenTelemetry is imported."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from turnkeeper.config import Config, ConfigError, build_config
from turnkeeper.config.tracing import DEFAULT_ENDPOINT, ENDPOINT_ENV, TracingConfig
from turnkeeper.providers.base import ModelRequest
from turnkeeper.tracing import NO_SPAN, NOOP
from turnkeeper.turn.record import TurnRecord

TP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
PROVIDERS = [{"name": "a", "kind": "scripted"}]


def _record(traceparent: str | None = None) -> TurnRecord:
    return TurnRecord(id="t1", session="s", message="hi", created_at=0.0, updated_at=0.0,
                      traceparent=traceparent)


def test_the_noop_tracer_gives_a_turn_without_a_traceparent_nothing_to_send() -> None:
    span = NOOP.turn(_record(), resumed=False)
    assert span is NO_SPAN and span.traceparent is None


def test_the_noop_tracer_passes_a_submitted_traceparent_on_unchanged() -> None:
    turn = NOOP.turn(_record(TP), resumed=True)
    assert turn.traceparent == TP
    config = Config(providers=PROVIDERS)
    # A step allocates nothing: an attempt's span is the turn's own.
    assert NOOP.chat(turn, provider="a", attempt=1, config=config) is turn
    assert NOOP.tool(turn, tool="echo", call_id="c1", key="k", attempt=1,
                     arguments={}) is turn
    NOOP.chat_ended(turn, ModelRequest(system="", messages=(), tools=(),
                                       max_output_tokens=1, timeout_s=1.0), None, None)
    NOOP.tool_ended(turn, None)
    NOOP.turn_ended(turn, _record(TP), None)


def test_a_record_keeps_its_traceparent_through_json() -> None:
    assert TurnRecord.from_json(_record(TP).to_json()).traceparent == TP
    assert "traceparent" not in _record().to_json()


def test_tracing_is_off_by_default_and_its_endpoint_comes_from_the_otel_variable(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENDPOINT_ENV, raising=False)
    assert not TracingConfig().enabled
    assert TracingConfig().endpoint == DEFAULT_ENDPOINT == "http://127.0.0.1:4318"
    monkeypatch.setenv(ENDPOINT_ENV, "http://[::1]:4999")
    assert TracingConfig().endpoint == "http://[::1]:4999"


def test_a_collector_neither_loopback_nor_allowed_is_refused_naming_the_key(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENDPOINT_ENV, raising=False)
    with pytest.raises(ConfigError) as err:
        build_config({"providers": PROVIDERS, "tracing": {
            "enabled": True, "endpoint": "http://collector.example:4318"}})
    assert err.value.exit_code == 78
    assert "tracing" in str(err.value) and "endpoint" in str(err.value)
    assert "allowed_hosts" in str(err.value)
    cfg = build_config({"providers": PROVIDERS, "tracing": {
        "enabled": True, "endpoint": "https://Collector.example/otlp",
        "allowed_hosts": ["collector.example"]}})
    assert cfg.tracing.endpoint == "https://Collector.example/otlp"
    for loopback in ("http://localhost:4318", "http://127.0.0.2:4318", "http://[::1]:4318"):
        build_config({"providers": PROVIDERS,
                      "tracing": {"enabled": True, "endpoint": loopback}})


def test_an_endpoint_from_the_environment_is_checked_only_when_tracing_is_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENDPOINT_ENV, "http://collector.example:4318")
    build_config({"providers": PROVIDERS})  # off: another program's variable
    with pytest.raises(ConfigError, match=ENDPOINT_ENV):
        build_config({"providers": PROVIDERS, "tracing": {"enabled": True}})


@pytest.mark.parametrize("tracing, says", [
    ({"endpoint": "127.0.0.1:4318"}, "http:// or https://"),
    ({"endpoint": "http://127.0.0.1:99999"}, "valid URL"),
    ({"sample_ratio": 1.5}, "sample_ratio"),
    ({"sample_ratio": -0.1}, "sample_ratio"),
    ({"service_name": ""}, "service_name"),
    ({"sampling": 1.0}, "sampling"),
])
def test_bad_tracing_values_are_named(tracing: dict[str, object], says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        build_config({"providers": PROVIDERS, "tracing": tracing})


def test_tracing_on_without_the_extra_is_exit_78_saying_what_to_install(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # As if not installed (a module set to None cannot be imported), whatever another
    # test of this process imported already.
    for name in ("opentelemetry", "opentelemetry.sdk.trace",
                 "opentelemetry.exporter.otlp.proto.http"):
        monkeypatch.setitem(sys.modules, name, None)
    build_config({"providers": PROVIDERS, "tracing": {"enabled": False}})
    with pytest.raises(ConfigError) as err:
        build_config({"providers": PROVIDERS, "tracing": {"enabled": True}})
    assert err.value.exit_code == 78
    assert "pip install 'turnkeeper[otel]'" in str(err.value)
    assert "enabled" in str(err.value)


def test_with_tracing_off_nothing_of_opentelemetry_is_imported(tmp_path: Path) -> None:
    """A fresh interpreter loads the config, the daemon and a turn's rooms: no
    `opentelemetry` module is in it (the step pays for nothing it does not use)."""
    script = textwrap.dedent("""
        import sys
        from turnkeeper.config import build_config
        import turnkeeper.daemon, turnkeeper.turn.runner, turnkeeper.control.routes
        import turnkeeper.tools.mcp_session, turnkeeper.providers.openai
        build_config({"providers": [{"name": "a", "kind": "scripted"}]})
        print(sorted(m for m in sys.modules if m.startswith("opentelemetry")))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, cwd=tmp_path)
    assert out.stdout.strip() == "[]", out.stdout
