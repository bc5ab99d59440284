"""What the adapters share to ask for structured output; each writes its own wire.

A turn with an output schema sends it with every request (`ModelRequest.output_schema`);
the adapter asks its API in the provider's mode (`policy.output.mode_of`):

- `native`: the API's own JSON Schema setting (each adapter's field);
- `tool`: an answer tool (`ANSWER_TOOL`) whose input schema is the output schema, and a
  tool choice that makes the model call a tool. The named answer tool is forced when it
  is the only tool; with other tools offered (the built-ins always are) the model must
  call one of them ("any" / "required"), so it can still work with its tools and gives
  its answer through the answer tool; forcing the answer tool on every request would
  leave the agent no other move. The answer tool's input comes back as the reply's text
  (`answer_from_tool`), as if the model had written it;
- `prompt`: the schema in the system prompt with an instruction to answer with JSON only
  (`prompt_system`), for servers that support neither.

Whatever the mode, the answer is checked by the turn (`policy.output`): a provider's
enforcement is never taken on trust.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from turnkeeper.providers.base import ModelReply, ToolSpec

ANSWER_TOOL = "final_answer"
ANSWER_TOOL_DESCRIPTION = (
    "Give your final answer with this tool once the task is done: its input is the "
    "answer, which must match this schema. Call it alone, not with other tools.")

PROMPT_INSTRUCTION = (
    "Your final answer must be a single JSON value that matches the JSON Schema below. "
    "Answer with the JSON only: no prose before or after it, no Markdown code fence.\n"
    "JSON Schema:\n")

_NAME = re.compile(r"[^A-Za-z0-9_-]+")


def schema_name(schema: Mapping[str, Any]) -> str:
    """A name for the schema where an API wants one (OpenAI's `json_schema.name`:
    letters, digits, `_` and `-`, at most 64): its `title`, else "answer"."""
    title = schema.get("title")
    name = _NAME.sub("_", title).strip("_")[:64] if isinstance(title, str) else ""
    return name or "answer"


def prompt_system(system: str, schema: Mapping[str, Any]) -> str:
    """The system prompt with the schema and the instruction to answer with it."""
    text = PROMPT_INSTRUCTION + json.dumps(schema, ensure_ascii=False, sort_keys=True)
    return f"{system}\n\n{text}" if system else text


def answer_tool(schema: Mapping[str, Any]) -> ToolSpec:
    return ToolSpec(ANSWER_TOOL, ANSWER_TOOL_DESCRIPTION, dict(schema))


def with_answer_tool(tools: Sequence[ToolSpec], schema: Mapping[str, Any]
                     ) -> tuple[ToolSpec, ...]:
    """The tools offered, then the answer tool."""
    return (*tools, answer_tool(schema))


def answer_from_tool(reply: ModelReply) -> ModelReply:
    """A reply that called the answer tool, as the answer it gave: the tool's input as
    the text, the call gone (the other calls, if any, stay and run as usual)."""
    answers = [c for c in reply.tool_calls if c.name == ANSWER_TOOL]
    if not answers:
        return reply
    rest = tuple(c for c in reply.tool_calls if c.name != ANSWER_TOOL)
    finish = reply.finish_reason
    if not rest and finish == "tool_calls":
        finish = "stop"
    return replace(reply, text=answers[-1].arguments, tool_calls=rest, finish_reason=finish)
