"""Budgets through the real daemon, against a real model server on 127.0.0.1.

A budget is a ceiling: the step that would cross a token or cost limit is not made (or
is made with its output cap cut to what is left), so a turn whose provider counts as the
daemon's estimate does never ends past its limit. A wall-clock limit counts every second
from the turn's start, waits included. A cost limit over a model with no price is
refused; a usage no provider could have used is never counted.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.fault_server import FaultServer, fail, ok
from tests.integration.harness import Daemon
from tests.integration.test_resilience import config, of_type

# Loop detection out of the way: each step calls echo with new text anyway, and only the
# budget may stop these turns.
LOOSE_LOOPS = {"max_repeats": 100, "warn_repeats": 100, "max_state_revisits": 100,
               "max_no_progress": 100}
PRICED = {"price_input_per_mtok": 3.0, "price_output_per_mtok": 15.0}


@pytest.fixture
def faults() -> Iterator[FaultServer]:
    server = FaultServer().start()
    yield server
    server.stop()


def provider(server: FaultServer, name: str = "primary", **keys: Any) -> dict[str, Any]:
    return {"name": name, "kind": "openai", "base_url": server.base_url(name),
            "model": f"model-{name}", "api_key_env": "", "stream": False, "timeout": 5.0,
            **keys}


def stop_of(turn: dict[str, Any]) -> dict[str, Any]:
    return turn["result"]["stopped_because"]  # type: ignore[no-any-return]


def growing_agent() -> Any:
    """An agent whose conversation grows by some 1,000 tokens a step (a 2,000-character
    echo, called and answered) and that writes as much as it is let (5,000 tokens, cut to
    the cap it is sent): it never answers, only the budget can stop it."""
    return ok("never", tool_steps=1000, pad=2000, output_tokens=5000)


# -- a budget is a ceiling ----------------------------------------------------------------

def test_a_token_budget_is_never_passed_the_crossing_call_is_cut_or_not_made(
        start: Any, faults: FaultServer) -> None:
    faults.script("primary", then=growing_agent())
    d = start(config([provider(faults)], budget={"max_steps": 100},
                     loop_detection=LOOSE_LOOPS))
    turn = d.run("grow", budget={"max_tokens": 20_000})
    stop = stop_of(turn)
    assert (stop["code"], stop["counter"], stop["limit"]) == ("budget.tokens", "tokens",
                                                              20_000)
    spent = turn["usage"]["total_tokens"]
    assert stop["value"] == spent <= 20_000, stop
    assert "does not fit" in stop["message"] and "estimated" in stop["message"]
    seen = faults.requests("primary")
    caps = [r.body["max_tokens"] for r in seen]
    # The provider's own cap until the budget had less room; the last call was cut.
    assert caps[0] == 4096 and caps[-1] < 4096, caps
    # The daemon's note came before the stop, at the latest with the first cut call.
    warnings = of_type(d.events(turn["id"]), "budget.warning")
    assert warnings and "tokens" in warnings[0]["dimensions"]
    first_cut = next(i for i, cap in enumerate(caps) if cap < 4096)
    told = [m for m in seen[first_cut].body["messages"]
            if "Budget note" in str(m.get("content"))]
    assert told, "the call whose cap was cut carried the note"


def test_a_cost_budget_is_never_passed_and_the_output_cap_is_cut_to_the_cost_left(
        start: Any, faults: FaultServer) -> None:
    faults.script("primary", then=growing_agent())
    d = start(config([provider(faults, **PRICED)], budget={"max_steps": 100},
                     loop_detection=LOOSE_LOOPS))
    turn = d.run("grow", budget={"max_cost_usd": 0.22})
    stop = stop_of(turn)
    assert (stop["code"], stop["counter"], stop["limit"]) == ("budget.cost", "cost_usd", 0.22)
    assert stop["value"] == turn["usage"]["cost_usd"] <= 0.22, stop
    caps = [r.body["max_tokens"] for r in faults.requests("primary")]
    assert caps[0] == 4096 and caps[-1] < 4096, caps


# -- the wall clock ------------------------------------------------------------------------

def test_a_long_recovery_wait_ends_at_the_wall_clock_limit_with_its_code(
        start: Any, faults: FaultServer) -> None:
    faults.script("primary", then=fail(503))
    d = start(config([provider(faults)],
                     agent={"api_max_retries": 0, "auto_recovery_cycles": 3,
                            "recovery_schedule": [30.0], "recovery_jitter": 0.0}))
    turn = d.run("hello", budget={"max_wall_seconds": 1.0}, timeout=20)
    stop = stop_of(turn)
    assert (stop["code"], stop["counter"], stop["limit"]) == (
        "budget.wall_seconds", "wall_seconds", 1.0)
    assert stop["value"] >= 0.99, stop
    assert turn["state"] == turn["result"]["status"] == "partial"
    # The 30 s wait began and was cut at the limit: the provider was asked once.
    recovering = of_type(d.events(turn["id"]), "turn.recovering")
    assert [e["wait"] for e in recovering] == [30.0]
    assert faults.count("primary") == 1


def test_a_retry_after_longer_than_the_time_left_stops_with_the_wall_clock_not_providers(
        start: Any, faults: FaultServer) -> None:
    faults.script("primary", then=fail(429, retry_after="20"))
    d = start(config([provider(faults)],
                     agent={"api_max_retries": 3, "auto_recovery_cycles": 0}))
    turn = d.run("hello", budget={"max_wall_seconds": 1.0}, timeout=20)
    stop = stop_of(turn)
    assert (stop["code"], stop["counter"], stop["limit"]) == (
        "budget.wall_seconds", "wall_seconds", 1.0)
    assert stop["value"] >= 0.99, stop
    assert faults.count("primary") == 1


def test_the_policy_wall_clock_applies_and_a_submit_may_not_set_a_negative_one(
        start: Any, faults: FaultServer) -> None:
    faults.script("primary", then=fail(503))
    d = start(config([provider(faults)], budget={"max_wall_seconds": 0.5},
                     agent={"api_max_retries": 0, "recovery_schedule": [30.0]}))
    stop = stop_of(d.run("hello", timeout=20))
    assert (stop["code"], stop["limit"]) == ("budget.wall_seconds", 0.5)
    status, body = d.post("/v1/turns", {"message": "m", "budget": {"max_wall_seconds": -1}})
    assert status == 400 and body["field"] == "budget.max_wall_seconds", body


# -- a cost limit needs prices ---------------------------------------------------------------

def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("TURNKEEPER_")}


def test_a_cost_limit_over_a_model_with_no_price_is_refused_at_check_start_and_reload(
        tmp_path: Path, start: Any, faults: FaultServer) -> None:
    unpriced = config([provider(faults, model="our-proxy-alias")],
                      budget={"max_cost_usd": 2.0})
    path = tmp_path / "unpriced.toml"
    path.write_text(unpriced)
    for argv in (["config", "check", str(path)], ["serve", "--config", str(path)]):
        out = subprocess.run([sys.executable, "-m", "turnkeeper", *argv], env=_env(),
                             capture_output=True, text=True, timeout=30, check=False)
        assert out.returncode == 78, (argv, out.stdout, out.stderr)
        assert "budget.max_cost_usd = 2" in out.stderr, out.stderr
        assert "provider 'primary' (model 'our-proxy-alias') has no price" in out.stderr
    # An explicit price of 0 is a price.
    path.write_text(config([provider(faults, model="our-proxy-alias",
                                     price_input_per_mtok=0.0)],
                           budget={"max_cost_usd": 2.0}))
    out = subprocess.run([sys.executable, "-m", "turnkeeper", "config", "check", str(path)],
                         env=_env(), capture_output=True, text=True, timeout=30, check=False)
    assert out.returncode == 0, out.stderr
    # A reload to an unpriced limit is refused; the running policy stays.
    d: Daemon = start(config([provider(faults, model="our-proxy-alias")]))
    d.set_config(config([provider(faults, model="our-proxy-alias")])
                 + "\n[budget.profiles.quick]\nmax_cost_usd = 1.0\n")
    status, body = d.post("/v1/reload")
    assert status == 422, body
    assert "budget.profiles.quick.max_cost_usd = 1" in body["error"], body
    assert "'our-proxy-alias'" in body["error"]


def test_a_submit_cost_limit_over_an_unpriced_chain_is_a_400_naming_the_provider(
        start: Any, faults: FaultServer) -> None:
    d: Daemon = start(config([provider(faults, "priced", **PRICED),
                              provider(faults, "proxy", model="our-proxy-alias")]))
    status, body = d.post("/v1/turns", {"message": "m", "budget": {"max_cost_usd": 1.0}})
    assert status == 400, body
    assert body["field"] == "budget.max_cost_usd"
    assert "'proxy' (model 'our-proxy-alias')" in body["error"]
    # A model chosen on submit whose chain is priced may have one.
    turn = d.run("m", model="priced", budget={"max_cost_usd": 1.0})
    assert turn["state"] == "completed", turn["result"]
    status, body = d.post("/v1/turns", [{"message": "a", "model": "priced"},
                                        {"message": "b", "model": "proxy",
                                         "budget": {"max_cost_usd": 1.0}}])
    assert status == 400 and body["field"] == "[1].budget.max_cost_usd", body


# -- usage is checked ----------------------------------------------------------------------

@pytest.mark.parametrize("usage", [
    {"prompt_tokens": -1_000_005, "completion_tokens": 5, "total_tokens": -1_000_000},
    {"prompt_tokens": 1e308, "completion_tokens": 5},
    {"prompt_tokens": 12.5, "completion_tokens": 5},
    {"prompt_tokens": "lots", "completion_tokens": 5},
])
def test_a_usage_no_provider_could_have_used_is_a_failure_never_counted(
        start: Any, faults: FaultServer, usage: dict[str, Any]) -> None:
    faults.script("primary", ok("broken counter", usage=usage), then=ok("fine"))
    d = start(config([provider(faults, **PRICED)], agent={"api_max_retries": 2}))
    turn = d.run("hello")
    assert turn["state"] == "completed", turn["result"]
    assert turn["result"]["answer"] == "fine"
    # Only the second answer counts: its prompt and one token of "fine".
    good = faults.requests("primary")[1]
    prompt = sum(len(str(m.get("content") or "")) for m in good.body["messages"]) // 4 + 1
    assert turn["usage"]["input_tokens"] == prompt
    assert turn["usage"]["output_tokens"] == 2
    assert turn["usage"]["cost_usd"] == pytest.approx((prompt * 3.0 + 2 * 15.0) / 1e6)
    events = d.events(turn["id"])
    failed = of_type(events, "model.attempt_failed")
    assert [(e["class"], e["status"]) for e in failed] == [("unknown", None)]
    assert "usage" in failed[0]["error"]
    # Retried on the same provider, as an unknown failure is.
    assert [e["attempt"] for e in of_type(events, "model.request")] == [1, 2]
    assert [e["usage"] for e in of_type(events, "model.response")] == [
        {"input_tokens": prompt, "output_tokens": 2}]
