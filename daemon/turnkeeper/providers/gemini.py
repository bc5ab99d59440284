"""The Gemini API (`POST {base_url}/v1beta/models/{model}:generateContent`, streamed:
`:streamGenerateContent?alt=sse`; base_url "https://generativelanguage.googleapis.com").

The base URL is the host, as google-genai takes it (`GOOGLE_GEMINI_BASE_URL`), the API
version appended; a base URL that ends in a version (`.../v1beta`, `.../v1`) is used as
it is.

The key goes in `x-goog-api-key` (`GOOGLE_API_KEY`, else `GEMINI_API_KEY`, as the
google-genai SDK reads them). The system prompt is `systemInstruction`, tools are
`functionDeclarations` (their JSON schema as `parametersJsonSchema`, which takes any
JSON Schema), calls and results are `functionCall` and `functionResponse` parts.

A thinking model signs its parts (`thoughtSignature`) and rejects a function call sent
back without its signature: the reply's parts are kept on the assistant `Message`
(`opaque`) as they came (adjacent plain text pieces of a stream joined, a signed part
never touched) and sent back as they are. A call from another provider's reply (a
fallback) has no signature: it goes with the placeholder Google documents for a
conversation that did not come from Gemini.

A finish of SAFETY, PROHIBITED_CONTENT, BLOCKLIST, RECITATION (and the other blocking
reasons) or a blocked prompt (`promptFeedback.blockReason`) is the content filter's
refusal; MAX_TOKENS is a cut answer. A stream is complete when a chunk carried a finish
reason and the body ended; a 429's `retryDelay` (a `RetryInfo` detail) is read like
Retry-After (see policy/classify.py).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp

from turnkeeper import jsonwire
from turnkeeper.config import ProviderConfig, ProviderSecrets
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
    HttpAdapter,
    HttpClient,
    dumps,
    request_headers,
)
from turnkeeper.providers.sse import IdleWatch, send_new_text, sse_reads
from turnkeeper.providers.structured import ANSWER_TOOL, prompt_system, with_answer_tool

PARTS = "gemini.parts"  # the `Message.opaque` entry holding a reply's parts
# The id of a call Gemini gave none: ours, never sent back.
_OUR_ID = "tk-gemini-"
# What Google documents for a function call whose signature is not Gemini's own (a
# call made through another provider).
SKIP_SIGNATURE = "skip_thought_signature_validator"

_FINISH = {"STOP": "stop", "MAX_TOKENS": "length"}
# Finish reasons that say the answer was blocked: the content filter's refusal.
BLOCKED = frozenset({"SAFETY", "PROHIBITED_CONTENT", "BLOCKLIST", "RECITATION", "SPII",
                     "IMAGE_SAFETY", "IMAGE_PROHIBITED_CONTENT"})


def finish_reason(raw: object, has_tool_calls: bool) -> str:
    raw = str(raw or "")
    if raw in BLOCKED:
        return "content_filter"
    if raw in ("", "STOP", "FINISH_REASON_UNSPECIFIED"):
        return "tool_calls" if has_tool_calls else "stop"
    return _FINISH.get(raw, raw.lower())


def usage_of(u: Mapping[str, Any]) -> Usage:
    """`promptTokenCount` includes the cached part (`cachedContentTokenCount`); a tool's
    prompt tokens are input too; thoughts are billed as output."""
    return Usage(int(u.get("promptTokenCount") or 0) + int(u.get("toolUsePromptTokenCount")
                                                          or 0),
                 int(u.get("candidatesTokenCount") or 0) + int(u.get("thoughtsTokenCount")
                                                              or 0),
                 cache_read_tokens=int(u.get("cachedContentTokenCount") or 0))


def _args_text(args: object) -> str:
    return json.dumps(args if args is not None else {}, separators=(",", ":"),
                      ensure_ascii=False)


def reply_of(parts: Sequence[Mapping[str, Any]], finish: object, usage: Mapping[str, Any],
             model: str, prompt_feedback: Mapping[str, Any] | None = None) -> ModelReply:
    """One reply from its parts (a thought's text is not the answer)."""
    if prompt_feedback and prompt_feedback.get("blockReason"):
        return ModelReply(text=None, tool_calls=(), usage=usage_of(usage),
                          finish_reason="content_filter", model=model)
    text: list[str] = []
    calls: list[ToolCall] = []
    for part in parts:
        call = part.get("functionCall")
        if call is not None:
            calls.append(ToolCall(id=str(call.get("id") or _OUR_ID + uuid.uuid4().hex[:12]),
                                  name=str(call["name"]), arguments=_args_text(call.get("args"))))
        elif part.get("text") and not part.get("thought"):
            text.append(str(part["text"]))
    signed = any("thoughtSignature" in p or p.get("thought") for p in parts)
    return ModelReply(
        text="".join(text) if text else None, tool_calls=tuple(calls), usage=usage_of(usage),
        finish_reason=finish_reason(finish, bool(calls)), model=model,
        opaque=({"type": PARTS, "parts": [dict(p) for p in parts]},) if signed else ())


# -- requests ------------------------------------------------------------------------------


def _tool_args(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments) if arguments else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def model_parts(m: Message) -> list[dict[str, Any]]:
    """An assistant message's parts: those Gemini sent, as they were, else built from
    its text and calls (the first call with the placeholder signature)."""
    for o in m.opaque:
        if o.get("type") == PARTS and isinstance(o.get("parts"), list):
            return [dict(p) for p in o["parts"]]
    parts: list[dict[str, Any]] = [{"text": m.content}] if m.content else []
    for i, c in enumerate(m.tool_calls):
        call: dict[str, Any] = {"name": c.name, "args": _tool_args(c.arguments)}
        if not c.id.startswith(_OUR_ID):
            call["id"] = c.id
        part: dict[str, Any] = {"functionCall": call}
        if i == 0:
            part["thoughtSignature"] = SKIP_SIGNATURE
        parts.append(part)
    return parts


def encode_contents(system: str, messages: Sequence[Message]
                    ) -> tuple[str, list[dict[str, Any]]]:
    """The system text (the prompt and any system message of the history) and the
    contents: a run of tool results is one user content of `functionResponse` parts."""
    systems = [system] if system else []
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}
    results: list[dict[str, Any]] | None = None
    for m in messages:
        if m.role == "tool":
            call_id = m.tool_call_id or ""
            response: dict[str, Any] = {"name": m.name or names.get(call_id, ""),
                                        "response": {"result": m.content or ""}}
            if call_id and not call_id.startswith(_OUR_ID):
                response["id"] = call_id
            part = {"functionResponse": response}
            if results is None:
                results = [part]
                out.append({"role": "user", "parts": results})
            else:
                results.append(part)
            continue
        results = None
        if m.role == "assistant":
            names.update((c.id, c.name) for c in m.tool_calls)
            parts = model_parts(m)
            if parts:
                out.append({"role": "model", "parts": parts})
        elif m.role == "system":
            if m.content:
                systems.append(m.content)
        else:
            out.append({"role": "user", "parts": [{"text": m.content or ""}]})
    return "\n\n".join(systems), out


def encode_tools(tools: Sequence[ToolSpec]) -> list[dict[str, Any]]:
    return [{"functionDeclarations": [
        {"name": t.name, "description": t.description,
         "parametersJsonSchema": dict(t.parameters)} for t in tools]}]


def versioned(base_url: str) -> str:
    """The base URL with the API version: `/v1beta` appended unless it ends in one."""
    base = base_url.rstrip("/")
    return base if _VERSION.search(base) else base + "/" + API_VERSION


API_VERSION = "v1beta"
_VERSION = re.compile(r"/v\d+(?:alpha|beta)?$")


class GeminiProvider(HttpAdapter):
    """The Gemini API over one shared aiohttp session."""

    def __init__(self, cfg: ProviderConfig, secrets: ProviderSecrets | None = None) -> None:
        self._cfg = cfg
        self._model = cfg.model.removeprefix("models/")
        self._stream = cfg.stream
        self._options = dict(cfg.options)
        self._structured = mode_of(cfg.kind, cfg.structured_output)
        secrets = secrets if secrets is not None else cfg.secrets()
        key = secrets.api_key
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if key:
            headers["x-goog-api-key"] = key
        method = "streamGenerateContent" if self._stream else "generateContent"
        query = {**secrets.query, "alt": "sse"} if self._stream else secrets.query
        self._client = HttpClient(
            f"{versioned(cfg.base_url)}/models/{self._model}:{method}",
            request_headers(headers, secrets.headers), max_connections=cfg.max_connections,
            secret=key, secrets=secrets.values(), query=query)
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
        system, contents = encode_contents(system, request.messages)
        body: dict[str, Any] = {**self._options, "contents": contents}
        if system:
            body["systemInstruction"] = {"parts": [{"text": system}]}
        if request.tools:
            if request.tools is not self._tools_src:
                self._tools_json = jsonwire.Encoded(encode_tools(request.tools))
                self._tools_src = request.tools
            body["tools"] = self._tools_json
        config = self._options.get("generationConfig")
        body["generationConfig"] = {**(config if isinstance(config, dict) else {}),
                                    "maxOutputTokens": request.max_output_tokens}
        if schema is not None:
            self._ask_structured(body, request.tools, schema)
        return dumps(body)

    def _ask_structured(self, body: dict[str, Any], tools: Sequence[ToolSpec],
                        schema: Mapping[str, Any]) -> None:
        """`native`: `generationConfig.responseMimeType` "application/json" with the schema
        as `responseJsonSchema` (JSON Schema as given; `responseSchema` takes only
        Google's OpenAPI subset). `tool`: the answer tool, and function calling in mode
        `ANY` (only the answer tool allowed when it is the only one)."""
        if self._structured == "native":
            body["generationConfig"].update(responseMimeType="application/json",
                                            responseJsonSchema=dict(schema))
        elif self._structured == "tool":
            body["tools"] = encode_tools(with_answer_tool(tools, schema))
            calling: dict[str, Any] = {"mode": "ANY"}
            if not tools:
                calling["allowedFunctionNames"] = [ANSWER_TOOL]
            body["toolConfig"] = {"functionCallingConfig": calling}

    def _parse(self, obj: dict[str, Any]) -> ModelReply:
        candidates = obj.get("candidates") or [{}]
        first = candidates[0]
        return reply_of((first.get("content") or {}).get("parts") or (),
                        first.get("finishReason"), obj.get("usageMetadata") or {},
                        str(obj.get("modelVersion") or self._model),
                        obj.get("promptFeedback"))

    async def _read_stream(self, resp: aiohttp.ClientResponse, on_delta: DeltaSink | None
                           ) -> ModelReply:
        client = self._client
        parts: list[dict[str, Any]] = []
        text: list[str] = []
        finish: object = None
        usage: Mapping[str, Any] = {}
        model = ""
        sent = 0
        async with IdleWatch(self._cfg.idle_timeout) as idle:
            async for chunks in sse_reads(client, resp):
                for obj in chunks:
                    if "error" in obj:
                        raise ProviderError(client.stream_error_event(obj))
                    usage = obj.get("usageMetadata") or usage
                    model = model or str(obj.get("modelVersion") or "")
                    feedback = obj.get("promptFeedback")
                    if feedback and feedback.get("blockReason"):
                        return reply_of((), None, usage, model or self._model, feedback)
                    candidate = (obj.get("candidates") or [{}])[0]
                    for part in (candidate.get("content") or {}).get("parts") or ():
                        _add_part(parts, part)
                        if part.get("text") and not part.get("thought"):
                            text.append(str(part["text"]))
                    finish = candidate.get("finishReason") or finish
                if any(o.get("candidates") for o in chunks):  # a chunk is progress
                    idle.progressed()
                sent = await send_new_text(text, sent, on_delta)
        if not finish:
            raise ProviderError(client.stream_failure(
                INCOMPLETE, "stream ended without a finish reason"))
        return reply_of(parts, finish, usage, model or self._model)


def _add_part(parts: list[dict[str, Any]], part: Mapping[str, Any]) -> None:
    """A streamed part joins the one before when both are plain text of the same kind
    (thought or answer) and neither is signed; any other part is kept as it came."""
    last = parts[-1] if parts else None
    if (last is not None and set(last) <= {"text", "thought"}
            and set(part) <= {"text", "thought"} and "text" in part and "text" in last
            and bool(last.get("thought")) == bool(part.get("thought"))):
        last["text"] = str(last["text"]) + str(part["text"])
        return
    parts.append(dict(part))
