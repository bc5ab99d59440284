"""The one protocol every model provider speaks.

A provider makes exactly one attempt per `complete()` call: no retries, no failover, no
sleeping. It either returns a `ModelReply` or raises `ProviderError` carrying one
`CallFailure` value; the resilience layer above decides what that failure means.
"""

from __future__ import annotations

import operator
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import field
from typing import Any, Protocol

from turnkeeper import jsonwire
from turnkeeper.errors import TurnkeeperError
from turnkeeper.messages import Message, ToolCall, ToolSpec
from turnkeeper.policy.classify import CallFailure
from turnkeeper.values import value_class


@value_class
class Usage:
    """Tokens of one reply, the same for every wire format. `input_tokens` counts all of
    the input, cached or not (it is what the token budget is charged); the cache counts
    are the parts of it read from or written to the provider's prompt cache, kept apart
    only because they are priced apart (OpenAI's `cached_tokens` is a read; Anthropic
    reports reads and writes).

    The figures are the provider's word, not yet checked: an adapter passes them on as
    its wire gave them (`policy.usage.wire_count`), and the model call charges them only
    once `policy.usage.metered` has found them whole, non-negative and possible."""

    input_tokens: float = 0
    output_tokens: float = 0
    cache_read_tokens: float = 0
    cache_write_tokens: float = 0

    @property
    def total_tokens(self) -> float:
        return self.input_tokens + self.output_tokens


# A request of fewer messages is encoded whole: below this the cache costs more than it
# saves (OpenAI's adapter: 1 message 2.4 us without it, 4.4 with; 21 messages: 19 us
# against 5).
CACHED_FROM = 8


class MessageCache:
    """One turn's messages as an adapter encoded them for its last request, kept for the
    next: between steps the conversation only grows (the same `Message` objects, and
    more), so a request encodes only the messages added since, not the whole history
    again (a turn 200 steps in, 401 messages: 360 us a request, 29 us with the cache).
    A compaction replaces messages, and everything from the first one that is not the
    same object is encoded again; a request through another adapter (a fallback) starts
    afresh. The turn's model call holds one; an adapter that encodes messages one by one
    uses it."""

    __slots__ = ("_data", "_owner", "_seen")

    def __init__(self) -> None:
        self._owner: object = None
        self._seen: list[Message] = []
        self._data: list[bytes] = []

    def encode(self, owner: object, messages: Sequence[Message],
               one: Callable[[Message, Message | None], bytes]) -> list[bytes]:
        """Each of `messages` as `owner`'s `one` encodes it (given the message and the
        one before it, None for the first), from the cache where the message and all
        before it are the ones encoded last time. The list returned is the cache's own,
        valid until its next `encode`."""
        if owner is not self._owner:
            self._owner, self._seen, self._data = owner, [], []
        seen, data = self._seen, self._data
        kept = len(seen)
        if kept > len(messages) or not all(map(operator.is_, seen, messages)):
            kept = next((i for i, (a, b) in enumerate(zip(seen, messages, strict=False))
                         if a is not b), min(kept, len(messages)))
            del seen[kept:], data[kept:]
        previous = seen[-1] if seen else None
        for m in messages[kept:]:
            seen.append(m)
            # Kept for the turn's life: right-sized (orjson's output sits in 4 KiB).
            data.append(jsonwire.kept(one(m, previous)))
            previous = m
        return data


@value_class
class ModelRequest:
    """Everything one model call needs. `timeout_s` is the per-request and per-chunk
    timeout already bounded by the turn's remaining time; `max_output_tokens` is already
    bounded by the token budget left. `turn_id` and `step` identify the call for logs and
    for the scripted provider; real providers do not send them. `cache` is the turn's
    `MessageCache`, for an adapter that uses one (None: every message is encoded).
    `traceparent` (W3C trace context) goes out as the request's header when set.
    `output_schema` is the JSON Schema the final answer must match (None: free text),
    asked for in the provider's `structured_output` mode (`providers/structured.py`)."""

    system: str
    messages: Sequence[Message]
    tools: Sequence[ToolSpec]
    max_output_tokens: int
    timeout_s: float
    turn_id: str = ""
    step: int = 0
    metadata: Mapping[str, Any] = field(default_factory=dict)
    cache: MessageCache | None = field(default=None, compare=False, repr=False)
    traceparent: str | None = None
    output_schema: Mapping[str, Any] | None = None


@value_class
class ModelReply:
    """One reply. `finish_reason` is "stop", "tool_calls", "length" (the output cap cut
    it), "refusal" or "content_filter" (the model or its provider declined), or the
    provider's own word. `refusal` is the model's refusal text where the wire carries
    one apart from the content (OpenAI's `refusal`, Anthropic's stop explanation);
    `opaque` the provider-opaque blocks the reply must be sent back with (see
    `Message.opaque`)."""

    text: str | None
    tool_calls: tuple[ToolCall, ...]
    usage: Usage
    finish_reason: str
    model: str = ""
    refusal: str | None = None
    opaque: tuple[Mapping[str, Any], ...] = ()


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
