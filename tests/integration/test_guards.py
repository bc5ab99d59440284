"""Turn guards, end to end: every exit of a turn, driven through the real daemon.

One daemon (module scope) runs a scripted model whose scenarios are picked by the turn's
message, next to a real HTTP tool server on 127.0.0.1 (`tool_server.py`); each test uses
its own scenario and its own tools, and sets its limits through the submit's budget
overrides. Tests that need another policy (`clarify.timeout`) start their own daemon.
Every stop is checked by code, counter, value and limit, as the result names them.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.harness import ECHO_TOOL, Daemon, scripted_provider
from tests.integration.tool_server import Reply, ToolServer
from turnkeeper.policy.effects import effect_key

NOTE = "[turnkeeper note] "

# The model. `$step` in arguments keeps actions of different steps apart where a test is
# not about repeats.
SCRIPT = """
# -- budgets -----------------------------------------------------------------------
[[scenarios]]
match = "^tokens"
[[scenarios.steps]]
usage = { input_tokens = 400, output_tokens = 100 }
[[scenarios.steps.tool_calls]]
name = "echo"
arguments = { step = "$step", max_output_tokens = "$max_output_tokens" }

[[scenarios]]
match = "^steps"
[[scenarios.steps]]
reply = "saw: $last_user"
tool_calls = [{ name = "echo", arguments = { step = "$step" } }]

[[scenarios]]
match = "^five steps then answer"
[[scenarios.steps]]
tool_calls = [{ name = "echo", arguments = { step = "$step" } }]
[[scenarios.steps]]
tool_calls = [{ name = "echo", arguments = { step = "$step" } }]
[[scenarios.steps]]
tool_calls = [{ name = "echo", arguments = { step = "$step" } }]
[[scenarios.steps]]
tool_calls = [{ name = "echo", arguments = { step = "$step" } }]
[[scenarios.steps]]
tool_calls = [{ name = "echo", arguments = { step = "$step" } }]
[[scenarios.steps]]
reply = "done after five tool steps"

[[scenarios]]
match = "^cost"
[[scenarios.steps]]
usage = { input_tokens = 1000, output_tokens = 500 }
tool_calls = [{ name = "echo", arguments = { step = "$step" } }]

[[scenarios]]
match = "^slow model"
[[scenarios.steps]]
delay = 3600.0
reply = "too late"

[[scenarios]]
match = "^slow tool"
[[scenarios.steps]]
tool_calls = [{ name = "slow", arguments = { q = "x" } }]
[[scenarios.steps]]
reply = "never"

[[scenarios]]
match = "^deadline"
[[scenarios.steps]]
delay = 0.05
tool_calls = [{ name = "echo", arguments = { step = "$step" } }]

# -- loops ---------------------------------------------------------------------------
[[scenarios]]
match = "^repeat"
[[scenarios.steps]]
reply = "saw: $last_user"
tool_calls = [{ name = "echo", arguments = '{"a":1,"b":2}' }]
[[scenarios.steps]]
reply = "saw: $last_user"
tool_calls = [{ name = "echo", arguments = '{"b":2,"a":1}' }]
[[scenarios.steps]]
reply = "saw: $last_user"
tool_calls = [{ name = "echo", arguments = '{"a": 1, "b": 2}' }]

[[scenarios]]
match = "^cycle"
[[scenarios.steps]]
tool_calls = [{ name = "state", arguments = { open = "inbox" } }]
[[scenarios.steps]]
tool_calls = [{ name = "state", arguments = { to = "B" } }]
[[scenarios.steps]]
tool_calls = [{ name = "state", arguments = { to = "A" } }]
[[scenarios.steps]]
tool_calls = [{ name = "state", arguments = { to = "B" } }]
[[scenarios.steps]]
tool_calls = [{ name = "state", arguments = { to = "A" } }]

[[scenarios]]
match = "^nothing found"
[[scenarios.steps]]
tool_calls = [{ name = "fact1", arguments = { q = "query $step" } }]

[[scenarios]]
match = "^no progress"
[[scenarios.steps]]
tool_calls = [{ name = "fact1", arguments = { step = "$step" } },
              { name = "fact2", arguments = { step = "$step" } },
              { name = "fact3", arguments = { step = "$step" } }]
[[scenarios.steps]]
tool_calls = [{ name = "fact1", arguments = { step = "$step" } }]
[[scenarios.steps]]
tool_calls = [{ name = "fact2", arguments = { step = "$step" } }]
[[scenarios.steps]]
tool_calls = [{ name = "fact3", arguments = { step = "$step" } }]
[[scenarios.steps]]
tool_calls = [{ name = "fact1", arguments = { step = "$step" } },
              { name = "fact2", arguments = { step = "$step" } }]
[[scenarios.steps]]
tool_calls = [{ name = "fact1", arguments = { step = "$step" } },
              { name = "fact3", arguments = { step = "$step" } }]
[[scenarios.steps]]
reply = "never reached"

[[scenarios]]
match = "^progress"
[[scenarios.steps]]
tool_calls = [{ name = "echo", arguments = { found = "fact $step" } }]
[[scenarios.steps]]
tool_calls = [{ name = "echo", arguments = { found = "fact $step" } }]
[[scenarios.steps]]
tool_calls = [{ name = "echo", arguments = { found = "fact $step" } }]
[[scenarios.steps]]
tool_calls = [{ name = "echo", arguments = { found = "fact $step" } }]
[[scenarios.steps]]
tool_calls = [{ name = "echo", arguments = { found = "fact $step" } }]
[[scenarios.steps]]
tool_calls = [{ name = "echo", arguments = { found = "fact $step" } }]
[[scenarios.steps]]
tool_calls = [{ name = "echo", arguments = { found = "fact $step" } }]
[[scenarios.steps]]
tool_calls = [{ name = "echo", arguments = { found = "fact $step" } }]
[[scenarios.steps]]
tool_calls = [{ name = "echo", arguments = { found = "fact $step" } }]
[[scenarios.steps]]
reply = "found nine facts"

[[scenarios]]
match = "^poll"
[[scenarios.steps]]
tool_calls = [{ name = "poll", arguments = { job = "j1" } }]
[[scenarios.steps]]
tool_calls = [{ name = "poll", arguments = { job = "j1" } }]
[[scenarios.steps]]
tool_calls = [{ name = "poll", arguments = { job = "j1" } }]
[[scenarios.steps]]
tool_calls = [{ name = "poll", arguments = { job = "j1" } }]
[[scenarios.steps]]
tool_calls = [{ name = "poll", arguments = { job = "j1" } }]
[[scenarios.steps]]
tool_calls = [{ name = "poll", arguments = { job = "j1" } }]
[[scenarios.steps]]
reply = "job j1: $last_tool_result"

# -- failures ------------------------------------------------------------------------
[[scenarios]]
match = "^bad request"
[[scenarios.steps]]
reply = "saw: $last_tool_result"
tool_calls = [{ name = "bad", arguments = { id = 7 } }]

[[scenarios]]
match = "^service down"
[[scenarios.steps]]
tool_calls = [{ name = "down", arguments = { id = 7 } }]

[[scenarios]]
match = "^weird"
[[scenarios.steps]]
tool_calls = [{ name = "weird", arguments = { id = 7 } }]

[[scenarios]]
match = "^rate limited"
[[scenarios.steps]]
tool_calls = [{ name = "limited", arguments = { id = 7 } }]
[[scenarios.steps]]
tool_calls = [{ name = "limited", arguments = { id = 7 } }]
[[scenarios.steps]]
tool_calls = [{ name = "limited", arguments = { id = 7 } }]
[[scenarios.steps]]
reply = "got through: $last_tool_result"

[[scenarios]]
match = "^idempotent"
[[scenarios.steps]]
tool_calls = [{ name = "lookup", arguments = { id = 7 } }]
[[scenarios.steps]]
reply = "looked up: $last_tool_result"

[[scenarios]]
match = "^not idempotent"
[[scenarios.steps]]
tool_calls = [{ name = "create_ticket", arguments = { title = "printer on fire" } }]
[[scenarios.steps]]
reply = "saw: $last_tool_result"

[[scenarios]]
match = "^schema"
[[scenarios.steps]]
tool_calls = [{ name = "create_ticket", arguments = { title = 5 } }]

# -- exits and messages --------------------------------------------------------------
[[scenarios]]
match = "^blocked"
[[scenarios.steps]]
tool_calls = [{ name = "echo", arguments = { probe = "door" } }]
[[scenarios.steps]]
[[scenarios.steps.tool_calls]]
name = "report_blocked"
[scenarios.steps.tool_calls.arguments]
reason = "the door is locked"
tried = ["the front door", "the back door"]
found = ["a note: back at 5"]

[[scenarios]]
match = "^overflow"
[[scenarios.steps]]
tool_calls = [{ name = "echo", arguments = { step = "$step" } }]
[[scenarios.steps]]
tool_calls = [{ name = "echo", arguments = { step = "$step" } }]
[[scenarios.steps]]
fail = [{ context_overflow = true, forever = true }]
reply = "never"

[[scenarios]]
match = "^clarify"
[[scenarios.steps]]
tool_calls = [{ name = "clarify", arguments = { question = "Which city?" } }]
[[scenarios.steps]]
reply = "Going to $last_tool_result"

[[scenarios]]
match = "^ten steers"
match_last_user = "^stop now$"
[[scenarios.steps]]
fail = [{ context_overflow = true }]
reply = "stopping at step $step"

[[scenarios]]
match = "^ten steers"
[[scenarios.steps]]
delay = 0.02
tool_calls = [{ name = "echo", arguments = { heard = "$last_user", step = "$step" } }]
[[scenarios.steps]]
delay = 0.02
tool_calls = [{ name = "echo", arguments = { heard = "$last_user", step = "$step" } }]
[[scenarios.steps]]
delay = 0.02
fail = [{ context_overflow = true }]
tool_calls = [{ name = "echo", arguments = { heard = "$last_user", step = "$step" } }]
[[scenarios.steps]]
delay = 0.02
tool_calls = [{ name = "echo", arguments = { heard = "$last_user", step = "$step" } }]

[[scenarios]]
match = "^unread steer"
[[scenarios.steps]]
delay = 1.0
reply = "first: $last_user"
[[scenarios.steps]]
reply = "second: $last_user"

[[scenarios]]
match = "^give up"
[[scenarios.steps]]
tool_calls = [{ name = "gated", arguments = { q = "look around" } },
              { name = "report_blocked", arguments = { reason = "no idea" } }]
[[scenarios.steps]]
reply = "with your hint: $last_user"

[[scenarios]]
match = "^redirect"
[[scenarios.steps]]
delay = 20.0
delay_attempts = 1
reply = "answer: $last_user"

[[scenarios]]
[[scenarios.steps]]
reply = "plain answer to $message"
"""


def http_tool(server: ToolServer, name: str, *, idempotent: bool = False,
              polling: bool = False, timeout: float = 5.0, parameters: str = "") -> str:
    return textwrap.dedent(f"""
        [[tools]]
        name = "{name}"
        kind = "http"
        url = "{server.url('/' + name)}"
        idempotent = {str(idempotent).lower()}
        polling = {str(polling).lower()}
        timeout = {timeout}
        {parameters}
        """)


def guards_config(tmp: Path, server: ToolServer, script: str = SCRIPT,
                  clarify_timeout: float = 30.0) -> str:
    script_path = tmp / "script.toml"
    script_path.write_text(script)
    tools = "".join([
        http_tool(server, "slow", timeout=3600.0),
        http_tool(server, "state"),
        http_tool(server, "fact1"), http_tool(server, "fact2"), http_tool(server, "fact3"),
        http_tool(server, "poll", polling=True),
        http_tool(server, "bad"), http_tool(server, "down"),
        http_tool(server, "weird", parameters="follow_redirects = true"),
        http_tool(server, "limited"),
        http_tool(server, "lookup", idempotent=True),
        http_tool(server, "gated"),
        http_tool(server, "create_ticket", parameters=(
            'parameters = { type = "object", properties = { title = { type = "string" } },'
            ' required = ["title"] }')),
    ])
    return f"""
[agent]
max_restarts = 1
api_max_retries = 3
recovery_schedule = [0.05]
auto_recovery_cycles = 1

[retry]
base_delay = 0.01
max_delay = 0.05

[circuit_breaker]
failure_threshold = 100
cooldown = 0.1

[budget]
max_steps = 8

[clarify]
timeout = {clarify_timeout}

""" + scripted_provider(script_path, name="model", extra=(
        "max_output_tokens = 500\nprice_input_per_mtok = 3.0\n"
        "price_output_per_mtok = 15.0\n")) + ECHO_TOOL + tools


@pytest.fixture(scope="module")
def server(module_tool_server: ToolServer) -> ToolServer:
    return module_tool_server


@pytest.fixture(scope="module")
def d(tmp_path_factory: pytest.TempPathFactory, server: ToolServer) -> Iterator[Daemon]:
    tmp = tmp_path_factory.mktemp("guards")
    daemon = Daemon(tmp, guards_config(tmp, server), name="g").start()
    try:
        yield daemon
    finally:
        daemon.kill()


# -- helpers ---------------------------------------------------------------------------

def stopped(turn: dict[str, Any], code: str, counter: str | None, value: Any,
            limit: Any, status: str = "partial") -> dict[str, Any]:
    """The turn ended with this stop, naming this counter, value and limit."""
    result = turn["result"]
    sb = result["stopped_because"]
    assert (sb["code"], sb["counter"]) == (code, counter), result
    if value is not None:
        assert sb["value"] == pytest.approx(value), result
    assert sb["limit"] == pytest.approx(limit) if limit is not None else sb["limit"] is None
    assert result["status"] == status == turn["state"], result
    return result  # type: ignore[no-any-return]


def of_type(events: list[dict[str, Any]], type_: str, **match: Any) -> list[dict[str, Any]]:
    return [e for e in events if e["type"] == type_
            and all(e.get(k) == v for k, v in match.items())]


def logs(d: Daemon, turn_id: str, event: str) -> list[dict[str, Any]]:
    return [r for r in d.log_records() if r.get("turn") == turn_id and r.get("event") == event]


def cli(d: Daemon, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "turnkeeper", "--socket", str(d.socket),
                           *args], capture_output=True, text=True, timeout=30, check=False)


def steer(d: Daemon, turn_id: str, text: str, *, redirect: bool = False) -> None:
    status, data = d.post(f"/v1/turns/{turn_id}/messages",
                          {"kind": "steer", "text": text, "redirect": redirect})
    assert status == 202, data


# -- budgets ---------------------------------------------------------------------------

def test_token_budget_stops_before_a_call_that_cannot_fit_and_cuts_the_output_cap(
        d: Daemon) -> None:
    turn = d.run("tokens", budget={"max_tokens": 1200})
    # 500 tokens a step. Before step 2, 700 are left: its request (estimated at some 600
    # input tokens, the tool specs included) is sent with the cap cut to the rest. Before
    # step 3, 200 are left: not enough for the request, so it is not made.
    result = stopped(turn, "budget.tokens", "tokens", 1000, 1200)
    assert turn["counters"]["steps"] == 2
    assert "does not fit in the 200 left" in result["stopped_because"]["message"]
    asked = [int(e["arguments"]["max_output_tokens"])
             for e in of_type(d.events(turn["id"]), "tool.call")]
    # The provider's own cap (500), then cut so the estimated input and it fit in 700.
    assert asked[0] == 500 and 1 <= asked[1] < 500, asked
    finished = logs(d, turn["id"], "turn.finished")
    assert finished and finished[0]["code"] == "budget.tokens"
    assert (finished[0]["value"], finished[0]["limit"], finished[0]["tokens"]) == (
        1000, 1200, 1000)


def test_step_budget_stops_and_the_soft_note_reaches_the_model(d: Daemon) -> None:
    turn = d.run("steps", budget={"max_steps": 5})
    result = stopped(turn, "budget.steps", "steps", 5, 5)
    # Each step answers "saw: <latest user message>"; at 4 of 5 steps (soft_limit 0.8)
    # the daemon's note is that message, so the model of step 5 read it.
    assert result["answer"].startswith("saw: " + NOTE + "Budget note: 1 of 5 steps left")
    assert "report_blocked" in result["answer"]
    assert len(result["partial"]) == 5
    events = d.events(turn["id"])
    warnings = of_type(events, "budget.warning")
    assert len(warnings) == 1  # once per dimension per turn
    assert warnings[0]["dimensions"] == ["steps"] and warnings[0]["steps"] == 4
    line = logs(d, turn["id"], "guard.budget_warning")
    assert line and line[0]["steps"] == 4 and line[0]["dimensions"] == ["steps"]


def test_a_submit_lowers_and_raises_the_policy_budget_for_its_own_turn(d: Daemon) -> None:
    # The policy allows 8 steps; the scenario needs 6.
    assert d.run("five steps then answer")["state"] == "completed"
    lowered = d.run("five steps then answer", budget={"max_steps": 3})
    stopped(lowered, "budget.steps", "steps", 3, 3)
    # "progress" needs 10 steps; the policy's 8 stop it before its answer, 12 let it end.
    stopped(d.run("progress"), "budget.steps", "steps", 8, 8)
    raised = d.run("progress", budget={"max_steps": 12})
    assert raised["state"] == "completed", raised["result"]
    assert raised["result"]["answer"] == "found nine facts"


def test_cost_budget_stops_with_provider_prices(d: Daemon) -> None:
    # 1000 in x $3/Mtok + 500 out x $15/Mtok = $0.0105 a step.
    turn = d.run("cost", budget={"max_cost_usd": 0.03})
    stopped(turn, "budget.cost", "cost_usd", 0.0315, 0.03)
    assert turn["counters"]["steps"] == 3
    assert turn["usage"]["cost_usd"] == pytest.approx(0.0315)


def test_active_time_budget_cuts_a_slow_model_call(d: Daemon) -> None:
    # The model answers after an hour: the turn ending at all (within the poll's deadline)
    # shows the request's timeout was the 0.4 s left, not the provider's 60 s.
    turn = d.run("slow model", budget={"max_seconds": 0.4})
    result = stopped(turn, "budget.seconds", "seconds", None, 0.4)
    # Spent, give or take the 10 ms a timer may fire early (TIME_RESERVE_S).
    assert result["stopped_because"]["value"] >= 0.39
    # A spent time budget is a stop, not a failover or a recovery wait.
    assert turn["counters"]["recovery_cycles"] == 0


def test_active_time_budget_cuts_a_slow_tool_call(d: Daemon, server: ToolServer) -> None:
    # The tool never answers before the test is over and its own timeout is an hour: the
    # turn ending at all (within the poll's deadline) shows the budget cut the call.
    server.hold("/slow")
    try:
        turn = d.run("slow tool", budget={"max_seconds": 0.5})
    finally:
        server.release("/slow")
    result = stopped(turn, "budget.seconds", "seconds", None, 0.5)
    assert result["stopped_because"]["value"] >= 0.49
    assert len(server.calls("/slow")) == 1
    # Not idempotent and cut while in flight: the effect may have happened.
    cut = of_type(d.events(turn["id"]), "tool.result", tool="slow")
    assert cut[0]["ok"] is None and cut[0]["outcome"] == "unknown"


def test_deadline_stops_the_turn_naming_the_deadline(d: Daemon) -> None:
    deadline = time.time() + 0.4
    turn = d.run("deadline", deadline=deadline, budget={"max_steps": 100})
    result = stopped(turn, "deadline", "deadline", None, deadline)
    assert deadline - 0.01 <= result["stopped_because"]["value"] < deadline + 0.3
    assert turn["counters"]["steps"] >= 2


# -- loops -----------------------------------------------------------------------------

def test_three_identical_calls_stop_at_the_third_before_it_runs(d: Daemon) -> None:
    turn = d.run("repeat")
    result = stopped(turn, "loop.repeated_action", "repeats", 3, 3)
    events = d.events(turn["id"])
    # {"a":1,"b":2}, {"b":2,"a":1} and {"a": 1, "b": 2} are one action; the third call
    # never ran.
    assert len(of_type(events, "tool.call", tool="echo")) == 2
    assert len(of_type(events, "tool.result", tool="echo")) == 2
    warning = of_type(events, "loop.warning")
    assert [(w["count"], w["limit"]) for w in warning] == [(2, 3)]
    # The model of step 3 read the note (its answer echoes the latest user message).
    assert result["answer"].startswith("saw: " + NOTE + "Loop note: this is the 2nd call")
    line = logs(d, turn["id"], "guard.loop_warning")
    assert line and line[0]["repeats"] == 2 and line[0]["steps"] == 2


def test_a_cycle_of_actions_and_states_stops_with_state_cycle(d: Daemon,
                                                              server: ToolServer) -> None:
    server.respond("/state", *(Reply(body={"state": s}) for s in "ABABAB"))
    turn = d.run("cycle")
    # open -> A, then B, A, B, A by the same two moves: the fifth state is A's second
    # revisit (max_state_revisits 2), reached by a move made before.
    stopped(turn, "loop.state_cycle", "state_revisits", 2, 2)
    assert turn["counters"]["steps"] == 5
    assert len(server.calls("/state")) == 5


def test_new_searches_that_all_find_nothing_stop_with_no_progress(
        d: Daemon, server: ToolServer) -> None:
    server.respond("/fact1", Reply(body={"results": []}))  # a search that finds nothing
    turn = d.run("nothing found")
    # "query 1", "query 2", ...: the same empty answer each time is a state seen before,
    # but reached by a search never made before: no progress (steps 2..6), not a cycle.
    stopped(turn, "loop.no_progress", "no_progress", 5, 5)
    assert turn["counters"]["steps"] == 6
    queries = [c.body["q"] for c in server.calls("/fact1") if "q" in c.body]
    assert queries == [f"query {n}" for n in range(1, 7)]


def test_steps_that_find_nothing_new_stop_with_no_progress(d: Daemon,
                                                           server: ToolServer) -> None:
    for name in ("fact1", "fact2", "fact3"):
        server.respond("/" + name, Reply(body={"fact": name}))
    turn = d.run("no progress")
    # Step 1 learns three facts; steps 2..6 see only those again, each in a new
    # combination (so no state repeats): five steps without progress.
    stopped(turn, "loop.no_progress", "no_progress", 5, 5)
    assert turn["counters"]["steps"] == 6
    line = logs(d, turn["id"], "guard.loop_stop")
    assert line and line[0]["no_progress"] == 5 and line[0]["steps"] == 6


def test_slow_but_real_progress_is_not_stopped(d: Daemon) -> None:
    turn = d.run("progress", budget={"max_steps": 20})
    assert turn["state"] == "completed"  # nine tool steps, each finding something new
    assert turn["counters"]["steps"] == 10


def test_polling_tools_are_exempt_from_repeat_and_progress_rules(
        d: Daemon, server: ToolServer) -> None:
    server.respond("/poll", *[Reply(body={"status": "pending"})] * 5,
                   Reply(body={"status": "done"}))
    turn = d.run("poll")
    # Six identical calls with the same answer five times: not a loop for a polling tool.
    assert turn["state"] == "completed", turn["result"]
    assert "done" in turn["result"]["answer"]
    assert len(server.calls("/poll")) == 6
    assert not of_type(d.events(turn["id"]), "loop.warning")


# -- failures --------------------------------------------------------------------------

def test_two_identical_deterministic_failures_stop(d: Daemon, server: ToolServer) -> None:
    server.respond("/bad", Reply(400))
    turn = d.run("bad request")
    result = stopped(turn, "failure.deterministic", "failure_streak", 2, 2)
    assert len(server.calls("/bad")) == 2  # a 400 is never retried
    # The agent was told the first failure, in its tool result.
    assert result["answer"].startswith("saw: ERROR (deterministic): HTTP 400")
    results = of_type(d.events(turn["id"]), "tool.result", tool="bad")
    assert [(r["failure_streak"], r["limit"]) for r in results] == [(1, 2), (2, 2)]
    line = logs(d, turn["id"], "tool.failed")
    assert [x["failure_streak"] for x in line] == [1, 2]
    assert line[1]["steps"] == 2 and line[1]["failure_class"] == "deterministic"


def test_five_identical_retryable_failures_stop_and_are_not_a_loop(
        d: Daemon, server: ToolServer) -> None:
    # 429: the server says it did nothing (a 503 to a call that is not idempotent would
    # leave its outcome unknown, and a repeat would be refused).
    server.respond("/down", Reply(429))
    turn = d.run("service down")
    # Five identical calls, each after a retryable failure: retries (failure_streak up to
    # 5), not repeats (max_repeats 3) and not a state cycle.
    stopped(turn, "failure.retryable", "failure_streak", 5, 5)
    calls = server.calls("/down")
    assert len(calls) == 5  # not idempotent: never retried by the daemon itself
    # Five calls of the agent, of one action that never succeeded: one key.
    assert len({c.idempotency_key for c in calls}) == 1
    assert not of_type(d.events(turn["id"]), "loop.warning")


def test_three_unknown_failures_stop(d: Daemon, server: ToolServer) -> None:
    server.respond("/weird", Reply(redirect_loop=True))
    turn = d.run("weird")
    stopped(turn, "failure.unknown", "failure_streak", 3, 3)
    results = of_type(d.events(turn["id"]), "tool.result", tool="weird")
    assert [r["class"] for r in results] == ["unknown"] * 3


def test_a_repeat_after_a_retryable_failure_is_a_retry_not_a_loop(
        d: Daemon, server: ToolServer) -> None:
    server.respond("/limited", Reply(429, headers={"Retry-After": "0"}),
                   Reply(429, headers={"Retry-After": "0"}), Reply(200, {"rows": 3}))
    turn = d.run("rate limited")
    assert turn["state"] == "completed", turn["result"]
    assert turn["result"]["answer"] == 'got through: {"rows": 3}'
    assert len(server.calls("/limited")) == 3
    assert not of_type(d.events(turn["id"]), "loop.warning")
    assert [p.rsplit("-> ", 1)[1] for p in turn["result"]["partial"][:3]] == [
        "failed (retryable)", "failed (retryable)", "ok"]


def test_retries_of_an_idempotent_call_share_one_idempotency_key(
        d: Daemon, server: ToolServer) -> None:
    server.respond("/lookup", Reply(503), Reply(503), Reply(200, {"name": "Ada"}))
    turn = d.run("idempotent")
    assert turn["state"] == "completed", turn["result"]
    assert turn["result"]["answer"] == 'looked up: {"name": "Ada"}'
    keys = [c.idempotency_key for c in server.calls("/lookup")]
    assert keys == [f"{turn['id']}.1.0"] * 3
    events = d.events(turn["id"])
    assert [e["attempt"] for e in of_type(events, "tool.retry_scheduled")] == [2, 3]
    assert len(of_type(events, "tool.call", tool="lookup")) == 1


def test_a_non_idempotent_call_that_fails_is_not_repeated(d: Daemon,
                                                          server: ToolServer) -> None:
    server.respond("/create_ticket", Reply(429), Reply(201, {"ticket": 1}))
    turn = d.run("not idempotent")
    assert turn["state"] == "completed", turn["result"]
    calls = server.calls("/create_ticket")
    assert len(calls) == 1
    assert calls[0].idempotency_key == effect_key(turn["id"], "create_ticket",
                                                  {"title": "printer on fire"}, 1)
    assert calls[0].body == {"title": "printer on fire"}
    assert turn["result"]["answer"].startswith("saw: ERROR (retryable): HTTP 429")


def test_a_schema_violation_is_a_deterministic_failure_and_sends_nothing(
        d: Daemon, server: ToolServer) -> None:
    before = len(server.calls("/create_ticket"))
    turn = d.run("schema")
    stopped(turn, "failure.deterministic", "failure_streak", 2, 2)
    assert len(server.calls("/create_ticket")) == before
    results = of_type(d.events(turn["id"]), "tool.result", tool="create_ticket")
    assert [r["class"] for r in results] == ["deterministic"] * 2
    assert "violate its schema at title" in results[0]["error"]


# -- exits -----------------------------------------------------------------------------

def test_report_blocked_ends_blocked_with_what_was_tried_and_found(d: Daemon) -> None:
    turn = d.run("blocked")
    result = stopped(turn, "blocked", None, None, None, status="blocked")
    assert result["blocked"] == {"reason": "the door is locked",
                                 "tried": ["the front door", "the back door"],
                                 "found": ["a note: back at 5"]}
    assert "tried: the back door" in result["partial"]
    assert "found: a note: back at 5" in result["partial"]
    assert result["open_issues"] == ["the door is locked"]


def test_context_overflow_past_max_restarts_is_restarts_exhausted(d: Daemon) -> None:
    turn = d.run("overflow")
    # max_restarts = 1: the first rebuild (step 1 compacted away) is allowed, the second
    # is one too many.
    stopped(turn, "restarts.exhausted", "restarts", 2, 1)
    assert turn["counters"]["restarts"] == 2
    assert turn["counters"]["steps"] == 3


def test_clarify_round_trip_through_the_cli(d: Daemon) -> None:
    turn = d.submit("clarify")
    waiting = d.wait_state(turn["id"], "waiting")
    assert waiting["question"] == "Which city?"
    shown = cli(d, "show", turn["id"])
    assert shown.returncode == 0, shown.stderr
    assert "waiting" in shown.stdout and "question  Which city?" in shown.stdout
    answered = cli(d, "answer", turn["id"], "Paris")
    assert answered.returncode == 0, answered.stderr
    done = d.wait(turn["id"])
    assert done["state"] == "completed", done["result"]
    assert done["result"]["answer"] == "Going to Paris"
    assert "question" not in done
    events = d.events(turn["id"])
    types = [e["type"] for e in events]
    assert types.index("turn.waiting") < types.index("turn.message")
    # Active time excludes the wait for the answer: had it been counted, the turn's
    # active time would hold the whole time between the question and the answer (two
    # runs of the CLI), as the daemon stamped them.
    asked, told = (events[types.index(t)]["ts"] for t in ("turn.waiting", "turn.message"))
    assert done["usage"]["seconds"] < told - asked
    # The turn is over: another answer is refused.
    late = cli(d, "answer", turn["id"], "Lyon")
    assert late.returncode == 1 and "already finished" in late.stderr


def test_an_answer_to_a_turn_that_asked_nothing_is_refused(d: Daemon) -> None:
    # Kept, it would answer whatever question the turn asks later.
    turn = d.submit("redirect")  # a 20 s model call, no question
    d.wait_state(turn["id"], "running")
    status, data = d.post(f"/v1/turns/{turn['id']}/messages",
                          {"kind": "answer", "text": "Paris"})
    assert status == 409, data
    assert "asked no question" in data["error"]
    status, _ = d.get(f"/v1/turns/{turn['id']}")
    assert status == 200
    assert d.post(f"/v1/turns/{turn['id']}/cancel")[0] == 202
    done = d.wait(turn["id"])
    assert done["state"] == "cancelled"
    assert "inbox" not in done  # the refused answer was not kept


# -- steering --------------------------------------------------------------------------

def test_ten_steers_under_max_restarts_1_do_not_end_the_turn(d: Daemon) -> None:
    turn = d.submit("ten steers", budget={"max_steps": 300, "max_tokens": 10_000_000})
    heard: list[str] = []
    expected: str | None = None
    sent = 0
    for ev in d.client.stream(f"/v1/turns/{turn['id']}/events"):
        if ev["type"] == "tool.call":
            now_heard = ev["arguments"]["heard"]
            heard.append(now_heard)
            if expected is None or now_heard == expected:
                sent += 1
                expected = f"steer number {sent}" if sent <= 10 else "stop now"
                steer(d, turn["id"], expected)
        if ev["type"] == "turn.finished":
            break
    done = d.wait(turn["id"])
    # Step 3 overflowed once (restarts 1 = max_restarts); ten steers later the last step
    # overflowed again, and the turn lives because every steer reset `restarts`.
    assert done["state"] == "completed", done["result"]
    assert done["result"]["answer"].startswith("stopping at step")
    assert sent == 11
    for i in range(1, 11):  # each steer was seen by the model, in order
        assert f"steer number {i}" in heard
    assert done["counters"]["restarts"] == 1
    restarts = logs(d, turn["id"], "turn.restart")
    assert len(restarts) == 2 and all(r["restarts"] == 1 for r in restarts)


def test_a_final_answer_with_an_unread_steer_starts_one_more_step(d: Daemon) -> None:
    turn = d.submit("unread steer")
    for ev in d.client.stream(f"/v1/turns/{turn['id']}/events"):
        if ev["type"] == "model.request":
            steer(d, turn["id"], "also check the cellar")
            break
    done = d.wait(turn["id"])
    assert done["state"] == "completed"
    assert done["result"]["answer"] == "second: also check the cellar"
    assert done["counters"]["steps"] == 2
    assert "step 1: answered, then read a steer message" in done["result"]["partial"]


def test_report_blocked_with_an_unread_steer_reads_it_first(
        d: Daemon, server: ToolServer) -> None:
    # The model's reply: look around, then give up. The steer lands while "look around"
    # is held in flight, so report_blocked comes with a steer still unread.
    server.hold("/gated")
    turn = d.submit("give up")
    server.wait_for_calls("/gated")
    steer(d, turn["id"], "the key is under the mat")
    server.release("/gated")
    done = d.wait(turn["id"])
    assert done["state"] == "completed", done["result"]
    assert done["result"]["answer"] == "with your hint: the key is under the mat"


def test_redirect_cuts_a_slow_model_call_and_the_step_restarts_with_it(d: Daemon) -> None:
    turn = d.submit("redirect")
    requested_at = None
    for ev in d.client.stream(f"/v1/turns/{turn['id']}/events"):
        if ev["type"] == "model.request" and requested_at is None:
            requested_at = ev["ts"]
            steer(d, turn["id"], "go left", redirect=True)
        if ev["type"] == "model.redirected":
            assert requested_at is not None
            assert ev["ts"] - requested_at < 10.0  # cut, not waited out (20 s)
        if ev["type"] == "turn.finished":
            break
    done = d.wait(turn["id"])
    assert done["state"] == "completed"
    assert done["result"]["answer"] == "answer: go left"
    assert done["counters"]["steps"] == 1
    assert done["counters"]["restarts"] == 0  # a user message is charged to nothing
    events = d.events(turn["id"])
    assert len(of_type(events, "model.redirected")) == 1
    assert len(of_type(events, "model.request")) == 2


def test_messages_to_a_finished_turn_answer_409(d: Daemon) -> None:
    turn = d.run("all done")
    assert turn["state"] == "completed"
    for body in ({"kind": "steer", "text": "more"}, {"kind": "answer", "text": "x"},
                 {"kind": "steer", "text": "more", "redirect": True}):
        status, data = d.post(f"/v1/turns/{turn['id']}/messages", body)
        assert status == 409, data
        assert "finished" in data["error"]
    out = cli(d, "steer", turn["id"], "more")
    assert out.returncode == 1 and "already finished" in out.stderr


# -- clarify timeouts (their own policy) -----------------------------------------------

@pytest.fixture(scope="module")
def quick_clarify(tmp_path_factory: pytest.TempPathFactory,
                  server: ToolServer) -> Iterator[Daemon]:
    tmp = tmp_path_factory.mktemp("clarify")
    daemon = Daemon(tmp, guards_config(tmp, server, clarify_timeout=0.4), name="c").start()
    try:
        yield daemon
    finally:
        daemon.kill()


def test_no_answer_within_clarify_timeout_stops_with_clarify_seconds(
        quick_clarify: Daemon) -> None:
    d = quick_clarify
    turn = d.submit("clarify")
    assert d.wait_state(turn["id"], "waiting")["question"] == "Which city?"
    done = d.wait(turn["id"])
    result = stopped(done, "clarify.timeout", "clarify_seconds", None, 0.4)
    assert 0.4 <= result["stopped_because"]["value"] < 1.5
    # The wait is not active time: the turn's active time is less than the wait alone.
    assert done["usage"]["seconds"] < result["stopped_because"]["value"]


def test_the_deadline_cuts_a_clarify_wait(quick_clarify: Daemon) -> None:
    d = quick_clarify
    deadline = time.time() + 0.15
    turn = d.run("clarify", deadline=deadline)
    result = stopped(turn, "deadline", "deadline", None, deadline)
    assert deadline - 0.01 <= result["stopped_because"]["value"] < deadline + 0.2
    assert turn["result"]["stopped_because"]["message"].startswith("deadline ")
