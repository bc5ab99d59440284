"""The one protocol every model provider speaks.

A provider makes exactly one attempt per `complete()` call: no retries, no failover, no
sleeping. It either returns a `ModelReply` or raises `ProviderError` carrying one
`CallFailure` value; the resilience layer above decides what that failure means.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from turnkeeper.errors import TurnkeeperError
from turnkeeper.messages import Message, ToolCall, ToolSpec
from turnkeeper.policy.classify import CallFailure


@dataclass(frozen=True, slots=True)
class Usage:
    """Tokens of one reply, the same for every wire format. `input_tokens` counts all of
    the input, cached or not (it is what the token budget is charged); the cache counts
    are the parts of it read from or written to the provider's prompt cache, kept apart
    only because they are priced apart (OpenAI's `cached_tokens` is a read; Anthropic
    reports reads and writes)."""

    input_tokens: int = 0
    output_tokens: int = 0
    cache_read_tokens: int = 0
    cache_write_tokens: int = 0

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


class ProviderError(TurnkeeperError):
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


__all__ = ["DeltaSink", "Message", "ModelReply", "ModelRequest", "Provider", "ProviderError",
           "ToolCall", "ToolSpec", "Usage"]
