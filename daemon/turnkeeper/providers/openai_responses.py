"""OpenAI's Responses API (`POST {base_url}/responses`), the one OpenAI's newest models
and the Responses-only ones (o1-pro, o3-pro, the deep-research models...) are served by.

Stateless: every request carries the whole conversation, with `store = false`, so
nothing is kept at OpenAI between steps. A reasoning model's reasoning comes back as
`reasoning` items whose `encrypted_content` is asked for (`include`); they go back in
the next request unchanged and in the order they came, around the function calls and
text they preceded, so the model keeps its reasoning across tool calls. They are kept
on the assistant `Message` (`opaque`), with place-holders for its text and calls to
keep the order, and checkpointed with it.

The provider's `options` go into the body as given (`store = true`, `reasoning =
{effort = "high"}`...), its `headers` and `query` onto every request, as for Chat
Completions (the session is built the same way, see openai.py). A reply is complete
only when `response.completed` or `response.incomplete` arrived: a stream that ends
before is an `IncompleteStream`; `response.failed` and `error` events are failures.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp

from turnkeeper import jsonwire
from turnkeeper.config import ProviderConfig, ProviderSecrets
from turnkeeper.policy.classify import CallFailure
from turnkeeper.policy.output import mode_of
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
    INCOMPLETE,
    STREAM_ERROR,
    HttpAdapter,
    HttpClient,
    dumps,
)
from turnkeeper.providers.openai import arguments_text, openai_client
from turnkeeper.providers.sse import IdleWatch, send_new_text, sse_reads
from turnkeeper.providers.structured import (
    ANSWER_TOOL,
    prompt_system,
    schema_name,
    with_answer_tool,
)

# Place-holders in `Message.opaque` for where the reply's text and each function call
# stood among its reasoning items.
TEXT_SLOT = "responses.text"
CALL_SLOT = "responses.call"
REASONING = "reasoning"
# Events that are progress (for the idle cut): text, a call's arguments, a refusal, an
# item begun or done. `response.created` / `in_progress` and keepalives are not.
_PROGRESS = frozenset({"response.output_text.delta", "response.refusal.delta",
                       "response.function_call_arguments.delta",
                       "response.output_item.added", "response.output_item.done",
                       "response.reasoning_summary_text.delta"})


def usage_of(u: Mapping[str, Any]) -> Usage:
    """`input_tokens` includes the cached part, `output_tokens` the reasoning tokens
    (billed as output)."""
    details = u.get("input_tokens_details") or {}
    return Usage(int(u.get("input_tokens") or 0), int(u.get("output_tokens") or 0),
                 cache_read_tokens=int(details.get("cached_tokens") or 0))


def finish_reason(response: Mapping[str, Any], has_tool_calls: bool) -> str:
    """completed -> stop / tool_calls; incomplete for `max_output_tokens` -> length, for
    `content_filter` -> content_filter; another reason passes through."""
    if response.get("status") == "incomplete":
        reason = str((response.get("incomplete_details") or {}).get("reason") or "")
        return "length" if reason == "max_output_tokens" else (reason or "incomplete")
    return "tool_calls" if has_tool_calls else "stop"


def failed(client: HttpClient, error: object) -> CallFailure:
    """A `response.failed` response's error, or an `error` event (both carry a `code`
    such as "server_error" or "rate_limit_exceeded", classified as an error type)."""
    err = error if isinstance(error, Mapping) else {}
    inner = err.get("error")
    if isinstance(inner, Mapping):
        err = inner
    kind = err.get("type")
    if kind in (None, "error"):  # an `error` event's own type says nothing
        kind = err.get("code")
    return CallFailure(error_type=str(kind) if kind else None, exception=STREAM_ERROR,
                       message=client.redact(str(err.get("message") or "response failed")))


def parse_response(obj: Mapping[str, Any], default_model: str) -> ModelReply:
    """A Response object (sent whole, or the one a stream's last event carries)."""
    text: list[str] = []
    refusal: list[str] = []
    calls: list[ToolCall] = []
    opaque: list[Mapping[str, Any]] = []
    for item in obj.get("output") or ():
        kind = item.get("type")
        if kind == "message":
            for part in item.get("content") or ():
                if part.get("type") == "output_text" and part.get("text"):
                    text.append(part["text"])
                elif part.get("type") == "refusal":
                    refusal.append(str(part.get("refusal") or ""))
            opaque.append({"type": TEXT_SLOT})
        elif kind == "function_call":
            call_id = str(item.get("call_id") or item.get("id") or "")
            calls.append(ToolCall(id=call_id, name=str(item["name"]),
                                  arguments=arguments_text(item.get("arguments"))))
            opaque.append({"type": CALL_SLOT, "call_id": call_id})
        elif kind == REASONING:
            opaque.append(dict(item))
    return ModelReply(
        text="".join(text) if text else None, tool_calls=tuple(calls),
        usage=usage_of(obj.get("usage") or {}),
        finish_reason=finish_reason(obj, bool(calls)),
        model=str(obj.get("model") or default_model),
        refusal="".join(refusal) if refusal else None,
        # Only a reply with reasoning has anything to carry (the slots alone say nothing).
        opaque=tuple(opaque) if any(o.get("type") == REASONING for o in opaque) else ())


# -- requests ------------------------------------------------------------------------------


def _call_item(c: ToolCall) -> dict[str, Any]:
    return {"type": "function_call", "call_id": c.id, "name": c.name,
            "arguments": c.arguments}


def assistant_items(m: Message) -> list[dict[str, Any]]:
    """An assistant message as input items: its reasoning items unchanged, its text and
    its function calls, in the order the reply had them (calls without a place, from
    another provider's reply, go last)."""
    text = [{"role": "assistant", "content": m.content}] if m.content else []
    calls = {c.id: c for c in m.tool_calls}
    out: list[dict[str, Any]] = []
    if any(o.get("type") == REASONING for o in m.opaque):
        for o in m.opaque:
            kind = o.get("type")
            if kind == REASONING:
                out.append(dict(o))
            elif kind == TEXT_SLOT:
                out += text
                text = []
            elif kind == CALL_SLOT and o.get("call_id") in calls:
                out.append(_call_item(calls.pop(str(o["call_id"]))))
    out += text
    out += (_call_item(c) for c in calls.values())
    return out


def encode_input(messages: Sequence[Message]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.role == "assistant":
            out += assistant_items(m)
        elif m.role == "tool":
            out.append({"type": "function_call_output", "call_id": m.tool_call_id or "",
                        "output": m.content or ""})
        else:
            out.append({"role": m.role, "content": m.content or ""})
    return out


def encode_tools(tools: Sequence[ToolSpec]) -> list[dict[str, Any]]:
    return [{"type": "function", "name": t.name, "description": t.description,
             "parameters": dict(t.parameters)} for t in tools]


class ResponsesProvider(HttpAdapter):
    """OpenAI Responses over one shared aiohttp session."""

    def __init__(self, cfg: ProviderConfig, secrets: ProviderSecrets | None = None) -> None:
        self._cfg = cfg
        self._model = cfg.model
        self._stream = cfg.stream
        self._options = dict(cfg.options)
        self._structured = mode_of(cfg.kind, cfg.structured_output)
        self._client = openai_client(cfg, secrets, "/responses")
        self._tools_src: Sequence[ToolSpec] | None = None
        self._tools_json = jsonwire.Encoded([])

    @property
    def name(self) -> str:
        return self._cfg.name

    def encode(self, request: ModelRequest) -> bytes:
        schema = request.output_schema
        system = request.system
        if schema is not None and self._structured == "prompt":
            system = prompt_system(system, schema)
        body: dict[str, Any] = {
            "model": self._model, "input": encode_input(request.messages),
            "max_output_tokens": request.max_output_tokens, "stream": self._stream,
            "store": False, "include": ["reasoning.encrypted_content"]}
        if system:
            body["instructions"] = system
        if request.tools:
            if request.tools is not self._tools_src:
                self._tools_json = jsonwire.Encoded(encode_tools(request.tools))
                self._tools_src = request.tools
            body["tools"] = self._tools_json
        if self._options:
            body.update(self._options)
        if schema is not None:
            self._ask_structured(body, request.tools, schema)
        return dumps(body)

    def _ask_structured(self, body: dict[str, Any], tools: Sequence[ToolSpec],
                        schema: Mapping[str, Any]) -> None:
        """`native`: `text.format` of type `json_schema` (name and schema; `strict` left
        out for the reason OpenAI's Chat Completions adapter gives). `tool`: the answer
        tool and a tool choice that makes the model call a tool."""
        if self._structured == "native":
            text = body.get("text")
            body["text"] = {**(text if isinstance(text, dict) else {}),
                            "format": {"type": "json_schema", "name": schema_name(schema),
                                       "schema": dict(schema)}}
        elif self._structured == "tool":
            body["tools"] = encode_tools(with_answer_tool(tools, schema))
            body["tool_choice"] = ("required" if tools
                                   else {"type": "function", "name": ANSWER_TOOL})

    def _parse(self, obj: dict[str, Any]) -> ModelReply:
        if obj.get("status") == "failed":
            raise ProviderError(failed(self._client, obj.get("error")))
        return parse_response(obj, self._model)

    async def _read_stream(self, resp: aiohttp.ClientResponse, on_delta: DeltaSink | None
                           ) -> ModelReply:
        client = self._client
        text: list[str] = []
        stream = _StreamedOutput()
        sent = 0
        async with IdleWatch(self._cfg.idle_timeout) as idle:
            async for events in sse_reads(client, resp):
                for obj in events:
                    kind = obj.get("type")
                    if kind == "response.output_text.delta":
                        piece = obj.get("delta")
                        if piece:
                            text.append(piece)
                            stream.text(obj, piece)
                    elif kind in ("response.completed", "response.incomplete"):
                        await send_new_text(text, sent, on_delta)
                        return parse_response(stream.response(obj.get("response") or {}),
                                              self._model)
                    elif kind == "response.failed":
                        raise ProviderError(failed(client, (obj.get("response") or {})
                                                   .get("error")))
                    elif kind == "error":
                        raise ProviderError(failed(client, obj))
                    else:
                        stream.event(kind, obj)
                if any(o.get("type") in _PROGRESS for o in events):
                    idle.progressed()
                sent = await send_new_text(text, sent, on_delta)
        raise ProviderError(client.stream_failure(
            INCOMPLETE, "stream ended without response.completed"))


class _StreamedOutput:
    """The output items of a stream as its events built them, by output index: whole
    from `response.output_item.done`, else as added with their deltas so far. The last
    event's response normally carries them all; these stand in where it does not."""

    __slots__ = ("_added", "_args", "_done", "_refusal", "_text")

    def __init__(self) -> None:
        self._added: dict[int, dict[str, Any]] = {}
        self._done: dict[int, dict[str, Any]] = {}
        self._args: dict[int, list[str]] = {}
        self._text: dict[int, list[str]] = {}
        self._refusal: dict[int, list[str]] = {}

    def text(self, obj: Mapping[str, Any], piece: str) -> None:
        self._text.setdefault(int(obj.get("output_index") or 0), []).append(piece)

    def event(self, kind: object, obj: Mapping[str, Any]) -> None:
        index = int(obj.get("output_index") or 0)
        if kind == "response.function_call_arguments.delta":
            self._args.setdefault(index, []).append(str(obj.get("delta") or ""))
        elif kind == "response.refusal.delta":
            self._refusal.setdefault(index, []).append(str(obj.get("delta") or ""))
        elif kind == "response.output_item.added":
            self._added[index] = dict(obj.get("item") or {})
        elif kind == "response.output_item.done":
            self._done[index] = dict(obj.get("item") or {})
        # created, in_progress, content parts, *.done of text and arguments, reasoning
        # summaries and event types added later: nothing to do.

    def response(self, response: Mapping[str, Any]) -> Mapping[str, Any]:
        if response.get("output"):
            return response
        items = []
        for index in sorted(self._added.keys() | self._done.keys()):
            item = self._done.get(index)
            if item is None:
                item = self._added[index]
                if item.get("type") == "function_call":
                    item["arguments"] = "".join(self._args.get(index, ()))
                elif item.get("type") == "message":
                    item["content"] = [
                        {"type": "output_text", "text": "".join(self._text.get(index, ()))},
                        *([{"type": "refusal", "refusal": "".join(self._refusal[index])}]
                          if index in self._refusal else [])]
            items.append(item)
        return {**response, "output": items}
