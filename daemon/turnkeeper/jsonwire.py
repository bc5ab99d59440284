"""Compact JSON for what the daemon encodes and reads many times a second: events (their
store row and the NDJSON streams), model requests, and the model's replies.

orjson does the work (several times faster than the standard library's encoder); what it
refuses, the standard library encodes instead, so a value `json.dumps` accepts is never
an error here: an integer beyond 64 bits, a key that is not a string, a string with a
lone surrogate, nesting deeper than orjson's limit. The output has no spaces and keeps
non-ASCII text as UTF-8. Two differences from `json.dumps`, both still the same values
to any JSON reader: a NaN or an infinity is written `null` (`json.dumps` writes `NaN`,
which is not JSON), and a float may be spelled differently (`1e-7`, not `1e-07`).

`loads` reads with orjson too, and hands the standard library what orjson would refuse
or read differently, so it returns exactly what `json.loads` returns (`NaN`, lone
surrogates in escapes, and integers beyond 64 bits, which orjson would turn into floats)
and fails with the standard library's error and message.

`Encoded` holds a value encoded once (a provider's tool list, once per tool offer; a
request's messages, joined from each message's bytes): put in a larger value, its bytes
are spliced in as they are.

Only the daemon imports this module: the CLI keeps its fast start without orjson.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import orjson

__all__ = ["Encoded", "dumps", "dumps_any", "dumps_str", "kept", "loads"]


class Encoded:
    """`value`, encoded once; `dumps` of a larger value containing it copies its bytes.
    A caller that has the bytes already gives them as `data`, and the value as a
    function (`value_of`) the standard library's fallback calls should it need it."""

    __slots__ = ("_value", "_value_of", "fragment")

    def __init__(self, value: Any = None, data: bytes | None = None, *,
                 value_of: Callable[[], Any] | None = None) -> None:
        self._value, self._value_of = value, value_of
        self.fragment = orjson.Fragment(dumps(value) if data is None else data)

    @property
    def value(self) -> Any:
        return self._value if self._value_of is None else self._value_of()

    def __repr__(self) -> str:
        return f"Encoded({self.value!r})"


def _fragment(value: Any) -> Any:
    """orjson's hook for a type it does not know: an `Encoded` is its fragment."""
    if isinstance(value, Encoded):
        return value.fragment
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def _value(value: Any) -> Any:
    """The standard library's hook: an `Encoded` is encoded again from its value."""
    if isinstance(value, Encoded):
        return value.value
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


# The fallbacks. The bytes form escapes non-ASCII text: a lone surrogate (the reason
# orjson refused) has no UTF-8 encoding, and \u escapes are valid JSON for any string.
_STD_ASCII = json.JSONEncoder(separators=(",", ":"), ensure_ascii=True,
                              default=_value)
_STD_TEXT = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False,
                             default=_value)


def dumps(value: Any) -> bytes:
    """`value` as compact JSON in UTF-8."""
    try:
        return orjson.dumps(value, default=_fragment)
    except TypeError:  # orjson.JSONEncodeError is a TypeError
        return _STD_ASCII.encode(value).encode("ascii")


def dumps_plain(value: Any) -> bytes:
    """`value` as compact JSON in UTF-8, made of JSON's own types only (raises TypeError
    otherwise), in one call that holds the GIL from start to end: no other thread runs
    meanwhile, so one may encode what another thread's code changes."""
    return orjson.dumps(value)


# Every byte to a space but digits, to "0": twenty "0"s in a row in the translation is a
# number of twenty digits or more, which orjson would read as a float.
_DIGITS = bytes(0x30 if 0x30 <= b <= 0x39 else 0x20 for b in range(256))
_LONG_NUMBER = b"0" * 20


def loads(data: bytes) -> Any:
    """`json.loads(data)`: the same values, and on bad input the same `JSONDecodeError`
    (or `UnicodeDecodeError`); three times faster on a model's reply."""
    if _LONG_NUMBER not in data.translate(_DIGITS):
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError:
            pass
    return json.loads(data)


def kept(data: bytes) -> bytes:
    """`data` (from `dumps`) in a bytes object of its own size, for what is kept long.
    orjson writes into a buffer of at least 4 KiB and gives none of it back when the
    output is shorter, so a kept 100-byte encoding held 4 KiB (a follower's waiting
    events, a turn's encoded messages)."""
    return memoryview(data).tobytes()


def dumps_str(value: Any) -> str:
    """`value` as compact JSON text (non-ASCII kept as it is)."""
    try:
        return orjson.dumps(value, default=_fragment).decode()
    except TypeError:
        return _STD_TEXT.encode(value)


def _repr(value: Any) -> Any:
    """orjson's hook for `dumps_any`: an `Encoded` is its fragment, anything else its repr."""
    return value.fragment if isinstance(value, Encoded) else repr(value)


def _value_or_repr(value: Any) -> Any:
    """The standard library's hook for `dumps_any`: an `Encoded` is its value, as in
    `dumps_str`, anything else its repr."""
    return value.value if isinstance(value, Encoded) else repr(value)


_STD_REPR = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False,
                             default=_value_or_repr)


def dumps_any(value: Any) -> str:
    """`dumps_str`, with any value JSON has no form for written as its `repr()`: for
    a log line, which must never fail over what it carries."""
    try:
        return orjson.dumps(value, default=_repr).decode()
    except TypeError:
        return _STD_REPR.encode(value)
