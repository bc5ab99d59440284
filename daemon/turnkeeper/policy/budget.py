"""The turn's budget: tokens, active seconds, steps, cost and an optional deadline.

Two decisions live here, both taken at the top of a step before anything is spent:

- the hard stop (`BudgetGuard.check`): a spent dimension ends the turn with its own stop
  code, whatever the model would have liked to do next;
- the soft note (`BudgetGuard.soft_warning`): once a dimension passes `soft_limit` of its
  limit the agent is told, once, what is left, so it can wrap up before the hard stop
  cuts it off mid-thought.

The guard never measures anything. The runner owns the counters (`BudgetUsage`) and the
clock and passes both in; the guard only compares. Active time (`usage.seconds`) excludes
time parked in auto-recovery or waiting for a clarify answer; the deadline is absolute
and counts everything, so it is compared with `now` (epoch seconds), not with usage.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, NamedTuple

from turnkeeper.policy.outcome import Stop, StopCode

if TYPE_CHECKING:  # config is pydantic: policy/ never imports it at run time
    from turnkeeper.config import BudgetConfig

# The keys a submit may override for its own turn (the `budget` object of POST /v1/turns).
OVERRIDABLE = ("max_tokens", "max_seconds", "max_steps", "max_cost_usd")
UNBOUNDED_TOKENS = 2**62

# Soft-warning dimensions, in the order they are reported.
DIMENSIONS = ("tokens", "seconds", "steps", "cost_usd")

# Between attempts, less time than this left counts as none: a request could only time
# out, and timers fire a little early or late, so "exactly spent" is no reliable test.
TIME_RESERVE_S = 0.01


def cost_usd(input_tokens: int, output_tokens: int, *, price_input_per_mtok: float,
             price_output_per_mtok: float, cache_read_tokens: int = 0,
             cache_write_tokens: int = 0, price_cache_read_per_mtok: float | None = None,
             price_cache_write_per_mtok: float | None = None) -> float:
    """Price of one model usage, prices per million tokens as providers publish them:

        (plain * price_in + cache_read * price_cache_read + cache_write * price_cache_write
         + output * price_out) / 1e6,   plain = input - cache_read - cache_write (>= 0)

    `input_tokens` counts every input token, cached or not; the cache counts are the
    parts of it read from or written to the provider's prompt cache, which providers
    bill at other rates (a read is much cheaper, an Anthropic write dearer). A cache price
    left None is the input price, so a provider without cache prices is charged as if
    nothing were cached. Unpriced providers (all prices 0) cost nothing, which is why
    `max_cost_usd` needs prices (configured or from the shipped table) to mean anything."""
    read = max(0, min(cache_read_tokens, input_tokens))
    write = max(0, min(cache_write_tokens, input_tokens - read))
    plain = input_tokens - read - write
    read_price = price_input_per_mtok if price_cache_read_per_mtok is None \
        else price_cache_read_per_mtok
    write_price = price_input_per_mtok if price_cache_write_per_mtok is None \
        else price_cache_write_per_mtok
    return (plain * price_input_per_mtok + read * read_price + write * write_price
            + output_tokens * price_output_per_mtok) / 1e6


def _num(value: float) -> str:
    """300.0 -> "300", 12.5 -> "12.5": limits read the way an operator wrote them."""
    if float(value).is_integer():
        return str(int(value))
    return f"{value:g}"


def _usd(value: float) -> str:
    return f"${value:,.2f}"


@dataclass(frozen=True, slots=True)
class BudgetLimits:
    """The limits of one turn: the policy's `[budget]`, adjusted by the submit.

    `max_cost_usd = 0` turns the cost dimension off. `deadline` is absolute (epoch
    seconds) and `None` when the submit set none."""

    max_tokens: int = 200_000
    max_seconds: float = 300.0
    max_steps: int = 40
    max_cost_usd: float = 0.0
    soft_limit: float = 0.8
    deadline: float | None = None

    def backstop_only(self) -> BudgetLimits:
        """These limits with only the ones that always enforce kept: the step backstop
        and the deadline. Tokens, time and cost become unbounded (for a budget in `warn`
        or `observe` mode, whose real limits are only watched)."""
        return replace(self, max_tokens=UNBOUNDED_TOKENS, max_seconds=math.inf,
                       max_cost_usd=0.0)

    @classmethod
    def from_config(cls, config: BudgetConfig, *, overrides: Mapping[str, Any] | None = None,
                    deadline: float | None = None) -> BudgetLimits:
        """The policy's budget with the submit's overrides applied.

        A submit may lower or raise any of `OVERRIDABLE` for its own turn. A key set to
        None is treated as absent. An unknown key or an unusable value raises ValueError
        naming the key: a typo in a budget must not silently run the turn on defaults."""
        values: dict[str, Any] = {
            "max_tokens": config.max_tokens,
            "max_seconds": config.max_seconds,
            "max_steps": config.max_steps,
            "max_cost_usd": config.max_cost_usd,
        }
        for key, raw in (overrides or {}).items():
            if key not in OVERRIDABLE:
                raise ValueError(f"budget.{key}: unknown key (allowed: {', '.join(OVERRIDABLE)})")
            if raw is None:
                continue
            values[key] = _checked_override(key, raw)
        if deadline is not None and not math.isfinite(deadline):
            raise ValueError("deadline: must be a finite time")
        return cls(soft_limit=config.soft_limit, deadline=deadline, **values)

    def snapshot(self) -> dict[str, Any]:
        return {"max_tokens": self.max_tokens, "max_seconds": self.max_seconds,
                "max_steps": self.max_steps, "max_cost_usd": self.max_cost_usd,
                "soft_limit": self.soft_limit, "deadline": self.deadline}

    @classmethod
    def restore(cls, data: Mapping[str, Any]) -> BudgetLimits:
        return cls(max_tokens=int(data["max_tokens"]), max_seconds=float(data["max_seconds"]),
                   max_steps=int(data["max_steps"]), max_cost_usd=float(data["max_cost_usd"]),
                   soft_limit=float(data["soft_limit"]),
                   deadline=None if data.get("deadline") is None else float(data["deadline"]))


def _checked_override(key: str, raw: object) -> int | float:
    if isinstance(raw, bool) or not isinstance(raw, int | float) or not math.isfinite(raw):
        raise ValueError(f"budget.{key}: must be a number")
    if key in ("max_tokens", "max_steps"):
        if not float(raw).is_integer() or raw <= 0:
            raise ValueError(f"budget.{key}: must be a whole number greater than 0")
        return int(raw)
    if key == "max_seconds" and raw <= 0:
        raise ValueError(f"budget.{key}: must be greater than 0")
    if key == "max_cost_usd" and raw < 0:
        raise ValueError(f"budget.{key}: must be 0 (off) or more")
    return float(raw)


class BudgetUsage(NamedTuple):
    """What the turn has spent so far. `seconds` is active time only; `steps` counts
    steps already run (0 at the top of the first step). A named tuple, not a frozen
    dataclass: a turn makes several a step, and a frozen dataclass pays a call per field
    to be built (1.2 us against 0.3)."""

    tokens: int = 0
    seconds: float = 0.0
    steps: int = 0
    cost_usd: float = 0.0

    def plus(self, *, tokens: int = 0, seconds: float = 0.0, steps: int = 0,
             cost_usd: float = 0.0) -> BudgetUsage:
        """A new usage with the given amounts added: the counters only ever grow."""
        return BudgetUsage(self.tokens + tokens, self.seconds + seconds,
                           self.steps + steps, self.cost_usd + cost_usd)

    def snapshot(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "seconds": self.seconds, "steps": self.steps,
                "cost_usd": self.cost_usd}

    @classmethod
    def restore(cls, data: Mapping[str, Any]) -> BudgetUsage:
        return cls(tokens=int(data.get("tokens", 0)), seconds=float(data.get("seconds", 0.0)),
                   steps=int(data.get("steps", 0)), cost_usd=float(data.get("cost_usd", 0.0)))


@dataclass(frozen=True, slots=True)
class SoftWarning:
    """One system note for the agent: which dimensions just passed the soft limit, and
    what is left, in words a model acts on."""

    dimensions: tuple[str, ...]
    message: str


class BudgetGuard:
    """Hard stops and soft notes for one turn's budget.

    `check` precedence, first match wins (fixed so that the same usage always names the
    same counter):

    1. `deadline`       now >= deadline                         value = now, limit = deadline
    2. `budget.seconds` usage.seconds >= max_seconds
    3. `budget.tokens`  usage.tokens >= max_tokens
    4. `budget.cost`    max_cost_usd > 0 and cost >= max_cost_usd
    5. `budget.steps`   usage.steps >= max_steps  (so a turn runs at most max_steps steps)

    The deadline comes first because it is the caller's own word and counts everything;
    steps come last because they are only a backstop behind the real budgets.

    The only state is which dimensions were already warned about, so that each warns
    once per turn; `snapshot`/`restore` carry it across a checkpoint."""

    def __init__(self, limits: BudgetLimits) -> None:
        self.limits = limits
        self._warned: set[str] = set()

    def __repr__(self) -> str:
        return f"BudgetGuard(limits={self.limits!r}, warned={sorted(self._warned)!r})"

    @classmethod
    def from_config(cls, config: BudgetConfig, *, overrides: Mapping[str, Any] | None = None,
                    deadline: float | None = None) -> BudgetGuard:
        return cls(BudgetLimits.from_config(config, overrides=overrides, deadline=deadline))

    @property
    def warned(self) -> frozenset[str]:
        return frozenset(self._warned)

    def check(self, usage: BudgetUsage, *, now: float) -> Stop | None:
        """The hard stop, or None when the next step may start."""
        for stop in self.violations(usage, now=now):
            return stop
        return None

    def violations(self, usage: BudgetUsage, *, now: float) -> Iterator[Stop]:
        """Every limit the usage has reached, in `check`'s precedence. A turn whose
        budget is only observed needs them all: one reached limit must not hide the
        next."""
        lim = self.limits
        if lim.deadline is not None and now >= lim.deadline:
            when = datetime.fromtimestamp(lim.deadline, tz=UTC).isoformat(timespec="seconds")
            yield Stop(StopCode.DEADLINE, f"deadline {when} passed",
                       value=now, limit=lim.deadline)
        if usage.seconds >= lim.max_seconds:
            yield Stop(StopCode.BUDGET_SECONDS,
                       f"time budget of {_num(lim.max_seconds)} s of active time spent",
                       value=usage.seconds, limit=lim.max_seconds)
        if usage.tokens >= lim.max_tokens:
            yield Stop(StopCode.BUDGET_TOKENS, f"token budget of {lim.max_tokens} spent",
                       value=usage.tokens, limit=lim.max_tokens)
        if lim.max_cost_usd > 0 and usage.cost_usd >= lim.max_cost_usd:
            yield Stop(StopCode.BUDGET_COST, f"cost budget of {_usd(lim.max_cost_usd)} spent",
                       value=usage.cost_usd, limit=lim.max_cost_usd)
        if usage.steps >= lim.max_steps:
            yield Stop(StopCode.BUDGET_STEPS, f"step budget of {lim.max_steps} steps spent",
                       value=usage.steps, limit=lim.max_steps)

    def check_time(self, usage: BudgetUsage, *, now: float,
                   reserve_s: float = TIME_RESERVE_S) -> Stop | None:
        """The time stop alone (`deadline`, then `budget.seconds`) once less than
        `reserve_s` is left. Asked between attempts and before tool calls, where the
        step's own counters (already incremented) must not stop it but a spent clock
        must: the value is the counter as it is, possibly a hair under the limit."""
        lim = self.limits
        if lim.deadline is not None and lim.deadline - now < reserve_s:
            when = datetime.fromtimestamp(lim.deadline, tz=UTC).isoformat(timespec="seconds")
            return Stop(StopCode.DEADLINE, f"deadline {when} reached",
                        value=now, limit=lim.deadline)
        if lim.max_seconds - usage.seconds < reserve_s:
            return Stop(StopCode.BUDGET_SECONDS,
                        f"time budget of {_num(lim.max_seconds)} s of active time spent",
                        value=usage.seconds, limit=lim.max_seconds)
        return None

    def soft_warning(self, usage: BudgetUsage, *, now: float) -> SoftWarning | None:
        """A note for each dimension that has reached `soft_limit` of its limit and was
        not warned about yet; several crossing together make one note. None otherwise.

        The deadline has no soft note: without a start it has no fraction to pass, and
        `remaining_seconds` already keeps every wait inside it. `now` is taken for that
        symmetry with `check` and is not used today."""
        del now
        lim = self.limits
        f = lim.soft_limit
        # Plain comparisons first: this runs every step and is almost always "no".
        if (usage.tokens < f * lim.max_tokens and usage.seconds < f * lim.max_seconds
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
            and spent[dim][0] >= f * spent[dim][1])
        if not crossed:
            return None
        self._warned.update(crossed)
        parts = [_left(dim, *spent[dim]) for dim in crossed]
        message = (f"Budget note: {', '.join(parts)}. Answer now with what you have, or call "
                   "report_blocked with what you tried and found.")
        return SoftWarning(dimensions=crossed, message=message)

    def remaining_seconds(self, usage: BudgetUsage, *, now: float) -> float:
        """Time any wait or timeout may still take: the lesser of active time left and
        time to the deadline, never negative."""
        left = self.limits.max_seconds - usage.seconds
        if self.limits.deadline is not None:
            left = min(left, self.limits.deadline - now)
        return max(0.0, left)

    def remaining_tokens(self, usage: BudgetUsage) -> int:
        return max(0, self.limits.max_tokens - usage.tokens)

    def remaining_steps(self, usage: BudgetUsage) -> int:
        return max(0, self.limits.max_steps - usage.steps)

    def max_output_tokens(self, usage: BudgetUsage, configured: int) -> int:
        """The `max_tokens` to ask the model for: the provider's configured output limit,
        cut to the tokens left so one answer cannot overshoot the budget by much; at
        least 1 because providers reject 0 (a spent budget is `check`'s to stop)."""
        return max(1, min(configured, self.remaining_tokens(usage)))

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
