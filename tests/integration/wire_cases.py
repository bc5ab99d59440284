"""One reply of each conformance case, in each adapter's wire format, as a stream.

Every builder takes the same words (a text, tool calls, a usage) and writes them the way
the vendor does, reusing the recorded envelopes of wire_replies.py (Chat Completions
chunks as openai/openai-python records them; Anthropic events in the order
anthropics/anthropic-sdk-python records them) and the documented shapes of
wire_native.py (Responses, Gemini). Usage always comes where the vendor puts it: the
last chunk (Chat Completions with `include_usage`, Gemini), the closing event
(Responses), message_start and message_delta (Anthropic).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tests.integration import wire_native as native
from tests.integration import wire_replies as recorded

# input tokens (all of them), of which read from the cache, output tokens
Use = tuple[int, int, int]
Call = tuple[str, str, str]  # id, name, arguments (JSON text)


def _split(text: str, n: int) -> list[str]:
    size = max(1, -(-len(text) // n))
    return [text[i:i + size] for i in range(0, len(text), size)] or [""]


# -- Chat Completions ----------------------------------------------------------------------

def _oa_usage(use: Use) -> dict[str, Any]:
    return {"prompt_tokens": use[0], "completion_tokens": use[2],
            "total_tokens": use[0] + use[2], "prompt_tokens_details": {"cached_tokens": use[1]}}


def _oa_end(finish: str, use: Use) -> str:
    last = json.loads(recorded._chunk({}, finish)[6:])
    last["choices"], last["usage"] = [], _oa_usage(use)
    return (recorded._chunk({}, finish) + "data: " + json.dumps(last, separators=(",", ":"))
            + "\n\n" + "data: [DONE]\n\n")


def openai_text(text: str, use: Use, finish: str = "stop") -> str:
    return (recorded._chunk({"role": "assistant", "content": "", "refusal": None})
            + "".join(recorded._chunk({"content": p}) for p in _split(text, 4))
            + _oa_end(finish, use))


def openai_calls(calls: list[Call], use: Use) -> str:
    out = [recorded._chunk({"role": "assistant", "content": None})]
    for i, (cid, name, args) in enumerate(calls):
        out.append(recorded._chunk({"tool_calls": [{"index": i, "id": cid, "type": "function",
                                                    "function": {"name": name,
                                                                 "arguments": ""}}]}))
        out += [recorded._chunk({"tool_calls": [{"index": i, "function": {"arguments": p}}]})
                for p in _split(args, 3)]
    return "".join(out) + _oa_end("tool_calls", use)


def openai_error(text: str) -> str:
    return (recorded._chunk({"role": "assistant", "content": text})
            + 'data: {"error":{"message":"The server had an error while processing your '
              'request.","type":"server_error","param":null,"code":null}}\n\n')


# -- Anthropic Messages --------------------------------------------------------------------

def _an_start(use: Use) -> str:
    return recorded._event({"type": "message_start", "message": {
        "id": "msg_01UdjYBBipA9omjYhicnevgq", "type": "message", "role": "assistant",
        "model": "claude-sonnet-4-5", "content": [], "stop_reason": None,
        "stop_sequence": None, "usage": {"input_tokens": use[0] - use[1],
                                         "cache_creation_input_tokens": 0,
                                         "cache_read_input_tokens": use[1],
                                         "output_tokens": 1}}})


def _an_blocks(blocks: list[list[dict[str, Any]]]) -> str:
    out = []
    for index, (start, *deltas) in enumerate(blocks):
        out.append(recorded._event({"type": "content_block_start", "index": index,
                                    "content_block": start}))
        if index == 0:
            out.append('event: ping\ndata: {"type": "ping"}\n\n')
        out += [recorded._event({"type": "content_block_delta", "index": index, "delta": d})
                for d in deltas]
        out.append(recorded._event({"type": "content_block_stop", "index": index}))
    return "".join(out)


def _an_end(stop: str, use: Use) -> str:
    return (recorded._event({"type": "message_delta", "delta": {"stop_reason": stop,
                                                                "stop_sequence": None},
                             "usage": {"output_tokens": use[2]}})
            + 'event: message_stop\ndata: {"type":"message_stop"}\n\n')


def anthropic_text(text: str, use: Use, finish: str = "stop") -> str:
    return (_an_start(use) + _an_blocks([recorded.text_block(*_split(text, 4))])
            + _an_end("max_tokens" if finish == "length" else "end_turn", use))


def anthropic_calls(calls: list[Call], use: Use) -> str:
    blocks = [[{"type": "tool_use", "id": cid, "name": name, "input": {}},
               *({"type": "input_json_delta", "partial_json": p} for p in _split(args, 3))]
              for cid, name, args in calls]
    return _an_start(use) + _an_blocks(blocks) + _an_end("tool_use", use)


def anthropic_error(text: str) -> str:
    # Anthropic's streaming docs: an error event (overloaded_error) inside a 200 stream.
    return (_an_start((10, 0, 1)) + _an_blocks([recorded.text_block(text)])
            + 'event: error\ndata: {"type":"error","error":{"type":"overloaded_error",'
              '"message":"Overloaded"}}\n\n')


# -- Responses -----------------------------------------------------------------------------

def _rs_usage(use: Use) -> dict[str, Any]:
    return {"input_tokens": use[0], "input_tokens_details": {"cached_tokens": use[1]},
            "output_tokens": use[2], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": use[0] + use[2]}


def responses_text(text: str, use: Use, finish: str = "stop") -> str:
    cut = finish == "length"
    final = native.response([native.message(text, status="incomplete" if cut else "completed")],
                            status="incomplete" if cut else "completed",
                            reason="max_output_tokens" if cut else None, usage=_rs_usage(use))
    return native.responses_stream(final)


def responses_calls(calls: list[Call], use: Use) -> str:
    items = [{"id": f"fc_{cid}", "type": "function_call", "status": "completed",
              "arguments": args, "call_id": cid, "name": name} for cid, name, args in calls]
    return native.responses_stream(native.response(items, usage=_rs_usage(use)))


def responses_error(text: str) -> str:
    stream = native.responses_stream(native.response([native.message(text)]))
    head = stream[:stream.index("event: response.output_item.done")]
    return head + ('event: error\ndata: {"type":"error","code":"server_error","message":'
                   '"The server had an error while processing your request.","param":null,'
                   '"sequence_number":9}\n\n')


# -- Gemini --------------------------------------------------------------------------------

def _gm_usage(use: Use) -> dict[str, Any]:
    return {"promptTokenCount": use[0], "cachedContentTokenCount": use[1],
            "candidatesTokenCount": use[2], "totalTokenCount": use[0] + use[2]}


def gemini_text(text: str, use: Use, finish: str = "stop") -> str:
    pieces = _split(text, 3)
    reason = "MAX_TOKENS" if finish == "length" else "STOP"
    return native.gemini_stream(*(native.gemini([{"text": p}], None) for p in pieces[:-1]),
                                native.gemini([{"text": pieces[-1]}], reason,
                                              usage=_gm_usage(use)))


def gemini_calls(calls: list[Call], use: Use) -> str:
    # A function call comes whole in its part; the bytes are what split (see `piece`).
    parts = [{"functionCall": {"id": cid, "name": name, "args": json.loads(args)},
              **({"thoughtSignature": native.SIGNATURE} if i == 0 else {})}
             for i, (cid, name, args) in enumerate(calls)]
    return native.gemini_stream(native.gemini(parts, "STOP", usage=_gm_usage(use)))


def gemini_error(text: str) -> str:
    return native.gemini_stream(native.gemini([{"text": text}], None)) + (
        'data: {"error":{"code":503,"message":"The model is overloaded. Please try again '
        'later.","status":"UNAVAILABLE"}}\r\n\r\n')


# -- the kinds -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Kind:
    """One adapter's wire: its replies and its overload answer (status, body)."""

    name: str
    model: str
    text: Callable[..., str]
    calls: Callable[[list[Call], Use], str]
    error: Callable[[str], str]
    refusal: str  # a refusal stream
    refusal_text: str
    overload: tuple[int, dict[str, Any]]


KINDS = {
    "openai": Kind("openai", "gpt-4o", openai_text, openai_calls, openai_error,
                   recorded.OPENAI_REFUSAL_STREAM, recorded.OPENAI_REFUSAL_STREAM_TEXT,
                   (503, {"error": {"message": "The engine is currently overloaded, please "
                                    "try again later", "type": "server_error"}})),
    "anthropic": Kind("anthropic", "claude-sonnet-4-5", anthropic_text, anthropic_calls,
                      anthropic_error, recorded.ANTHROPIC_REFUSAL_STREAM,
                      recorded.ANTHROPIC_REFUSAL_STREAM_TEXT,
                      (529, {"type": "error", "error": {"type": "overloaded_error",
                                                        "message": "Overloaded"}})),
    "openai-responses": Kind("openai-responses", "o4-mini", responses_text, responses_calls,
                             responses_error, native.RESPONSES_REFUSAL_STREAM,
                             native.RESPONSES_REFUSAL_TEXT,
                             (503, {"error": {"message": "The engine is currently "
                                              "overloaded, please try again later",
                                              "type": "server_error"}})),
    "gemini": Kind("gemini", "gemini-2.5-flash", gemini_text, gemini_calls, gemini_error,
                   native.GEMINI_SAFETY_STREAM, "",
                   (503, {"error": {"code": 503, "message": "The model is overloaded. "
                                    "Please try again later.", "status": "UNAVAILABLE"}})),
}
