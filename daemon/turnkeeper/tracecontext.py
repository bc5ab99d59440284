"""W3C trace context: the `traceparent` a caller hands a submit, and the one the daemon
sends on with each request it makes for a turn (providers, http tools, MCP servers).

    traceparent = version "-" trace-id "-" parent-id "-" trace-flags
                  00      -  32 hex   -   16 hex    -  2 hex

Lower-case hex only; a trace id or a parent id of all zeros is invalid; version ff is
invalid. A version above 00 may carry more fields after the flags (the recommendation's
forward compatibility): they are accepted and dropped, the four known ones kept. Pure:
no I/O, no OpenTelemetry (the daemon keeps and forwards a traceparent with tracing off).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_HEX = frozenset("0123456789abcdef")
# The shape (what the API's schema says); `traceparent_problem` checks the rest.
PATTERN = r"^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}(-.*)?$"
_FIELDS = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")
_ZERO_TRACE = "0" * 32
_ZERO_SPAN = "0" * 16
MAX_LENGTH = 512  # a header of a later version may be longer; nothing sane is this long


@dataclass(frozen=True, slots=True)
class TraceParent:
    trace_id: str  # 32 lower-case hex digits, not all zero
    span_id: str  # 16 lower-case hex digits, not all zero (the caller's span)
    flags: int  # bit 0: sampled

    @property
    def sampled(self) -> bool:
        return bool(self.flags & 1)

    def header(self) -> str:
        """The version 00 header of this context."""
        return format_traceparent(self.trace_id, self.span_id, self.flags)


def traceparent_problem(value: str) -> str | None:
    """What is wrong with `value` as a traceparent, or None when it is valid."""
    if len(value) > MAX_LENGTH:
        return f"is longer than {MAX_LENGTH} characters"
    m = _FIELDS.fullmatch(value)
    if m is None:
        return ("must be 00-<32 hex trace id>-<16 hex parent id>-<2 hex flags>, in "
                "lower-case hex (W3C trace context)")
    version, trace_id, span_id, _flags, rest = m.groups()
    if version == "ff":
        return "version ff is invalid"
    if version == "00" and rest:
        return "a version 00 traceparent has exactly four fields"
    if trace_id == _ZERO_TRACE:
        return "the trace id is all zeros"
    if span_id == _ZERO_SPAN:
        return "the parent id is all zeros"
    return None


def parse_traceparent(value: str) -> TraceParent:
    """The context of a valid traceparent; ValueError (saying why) otherwise."""
    problem = traceparent_problem(value)
    if problem is not None:
        raise ValueError(problem)
    _version, trace_id, span_id, flags = value.split("-", 4)[:4]
    return TraceParent(trace_id=trace_id, span_id=span_id, flags=int(flags, 16))


def format_traceparent(trace_id: str, span_id: str, flags: int) -> str:
    """A version 00 traceparent. `trace_id` and `span_id` are lower-case hex of 32 and 16
    digits (as `f"{n:032x}"` writes an OpenTelemetry id)."""
    if (len(trace_id) != 32 or len(span_id) != 16 or not _HEX.issuperset(trace_id)
            or not _HEX.issuperset(span_id)):
        raise ValueError(f"not a trace id and span id: {trace_id!r}, {span_id!r}")
    return f"00-{trace_id}-{span_id}-{flags & 0xff:02x}"
