"""The model side says why it stopped, its counters stay honest, and a replay continues.

The real daemon against real servers on 127.0.0.1: the fault server for the providers,
the tool server for a tool with side effects, and an address where nothing listens.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.integration.fault_server import FaultServer, fail, ok
from tests.integration.test_resilience import chain, config, stop_of
from tests.integration.tool_server import ToolServer
from turnkeeper.policy.effects import effect_key


@pytest.fixture
def faults() -> Iterator[FaultServer]:
    server = FaultServer().start()
    yield server
    server.stop()


def _send_tool(tools: ToolServer) -> str:
    return f"""
[[tools]]
name = "send"
kind = "http"
description = "send something (not safe to repeat)"
url = "{tools.url('/send')}"
idempotent = false
timeout = 5.0
"""


def _stored_events(d: Any, turn_id: str) -> list[dict[str, Any]]:
    """The turn's events as the store holds them."""
    with sqlite3.connect(d.state_dir / "turnkeeper.sqlite3") as db:
        rows = db.execute("SELECT data FROM events WHERE turn = ? ORDER BY seq",
                          (turn_id,)).fetchall()
    return [json.loads(r[0]) for r in rows]


def _wait_for(pred: Any, timeout: float = 15.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError("timed out")


def test_a_replayed_dead_letter_continues_from_its_checkpoint(
        start: Any, faults: FaultServer, tool_server: ToolServer) -> None:
    # Step 1 sends (a side effect, with an Idempotency-Key); step 2 is refused by the only
    # provider: a dead letter. After the fix, the replay answers from step 1's result.
    faults.script("primary", ok("", tool_calls=(("send", {"text": "hello"}),)),
                  then=fail(400, error_type="invalid_request_error", message="bad request"))
    d = start(config(chain(faults, "primary")) + _send_tool(tool_server))
    turn = d.run("send hello")
    assert stop_of(turn)[0] == "providers.rejected"
    assert len(tool_server.calls("/send")) == 1
    faults.script("primary", then=ok("done"))
    status, data = d.post(f"/v1/dead-letters/{turn['id']}/replay")
    assert status == 202, data
    assert data["turn"]["id"] == turn["id"]
    done = d.wait(turn["id"])
    assert done["state"] == "completed" and done["result"]["answer"] == "done"
    # The step that sent ran once: its key was seen once, and the model saw its result.
    keys = [c.idempotency_key for c in tool_server.calls("/send")]
    assert keys == [effect_key(turn["id"], "send", {"text": "hello"}, 1)]
    last = faults.requests("primary")[-1].body["messages"]
    assert any(m["role"] == "tool" for m in last)
    assert [r["stopped_because"]["code"] for r in done["previous_results"]] == [
        "providers.rejected"]
    types = [e["type"] for e in _stored_events(d, turn["id"])]
    assert types.count("turn.finished") == 2
    # The follow stream of a replayed turn runs to its last finish, not its first.
    assert [e["type"] for e in d.events(turn["id"])] == types
    assert types.index("turn.replayed") > types.index("turn.finished")
    assert d.get("/v1/dead-letters")[1]["dead_letters"] == []


def test_an_unreachable_provider_names_the_connection_error(start: Any) -> None:
    provider = {"name": "primary", "kind": "openai", "base_url": "http://127.0.0.1:1",
                "model": "m", "timeout": 5.0}
    d = start(config([provider], agent={"api_max_retries": 0, "auto_recovery_cycles": 1,
                                        "recovery_schedule": [0.01]}))
    turn = d.run("anyone there?")
    stop = turn["result"]["stopped_because"]
    assert stop["code"] == "providers.exhausted"
    assert "Cannot connect" in stop["last_error"]["primary"]
    assert "Cannot connect" in stop["message"]  # what `turnkeeper show` prints
    # What was attempted is an open issue, not work done.
    assert any("none answered" in line for line in turn["result"]["open_issues"])
    assert not any("none answered" in line for line in turn["result"]["partial"])
    failed = [e for e in d.events(turn["id"]) if e["type"] == "model.attempt_failed"]
    assert failed and all("Cannot connect" in e["error"] for e in failed)


def test_an_overflow_with_nothing_to_compact_is_context_exhausted(
        start: Any, faults: FaultServer) -> None:
    faults.script("primary", then=fail(
        400, error_type="invalid_request_error",
        message="This model's maximum context length is 8192 tokens. However, you "
                "requested 9000 tokens (8000 in the messages, 1000 in the completion)."))
    d = start(config(chain(faults, "primary")))
    turn = d.run("too big")
    assert stop_of(turn) == ("context.exhausted", "context_tokens", 9000, 8192)
    assert turn["state"] == "partial"


@pytest.mark.slow
def test_a_reload_during_recovery_keeps_the_recovery_cycles(
        start: Any, faults: FaultServer) -> None:
    faults.script("primary", then=fail(503))
    faults.script("fallback", then=fail(503))
    agent = {"api_max_retries": 0, "auto_recovery_cycles": 2, "recovery_jitter": 0.0,
             "recovery_schedule": [0.1, 3.0]}
    d = start(config(chain(faults, "primary"), agent=agent))
    tid = d.submit("wait for it")["id"]

    def parked_in_cycle_2() -> bool:
        t = d.get(f"/v1/turns/{tid}")[1]["turn"]
        return bool(t["state"] == "recovering" and t["counters"]["recovery_cycles"] == 1)

    _wait_for(parked_in_cycle_2)
    d.set_config(config(chain(faults, "primary", "fallback"), agent=agent))
    assert d.post("/v1/reload")[0] == 200
    t = d.get(f"/v1/turns/{tid}")[1]["turn"]
    assert t["counters"]["recovery_cycles"] == 1
    done = d.wait(tid)
    recovering = [e for e in d.events(tid) if e["type"] == "turn.recovering"]
    assert [e["cycle"] for e in recovering] == [1, 2, 2]
    # The same wait, not a new cycle's: it ends when it was to end before the reload,
    # and what it reports is what was left of it, not the whole wait.
    assert recovering[-1]["next_attempt_at"] == recovering[-2]["next_attempt_at"]
    assert recovering[-1]["wait"] < 3.0
    assert stop_of(done) == ("providers.exhausted", "recovery_cycles", 2, 2)
    assert faults.count("fallback") == 1  # the new list's pass reached the new provider
