"""A provider's server cannot hold a turn, a reload or a key: a stream that stays alive
(a token every 0.2 s, or keepalives alone) is cut at the turn's time or the call's own
limit; a reload cuts a model call and finishes; a redirect is never followed.

The real daemon, and hostile providers of our own on 127.0.0.1 (`fault_server`). The
assertions read the turn's own record (its stop, its figures, its events), not the
test's clock: with the bounds gone, these turns and reloads never end at all.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.integration.fault_server import (
    Answer,
    FaultServer,
    keepalive,
    ok,
    redirect,
    trickle,
)
from tests.integration.fault_server import running as fault_running
from tests.integration.harness import Daemon
from tests.integration.tool_server import Reply, ToolServer

KEY = "sk-hostile-test-KEY-0123456789"


@pytest.fixture
def fault() -> Iterator[FaultServer]:
    with fault_running() as server:
        yield server


def config(fault: FaultServer, *, provider: str = "", budget: str = "", daemon: str = "",
           extra: str = "") -> str:
    return f"""
[daemon]
watch_config = false
{daemon}

[retry]
base_delay = 0.01
max_delay = 0.05

[budget]
{budget}

[[providers]]
name = "primary"
kind = "openai"
base_url = "{fault.base_url('primary')}"
model = "m"
api_key_env = "TK_HOSTILE_KEY"
headers = {{ "api-key" = "env:TK_HOSTILE_KEY" }}
{provider}
{extra}
"""


def start_with(start: Any, text: str) -> Daemon:
    return start(text, env={"TK_HOSTILE_KEY": KEY})  # type: ignore[no-any-return]


def stop_of(turn: dict[str, Any]) -> dict[str, Any]:
    return turn["result"]["stopped_because"]  # type: ignore[no-any-return]


ENDLESS = {"a token every 0.2 s": trickle(0.2), "keepalives only": keepalive(0.2)}


# -- a total bound on every call --------------------------------------------------------

@pytest.mark.parametrize("stream", list(ENDLESS), ids=["trickle", "keepalive"])
def test_an_endless_stream_is_cut_when_the_active_time_runs_out(
        start: Any, fault: FaultServer, stream: str) -> None:
    fault.script("primary", then=ENDLESS[stream])
    d = start_with(start, config(fault, budget="max_seconds = 1.5"))
    turn = d.run("go on for ever", timeout=30)
    stop = stop_of(turn)
    assert (turn["state"], stop["code"], stop["limit"]) == ("partial", "budget.seconds", 1.5)
    # Cut at the limit, not whenever the stream chose to end (never): the turn's own
    # figures, with room for a loaded machine's scheduling.
    assert 1.5 <= turn["usage"]["seconds"] < 1.5 + 5
    types = [e["type"] for e in d.events(turn["id"])]
    assert "model.attempt_failed" not in types  # the provider is not blamed for it


@pytest.mark.parametrize("stream", list(ENDLESS), ids=["trickle", "keepalive"])
def test_an_endless_stream_is_cut_at_the_deadline(start: Any, fault: FaultServer,
                                                  stream: str) -> None:
    fault.script("primary", then=ENDLESS[stream])
    d = start_with(start, config(fault))
    deadline = time.time() + 1.5
    turn = d.run("go on for ever", timeout=30, deadline=deadline)
    stop = stop_of(turn)
    assert (turn["state"], stop["code"], stop["limit"]) == ("partial", "deadline", deadline)
    assert deadline - 0.5 <= stop["value"] < deadline + 5  # when the turn stopped


@pytest.mark.parametrize("stream", list(ENDLESS), ids=["trickle", "keepalive"])
def test_an_endless_stream_is_cut_at_max_call_seconds_and_retried(
        start: Any, fault: FaultServer, stream: str) -> None:
    fault.script("primary", ENDLESS[stream], then=ok("the second attempt answered"))
    d = start_with(start, config(fault, provider="max_call_seconds = 1.0"))
    turn = d.run("go on for ever", timeout=30)
    assert turn["state"] == "completed"
    assert turn["result"]["answer"] == "the second attempt answered"
    failed = [e for e in d.events(turn["id"]) if e["type"] == "model.attempt_failed"]
    assert [(e["class"], e["attempt"]) for e in failed] == [("retryable", 1)]
    assert "max_call_seconds = 1 s" in failed[0]["error"]
    assert fault.arrived("primary") == 2


def test_a_stream_of_keepalives_only_fails_after_idle_timeout_and_is_retried(
        start: Any, fault: FaultServer) -> None:
    fault.script("primary", keepalive(0.1), then=ok("answered after the idle stream"))
    d = start_with(start, config(fault, provider="idle_timeout = 0.8"))
    turn = d.run("hello", timeout=30)
    assert turn["result"]["answer"] == "answered after the idle stream"
    failed = [e for e in d.events(turn["id"]) if e["type"] == "model.attempt_failed"]
    assert [e["class"] for e in failed] == ["retryable"]
    assert "IdleStream" in failed[0]["error"] and "idle_timeout = 0.8 s" in failed[0]["error"]


# -- a reload always finishes ------------------------------------------------------------

def test_a_reload_cuts_an_endless_stream_after_drain_timeout_and_the_turn_goes_on_under_it(
        start: Any, fault: FaultServer) -> None:
    fault.script("primary", trickle(0.2), then=ok("answered under the new policy"))
    text = config(fault, daemon="drain_timeout = 2.0")
    d = start_with(start, text)
    turn = d.submit("stream for ever")
    d.wait_state(turn["id"], "running")
    deadline = time.monotonic() + 10
    while fault.arrived("primary") < 1:  # the stream is on the wire
        assert time.monotonic() < deadline
        time.sleep(0.02)
    d.set_config(text + '\n[agent]\nsystem_prompt = "the new policy"\n')
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        reload = pool.submit(d.post, "/v1/reload")
        deadline = time.monotonic() + 10
        while d.get("/v1/status")[1]["state"] != "reloading":
            assert time.monotonic() < deadline and not reload.done()
            time.sleep(0.01)
        during = d.submit("submitted during the reload")  # 202, queued
        code, data = reload.result(timeout=30)
    assert code == 200 and data["policy_version"] == 2
    status = d.get("/v1/status")[1]
    assert status["state"] == "ready" and status["policy_version"] == 2
    done = d.wait(turn["id"], timeout=30)
    assert done["state"] == "completed" and done["policy_version"] == 2
    assert done["result"]["answer"] == "answered under the new policy"
    assert done["counters"]["steps"] == 1  # the cut step is asked again, not counted again
    events = d.events(turn["id"])
    types = [e["type"] for e in events]
    assert types.index("turn.suspended") < types.index("turn.resumed")
    assert next(e for e in events if e["type"] == "turn.resumed")["policy_version"] == 2
    assert "model.attempt_failed" not in types  # a cut for the reload blames no provider
    # The second request carried the new policy's system prompt.
    assert fault.requests("primary")[-1].body["messages"][0]["content"] == "the new policy"
    later = d.wait(during["id"], timeout=30)
    assert later["state"] == "completed" and later["policy_version"] == 2


def test_a_reload_lets_a_tool_call_in_flight_finish_once_then_switches(
        start: Any, fault: FaultServer, tool_server: ToolServer) -> None:
    tool_server.respond("/slow", Reply(200, {"done": True}))
    tool_server.hold("/slow")
    fault.script("primary", Answer(tool_calls=(("slow", {"n": 1}),), text=""),
                 then=ok("after the tool"))
    tool = f"""
[[tools]]
name = "slow"
kind = "http"
description = "slow"
url = "{tool_server.url('/slow')}"
timeout = 30.0
idempotent = true
"""
    text = config(fault, daemon="drain_timeout = 0.3", extra=tool)
    d = start_with(start, text)
    turn = d.submit("call the slow tool")
    tool_server.wait_for_calls("/slow", 1)
    d.set_config(text + '\n[agent]\nsystem_prompt = "the new policy"\n')
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        reload = pool.submit(d.post, "/v1/reload")
        # The drain timeout passes with the tool call on the wire: it is not cut.
        deadline = time.monotonic() + 10
        while not any(r.get("event") == "daemon.drain_timeout" for r in d.log_records()):
            assert time.monotonic() < deadline, "no drain timeout"
            time.sleep(0.02)
        assert not reload.done()
        tool_server.release("/slow")
        code, data = reload.result(timeout=30)
    assert code == 200 and data["policy_version"] == 2
    done = d.wait(turn["id"], timeout=30)
    assert done["state"] == "completed" and done["policy_version"] == 2
    assert len(tool_server.calls("/slow")) == 1  # finished once, never cut and sent again
    results = [e for e in d.events(turn["id"]) if e["type"] == "tool.result"]
    assert [r["ok"] for r in results] == [True]
    assert fault.requests("primary")[-1].body["messages"][0]["content"] == "the new policy"


def test_a_stop_cuts_an_endless_stream_after_shutdown_timeout_and_the_turn_resumes(
        start: Any, fault: FaultServer) -> None:
    fault.script("primary", trickle(0.2), then=ok("answered after the restart"))
    d = start_with(start, config(fault, daemon="shutdown_timeout = 0.5"))
    turn = d.submit("stream for ever")
    deadline = time.monotonic() + 10
    while fault.arrived("primary") < 1:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert d.stop(timeout=30) == 0  # the stream is cut; the stop does not wait for it
    d.start()
    done = d.wait(turn["id"], timeout=30)
    assert done["state"] == "completed"
    assert done["result"]["answer"] == "answered after the restart"


# -- no redirect is followed ---------------------------------------------------------------

def test_a_provider_redirect_to_another_host_is_never_followed(start: Any,
                                                               fault: FaultServer) -> None:
    with fault_running() as elsewhere:
        elsewhere.script("thief", then=ok("an answer from another host"))
        target = elsewhere.base_url("thief") + "/chat/completions"
        fault.script("primary", then=redirect(target))
        d = start_with(start, config(fault))
        turn = d.run("hello", timeout=30)
        assert elsewhere.arrived("thief") == 0  # never called: no key, no conversation
    stop = stop_of(turn)
    assert (turn["state"], stop["code"]) == ("failed", "providers.rejected")
    assert target in stop["message"] and "307" in stop["message"]
    assert "not followed" in stop["message"]
    assert KEY not in str(turn)
    assert fault.count("primary") == 1  # deterministic: not retried
