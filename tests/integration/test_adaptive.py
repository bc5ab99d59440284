"""Concurrency that follows the provider's rate limits, through the real daemon: 200
turns at once against a provider throttling them, with the adaptive in-flight limit on
and off, in the same run.

Two throttles. llmock answering 429 with Retry-After to half of all requests, whatever
the load: the limit must drop during the storm and climb back once it is over. And our
fault server admitting 8 requests at once and answering 429 above that (a concurrency
quota, the throttle adaptation is for): the provider must see fewer 429s with adaptation
on than off. Other protections that would hide the effect (the breaker, the retry budget,
a give-up after a few attempts) are set out of the way in both runs alike."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.integration.fault_server import FaultServer, ok
from tests.integration.harness import Daemon
from tests.integration.test_resilience import config

TURNS = 200
ISOLATED = {
    "daemon": {"max_concurrent_turns": TURNS + 10, "max_queued_turns": 10 * TURNS},
    "agent": {"api_max_retries": 100},
    "retry": {"base_delay": 0.05, "max_delay": 0.2},
    "retry_budget": {"ratio": 100.0, "min_concurrency": 1000},
    "circuit_breaker": {"failure_threshold": 100000},
}


def _adaptive(on: bool) -> dict[str, dict[str, Any]]:
    return {**ISOLATED, "adaptive_concurrency": {"enabled": on, "min": 1}}


def _run_all(d: Daemon, n: int, tag: str) -> list[dict[str, Any]]:
    ids = [d.submit(f"{tag} {i}")["id"] for i in range(n)]
    return [d.wait(i, timeout=240) for i in ids]


def _gate(d: Daemon, provider: str) -> dict[str, Any]:
    status, data = d.get("/v1/status")
    assert status == 200, data
    return data["in_flight"][provider]  # type: ignore[no-any-return]


def _metric(d: Daemon, name: str, provider: str) -> float:
    status, data = d.get("/metrics")  # not JSON: the client hands back the text
    assert status == 200
    for line in str(data["error"]).splitlines():
        if line.startswith(f'{name}{{provider="{provider}"}}'):
            return float(line.split()[-1])
    raise AssertionError(f"{name} for {provider} not in /metrics")


@pytest.fixture
def storm() -> Iterator[tuple[Any, Any]]:
    from llmock.chaos import ChaosSettings
    from llmock.pytest_plugin import LLMock
    from llmock.testing import LLMockServer

    with LLMockServer(chaos=ChaosSettings()) as server:
        yield LLMock(server), server


def _primary(llmock: Any, max_in_flight: int) -> dict[str, Any]:
    return {"name": "primary", "kind": "openai", "base_url": llmock.base_url("openai"),
            "model": "openai-test-model", "api_key_env": "LLMOCK_TEST_KEY",
            "stream": False, "timeout": 10.0, "max_in_flight": max_in_flight}


@pytest.mark.slow
def test_under_a_429_storm_the_primary_limit_drops_and_recovers(
        start: Any, storm: tuple[Any, Any]) -> None:
    llmock, server = storm
    env = {"LLMOCK_TEST_KEY": "llmock-key"}
    seen: dict[bool, int] = {}
    for on in (False, True):
        llmock.reset().reply("done", times=None)  # a plain answer, every time
        chaos = server.state.chaos  # reset() put fresh settings in place
        chaos.error_rate_429 = 0.5  # with Retry-After: 1 s
        chaos.latency_ms = 20
        d = start(config([_primary(llmock, 16)], **_adaptive(on)), env=env,
                  name=f"storm-{'on' if on else 'off'}")
        turns = _run_all(d, TURNS, "storm")
        assert all(t["state"] == "completed" for t in turns)
        seen[on] = sum(1 for r in llmock.requests if r.status == 429)
        if not on:
            assert _gate(d, "primary")["limit"] == 16  # fixed: max_in_flight
            d.stop()
            continue
        during = _gate(d, "primary")
        assert during["decreases"] > 0 and during["lowest"] < during["highest"], during
        # The storm is over: successes bring the limit back up to max_in_flight.
        chaos.error_rate_429 = 0.0
        _run_all(d, TURNS, "calm")
        after = _gate(d, "primary")
        assert after["limit"] == 16, after
        assert _metric(d, "turnkeeper_provider_in_flight_limit", "primary") == 16
        assert _metric(d, "turnkeeper_provider_in_flight_decreases_total", "primary") == \
            during["decreases"]
        print(f"\nllmock 50% 429 storm, {TURNS} turns: limit up to {during['highest']}, "
              f"down to {during['lowest']} after {during['decreases']} cuts, back to "
              f"{after['limit']} once calm; "
              f"429s seen by the primary: {seen[True]} adaptive, {seen[False]} fixed")
        d.stop()
    # A 429 that comes whatever the load is not avoided by sending fewer at once: both
    # runs see about one 429 per completed call (the scenario's own odds).
    assert seen[True] > 0 and seen[False] > 0


@pytest.fixture
def quota() -> Iterator[FaultServer]:
    server = FaultServer().start()
    yield server
    server.stop()


@pytest.mark.slow
def test_against_a_concurrency_quota_adaptation_sees_fewer_429s(
        start: Any, quota: FaultServer) -> None:
    quota.script("primary", then=ok("done", delay=0.1)).capacity("primary", 8,
                                                                  retry_after="1")
    provider = {"name": "primary", "kind": "openai", "base_url": quota.base_url("primary"),
                "model": "m", "stream": False, "timeout": 10.0}
    seen: dict[bool, int] = {}
    took: dict[bool, float] = {}
    for on in (False, True):
        quota.clear()
        d = start(config([provider], **_adaptive(on)), name=f"quota-{'on' if on else 'off'}")
        t0 = time.monotonic()
        turns = _run_all(d, TURNS, "quota")
        took[on] = time.monotonic() - t0
        assert all(t["state"] == "completed" for t in turns)
        seen[on] = sum(1 for r in quota.requests("primary") if r.status == 429)
        if on:
            assert _gate(d, "primary")["decreases"] > 0
        d.stop()
    print(f"\nquota of 8 in flight, {TURNS} turns: 429s {seen[True]} adaptive, "
          f"{seen[False]} off; {took[True]:.1f} s adaptive, {took[False]:.1f} s off")
    assert seen[True] < seen[False]


@pytest.mark.slow
def test_max_in_flight_alone_caps_the_calls_at_the_provider(
        start: Any, quota: FaultServer) -> None:
    quota.script("primary", then=ok("done", delay=0.2, tool_steps=1))
    provider = {"name": "primary", "kind": "openai", "base_url": quota.base_url("primary"),
                "model": "m", "stream": False, "timeout": 10.0, "max_in_flight": 4}
    d = start(config([provider], daemon={"max_concurrent_turns": 60}))
    turns = _run_all(d, 50, "capped")
    assert all(t["state"] == "completed" for t in turns)
    assert quota.max_in_flight == 4  # reached, never passed
    gate = _gate(d, "primary")
    assert (gate["limit"], gate["adaptive"], gate["in_flight"]) == (4, False, 0)
    queued = [e for t in turns for e in d.events(t["id"]) if e["type"] == "model.queued"]
    assert queued and all(e["limit"] == 4 for e in queued)
