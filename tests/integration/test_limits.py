"""Limits from measured runs: budget profiles, enforcement modes, and the
limits report, against the real daemon."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.integration.harness import ECHO_TOOL, script_file, scripted_provider
from turnkeeper.policy.limits import percentile

# "walk": a new observation every step (no loop), forever. "loop": the same call forever.
# "nK": K steps of 100 + 10 tokens each, then an answer of 50 + 5 tokens.
SCRIPT = """
[[scenarios]]
match = "walk"
[[scenarios.steps]]
tool_calls = [{ name = "echo", arguments = { text = "step $step" } }]

[[scenarios]]
match = "loop"
[[scenarios.steps]]
tool_calls = [{ name = "echo", arguments = { text = "same" } }]
"""
for k in range(1, 6):
    SCRIPT += f'\n[[scenarios]]\nmatch = "n{k}"\n'
    for _ in range(k - 1):
        SCRIPT += ('[[scenarios.steps]]\nusage = { input_tokens = 100, output_tokens = 10 }\n'
                   'tool_calls = [{ name = "echo", arguments = { text = "s$step" } }]\n')
    SCRIPT += ('[[scenarios.steps]]\nusage = { input_tokens = 50, output_tokens = 5 }\n'
               'reply = "done"\n')


def config(tmp_path: Path, extra: str = "") -> str:
    script = script_file(tmp_path / "script.toml", SCRIPT)
    return scripted_provider(script) + ECHO_TOOL + extra


PROFILES = """
[budget]
max_steps = 40

[budget.profiles.quick]
max_steps = 3

[budget.profiles.deep]
max_steps = 6

[budget.profiles.watch]
max_steps = 6
[budget.profiles.watch.loop_detection]
mode = "observe"

[budget.profiles.tell]
max_steps = 6
[budget.profiles.tell.loop_detection]
mode = "warn"
"""


def stop(turn: dict[str, Any]) -> tuple[str, Any, Any, Any]:
    sb = turn["result"]["stopped_because"]
    return sb["code"], sb["counter"], sb["value"], sb["limit"]


def test_two_profiles_stop_the_same_conversation_at_different_steps(start: Any,
                                                                    tmp_path: Path) -> None:
    d = start(config(tmp_path, PROFILES))
    quick = d.run("walk on", profile="quick")
    deep = d.run("walk on", profile="deep")
    assert stop(quick) == ("budget.steps", "steps", 3, 3)
    assert stop(deep) == ("budget.steps", "steps", 6, 6)
    assert quick["profile"] == "quick" and deep["profile"] == "deep"
    assert quick["limits"]["max_steps"] == 3
    status, data = d.post("/v1/turns", {"message": "walk", "profile": "nope"})
    assert status == 400 and data["field"] == "profile" and "nope" in data["error"]


def test_observe_mode_runs_a_loop_to_its_step_budget_and_records_what_would_have_stopped(
        start: Any, tmp_path: Path) -> None:
    d = start(config(tmp_path, PROFILES))
    enforced = d.run("loop here", profile="deep")
    assert stop(enforced) == ("loop.repeated_action", "repeats", 3, 3)
    assert enforced["counters"]["steps"] == 3
    watched = d.run("loop here", profile="watch")
    assert stop(watched) == ("budget.steps", "steps", 6, 6)
    (would,) = [w for w in watched["would_have_stopped"]
                if w["code"] == "loop.repeated_action"]
    assert (would["counter"], would["value"], would["limit"], would["step"], would["mode"]) == (
        "repeats", 3, 3, enforced["counters"]["steps"], "observe")
    events = d.events(watched["id"])
    assert any(e["type"] == "guard.would_stop" and e["code"] == "loop.repeated_action"
               for e in events)
    # observe: the agent is told nothing about loops.
    requests = [e for e in events if e["type"] == "model.request"]
    assert requests and all("loop" not in json.dumps(e).lower() for e in requests)


def test_warn_mode_tells_the_agent_and_goes_on(start: Any, tmp_path: Path) -> None:
    d = start(config(tmp_path, PROFILES))
    told = d.run("loop here", profile="tell")
    assert stop(told) == ("budget.steps", "steps", 6, 6)
    codes = [w["code"] for w in told["would_have_stopped"]]
    # Each rule is recorded once, at the step where enforce would have stopped the turn.
    assert codes[0] == "loop.repeated_action" and len(codes) == len(set(codes))
    assert set(codes) <= {"loop.repeated_action", "loop.state_cycle", "loop.no_progress"}
    assert all(w["mode"] == "warn" for w in told["would_have_stopped"])


def test_a_budget_in_observe_mode_never_stops_but_the_step_backstop_does(
        start: Any, tmp_path: Path) -> None:
    d = start(config(tmp_path, """
[budget]
max_steps = 5
max_tokens = 300
mode = "observe"
"""))
    turn = d.run("n5")  # 4 steps of 110 tokens: passes 300 at step 3
    assert turn["state"] == "completed", turn["result"]
    assert turn["usage"]["total_tokens"] == 4 * 110 + 55
    (would,) = turn["would_have_stopped"]
    assert (would["code"], would["counter"], would["limit"]) == ("budget.tokens", "tokens", 300)
    assert would["value"] == 330 and would["step"] == 3
    looping = d.run("walk forever")
    assert stop(looping) == ("budget.steps", "steps", 5, 5)


def test_switching_the_mode_by_reload_changes_new_turns_only(start: Any,
                                                             tmp_path: Path) -> None:
    observe = config(tmp_path, '[loop_detection]\nmode = "observe"\n[budget]\nmax_steps = 5\n')
    d = start(observe)
    before = d.run("loop here")
    assert stop(before)[0] == "budget.steps"
    d.set_config(config(tmp_path, "[budget]\nmax_steps = 5\n"))
    status, data = d.post("/v1/reload")
    assert status == 200, data
    after = d.run("loop here")
    assert stop(after) == ("loop.repeated_action", "repeats", 3, 3)
    assert after["policy_version"] > before["policy_version"]
    # The finished turn keeps what it ran under.
    again = d.get(f"/v1/turns/{before['id']}")[1]["turn"]
    assert stop(again)[0] == "budget.steps"


def test_the_limits_report_gives_exact_percentiles_and_suggestions(start: Any,
                                                                   tmp_path: Path) -> None:
    d = start(config(tmp_path, PROFILES))
    steps = [1, 2, 2, 3, 3, 3, 4, 5]
    for k in steps:
        assert d.run(f"n{k}", profile="deep")["state"] == "completed"
    d.run("walk far", profile="quick")  # stopped by budget.steps: partial
    status, report = d.get("/v1/limits/report?factor=2")
    assert status == 200, report
    profiles = {p["profile"]: p for p in report["profiles"]}
    deep = profiles["deep"]
    assert (deep["completed_turns"], deep["finished_turns"]) == (8, 8)
    tokens = [110 * (k - 1) + 55 for k in steps]
    dims = deep["dimensions"]
    assert dims["steps"]["p50"] == percentile([float(s) for s in steps], 50) == 3
    assert dims["steps"]["p95"] == percentile([float(s) for s in steps], 95)
    assert dims["steps"]["max"] == 5 and dims["steps"]["limit"] == 6
    assert dims["steps"]["suggested"] == 10  # 2 x p95 (4.65) = 9.3 -> 10
    assert dims["tokens"]["p95"] == percentile([float(t) for t in tokens], 95)
    assert dims["tokens"]["suggested"] == 1000
    quick = profiles["quick"]
    assert (quick["completed_turns"], quick["finished_turns"]) == (0, 1)
    assert "[budget.profiles.deep]\nmax_tokens = 1000\n" in report["toml"]
    assert "max_steps = 10" in report["toml"]
    out = subprocess.run([sys.executable, "-m", "turnkeeper", "--socket", str(d.socket),
                          "limits", "report", "--profile", "deep", "--factor", "2",
                          "--since", "1h"], capture_output=True, text=True, timeout=30,
                         check=False)
    assert out.returncode == 0, out.stderr
    assert "profile deep: 8 completed of 8 finished" in out.stdout
    assert "[budget.profiles.deep]" in out.stdout
