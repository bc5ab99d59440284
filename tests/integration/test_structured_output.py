"""Structured output on the real daemon: the schema asked for the provider's way, every
answer checked, a failing one sent back to the agent, the parsed answer in the result.

The providers are the fault server on 127.0.0.1, which records each request: the OpenAI
path answers with scripted text, the Anthropic path replays Messages replies.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration import wire_replies as wire
from tests.integration.fault_server import FaultServer, ok, replay
from tests.integration.test_cli import cli
from tests.integration.test_resilience import config, stop_of
from turnkeeper.client import Client, InvalidRequest

QUOTE: dict[str, Any] = {
    "title": "quote", "type": "object",
    "properties": {"item": {"type": "string"}, "price": {"type": "number"}},
    "required": ["item", "price"],
}
GOOD = {"item": "tea", "price": 2.5}


@pytest.fixture
def faults() -> Iterator[FaultServer]:
    server = FaultServer().start()
    yield server
    server.stop()


def openai(faults: FaultServer, **extra: Any) -> list[dict[str, Any]]:
    return [{"name": "primary", "kind": "openai", "base_url": faults.base_url("primary"),
             "model": "gpt-4o-2024-08-06", "stream": False, "timeout": 5.0, **extra}]


def anthropic(faults: FaultServer, *, stream: bool, **extra: Any) -> list[dict[str, Any]]:
    return [{"name": "primary", "kind": "anthropic", "base_url": faults.anthropic_url("primary"),
             "api_key_env": "", "model": "claude-sonnet-4-5", "stream": stream,
             "timeout": 5.0, **extra}]


def dead_letters(d: Any) -> list[str]:
    return [t["id"] for t in d.get("/v1/dead-letters")[1]["dead_letters"]]


def user_texts(body: dict[str, Any]) -> list[str]:
    return [str(m.get("content")) for m in body.get("messages", ()) if m.get("role") == "user"]


def test_an_answer_that_fails_its_schema_is_sent_back_and_the_next_one_kept_parsed(
        start: Any, faults: FaultServer) -> None:
    faults.script("primary", ok('{"item": "tea", "price": "cheap"}'), ok(json.dumps(GOOD)))
    d = start(config(openai(faults)))
    turn = d.run("quote me tea", output_schema=QUOTE)
    assert stop_of(turn)[0] == "completed", turn["result"]
    assert turn["result"]["output"] == GOOD
    assert json.loads(turn["result"]["answer"]) == GOOD
    assert turn["counters"]["output_attempts"] == 2
    first, second = (s.body for s in faults.requests("primary"))
    # Asked natively, the schema as given.
    assert first["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "quote", "schema": QUOTE}}
    assert second["response_format"] == first["response_format"]
    # The second request carries the failing answer, then what failed in it.
    told = user_texts(second)[-1]
    assert "at $.price: 'cheap' is not of type 'number'" in told
    assert "attempt 1 of 3" in told
    assert second["messages"][-2] == {"role": "assistant",
                                      "content": '{"item": "tea", "price": "cheap"}'}
    # Kept with the result: it survives a restart.
    d.stop()
    d.start()
    status, data = d.get(f"/v1/turns/{turn['id']}")
    assert status == 200 and data["turn"]["result"]["output"] == GOOD
    assert data["turn"]["output_schema"] == QUOTE


def test_an_answer_that_never_matches_stops_output_invalid_as_a_dead_letter(
        start: Any, faults: FaultServer) -> None:
    faults.script("primary", then=ok("tea costs 2.5"))
    d = start(config(openai(faults), agent={"max_output_attempts": 2}))
    turn = d.run("quote me tea", output_schema=QUOTE)
    assert turn["state"] == "failed", turn["result"]
    assert stop_of(turn) == ("output.invalid", "output_attempts", 2, 2)
    assert turn["result"]["answer"] == "tea costs 2.5"
    assert "output" not in turn["result"]
    assert any("not JSON" in issue for issue in turn["result"]["open_issues"])
    assert faults.count("primary") == 2
    assert turn["id"] in dead_letters(d)
    # A replay resumes it with its answers counted afresh and keeps the same schema.
    faults.script("primary", then=ok(json.dumps(GOOD)))
    status, data = d.post(f"/v1/dead-letters/{turn['id']}/replay")
    assert status == 202, data
    again = d.wait(turn["id"])
    assert again["state"] == "completed", again["result"]
    assert again["result"]["output"] == GOOD and again["counters"]["output_attempts"] == 1
    assert faults.requests("primary")[-1].body["response_format"]["json_schema"][
        "schema"] == QUOTE


def test_the_agents_schema_applies_unless_the_submit_gives_its_own(
        start: Any, faults: FaultServer, tmp_path: Path) -> None:
    schema_file = tmp_path / "quote.json"
    schema_file.write_text(json.dumps(QUOTE))
    faults.script("primary", ok(json.dumps(GOOD)), ok('["tea"]'))
    d = start(config(openai(faults), agent={"output_schema_file": str(schema_file)}))
    turn = d.run("quote me tea")
    assert turn["result"]["output"] == GOOD
    assert faults.requests("primary")[0].body["response_format"]["json_schema"]["schema"] \
        == QUOTE
    own = {"type": "array", "items": {"type": "string"}}
    turn = d.run("list it", output_schema=own)
    assert turn["result"]["output"] == ["tea"]
    assert faults.requests("primary")[1].body["response_format"]["json_schema"] == {
        "name": "answer", "schema": own}


@pytest.mark.parametrize(("schema", "says"), [
    ({"type": "objectt"}, "not a valid JSON Schema"),
    ({"$schema": "http://json-schema.org/draft-07/schema#", "required": "item"},
     "not a valid JSON Schema"),
    ("{}", "dictionary"),
])
def test_a_submit_whose_schema_is_not_a_json_schema_is_refused_naming_the_field(
        start: Any, faults: FaultServer, schema: Any, says: str) -> None:
    d = start(config(openai(faults)))
    status, data = d.post("/v1/turns", {"message": "hi", "output_schema": schema})
    assert status == 400, data
    assert data["field"] == "output_schema" and says in data["error"]
    status, data = d.post("/v1/turns", [{"message": "ok"},
                                        {"message": "hi", "output_schema": schema}])
    assert status == 400 and data["field"] == "[1].output_schema", data
    assert faults.count("primary") == 0


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_an_anthropic_provider_answers_through_the_forced_answer_tool(
        start: Any, faults: FaultServer, stream: bool) -> None:
    blocks = [{"type": "text", "text": "Here is the quote."},
              {"type": "tool_use", "id": "toolu_01", "name": "final_answer", "input": GOOD}]
    recorded: Any = (wire.anthropic_stream(
        [wire.text_block("Here is the quote."),
         [{**blocks[1], "input": {}},
          {"type": "input_json_delta", "partial_json": json.dumps(GOOD)}]], "tool_use")
        if stream else wire.anthropic_message(blocks, "tool_use"))
    faults.script("primary", replay(recorded))
    d = start(config(anthropic(faults, stream=stream)))
    turn = d.run("quote me tea", output_schema=QUOTE)
    assert stop_of(turn)[0] == "completed", turn["result"]
    assert turn["result"]["output"] == GOOD
    (sent,) = (s.body for s in faults.requests("primary"))
    answer_tool = sent["tools"][-1]
    assert answer_tool["name"] == "final_answer" and answer_tool["input_schema"] == QUOTE
    # The built-in tools are offered too, so the model must call a tool, any of them.
    assert {"report_blocked", "clarify"} <= {t["name"] for t in sent["tools"][:-1]}
    assert sent["tool_choice"] == {"type": "any"}
    assert "response_format" not in sent and "output_config" not in sent
    events = d.events(turn["id"])
    assert not [e for e in events if e["type"] == "tool.call"]


def test_the_prompt_mode_puts_the_schema_in_the_system_prompt_and_takes_a_fenced_answer(
        start: Any, faults: FaultServer) -> None:
    faults.script("primary", ok("```json\n" + json.dumps(GOOD) + "\n```"))
    d = start(config(openai(faults, structured_output="prompt")))
    turn = d.run("quote me tea", output_schema=QUOTE)
    assert stop_of(turn)[0] == "completed", turn["result"]
    assert turn["result"]["output"] == GOOD
    (sent,) = (s.body for s in faults.requests("primary"))
    assert "response_format" not in sent and "tool_choice" not in sent
    system = sent["messages"][0]
    assert system["role"] == "system"
    assert "JSON only" in system["content"]
    assert json.dumps(QUOTE, sort_keys=True) in system["content"]


def test_a_fenced_answer_is_sent_back_where_the_provider_was_asked_natively(
        start: Any, faults: FaultServer) -> None:
    faults.script("primary", ok("```json\n" + json.dumps(GOOD) + "\n```"),
                  ok(json.dumps(GOOD)))
    d = start(config(openai(faults)))
    turn = d.run("quote me tea", output_schema=QUOTE)
    assert turn["result"]["output"] == GOOD and turn["counters"]["output_attempts"] == 2
    assert "not JSON" in user_texts(faults.requests("primary")[1].body)[-1]


def test_a_turn_without_a_schema_answers_free_text_and_asks_for_no_format(
        start: Any, faults: FaultServer) -> None:
    faults.script("primary", ok("tea costs 2.5"))
    d = start(config(openai(faults)))
    turn = d.run("quote me tea")
    assert turn["result"]["answer"] == "tea costs 2.5" and "output" not in turn["result"]
    assert "response_format" not in faults.requests("primary")[0].body
    assert turn["counters"]["output_attempts"] == 0


def test_the_command_submits_a_schema_from_a_file_or_inline_and_prints_the_output(
        start: Any, faults: FaultServer, tmp_path: Path) -> None:
    faults.script("primary", then=ok(json.dumps(GOOD)))
    d = start(config(openai(faults)))
    schema_file = tmp_path / "quote.json"
    schema_file.write_text(json.dumps(QUOTE))
    for given in (str(schema_file), json.dumps(QUOTE)):
        out = cli("submit", "quote me tea", "--output-schema", given, "--wait", "--json",
                  socket=d.socket)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["result"]["output"] == GOOD
    assert all(s.body["response_format"]["json_schema"]["schema"] == QUOTE
               for s in faults.requests("primary"))
    out = cli("submit", "x", "--output-schema", "{not json", socket=d.socket)
    assert out.returncode == 2 and "--output-schema: not valid JSON" in out.stderr
    out = cli("submit", "x", "--output-schema", '{"type": 3}', socket=d.socket)
    assert out.returncode != 0 and "output_schema" in out.stderr


def test_an_agent_schema_that_is_not_a_json_schema_is_exit_78_naming_the_key(
        tmp_path: Path) -> None:
    f = tmp_path / "t.toml"
    f.write_text('[agent]\noutput_schema = { type = "objectt" }\n\n'
                 '[[providers]]\nname = "offline"\nkind = "scripted"\n')
    out = cli("config", "check", "--config", str(f))
    assert out.returncode == 78, out
    assert "agent.output_schema: not a valid JSON Schema" in out.stderr


def test_the_python_client_submits_a_schema_and_reads_the_output(
        start: Any, faults: FaultServer) -> None:
    faults.script("primary", then=ok(json.dumps(GOOD)))
    d = start(config(openai(faults)))
    tk = Client(socket=d.socket)
    turn = tk.submit("quote me tea", output_schema=QUOTE)
    result = tk.wait(turn.id, timeout=30).result
    assert result is not None and result.output == GOOD
    with pytest.raises(InvalidRequest) as err:
        tk.submit("quote me tea", output_schema={"type": "objectt"})
    assert err.value.field == "output_schema"
