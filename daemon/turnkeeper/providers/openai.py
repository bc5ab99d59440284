"""Any OpenAI-compatible Chat Completions endpoint (`POST {base_url}/chat/completions`).

The provider's `options` go into the body as given, its `headers` and `query` onto every
request (Azure OpenAI: an `api-key` header and an `api-version` query). OpenAI caches
long prompt prefixes by itself, so `cache` marks nothing here; the cached part of the
input is read from `usage.prompt_tokens_details.cached_tokens` and priced apart.

One attempt per `complete()`; every failure is a `ProviderError(CallFailure)` (see http.py).
A stream counts as complete only when it carried a finish reason and the `[DONE]`
terminator: anything shorter is an `IncompleteStream`, never a shortened answer.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp

from turnkeeper import jsonwire
from turnkeeper.config import ProviderConfig, ProviderSecrets
from turnkeeper.policy.output import mode_of
from turnkeeper.policy.usage import wire_count
from turnkeeper.providers.base import (
    CACHED_FROM,
    DeltaSink,
    Message,
    MessageCache,
    ModelReply,
    ModelRequest,
    ProviderError,
    ToolCall,
    ToolSpec,
    Usage,
)
from turnkeeper.providers.http import (
    INCOMPLETE,
    HttpAdapter,
    HttpClient,
    dumps,
    request_headers,
)
from turnkeeper.providers.sse import SSE_DONE, IdleWatch, send_new_text, sse_reads
from turnkeeper.providers.structured import (
    ANSWER_TOOL,
    prompt_system,
    schema_name,
    with_answer_tool,
)

_FINISH = {"stop": "stop", "tool_calls": "tool_calls", "function_call": "tool_calls",
           "length": "length"}


def finish_reason(raw: object, has_tool_calls: bool) -> str:
    """stop / tool_calls / length; other values (content_filter...) pass through. A
    refusal has no finish reason of its own here: it comes as the message's `refusal`
    text (content null) with "stop"."""
    if not raw:
        return "tool_calls" if has_tool_calls else "stop"
    return _FINISH.get(str(raw), str(raw))


# Reasoning models (o1, o3, o4-mini, gpt-5...) reject `max_tokens`: they take
# `max_completion_tokens`. Matched on the model's last path segment ("openai/o3-mini").
_COMPLETION_TOKENS_MODELS = re.compile(r"^(o\d|gpt-5)")


def max_tokens_field(cfg: ProviderConfig) -> str:
    """The body field that carries the output limit: the configured one, else the one the
    model family takes."""
    if cfg.max_tokens_field != "auto":
        return cfg.max_tokens_field
    model = cfg.model.rsplit("/", 1)[-1].lower()
    return "max_completion_tokens" if _COMPLETION_TOKENS_MODELS.match(model) else "max_tokens"


def usage_of(u: Mapping[str, Any]) -> Usage:
    """`prompt_tokens` includes the cached part, reported in `prompt_tokens_details`."""
    details = u.get("prompt_tokens_details") or {}
    return Usage(wire_count(u.get("prompt_tokens")), wire_count(u.get("completion_tokens")),
                 cache_read_tokens=wire_count(details.get("cached_tokens")))


def arguments_text(raw: object) -> str:
    """The raw argument text; "{}" when empty. A server that sends an object instead of
    a string (some compatible servers do) gets it back as compact JSON."""
    if isinstance(raw, str):
        return raw or "{}"
    if raw is None:
        return "{}"
    return json.dumps(raw, separators=(",", ":"), ensure_ascii=False)


def encode_message(m: Message) -> dict[str, Any]:
    role = m.role
    if role == "assistant":
        d: dict[str, Any] = {"role": "assistant", "content": m.content}
        if m.tool_calls:
            d["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.name, "arguments": c.arguments}}
                for c in m.tool_calls]
        elif m.content is None:
            d["content"] = ""
        return d
    if role == "tool":
        return {"role": "tool", "tool_call_id": m.tool_call_id or "", "content": m.content or ""}
    return {"role": role, "content": m.content or ""}


def _encoded_message(m: Message, previous: Message | None) -> bytes:
    return dumps(encode_message(m))


def encode_messages(system: str, messages: Sequence[Message]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    out += map(encode_message, messages)
    return out


def cached_messages(system: str, messages: Sequence[Message], cache: MessageCache,
                    owner: object) -> jsonwire.Encoded:
    """`encode_messages`, encoded, with each message's bytes from the turn's `cache`:
    only the messages new since the turn's last request are encoded."""
    data = cache.encode(owner, messages, _encoded_message)
    if system:
        data = [dumps({"role": "system", "content": system}), *data]
    return jsonwire.Encoded(data=b"[" + b",".join(data) + b"]",
                            value_of=lambda: encode_messages(system, messages))


def encode_tools(tools: Sequence[ToolSpec]) -> list[dict[str, Any]]:
    return [{"type": "function",
             "function": {"name": t.name, "description": t.description,
                          "parameters": dict(t.parameters)}}
            for t in tools]


class _StreamedReply:
    """A streamed reply as its chunks build it."""

    __slots__ = ("calls", "finish", "model", "refusal", "text", "usage")

    def __init__(self) -> None:
        self.text: list[str] = []
        self.refusal: list[str] = []
        self.calls: dict[int, list[Any]] = {}  # index -> [id, name, [argument fragments]]
        self.finish: str | None = None
        self.usage: dict[str, Any] | None = None
        self.model = ""

    def take(self, obj: dict[str, Any]) -> bool:
        """Add one chunk; True when it brought progress (text, a refusal, a piece of a
        tool call, a finish reason or the usage), False for a chunk that only keeps the
        stream alive."""
        moved = False
        choices = obj.get("choices")
        if choices:
            ch = choices[0]
            delta = ch.get("delta")
            if delta:
                piece = delta.get("content")
                if piece:
                    self.text.append(piece)
                    moved = True
                if delta.get("refusal"):
                    self.refusal.append(delta["refusal"])
                    moved = True
                tcs = delta.get("tool_calls")
                if tcs:
                    moved = True
                    for tc in tcs:
                        self._tool_call_piece(tc)
            if ch.get("finish_reason"):
                self.finish = ch["finish_reason"]
                moved = True
        u = obj.get("usage")
        if u:
            self.usage = u
            moved = True
        if not self.model and obj.get("model"):
            self.model = obj["model"]
        return moved

    def _tool_call_piece(self, tc: dict[str, Any]) -> None:
        index = tc.get("index", 0)
        slot = self.calls.get(index)
        if slot is None:
            slot = self.calls[index] = ["", "", []]
        if tc.get("id"):
            slot[0] = tc["id"]
        fn = tc.get("function")
        if fn:
            if fn.get("name"):
                slot[1] += fn["name"]
            if fn.get("arguments"):
                slot[2].append(fn["arguments"])


def openai_client(cfg: ProviderConfig, secrets: ProviderSecrets | None, path: str
                  ) -> HttpClient:
    """The session of an OpenAI endpoint (`path` under `base_url`): the key as a bearer
    token, the provider's `headers` on top and its `query` on the URL (Azure's
    `api-version`). `secrets` as read by the caller; None reads them now."""
    secrets = secrets if secrets is not None else cfg.secrets()
    key = secrets.api_key
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    return HttpClient(cfg.base_url.rstrip("/") + path,
                      request_headers(headers, secrets.headers),
                      max_connections=cfg.max_connections,
                      secret=key, secrets=secrets.values(), query=secrets.query)


class OpenAIProvider(HttpAdapter):
    """OpenAI Chat Completions over one shared aiohttp session."""

    def __init__(self, cfg: ProviderConfig, secrets: ProviderSecrets | None = None) -> None:
        """`secrets` as read by the caller (the runtime reads them once to compare across
        a reload); None reads them now."""
        self._cfg = cfg
        self._model = cfg.model
        self._stream = cfg.stream
        self._max_tokens_field = max_tokens_field(cfg)
        self._options = dict(cfg.options)
        self._structured = mode_of(cfg.kind, cfg.structured_output)
        self._client = openai_client(cfg, secrets, "/chat/completions")
        # The tool list is the same object from one step to the next until the offer
        # changes (a policy's tools; MCP servers going and coming): encoded once for it.
        self._tools_src: Sequence[ToolSpec] | None = None
        self._tools_json = jsonwire.Encoded([])

    @property
    def name(self) -> str:
        return self._cfg.name

    def encode(self, request: ModelRequest) -> bytes:
        cache, messages, schema = request.cache, request.messages, request.output_schema
        system = request.system
        if schema is not None and self._structured == "prompt":
            system = prompt_system(system, schema)
        body: dict[str, Any] = {
            "model": self._model,
            "messages": encode_messages(system, messages)
            if cache is None or len(messages) < CACHED_FROM
            else cached_messages(system, messages, cache, self),
            self._max_tokens_field: request.max_output_tokens,
            "stream": self._stream,
        }
        if request.tools:
            if request.tools is not self._tools_src:
                self._tools_json = jsonwire.Encoded(encode_tools(request.tools))
                self._tools_src = request.tools
            body["tools"] = self._tools_json
        if self._stream:
            body["stream_options"] = {"include_usage": True}
        if self._options:
            body.update(self._options)
        if schema is not None:
            self._ask_structured(body, request.tools, schema)
        return dumps(body)

    def _ask_structured(self, body: dict[str, Any], tools: Sequence[ToolSpec],
                        schema: Mapping[str, Any]) -> None:
        """`native`: `response_format` of type `json_schema`, the schema as given.
        `strict` is left out (false): strict mode takes only schemas where every object
        lists all its properties as required and forbids others, and refuses keywords a
        caller's schema may well use; sent with one that does not qualify, every call
        would be a 400. The turn validates each answer itself either way.
        `tool`: the answer tool, and a tool choice that makes the model call a tool."""
        if self._structured == "native":
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": schema_name(schema), "schema": dict(schema)}}
        elif self._structured == "tool":
            body["tools"] = encode_tools(with_answer_tool(tools, schema))
            body["tool_choice"] = ("required" if tools else
                                   {"type": "function", "function": {"name": ANSWER_TOOL}})

    # -- replies -------------------------------------------------------------------------

    def _parse(self, obj: dict[str, Any]) -> ModelReply:
        choice = obj["choices"][0]
        msg = choice.get("message") or {}
        calls = tuple(
            ToolCall(id=str(c.get("id") or ""), name=str(c["function"]["name"]),
                     arguments=arguments_text(c["function"].get("arguments")))
            for c in msg.get("tool_calls") or ())
        u = obj.get("usage") or {}
        return ModelReply(
            text=msg.get("content"), tool_calls=calls,
            usage=usage_of(u),
            finish_reason=finish_reason(choice.get("finish_reason"), bool(calls)),
            model=str(obj.get("model") or self._model),
            refusal=str(msg.get("refusal") or "") or None)

    async def _read_stream(self, resp: aiohttp.ClientResponse, on_delta: DeltaSink | None
                           ) -> ModelReply:
        client = self._client
        reply = _StreamedReply()
        sent = 0  # pieces of `text` handed to `on_delta`
        async with IdleWatch(self._cfg.idle_timeout) as idle:
            async for events in sse_reads(client, resp, done=b"[DONE]"):
                moved = False
                for obj in events:
                    if obj is SSE_DONE:
                        if reply.finish is None:
                            raise ProviderError(client.stream_failure(
                                INCOMPLETE, "[DONE] without a finish reason"))
                        await send_new_text(reply.text, sent, on_delta)
                        return self._stream_reply(reply.text, reply.calls, reply.finish,
                                                  reply.usage, reply.model, reply.refusal)
                    if "error" in obj and not obj.get("choices"):
                        raise ProviderError(client.stream_error_event(obj))
                    moved = reply.take(obj) or moved
                if moved:
                    idle.progressed()
                sent = await send_new_text(reply.text, sent, on_delta)
        raise ProviderError(client.stream_failure(
            INCOMPLETE, "stream ended without [DONE]" if reply.finish else
            "stream ended without a finish reason"))

    def _stream_reply(self, text: list[str], calls: dict[int, list[Any]], finish: str,
                      usage: dict[str, Any] | None, model: str, refusal: list[str]
                      ) -> ModelReply:
        tool_calls = tuple(
            ToolCall(id=slot[0], name=slot[1], arguments="".join(slot[2]) or "{}")
            for _, slot in sorted(calls.items()))
        u = usage or {}
        return ModelReply(
            text="".join(text) if text else None, tool_calls=tool_calls,
            usage=usage_of(u),
            finish_reason=finish_reason(finish, bool(tool_calls)),
            model=model or self._model, refusal="".join(refusal) or None)
