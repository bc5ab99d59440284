"""The structured-output rule: a final answer is kept only as JSON that matches its schema;
a failing one goes back to the agent naming what failed, until `max_output_attempts`."""

from __future__ import annotations

from typing import Any

import pytest

from turnkeeper.policy.outcome import Status, StopCode, TurnResult, goes_to_dead_letters
from turnkeeper.policy.output import (
    MAX_ERRORS,
    Invalid,
    Retry,
    Valid,
    check_output,
    mode_of,
    schema_problem,
    strip_fence,
)
from turnkeeper.providers.base import ModelReply, ToolCall, Usage
from turnkeeper.providers.structured import (
    ANSWER_TOOL,
    answer_from_tool,
    prompt_system,
    schema_name,
)

PRICE: dict[str, Any] = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "price": {"type": "number"},
                   "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "price"],
}


def check(text: str | None, *, attempts: int = 0, max_attempts: int = 3,
          fenced: bool = False) -> Valid | Retry | Invalid:
    return check_output(text, PRICE, attempts=attempts, max_attempts=max_attempts,
                        fenced=fenced)


def test_an_answer_that_matches_is_kept_parsed_and_counted() -> None:
    checked = check('{"name": "tea", "price": 2.5}')
    assert checked == Valid({"name": "tea", "price": 2.5}, attempts=1)


def test_an_answer_that_is_not_json_goes_back_to_the_agent_saying_so() -> None:
    checked = check("The price of tea is 2.5")
    assert isinstance(checked, Retry) and checked.attempts == 1
    assert checked.errors[0].startswith("the answer is not JSON")
    assert "attempt 1 of 3" in checked.message
    assert "only the corrected JSON" in checked.message


def test_a_failing_answer_names_every_failing_path() -> None:
    checked = check('{"price": "cheap", "tags": ["a", 3]}', attempts=1)
    assert isinstance(checked, Retry) and checked.attempts == 2
    assert checked.errors == ("at $: 'name' is a required property",
                              "at $.price: 'cheap' is not of type 'number'",
                              "at $.tags[1]: 3 is not of type 'string'")
    for error in checked.errors:
        assert f"- {error}" in checked.message


def test_the_last_attempt_that_fails_stops_the_turn_output_invalid() -> None:
    checked = check('{"name": "tea"}', attempts=2, max_attempts=3)
    assert isinstance(checked, Invalid) and checked.attempts == 3
    stop = checked.stop
    assert (stop.code, stop.counter, stop.value, stop.limit) == (
        StopCode.OUTPUT_INVALID, "output_attempts", 3, 3)
    assert "'price' is a required property" in stop.message
    result = TurnResult(stopped_because=stop)
    assert result.status is Status.FAILED and goes_to_dead_letters(result)


def test_one_attempt_allowed_stops_at_the_first_failure() -> None:
    assert isinstance(check("no", max_attempts=1), Invalid)


def test_a_valid_answer_on_the_last_attempt_is_kept() -> None:
    assert check('{"name": "tea", "price": 1}', attempts=2) == Valid(
        {"name": "tea", "price": 1}, attempts=3)


def test_no_answer_at_all_is_not_json() -> None:
    checked = check(None)
    assert isinstance(checked, Retry) and "not JSON" in checked.errors[0]


def test_nan_and_infinity_are_not_json() -> None:
    checked = check_output("NaN", {"type": "number"}, attempts=0, max_attempts=3)
    assert isinstance(checked, Retry) and "not JSON" in checked.errors[0]


def test_a_fenced_answer_is_accepted_only_where_fences_are_let_through() -> None:
    fenced = '```json\n{"name": "tea", "price": 2}\n```'
    assert isinstance(check(fenced), Retry)
    assert check(fenced, fenced=True) == Valid({"name": "tea", "price": 2}, attempts=1)
    assert strip_fence("```\n[1]\n```\n") == "[1]"
    assert strip_fence("text ```json\n[1]\n```") == "text ```json\n[1]\n```"


def test_the_errors_listed_are_bounded() -> None:
    schema = {"type": "array", "items": {"type": "string"}}
    checked = check_output("[" + ",".join(["1"] * 20) + "]", schema, attempts=0,
                           max_attempts=3)
    assert isinstance(checked, Retry)
    assert len(checked.errors) == MAX_ERRORS + 1
    assert checked.errors[-1] == f"... and {20 - MAX_ERRORS} more"


def test_a_long_error_is_cut() -> None:
    checked = check_output('"' + "x" * 1000 + '"', {"type": "integer"}, attempts=0,
                           max_attempts=3)
    assert isinstance(checked, Retry) and len(checked.errors[0]) < 250


def test_a_schema_that_cannot_be_applied_is_reported_not_raised() -> None:
    schema = {"$ref": "https://example.invalid/schema.json"}
    checked = check_output("{}", schema, attempts=0, max_attempts=3)
    assert isinstance(checked, Retry)
    assert checked.errors[0].startswith("the output schema could not be applied")


# -- the schema itself -------------------------------------------------------------------


def test_a_valid_schema_has_no_problem() -> None:
    assert schema_problem(PRICE) is None
    assert schema_problem({}) is None


@pytest.mark.parametrize(("schema", "says"), [
    ({"type": "bogus"}, "at $.type"),
    ({"properties": {"a": {"type": 3}}}, "at $.properties.a.type"),
    ({"required": "name"}, "at $.required"),
    ([1, 2], "a JSON object"),
    ({"$schema": 7}, "$schema"),
])
def test_a_schema_its_metaschema_refuses_is_named(schema: Any, says: str) -> None:
    problem = schema_problem(schema)
    assert problem is not None and says in problem


def test_the_schema_is_checked_against_the_draft_it_names() -> None:
    # Draft 4 takes a boolean exclusiveMaximum; 2020-12 wants a number.
    draft4 = {"$schema": "http://json-schema.org/draft-04/schema#",
              "type": "number", "maximum": 5, "exclusiveMaximum": True}
    assert schema_problem(draft4) is None
    assert schema_problem({k: v for k, v in draft4.items() if k != "$schema"}) is not None


# -- how a provider is asked -------------------------------------------------------------


@pytest.mark.parametrize(("kind", "mode"), [
    ("openai", "native"), ("openai-responses", "native"), ("gemini", "native"),
    ("anthropic", "tool"), ("scripted", "prompt")])
def test_auto_picks_by_kind(kind: str, mode: str) -> None:
    assert mode_of(kind, "auto") == mode


def test_a_configured_mode_is_kept() -> None:
    assert mode_of("openai", "prompt") == "prompt"
    assert mode_of("anthropic", "native") == "native"


def _reply(calls: tuple[ToolCall, ...], finish: str = "tool_calls") -> ModelReply:
    return ModelReply(text="Here it is.", tool_calls=calls, usage=Usage(), finish_reason=finish)


def test_the_answer_tools_input_is_the_answer() -> None:
    reply = answer_from_tool(_reply((ToolCall("c1", ANSWER_TOOL, '{"a":1}'),)))
    assert (reply.text, reply.tool_calls, reply.finish_reason) == ('{"a":1}', (), "stop")


def test_other_calls_beside_the_answer_tool_stay() -> None:
    echo = ToolCall("c2", "echo", "{}")
    reply = answer_from_tool(_reply((ToolCall("c1", ANSWER_TOOL, "{}"), echo)))
    assert reply.tool_calls == (echo,) and reply.finish_reason == "tool_calls"


def test_a_reply_without_the_answer_tool_is_unchanged() -> None:
    reply = _reply((), finish="stop")
    assert answer_from_tool(reply) is reply


def test_the_prompt_mode_puts_the_schema_after_the_system_prompt() -> None:
    text = prompt_system("Be brief.", PRICE)
    assert text.startswith("Be brief.\n\n") and '"required": ["name", "price"]' in text
    assert "JSON only" in text


def test_a_schema_name_comes_from_its_title() -> None:
    assert schema_name({"title": "Price quote!"}) == "Price_quote"
    assert schema_name({}) == "answer"
    assert len(schema_name({"title": "x" * 100})) == 64
