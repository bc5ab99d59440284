"""How each adapter asks for structured output, on its encoder: the field of its API's
own JSON Schema mode, the answer tool and its tool choice, or the schema in the system
prompt. Whole turns on the wire are in tests/integration/test_structured_output.py."""

from __future__ import annotations

import json
from typing import Any

import pytest

from turnkeeper.config import ProviderConfig
from turnkeeper.providers.anthropic import AnthropicProvider
from turnkeeper.providers.base import Message, ModelRequest, ToolSpec
from turnkeeper.providers.gemini import GeminiProvider
from turnkeeper.providers.http import HttpAdapter
from turnkeeper.providers.openai import OpenAIProvider
from turnkeeper.providers.openai_responses import ResponsesProvider

SCHEMA: dict[str, Any] = {"title": "Quote", "type": "object",
                          "properties": {"price": {"type": "number"}}, "required": ["price"]}
ECHO = ToolSpec("echo", "Echo", {"type": "object"})
ADAPTERS = {"openai": OpenAIProvider, "openai-responses": ResponsesProvider,
            "anthropic": AnthropicProvider, "gemini": GeminiProvider}


def body(kind: str, mode: str = "auto", *, tools: tuple[ToolSpec, ...] = (ECHO,),
         schema: dict[str, Any] | None = SCHEMA, **extra: Any) -> dict[str, Any]:
    cfg = ProviderConfig(name="p", kind=kind, base_url="http://127.0.0.1:9", model="m",
                         api_key_env="", cache="off", structured_output=mode, **extra)
    adapter: HttpAdapter = ADAPTERS[kind](cfg)
    request = ModelRequest(system="Be brief.", messages=(Message(role="user", content="q"),),
                           tools=tools, max_output_tokens=100, timeout_s=5.0,
                           output_schema=schema)
    out: dict[str, Any] = json.loads(adapter.encode(request))
    return out


def test_openai_native_is_a_json_schema_response_format_without_strict() -> None:
    assert body("openai")["response_format"] == {
        "type": "json_schema", "json_schema": {"name": "Quote", "schema": SCHEMA}}


def test_responses_native_is_text_format_json_schema_beside_other_text_options() -> None:
    sent = body("openai-responses", options={"text": {"verbosity": "low"}})
    assert sent["text"] == {"verbosity": "low", "format": {
        "type": "json_schema", "name": "Quote", "schema": SCHEMA}}


def test_gemini_native_is_a_json_mime_type_and_the_schema_as_json_schema() -> None:
    config = body("gemini")["generationConfig"]
    assert config["responseMimeType"] == "application/json"
    assert config["responseJsonSchema"] == SCHEMA and config["maxOutputTokens"] == 100


def test_anthropic_native_is_output_config_format() -> None:
    sent = body("anthropic", "native")
    assert sent["output_config"] == {"format": {"type": "json_schema", "schema": SCHEMA}}
    assert "tool_choice" not in sent


@pytest.mark.parametrize(("kind", "tools_of", "any_choice", "named_choice"), [
    ("openai", lambda b: [t["function"] for t in b["tools"]], "required",
     {"type": "function", "function": {"name": "final_answer"}}),
    ("openai-responses", lambda b: b["tools"], "required",
     {"type": "function", "name": "final_answer"}),
    ("anthropic", lambda b: b["tools"], {"type": "any"},
     {"type": "tool", "name": "final_answer"}),
])
def test_the_tool_mode_offers_the_answer_tool_and_makes_the_model_call_a_tool(
        kind: str, tools_of: Any, any_choice: Any, named_choice: Any) -> None:
    sent = body(kind, "tool")
    names = [t["name"] for t in tools_of(sent)]
    assert names == ["echo", "final_answer"]
    schema_key = "input_schema" if kind == "anthropic" else "parameters"
    assert tools_of(sent)[-1][schema_key] == SCHEMA
    assert sent["tool_choice"] == any_choice
    # The answer tool alone: it is forced by name.
    assert body(kind, "tool", tools=())["tool_choice"] == named_choice


def test_gemini_tool_mode_calls_a_function_in_mode_any() -> None:
    sent = body("gemini", "tool", tools=())
    assert sent["toolConfig"] == {"functionCallingConfig": {
        "mode": "ANY", "allowedFunctionNames": ["final_answer"]}}
    assert sent["tools"][0]["functionDeclarations"][-1]["parametersJsonSchema"] == SCHEMA


def test_anthropic_with_thinking_leaves_the_tool_choice_to_the_model() -> None:
    sent = body("anthropic", "tool", options={"thinking": {"type": "enabled",
                                                           "budget_tokens": 1024}},
                max_output_tokens=4096)
    assert sent["tool_choice"] == {"type": "auto"}


@pytest.mark.parametrize("kind", list(ADAPTERS))
def test_the_prompt_mode_puts_the_schema_in_the_system_prompt_and_nothing_else(
        kind: str) -> None:
    text = json.dumps(body(kind, "prompt"))
    assert "JSON only" in text and "Be brief." in text
    for field in ("response_format", "tool_choice", "responseJsonSchema", "output_config",
                  "final_answer", '"format"'):
        assert field not in text


@pytest.mark.parametrize("kind", list(ADAPTERS))
def test_a_request_without_a_schema_asks_for_no_format(kind: str) -> None:
    text = json.dumps(body(kind, "tool", schema=None))
    for field in ("response_format", "tool_choice", "final_answer", "JSON only"):
        assert field not in text
