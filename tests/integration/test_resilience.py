"""Resilience end to end: the real daemon against real model servers.

Every test starts `turnkeeper serve` as a subprocess and points its providers at a real
HTTP server on 127.0.0.1: our own `FaultServer` where a test needs exact control (what
each attempt is answered, and when each arrives: attempts are counted and waits measured
at the server), or llmock, which speaks both wire formats and judges the client from its
journal. The schedules are scaled down by config (base_delay, recovery_schedule...), never
by sleeping.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.integration.fault_server import (
    FaultServer,
    broken_stream,
    fail,
    ok,
    stream_error,
)
from tests.integration.harness import Daemon, script_file, scripted_provider
from tests.integration.tool_server import Reply, ToolServer

# Waits small enough for a test, large enough to measure: the backoff curve is base_delay
# 0.01 s doubling to max_delay 0.04 s; everything else keeps its default unless a test
# says otherwise.
FAST_RETRY = {"base_delay": 0.01, "max_delay": 0.04}


@pytest.fixture
def faults() -> Iterator[FaultServer]:
    server = FaultServer().start()
    yield server
    server.stop()


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_toml_value(x)}" for k, x in v.items()) + " }"
    return repr(v)


def config(providers: list[dict[str, Any]], **sections: dict[str, Any]) -> str:
    """A config file body: `sections` as TOML tables (retry={"base_delay": 0.01}...), then
    the provider chain in order. `retry` defaults to FAST_RETRY."""
    sections.setdefault("retry", FAST_RETRY)
    out: list[str] = []
    for name, keys in sections.items():
        out.append(f"[{name}]")
        out += [f"{k} = {_toml_value(v)}" for k, v in keys.items()]
        out.append("")
    for p in providers:
        out.append("[[providers]]")
        out += [f"{k} = {_toml_value(v)}" for k, v in p.items()]
        out.append("")
    return "\n".join(out)


def chain(server: FaultServer, *names: str, stream: bool = False, timeout: float = 5.0
          ) -> list[dict[str, Any]]:
    """One openai provider per name, each on its own path of the fault server."""
    return [{"name": n, "kind": "openai", "base_url": server.base_url(n),
             "model": f"model-{n}", "stream": stream, "timeout": timeout} for n in names]


def stop_of(turn: dict[str, Any]) -> tuple[str, str | None, Any, Any]:
    sb = turn["result"]["stopped_because"]
    return sb["code"], sb["counter"], sb["value"], sb["limit"]


def of_type(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e["type"] == kind]


def gaps(seen: list[Any]) -> list[float]:
    """Seconds between the end of each request and the arrival of the next, at the server."""
    return [b.started - a.ended for a, b in itertools.pairwise(seen)]


# -- provider_attempts -------------------------------------------------------------------

def test_persistent_503_gets_exactly_four_attempts_on_each_provider(
        start: Any, faults: FaultServer) -> None:
    faults.script("primary", then=fail(503)).script("fallback", then=fail(503))
    d = start(config(chain(faults, "primary", "fallback"),
                     agent={"auto_recovery_cycles": 0}))
    turn = d.run("hello")
    assert (faults.count("primary"), faults.count("fallback")) == (4, 4)
    assert turn["state"] == "partial"
    assert stop_of(turn) == ("providers.exhausted", "recovery_cycles", 0, 0)
    events = d.events(turn["id"])
    retries = of_type(events, "model.retry_scheduled")
    assert [(e["provider"], e["attempt"]) for e in retries] == [
        ("primary", 2), ("primary", 3), ("primary", 4),
        ("fallback", 2), ("fallback", 3), ("fallback", 4)]
    for e in retries:
        assert (e["class"], e["status"], e["retry_after"]) == ("retryable", 503, None)
        assert 0 <= e["delay"] <= FAST_RETRY["max_delay"]
    assert [(e["from"], e["to"], e["reason"]) for e in of_type(events, "model.failover")] == [
        ("primary", "fallback", "attempts_spent")]
    requests = of_type(events, "model.request")
    assert [(e["provider"], e["attempt"]) for e in requests] == [
        ("primary", i) for i in range(1, 5)] + [("fallback", i) for i in range(1, 5)]
    # The waits at the server are never shorter than the scheduled delays (how late a
    # timer fires on a busy machine is the loop's lag, measured by the benchmarks).
    for seen, scheduled in ((faults.requests("primary"), retries[:3]),
                            (faults.requests("fallback"), retries[3:])):
        for gap, e in zip(gaps(seen), scheduled, strict=True):
            assert gap >= e["delay"] - 0.002


def test_api_max_retries_0_fails_over_after_one_attempt(start: Any, faults: FaultServer) -> None:
    faults.script("primary", then=fail(503)).script("fallback", then=ok("from the fallback"))
    d = start(config(chain(faults, "primary", "fallback"), agent={"api_max_retries": 0}))
    turn = d.run("hello")
    assert turn["state"] == "completed"
    assert turn["result"]["answer"] == "from the fallback"
    assert (faults.count("primary"), faults.count("fallback")) == (1, 1)
    events = d.events(turn["id"])
    assert not of_type(events, "model.retry_scheduled")
    assert [(e["from"], e["to"], e["reason"]) for e in of_type(events, "model.failover")] == [
        ("primary", "fallback", "attempts_spent")]
    assert turn["provider"] == "fallback"
    assert turn["counters"]["fallback_hops"] == 1


# -- Retry-After -------------------------------------------------------------------------

def test_retry_after_is_a_floor_on_the_wait_at_the_server(
        start: Any, faults: FaultServer) -> None:
    faults.script("primary", fail(429, retry_after="0.3"), fail(503, retry_after_ms="200"),
                  then=ok("after the wait"))
    d = start(config(chain(faults, "primary")))
    turn = d.run("hello")
    assert turn["state"] == "completed"
    seen = faults.requests("primary")
    assert len(seen) == 3
    first, second = gaps(seen)
    assert first >= 0.3 and second >= 0.2, (first, second)
    # ... and the wait is the Retry-After itself, not a backoff stretched past it.
    retries = of_type(d.events(turn["id"]), "model.retry_scheduled")
    assert [(e["status"], e["retry_after"], e["delay"]) for e in retries] == [
        (429, 0.3, 0.3), (503, 0.2, 0.2)]


def test_retry_after_above_max_retry_after_fails_over_at_once(
        start: Any, faults: FaultServer) -> None:
    # At once: a wait for the asked two hours, or for the hour max_retry_after allows,
    # would not end within the poll's deadline.
    faults.script("primary", then=fail(429, retry_after="7200")).script("fallback", then=ok())
    d = start(config(chain(faults, "primary", "fallback"),
                     retry={**FAST_RETRY, "max_retry_after": 3600.0}))
    turn = d.run("hello", timeout=30)
    assert turn["state"] == "completed"
    assert (faults.count("primary"), faults.count("fallback")) == (1, 1)
    events = d.events(turn["id"])
    (hop,) = of_type(events, "model.failover")
    assert (hop["from"], hop["to"], hop["reason"]) == ("primary", "fallback",
                                                       "retry_after_too_long")
    assert of_type(events, "model.retry_scheduled") == []


# -- the chain ---------------------------------------------------------------------------

def test_a_new_turn_starts_at_the_primary_after_the_last_one_failed_over(
        start: Any, faults: FaultServer) -> None:
    faults.script("primary", *[fail(503)] * 4, then=ok("primary is back"))
    faults.script("fallback", then=ok("from the fallback"))
    d = start(config(chain(faults, "primary", "fallback")))
    first = d.run("one", session="s")
    assert first["result"]["answer"] == "from the fallback"
    assert first["provider"] == "fallback"
    second = d.run("two", session="s")
    assert second["result"]["answer"] == "primary is back"
    assert (faults.count("primary"), faults.count("fallback")) == (5, 1)
    events = d.events(second["id"])
    assert of_type(events, "turn.started")[0]["provider"] == "primary"
    assert [e["provider"] for e in of_type(events, "model.request")] == ["primary"]
    assert not of_type(events, "model.failover")


def test_401_on_every_provider_ends_providers_rejected_with_no_recovery_cycle(
        start: Any, faults: FaultServer) -> None:
    faults.script("primary", then=fail(401, error_type="authentication_error"))
    faults.script("fallback", then=fail(401, error_type="authentication_error"))
    d = start(config(chain(faults, "primary", "fallback"),
                     agent={"recovery_schedule": [0.05]}))
    turn = d.run("hello")
    assert (faults.count("primary"), faults.count("fallback")) == (1, 1)
    assert turn["state"] == "failed"
    assert stop_of(turn) == ("providers.rejected", "fallback_hops", 2, 2)
    events = d.events(turn["id"])
    assert not of_type(events, "turn.recovering")
    assert not of_type(events, "model.retry_scheduled")
    assert of_type(events, "model.failover")[0]["reason"] == "deterministic"
    assert "401" in turn["last_error"]


def test_a_deterministic_failure_is_not_retried_but_a_retryable_one_still_recovers(
        start: Any, faults: FaultServer) -> None:
    faults.script("primary", then=fail(400, error_type="invalid_request_error"))
    faults.script("fallback", then=fail(503))
    d = start(config(chain(faults, "primary", "fallback"),
                     agent={"api_max_retries": 1, "auto_recovery_cycles": 1,
                            "recovery_schedule": [0.05], "recovery_jitter": 0.0}))
    turn = d.run("hello")
    # One attempt on the primary per pass (never retried), two on the fallback.
    assert (faults.count("primary"), faults.count("fallback")) == (2, 4)
    assert stop_of(turn) == ("providers.exhausted", "recovery_cycles", 1, 1)
    assert turn["state"] == "partial"


def test_an_error_event_inside_a_stream_is_judged_by_its_type(
        start: Any, faults: FaultServer) -> None:
    """A 200 stream that carries an error: `overloaded_error` is retried like a 529,
    `invalid_request_error` is deterministic like a 400 (never retried; every provider
    rejecting ends providers.rejected, with no recovery cycle)."""
    faults.script("primary", stream_error("overloaded_error"), then=ok("second try"))
    d = start(config(chain(faults, "primary", stream=True),
                     agent={"recovery_schedule": [0.05]}))
    turn = d.run("hello")
    assert turn["result"]["answer"] == "second try"
    assert faults.count("primary") == 2
    faults.script("primary", then=stream_error("invalid_request_error"))
    turn = d.run("again")
    assert stop_of(turn) == ("providers.rejected", "fallback_hops", 1, 1)
    assert faults.count("primary") == 3
    assert not of_type(d.events(turn["id"]), "turn.recovering")


# -- auto-recovery -----------------------------------------------------------------------

def test_recovery_cycles_run_on_the_schedule_then_providers_exhausted(
        start: Any, faults: FaultServer) -> None:
    faults.script("primary", then=fail(503)).script("fallback", then=fail(502))
    schedule = [0.1, 0.2]
    d = start(config(chain(faults, "primary", "fallback"),
                     agent={"api_max_retries": 0, "auto_recovery_cycles": 3,
                            "recovery_schedule": schedule, "recovery_jitter": 0.5}))
    turn = d.run("hello")
    assert stop_of(turn) == ("providers.exhausted", "recovery_cycles", 3, 3)
    assert turn["state"] == "partial"
    # One attempt per provider per pass: the first pass and three recovery cycles.
    assert (faults.count("primary"), faults.count("fallback")) == (4, 4)
    events = d.events(turn["id"])
    recovering = of_type(events, "turn.recovering")
    assert [(e["cycle"], e["of"]) for e in recovering] == [(1, 3), (2, 3), (3, 3)]
    for e, scheduled in zip(recovering, [0.1, 0.2, 0.2], strict=True):  # the last repeats
        assert scheduled <= e["wait"] <= scheduled * 1.5 + 0.001
        assert e["next_attempt_at"] == pytest.approx(e["ts"] + e["wait"], abs=0.01)
    # Each new pass starts at the primary once the wait is over, measured at the server.
    primary, fallback = faults.requests("primary"), faults.requests("fallback")
    for i, e in enumerate(recovering):
        waited = primary[i + 1].started - fallback[i].ended
        assert waited >= e["wait"] - 0.002, (i, waited, e["wait"])


def test_a_recovering_turn_shows_its_state_and_next_attempt_and_cancel_ends_it(
        start: Any, faults: FaultServer) -> None:
    """The recovery wait is an hour: a turn that finishes at all within the poll's
    deadline was cut short by the cancel."""
    faults.script("primary", then=fail(503))
    d = start(config(chain(faults, "primary"),
                     agent={"api_max_retries": 0, "recovery_schedule": [3600.0],
                            "recovery_jitter": 0.0}))
    submitted = d.submit("hello")
    before = time.time()
    turn = d.wait_state(submitted["id"], "recovering")
    assert turn["counters"]["recovery_cycles"] == 0  # counted when the wait is over
    assert before + 3599 < turn["next_attempt_at"] < time.time() + 3600.5
    status = d.get("/v1/status")[1]
    assert status["turns"]["recovering"] == 1
    (e,) = of_type(_events_until(d, submitted["id"], "turn.recovering"), "turn.recovering")
    assert (e["cycle"], e["of"], e["wait"]) == (1, 5, 3600.0)
    assert d.post(f"/v1/turns/{submitted['id']}/cancel")[0] == 202
    done = d.wait(submitted["id"], timeout=30)
    assert done["state"] == "cancelled"
    assert done["result"]["stopped_because"]["code"] == "cancelled"
    assert faults.count("primary") == 1


def _events_until(d: Daemon, turn_id: str, kind: str, timeout: float = 5.0
                  ) -> list[dict[str, Any]]:
    """The turn's events up to and including the first `kind` (the stream stays open
    while the turn lives, so read it in a thread and stop at `kind`)."""
    out: list[dict[str, Any]] = []
    done = threading.Event()

    def read() -> None:
        for ev in d.client.stream(f"/v1/turns/{turn_id}/events"):
            out.append(ev)
            if ev["type"] == kind or ev["type"] == "turn.finished":
                break
        done.set()

    threading.Thread(target=read, daemon=True).start()
    assert done.wait(timeout), f"no {kind} event in {timeout} s: {out}"
    return out


def test_a_steer_during_a_recovery_wait_starts_a_new_pass_with_the_message(
        start: Any, faults: FaultServer) -> None:
    faults.script("primary", then=fail(503))
    d = start(config(chain(faults, "primary"),
                     agent={"api_max_retries": 0, "recovery_schedule": [3600.0],
                            "auto_recovery_cycles": 2}))
    submitted = d.submit("hello")
    d.wait_state(submitted["id"], "recovering")
    faults.script("primary", then=ok("steered answer"))
    status, _ = d.post(f"/v1/turns/{submitted['id']}/messages",
                       {"kind": "steer", "text": "use the other approach"})
    assert status == 202
    # The wait is an hour: an answer within the poll's deadline means the steer cut it.
    done = d.wait(submitted["id"], timeout=30)
    assert done["state"] == "completed"
    assert done["result"]["answer"] == "steered answer"
    last = faults.requests("primary")[-1]
    assert last.user_texts()[-1] == "use the other approach"
    assert len(of_type(d.events(submitted["id"]), "turn.recovering")) == 1


def test_recovery_waits_do_not_count_toward_max_seconds(start: Any, faults: FaultServer) -> None:
    faults.script("primary", fail(503), then=ok("made it"))
    d = start(config(chain(faults, "primary"),
                     agent={"api_max_retries": 0, "recovery_schedule": [0.6],
                            "recovery_jitter": 0.0}))
    turn = d.run("hello", budget={"max_seconds": 0.4})
    assert turn["state"] == "completed", turn["result"]
    first, second = faults.requests("primary")
    assert second.started - first.ended >= 0.6  # the wall clock passed max_seconds...
    assert turn["usage"]["seconds"] < 0.4  # ...the active time did not


def test_a_request_never_outlives_the_turn_s_remaining_time(
        start: Any, faults: FaultServer) -> None:
    """The provider hangs for an hour and its timeout is an hour: the turn finishing at
    all within the poll's deadline shows the request's timeout was cut to the turn's
    remaining active time, and the turn stops on its time budget, not on a failover or a
    recovery cycle."""
    faults.script("primary", then=ok("too late", delay=3600.0))
    d = start(config(chain(faults, "primary", timeout=3600.0),
                     agent={"recovery_schedule": [0.05]}))
    turn = d.run("hello", timeout=30, budget={"max_seconds": 0.5})
    code, counter, value, limit = stop_of(turn)
    assert (code, counter, limit) == ("budget.seconds", "seconds", 0.5)
    assert value >= 0.5
    assert turn["state"] == "partial"
    assert faults.arrived("primary") == 1  # one attempt, cut short by the budget


# -- circuit breaker ---------------------------------------------------------------------

def test_breaker_opens_after_failure_threshold_and_then_fails_over_with_no_attempt(
        start: Any, faults: FaultServer) -> None:
    faults.script("primary", then=fail(503)).script("fallback", then=ok("fallback answer"))
    body = config(chain(faults, "primary", "fallback"),
                  agent={"api_max_retries": 5},
                  circuit_breaker={"failure_threshold": 3, "cooldown": 30.0})
    d = start(body)
    assert d.get("/v1/status")[1]["breakers"] == {"primary": "closed", "fallback": "closed"}
    first = d.run("one")
    assert first["state"] == "completed"
    assert faults.count("primary") == 3  # the breaker opened at the third failure
    assert of_type(d.events(first["id"]), "model.failover")[0]["reason"] == "breaker_open"
    assert d.get("/v1/status")[1]["breakers"] == {"primary": "open", "fallback": "closed"}
    second = d.run("two")
    assert second["result"]["answer"] == "fallback answer"
    assert faults.count("primary") == 3  # no attempt at all
    events = d.events(second["id"])
    assert [e["provider"] for e in of_type(events, "model.request")] == ["fallback"]
    assert [(e["from"], e["reason"]) for e in of_type(events, "model.failover")] == [
        ("primary", "breaker_open")]

    # A reload that leaves the primary unchanged keeps its breaker open...
    d.set_config(body.replace("[agent]", "[budget]\nmax_steps = 20\n\n[agent]"))
    status, data = d.post("/v1/reload")
    assert status == 200, data
    assert d.get("/v1/status")[1]["breakers"]["primary"] == "open"
    d.run("three")
    assert faults.count("primary") == 3
    # ...and one that changes it (another endpoint) starts it closed.
    d.set_config(body.replace("timeout = 5.0", "timeout = 4.0", 1))
    status, data = d.post("/v1/reload")
    assert status == 200, data
    assert d.get("/v1/status")[1]["breakers"] == {"primary": "closed", "fallback": "closed"}


# -- retry budget ------------------------------------------------------------------------

def test_retry_budget_turns_refused_retries_into_failovers(
        start: Any, faults: FaultServer) -> None:
    """20 turns against a failing primary, min_concurrency 2 and ratio 0.1: at most two
    retries are in flight at once; every other turn fails over at once instead of starting
    its own retry loop. A backoff of 0.3 s holds each admitted retry in flight (not a
    Retry-After: that would be remembered, and every other turn skip the primary)."""
    n = 20
    faults.script("primary", then=fail(503))
    faults.script("fallback", then=ok("fallback answer"))
    d = start(config(chain(faults, "primary", "fallback"),
                     retry={"base_delay": 0.3, "max_delay": 0.3, "jitter": "decorrelated"},
                     retry_budget={"min_concurrency": 2, "ratio": 0.1},
                     circuit_breaker={"failure_threshold": 1000}))
    ids = [d.submit(f"turn {i}")["id"] for i in range(n)]
    turns = [d.wait(i, timeout=30) for i in ids]
    assert all(t["state"] == "completed" for t in turns)
    reasons = [e["reason"] for i in ids for e in of_type(d.events(i), "model.failover")]
    assert len(reasons) == n
    assert reasons.count("retry_budget") >= n - 2
    naive = n * 4  # every turn retrying on its own: 4 attempts each
    # First attempts, plus at most 3 retries for each of the 2 turns the budget admitted.
    assert n <= faults.count("primary") <= n + 2 * 3 < naive
    assert faults.count("fallback") == n


# -- restarts ----------------------------------------------------------------------------

def test_a_broken_stream_retried_on_the_same_provider_is_not_a_restart(
        start: Any, faults: FaultServer) -> None:
    faults.script("primary", broken_stream(2), then=ok("whole answer"))
    d = start(config(chain(faults, "primary", stream=True)))
    turn = d.run("hello")
    assert turn["state"] == "completed"
    assert turn["result"]["answer"] == "whole answer"
    assert faults.count("primary") == 2
    assert turn["counters"]["restarts"] == 0


def test_a_broken_stream_is_a_provider_failure_that_fails_over_not_a_restart(
        start: Any, faults: FaultServer) -> None:
    """A stream that breaks after two chunks, no retries on the provider and no rebuild
    allowed: the fallback answers the step, counted as a provider attempt and a hop, and
    `restarts` (context rebuilds only) stays 0."""
    faults.script("primary", then=broken_stream(2))
    faults.script("fallback", then=ok("fallback answer"))
    providers = chain(faults, "primary", "fallback", stream=True)
    d = start(config(providers, agent={"api_max_retries": 0, "max_restarts": 0}))
    turn = d.run("hello")
    assert turn["state"] == "completed", turn["result"]
    assert turn["result"]["answer"] == "fallback answer"
    assert (faults.count("primary"), faults.count("fallback")) == (1, 1)
    assert turn["counters"]["restarts"] == 0
    assert turn["counters"]["fallback_hops"] == 1
    events = d.events(turn["id"])
    assert [(e["provider"], e["class"]) for e in of_type(events, "model.attempt_failed")] == [
        ("primary", "retryable")]
    assert [(e["from"], e["to"], e["reason"]) for e in of_type(events, "model.failover")] == [
        ("primary", "fallback", "attempts_spent")]


# -- the chain within a turn ---------------------------------------------------------------

def test_fallback_is_turn_scoped_later_steps_stay_on_it_the_next_turn_starts_at_the_primary(
        start: Any, faults: FaultServer) -> None:
    """The primary fails step 1 once; the fallback answers it (a tool call) and step 2
    goes to the fallback, not to the primary again; the next turn starts at the primary.
    `step.started` names the provider each step asks first."""
    faults.script("primary", fail(503), then=ok("from the primary"))
    faults.script("fallback", then=ok("from the fallback", tool_steps=1))
    d = start(config(chain(faults, "primary", "fallback"),
                     agent={"api_max_retries": 0}) + ECHO_TOOL)
    first = d.run("one", session="s")
    assert first["state"] == "completed", first["result"]
    assert first["result"]["answer"] == "from the fallback"
    assert (faults.count("primary"), faults.count("fallback")) == (1, 2)
    events = d.events(first["id"])
    asked = [(e["step"], e["provider"]) for e in of_type(events, "model.request")]
    assert asked == [(1, "primary"), (1, "fallback"), (2, "fallback")]
    assert [(e["step"], e["provider"]) for e in of_type(events, "step.started")] == [
        (1, "primary"), (2, "fallback")]
    assert first["provider"] == "fallback"
    second = d.run("two", session="s")
    assert second["result"]["answer"] == "from the primary"
    assert (faults.count("primary"), faults.count("fallback")) == (2, 2)
    events = d.events(second["id"])
    assert [e["provider"] for e in of_type(events, "step.started")] == ["primary"]
    assert [e["provider"] for e in of_type(events, "model.request")] == ["primary"]


# -- Retry-After remembered ----------------------------------------------------------------

def test_a_provider_s_retry_after_is_remembered_by_later_steps_and_later_turns(
        start: Any, faults: FaultServer) -> None:
    """The primary answers 429 Retry-After: 30 once and would again to every request.
    Step 2 fails on the fallback and wraps round to the primary: skipped (a hop with
    reason retry_after, no request), and so after the recovery wait; the next turn starts
    at the primary: skipped too. The primary is asked once in all."""
    faults.script("primary", then=fail(429, retry_after="30"))
    faults.script("fallback", ok("done", tool_steps=1), fail(503),
                  then=ok("done", tool_steps=1))
    d = start(config(chain(faults, "primary", "fallback"),
                     agent={"api_max_retries": 0, "recovery_schedule": [0.05],
                            "recovery_jitter": 0.0}) + ECHO_TOOL)
    first = d.run("one")
    assert first["state"] == "completed", first["result"]
    assert faults.count("primary") == 1
    events = d.events(first["id"])
    hops = [(e["from"], e["to"], e["reason"]) for e in of_type(events, "model.failover")]
    assert hops == [("primary", "fallback", "attempts_spent"),
                    ("fallback", "primary", "attempts_spent"),
                    ("primary", "fallback", "retry_after")]
    (recovering,) = of_type(events, "turn.recovering")
    assert recovering["waits_for"] == "schedule"
    second = d.run("two")
    assert second["state"] == "completed", second["result"]
    assert faults.count("primary") == 1
    events = d.events(second["id"])
    assert [(e["from"], e["reason"]) for e in of_type(events, "model.failover")] == [
        ("primary", "retry_after")]
    assert {e["provider"] for e in of_type(events, "model.request")} == {"fallback"}
    assert 0 < d.get("/v1/status")[1]["retry_after"]["primary"] <= 30


def test_a_turn_finding_every_provider_inside_its_window_waits_for_it_uncharged(
        start: Any, faults: FaultServer) -> None:
    """The only provider answers one turn 429 Retry-After: 1. A second turn, started
    inside that window, sends nothing until it ends: it waits, parked, charging no
    recovery cycle (there are none to charge), and then completes."""
    faults.script("primary", fail(429, retry_after="1"), then=ok("after the window"))
    d = start(config(chain(faults, "primary"),
                     agent={"auto_recovery_cycles": 0, "recovery_jitter": 0.0}))
    first = d.submit("one")["id"]
    deadline = time.monotonic() + 10
    while "primary" not in d.get("/v1/status")[1]["retry_after"]:
        assert time.monotonic() < deadline, "the 429 was never remembered"
        time.sleep(0.01)
    second = d.submit("two")["id"]
    for turn in (d.wait(first), d.wait(second)):
        assert turn["state"] == "completed", turn["result"]
        assert turn["result"]["answer"] == "after the window"
    seen = faults.requests("primary")
    assert len(seen) == 3
    # Neither turn asked again before the window ended (measured at the server).
    assert all(s.started >= seen[0].ended + 1.0 - 0.005 for s in seen[1:]), gaps(seen)
    (waited,) = of_type(d.events(second), "turn.recovering")
    assert waited["waits_for"] == "retry_after"
    assert "no recovery cycle" in waited["reason"]
    assert not of_type(d.events(second), "model.attempt_failed")


def test_a_recovery_wait_stretched_to_a_breaker_cooldown_says_so(
        start: Any, faults: FaultServer) -> None:
    """The only provider's breaker opens at the first failure; the schedule says 0.05 s
    but no attempt can be made until the cooldown (0.3 s) ends: the wait is stretched to
    it, and its event says what it waits for."""
    faults.script("primary", fail(503), then=ok("back"))
    d = start(config(chain(faults, "primary"),
                     agent={"api_max_retries": 1, "recovery_schedule": [0.05],
                            "recovery_jitter": 0.0},
                     circuit_breaker={"failure_threshold": 1, "cooldown": 0.3}))
    turn = d.run("hello")
    assert turn["state"] == "completed", turn["result"]
    waits = of_type(d.events(turn["id"]), "turn.recovering")
    assert [w["waits_for"] for w in waits] == ["breaker"]
    assert 0.05 < waits[0]["wait"] <= 0.3
    assert "circuit breaker" in waits[0]["reason"]


TOOL_SCRIPT = """
[[scenarios]]
match = "^limited"
[[scenarios.steps]]
tool_calls = [{ name = "limited", arguments = { q = "$step" } }]
[[scenarios.steps]]
tool_calls = [{ name = "limited", arguments = { q = "$step" } }]
[[scenarios.steps]]
tool_calls = [{ name = "limited", arguments = { q = "$step" } }]
[[scenarios.steps]]
tool_calls = [{ name = "limited", arguments = { q = "$step" } }]
[[scenarios.steps]]
reply = "last: $last_tool_result"
"""


def test_a_tool_s_retry_after_keeps_later_calls_from_being_sent(
        start: Any, tmp_path: Any, tool_server: ToolServer) -> None:
    """An idempotent tool answers 429 Retry-After: 30 (one attempt a call): the agent's
    next three calls are not sent; each is told, as a retryable failure, how long the
    tool asked to wait."""
    tool_server.respond("/limited", Reply(429, headers={"Retry-After": "30"}), Reply(200))
    script = script_file(tmp_path / "limited.toml", TOOL_SCRIPT)
    d = start(f"""
[[tools]]
name = "limited"
kind = "http"
url = "{tool_server.url('/limited')}"
description = "a rate-limited lookup"
idempotent = true
max_attempts = 1
parameters = {{ type = "object", properties = {{ q = {{ type = "string" }} }} }}
""" + scripted_provider(script))
    turn = d.run("limited")
    assert turn["state"] == "completed", turn["result"]
    assert len(tool_server.calls("/limited")) == 1
    results = of_type(d.events(turn["id"]), "tool.result")
    assert [(r["ok"], r["class"]) for r in results] == [(False, "retryable")] * 4
    assert "HTTP 429" in results[0]["error"]
    for r in results[1:]:
        assert "not sent" in r["error"] and "more seconds" in r["error"], r["error"]
    assert "not sent" in turn["result"]["answer"]
    assert 0 < d.get("/v1/status")[1]["retry_after"]["tool:limited"] <= 30


def test_a_context_overflow_rebuilds_the_step_and_the_turn_completes(
        start: Any, faults: FaultServer) -> None:
    d = start(config(chain(faults, "primary")))
    assert d.run("earlier question", session="s")["state"] == "completed"
    faults.script("primary", fail(400, error_type="invalid_request_error",
                                  message="This model's maximum context length is 10 tokens"),
                  then=ok("fits now"))
    turn = d.run("next question", session="s")
    assert turn["state"] == "completed", turn["result"]
    assert turn["result"]["answer"] == "fits now"
    assert turn["counters"]["restarts"] == 1
    overflowed, rebuilt = faults.requests("primary")[-2:]
    assert len(rebuilt.body["messages"]) < len(overflowed.body["messages"])


# -- dead letters ------------------------------------------------------------------------

def test_dead_letters_are_listed_and_replayed_with_the_same_session_and_message(
        start: Any, faults: FaultServer) -> None:
    faults.script("primary", then=fail(503))
    d = start(config(chain(faults, "primary"), agent={"auto_recovery_cycles": 0}))
    exhausted = d.run("needs the model", session="dl")
    assert stop_of(exhausted)[0] == "providers.exhausted"
    faults.script("primary", then=fail(401))
    rejected = d.run("also needs it", session="dl2")
    assert stop_of(rejected)[0] == "providers.rejected"
    completed_turn = None
    faults.script("primary", then=ok("fine"))
    completed_turn = d.run("this one is fine")

    status, data = d.get("/v1/dead-letters")
    assert status == 200
    letters = {x["id"]: x for x in data["dead_letters"]}
    assert set(letters) == {exhausted["id"], rejected["id"]}
    assert letters[exhausted["id"]]["message"] == "needs the model"
    assert letters[exhausted["id"]]["stopped_because"]["code"] == "providers.exhausted"
    assert "503" in letters[exhausted["id"]]["last_error"]
    assert "401" in letters[rejected["id"]]["last_error"]

    cli = [sys.executable, "-m", "turnkeeper", "--socket", str(d.socket)]
    out = subprocess.run([*cli, "dead-letters"], capture_output=True, text=True, timeout=30,
                         check=False)
    assert out.returncode == 0, out.stderr
    assert exhausted["id"] in out.stdout and "providers.exhausted" in out.stdout
    assert rejected["id"] in out.stdout and "providers.rejected" in out.stdout

    status, data = d.post(f"/v1/dead-letters/{exhausted['id']}/replay")
    assert status == 202, data
    replay = data["turn"]
    assert (replay["session"], replay["message"]) == ("dl", "needs the model")
    assert replay["replay_of"] == exhausted["id"]
    assert d.wait(replay["id"])["result"]["answer"] == "fine"
    # The dead letter itself is not history of its replay: the message is sent once.
    sent = [m for m in faults.requests("primary")[-1].body["messages"]
            if m["role"] == "user" and m["content"] == "needs the model"]
    assert len(sent) == 1
    out = subprocess.run([*cli, "dead-letters", "replay", rejected["id"]],
                         capture_output=True, text=True, timeout=30, check=False)
    assert out.returncode == 0, out.stderr
    replay2 = d.wait(out.stdout.strip())
    assert (replay2["session"], replay2["state"]) == ("dl2", "completed")
    # A replay resumes the dead letter itself, which leaves the list.
    assert replay["id"] == exhausted["id"] and replay2["id"] == rejected["id"]
    assert d.get("/v1/dead-letters")[1]["dead_letters"] == []
    assert d.post(f"/v1/dead-letters/{completed_turn['id']}/replay")[0] == 409
    assert d.post("/v1/dead-letters/t_nope/replay")[0] == 404


# -- llmock: both wire formats through the daemon ----------------------------------------

def _llmock_provider(llmock: Any, kind: str, *, stream: bool, timeout: float = 5.0
                     ) -> dict[str, Any]:
    return {"name": kind, "kind": kind, "base_url": llmock.base_url(kind),
            "model": f"{kind}-test-model", "api_key_env": "LLMOCK_TEST_KEY",
            "stream": stream, "timeout": timeout}


ECHO_TOOL = """
[[tools]]
name = "echo"
kind = "echo"
description = "Echo the arguments back"
parameters = { type = "object", properties = { text = { type = "string" } } }
idempotent = true
"""


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
@pytest.mark.parametrize("kind", ["openai", "anthropic"])
def test_a_tool_calling_conversation_completes_through_the_daemon(
        start: Any, llmock: Any, kind: str, stream: bool) -> None:
    llmock.call_tool("echo", {"text": "ping"}).reply("the echo said ping")
    d = start(config([_llmock_provider(llmock, kind, stream=stream)]) + ECHO_TOOL,
              env={"LLMOCK_TEST_KEY": "llmock-key"})
    turn = d.run("call the echo tool")
    assert turn["state"] == "completed", turn["result"]
    assert turn["result"]["answer"] == "the echo said ping"
    assert turn["counters"]["steps"] == 2
    assert turn["usage"]["input_tokens"] > 0 and turn["usage"]["output_tokens"] > 0
    events = d.events(turn["id"])
    (result,) = of_type(events, "tool.result")
    assert result["ok"] is True and json.loads(result["content"]) == {"text": "ping"}
    first, second = llmock.requests
    assert (first.stream, second.stream) == (stream, stream)
    assert "ping" in json.dumps(second.body)  # the tool result went back to the model
    llmock.assert_resilient(strict=True)


# -- llmock: faults through the daemon, judged by llmock's verdict -------------------------

VERDICT_AGENT = {"auto_recovery_cycles": 1, "recovery_schedule": [0.1]}
# One provider per daemon: every attempt of a turn lands on the same llmock route, so
# llmock sees (and judges) the whole retry sequence of each call.


@pytest.fixture(scope="module")
def verdict_daemons(llmock_server: Any, tmp_path_factory: pytest.TempPathFactory
                    ) -> Iterator[dict[str, Daemon]]:
    from llmock.pytest_plugin import LLMock

    handle = LLMock(llmock_server)
    tmp = tmp_path_factory.mktemp("verdict")
    daemons: dict[str, Daemon] = {}
    try:
        for kind in ("openai", "anthropic"):
            body = config([_llmock_provider(handle, kind, stream=True, timeout=0.3)],
                          agent=VERDICT_AGENT,
                          circuit_breaker={"failure_threshold": 1000})
            daemons[kind] = Daemon(tmp, body, env={"LLMOCK_TEST_KEY": "llmock-key"},
                                   name=kind).start()
        yield daemons
    finally:
        for d in daemons.values():
            d.kill()


SCENARIOS: dict[str, tuple[Any, str, int]] = {
    # name: (fault, expected stop code, expected attempts)
    "429_retry_after": (lambda m: m.rate_limit(times=2, retry_after=0.2), "completed", 3),
    "503_burst": (lambda m: m.fail(503, times=3, retry_after=0.05), "completed", 4),
    "outage": (lambda m: m.fail(503, times=None, retry_after=0.05), "providers.exhausted", 8),
    "400": (lambda m: m.fail(400, times=None), "providers.rejected", 1),
    "401": (lambda m: m.fail(401, times=None), "providers.rejected", 1),
    "422": (lambda m: m.fail(422, times=None), "providers.rejected", 1),
    "disconnect": (lambda m: m.disconnect(after_chunks=2), "completed", 2),
    "truncate": (lambda m: m.truncate(after_chunks=2), "completed", 2),
    # Paced like a model generating tokens, so that llmock sees the client hang up at the
    # bad chunk (a stream sent in one burst is over on its side before the client reads).
    "corrupt_chunk": (lambda m: m.pace(20).corrupt(after_chunks=2), "completed", 2),
    "stall": (lambda m: m.stall(after_chunks=2, seconds=2.0), "completed", 2),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("kind", ["openai", "anthropic"])
def test_llmock_verdict_has_no_fail_and_no_warn(
        verdict_daemons: dict[str, Daemon], llmock: Any, kind: str, scenario: str) -> None:
    fault, code, attempts = SCENARIOS[scenario]
    d = verdict_daemons[kind]
    llmock.tool_mode("off")  # a plain answer: the built-in tools are offered, not wanted
    fault(llmock)
    turn = d.run(f"{scenario} please", timeout=20)
    assert turn["result"]["stopped_because"]["code"] == code, turn["result"]
    assert len(llmock.requests) == attempts, [r.to_dict() for r in llmock.requests]
    verdict = llmock.verdict()
    assert verdict.faults >= 1  # the fault was injected and seen by the daemon
    assert not verdict.findings, verdict.render()
