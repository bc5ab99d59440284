"""A turn's budget as data: its limits (the policy's `[budget]`, adjusted by the submit,
and how a checkpoint keeps them) and what the turn has spent against them. The rules
that compare the two are `policy/budget.py`'s."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import field, replace
from typing import Any, NamedTuple, Protocol

from turnkeeper.values import value_class


class BudgetSettings(Protocol):
    """What `BudgetLimits.from_config` reads (`[budget]` fits). A protocol, so that
    `policy/` does not import the config layer."""

    @property
    def max_tokens(self) -> int: ...
    @property
    def max_seconds(self) -> float: ...
    @property
    def max_steps(self) -> int: ...
    @property
    def max_cost_usd(self) -> float: ...
    @property
    def max_wall_seconds(self) -> float: ...
    @property
    def soft_limit(self) -> float: ...

# The keys a submit may override for its own turn (the `budget` object of POST /v1/turns).
OVERRIDABLE = ("max_tokens", "max_seconds", "max_steps", "max_cost_usd", "max_wall_seconds")
UNBOUNDED_TOKENS = 2**62


@value_class
class BudgetLimits:
    """The limits of one turn: the policy's `[budget]`, adjusted by the submit.

    `max_cost_usd = 0` turns the cost dimension off, `max_wall_seconds = 0` the wall
    clock. `deadline` is absolute (epoch seconds) and `None` when the submit set none;
    `started_at` (epoch seconds) is when the turn first started running, from which
    `max_wall_seconds` counts (None: not started, nothing to count)."""

    max_tokens: int = 200_000
    max_seconds: float = 300.0
    max_steps: int = 40
    max_cost_usd: float = 0.0
    soft_limit: float = 0.8
    deadline: float | None = None
    max_wall_seconds: float = 0.0
    started_at: float | None = None
    # When the wall clock runs out (epoch seconds), or None when it is off: worked out
    # once here, as the guard reads it several times a step.
    wall_deadline: float | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        wall_end = (None if self.max_wall_seconds <= 0 or self.started_at is None
                    else self.started_at + self.max_wall_seconds)
        object.__setattr__(self, "wall_deadline", wall_end)

    def backstop_only(self) -> BudgetLimits:
        """These limits with only the ones that always enforce kept: the step backstop,
        the deadline and the wall clock. Tokens, active time and cost become unbounded
        (for a budget in `warn` or `observe` mode, whose real limits are only watched)."""
        return replace(self, max_tokens=UNBOUNDED_TOKENS, max_seconds=math.inf,
                       max_cost_usd=0.0)

    @classmethod
    def from_config(cls, config: BudgetSettings, *, overrides: Mapping[str, Any] | None = None,
                    deadline: float | None = None,
                    started_at: float | None = None) -> BudgetLimits:
        """The policy's budget with the submit's overrides applied.

        A submit may lower or raise any of `OVERRIDABLE` for its own turn. A key set to
        None is treated as absent. An unknown key or an unusable value raises ValueError
        naming the key: a typo in a budget must not silently run the turn on defaults."""
        values: dict[str, Any] = {
            "max_tokens": config.max_tokens,
            "max_seconds": config.max_seconds,
            "max_steps": config.max_steps,
            "max_cost_usd": config.max_cost_usd,
            "max_wall_seconds": config.max_wall_seconds,
        }
        for key, raw in (overrides or {}).items():
            if key not in OVERRIDABLE:
                raise ValueError(f"budget.{key}: unknown key (allowed: {', '.join(OVERRIDABLE)})")
            if raw is None:
                continue
            values[key] = _checked_override(key, raw)
        if deadline is not None and not math.isfinite(deadline):
            raise ValueError("deadline: must be a finite time")
        return cls(soft_limit=config.soft_limit, deadline=deadline, started_at=started_at,
                   **values)

    def snapshot(self) -> dict[str, Any]:
        return {"max_tokens": self.max_tokens, "max_seconds": self.max_seconds,
                "max_steps": self.max_steps, "max_cost_usd": self.max_cost_usd,
                "soft_limit": self.soft_limit, "deadline": self.deadline,
                "max_wall_seconds": self.max_wall_seconds, "started_at": self.started_at}

    @classmethod
    def restore(cls, data: Mapping[str, Any]) -> BudgetLimits:
        return cls(max_tokens=int(data["max_tokens"]), max_seconds=float(data["max_seconds"]),
                   max_steps=int(data["max_steps"]), max_cost_usd=float(data["max_cost_usd"]),
                   soft_limit=float(data["soft_limit"]),
                   deadline=None if data.get("deadline") is None else float(data["deadline"]),
                   max_wall_seconds=float(data.get("max_wall_seconds") or 0.0),
                   started_at=(None if data.get("started_at") is None
                               else float(data["started_at"])))


def _checked_override(key: str, raw: object) -> int | float:
    if isinstance(raw, bool) or not isinstance(raw, int | float) or not math.isfinite(raw):
        raise ValueError(f"budget.{key}: must be a number")
    if key in ("max_tokens", "max_steps"):
        if not float(raw).is_integer() or raw <= 0:
            raise ValueError(f"budget.{key}: must be a whole number greater than 0")
        return int(raw)
    if key == "max_seconds" and raw <= 0:
        raise ValueError(f"budget.{key}: must be greater than 0")
    if key in ("max_cost_usd", "max_wall_seconds") and raw < 0:
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
