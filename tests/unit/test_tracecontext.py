"""The W3C traceparent: what a submit may carry, and what the daemon writes."""

from __future__ import annotations

import pytest

from turnkeeper.tracecontext import (
    TraceParent,
    format_traceparent,
    parse_traceparent,
    traceparent_problem,
)

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
SPAN = "00f067aa0ba902b7"
VALID = f"00-{TRACE}-{SPAN}-01"


def test_a_valid_traceparent_is_read_field_by_field() -> None:
    tp = parse_traceparent(VALID)
    assert tp == TraceParent(trace_id=TRACE, span_id=SPAN, flags=1)
    assert tp.sampled
    assert tp.header() == VALID


def test_the_sampled_flag_is_bit_zero() -> None:
    assert not parse_traceparent(f"00-{TRACE}-{SPAN}-00").sampled
    assert parse_traceparent(f"00-{TRACE}-{SPAN}-03").sampled


@pytest.mark.parametrize("value, says", [
    ("", "must be 00-"),
    ("hello", "must be 00-"),
    (f"00-{TRACE.upper()}-{SPAN}-01", "lower-case"),
    (f"00-{TRACE[:-1]}-{SPAN}-01", "must be 00-"),
    (f"00-{TRACE}-{SPAN}0-01", "must be 00-"),
    (f"00-{TRACE}-{SPAN}-1", "must be 00-"),
    (f"ff-{TRACE}-{SPAN}-01", "version ff"),
    (f"00-{'0' * 32}-{SPAN}-01", "trace id is all zeros"),
    (f"00-{TRACE}-{'0' * 16}-01", "parent id is all zeros"),
    (f"00-{TRACE}-{SPAN}-01-extra", "exactly four fields"),
    (f" {VALID}", "must be 00-"),
    (VALID + "\n", "must be 00-"),
    ("01-" + "a" * 600, "longer than"),
])
def test_a_malformed_traceparent_says_what_is_wrong(value: str, says: str) -> None:
    problem = traceparent_problem(value)
    assert problem is not None and says in problem
    with pytest.raises(ValueError, match=says.split()[0]):
        parse_traceparent(value)


def test_a_later_version_keeps_its_four_known_fields_and_drops_the_rest() -> None:
    """A version above 00 may add fields: accepted, read as version 00 would be."""
    tp = parse_traceparent(f"01-{TRACE}-{SPAN}-01-more-fields")
    assert (tp.trace_id, tp.span_id, tp.flags) == (TRACE, SPAN, 1)
    assert tp.header() == VALID


def test_format_writes_version_00_and_refuses_what_is_not_an_id() -> None:
    assert format_traceparent(TRACE, SPAN, 1) == VALID
    assert format_traceparent(TRACE, SPAN, 0x100) == f"00-{TRACE}-{SPAN}-00"
    with pytest.raises(ValueError):
        format_traceparent(TRACE[:-1], SPAN, 1)
    with pytest.raises(ValueError):
        format_traceparent(TRACE, SPAN.upper(), 1)
