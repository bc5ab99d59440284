"""Compact JSON for events and model requests: the same values as `json.dumps` for
everything `json.dumps` accepts (orjson, or the standard library where orjson refuses),
and an event encoded once for the store and every stream."""

from __future__ import annotations

import json
from typing import Any

import pytest

from turnkeeper import event_types as ev
from turnkeeper import jsonwire
from turnkeeper.clock import FakeClock
from turnkeeper.events import EventBus

_STD = {"separators": (",", ":"), "ensure_ascii": False}

VALUES: list[Any] = [
    {"seq": 3, "ts": 1764536000.123456, "turn": "t1", "type": "tool.call",
     "arguments": {"text": "héllo ✓", "n": [1, 2.5, None, True]}},
    {"cost_usd": 1.5e-05, "small": 1e-07, "big": 1e16, "neg": -0.0},
    [],
    "plain",
]
# What orjson refuses and the standard library takes: each still encodes.
REFUSED_BY_ORJSON: list[Any] = [
    {"big": 2 ** 70},  # beyond 64 bits
    {1: "int key"},  # a key that is not a string
    {"text": "lone \ud800 surrogate"},  # no UTF-8 encoding
    json.loads("[" * 300 + "]" * 300),  # deeper than orjson's limit
]


@pytest.mark.parametrize("value", VALUES + REFUSED_BY_ORJSON)
def test_the_same_values_as_the_standard_library(value: Any) -> None:
    expected = json.loads(json.dumps(value, **_STD))  # type: ignore[arg-type]
    assert json.loads(jsonwire.dumps(value)) == expected
    assert json.loads(jsonwire.dumps_str(value)) == expected


# What orjson reads differently from the standard library, or not at all.
READ_BY_THE_STANDARD_LIBRARY = [
    b'{"id": 123456789012345678901234567890}',  # orjson: a float
    b'[-18446744073709551616, 1.00000000000000000000001]',
    b'{"score": NaN, "limit": Infinity}',
    b'"lone \\ud800 surrogate"',
    b"[" * 300 + b"]" * 300,
]


@pytest.mark.parametrize("raw", [*(json.dumps(v, **_STD).encode()  # type: ignore[arg-type]
                                   for v in VALUES), *READ_BY_THE_STANDARD_LIBRARY])
def test_loads_reads_what_the_standard_library_reads(raw: bytes) -> None:
    value = jsonwire.loads(raw)
    assert repr(value) == repr(json.loads(raw))  # repr: an int stays an int, NaN is NaN


@pytest.mark.parametrize("raw", [b"", b"[1,", b'{"a" 1}', b"\xff\xfe", b"[1] x"])
def test_loads_fails_as_the_standard_library_fails(raw: bytes) -> None:
    with pytest.raises(ValueError) as ours:
        jsonwire.loads(raw)
    with pytest.raises(ValueError) as std:
        json.loads(raw)
    assert type(ours.value) is type(std.value)
    assert str(ours.value) == str(std.value)


def test_compact_and_utf8() -> None:
    assert jsonwire.dumps({"a": [1, "é"]}) == '{"a":[1,"é"]}'.encode()
    assert jsonwire.dumps_str({"a": [1, "é"]}) == '{"a":[1,"é"]}'


def test_a_lone_surrogate_is_escaped_in_the_bytes_form() -> None:
    out = jsonwire.dumps({"text": "a\ud800b"})
    assert out == b'{"text":"a\\ud800b"}'


def test_nan_is_written_as_null() -> None:
    assert jsonwire.dumps({"x": float("nan"), "y": float("inf")}) == b'{"x":null,"y":null}'


def test_what_json_refuses_is_still_refused() -> None:
    with pytest.raises(TypeError):
        jsonwire.dumps({"x": object()})
    with pytest.raises(TypeError):
        jsonwire.dumps_str({"x": object()})


def test_an_encoded_value_goes_in_as_it_is_also_through_the_fallback() -> None:
    tools = jsonwire.Encoded([{"name": "echo"}])
    assert jsonwire.dumps({"tools": tools, "n": 1}) == b'{"tools":[{"name":"echo"}],"n":1}'
    # An integer orjson refuses sends the whole body through the standard library.
    out = jsonwire.dumps({"tools": tools, "n": 2 ** 70})
    assert json.loads(out) == {"tools": [{"name": "echo"}], "n": 2 ** 70}


def test_an_event_is_encoded_once_as_its_wire_json() -> None:
    bus = EventBus(clock=FakeClock(start=1764536000.25))
    event = bus.publish(ev.ToolCalled(tool="echo", call_id="c1", key="k",
                                      arguments={"text": "héllo"}), turn="t1")
    wire = event.encoded_bytes()
    assert json.loads(wire) == event.to_json()
    # Field order as the wire form always had it: the envelope, then the fields.
    assert list(json.loads(wire)) == ["seq", "ts", "turn", "type", "tool", "call_id", "key",
                                      "arguments"]
    assert event.encoded_bytes() is wire  # cached
    assert event.encoded() == wire.decode()
    assert json.loads(event.encoded()) == json.loads(
        json.dumps(event.to_json(), **_STD))  # type: ignore[arg-type]


def test_a_cached_encoding_is_not_part_of_an_events_identity() -> None:
    bus = EventBus(clock=FakeClock(start=5.0))
    a = bus.prepare(ev.TurnSuspended(step=2), turn="t")
    b = type(a)(seq=a.seq, ts=a.ts, type=a.type, turn=a.turn, data=dict(a.data))
    a.encoded_bytes()
    assert a == b
    assert "wire" not in repr(a)
