"""The turn budget: hard stops, soft notes, what is left."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turnkeeper.config import BudgetConfig
from turnkeeper.policy.budget import (
    BudgetGuard,
    BudgetLimits,
    BudgetUsage,
    Preflight,
    SoftWarning,
    cost_usd,
)
from turnkeeper.policy.outcome import Stop, StopCode
from turnkeeper.policy.usage import Prices

NOW = 1_700_000_000.0


def guard(**limits: object) -> BudgetGuard:
    return BudgetGuard(BudgetLimits(**limits))  # type: ignore[arg-type]


def test_limits_come_from_config() -> None:
    limits = BudgetLimits.from_config(BudgetConfig())
    assert limits == BudgetLimits(max_tokens=200_000, max_seconds=300.0, max_steps=40,
                                  max_cost_usd=0.0, soft_limit=0.8, deadline=None)


def test_submit_may_lower_or_raise_its_own_budget() -> None:
    limits = BudgetLimits.from_config(
        BudgetConfig(), overrides={"max_tokens": 500_000, "max_steps": 5, "max_seconds": 30,
                                   "max_cost_usd": 1.5}, deadline=NOW + 60)
    assert limits == BudgetLimits(max_tokens=500_000, max_seconds=30.0, max_steps=5,
                                  max_cost_usd=1.5, soft_limit=0.8, deadline=NOW + 60)


def test_override_set_to_none_keeps_the_policy_value() -> None:
    limits = BudgetLimits.from_config(BudgetConfig(), overrides={"max_tokens": None})
    assert limits.max_tokens == 200_000


@pytest.mark.parametrize(("overrides", "names"), [
    ({"max_tokenz": 5}, "budget.max_tokenz"),
    ({"max_tokens": 0}, "budget.max_tokens"),
    ({"max_steps": 2.5}, "budget.max_steps"),
    ({"max_seconds": -1}, "budget.max_seconds"),
    ({"max_cost_usd": -0.01}, "budget.max_cost_usd"),
    ({"max_tokens": True}, "budget.max_tokens"),
    ({"max_tokens": "100"}, "budget.max_tokens"),
])
def test_a_bad_override_is_an_error_naming_the_key(overrides: dict[str, object],
                                                   names: str) -> None:
    with pytest.raises(ValueError, match=names):
        BudgetLimits.from_config(BudgetConfig(), overrides=overrides)


def test_nothing_spent_nothing_stops() -> None:
    assert guard().check(BudgetUsage(), now=NOW) is None


def test_token_budget_stops_when_spent() -> None:
    g = guard(max_tokens=1000)
    assert g.check(BudgetUsage(tokens=999), now=NOW) is None
    stop = g.check(BudgetUsage(tokens=1234), now=NOW)
    assert stop == Stop(StopCode.BUDGET_TOKENS, "token budget of 1000 spent",
                        value=1234, limit=1000)
    assert stop.counter == "tokens"


def test_seconds_budget_counts_active_time_only() -> None:
    g = guard(max_seconds=300.0)
    # an hour of wall time parked in recovery is not active time
    assert g.check(BudgetUsage(seconds=299.5), now=NOW + 3600) is None
    assert g.check(BudgetUsage(seconds=300.0), now=NOW) == Stop(
        StopCode.BUDGET_SECONDS, "time budget of 300 s of active time spent",
        value=300.0, limit=300.0)


def test_cost_budget_is_off_at_zero() -> None:
    assert guard(max_cost_usd=0.0).check(BudgetUsage(cost_usd=1e6), now=NOW) is None


def test_cost_budget_stops_when_on_and_spent() -> None:
    g = guard(max_cost_usd=2.0)
    assert g.check(BudgetUsage(cost_usd=1.99), now=NOW) is None
    assert g.check(BudgetUsage(cost_usd=2.5), now=NOW) == Stop(
        StopCode.BUDGET_COST, "cost budget of $2.00 spent", value=2.5, limit=2.0)


def test_steps_budget_allows_exactly_max_steps() -> None:
    g = guard(max_steps=3)
    usage = BudgetUsage()
    ran = 0
    while g.check(usage, now=NOW) is None:
        ran += 1
        usage = usage.plus(steps=1)
    assert ran == 3
    assert g.check(usage, now=NOW) == Stop(StopCode.BUDGET_STEPS,
                                           "step budget of 3 steps spent", value=3, limit=3)


def test_deadline_counts_everything() -> None:
    g = guard(deadline=NOW + 60)
    # no active time spent at all, yet the deadline has passed: it is wall time
    assert g.check(BudgetUsage(), now=NOW + 59.9) is None
    stop = g.check(BudgetUsage(), now=NOW + 61)
    assert stop == Stop(StopCode.DEADLINE, "deadline 2023-11-14T22:14:20+00:00 passed",
                        value=NOW + 61, limit=NOW + 60)
    assert stop.counter == "deadline"


def test_precedence_is_deadline_seconds_tokens_cost_steps() -> None:
    g = guard(max_tokens=10, max_seconds=10.0, max_steps=10, max_cost_usd=1.0,
              deadline=NOW)
    everything = BudgetUsage(tokens=10, seconds=10.0, steps=10, cost_usd=1.0)
    assert g.check(everything, now=NOW).code is StopCode.DEADLINE  # type: ignore[union-attr]
    codes = []
    for usage in (everything,
                  BudgetUsage(tokens=10, steps=10, cost_usd=1.0),
                  BudgetUsage(steps=10, cost_usd=1.0),
                  BudgetUsage(steps=10)):
        stop = g.check(usage, now=NOW - 1)
        assert stop is not None
        codes.append(stop.code)
    assert codes == [StopCode.BUDGET_SECONDS, StopCode.BUDGET_TOKENS, StopCode.BUDGET_COST,
                     StopCode.BUDGET_STEPS]


def test_soft_warning_says_what_is_left() -> None:
    g = guard()
    warning = g.soft_warning(BudgetUsage(tokens=162_000, steps=37), now=NOW)
    assert warning == SoftWarning(
        dimensions=("tokens", "steps"),
        message="Budget note: 38,000 of 200,000 tokens left, 3 of 40 steps left. Answer now "
                "with what you have, or call report_blocked with what you tried and found.")


def test_soft_warning_once_per_dimension() -> None:
    g = guard(max_steps=10, max_tokens=1000)
    assert g.soft_warning(BudgetUsage(steps=7, tokens=100), now=NOW) is None
    first = g.soft_warning(BudgetUsage(steps=8, tokens=100), now=NOW)
    assert first is not None and first.dimensions == ("steps",)
    assert g.soft_warning(BudgetUsage(steps=9, tokens=100), now=NOW) is None
    second = g.soft_warning(BudgetUsage(steps=9, tokens=850), now=NOW)
    assert second is not None and second.dimensions == ("tokens",)
    assert g.soft_warning(BudgetUsage(steps=9, tokens=990), now=NOW) is None
    assert g.warned == frozenset({"steps", "tokens"})


def test_soft_warning_for_seconds_and_cost() -> None:
    g = guard(max_seconds=300.0, max_cost_usd=2.0)
    warning = g.soft_warning(BudgetUsage(seconds=251.4, cost_usd=1.6), now=NOW)
    assert warning is not None
    assert warning.dimensions == ("seconds", "cost_usd")
    assert warning.message.startswith(
        "Budget note: 48 of 300 seconds left, $0.40 of $2.00 left. ")


def test_soft_warning_ignores_cost_when_off() -> None:
    assert guard(max_cost_usd=0.0).soft_warning(BudgetUsage(cost_usd=5.0), now=NOW) is None


def test_remaining_seconds_bounded_by_deadline() -> None:
    g = guard(max_seconds=300.0, deadline=NOW + 20)
    assert g.remaining_seconds(BudgetUsage(seconds=100.0), now=NOW) == 20.0
    assert g.remaining_seconds(BudgetUsage(seconds=290.0), now=NOW) == 10.0
    assert g.remaining_seconds(BudgetUsage(seconds=0.0), now=NOW + 25) == 0.0


def test_remaining_seconds_is_never_negative() -> None:
    assert guard(max_seconds=300.0).remaining_seconds(BudgetUsage(seconds=400.0),
                                                      now=NOW) == 0.0


# -- the pre-flight: a budget is a ceiling ------------------------------------------------

def test_preflight_sends_the_providers_cap_when_it_fits() -> None:
    g = guard(max_tokens=10_000)
    assert g.preflight(BudgetUsage(tokens=1000), input_tokens=2000,
                       max_output_tokens=4096) == Preflight(max_output_tokens=4096)


def test_preflight_cuts_the_cap_so_input_and_cap_fit_in_the_tokens_left() -> None:
    g = guard(max_tokens=10_000)
    fits = g.preflight(BudgetUsage(tokens=6000), input_tokens=2000, max_output_tokens=4096)
    assert fits == Preflight(max_output_tokens=2000, short=("tokens",))
    # Spent + input + cap is the limit exactly: a provider counting as the estimate
    # does cannot take the turn past it.
    assert 6000 + 2000 + fits.max_output_tokens == 10_000  # type: ignore[union-attr]


def test_preflight_stops_before_a_call_whose_input_and_least_answer_do_not_fit() -> None:
    g = guard(max_tokens=10_000)
    # 64 answer tokens are the least a call is made for.
    assert isinstance(g.preflight(BudgetUsage(tokens=7936), input_tokens=2000,
                                  max_output_tokens=4096), Preflight)
    stop = g.preflight(BudgetUsage(tokens=7937), input_tokens=2000, max_output_tokens=4096)
    assert isinstance(stop, Stop)
    assert (stop.code, stop.counter, stop.value, stop.limit) == (
        StopCode.BUDGET_TOKENS, "tokens", 7937, 10_000)
    assert stop.message == ("token budget of 10000: 7937 spent, and the next request (an "
                            "estimated 2000 input tokens and an answer of at least 64) "
                            "does not fit in the 2063 left")


def test_preflight_least_answer_is_the_providers_cap_when_that_is_lower() -> None:
    g = guard(max_tokens=1000)
    assert g.preflight(BudgetUsage(tokens=900), input_tokens=84,
                       max_output_tokens=16) == Preflight(max_output_tokens=16)


def test_preflight_prices_the_input_at_its_dearest_rate_and_cuts_the_cap_to_the_cost_left(
        ) -> None:
    # $3 in, $15 out, cache reads at $0.30 and writes at $3.75 a million tokens: the
    # input is priced at $3.75, whatever the cache will do.
    prices = Prices(3.0, 15.0, cache_read_per_mtok=0.3, cache_write_per_mtok=3.75)
    g = guard(max_cost_usd=1.0)
    fits = g.preflight(BudgetUsage(cost_usd=0.9), input_tokens=20_000,
                       max_output_tokens=4096, prices=prices)
    # Left: $0.10 - $0.075 of input = $0.025 for output at $15/M: 1666 tokens.
    assert fits == Preflight(max_output_tokens=1666, short=("cost_usd",))
    worst = 0.9 + prices.worst_cost_usd(20_000, 1666)
    assert worst <= 1.0
    stop = g.preflight(BudgetUsage(cost_usd=0.925), input_tokens=20_000,
                       max_output_tokens=4096, prices=prices)
    assert isinstance(stop, Stop)
    assert (stop.code, stop.counter, stop.value, stop.limit) == (
        StopCode.BUDGET_COST, "cost_usd", 0.925, 1.0)
    assert "estimated 20000 input tokens" in stop.message


def test_preflight_ignores_cost_when_off_or_unpriced() -> None:
    prices = Prices(3.0, 15.0)
    assert guard(max_cost_usd=0.0).preflight(
        BudgetUsage(cost_usd=99.0), input_tokens=1000, max_output_tokens=4096,
        prices=prices) == Preflight(max_output_tokens=4096)
    assert guard(max_cost_usd=1.0).preflight(
        BudgetUsage(cost_usd=0.99), input_tokens=1000, max_output_tokens=4096,
        prices=Prices()) == Preflight(max_output_tokens=4096)


def test_preflight_names_both_dimensions_when_both_cut_the_cap() -> None:
    g = guard(max_tokens=10_000, max_cost_usd=1.0)
    fits = g.preflight(BudgetUsage(tokens=7000, cost_usd=0.99), input_tokens=1000,
                       max_output_tokens=4096, prices=Prices(1.0, 10.0))
    assert isinstance(fits, Preflight)
    assert fits.short == ("tokens", "cost_usd")
    assert fits.max_output_tokens == 899  # ($0.01 - $0.001 - the margin) / $10 a million


def test_the_soft_note_comes_when_the_next_call_would_not_fit_whole() -> None:
    """Before 80%, as soon as the provider's cap was cut: a step that would jump past
    both the soft and the hard limit still gets its note first."""
    g = guard(max_tokens=10_000)
    usage = BudgetUsage(tokens=5000)
    fits = g.preflight(usage, input_tokens=3000, max_output_tokens=4096)
    assert isinstance(fits, Preflight) and fits.short == ("tokens",)
    assert g.soft_warning(usage, now=NOW) is None
    warning = g.soft_warning(usage, now=NOW, short=fits.short)
    assert warning is not None and warning.dimensions == ("tokens",)
    assert warning.message.startswith("Budget note: 5,000 of 10,000 tokens left.")
    assert g.soft_warning(BudgetUsage(tokens=9000), now=NOW, short=("tokens",)) is None


def test_cost_is_priced_per_million_tokens() -> None:
    assert cost_usd(1_000_000, 500_000, price_input_per_mtok=3.0,
                    price_output_per_mtok=15.0) == 10.5
    assert cost_usd(1234, 567, price_input_per_mtok=0.0, price_output_per_mtok=0.0) == 0.0


def test_usage_only_grows_by_plus() -> None:
    usage = BudgetUsage().plus(tokens=100, seconds=1.5, steps=1, cost_usd=0.25)
    assert usage.plus(tokens=50, steps=1) == BudgetUsage(tokens=150, seconds=1.5, steps=2,
                                                         cost_usd=0.25)


def test_snapshot_restore_continues_exactly() -> None:
    limits = BudgetLimits(max_tokens=1000, max_steps=10, deadline=NOW + 60)
    g = BudgetGuard(limits)
    assert g.soft_warning(BudgetUsage(steps=8), now=NOW) is not None
    usage = BudgetUsage(tokens=700, seconds=12.5, steps=8, cost_usd=0.5)
    data = json.loads(json.dumps({"guard": g.snapshot(), "limits": limits.snapshot(),
                                  "usage": usage.snapshot()}))
    restored_limits = BudgetLimits.restore(data["limits"])
    restored = BudgetGuard.restore(data["guard"], restored_limits)
    restored_usage = BudgetUsage.restore(data["usage"])
    assert restored_limits == limits
    assert restored_usage == usage
    # steps was already warned about: only tokens warns now, exactly as the original would
    later = restored_usage.plus(tokens=100, steps=1)
    warning = restored.soft_warning(later, now=NOW)
    assert warning is not None and warning.dimensions == ("tokens",)
    assert restored.soft_warning(later, now=NOW) is None
    assert restored.check(later.plus(steps=1), now=NOW) == Stop(
        StopCode.BUDGET_STEPS, "step budget of 10 steps spent", value=10, limit=10)


def test_guard_repr_shows_limits_and_warnings() -> None:
    g = guard(max_steps=10)
    g.soft_warning(BudgetUsage(steps=9), now=NOW)
    assert repr(g) == (
        "BudgetGuard(limits=BudgetLimits(max_tokens=200000, max_seconds=300.0, max_steps=10, "
        "max_cost_usd=0.0, soft_limit=0.8, deadline=None, max_wall_seconds=0.0, "
        "started_at=None), warned=['steps'])")


def test_check_time_stops_on_time_alone_not_on_the_step_in_progress() -> None:
    g = guard(max_seconds=10.0, max_steps=3)
    # Between attempts the step counter already counts the running step: not a stop.
    assert g.check_time(BudgetUsage(seconds=5.0, steps=3), now=NOW) is None
    stop = g.check_time(BudgetUsage(seconds=10.0, steps=3), now=NOW)
    assert stop == Stop(StopCode.BUDGET_SECONDS, stop.message if stop else "",
                        value=10.0, limit=10.0)


def test_check_time_counts_less_than_the_reserve_as_spent() -> None:
    # A timer that fired a hair early must not leave a 0.5 ms "budget" to fail over with.
    g = guard(max_seconds=0.4)
    assert g.check_time(BudgetUsage(seconds=0.3995), now=NOW, reserve_s=0.01) == Stop(
        StopCode.BUDGET_SECONDS, "time budget of 0.4 s of active time spent",
        value=0.3995, limit=0.4)
    assert g.check_time(BudgetUsage(seconds=0.3), now=NOW, reserve_s=0.01) is None


def test_check_time_reports_the_deadline_first() -> None:
    g = guard(max_seconds=1.0, deadline=NOW + 0.005)
    stop = g.check_time(BudgetUsage(seconds=1.0), now=NOW, reserve_s=0.01)
    assert stop is not None and stop.code is StopCode.DEADLINE
    assert (stop.value, stop.limit) == (NOW, NOW + 0.005)
    assert guard(deadline=NOW + 1).check_time(BudgetUsage(), now=NOW) is None


# -- the wall clock ----------------------------------------------------------------------

def test_wall_seconds_count_every_second_from_the_turns_start() -> None:
    g = guard(max_wall_seconds=60.0, started_at=NOW)
    # No active time at all: an hour parked in recovery is wall time.
    assert g.check(BudgetUsage(), now=NOW + 59.9) is None
    stop = g.check(BudgetUsage(), now=NOW + 60.0)
    assert stop == Stop(StopCode.BUDGET_WALL_SECONDS,
                        "wall-clock budget of 60 s since the turn started spent",
                        value=60.0, limit=60.0)
    assert stop.counter == "wall_seconds"


def test_wall_seconds_are_off_at_zero_or_before_the_start() -> None:
    assert guard(max_wall_seconds=0.0, started_at=NOW).check(
        BudgetUsage(), now=NOW + 1e6) is None
    assert guard(max_wall_seconds=5.0).check(BudgetUsage(), now=NOW + 1e6) is None


def test_wall_seconds_come_after_the_deadline_and_before_active_time() -> None:
    g = guard(max_seconds=10.0, max_wall_seconds=10.0, started_at=NOW, deadline=NOW + 10)
    spent = BudgetUsage(seconds=10.0)
    assert [s.code for s in g.violations(spent, now=NOW + 10)] == [
        StopCode.DEADLINE, StopCode.BUDGET_WALL_SECONDS, StopCode.BUDGET_SECONDS]
    assert g.check_time(spent, now=NOW + 9.995).code is StopCode.DEADLINE  # type: ignore[union-attr]
    g = guard(max_seconds=10.0, max_wall_seconds=10.0, started_at=NOW)
    assert g.check_time(spent, now=NOW + 9.995).code is (  # type: ignore[union-attr]
        StopCode.BUDGET_WALL_SECONDS)


def test_every_wait_is_bounded_by_the_wall_clock() -> None:
    g = guard(max_seconds=300.0, max_wall_seconds=30.0, started_at=NOW)
    assert g.remaining_seconds(BudgetUsage(seconds=1.0), now=NOW + 25) == 5.0
    assert g.clock_left(NOW + 25) == 5.0
    assert g.clock_left(NOW + 31) == 0.0
    assert guard().clock_left(NOW) == math.inf
    both = guard(max_wall_seconds=30.0, started_at=NOW, deadline=NOW + 10)
    assert both.clock_left(NOW) == 10.0


def test_the_wall_clock_always_enforces_like_the_deadline() -> None:
    limits = BudgetLimits(max_wall_seconds=30.0, started_at=NOW, deadline=NOW + 60)
    kept = limits.backstop_only()
    assert (kept.max_wall_seconds, kept.started_at, kept.deadline) == (30.0, NOW, NOW + 60)


def test_a_submit_sets_its_own_wall_seconds_and_a_checkpoint_keeps_them() -> None:
    limits = BudgetLimits.from_config(BudgetConfig(max_wall_seconds=600.0),
                                      overrides={"max_wall_seconds": 5}, started_at=NOW)
    assert (limits.max_wall_seconds, limits.started_at) == (5.0, NOW)
    assert BudgetLimits.restore(json.loads(json.dumps(limits.snapshot()))) == limits
    assert BudgetLimits.from_config(BudgetConfig(max_wall_seconds=600.0)).max_wall_seconds \
        == 600.0
    with pytest.raises(ValueError, match=r"budget\.max_wall_seconds"):
        BudgetLimits.from_config(BudgetConfig(), overrides={"max_wall_seconds": -1})


def test_a_wait_refused_for_want_of_time_is_the_clocks_when_they_run_out_first() -> None:
    g = guard(max_seconds=300.0, max_wall_seconds=30.0, started_at=NOW)
    assert g.clock_binds(BudgetUsage(seconds=10.0), now=NOW + 5)
    # 5 s of active time left, 25 s of wall clock: active time runs out first.
    assert not g.clock_binds(BudgetUsage(seconds=295.0), now=NOW + 5)
    assert not guard().clock_binds(BudgetUsage(seconds=10.0), now=NOW)


_AROUND = st.sampled_from([0.0, 9.99, 10.0, 10.01, 100.0, math.inf, math.nan])


@settings(max_examples=400, deadline=None)
@given(tokens=st.sampled_from([0, 99, 100, 101]), seconds=_AROUND,
       steps=st.sampled_from([0, 4, 5, 6]), cost=_AROUND, now=_AROUND,
       deadline=st.sampled_from([None, 9.0, 10.0, 11.0]),
       wall=st.sampled_from([0.0, 5.0, 10.0]), started=st.sampled_from([None, 0.0, 4.0]),
       max_cost=st.sampled_from([0.0, 10.0]))
def test_the_quick_no_of_check_is_the_first_of_the_violations(
        tokens: int, seconds: float, steps: int, cost: float, now: float,
        deadline: float | None, wall: float, started: float | None,
        max_cost: float) -> None:
    """`check` answers "no stop" from plain comparisons first: it must answer exactly
    what the first of `violations` is, whatever the limits and the usage."""
    guard = BudgetGuard(BudgetLimits(max_tokens=100, max_seconds=10.0, max_steps=5,
                                     max_cost_usd=max_cost, deadline=deadline,
                                     max_wall_seconds=wall, started_at=started))
    usage = BudgetUsage(tokens=tokens, seconds=seconds, steps=steps, cost_usd=cost)
    assert guard.check(usage, now=now) == next(iter(guard.violations(usage, now=now)), None)
    # And the time left, written out for speed, is the active time's and the clocks'.
    left = guard.remaining_seconds(usage, now=now)
    expected = max(0.0, min(10.0 - seconds, guard.clock_left(now)))
    assert left == expected or (math.isnan(left) and math.isnan(expected))
