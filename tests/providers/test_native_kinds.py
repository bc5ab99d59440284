"""The Responses and Gemini adapters' own rules, on their encoders and readers: the
order reasoning items go back in, what a reply from another provider is sent as, how a
stream's parts are kept, and how each finish reason is read. Whole turns on the wire
are in tests/integration (test_native_providers.py, test_conformance.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from turnkeeper.messages import Message, ToolCall
from turnkeeper.providers import gemini, openai_responses
from turnkeeper.providers.http import HttpClient

R1 = {"id": "rs_1", "type": "reasoning", "summary": [], "encrypted_content": "enc-1"}
R2 = {"id": "rs_2", "type": "reasoning", "summary": [], "encrypted_content": "enc-2"}


def _call(cid: str, args: str = '{"q":1}') -> dict[str, Any]:
    return {"id": f"fc_{cid}", "type": "function_call", "call_id": cid, "name": "look",
            "arguments": args, "status": "completed"}


def test_interleaved_reasoning_items_go_back_in_the_order_they_came() -> None:
    reply = openai_responses.parse_response({"status": "completed", "output": [
        R1, _call("c1"), R2, {"type": "message", "content": [
            {"type": "output_text", "text": "and so"}]}, _call("c2")]}, "o3")
    assert [c.id for c in reply.tool_calls] == ["c1", "c2"] and reply.text == "and so"
    m = Message(role="assistant", content=reply.text, tool_calls=reply.tool_calls,
                opaque=reply.opaque)
    items = openai_responses.assistant_items(m)
    assert [i.get("type", i.get("role")) for i in items] == [
        "reasoning", "function_call", "reasoning", "assistant", "function_call"]
    assert items[0] == R1 and items[2] == R2
    assert items[1] == {"type": "function_call", "call_id": "c1", "name": "look",
                        "arguments": '{"q":1}'}


def test_a_reply_without_reasoning_keeps_nothing_opaque_and_another_provider_s_calls_go_last(
        ) -> None:
    reply = openai_responses.parse_response({"status": "completed", "output": [
        _call("c1")]}, "gpt-5")
    assert reply.opaque == () and reply.finish_reason == "tool_calls"
    # A message from another provider (a fallback): text, then its calls.
    m = Message(role="assistant", content="let me look",
                tool_calls=(ToolCall("toolu_1", "look", "{}"),),
                opaque=({"type": "thinking", "thinking": "x", "signature": "s"},))
    items = openai_responses.assistant_items(m)
    assert items == [{"role": "assistant", "content": "let me look"},
                     {"type": "function_call", "call_id": "toolu_1", "name": "look",
                      "arguments": "{}"}]


@pytest.mark.parametrize(("response", "finish", "refusal"), [
    ({"status": "completed", "output": []}, "stop", None),
    ({"status": "incomplete", "incomplete_details": {"reason": "max_output_tokens"},
      "output": []}, "length", None),
    ({"status": "incomplete", "incomplete_details": {"reason": "content_filter"},
      "output": []}, "content_filter", None),
    ({"status": "completed", "output": [{"type": "message", "content": [
        {"type": "refusal", "refusal": "No."}]}]}, "stop", "No."),
])
def test_responses_finish_reasons_and_refusals_are_read(
        response: dict[str, Any], finish: str, refusal: str | None) -> None:
    reply = openai_responses.parse_response(response, "m")
    assert (reply.finish_reason, reply.refusal) == (finish, refusal)


def test_a_failed_response_or_error_event_is_classified_by_its_code() -> None:
    client = HttpClient("http://127.0.0.1:9/responses", {}, max_connections=1)
    assert openai_responses.failed(client, {"code": "rate_limit_exceeded",
                                            "message": "slow"}).error_type \
        == "rate_limit_exceeded"
    event = {"type": "error", "code": "server_error", "message": "oops"}
    assert openai_responses.failed(client, event).error_type == "server_error"
    nested = {"type": "error", "error": {"type": "invalid_request_error", "message": "bad"}}
    assert openai_responses.failed(client, nested).error_type == "invalid_request_error"


# -- Gemini --------------------------------------------------------------------------------


def test_gemini_parts_go_back_as_they_came_with_their_signatures() -> None:
    parts = [{"text": "thinking...", "thought": True, "thoughtSignature": "s0"},
             {"functionCall": {"name": "look", "args": {"q": 1}}, "thoughtSignature": "s1"},
             {"functionCall": {"name": "look", "args": {"q": 2}}}]
    reply = gemini.reply_of(parts, "STOP", {}, "gemini-2.5-pro")
    assert reply.text is None and reply.finish_reason == "tool_calls"
    assert [json.loads(c.arguments) for c in reply.tool_calls] == [{"q": 1}, {"q": 2}]
    history = [Message(role="user", content="go"),
               Message(role="assistant", content=None, tool_calls=reply.tool_calls,
                       opaque=reply.opaque),
               Message(role="tool", content="one", tool_call_id=reply.tool_calls[0].id),
               Message(role="tool", content="two", tool_call_id=reply.tool_calls[1].id)]
    system, contents = gemini.encode_contents("be brief", history)
    assert system == "be brief"
    assert contents[1] == {"role": "model", "parts": parts}
    # Both results in one user content, named after their calls; our ids are not sent.
    assert contents[2] == {"role": "user", "parts": [
        {"functionResponse": {"name": "look", "response": {"result": "one"}}},
        {"functionResponse": {"name": "look", "response": {"result": "two"}}}]}


def test_a_call_from_another_provider_goes_with_the_documented_placeholder_signature(
        ) -> None:
    m = Message(role="assistant", content="on it",
                tool_calls=(ToolCall("call_1", "look", '{"q":1}'),
                            ToolCall("call_2", "look", "not json")))
    assert gemini.model_parts(m) == [
        {"text": "on it"},
        {"functionCall": {"name": "look", "args": {"q": 1}, "id": "call_1"},
         "thoughtSignature": gemini.SKIP_SIGNATURE},
        {"functionCall": {"name": "look", "args": {}, "id": "call_2"}}]


def test_streamed_plain_text_pieces_are_joined_and_signed_parts_kept_apart() -> None:
    parts: list[dict[str, Any]] = []
    for p in ({"text": "a"}, {"text": "b"}, {"text": "c", "thoughtSignature": "s"},
              {"text": "d"}, {"text": "t", "thought": True}, {"text": "u", "thought": True}):
        gemini._add_part(parts, p)
    assert parts == [{"text": "ab"}, {"text": "c", "thoughtSignature": "s"}, {"text": "d"},
                     {"text": "tu", "thought": True}]


@pytest.mark.parametrize(("raw", "finish"), [
    ("STOP", "stop"), ("MAX_TOKENS", "length"), ("SAFETY", "content_filter"),
    ("PROHIBITED_CONTENT", "content_filter"), ("BLOCKLIST", "content_filter"),
    ("RECITATION", "content_filter"), ("SPII", "content_filter"),
    ("MALFORMED_FUNCTION_CALL", "malformed_function_call"), (None, "stop")])
def test_gemini_finish_reasons_are_read(raw: str | None, finish: str) -> None:
    assert gemini.finish_reason(raw, False) == finish


def test_gemini_usage_counts_cached_input_and_thoughts_as_output() -> None:
    u = gemini.usage_of({"promptTokenCount": 100, "cachedContentTokenCount": 60,
                         "toolUsePromptTokenCount": 5, "candidatesTokenCount": 7,
                         "thoughtsTokenCount": 30})
    assert (u.input_tokens, u.cache_read_tokens, u.output_tokens) == (105, 60, 37)


def test_a_blocked_prompt_is_the_content_filter_s_refusal() -> None:
    reply = gemini.reply_of((), None, {"promptTokenCount": 3}, "m",
                            {"blockReason": "SAFETY"})
    assert (reply.finish_reason, reply.text, reply.tool_calls) == ("content_filter", None, ())


@pytest.mark.parametrize(("base", "url"), [
    ("https://generativelanguage.googleapis.com", "https://generativelanguage.googleapis.com/v1beta"),
    ("http://127.0.0.1:8080/", "http://127.0.0.1:8080/v1beta"),
    ("http://127.0.0.1:8080/gw/v1", "http://127.0.0.1:8080/gw/v1"),
    ("http://127.0.0.1:8080/v1alpha/", "http://127.0.0.1:8080/v1alpha")])
def test_the_gemini_base_url_is_a_host_the_api_version_appended_unless_it_has_one(
        base: str, url: str) -> None:
    assert gemini.versioned(base) == url
