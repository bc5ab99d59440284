"""The limits in force are kept once: the enforcing guard's, the watching guard's and the
record's forms are each derived from the base limits and the extensions granted."""

from __future__ import annotations

import math

from turnkeeper.policy.budget import UNBOUNDED_TOKENS, BudgetLimits
from turnkeeper.policy.extension import Extension
from turnkeeper.policy.outcome import Stop, StopCode
from turnkeeper.turn.limits_in_force import LimitsInForce

BASE = BudgetLimits(max_tokens=1000, max_seconds=10.0, max_steps=3, max_cost_usd=0.5)
STEPS = Stop(StopCode.BUDGET_STEPS, "step budget of 3 steps spent", value=3, limit=3)


def _granted_once() -> Extension:
    ext = Extension(enabled=True, window=2, steps=5, seconds=30.0, max_extensions=2)
    ext.after_step(3, observations=1, states=1)
    assert ext.decide(STEPS, steps=3) is not None
    return ext


def test_an_enforcing_budget_has_no_watch_and_its_guard_keeps_the_base_object() -> None:
    limits = LimitsInForce(BASE, enforce=True, extension=Extension())
    assert limits.for_guard() is BASE  # the meter's answers are kept while it is the same
    assert limits.for_watch() is None
    assert limits.shown() == BASE.snapshot()


def test_a_budget_that_only_watches_enforces_the_backstop_and_watches_the_rest() -> None:
    limits = LimitsInForce(BASE, enforce=False, extension=Extension())
    guard = limits.for_guard()
    assert guard is limits.for_guard()  # worked out once, not on every ask
    assert (guard.max_tokens, guard.max_seconds, guard.max_cost_usd, guard.max_steps) == (
        UNBOUNDED_TOKENS, math.inf, 0.0, 3)
    assert limits.for_watch() is BASE


def test_a_grant_shows_in_every_form_and_the_record_names_the_base_too() -> None:
    ext = Extension(enabled=True, window=2, steps=5, seconds=30.0, max_extensions=2)
    limits = LimitsInForce(BASE, enforce=False, extension=ext)
    ext.after_step(3, observations=1, states=1)
    assert ext.decide(STEPS, steps=3) is not None  # granted after the limits were made
    assert (limits.current.max_steps, limits.current.max_seconds) == (8, 40.0)
    assert limits.for_guard().max_steps == 8 and limits.for_guard().max_seconds == math.inf
    watched = limits.for_watch()
    assert watched is not None and (watched.max_steps, watched.max_seconds) == (8, 40.0)
    assert limits.shown() == {**BASE.snapshot(), "max_steps": 8, "max_seconds": 40.0,
                              "base_max_steps": 3, "base_max_seconds": 10.0}
    assert limits.base is BASE


def test_an_enforcing_budget_extended_extends_its_guard() -> None:
    limits = LimitsInForce(BASE, enforce=True, extension=_granted_once())
    assert limits.for_guard() == limits.current
    assert (limits.for_guard().max_steps, limits.for_guard().max_tokens) == (8, 1000)
