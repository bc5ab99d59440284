"""The limits report: exact percentiles, suggestions and stop counts."""

from __future__ import annotations

import pytest

from turnkeeper.policy.limits import FinishedTurn, percentile, profile_report, report, suggest


def turn(tokens: int, seconds: float, steps: int, *, cost: float = 0.0,
         status: str = "completed", code: str = "completed", profile: str = "default",
         would: tuple[str, ...] = ()) -> FinishedTurn:
    return FinishedTurn(profile=profile, status=status, code=code, tokens=tokens,
                     seconds=seconds, steps=steps, cost_usd=cost, would_have_stopped=would)


def test_percentile_interpolates_linearly_between_closest_ranks() -> None:
    values = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0]
    assert percentile(values, 50) == pytest.approx(5.5)
    assert percentile(values, 95) == pytest.approx(9.55)
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 10.0
    assert percentile([7.0], 95) == 7.0


def test_percentile_refuses_no_values_and_out_of_range() -> None:
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_suggestions_round_up_to_what_an_operator_writes() -> None:
    assert suggest("tokens", 10_001, 2.5) == 26_000
    assert suggest("tokens", 10, 2.5) == 1000
    assert suggest("seconds", 4.1, 2.5) == 11
    assert suggest("steps", 3.2, 2.5) == 8
    assert suggest("cost_usd", 0.0101, 2.5) == pytest.approx(0.03)
    assert suggest("cost_usd", 0.0, 2.5) == 0.0


def test_report_statistics_come_from_completed_turns_only() -> None:
    turns = [turn(1000 * i, float(i), i) for i in range(1, 11)]
    turns.append(turn(999_999, 999.0, 99, status="partial", code="budget.steps"))
    (r,) = report(turns, limits={"default": {"max_tokens": 200_000, "max_seconds": 300.0,
                                             "max_steps": 40, "max_cost_usd": 0.0}})
    assert r.completed == 10 and r.finished == 11
    dims = {d.dimension: d for d in r.dimensions}
    assert dims["tokens"].p50 == pytest.approx(5500)
    assert dims["tokens"].p95 == pytest.approx(9550)
    assert dims["tokens"].max == 10_000
    assert dims["tokens"].suggested == 24_000  # 2.5 x 9550 = 23875 -> 24000
    assert dims["steps"].suggested == 24  # 2.5 x 9.55 = 23.875 -> 24
    assert dims["seconds"].suggested == 24
    assert dims["steps"].stopped == {"partial": 1}
    assert dims["tokens"].stopped == {}
    assert dims["steps"].limit == 40


def test_would_have_stopped_is_split_by_how_the_turn_ended() -> None:
    turns = [
        turn(100, 1.0, 2),
        turn(100, 1.0, 9, would=("loop.repeated_action", "budget.steps")),
        turn(100, 1.0, 9, status="blocked", code="blocked", would=("budget.steps",)),
        turn(100, 1.0, 9, status="partial", code="budget.tokens", would=("budget.steps",)),
    ]
    r = profile_report("default", turns, limits={"max_steps": 8})
    steps = next(d for d in r.dimensions if d.dimension == "steps")
    assert steps.would_have_stopped == {"blocked": 1, "completed": 1, "partial": 1}
    tokens = next(d for d in r.dimensions if d.dimension == "tokens")
    assert tokens.stopped == {"partial": 1}
    assert r.rules["loop.repeated_action"] == {"stopped": {},
                                               "would_have_stopped": {"completed": 1}}
    assert r.rules["budget.tokens"]["stopped"] == {"partial": 1}


def test_profiles_are_reported_apart_with_a_ready_to_paste_snippet() -> None:
    turns = [turn(2000, 2.0, 2, profile="lookup"), turn(4000, 4.0, 4, profile="lookup"),
             turn(50_000, 60.0, 20, profile="report", cost=0.5)]
    reports = report(turns, limits={}, factor=2.0)
    assert [r.profile for r in reports] == ["lookup", "report"]
    assert reports[0].toml() == ("[budget.profiles.lookup]\nmax_tokens = 8000\n"
                                 "max_seconds = 8.0\nmax_steps = 8")
    assert reports[1].toml().endswith("max_cost_usd = 1.00")
    assert report([turn(1, 1.0, 1)], limits={})[0].toml().startswith("[budget]\n")
