"""Anthropic Messages API (`POST {base_url}/v1/messages`, base_url "https://api.anthropic.com").

One attempt per `complete()`; every failure is a `ProviderError(CallFailure)` (see http.py).
A stream counts as complete only when `message_stop` arrived: anything shorter is an
`IncompleteStream`, never a shortened answer.

Prompt caching (`cache = "auto"`): an agent sends its whole, growing history every step,
so the stable prefix is marked for Anthropic's cache: the system prompt, the tools and the
latest message (three of the four breakpoints a request may carry). The next step's
request finds the previous prefix by looking back from its own last breakpoint, so one
mark on the history is enough while it grows. Reads and writes of the cache come back in
the usage and are priced apart. The provider's `options` go into the body as given, its
`headers` and `query` onto every request.

A turn's requests encode each message once (the turn's `MessageCache`): a request joins
the bytes of the messages before its last, and encodes only its last message, the one
the breakpoint goes on, from the messages it is made of.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp

from turnkeeper import jsonwire
from turnkeeper.config import ProviderConfig, ProviderSecrets
from turnkeeper.policy.output import mode_of
from turnkeeper.policy.replies import thinking_budget
from turnkeeper.providers.anthropic_replies import (
    OPAQUE_BLOCKS,
    parse_message,
    read_stream,
)
from turnkeeper.providers.base import (
    CACHED_FROM,
    DeltaSink,
    Message,
    MessageCache,
    ModelReply,
    ModelRequest,
    ToolSpec,
)
from turnkeeper.providers.http import HttpAdapter, HttpClient, dumps, request_headers
from turnkeeper.providers.structured import ANSWER_TOOL, prompt_system, with_answer_tool

API_VERSION = "2023-06-01"

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
            blocks = _assistant_blocks(m)
            if blocks:
                out.append({"role": "assistant", "content": blocks})
        elif role == "system":
            if m.content:
                systems.append(m.content)
        else:
            out.append({"role": "user", "content": m.content or ""})
    return "\n\n".join(systems), out


def encode_marked(system: str, messages: Sequence[Message], *, mark: bool
                  ) -> tuple[str, list[dict[str, Any]]]:
    """`encode_messages`, with the cache breakpoint on the last message when `mark`."""
    system, out = encode_messages(system, messages)
    if mark:
        mark_cache(out)
    return system, out


def _assistant_blocks(m: Message) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if m.content:
        blocks.append({"type": "text", "text": m.content})
    for c in m.tool_calls:
        blocks.append({"type": "tool_use", "id": c.id, "name": c.name,
                       "input": tool_input(c.arguments)})
    if blocks and m.opaque:  # thinking first, as it came (alone it makes no message)
        blocks[:0] = [dict(b) for b in m.opaque if b.get("type") in OPAQUE_BLOCKS]
    return blocks


def _makes_a_message(m: Message) -> bool:
    """Whether `m` is (or, a tool result, is part of) a message of the request."""
    if m.role == "assistant":
        return bool(m.content or m.tool_calls)
    return m.role != "system"


def _piece(m: Message, previous: Message | None) -> bytes:
    """What `m` adds to the encoded message list, after what the messages before it
    added: a comma and its message; a tool result its block, opening the user message
    that holds a run of them when it is the first; a message after a run closes it
    first. Joined in order, the pieces are the list's content with a leading comma (and
    the last run left open)."""
    after_results = previous is not None and previous.role == "tool"
    role = m.role
    if role == "tool":
        block = dumps({"type": "tool_result", "tool_use_id": m.tool_call_id or "",
                       "content": m.content or ""})
        return b"," + block if after_results else b',{"role":"user","content":[' + block
    close = b"]}" if after_results else b""
    if role == "assistant":
        blocks = _assistant_blocks(m)
        if not blocks:
            return close
        return close + b"," + dumps({"role": "assistant", "content": blocks})
    if role == "system":
        return close
    return close + b"," + dumps({"role": "user", "content": m.content or ""})


def cached_messages(system: str, messages: Sequence[Message], cache: MessageCache,
                    owner: object, *, mark: bool) -> tuple[str, jsonwire.Encoded]:
    """`encode_marked`, encoded, each message's piece from the turn's `cache`: only the
    messages new since the turn's last request are encoded. The last message of the
    request, the one a cache breakpoint goes on, is encoded as `encode_marked` does, from
    the messages it is made of."""
    tail = len(messages)
    if mark:
        tail = next((i for i in range(tail - 1, -1, -1) if _makes_a_message(messages[i])),
                    tail)
        while 0 < tail < len(messages) and messages[tail].role == "tool" \
                and messages[tail - 1].role == "tool":
            tail -= 1
    head = messages[:tail]
    data = b"".join(cache.encode(owner, head, _piece))
    if head and head[-1].role == "tool":
        data += b"]}"
    _, last = encode_marked("", messages[tail:], mark=mark)
    data += b"".join(b"," + dumps(d) for d in last)
    systems = [system] if system else []
    systems += [m.content for m in messages if m.role == "system" and m.content]
    return "\n\n".join(systems), jsonwire.Encoded(
        data=b"[" + data[1:] + b"]",
        value_of=lambda: encode_marked("", messages, mark=mark)[1])


def encode_tools(tools: Sequence[ToolSpec]) -> list[dict[str, Any]]:
    return [{"name": t.name, "description": t.description, "input_schema": dict(t.parameters)}
            for t in tools]


EPHEMERAL = {"type": "ephemeral"}


def mark_cache(messages: list[dict[str, Any]]) -> None:
    """Put a cache breakpoint on the last block of the latest message (in place: the
    message dicts are fresh on every encode). An empty text cannot carry one."""
    if not messages:
        return
    last = messages[-1]
    content = last["content"]
    if isinstance(content, str):
        if content:
            last["content"] = [{"type": "text", "text": content, "cache_control": EPHEMERAL}]
    elif content:
        content[-1] = {**content[-1], "cache_control": EPHEMERAL}


class AnthropicProvider(HttpAdapter):
    """Anthropic Messages over one shared aiohttp session."""

    def __init__(self, cfg: ProviderConfig, secrets: ProviderSecrets | None = None) -> None:
        """`secrets` as read by the caller (the runtime reads them once to compare across
        a reload); None reads them now."""
        self._cfg = cfg
        self._model = cfg.model
        self._stream = cfg.stream
        self._cache = cfg.cache == "auto"
        self._options = dict(cfg.options)
        self._thinking_budget = cfg.thinking_budget_tokens
        self._structured = mode_of(cfg.kind, cfg.structured_output)
        secrets = secrets if secrets is not None else cfg.secrets()
        key = secrets.api_key
        headers = {"content-type": "application/json", "accept": "application/json",
                   "anthropic-version": API_VERSION}
        if key:
            headers["x-api-key"] = key
        self._client = HttpClient(cfg.base_url.rstrip("/") + "/v1/messages",
                                  request_headers(headers, secrets.headers),
                                  max_connections=cfg.max_connections,
                                  secret=key, secrets=secrets.values(), query=secrets.query)
        # Encoded once per tool offer (the same object from one step to the next).
        self._tools_src: Sequence[ToolSpec] | None = None
        self._tools_json = jsonwire.Encoded([])

    @property
    def name(self) -> str:
        return self._cfg.name

    def encode(self, request: ModelRequest) -> bytes:
        cache, schema = request.cache, request.output_schema
        system = request.system
        if schema is not None and self._structured == "prompt":
            system = prompt_system(system, schema)
        messages: list[dict[str, Any]] | jsonwire.Encoded
        if cache is None or len(request.messages) < CACHED_FROM:
            system, messages = encode_marked(system, request.messages, mark=self._cache)
        else:
            system, messages = cached_messages(system, request.messages, cache,
                                               self, mark=self._cache)
        body: dict[str, Any] = {"model": self._model, "messages": messages,
                                "max_tokens": request.max_output_tokens,
                                "stream": self._stream}
        if system:
            body["system"] = ([{"type": "text", "text": system, "cache_control": EPHEMERAL}]
                              if self._cache else system)
        if request.tools:
            if request.tools is not self._tools_src:
                tools = encode_tools(request.tools)
                if self._cache:
                    tools[-1]["cache_control"] = EPHEMERAL
                self._tools_json = jsonwire.Encoded(tools)
                self._tools_src = request.tools
            body["tools"] = self._tools_json
        if self._options:
            body.update(self._options)
        if self._thinking_budget is not None:
            # The cap may have been cut to what is left of the turn's token budget: the
            # thinking budget goes under it (the model call stops before a cap that
            # cannot hold the smallest one).
            budget = thinking_budget(output_cap=request.max_output_tokens,
                                     budget_tokens=self._thinking_budget)
            if budget is not None and budget != self._thinking_budget:
                body["thinking"] = {**self._options["thinking"], "budget_tokens": budget}
        if schema is not None:
            self._ask_structured(body, request.tools, schema)
        return dumps(body)

    def _ask_structured(self, body: dict[str, Any], tools: Sequence[ToolSpec],
                        schema: Mapping[str, Any]) -> None:
        """`tool` (the default): the answer tool with the schema as its `input_schema`,
        and a `tool_choice` that makes the model call a tool (the answer tool by name
        when it is the only one, else `any`). Extended thinking accepts only `auto`: with
        it the choice is left to the model, which the answer tool's description and the
        turn's check of any plain-text answer steer. `native`: Anthropic's JSON outputs
        (`output_config.format` of type `json_schema`), on the models that have them."""
        if self._structured == "native":
            config = body.get("output_config")
            body["output_config"] = {**(config if isinstance(config, dict) else {}),
                                     "format": {"type": "json_schema", "schema": dict(schema)}}
        elif self._structured == "tool":
            offered = encode_tools(with_answer_tool(tools, schema))
            if self._cache:
                offered[-1]["cache_control"] = EPHEMERAL
            body["tools"] = offered
            if self._thinking_budget is not None or "thinking" in self._options:
                body["tool_choice"] = {"type": "auto"}
            else:
                body["tool_choice"] = ({"type": "any"} if tools
                                       else {"type": "tool", "name": ANSWER_TOOL})

    # -- replies -------------------------------------------------------------------------

    def _parse(self, obj: dict[str, Any]) -> ModelReply:
        return parse_message(self._client, obj, self._model)

    async def _read_stream(self, resp: aiohttp.ClientResponse, on_delta: DeltaSink | None
                           ) -> ModelReply:
        return await read_stream(self._client, resp, on_delta, self._model,
                                 idle_s=self._cfg.idle_timeout)
