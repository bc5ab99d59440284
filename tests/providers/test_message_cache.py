"""A turn's messages encoded once: the `MessageCache` a turn's model call keeps, and the
OpenAI and Anthropic adapters' request bodies with it, byte for byte those without it."""

from __future__ import annotations

import json
import tracemalloc
from typing import Any

from turnkeeper import jsonwire
from turnkeeper.config import ProviderConfig
from turnkeeper.messages import Message, ToolCall
from turnkeeper.providers.anthropic import AnthropicProvider
from turnkeeper.providers.base import CACHED_FROM, MessageCache, ModelRequest
from turnkeeper.providers.openai import OpenAIProvider

LOCAL = "http://127.0.0.1:1/v1"  # a server without a key (nothing is sent)


def counted(calls: list[str]) -> Any:
    def one(m: Message, previous: Message | None) -> bytes:
        calls.append(m.content or "")
        return json.dumps(m.content).encode()
    return one


def conversation(steps: int) -> list[Message]:
    out = [Message(role="user", content="the task")]
    for i in range(steps):
        call = ToolCall(id=f"c{i}", name="echo", arguments=json.dumps({"text": f"{i}"}))
        out.append(Message(role="assistant", content=None, tool_calls=(call,)))
        out.append(Message(role="tool", content=f"result {i}", tool_call_id=f"c{i}",
                           name="echo"))
    return out


def test_each_request_encodes_only_the_messages_added_since_the_last() -> None:
    cache, calls = MessageCache(), []
    owner = object()
    messages = [Message(role="user", content=t) for t in ("a", "b")]
    data = cache.encode(owner, messages, counted(calls))
    assert data == [b'"a"', b'"b"'] and calls == ["a", "b"]
    messages = [*messages, Message(role="user", content="c")]
    data = cache.encode(owner, messages, counted(calls))
    assert data == [b'"a"', b'"b"', b'"c"'] and calls == ["a", "b", "c"]  # only "c" again
    cache.encode(owner, messages, counted(calls))
    assert calls == ["a", "b", "c"]  # nothing new: nothing encoded


def test_a_replaced_message_is_encoded_again_with_all_after_it() -> None:
    cache, calls = MessageCache(), []
    owner = object()
    messages = [Message(role="user", content=t) for t in ("a", "b", "c", "d")]
    cache.encode(owner, messages, counted(calls))
    compacted = [messages[0], Message(role="user", content="b, shorter"), messages[2]]
    data = cache.encode(owner, compacted, counted(calls))
    assert data == [b'"a"', b'"b, shorter"', b'"c"']
    # "c" is the same object, but it follows a replaced one: it is encoded again.
    assert calls[4:] == ["b, shorter", "c"]
    data = cache.encode(owner, compacted[:1], counted(calls))  # the history dropped
    assert data == [b'"a"'] and len(calls) == 6


def test_another_adapter_encodes_everything_afresh() -> None:
    cache, calls = MessageCache(), []
    messages = [Message(role="user", content=t) for t in ("a", "b")]
    cache.encode(object(), messages, counted(calls))
    cache.encode(object(), messages, counted(calls))
    assert calls == ["a", "b", "a", "b"]


def request(messages: list[Message], cache: MessageCache | None, system: str) -> ModelRequest:
    return ModelRequest(system=system, messages=tuple(messages), tools=(),
                        max_output_tokens=100, timeout_s=10.0, cache=cache)


def test_openai_bodies_with_the_cache_are_the_bodies_without_it() -> None:
    for system in ("be brief", ""):
        provider = OpenAIProvider(ProviderConfig(name="o", kind="openai", model="m",
                                                 base_url=LOCAL))
        cache = MessageCache()
        messages = conversation(0)
        for step in range(10):
            assert provider.encode(request(messages, cache, system)) == \
                provider.encode(request(messages, None, system))
            call = ToolCall(id=f"c{step}", name="echo", arguments="{}")
            messages = [*messages, Message(role="assistant", content=None, tool_calls=(call,)),
                        Message(role="tool", content=f"ok {step}", tool_call_id=f"c{step}")]
        compacted = [messages[0], Message(role="user", content="(earlier steps: summary)"),
                     *messages[-8:]]
        assert provider.encode(request(compacted, cache, system)) == \
            provider.encode(request(compacted, None, system))


def test_a_body_orjson_refuses_is_still_the_same_json() -> None:
    """An option orjson cannot encode (an integer beyond 64 bits) sends the whole body
    through the standard library, the cached messages included."""
    provider = OpenAIProvider(ProviderConfig(name="o", kind="openai", model="m",
                                             base_url=LOCAL, options={"seed": 2**70}))
    cache = MessageCache()
    messages = conversation(5)
    provider.encode(request(messages[:9], cache, "sys"))  # some messages cached first
    cached = json.loads(provider.encode(request(messages, cache, "sys")))
    assert cached == json.loads(provider.encode(request(messages, None, "sys")))
    assert cached["seed"] == 2**70 and len(cached["messages"]) == len(messages) + 1


def calls_of(monkeypatch: Any, module: Any, name: str) -> list[Any]:
    """The argument of every call of `module.name` from now on (a function of one)."""
    seen: list[Any] = []
    real = getattr(module, name)

    def counting(arg: Any) -> Any:
        seen.append(arg)
        return real(arg)

    monkeypatch.setattr(module, name, counting)
    return seen


def test_openai_encodes_each_message_of_a_turn_once(monkeypatch: Any) -> None:
    from turnkeeper.providers import openai

    encoded = calls_of(monkeypatch, openai, "encode_message")
    provider = OpenAIProvider(ProviderConfig(name="o", kind="openai", model="m",
                                             base_url=LOCAL))
    cache, messages = MessageCache(), conversation(10)
    for n in range(1, len(messages) + 1):  # a request a message, as a turn's steps go
        if n == CACHED_FROM:  # the short requests before: encoded whole
            encoded.clear()
        provider.encode(request(messages[:n], cache, "sys"))
    assert encoded == messages  # from then on, each message once, in order


def anthropic(cache: str) -> AnthropicProvider:
    return AnthropicProvider(ProviderConfig(name="a", kind="anthropic", model="m",
                                            base_url="http://127.0.0.1:1", cache=cache))


def varied_turn() -> list[Message]:
    """What an Anthropic request folds: results of several calls merged into one user
    message, a note between steps, a system message in the history (it joins the system
    prompt), an assistant with text and calls, one with neither (left out)."""
    out = [Message(role="user", content="the task")]
    for i in range(6):
        calls = tuple(ToolCall(id=f"c{i}.{k}", name="echo", arguments=json.dumps({"k": k}))
                      for k in range(1 + i % 3))
        out.append(Message(role="assistant", content=f"step {i}" if i % 2 else None,
                           tool_calls=calls))
        out += [Message(role="tool", content=f"r{c.id}", tool_call_id=c.id, name="echo")
                for c in calls]
        if i == 2:
            out.append(Message(role="user", content="[turnkeeper] a note"))
        if i == 3:
            out.append(Message(role="system", content="earlier turns, summed up"))
        if i == 4:
            out.append(Message(role="assistant", content=None))
    out.append(Message(role="assistant", content="done"))
    return out


def test_anthropic_bodies_with_the_cache_are_the_bodies_without_it() -> None:
    messages = varied_turn()
    for mode in ("auto", "off"):
        for system in ("be brief", ""):
            provider, cache = anthropic(mode), MessageCache()
            for n in range(1, len(messages) + 1):  # a request a message, as a turn goes
                assert provider.encode(request(messages[:n], cache, system)) == \
                    provider.encode(request(messages[:n], None, system)), (mode, system, n)
            compacted = [messages[0], Message(role="user", content="(summary)"),
                         *messages[-9:]]
            assert provider.encode(request(compacted, cache, system)) == \
                provider.encode(request(compacted, None, system))


def test_anthropic_marks_the_last_message_and_encodes_each_earlier_one_once(
        monkeypatch: Any) -> None:
    from turnkeeper.providers import anthropic as adapter

    inputs = calls_of(monkeypatch, adapter, "tool_input")
    provider, cache = anthropic("auto"), MessageCache()
    messages = conversation(20)
    for n in range(CACHED_FROM, len(messages) + 1):
        provider.encode(request(messages[:n], cache, "sys"))
    # Each call is parsed once for the cache, and once more for the request in which its
    # message is the last (the breakpoint's message, encoded apart): all but those the
    # first request found already before its last.
    early = [m.tool_calls[0].arguments for m in messages[:CACHED_FROM - 1] if m.tool_calls]
    late = [m.tool_calls[0].arguments for m in messages[CACHED_FROM - 1:] if m.tool_calls]
    assert sorted(inputs) == sorted(early + late * 2)
    body = json.loads(provider.encode(request(messages, cache, "sys")))
    last = body["messages"][-1]
    assert last["role"] == "user" and last["content"][-1]["cache_control"] == {
        "type": "ephemeral"}
    assert all("cache_control" not in json.dumps(m) for m in body["messages"][:-1])


def test_an_anthropic_body_orjson_refuses_is_still_the_same_json() -> None:
    provider = AnthropicProvider(ProviderConfig(
        name="a", kind="anthropic", model="m", base_url="http://127.0.0.1:1",
        options={"seed": 2**70}))
    cache, messages = MessageCache(), varied_turn()
    provider.encode(request(messages[:12], cache, "sys"))  # some messages cached first
    cached = json.loads(provider.encode(request(messages, cache, "sys")))
    assert cached == json.loads(provider.encode(request(messages, None, "sys")))
    assert cached["seed"] == 2**70 and "cache_control" in json.dumps(cached["messages"][-1])


def test_a_cached_message_holds_the_memory_of_its_bytes_not_of_the_encoders_buffer() -> None:
    """orjson writes into a buffer of at least 4 KiB and keeps it whole: a turn's cache
    of 200 short messages held 800 KiB. What the cache keeps is sized to the bytes."""
    messages = conversation(100)
    cache = MessageCache()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        data = cache.encode(object(), messages,
                            lambda m, _p: jsonwire.dumps({"content": m.content}))
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(data) == len(messages) == 201
    assert held < 201 * 200, held  # each under 200 bytes with its object; 4 KiB before
