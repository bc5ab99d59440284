"""Named agents (`[agents.NAME]`) on the real daemon: each agent's turns send its own
system prompt and offer only its tools, to a model server that records every request; a
call of a tool the agent was not offered is answered as an unknown tool and never reaches
the tool server; an unknown agent is refused naming the field; a reload adds and removes
agents, and a parked turn whose agent was removed goes on as the default agent."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.fault_server import FaultServer, ok
from tests.integration.harness import Daemon
from tests.integration.test_mcp import _kill_pid, ledger, mcp_status, server_pids, stdio_server
from tests.integration.tool_server import ToolServer
from turnkeeper.client import Client, InvalidRequest

BUILTINS = {"report_blocked", "clarify", "update_plan"}


@pytest.fixture
def faults() -> Iterator[FaultServer]:
    server = FaultServer().start()
    yield server
    server.stop()


@pytest.fixture
def workdir(tmp_path: Path) -> Iterator[Path]:
    """The MCP test server's work directory; its processes are killed at the end."""
    work = tmp_path / "mcp-work"
    work.mkdir()
    yield work
    for pid in server_pids(work):
        _kill_pid(pid)


def _config(faults: FaultServer, tools: ToolServer, agents: str) -> str:
    out = ['[agent]', 'system_prompt = "the default prompt"', "api_max_retries = 0", ""]
    for name in ("a", "b"):
        out += ["[[providers]]", f'name = "{name}"', 'kind = "openai"',
                f'base_url = "{faults.base_url(name)}"', f'model = "model-{name}"',
                "stream = false", "timeout = 5.0", 'api_key_env = ""', ""]
    for name in ("lookup", "ticket"):
        out += ["[[tools]]", f'name = "{name}"', 'kind = "http"',
                f'url = "{tools.url("/" + name)}"', "idempotent = true", "timeout = 5.0", ""]
    return "\n".join(out) + textwrap.dedent(agents)


AGENTS = """
[agents.alpha]
system_prompt = "the alpha prompt"
tools = ["lookup"]
model = "a"

[agents.beta]
system_prompt = "the beta prompt"
tools = ["ticket"]
model = "b"
"""


def _system(seen_body: dict[str, Any]) -> str:
    return str(next(m["content"] for m in seen_body["messages"] if m["role"] == "system"))


def _tools(seen_body: dict[str, Any]) -> set[str]:
    return {t["function"]["name"] for t in seen_body.get("tools", ())}


def _tool_results(seen_body: dict[str, Any]) -> list[str]:
    return [str(m["content"]) for m in seen_body["messages"] if m["role"] == "tool"]


def test_each_agent_sends_its_own_prompt_and_offers_only_its_tools(
        start: Any, faults: FaultServer, tool_server: ToolServer) -> None:
    faults.script("a", ok("", tool_calls=(("lookup", {"q": "x"}),)), then=ok("alpha done"))
    faults.script("b", ok("", tool_calls=(("ticket", {"title": "t"}),)), then=ok("beta done"))
    d: Daemon = start(_config(faults, tool_server, AGENTS))

    alpha = d.run("hello", agent="alpha")
    beta = d.run("hello", agent="beta")
    assert alpha["result"]["answer"] == "alpha done" and alpha["agent"] == "alpha"
    assert beta["result"]["answer"] == "beta done" and beta["agent"] == "beta"
    # The agent's model is the turn's.
    assert (alpha["model"], beta["model"]) == ("a", "b")

    for provider, prompt, tool in (("a", "the alpha prompt", "lookup"),
                                   ("b", "the beta prompt", "ticket")):
        seen = faults.requests(provider)
        assert len(seen) == 2
        for request in seen:
            assert _system(request.body) == prompt
            assert _tools(request.body) == BUILTINS | {tool}
    assert len(tool_server.calls("/lookup")) == 1 and len(tool_server.calls("/ticket")) == 1

    # A submit naming no agent runs as [agent]: its prompt, every tool.
    faults.clear()
    plain = d.run("hello")
    assert plain["agent"] is None and plain["result"]["answer"] == "alpha done"
    (request,) = faults.requests("a")
    assert _system(request.body) == "the default prompt"
    assert _tools(request.body) == BUILTINS | {"lookup", "ticket"}

    status, data = d.get("/v1/status")
    assert status == 200
    assert data["agents"] == {"alpha": {"tools": 1, "model": "a", "profile": None},
                              "beta": {"tools": 1, "model": "b", "profile": None}}


def test_a_tool_the_agent_was_not_offered_is_an_unknown_tool_and_is_never_called(
        start: Any, faults: FaultServer, tool_server: ToolServer) -> None:
    # alpha's model names beta's tool (it exists in the daemon, not for alpha) and a
    # tool that exists nowhere: both get the same answer.
    faults.script("a", ok("", tool_calls=(("ticket", {"title": "t"}),
                                          ("nonesuch", {"title": "t"}))),
                  then=ok("gave up"))
    d: Daemon = start(_config(faults, tool_server, AGENTS))

    turn = d.run("hello", agent="alpha")
    assert turn["result"]["answer"] == "gave up"
    assert tool_server.calls("/ticket") == []
    first, second = faults.requests("a")
    assert "ticket" not in _tools(first.body)
    offered, unknown = _tool_results(second.body)
    assert offered == "ERROR (deterministic): UnknownTool: there is no tool named 'ticket'"
    assert unknown == offered.replace("'ticket'", "'nonesuch'")
    results = [e for e in d.events(turn["id"]) if e["type"] == "tool.result"]
    assert [(r["tool"], r["ok"], r["class"], r["key"]) for r in results] == [
        ("ticket", False, "deterministic", None), ("nonesuch", False, "deterministic", None)]


def test_an_unknown_agent_is_refused_naming_the_field(
        start: Any, faults: FaultServer, tool_server: ToolServer) -> None:
    d: Daemon = start(_config(faults, tool_server, AGENTS))
    status, data = d.post("/v1/turns", {"message": "hello", "agent": "gamma"})
    assert status == 400 and data["field"] == "agent", data
    assert "'gamma'" in data["error"] and "alpha, beta" in data["error"]
    status, data = d.post("/v1/turns", [{"message": "ok", "agent": "alpha"},
                                        {"message": "hello", "agent": "gamma"}])
    assert status == 400 and data["field"] == "[1].agent", data
    with pytest.raises(InvalidRequest) as caught:
        Client(d.socket).submit("hello", agent="gamma")
    assert caught.value.field == "agent"
    status, data = d.get("/v1/turns")
    assert status == 200 and data["turns"] == []
    assert faults.requests() == []


def test_a_reload_adds_an_agent_and_a_parked_turn_of_a_removed_one_goes_on_as_default(
        start: Any, faults: FaultServer, tool_server: ToolServer) -> None:
    faults.script("a", ok("", tool_calls=(("clarify", {"question": "which one?"}),)),
                  then=ok("done"))
    d: Daemon = start(_config(faults, tool_server, AGENTS))
    turn = d.submit("hello", agent="alpha")
    d.wait_state(turn["id"], "waiting")
    status, data = d.post("/v1/turns", {"message": "hello", "agent": "gamma"})
    assert status == 400 and data["field"] == "agent"

    # The new policy has no alpha and a new agent, gamma.
    d.set_config(_config(faults, tool_server, """
        [agents.beta]
        system_prompt = "the beta prompt"
        tools = ["ticket"]
        model = "b"

        [agents.gamma]
        system_prompt = "the gamma prompt"
        tools = []
        model = "b"
        """))
    status, data = d.post("/v1/reload")
    assert status == 200, data
    # Parked when the reload came: suspended, then resumed under the new policy.
    d.wait_state(turn["id"], "waiting")
    status, data = d.post(f"/v1/turns/{turn['id']}/messages",
                          {"kind": "answer", "text": "the first"})
    assert status == 202, data
    done = d.wait(turn["id"])
    assert done["result"]["answer"] == "done"
    assert done["agent"] is None and done["model"] == "a"
    events = d.events(turn["id"])
    removed = [e for e in events if e["type"] == "turn.agent_removed"]
    assert len(removed) == 1 and removed[0]["agent"] == "alpha"
    assert removed[0]["policy_version"] == 2
    # Said once, when the turn goes on under the policy without its agent (resumed by
    # the reload, once), before its next model call.
    types = [e["type"] for e in events]
    resumed = types.index("turn.resumed")
    assert types.count("turn.resumed") == 1, types
    assert resumed < types.index("turn.agent_removed") < types.index("model.request", resumed)
    # Its next model call was the default agent's: its prompt, every tool.
    first, after = faults.requests("a")
    assert _system(first.body) == "the alpha prompt"
    assert _system(after.body) == "the default prompt"
    assert _tools(after.body) == BUILTINS | {"lookup", "ticket"}

    # The added agent runs, with its own prompt and the built-ins only.
    faults.script("b", then=ok("gamma here"))
    gamma = d.run("hello", agent="gamma")
    assert gamma["result"]["answer"] == "gamma here" and gamma["agent"] == "gamma"
    (request,) = faults.requests("b")
    assert _system(request.body) == "the gamma prompt" and _tools(request.body) == BUILTINS
    status, data = d.post("/v1/turns", {"message": "hello", "agent": "alpha"})
    assert status == 400 and data["field"] == "agent"
    status, data = d.get("/v1/status")
    assert sorted(data["agents"]) == ["beta", "gamma"]
    assert data["agents"]["gamma"]["tools"] == 0


def test_the_agent_is_kept_with_the_turn_across_a_restart(
        start: Any, faults: FaultServer, tool_server: ToolServer) -> None:
    faults.script("a", ok("", tool_calls=(("clarify", {"question": "which one?"}),)),
                  then=ok("done"))
    d: Daemon = start(_config(faults, tool_server, AGENTS))
    turn = d.submit("hello", agent="alpha")
    d.wait_state(turn["id"], "waiting")
    assert d.stop() == 0
    d.start()
    d.wait_state(turn["id"], "waiting")
    status, data = d.post(f"/v1/turns/{turn['id']}/messages",
                          {"kind": "answer", "text": "the first"})
    assert status == 202, data
    done = d.wait(turn["id"])
    assert done["agent"] == "alpha" and done["result"]["answer"] == "done"
    assert [_system(r.body) for r in faults.requests("a")] == ["the alpha prompt"] * 2
    assert _tools(faults.requests("a")[-1].body) == BUILTINS | {"lookup"}
    assert json.dumps(done).count('"agent_removed"') == 0


def test_server_star_offers_every_tool_of_the_mcp_server_and_a_pattern_only_some(
        start: Any, faults: FaultServer, tool_server: ToolServer, workdir: Path) -> None:
    # `adder` may call calc's `add` only; its model names calc's destructive `charge`.
    faults.script("a", ok("", tool_calls=(("calc__add", {"a": 2, "b": 3}),
                                          ("calc__charge", {"account": "x", "amount": 1}))),
                  then=ok("added"))
    faults.script("b", then=ok("all calc"))
    d: Daemon = start(_config(faults, tool_server, stdio_server("calc", workdir) + """
        [agents.adder]
        tools = ["calc.add"]
        model = "a"

        [agents.calculator]
        tools = ["calc.*"]
        model = "b"
        """))
    calc = {f"calc__{t['remote']}" for t in mcp_status(d, "calc")["tools"]}
    assert {"calc__add", "calc__charge"} <= calc

    turn = d.run("add", agent="adder")
    assert turn["result"]["answer"] == "added"
    first, second = faults.requests("a")
    assert _tools(first.body) == BUILTINS | {"calc__add"}
    assert _tool_results(second.body) == [
        "5", "ERROR (deterministic): UnknownTool: there is no tool named 'calc__charge'"]
    assert not any(line.startswith("charge") for line in ledger(workdir))

    d.run("everything", agent="calculator")
    (request,) = faults.requests("b")
    assert _tools(request.body) == BUILTINS | calc  # not the http tools
    _, data = d.get("/v1/status")
    assert data["agents"]["adder"]["tools"] == 1
    assert data["agents"]["calculator"]["tools"] == len(calc)


JOINED = """
[agents.payer]
system_prompt = "the payer prompt"
tools = ["ticket"]
approval = { ticket = "always" }

[agents.quoter]
tools = []

[agents.quoter.output_schema]
type = "object"
required = ["price"]
properties = { price = { type = "number" } }
"""


def test_an_agents_approval_and_output_schema_apply_to_its_turns_only(
        start: Any, faults: FaultServer, tool_server: ToolServer) -> None:
    """`approval` on a named agent holds its calls for a person while the same tool runs
    unasked for the default agent; its `output_schema` is sent with its requests and its
    answer comes back parsed, while a default turn stays free text."""
    faults.script("a", ok("", tool_calls=(("ticket", {"title": "t"}),)), then=ok("filed"))
    d: Daemon = start(_config(faults, tool_server, JOINED))

    plain = d.run("file it")
    assert plain["result"]["answer"] == "filed" and plain["result"].get("output") is None
    assert len(tool_server.calls("/ticket")) == 1  # [agent] holds nothing

    faults.clear()
    faults.script("a", ok("", tool_calls=(("ticket", {"title": "t"}),)), then=ok("filed"))
    held = d.submit("file it", agent="payer")
    d.wait_state(held["id"], "waiting")
    status, data = d.get(f"/v1/turns/{held['id']}")
    (pending,) = data["turn"]["pending_approvals"]
    assert pending["tool"] == "ticket" and len(tool_server.calls("/ticket")) == 1
    status, _ = d.post(f"/v1/turns/{held['id']}/approvals",
                       {"call_id": pending["call_id"], "decision": "approve"})
    assert status in (200, 202)
    assert d.wait(held["id"])["result"]["answer"] == "filed"
    assert len(tool_server.calls("/ticket")) == 2

    faults.clear()
    faults.script("a", ok('{"price": 2.5}'))
    quoted = d.run("quote", agent="quoter")
    assert quoted["result"]["output"] == {"price": 2.5}
    (request,) = faults.requests("a")
    assert request.body["response_format"]["json_schema"]["schema"]["required"] == ["price"]
