"""How long one model call may last, start to end, and what a cut at that bound means.

A per-read timeout never cuts a provider that keeps its stream alive (a keepalive
comment, or one token now and then): a turn could run on past its deadline for as long
as the provider liked. So every call also has a total bound, the lesser of two limits:

- the turn's time left (active seconds, deadline, and any other clock its budget keeps:
  whatever `BudgetGuard.remaining_seconds` answers). A cut there is the turn's own time
  stop (`budget.seconds`, `deadline`...), asked of the budget right after: the provider
  did nothing wrong, and its breaker is not told;
- the provider's `max_call_seconds`. A cut there is a timeout like a read timeout:
  retryable, counted in `provider_attempts` and told to the provider's breaker.

A stream that sends only keepalives for the provider's `idle_timeout` is cut as well
(the adapter watches it); that failure is retryable too, and named here with the others.
"""

from __future__ import annotations

from typing import NamedTuple

from turnkeeper.policy.classify import CallFailure

# The exception names the adapter and the model call report for the two provider-side
# cuts; both classify as retryable (see `classify.RETRYABLE_EXCEPTIONS`).
CALL_TIMEOUT = ("CallTimeout", "TimeoutError")
IDLE_STREAM = ("IdleStream", "TimeoutError")


class CallBound(NamedTuple):
    """The total time one call may take (`seconds`) and whether the turn's time left
    (`by_turn`) or the provider's `max_call_seconds` sets it. Equal limits: the turn's,
    since its stop is the more precise account of what ran out. A named tuple: one is
    made for every model call, and a frozen dataclass costs a call per field."""

    seconds: float
    by_turn: bool
    max_call_s: float

    @classmethod
    def of(cls, *, turn_left_s: float, max_call_s: float) -> CallBound:
        turn_left_s = max(0.0, turn_left_s)
        # (seconds, by_turn, max_call_s), built as a tuple is: a named tuple's own
        # constructor is a Python call, and one is made for every model call.
        if turn_left_s <= max_call_s:
            return tuple.__new__(cls, (turn_left_s, True, max_call_s))
        return tuple.__new__(cls, (max_call_s, False, max_call_s))

    def failure(self) -> CallFailure:
        """The failure of a call this bound cut. The model call asks the budget first
        when the turn's time set the bound: only when the budget sees time left after
        all (the wall clock stepped back under a deadline) is it a failure at all."""
        if self.by_turn:  # ours to answer for, not the provider's: its breaker is not told
            return CallFailure(exception=CALL_TIMEOUT, local=True,
                               message=f"no complete answer within the turn's time left "
                                       f"({_num(round(self.seconds, 3))} s)")
        return CallFailure(exception=CALL_TIMEOUT,
                           message=f"no complete answer within max_call_seconds = "
                                   f"{_num(self.max_call_s)} s")


def idle_failure(idle_s: float) -> CallFailure:
    """A started stream that made no progress (only keepalives) for `idle_s`."""
    return CallFailure(exception=IDLE_STREAM,
                       message=f"the stream brought no progress for idle_timeout = "
                               f"{_num(idle_s)} s (keepalives only)")


def _num(x: float) -> str:
    return f"{x:g}"
