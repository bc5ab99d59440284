"""Limits from measured runs: percentiles of what completed turns used, a suggested
budget at a multiple of the p95, and what each current limit stopped or would have
stopped.

Pure: the caller reads the turns from the store and passes them in.

- Percentiles use linear interpolation between closest ranks (numpy's default "linear"
  method): for sorted values v[0..n-1], p = q/100 * (n - 1), the value is
  v[floor(p)] + (p - floor(p)) * (v[ceil(p)] - v[floor(p)]).
- Suggestions are `factor * p95` (default 2.5), rounded up to a value an operator would
  write: tokens to the next 1,000, seconds to the next whole second, steps to the next
  whole step, cost to the next cent (0, i.e. off, when no completed turn had a cost).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

DIMENSIONS = ("tokens", "seconds", "steps", "cost_usd")
LIMIT_KEY = {"tokens": "max_tokens", "seconds": "max_seconds", "steps": "max_steps",
             "cost_usd": "max_cost_usd"}
STOP_CODE = {"tokens": "budget.tokens", "seconds": "budget.seconds",
             "steps": "budget.steps", "cost_usd": "budget.cost"}
DEFAULT_FACTOR = 2.5


@dataclass(frozen=True, slots=True)
class FinishedTurn:
    """What one finished turn used and how it ended: a row the limits report reads (a
    running turn's spending is `turn.record.TurnUsage`; one call's, `providers.Usage`)."""

    profile: str
    status: str
    code: str
    tokens: int
    seconds: float
    steps: int
    cost_usd: float
    would_have_stopped: tuple[str, ...] = ()
    extensions: int = 0  # budget extensions the turn earned by progress

    def value(self, dimension: str) -> float:
        return float(getattr(self, dimension))


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation; see the module docstring."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is not within 0..100")
    ordered = sorted(values)
    pos = q / 100 * (len(ordered) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (pos - lo) * (ordered[hi] - ordered[lo])


def suggest(dimension: str, p95: float, factor: float) -> float:
    raw = p95 * factor
    if dimension == "tokens":
        return float(max(1000, math.ceil(raw / 1000) * 1000))
    if dimension == "seconds":
        return float(max(1, math.ceil(raw)))
    if dimension == "steps":
        return float(max(1, math.ceil(raw)))
    return math.ceil(raw * 100) / 100 if raw > 0 else 0.0


@dataclass(frozen=True, slots=True)
class DimensionReport:
    dimension: str
    p50: float
    p95: float
    max: float
    suggested: float
    limit: float | None
    stopped: Mapping[str, int]
    would_have_stopped: Mapping[str, int]

    def to_json(self) -> dict[str, Any]:
        return {"p50": self.p50, "p95": self.p95, "max": self.max,
                "suggested": self.suggested, "limit": self.limit,
                "stopped": dict(self.stopped),
                "would_have_stopped": dict(self.would_have_stopped)}


@dataclass(frozen=True, slots=True)
class ProfileReport:
    profile: str
    completed: int
    finished: int
    dimensions: tuple[DimensionReport, ...] = field(default_factory=tuple)
    # Every stop code seen (loop and failure rules included): how many turns it stopped
    # and how many it would have stopped, by how they ended.
    rules: Mapping[str, Mapping[str, Mapping[str, int]]] = field(default_factory=dict)
    # Turns that earned at least one budget extension, by how they ended.
    extended: Mapping[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"profile": self.profile, "completed_turns": self.completed,
                "finished_turns": self.finished,
                "extended_turns": dict(self.extended),
                "dimensions": {d.dimension: d.to_json() for d in self.dimensions},
                "rules": {code: {k: dict(v) for k, v in counts.items()}
                          for code, counts in self.rules.items()}}

    def toml(self) -> str:
        table = "[budget]" if self.profile == "default" else f"[budget.profiles.{self.profile}]"
        lines = [table]
        for d in self.dimensions:
            if d.dimension == "cost_usd" and d.suggested == 0:
                continue
            value = (f"{int(d.suggested)}" if d.dimension in ("tokens", "steps")
                     else f"{d.suggested:.2f}" if d.dimension == "cost_usd"
                     else f"{d.suggested:.1f}")
            lines.append(f"{LIMIT_KEY[d.dimension]} = {value}")
        return "\n".join(lines)


def _count_by_status(turns: Iterable[FinishedTurn]) -> dict[str, int]:
    out: dict[str, int] = {}
    for t in turns:
        out[t.status] = out.get(t.status, 0) + 1
    return dict(sorted(out.items()))


def profile_report(profile: str, turns: Sequence[FinishedTurn], *,
                   limits: Mapping[str, float], factor: float = DEFAULT_FACTOR
                   ) -> ProfileReport:
    """The report for one profile from its finished turns. Percentiles come from the
    completed ones; the stop counts from all of them, split by how they ended: blocked
    (the limit did its job: the task could not be done), partial (the limit cut the
    work), completed (only for would-have-stopped: a limit that would have cut a turn
    that succeeded)."""
    completed = [t for t in turns if t.status == "completed"]
    dims = []
    if completed:
        for dim in DIMENSIONS:
            values = [t.value(dim) for t in completed]
            p95 = percentile(values, 95)
            limit = limits.get(LIMIT_KEY[dim])
            code = STOP_CODE[dim]
            dims.append(DimensionReport(
                dimension=dim, p50=percentile(values, 50), p95=p95, max=max(values),
                suggested=suggest(dim, p95, factor),
                limit=None if limit is None else float(limit),
                stopped=_count_by_status(t for t in turns if t.code == code),
                would_have_stopped=_count_by_status(
                    t for t in turns if code in t.would_have_stopped)))
    codes = sorted({t.code for t in turns if t.code not in ("completed", "blocked",
                                                           "cancelled")}
                   | {c for t in turns for c in t.would_have_stopped})
    rules = {code: {"stopped": _count_by_status(t for t in turns if t.code == code),
                    "would_have_stopped": _count_by_status(
                        t for t in turns if code in t.would_have_stopped)}
             for code in codes}
    return ProfileReport(profile=profile, completed=len(completed), finished=len(turns),
                         dimensions=tuple(dims), rules=rules,
                         extended=_count_by_status(t for t in turns if t.extensions))


def report(turns: Sequence[FinishedTurn], *, limits: Mapping[str, Mapping[str, float]],
           factor: float = DEFAULT_FACTOR) -> list[ProfileReport]:
    """One ProfileReport per profile seen in `turns`, in name order; `limits` maps a
    profile to its current effective limits (max_tokens, ...)."""
    if factor <= 0:
        raise ValueError("factor must be positive")
    by_profile: dict[str, list[FinishedTurn]] = {}
    for t in turns:
        by_profile.setdefault(t.profile, []).append(t)
    return [profile_report(name, by_profile[name], limits=limits.get(name, {}), factor=factor)
            for name in sorted(by_profile)]
