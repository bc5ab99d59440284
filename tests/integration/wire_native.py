"""Replies in the wire formats of OpenAI's Responses API and of the Gemini API, for the
fault server to replay.

Neither SDK ships recorded streams of these as the Chat Completions and Messages ones
are (wire_replies.py): each reply here is written from the vendor's documented shape,
named above it, with our own tool (`echo`) and short made-up ids and signatures. The
fields and event order are the documented ones; nothing else was changed.
"""

from __future__ import annotations

import json
from typing import Any

# -- OpenAI Responses ----------------------------------------------------------------------
# Shapes: OpenAI API reference, "Responses" (the Response object: output items
# `reasoning` with `encrypted_content` when `include` asks for it, `function_call`,
# `message` with `output_text` / `refusal` parts; `status`, `incomplete_details`,
# `usage` with `input_tokens_details.cached_tokens` and
# `output_tokens_details.reasoning_tokens`) and "Streaming events" (`event:` then
# `data:` lines, the events in the order documented there); the incomplete stream as in
# openai/openai-python tests/lib/responses/test_stream_incomplete.py.

REASONING: dict[str, Any] = {
    "id": "rs_6806bfca0b2481918a5748308061a260", "type": "reasoning", "summary": [],
    "encrypted_content": "gAAAAABoBr_KRc2wW3KM0ZhSwVmuX2k4QPq6yJ8Tc1FA"}
CALL: dict[str, Any] = {
    "id": "fc_6806bfcb2a2c8191b43f8c1a58f5ba6f", "type": "function_call",
    "status": "completed", "arguments": '{"text":"Paris"}',
    "call_id": "call_Yp7kVvIz2DkqUk6ZJvA5qmlH", "name": "echo"}
RESPONSES_USAGE: dict[str, Any] = {
    "input_tokens": 300, "input_tokens_details": {"cached_tokens": 128},
    "output_tokens": 180, "output_tokens_details": {"reasoning_tokens": 150},
    "total_tokens": 480}


def response(output: list[dict[str, Any]], *, status: str = "completed",
             reason: str | None = None, usage: dict[str, Any] | None = None
             ) -> dict[str, Any]:
    """A Response object as `POST /responses` answers it (and `response.completed`
    carries it)."""
    return {"id": "resp_6806bfc9e6f08191a0d28cdb34f4b7e1", "object": "response",
            "created_at": 1745272777, "status": status, "error": None,
            "incomplete_details": {"reason": reason} if reason else None,
            "model": "o4-mini-2025-04-16", "output": output, "parallel_tool_calls": True,
            "store": False, "usage": usage or RESPONSES_USAGE}


def message(text: str, *, part: str = "output_text", status: str = "completed"
            ) -> dict[str, Any]:
    content = ({"type": "output_text", "text": text, "annotations": []}
               if part == "output_text" else {"type": "refusal", "refusal": text})
    return {"id": "msg_6806bfcc5a008191a0ad3c6db3a6f7a1", "type": "message",
            "status": status, "role": "assistant", "content": [content]}


def _event(obj: dict[str, Any]) -> str:
    return f"event: {obj['type']}\ndata: " + json.dumps(obj, separators=(",", ":")) + "\n\n"


def responses_stream(final: dict[str, Any], *, arg_pieces: int = 3,
                     text_pieces: int = 4) -> str:
    """The event stream of `final`: created, each output item added, its deltas (text
    and arguments split in pieces) and done, then completed / incomplete."""
    seq = iter(range(10_000))
    start = {**final, "status": "in_progress", "output": [], "usage": None}
    out = [_event({"type": "response.created", "sequence_number": next(seq),
                   "response": start})]
    for index, item in enumerate(final["output"]):
        added = dict(item)
        if item["type"] == "function_call":
            added["arguments"] = ""
        if item["type"] == "message":
            added["content"] = []
        out.append(_event({"type": "response.output_item.added", "sequence_number": next(seq),
                           "output_index": index, "item": added}))
        if item["type"] == "function_call":
            args = item["arguments"]
            size = max(1, -(-len(args) // arg_pieces))
            for at in range(0, len(args), size):
                out.append(_event({"type": "response.function_call_arguments.delta",
                                   "sequence_number": next(seq), "item_id": item["id"],
                                   "output_index": index, "delta": args[at:at + size]}))
            out.append(_event({"type": "response.function_call_arguments.done",
                               "sequence_number": next(seq), "item_id": item["id"],
                               "output_index": index, "arguments": args}))
        if item["type"] == "message":
            part = item["content"][0]
            kind = "output_text" if part["type"] == "output_text" else "refusal"
            text = part.get("text") or part.get("refusal") or ""
            size = max(1, -(-len(text) // text_pieces))
            for at in range(0, len(text), size):
                out.append(_event({"type": f"response.{kind}.delta",
                                   "sequence_number": next(seq), "item_id": item["id"],
                                   "output_index": index, "content_index": 0,
                                   "delta": text[at:at + size]}))
        out.append(_event({"type": "response.output_item.done", "sequence_number": next(seq),
                           "output_index": index, "item": item}))
    last = "response.completed" if final["status"] == "completed" else "response.incomplete"
    out.append(_event({"type": last, "sequence_number": next(seq), "response": final}))
    return "".join(out)


RESPONSES_REASONING_CALL = response([REASONING, CALL])
RESPONSES_REASONING_CALL_STREAM = responses_stream(RESPONSES_REASONING_CALL)
RESPONSES_CUT_TEXT = "The guide, in three parts: first, keep every rec"
RESPONSES_CUT = response([message(RESPONSES_CUT_TEXT, status="incomplete")],
                         status="incomplete", reason="max_output_tokens",
                         usage={"input_tokens": 40, "output_tokens": 16,
                                "input_tokens_details": {"cached_tokens": 0},
                                "output_tokens_details": {"reasoning_tokens": 0}})
RESPONSES_CUT_STREAM = responses_stream(RESPONSES_CUT)
RESPONSES_REFUSAL_TEXT = "I'm sorry, but I can't help with that."
RESPONSES_REFUSAL = response([message(RESPONSES_REFUSAL_TEXT, part="refusal")])
RESPONSES_REFUSAL_STREAM = responses_stream(RESPONSES_REFUSAL)

# "Streaming events": `response.failed` carries the response with its `error`.
RESPONSES_FAILED_STREAM = _event({"type": "response.created", "sequence_number": 0,
                                  "response": response([], status="in_progress")}) + _event(
    {"type": "response.failed", "sequence_number": 1,
     "response": {**response([], status="failed"),
                  "error": {"code": "server_error", "message": "The server had an error"}}})


def responses_text(text: str) -> dict[str, Any]:
    return response([message(text)], usage={
        "input_tokens": 400, "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": 12, "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 412})


# -- Gemini --------------------------------------------------------------------------------
# Shapes: Gemini API reference, "Generating content" (GenerateContentResponse:
# `candidates[].content.parts`, `finishReason`, `safetyRatings`, `promptFeedback`,
# `usageMetadata` with `cachedContentTokenCount` and `thoughtsTokenCount`,
# `modelVersion`), "Thought signatures" (a `functionCall` part signed with
# `thoughtSignature`; streamed, the signature may come in a later part of empty text)
# and "Troubleshooting" / google.rpc error details (a 429 RESOURCE_EXHAUSTED with a
# `RetryInfo` `retryDelay`). A stream is `data: <chunk>` lines separated by CRLF CRLF,
# as the API sends them with `alt=sse`.

SIGNATURE = "CiQB0e2Kb6Qb5m3uUq0QF9yCj1mzxYh0FQx8vTQ0nJ2rQ1S4sQ="
SIGNATURE_B = "CiUB0e2Kb1R5xP8n2VtQm1K7z0yqQw9LrFf3XcH6dYt2aV8bWg=="
GEMINI_USAGE: dict[str, Any] = {
    "promptTokenCount": 220, "candidatesTokenCount": 14, "thoughtsTokenCount": 96,
    "cachedContentTokenCount": 120, "totalTokenCount": 330}


def gemini(parts: list[dict[str, Any]] | None, finish: str | None = "STOP",
           usage: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    candidate: dict[str, Any] = {"index": 0}
    if parts is not None:
        candidate["content"] = {"role": "model", "parts": parts}
    if finish:
        candidate["finishReason"] = finish
    out: dict[str, Any] = {"candidates": [candidate], "modelVersion": "gemini-2.5-flash",
                           "responseId": "xsMdaPqZLJ6Jz7IPj8mN-Qc", **extra}
    if usage is not None:
        out["usageMetadata"] = usage
    return out


def gemini_stream(*chunks: dict[str, Any]) -> str:
    return "".join("data: " + json.dumps(c, separators=(",", ":")) + "\r\n\r\n"
                   for c in chunks)


SIGNED_CALL_PART = {"functionCall": {"name": "echo", "args": {"text": "Paris"}},
                    "thoughtSignature": SIGNATURE}
GEMINI_SIGNED_CALL = gemini([SIGNED_CALL_PART], usage=GEMINI_USAGE)
GEMINI_SIGNED_CALL_STREAM = gemini_stream(
    gemini([{"text": "Checking the "}], None),
    gemini([{"text": "weather."}, SIGNED_CALL_PART], None),
    gemini([{"text": "", "thoughtSignature": SIGNATURE_B}], "STOP", usage=GEMINI_USAGE))
# The parts the stream's reply is made of, as they go back (the two plain text pieces
# joined; the signed parts as they came).
GEMINI_SIGNED_CALL_STREAM_PARTS = [{"text": "Checking the weather."}, SIGNED_CALL_PART,
                                   {"text": "", "thoughtSignature": SIGNATURE_B}]

_BLOCKED_RATINGS = [{"category": "HARM_CATEGORY_DANGEROUS_CONTENT", "probability": "HIGH",
                     "blocked": True}]
GEMINI_SAFETY = gemini(None, "SAFETY", usage={"promptTokenCount": 12, "totalTokenCount": 12},
                       )
GEMINI_SAFETY["candidates"][0]["safetyRatings"] = _BLOCKED_RATINGS
GEMINI_SAFETY_STREAM = gemini_stream(GEMINI_SAFETY)
GEMINI_PROMPT_BLOCKED: dict[str, Any] = {
    "promptFeedback": {"blockReason": "SAFETY", "safetyRatings": _BLOCKED_RATINGS},
    "usageMetadata": {"promptTokenCount": 12, "totalTokenCount": 12},
    "modelVersion": "gemini-2.5-flash"}
GEMINI_CUT_TEXT = "The guide, in three parts: first, keep every rec"
GEMINI_CUT = gemini([{"text": GEMINI_CUT_TEXT}], "MAX_TOKENS",
                    usage={"promptTokenCount": 40, "candidatesTokenCount": 16,
                           "totalTokenCount": 56})
GEMINI_CUT_STREAM = gemini_stream(
    gemini([{"text": GEMINI_CUT_TEXT[:20]}], None),
    gemini([{"text": GEMINI_CUT_TEXT[20:]}], "MAX_TOKENS",
           usage={"promptTokenCount": 40, "candidatesTokenCount": 16, "totalTokenCount": 56}))
GEMINI_RATE_LIMITED: dict[str, Any] = {"error": {
    "code": 429, "status": "RESOURCE_EXHAUSTED",
    "message": "You exceeded your current quota, please check your plan and billing "
               "details.",
    "details": [
        {"@type": "type.googleapis.com/google.rpc.QuotaFailure", "violations": [
            {"quotaMetric": "generativelanguage.googleapis.com/generate_content_free_tier_"
                            "requests", "quotaId": "GenerateRequestsPerMinutePerProject"
                                                   "PerModel-FreeTier"}]},
        {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "0.4s"}]}}


def gemini_text(text: str) -> dict[str, Any]:
    return gemini([{"text": text}], usage={"promptTokenCount": 400,
                                           "candidatesTokenCount": 12,
                                           "totalTokenCount": 412})
