"""Model replies as the vendors send them, for the fault server to replay.

Each one is copied from a recording in the vendor's own SDK test suite (named above it),
trimmed only where it says so; the tests replay them byte for byte from a server on
127.0.0.1, so the daemon reads exactly what it would read from the vendor.
"""

from __future__ import annotations

import json
from typing import Any

# -- OpenAI Chat Completions ---------------------------------------------------------------

# openai/openai-python tests/lib/chat/test_completions.py, test_parse_pydantic_model_refusal.
OPENAI_REFUSAL: dict[str, Any] = json.loads(
    '{"id": "chatcmpl-ABfvwoKVWPQj2UPlAcAKM7s40GsRx", "object": "chat.completion", '
    '"created": 1727346164, "model": "gpt-4o-2024-08-06", "choices": [{"index": 0, '
    '"message": {"role": "assistant", "content": null, "refusal": "I\'m very sorry, but I '
    'can\'t assist with that."}, "logprobs": null, "finish_reason": "stop"}], "usage": '
    '{"prompt_tokens": 79, "completion_tokens": 12, "total_tokens": 91, '
    '"completion_tokens_details": {"reasoning_tokens": 0}}, "system_fingerprint": '
    '"fp_5050236cbd"}')
OPENAI_REFUSAL_TEXT = "I'm very sorry, but I can't assist with that."


def _chunk(delta: dict[str, Any], finish: str | None = None) -> str:
    return "data: " + json.dumps({
        "id": "chatcmpl-9tXjmhJIrvp7TBeVxzzxmx8pp2UGY", "object": "chat.completion.chunk",
        "created": 1723024754, "model": "gpt-4o-2024-08-06",
        "system_fingerprint": "fp_845eaabc1f",
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }, separators=(",", ":")) + "\n\n"


# openai/openai-python .inline-snapshot/external/0a00cd46c610*.bin (test_refusal_logprobs_
# events): the refusal streamed in its own `refusal` deltas, content null, finish "stop".
# The recording asked for logprobs; here each chunk carries `"logprobs":null`, as OpenAI
# sends it to a request that did not.
OPENAI_REFUSAL_STREAM = (
    _chunk({"role": "assistant", "content": None, "refusal": ""})
    + "".join(_chunk({"refusal": piece}) for piece in (
        "I'm", " sorry", ",", " I", " cannot", " assist", " with", " that", " request",
        "."))
    + _chunk({}, "stop")
    + 'data: {"id":"chatcmpl-9tXjmhJIrvp7TBeVxzzxmx8pp2UGY","object":"chat.completion.chunk",'
      '"created":1723024754,"model":"gpt-4o-2024-08-06","system_fingerprint":"fp_845eaabc1f",'
      '"choices":[],"usage":{"prompt_tokens":17,"completion_tokens":11,"total_tokens":28}}\n\n'
    + "data: [DONE]\n\n")
OPENAI_REFUSAL_STREAM_TEXT = "I'm sorry, I cannot assist with that request."

# openai/openai-python tests/lib/chat/test_content_filter.py, test_stream_content_filter_
# completion ("after_content"): a partial answer, then the filter's finish reason.
OPENAI_FILTERED_STREAM = "".join(
    "data: " + json.dumps({"id": "chatcmpl-example", "object": "chat.completion.chunk",
                           "created": 0, "model": "gpt-4o-2024-08-06", "choices": [c]}) + "\n\n"
    for c in ({"index": 0, "delta": {"role": "assistant", "content": '{"value": "example'},
               "finish_reason": None},
              {"index": 0, "delta": {"role": "assistant"}, "finish_reason": "content_filter"})
) + "data: [DONE]\n\n"

# openai/openai-python tests/lib/chat/test_completions.py, test_parse_max_tokens_reached:
# an answer cut by `max_tokens` after one token.
OPENAI_CUT: dict[str, Any] = json.loads(
    '{"id": "chatcmpl-ABfvvX7eB1KsfeZj8VcF3z7G7SbaA", "object": "chat.completion", '
    '"created": 1727346163, "model": "gpt-4o-2024-08-06", "choices": [{"index": 0, '
    '"message": {"role": "assistant", "content": "{\\"", "refusal": null}, "logprobs": '
    'null, "finish_reason": "length"}], "usage": {"prompt_tokens": 79, '
    '"completion_tokens": 1, "total_tokens": 80, "completion_tokens_details": '
    '{"reasoning_tokens": 0}}, "system_fingerprint": "fp_7568d46099"}')

# openai/openai-python .inline-snapshot/external/4cc50a6135d2*.bin (the streamed
# test_parse_max_tokens_reached), as recorded.
OPENAI_CUT_STREAM = (
    'data: {"id":"chatcmpl-ABfw3Oqj8RD0z6aJiiX37oTjV2HFh","object":"chat.completion.chunk",'
    '"created":1727346171,"model":"gpt-4o-2024-08-06","system_fingerprint":"fp_7568d46099",'
    '"choices":[{"index":0,"delta":{"role":"assistant","content":"","refusal":null},'
    '"logprobs":null,"finish_reason":null}]}\n\n'
    'data: {"id":"chatcmpl-ABfw3Oqj8RD0z6aJiiX37oTjV2HFh","object":"chat.completion.chunk",'
    '"created":1727346171,"model":"gpt-4o-2024-08-06","system_fingerprint":"fp_7568d46099",'
    '"choices":[{"index":0,"delta":{"content":"{\\""},"logprobs":null,"finish_reason":null}]}'
    '\n\n'
    'data: {"id":"chatcmpl-ABfw3Oqj8RD0z6aJiiX37oTjV2HFh","object":"chat.completion.chunk",'
    '"created":1727346171,"model":"gpt-4o-2024-08-06","system_fingerprint":"fp_7568d46099",'
    '"choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":"length"}]}\n\n'
    'data: {"id":"chatcmpl-ABfw3Oqj8RD0z6aJiiX37oTjV2HFh","object":"chat.completion.chunk",'
    '"created":1727346171,"model":"gpt-4o-2024-08-06","system_fingerprint":"fp_7568d46099",'
    '"choices":[],"usage":{"prompt_tokens":79,"completion_tokens":1,"total_tokens":80,'
    '"completion_tokens_details":{"reasoning_tokens":0}}}\n\n'
    "data: [DONE]\n\n")
OPENAI_CUT_TEXT = '{"'  # what both cut replies said
OPENAI_CUT_TOKENS = 1

# -- Anthropic Messages ----------------------------------------------------------------------


def anthropic_message(content: list[dict[str, Any]], stop_reason: str, *,
                      output_tokens: int = 1, **extra: Any) -> dict[str, Any]:
    """A Messages reply in the shape of anthropics/anthropic-sdk-python
    tests/lib/test_refusal_fallback.py's `message()` (id, type, role, model, content,
    stop_reason, stop_sequence, usage), with this content and stop reason."""
    return {"id": "msg_1", "type": "message", "role": "assistant",
            "model": "claude-sonnet-4-5", "content": content, "stop_reason": stop_reason,
            "stop_sequence": None,
            "usage": {"input_tokens": 20, "output_tokens": output_tokens}, **extra}


# anthropics/anthropic-sdk-python tests/lib/test_refusal_fallback.py, `refusal()`: no
# content, the refusal's details apart.
ANTHROPIC_REFUSAL = anthropic_message(
    [], "refusal", stop_details={"type": "refusal", "category": None, "explanation": None})

# anthropics/anthropic-sdk-python tests/lib/streaming/fixtures/refusal_response.txt.
ANTHROPIC_REFUSAL_STREAM = (
    'event: message_start\ndata: {"type":"message_start","message":{"id":"msg_01RefusalTest'
    'Message123456789","type":"message","role":"assistant","content":[],"model":"claude-opus'
    '-4-7","stop_reason":null,"stop_sequence":null,"usage":{"input_tokens":20,'
    '"output_tokens":1}}}\n\n'
    'event: content_block_start\ndata: {"type":"content_block_start","index":0,'
    '"content_block":{"type":"text","text":""}}\n\n'
    'event: content_block_stop\ndata: {"type":"content_block_stop","index":0}\n\n'
    'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"refusal",'
    '"stop_sequence":null,"stop_details":{"type":"refusal","category":"cyber",'
    '"explanation":"This request was refused due to policy."}},"usage":{"output_tokens":0}}'
    '\n\n'
    'event: message_stop\ndata: {"type":"message_stop"}\n')
ANTHROPIC_REFUSAL_STREAM_TEXT = "This request was refused due to policy."

# A final answer cut by max_tokens: the non-streamed shape above with stop_reason
# "max_tokens" and the text the SDK's incomplete_partial_json_response.txt starts with.
ANTHROPIC_CUT_TEXT = "I'll create a comprehensive tax guide for someone with multiple W2s an"
ANTHROPIC_CUT = anthropic_message([{"type": "text", "text": ANTHROPIC_CUT_TEXT}],
                                  "max_tokens", output_tokens=16)


def _event(obj: dict[str, Any]) -> str:
    return f"event: {obj['type']}\ndata: {json.dumps(obj, separators=(',', ':'))}\n\n"


def anthropic_stream(blocks: list[list[dict[str, Any]]], stop_reason: str, *,
                     output_tokens: int = 16) -> str:
    """An event stream in the order anthropics/anthropic-sdk-python
    tests/lib/streaming/fixtures/*.txt record it: message_start, each block's start,
    deltas and stop (a ping after the first start), message_delta, message_stop."""
    out = [_event({"type": "message_start", "message": {
        "id": "msg_01UdjYBBipA9omjYhicnevgq", "type": "message", "role": "assistant",
        "model": "claude-3-7-sonnet-20250219", "content": [], "stop_reason": None,
        "stop_sequence": None, "usage": {"input_tokens": 450, "cache_creation_input_tokens": 0,
                                         "cache_read_input_tokens": 0, "output_tokens": 1,
                                         "service_tier": "standard"}}})]
    for index, (start, *deltas) in enumerate(blocks):
        out.append(_event({"type": "content_block_start", "index": index,
                           "content_block": start}))
        if index == 0:
            out.append('event: ping\ndata: {"type": "ping"}\n\n')
        out += [_event({"type": "content_block_delta", "index": index, "delta": d})
                for d in deltas]
        out.append(_event({"type": "content_block_stop", "index": index}))
    out.append(_event({"type": "message_delta", "delta": {"stop_reason": stop_reason,
                                                          "stop_sequence": None},
                       "usage": {"output_tokens": output_tokens}}))
    out.append('event: message_stop\ndata: {"type":"message_stop"}\n\n')
    return "".join(out)


def text_block(*pieces: str) -> list[dict[str, Any]]:
    return [{"type": "text", "text": ""}, *({"type": "text_delta", "text": p} for p in pieces)]


ANTHROPIC_CUT_STREAM = anthropic_stream(
    [text_block("I", "'ll create a comprehensive tax guide for", " someone with multiple "
                "W2s an")], "max_tokens")

# anthropics/anthropic-sdk-python tests/lib/streaming/fixtures/incomplete_partial_json_
# response.txt: text, then a make_file call whose arguments max_tokens cut mid-string.
ANTHROPIC_CUT_CALL_STREAM = anthropic_stream([
    text_block("I", "'ll create a comprehensive tax guide for", " someone with multiple W2s an",
               "d save it in a file called taxes.txt. Let", " me do that for you now."),
    [{"type": "tool_use", "id": "toolu_01EKqbqmZrGRXy18eN7m9kvY", "name": "make_file",
      "input": {}},
     {"type": "input_json_delta", "partial_json": ""},
     {"type": "input_json_delta", "partial_json": '{"filename": "taxes.txt'},
     {"type": "input_json_delta", "partial_json":
      '", "lines_of_text": [\n"# COMPREHENSIVE TAX GUIDE FOR INDIVIDUALS WITH MULTIPLE '
      'W-2s",\n"",\n"## INTRODUCTION",\n"",'},
     {"type": "input_json_delta", "partial_json": '\n"Filing taxes'}],
], "max_tokens", output_tokens=124)

# The same reply as the SDK's stream accumulator builds it (tests/lib/streaming/
# test_beta_messages.py, EXPECTED_INCOMPLETE_MESSAGE): the cut arguments parsed into an
# object that looks whole. A non-streamed reply can carry the same.
ANTHROPIC_CUT_CALL = anthropic_message([
    {"type": "text", "text": "I'll create a comprehensive tax guide for someone with "
     "multiple W2s and save it in a file called taxes.txt. Let me do that for you now."},
    {"type": "tool_use", "id": "toolu_01EKqbqmZrGRXy18eN7m9kvY", "name": "make_file",
     "input": {"filename": "taxes.txt", "lines_of_text": [
         "# COMPREHENSIVE TAX GUIDE FOR INDIVIDUALS WITH MULTIPLE W-2s", "",
         "## INTRODUCTION", "", "Filing taxes"]}},
], "max_tokens", output_tokens=124)

# Extended thinking before a tool call, in the shape Anthropic's extended-thinking docs
# show and anthropics/anthropic-sdk-python tests/fixtures/fable-fallback/*.sse record it
# (a thinking block with its signature, then the tool_use). The signature is opaque: the
# daemon must send it back byte for byte.
THINKING = {"type": "thinking", "thinking": "The user wants the weather; call get_weather.",
            "signature": "ErUBCkYIARgCIkACJWxzySUOJzOlZ8WFdgQSbeQA3H1i5rfkKLV9eC4HN6Jcnrlw=="}
REDACTED = {"type": "redacted_thinking",
            "data": "EmwKAhgBEgy3va3pzix/LafPsn4aDFIT2Xlxh0L5L8rLVyIwxtE3rAFBa8cr3qpP"}
THINKING_CALL = anthropic_message(
    [THINKING, REDACTED, {"type": "tool_use", "id": "toolu_01", "name": "echo",
                          "input": {"text": "paris"}}], "tool_use", output_tokens=90)
THINKING_CALL_STREAM = anthropic_stream([
    [{"type": "thinking", "thinking": "", "signature": ""},
     {"type": "thinking_delta", "thinking": "The user wants the weather; "},
     {"type": "thinking_delta", "thinking": "call get_weather."},
     {"type": "signature_delta", "signature": THINKING["signature"]}],
    [dict(REDACTED)],
    [{"type": "tool_use", "id": "toolu_01", "name": "echo", "input": {}},
     {"type": "input_json_delta", "partial_json": '{"text": '},
     {"type": "input_json_delta", "partial_json": '"paris"}'}],
], "tool_use", output_tokens=90)
