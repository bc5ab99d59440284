"""The turn's budget: tokens, active seconds, wall seconds, steps, cost and an optional
deadline.

Three decisions live here:

- the hard stop (`BudgetGuard.check`), at the top of a step before anything is spent: a
  spent dimension ends the turn with its own stop code, whatever the model would have
  liked to do next;
- the pre-flight (`BudgetGuard.preflight`), before every model call: a budget is a
  ceiling, not a line the crossing step may pass. The request's input is estimated
  (`policy/usage.py`, never under characters / 4, priced at its dearest input rate);
  when it and a minimal answer do not fit in what is left of `max_tokens` or
  `max_cost_usd` the call is not made (`budget.tokens` / `budget.cost`, value = what was
  spent), and otherwise the output cap sent to the provider is cut so that input + cap
  fits. A provider that counts no more than the estimate can then never take a turn
  past its limit;
- the soft note (`BudgetGuard.soft_warning`): once a dimension passes `soft_limit` of its
  limit, or as soon as the next call would not fit with the provider's full output cap
  (whichever comes first), the agent is told, once, what is left, so it can wrap up
  before the hard stop cuts it off mid-thought.

The limits and the usage themselves are data (`policy/budget_limits.py`).
The guard never measures anything. The runner owns the counters (`BudgetUsage`) and the
clock and passes both in; the guard only compares. Active time (`usage.seconds`) excludes
time parked in auto-recovery or waiting for a clarify answer. Two limits count every
second instead, so they are compared with `now` (epoch seconds), not with usage: the
absolute `deadline`, and `max_wall_seconds` from the turn's first start (`started_at`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, NamedTuple

from turnkeeper.policy.budget_limits import OVERRIDABLE as OVERRIDABLE
from turnkeeper.policy.budget_limits import UNBOUNDED_TOKENS as UNBOUNDED_TOKENS
from turnkeeper.policy.budget_limits import BudgetLimits as BudgetLimits
from turnkeeper.policy.budget_limits import BudgetSettings as BudgetSettings
from turnkeeper.policy.budget_limits import BudgetUsage as BudgetUsage
from turnkeeper.policy.outcome import Stop, StopCode
from turnkeeper.policy.usage import Prices
from turnkeeper.policy.usage import cost_usd as cost_usd

# Soft-warning dimensions, in the order they are reported.
DIMENSIONS = ("tokens", "seconds", "steps", "cost_usd")

# Between attempts, less time than this left counts as none: a request could only time
# out, and timers fire a little early or late, so "exactly spent" is no reliable test.
TIME_RESERVE_S = 0.01

# The least answer a model call is made for: a request whose input leaves room for fewer
# output tokens than this (or than the provider's own cap, if lower) is not sent. Enough
# for a short answer or a report_blocked call.
MIN_ANSWER_TOKENS = 64
# Taken off the cost left before the output cap is worked out: the sums of float prices
# and the rounding of the charged cost must not push a call that fits a hair past it.
COST_MARGIN_USD = 1e-8

# The stops of the limits that count every second, waits included: a wait that cannot
# end before them stops the turn with their code when they are reached.
CLOCK_STOPS = frozenset({StopCode.DEADLINE, StopCode.BUDGET_WALL_SECONDS})


def _num(value: float) -> str:
    """300.0 -> "300", 12.5 -> "12.5": limits read the way an operator wrote them."""
    if float(value).is_integer():
        return str(int(value))
    return f"{value:g}"


def _usd(value: float) -> str:
    return f"${value:,.2f}"


@dataclass(frozen=True, slots=True)
class SoftWarning:
    """One system note for the agent: which dimensions just passed the soft limit, and
    what is left, in words a model acts on."""

    dimensions: tuple[str, ...]
    message: str


class Preflight(NamedTuple):
    """The next model call fits: send `max_output_tokens`. `short` names the dimensions
    ("tokens", "cost_usd") in which the provider's own cap did not fit and was cut: the
    call would cross the limit if the model used all of it. A named tuple, as
    `BudgetUsage` is: one is made at every step."""

    max_output_tokens: int
    short: tuple[str, ...] = ()


class BudgetGuard:
    """Hard stops, the pre-flight of a model call and soft notes for one turn's budget.

    `check` precedence, first match wins (fixed so that the same usage always names the
    same counter):

    1. `deadline`            now >= deadline                 value = now, limit = deadline
    2. `budget.wall_seconds` now - started_at >= max_wall_seconds (when set)
    3. `budget.seconds`      usage.seconds >= max_seconds
    4. `budget.tokens`       usage.tokens >= max_tokens
    5. `budget.cost`         max_cost_usd > 0 and cost >= max_cost_usd
    6. `budget.steps`        usage.steps >= max_steps  (so a turn runs at most max_steps)

    The clock limits come first because they count everything, the deadline being the
    caller's own word; steps come last because they are only a backstop behind the real
    budgets.

    The only state is which dimensions were already warned about, so that each warns
    once per turn; `snapshot`/`restore` carry it across a checkpoint."""

    def __init__(self, limits: BudgetLimits) -> None:
        self.limits = limits
        self._warned: set[str] = set()

    def __repr__(self) -> str:
        return f"BudgetGuard(limits={self.limits!r}, warned={sorted(self._warned)!r})"

    @property
    def warned(self) -> frozenset[str]:
        return frozenset(self._warned)

    def check(self, usage: BudgetUsage, *, now: float) -> Stop | None:
        """The hard stop, or None when the next step may start."""
        lim = self.limits
        wall_end = lim.wall_deadline
        # Plain comparisons first: this runs every step and is almost always "no".
        if (usage.seconds < lim.max_seconds and usage.tokens < lim.max_tokens
                and usage.steps < lim.max_steps
                and (lim.max_cost_usd <= 0 or usage.cost_usd < lim.max_cost_usd)
                and (lim.deadline is None or now < lim.deadline)
                and (wall_end is None or now < wall_end)):
            return None
        for stop in self.violations(usage, now=now):
            return stop
        return None

    def violations(self, usage: BudgetUsage, *, now: float) -> Iterator[Stop]:
        """Every limit the usage has reached, in `check`'s precedence. A turn whose
        budget is only observed needs them all: one reached limit must not hide the
        next."""
        lim = self.limits
        yield from self._clock_stops(now, reserve_s=0.0)
        if usage.seconds >= lim.max_seconds:
            yield self._seconds_stop(usage)
        if usage.tokens >= lim.max_tokens:
            yield Stop(StopCode.BUDGET_TOKENS, f"token budget of {lim.max_tokens} spent",
                       value=usage.tokens, limit=lim.max_tokens)
        if lim.max_cost_usd > 0 and usage.cost_usd >= lim.max_cost_usd:
            yield Stop(StopCode.BUDGET_COST, f"cost budget of {_usd(lim.max_cost_usd)} spent",
                       value=usage.cost_usd, limit=lim.max_cost_usd)
        if usage.steps >= lim.max_steps:
            yield Stop(StopCode.BUDGET_STEPS, f"step budget of {lim.max_steps} steps spent",
                       value=usage.steps, limit=lim.max_steps)

    def _clock_stops(self, now: float, *, reserve_s: float) -> Iterator[Stop]:
        """The deadline's stop, then the wall clock's, once less than `reserve_s` is left
        of them."""
        lim = self.limits

        def reached(end: float) -> bool:
            return end - now < reserve_s if reserve_s > 0 else now >= end

        if lim.deadline is not None and reached(lim.deadline):
            when = datetime.fromtimestamp(lim.deadline, tz=UTC).isoformat(timespec="seconds")
            yield Stop(StopCode.DEADLINE,
                       f"deadline {when} {'reached' if reserve_s > 0 else 'passed'}",
                       value=now, limit=lim.deadline)
        wall_end = lim.wall_deadline
        if wall_end is not None and lim.started_at is not None and reached(wall_end):
            yield Stop(StopCode.BUDGET_WALL_SECONDS,
                       f"wall-clock budget of {_num(lim.max_wall_seconds)} s since the turn "
                       "started spent", value=round(now - lim.started_at, 6),
                       limit=lim.max_wall_seconds)

    def _seconds_stop(self, usage: BudgetUsage) -> Stop:
        lim = self.limits
        return Stop(StopCode.BUDGET_SECONDS,
                    f"time budget of {_num(lim.max_seconds)} s of active time spent",
                    value=usage.seconds, limit=lim.max_seconds)

    def check_time(self, usage: BudgetUsage, *, now: float,
                   reserve_s: float = TIME_RESERVE_S) -> Stop | None:
        """The time stop alone (`deadline`, then `budget.wall_seconds`, then
        `budget.seconds`) once less than `reserve_s` is left. Asked between attempts,
        before tool calls and after waits, where the step's own counters (already
        incremented) must not stop it but a spent clock must: the value is the counter
        as it is, possibly a hair under the limit."""
        lim = self.limits
        if lim.deadline is not None or lim.wall_deadline is not None:
            for stop in self._clock_stops(now, reserve_s=reserve_s):
                return stop
        if self.limits.max_seconds - usage.seconds < reserve_s:
            return self._seconds_stop(usage)
        return None

    def clock_left(self, now: float) -> float:
        """Seconds until the deadline or the wall clock runs out, whichever is first;
        inf when neither is set. What a park (a recovery or clarify wait, which is not
        active time) may last at most."""
        lim = self.limits
        left = math.inf if lim.deadline is None else lim.deadline - now
        wall_end = lim.wall_deadline
        if wall_end is not None:
            left = min(left, wall_end - now)
        return max(0.0, left)

    def clock_binds(self, usage: BudgetUsage, *, now: float) -> bool:
        """Whether the deadline or the wall clock runs out before the active time: a
        wait refused for want of time then ends the turn with their stop when they are
        reached (a wait is active time, so waiting out active time proves nothing)."""
        return self.clock_left(now) <= self.limits.max_seconds - usage.seconds

    def preflight(self, usage: BudgetUsage, *, input_tokens: int, max_output_tokens: int,
                  prices: Prices | None = None) -> Preflight | Stop:
        """Whether a model call of `input_tokens` (the estimate) may be made, and the
        output cap to send: the provider's `max_output_tokens`, cut so that input + cap
        fits in the tokens left and, with the cost dimension on, input at its dearest
        rate + cap at the output rate fits in the cost left. When not even
        `MIN_ANSWER_TOKENS` (or the provider's cap, if lower) fit, the stop of the
        dimension that is short, before the call: value = what was spent, so it never
        exceeds the limit."""
        lim = self.limits
        least = max(1, min(MIN_ANSWER_TOKENS, max_output_tokens))
        cap = max_output_tokens
        short: list[str] = []
        tokens_left = lim.max_tokens - usage.tokens
        if input_tokens + least > tokens_left:
            return Stop(StopCode.BUDGET_TOKENS,
                        f"token budget of {lim.max_tokens}: {usage.tokens} spent, and the "
                        f"next request (an estimated {input_tokens} input tokens and an "
                        f"answer of at least {least}) does not fit in the "
                        f"{max(0, tokens_left)} left",
                        value=usage.tokens, limit=lim.max_tokens)
        if input_tokens + cap > tokens_left:
            cap = tokens_left - input_tokens
            short.append("tokens")
        if lim.max_cost_usd > 0 and prices is not None:
            cost_left = lim.max_cost_usd - usage.cost_usd - COST_MARGIN_USD
            need = prices.worst_cost_usd(input_tokens, least)
            if need > cost_left:
                return Stop(StopCode.BUDGET_COST,
                            f"cost budget of {_usd(lim.max_cost_usd)}: "
                            f"${usage.cost_usd:,.4f} spent, and the next request (an "
                            f"estimated {input_tokens} input tokens and an answer of at "
                            f"least {least}, ${need:,.4f}) does not fit in the "
                            f"${max(0.0, cost_left):,.4f} left",
                            value=usage.cost_usd, limit=lim.max_cost_usd)
            if prices.worst_cost_usd(input_tokens, cap) > cost_left:
                spare = cost_left - prices.worst_cost_usd(input_tokens, 0)
                cap = max(least, min(cap, math.floor(spare * 1e6 / prices.output_per_mtok)))
                short.append("cost_usd")
        # Built as a tuple is (max_output_tokens, short): a named tuple's own
        # constructor is a Python call, and this runs at every step.
        return tuple.__new__(Preflight, (max(1, cap), tuple(short)))

    def soft_warning(self, usage: BudgetUsage, *, now: float,
                     short: tuple[str, ...] = ()) -> SoftWarning | None:
        """A note for each dimension that has reached `soft_limit` of its limit, or in
        which the next model call would not fit whole (`short`, from `preflight`), and
        was not warned about yet; several together make one note. None otherwise.

        The clock limits have no soft note: the deadline has no start to take a fraction
        of, and `remaining_seconds` already keeps every wait inside both. `now` is taken
        for that symmetry with `check` and is not used today."""
        del now
        lim = self.limits
        f = lim.soft_limit
        # Plain comparisons first: this runs every step and is almost always "no".
        if (not short and usage.tokens < f * lim.max_tokens
                and usage.seconds < f * lim.max_seconds
                and usage.steps < f * lim.max_steps
                and (lim.max_cost_usd <= 0 or usage.cost_usd < f * lim.max_cost_usd)):
            return None
        spent = {"tokens": (usage.tokens, lim.max_tokens),
                 "seconds": (usage.seconds, lim.max_seconds),
                 "steps": (usage.steps, lim.max_steps),
                 "cost_usd": (usage.cost_usd, lim.max_cost_usd)}
        crossed = tuple(
            dim for dim in DIMENSIONS
            if dim not in self._warned and spent[dim][1] > 0
            and (spent[dim][0] >= f * spent[dim][1] or dim in short))
        if not crossed:
            return None
        self._warned.update(crossed)
        parts = [_left(dim, *spent[dim]) for dim in crossed]
        message = (f"Budget note: {', '.join(parts)}. Answer now with what you have, or call "
                   "report_blocked with what you tried and found.")
        return SoftWarning(dimensions=crossed, message=message)

    def remaining_seconds(self, usage: BudgetUsage, *, now: float) -> float:
        """Time any wait, request or stream may still take: the least of active time
        left, time to the deadline and time to the end of the wall clock, never
        negative. (`clock_left` written out: this is asked several times a step.)"""
        lim = self.limits
        clock = math.inf if lim.deadline is None else lim.deadline - now
        wall_end = lim.wall_deadline
        if wall_end is not None:
            clock = min(clock, wall_end - now)
        return max(0.0, min(lim.max_seconds - usage.seconds, max(0.0, clock)))

    def snapshot(self) -> dict[str, Any]:
        return {"warned": sorted(self._warned) if self._warned else []}

    @classmethod
    def restore(cls, data: Mapping[str, Any], limits: BudgetLimits) -> BudgetGuard:
        guard = cls(limits)
        guard._warned = {str(d) for d in data.get("warned", ()) if d in DIMENSIONS}
        return guard


def _left(dim: str, used: float, limit: float) -> str:
    left = max(0.0, limit - used)
    if dim == "tokens":
        return f"{int(left):,} of {int(limit):,} tokens left"
    if dim == "steps":
        return f"{int(left)} of {int(limit)} steps left"
    if dim == "seconds":
        return f"{math.floor(left)} of {_num(limit)} seconds left"
    return f"{_usd(left)} of {_usd(limit)} left"
