"""The one protocol every model provider speaks, and the neutral message shapes.

A provider makes exactly one attempt per `complete()` call: no retries, no failover, no
sleeping. It either returns a `ModelReply` or raises `ProviderError` carrying one
`CallFailure` value; the resilience layer above decides what that failure means.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from turnkeeper.policy.classify import CallFailure

Role = Literal["system", "user", "assistant", "tool"]


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A tool call the model asked for. `arguments` is the raw JSON text the model sent:
    malformed arguments are the model's failure and are classified, not repaired."""

    id: str
    name: str
    arguments: str

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "name": self.name, "arguments": self.arguments}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> ToolCall:
        return cls(id=str(d["id"]), name=str(d["name"]), arguments=str(d["arguments"]))


@dataclass(frozen=True, slots=True)
class Message:
    """One conversation message in a provider-neutral form.

    - user/system: `content`.
    - assistant: `content` (may be None) and `tool_calls`.
    - tool: `content` (the result text) and `tool_call_id` (+ `name`).
    """

    role: Role
    content: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            d["tool_calls"] = [c.to_json() for c in self.tool_calls]
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            d["name"] = self.name
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Message:
        return cls(role=d["role"], content=d.get("content"),
                   tool_calls=tuple(ToolCall.from_json(c) for c in d.get("tool_calls", ())),
                   tool_call_id=d.get("tool_call_id"), name=d.get("name"))


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """A tool as offered to the model: a name, a description, a JSON schema."""

    name: str
    description: str
    parameters: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class Usage:
    input_tokens: int = 0
    output_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens


@dataclass(frozen=True, slots=True)
class ModelRequest:
    """Everything one model call needs. `timeout_s` is the per-request and per-chunk
    timeout already bounded by the turn's remaining time; `max_output_tokens` is already
    bounded by the token budget left. `turn_id` and `step` identify the call for logs and
    for the scripted provider; real providers do not send them."""

    system: str
    messages: Sequence[Message]
    tools: Sequence[ToolSpec]
    max_output_tokens: int
    timeout_s: float
    turn_id: str = ""
    step: int = 0
    metadata: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ModelReply:
    text: str | None
    tool_calls: tuple[ToolCall, ...]
    usage: Usage
    finish_reason: str
    model: str = ""


class ProviderError(Exception):
    """One failed attempt, described by one value."""

    def __init__(self, failure: CallFailure) -> None:
        super().__init__(failure.describe())
        self.failure = failure


DeltaSink = Callable[[str], Awaitable[None]]


class Provider(Protocol):
    """A model endpoint. `complete` makes one attempt; `aclose` releases connections."""

    @property
    def name(self) -> str: ...

    async def complete(self, request: ModelRequest, on_delta: DeltaSink | None = None
                       ) -> ModelReply: ...

    async def aclose(self) -> None: ...


def dumps_arguments(arguments: Mapping[str, Any]) -> str:
    """Compact JSON for tool arguments built by the daemon itself (scripted provider)."""
    return json.dumps(arguments, separators=(",", ":"), ensure_ascii=False)
