"""Anthropic replies read: a message sent whole (JSON), or its event stream.

The finish reasons are mapped to the ones every adapter reports (`policy/replies.py`
judges them); a refusal's explanation is kept apart from the text; thinking and
redacted-thinking blocks are kept as they came, with their signatures (a stream's built
from its deltas), to go back with the tool calls they led to.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp

from turnkeeper.policy.usage import wire_count
from turnkeeper.providers.base import DeltaSink, ModelReply, ProviderError, ToolCall, Usage
from turnkeeper.providers.http import INCOMPLETE, HttpClient
from turnkeeper.providers.sse import IdleWatch, send_new_text, sse_reads

_STOP = {"end_turn": "stop", "stop_sequence": "stop", "tool_use": "tool_calls",
         "max_tokens": "length", "refusal": "refusal"}

# The stream events that build the reply; a `ping` (or an event type added later) only
# keeps the stream alive, and a stream of those alone is cut after `idle_timeout`.
_PROGRESS = frozenset({"message_start", "content_block_start", "content_block_delta",
                       "content_block_stop", "message_delta", "message_stop"})

# Content blocks that are not ours to read: thinking (with its signature) and redacted
# thinking. They go back unchanged, first in the assistant message, with the tool calls
# they led to (Anthropic rejects a tool-use continuation without them).
OPAQUE_BLOCKS = frozenset({"thinking", "redacted_thinking"})


def finish_reason(raw: object, has_tool_calls: bool) -> str:
    """end_turn -> stop, tool_use -> tool_calls, max_tokens -> length, refusal ->
    refusal; others pass."""
    if not raw:
        return "tool_calls" if has_tool_calls else "stop"
    return _STOP.get(str(raw), str(raw))


def refusal_text(stop_reason: object, details: object) -> str | None:
    """The explanation a refusal's `stop_details` carries, if any."""
    if stop_reason != "refusal" or not isinstance(details, dict):
        return None
    return str(details.get("explanation") or "") or None


def usage_of(u: dict[str, Any], output_tokens: float | None = None) -> Usage:
    """Anthropic reports uncached input, cache writes and cache reads apart; all three are
    input (what the token budget is charged), the last two priced apart. The figures go
    on as the wire gave them: the model call checks them before charging anything."""
    write = wire_count(u.get("cache_creation_input_tokens"))
    read = wire_count(u.get("cache_read_input_tokens"))
    out = wire_count(u.get("output_tokens")) if output_tokens is None else output_tokens
    return Usage(wire_count(u.get("input_tokens")) + write + read, out,
                 cache_read_tokens=read, cache_write_tokens=write)


def _streamed_block(start: dict[str, Any], pieces: list[str], signature: list[str]
                    ) -> dict[str, Any]:
    """A thinking block as its stream built it: the block it started as, its thinking
    and its signature joined from their deltas (a redacted block came whole)."""
    if start.get("type") != "thinking":
        return start
    return {**start, "thinking": (start.get("thinking") or "") + "".join(pieces),
            "signature": (start.get("signature") or "") + "".join(signature)}


def parse_message(client: HttpClient, obj: dict[str, Any], default_model: str) -> ModelReply:
    """A reply sent whole (JSON)."""
    if obj.get("type") == "error":
        raise ProviderError(client.stream_error_event(obj))
    text: list[str] = []
    calls: list[ToolCall] = []
    opaque: list[dict[str, Any]] = []
    for block in obj["content"]:
        kind = block.get("type")
        if kind == "text":
            text.append(block.get("text") or "")
        elif kind in OPAQUE_BLOCKS:
            opaque.append(block)
        elif kind == "tool_use":
            calls.append(ToolCall(
                id=str(block["id"]), name=str(block["name"]),
                arguments=json.dumps(block.get("input") or {}, separators=(",", ":"),
                                     ensure_ascii=False)))
    u = obj.get("usage") or {}
    return ModelReply(
        text="".join(text) if text else None, tool_calls=tuple(calls),
        usage=usage_of(u),
        finish_reason=finish_reason(obj.get("stop_reason"), bool(calls)),
        model=str(obj.get("model") or default_model),
        refusal=refusal_text(obj.get("stop_reason"), obj.get("stop_details")),
        opaque=tuple(opaque))


class _Streamed:
    """What the events of a streamed reply have said so far."""

    def __init__(self) -> None:
        self.text: list[str] = []
        self.blocks: dict[int, list[Any]] = {}  # tool_use index -> [id, name, [json]]
        # thinking index -> [the block as it started, [thinking pieces], [signature]]
        self.thinking: dict[int, list[Any]] = {}
        self.stop: str | None = None
        self.refusal: str | None = None
        self.input_usage: dict[str, Any] = {}
        self.output_tokens: float = 0
        self.model = ""
        self.done = False  # `message_stop` came: the reply is whole

    def take(self, obj: dict[str, Any]) -> None:
        kind = obj.get("type")
        if kind == "content_block_delta":
            self._delta(obj)
        elif kind == "content_block_start":
            self._start(obj)
        elif kind == "message_delta":
            d = obj.get("delta") or {}
            if d.get("stop_reason"):
                self.stop = d["stop_reason"]
                self.refusal = refusal_text(self.stop, d.get("stop_details"))
            u = obj.get("usage") or {}
            if u.get("output_tokens") is not None:
                self.output_tokens = wire_count(u["output_tokens"])
            if u.get("input_tokens"):  # newer servers repeat the input counts
                self.input_usage = u
        elif kind == "message_start":
            message = obj.get("message") or {}
            u = message.get("usage") or {}
            self.input_usage = u
            self.output_tokens = wire_count(u.get("output_tokens"))
            self.model = str(message.get("model") or "")
        elif kind == "message_stop":
            self.done = True
        # ping, content_block_stop and event types added later: nothing to do.

    def _delta(self, obj: dict[str, Any]) -> None:
        delta = obj.get("delta") or {}
        dtype = delta.get("type")
        if dtype == "text_delta":
            piece = delta.get("text")
            if piece:
                self.text.append(piece)
        elif dtype == "input_json_delta":
            slot = self.blocks.get(obj.get("index", -1))
            if slot is not None and delta.get("partial_json"):
                slot[2].append(delta["partial_json"])
        elif dtype in ("thinking_delta", "signature_delta"):
            th = self.thinking.get(obj.get("index", -1))
            if th is not None:
                if dtype == "thinking_delta":
                    th[1].append(delta.get("thinking") or "")
                else:
                    th[2].append(delta.get("signature") or "")

    def _start(self, obj: dict[str, Any]) -> None:
        block = obj.get("content_block") or {}
        btype = block.get("type")
        if btype == "tool_use":
            self.blocks[obj.get("index", len(self.blocks))] = [
                str(block.get("id") or ""), str(block.get("name") or ""), []]
        elif btype == "text" and block.get("text"):
            self.text.append(block["text"])
        elif btype in OPAQUE_BLOCKS:
            self.thinking[obj.get("index", len(self.thinking))] = [dict(block), [], []]

    def reply(self, default_model: str) -> ModelReply:
        calls = tuple(
            ToolCall(id=slot[0], name=slot[1], arguments="".join(slot[2]) or "{}")
            for _, slot in sorted(self.blocks.items()))
        return ModelReply(
            text="".join(self.text) if self.text else None, tool_calls=calls,
            usage=usage_of(self.input_usage, self.output_tokens),
            finish_reason=finish_reason(self.stop, bool(calls)),
            model=self.model or default_model, refusal=self.refusal,
            opaque=tuple(_streamed_block(*slot) for _, slot in sorted(self.thinking.items())))


async def read_stream(client: HttpClient, resp: aiohttp.ClientResponse,
                      on_delta: DeltaSink | None, default_model: str, *,
                      idle_s: float) -> ModelReply:
    """A streamed reply: whole only when `message_stop` arrived; cut when no event but
    `ping`s (or types added later) came for `idle_s`."""
    streamed = _Streamed()
    sent = 0  # pieces of `text` handed to `on_delta`
    async with IdleWatch(idle_s) as idle:
        async for events in sse_reads(client, resp):
            moved = False
            for obj in events:
                if obj.get("type") == "error":
                    raise ProviderError(client.stream_error_event(obj))
                moved = moved or obj.get("type") in _PROGRESS
                streamed.take(obj)
                if streamed.done:
                    await send_new_text(streamed.text, sent, on_delta)
                    return streamed.reply(default_model)
            if moved:
                idle.progressed()
            sent = await send_new_text(streamed.text, sent, on_delta)
    raise ProviderError(client.stream_failure(
        INCOMPLETE, "stream ended without message_stop"))
