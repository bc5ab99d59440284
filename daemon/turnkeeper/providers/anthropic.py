"""Anthropic Messages API (`POST {base_url}/v1/messages`, base_url "https://api.anthropic.com").

One attempt per `complete()`; every failure is a `ProviderError(CallFailure)` (see http.py).
A stream counts as complete only when `message_stop` arrived: anything shorter is an
`IncompleteStream`, never a shortened answer.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import aiohttp

from turnkeeper.config import ProviderConfig
from turnkeeper.providers.base import (
    DeltaSink,
    Message,
    ModelReply,
    ModelRequest,
    ProviderError,
    ToolCall,
    ToolSpec,
    Usage,
)
from turnkeeper.providers.http import (
    CORRUPT,
    INCOMPLETE,
    TRANSPORT_ERRORS,
    HttpClient,
    SSEDecoder,
    dumps,
    exchange,
    loads,
)

API_VERSION = "2023-06-01"

_STOP = {"end_turn": "stop", "stop_sequence": "stop", "tool_use": "tool_calls",
         "max_tokens": "length", "refusal": "content_filter"}


def finish_reason(raw: object, has_tool_calls: bool) -> str:
    """end_turn -> stop, tool_use -> tool_calls, max_tokens -> length; others pass."""
    if not raw:
        return "tool_calls" if has_tool_calls else "stop"
    return _STOP.get(str(raw), str(raw))


def tool_input(arguments: str) -> dict[str, Any]:
    """The JSON object a tool call's arguments stand for; `{}` when they are not one (the
    model's malformed arguments were already classified when the call was made)."""
    try:
        value = json.loads(arguments) if arguments else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def encode_messages(system: str, messages: Sequence[Message]
                    ) -> tuple[str, list[dict[str, Any]]]:
    """Anthropic's shape: the system prompt apart; assistant text + tool_use blocks; tool
    results as tool_result blocks of one user message (consecutive results merged). A
    system message inside the history joins the system prompt (there is no system role)."""
    systems = [system] if system else []
    out: list[dict[str, Any]] = []
    results: list[dict[str, Any]] | None = None  # the open tool_result user message
    for m in messages:
        role = m.role
        if role == "tool":
            block = {"type": "tool_result", "tool_use_id": m.tool_call_id or "",
                     "content": m.content or ""}
            if results is None:
                results = [block]
                out.append({"role": "user", "content": results})
            else:
                results.append(block)
            continue
        results = None
        if role == "assistant":
            blocks: list[dict[str, Any]] = []
            if m.content:
                blocks.append({"type": "text", "text": m.content})
            for c in m.tool_calls:
                blocks.append({"type": "tool_use", "id": c.id, "name": c.name,
                               "input": tool_input(c.arguments)})
            if blocks:
                out.append({"role": "assistant", "content": blocks})
        elif role == "system":
            if m.content:
                systems.append(m.content)
        else:
            out.append({"role": "user", "content": m.content or ""})
    return "\n\n".join(systems), out


def encode_tools(tools: Sequence[ToolSpec]) -> list[dict[str, Any]]:
    return [{"name": t.name, "description": t.description, "input_schema": dict(t.parameters)}
            for t in tools]


def _input_tokens(u: dict[str, Any]) -> int:
    """Cache reads and writes are input too (Anthropic reports them apart)."""
    return (int(u.get("input_tokens") or 0) + int(u.get("cache_creation_input_tokens") or 0)
            + int(u.get("cache_read_input_tokens") or 0))


class AnthropicProvider:
    """Anthropic Messages over one shared aiohttp session."""

    def __init__(self, cfg: ProviderConfig) -> None:
        self._cfg = cfg
        self._model = cfg.model
        self._stream = cfg.stream
        key = cfg.api_key()
        headers = {"content-type": "application/json", "accept": "application/json",
                   "anthropic-version": API_VERSION}
        if key:
            headers["x-api-key"] = key
        self._client = HttpClient(cfg.base_url.rstrip("/") + "/v1/messages", headers,
                                  max_connections=cfg.max_connections, secret=key)
        self._tools_src: Sequence[ToolSpec] | None = None
        self._tools_json: list[dict[str, Any]] = []

    @property
    def name(self) -> str:
        return self._cfg.name

    def encode(self, request: ModelRequest) -> bytes:
        system, messages = encode_messages(request.system, request.messages)
        body: dict[str, Any] = {"model": self._model, "messages": messages,
                                "max_tokens": request.max_output_tokens,
                                "stream": self._stream}
        if system:
            body["system"] = system
        if request.tools:
            if request.tools is not self._tools_src:
                self._tools_json = encode_tools(request.tools)
                self._tools_src = request.tools
            body["tools"] = self._tools_json
        return dumps(body)

    async def complete(self, request: ModelRequest, on_delta: DeltaSink | None = None
                       ) -> ModelReply:
        return await exchange(self._client, self.encode(request), request.timeout_s,
                              stream=self._stream, parse=self._parse,
                              read_stream=self._read_stream, on_delta=on_delta)

    async def aclose(self) -> None:
        await self._client.aclose()

    # -- replies -------------------------------------------------------------------------

    def _parse(self, obj: dict[str, Any]) -> ModelReply:
        if obj.get("type") == "error":
            raise ProviderError(self._client.stream_error_event(obj))
        text: list[str] = []
        calls: list[ToolCall] = []
        for block in obj["content"]:
            kind = block.get("type")
            if kind == "text":
                text.append(block.get("text") or "")
            elif kind == "tool_use":
                calls.append(ToolCall(
                    id=str(block["id"]), name=str(block["name"]),
                    arguments=json.dumps(block.get("input") or {}, separators=(",", ":"),
                                         ensure_ascii=False)))
        u = obj.get("usage") or {}
        return ModelReply(
            text="".join(text) if text else None, tool_calls=tuple(calls),
            usage=Usage(_input_tokens(u), int(u.get("output_tokens") or 0)),
            finish_reason=finish_reason(obj.get("stop_reason"), bool(calls)),
            model=str(obj.get("model") or self._model))

    async def _read_stream(self, resp: aiohttp.ClientResponse, on_delta: DeltaSink | None
                           ) -> ModelReply:
        client = self._client
        read = resp.content.readany
        decoder = SSEDecoder()
        text: list[str] = []
        blocks: dict[int, list[Any]] = {}  # tool_use index -> [id, name, [json fragments]]
        stop: str | None = None
        input_tokens = output_tokens = 0
        model = ""
        eof = False
        while not eof:
            try:
                chunk = await read()
            except TRANSPORT_ERRORS as exc:
                raise ProviderError(client.stream_read_failure(exc)) from exc
            if chunk:
                events = decoder.feed(chunk)
            else:
                events, eof = decoder.flush(), True
            for data in events:
                obj = loads(data)
                if not isinstance(obj, dict):
                    raise ProviderError(client.stream_failure(
                        CORRUPT, "stream event is not a JSON object"))
                kind = obj.get("type")
                if kind == "content_block_delta":
                    delta = obj.get("delta") or {}
                    dtype = delta.get("type")
                    if dtype == "text_delta":
                        piece = delta.get("text")
                        if piece:
                            text.append(piece)
                            if on_delta is not None:
                                await on_delta(piece)
                    elif dtype == "input_json_delta":
                        slot = blocks.get(obj.get("index", -1))
                        if slot is not None and delta.get("partial_json"):
                            slot[2].append(delta["partial_json"])
                elif kind == "content_block_start":
                    block = obj.get("content_block") or {}
                    btype = block.get("type")
                    if btype == "tool_use":
                        blocks[obj.get("index", len(blocks))] = [
                            str(block.get("id") or ""), str(block.get("name") or ""), []]
                    elif btype == "text" and block.get("text"):
                        piece = block["text"]
                        text.append(piece)
                        if on_delta is not None:
                            await on_delta(piece)
                elif kind == "message_delta":
                    d = obj.get("delta") or {}
                    if d.get("stop_reason"):
                        stop = d["stop_reason"]
                    u = obj.get("usage") or {}
                    if u.get("output_tokens") is not None:
                        output_tokens = int(u["output_tokens"])
                    if u.get("input_tokens"):
                        input_tokens = _input_tokens(u)
                elif kind == "message_start":
                    message = obj.get("message") or {}
                    u = message.get("usage") or {}
                    input_tokens = _input_tokens(u)
                    output_tokens = int(u.get("output_tokens") or 0)
                    model = str(message.get("model") or "")
                elif kind == "message_stop":
                    calls = tuple(
                        ToolCall(id=slot[0], name=slot[1], arguments="".join(slot[2]) or "{}")
                        for _, slot in sorted(blocks.items()))
                    return ModelReply(
                        text="".join(text) if text else None, tool_calls=calls,
                        usage=Usage(input_tokens, output_tokens),
                        finish_reason=finish_reason(stop, bool(calls)),
                        model=model or self._model)
                elif kind == "error":
                    raise ProviderError(client.stream_error_event(obj))
                # ping, content_block_stop and event types added later: nothing to do.
        raise ProviderError(client.stream_failure(
            INCOMPLETE, "stream ended without message_stop"))
