"""A person's approval before a risky tool call runs, through the real daemon: a real
model server on 127.0.0.1 that records every request, and a real tool server that counts
every call. A held call is never sent before its decision; approved, it runs once (with
the arguments the person gave, when edited), even across a kill -9; denied, it never
runs and the agent reads why; with no decision in time the turn stops, or the calls are
denied, as `[approvals] on_timeout` says."""

from __future__ import annotations

import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.integration.fault_server import FaultServer, ok
from tests.integration.fleet_helpers import fleet_db, query  # noqa: F401 - fixture `db`
from tests.integration.harness import Daemon
from tests.integration.tool_server import ToolServer
from turnkeeper.client import (
    ApprovalDecision,
    AsyncClient,
    Client,
    Conflict,
    InvalidRequest,
    PendingApproval,
)

PAY = {"amount": 5, "to": "bob"}
PAY_SCHEMA = ('{ type = "object", required = ["amount", "to"], properties = { '
              'amount = { type = "integer" }, to = { type = "string" } } }')


@pytest.fixture
def faults() -> Iterator[FaultServer]:
    server = FaultServer().start()
    yield server
    server.stop()


def approvals_config(faults: FaultServer, tools: ToolServer, *, timeout: str = "1h",
                     on_timeout: str = "stop") -> str:
    return textwrap.dedent(f"""
        [approvals]
        timeout = "{timeout}"
        on_timeout = "{on_timeout}"

        [[providers]]
        name = "primary"
        kind = "openai"
        base_url = "{faults.base_url('primary')}"
        model = "model-primary"
        api_key_env = ""
        stream = false
        timeout = 5.0

        [[tools]]
        name = "pay"
        kind = "http"
        url = "{tools.url('/pay')}"
        idempotent = false
        approval = "effects"
        parameters = {PAY_SCHEMA}

        [[tools]]
        name = "lookup"
        kind = "http"
        url = "{tools.url('/lookup')}"
        idempotent = true
        approval = "effects"
        """)


def agent_pays(faults: FaultServer, *, also_lookup: bool = False) -> None:
    """The model asks for `pay` (and `lookup`, a read, in the same step), then answers."""
    calls: tuple[tuple[str, dict[str, Any]], ...] = (("pay", PAY),)
    if also_lookup:
        calls = (("lookup", {"q": "balance"}), *calls)
    faults.script("primary", ok("", tool_calls=calls), then=ok("paid"))


def pending_of(d: Daemon, turn_id: str, timeout: float = 20.0) -> list[dict[str, Any]]:
    """The turn's calls in `GET /v1/approvals`, once there are some."""
    deadline = time.monotonic() + timeout
    while True:
        status, data = d.get("/v1/approvals")
        assert status == 200, data
        mine = [a for a in data["approvals"] if a["turn"] == turn_id]
        if mine:
            return mine
        assert time.monotonic() < deadline, f"nothing pending for {turn_id}: {data}"
        time.sleep(0.05)


def of_type(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e["type"] == kind]


def tool_messages(faults: FaultServer) -> list[str]:
    """The tool results the model was sent, in its last request."""
    last = faults.requests("primary")[-1].body
    return [str(m.get("content")) for m in last["messages"] if m.get("role") == "tool"]


def test_an_approved_call_runs_once_after_the_decision_and_the_turn_finishes(
        start: Any, faults: FaultServer, tool_server: ToolServer) -> None:
    agent_pays(faults)
    d = start(approvals_config(faults, tool_server))
    turn_id = d.submit("pay bob")["id"]
    [pending] = pending_of(d, turn_id)
    assert pending["tool"] == "pay" and pending["arguments"] == PAY
    assert pending["key"].startswith(f"{turn_id}.pay.") and pending["requested_at"] > 0
    status, data = d.get(f"/v1/turns/{turn_id}")
    assert data["turn"]["state"] == "waiting"
    assert [p["call_id"] for p in data["turn"]["pending_approvals"]] == [pending["call_id"]]
    assert tool_server.calls("/pay") == []  # held: not sent

    status, out = d.post(f"/v1/turns/{turn_id}/approvals",
                         {"call_id": pending["call_id"], "decision": "approve"})
    assert status == 202, out
    done = d.wait(turn_id)
    assert done["state"] == "completed" and done["result"]["answer"] == "paid"
    [call] = tool_server.calls("/pay")
    assert call.body == PAY and call.idempotency_key == pending["key"]
    assert "pending_approvals" not in done
    events = d.events(turn_id)
    [asked] = of_type(events, "tool.approval_requested")
    assert (asked["tool"], asked["call_id"], asked["key"]) == ("pay", pending["call_id"],
                                                               pending["key"])
    [decided] = of_type(events, "tool.approval_decided")
    assert decided["decision"] == "approve" and decided["by"] == "operator"
    status, again = d.post(f"/v1/turns/{turn_id}/approvals",
                           {"call_id": pending["call_id"], "decision": "approve"})
    assert status == 409, again


def test_a_denied_call_never_runs_and_the_agent_reads_the_reason_without_a_failure(
        start: Any, faults: FaultServer, tool_server: ToolServer) -> None:
    agent_pays(faults, also_lookup=True)
    d = start(approvals_config(faults, tool_server))
    turn_id = d.submit("pay bob")["id"]
    [pending] = pending_of(d, turn_id)  # the read needs no approval
    assert pending["tool"] == "pay"
    # The whole step waits: the read has not run either.
    assert tool_server.calls("/lookup") == []
    status, out = d.post(f"/v1/turns/{turn_id}/approvals",
                         {"call_id": pending["call_id"], "decision": "deny",
                          "reason": "too expensive"})
    assert status == 202, out
    done = d.wait(turn_id)
    assert done["state"] == "completed"
    assert tool_server.calls("/pay") == []
    assert len(tool_server.calls("/lookup")) == 1
    assert "denied by the operator: too expensive" in tool_messages(faults)
    events = d.events(turn_id)
    results = of_type(events, "tool.result")
    assert [r["tool"] for r in results] == ["lookup"] and results[0]["ok"] is True
    [decided] = of_type(events, "tool.approval_decided")
    assert (decided["decision"], decided["reason"]) == ("deny", "too expensive")
    status, data = d.get("/metrics")  # not JSON: the client hands back the text
    assert status == 200
    metrics = str(data["error"])
    # A decision, not a failure: no tool call of pay is counted, the denial is.
    assert 'turnkeeper_tool_calls_total{outcome="ok",tool="lookup"} 1.0' in metrics
    assert 'tool="pay"' not in "".join(
        line for line in metrics.splitlines() if line.startswith("turnkeeper_tool_calls"))
    assert ('turnkeeper_tool_approvals_total{by="operator",decision="deny",tool="pay"} 1.0'
            in metrics)
    assert "turnkeeper_approval_wait_seconds_count 1.0" in metrics


def test_edited_arguments_are_the_ones_the_tool_receives(
        start: Any, faults: FaultServer, tool_server: ToolServer) -> None:
    agent_pays(faults)
    d = start(approvals_config(faults, tool_server))
    turn_id = d.submit("pay bob")["id"]
    [pending] = pending_of(d, turn_id)
    call_id = pending["call_id"]
    status, bad = d.post(f"/v1/turns/{turn_id}/approvals",
                         {"call_id": call_id, "decision": "approve",
                          "arguments": {"amount": "lots", "to": "carol"}})
    assert status == 400 and bad["field"] == "arguments", bad
    status, bad = d.post(f"/v1/turns/{turn_id}/approvals",
                         {"call_id": call_id, "decision": "maybe"})
    assert status == 400 and bad["field"] == "decision", bad
    status, bad = d.post(f"/v1/turns/{turn_id}/approvals",
                         {"call_id": "call_nope", "decision": "approve"})
    assert status == 409 and "call_nope" in bad["error"], bad
    status, bad = d.post("/v1/turns/t_0000000000000000/approvals",
                         {"call_id": call_id, "decision": "approve"})
    assert status == 404, bad
    edited = {"amount": 3, "to": "carol"}
    status, out = d.post(f"/v1/turns/{turn_id}/approvals",
                         {"call_id": call_id, "decision": "approve", "arguments": edited})
    assert status == 202, out
    done = d.wait(turn_id)
    assert done["state"] == "completed"
    [call] = tool_server.calls("/pay")
    assert call.body == edited
    [decided] = of_type(d.events(turn_id), "tool.approval_decided")
    assert decided["requested_arguments"] == PAY and decided["arguments"] == edited


def test_a_pending_approval_survives_kill_9_and_the_approved_call_runs_once(
        start: Any, faults: FaultServer, tool_server: ToolServer) -> None:
    agent_pays(faults)
    d = start(approvals_config(faults, tool_server))
    turn_id = d.submit("pay bob")["id"]
    [before] = pending_of(d, turn_id)
    d.kill()
    d.start()
    [after] = pending_of(d, turn_id)
    assert after == before  # the same call, key and request time: the clock goes on
    status, out = d.post(f"/v1/turns/{turn_id}/approvals",
                         {"call_id": after["call_id"], "decision": "approve"})
    assert status == 202, out
    done = d.wait(turn_id)
    assert done["state"] == "completed"
    assert len(tool_server.calls("/pay")) == 1
    assert len(of_type(d.events(turn_id), "tool.approval_requested")) == 1


def test_no_decision_in_time_stops_the_turn_with_approval_timeout(
        start: Any, faults: FaultServer, tool_server: ToolServer) -> None:
    agent_pays(faults)
    d = start(approvals_config(faults, tool_server, timeout="0.5s"))
    done = d.run("pay bob")
    stop = done["result"]["stopped_because"]
    assert done["state"] == "partial"
    assert (stop["code"], stop["counter"], stop["limit"]) == ("approval.timeout",
                                                              "approval_seconds", 0.5)
    assert stop["value"] >= 0.5
    assert tool_server.calls("/pay") == []
    assert any("not approved" in issue for issue in done["result"]["open_issues"])
    assert d.get("/v1/approvals") == (200, {"approvals": []})


def test_no_decision_in_time_denies_the_calls_when_on_timeout_is_deny(
        start: Any, faults: FaultServer, tool_server: ToolServer) -> None:
    agent_pays(faults)
    d = start(approvals_config(faults, tool_server, timeout="0.5s", on_timeout="deny"))
    done = d.run("pay bob")
    assert done["state"] == "completed" and done["result"]["answer"] == "paid"
    assert tool_server.calls("/pay") == []
    assert "denied by the operator: approval timed out" in tool_messages(faults)
    [decided] = of_type(d.events(done["id"]), "tool.approval_decided")
    assert (decided["decision"], decided["by"]) == ("deny", "timeout")



def test_the_python_clients_list_approve_and_deny_with_typed_results(
        start: Any, faults: FaultServer, tool_server: ToolServer) -> None:
    faults.script("primary", ok("", tool_calls=(("pay", PAY),)),
                  ok("", tool_calls=(("pay", {"amount": 7, "to": "eve"}),)), then=ok("paid"))
    d = start(approvals_config(faults, tool_server))
    turn_id = d.submit("pay bob")["id"]
    pending_of(d, turn_id)
    with Client(socket=d.socket) as tk:
        [held] = [a for a in tk.approvals() if a.turn == turn_id]
        assert isinstance(held, PendingApproval)
        assert (held.tool, held.arguments) == ("pay", PAY) and held.requested_at > 0
        with pytest.raises(InvalidRequest) as bad:
            tk.approve(turn_id, held.call_id, arguments={"amount": -1.5})
        assert bad.value.field == "arguments"
        decided = tk.approve(turn_id, held.call_id, arguments={"amount": 6, "to": "bob"})
        assert isinstance(decided, ApprovalDecision) and decided.decision == "approve"
        with pytest.raises(Conflict):
            tk.approve(turn_id, held.call_id)

    async def deny_next() -> None:
        async with AsyncClient(socket=d.socket) as tk:
            deadline = time.monotonic() + 20
            while not (mine := [a for a in await tk.approvals() if a.turn == turn_id
                                and a.arguments != PAY]):
                assert time.monotonic() < deadline, "the second call was never held"
                await anyio.sleep(0.05)
            assert mine[0].arguments == {"amount": 7, "to": "eve"}
            out = await tk.deny(turn_id, mine[0].call_id, reason="not eve")
            assert out.decision == "deny"

    anyio.run(deny_next)
    done = d.wait(turn_id)
    assert done["state"] == "completed"
    assert [c.body for c in tool_server.calls("/pay")] == [{"amount": 6, "to": "bob"}]
    assert "denied by the operator: not eve" in tool_messages(faults)


def test_a_decision_taken_on_another_fleet_node_reaches_the_node_holding_the_turn(
        tmp_path: Path, faults: FaultServer, tool_server: ToolServer, db: str) -> None:
    agent_pays(faults)
    body = approvals_config(faults, tool_server)
    nodes = [Daemon(tmp_path, body + textwrap.dedent(f"""
        [store]
        url = "{db}"

        [fleet]
        node_id = "n{i}"
        """), name=f"n{i}") for i in range(2)]
    try:
        for node in nodes:
            node.start()
        turn_id = nodes[0].submit("pay bob")["id"]
        deadline = time.monotonic() + 30
        while not (rows := query(db, "SELECT owner FROM turns WHERE id = $1 AND state ="
                                     " 'waiting' AND owner IS NOT NULL", turn_id)):
            assert time.monotonic() < deadline, "the turn never parked for approval"
            time.sleep(0.05)
        other = next(n for i, n in enumerate(nodes) if f"n{i}" != rows[0]["owner"])
        [pending] = pending_of(other, turn_id)  # listed by a node that does not hold it
        status, out = other.post(f"/v1/turns/{turn_id}/approvals",
                                 {"call_id": pending["call_id"], "decision": "approve"})
        assert status == 202, out
        done = other.wait(turn_id, timeout=30)
        assert done["state"] == "completed" and done["result"]["answer"] == "paid"
        assert len(tool_server.calls("/pay")) == 1
        status, again = other.post(f"/v1/turns/{turn_id}/approvals",
                                   {"call_id": pending["call_id"], "decision": "deny"})
        assert status == 409, again
    finally:
        for node in nodes:
            node.kill()


def test_a_daemon_started_after_the_approval_deadline_applies_the_timeout_at_once(
        start: Any, faults: FaultServer, tool_server: ToolServer) -> None:
    agent_pays(faults)
    d = start(approvals_config(faults, tool_server, timeout="2s"))
    turn_id = d.submit("pay bob")["id"]
    [pending] = pending_of(d, turn_id)
    d.kill()
    while time.time() < pending["requested_at"] + 2.5:  # the deadline passes while down
        time.sleep(0.1)
    d.start()
    done = d.wait(turn_id)
    stop = done["result"]["stopped_because"]
    assert (stop["code"], stop["limit"]) == ("approval.timeout", 2.0)
    assert stop["value"] >= 2.5  # counted from the request, the time down included
    assert tool_server.calls("/pay") == []
