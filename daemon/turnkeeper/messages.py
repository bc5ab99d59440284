"""The provider-neutral shapes of a conversation: messages, tool calls and tool specs.

Both sides meet here: `providers/` translate these to and from a vendor's wire format,
`tools/` offer `ToolSpec`s and answer `ToolCall`s, and the turn keeps its conversation in
`Message`s. Neither side imports the other.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from turnkeeper.values import value_class

Role = Literal["system", "user", "assistant", "tool"]


@value_class
class ToolCall:
    """A tool call the model asked for. `arguments` is the raw JSON text the model sent:
    malformed arguments are the model's failure and are classified, not repaired.
    `cut_at` is set (to the output cap) on a call its reply's output cap cut: its
    arguments may be incomplete even where they parse, and it is never run. Kept with
    the call, so a turn resumed before its tools ran refuses it too."""

    id: str
    name: str
    arguments: str
    cut_at: int | None = None

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"id": self.id, "name": self.name, "arguments": self.arguments}
        if self.cut_at is not None:
            d["cut_at"] = self.cut_at
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> ToolCall:
        cut = d.get("cut_at")
        return cls(id=str(d["id"]), name=str(d["name"]), arguments=str(d["arguments"]),
                   cut_at=None if cut is None else int(cut))


@value_class
class Message:
    """One conversation message in a provider-neutral form.

    - user/system: `content`.
    - assistant: `content` (may be None) and `tool_calls`.
    - tool: `content` (the result text) and `tool_call_id` (+ `name`).

    `opaque` holds an assistant message's provider-opaque blocks, as the provider sent
    them and in its order: Anthropic's `thinking` (with its signature) and
    `redacted_thinking`, OpenAI Responses' `reasoning` items (with place-holders for
    where the text and each call stood among them), Gemini's parts (with their
    `thoughtSignature`), which must go back unchanged with the tool calls they led to.
    Only the adapter that reads a block's `type` sends it; the others leave it out.
    Checkpoints keep them, so a resumed turn sends them too.
    """

    role: Role
    content: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None
    opaque: tuple[Mapping[str, Any], ...] = ()

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            d["tool_calls"] = [c.to_json() for c in self.tool_calls]
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            d["name"] = self.name
        if self.opaque:
            d["opaque"] = [dict(b) for b in self.opaque]
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Message:
        return cls(role=d["role"], content=d.get("content"),
                   tool_calls=tuple(ToolCall.from_json(c) for c in d.get("tool_calls", ())),
                   tool_call_id=d.get("tool_call_id"), name=d.get("name"),
                   opaque=tuple(dict(b) for b in d.get("opaque", ()) if isinstance(b, dict)))


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """A tool as offered to the model: a name, a description, a JSON schema."""

    name: str
    description: str
    parameters: Mapping[str, Any]


def dumps_arguments(arguments: Mapping[str, Any]) -> str:
    """Compact JSON for tool arguments built by the daemon itself (scripted provider)."""
    return json.dumps(arguments, separators=(",", ":"), ensure_ascii=False)


def json_text(value: Any) -> str:
    """Compact JSON text for a message as it is stored (one row per message). orjson is
    3-5x faster than the standard encoder on these; a string it refuses (a lone
    surrogate, which a model's escaped output can hold) is written with \\u escapes by
    the standard one instead, so the text is always valid UTF-8 and reads back equal."""
    try:
        return orjson.dumps(value).decode()
    except TypeError:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=True)


def message_text(message: Message) -> str:
    """The message as the JSON text of its stored row."""
    return json_text(message.to_json())
