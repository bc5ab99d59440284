"""The per-turn provider chain: its counters, its backoff and its stop codes.

Every test drives the sans-I/O state machine directly: events in, decisions out, a
deterministic rand, no clock and no sleeps.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from turnkeeper.policy.backoff import Backoff
from turnkeeper.policy.chain import (
    Attempt,
    ChainError,
    FailOver,
    Phase,
    ProviderChain,
    Recover,
    RetryIn,
)
from turnkeeper.policy.classify import FailureClass
from turnkeeper.policy.outcome import Stop, StopCode

R = FailureClass.RETRYABLE
U = FailureClass.UNKNOWN
D = FailureClass.DETERMINISTIC


def upper(a: float, b: float) -> float:
    return b


def lower(a: float, b: float) -> float:
    return a


class Recorder:
    def __init__(self, result: str = "upper") -> None:
        self.calls: list[tuple[float, float]] = []
        self.result = result

    def __call__(self, a: float, b: float) -> float:
        self.calls.append((a, b))
        return b if self.result == "upper" else a


SETTINGS: dict[str, Any] = {
    "max_attempts": 4,
    "backoff": Backoff(base_delay_s=1.0, max_delay_s=30.0),
    "max_retry_after_s": 120.0,
    "recovery_schedule": (15.0, 30.0, 60.0),
    "recovery_jitter": 0.2,
    "auto_recovery_cycles": 5,
}


def make(providers: tuple[str, ...] = ("primary", "fallback"), **overrides: Any
         ) -> ProviderChain:
    return ProviderChain(providers, **{**SETTINGS, **overrides})


def fail(chain: ProviderChain, fc: FailureClass = R, **kwargs: Any
         ) -> RetryIn | FailOver | Recover | Stop:
    kwargs.setdefault("rand", upper)
    return chain.on_failure(fc, **kwargs)


def exhaust_pass(chain: ProviderChain, fc: FailureClass = R) -> Recover | Stop:
    """From a fresh Attempt, fail every provider of the pass with `fc` (max_attempts=1)."""
    while True:
        decision = fail(chain, fc)
        if isinstance(decision, Recover | Stop):
            return decision
        assert isinstance(decision, FailOver)
        chain.begin_call()


# -- one provider: attempts and backoff ----------------------------------------------

def test_first_call_is_attempt_one_on_the_primary() -> None:
    chain = make()
    assert chain.begin_call() == Attempt(provider="primary", attempt=1)
    assert chain.provider_attempts == 1
    assert chain.fallback_hops == 0
    assert chain.recovery_cycles == 0


def test_retryable_failure_retries_the_same_provider_with_exponential_backoff() -> None:
    chain = make()
    chain.begin_call()
    assert fail(chain) == RetryIn(provider="primary", seconds=1.0, attempt_next=2,
                                  failure_class=R, retry_after_s=None)
    assert chain.retry_ready() == Attempt(provider="primary", attempt=2)
    assert fail(chain) == RetryIn(provider="primary", seconds=2.0, attempt_next=3,
                                  failure_class=R)
    assert chain.retry_ready() == Attempt(provider="primary", attempt=3)
    assert fail(chain, U) == RetryIn(provider="primary", seconds=4.0, attempt_next=4,
                                     failure_class=U)


def test_backoff_attempt_index_is_attempts_made_minus_one() -> None:
    rec = Recorder()
    chain = make()
    chain.begin_call()
    for _ in range(3):
        chain.on_failure(R, rand=rec)
        chain.retry_ready()
    assert rec.calls == [(0.0, 1.0), (0.0, 2.0), (0.0, 4.0)]


def test_unknown_failures_are_retried_like_retryable_ones() -> None:
    chain = make()
    chain.begin_call()
    decision = fail(chain, U)
    assert isinstance(decision, RetryIn)
    assert decision.provider == "primary"


def test_decorrelated_backoff_grows_from_the_previous_delay() -> None:
    chain = make(backoff=Backoff(base_delay_s=1.0, max_delay_s=30.0, jitter="decorrelated"))
    chain.begin_call()
    waits = []
    for _ in range(3):
        decision = fail(chain)
        assert isinstance(decision, RetryIn)
        waits.append(decision.seconds)
        chain.retry_ready()
    assert waits == [3.0, 9.0, 27.0]


def test_retry_after_is_a_floor_on_the_wait() -> None:
    chain = make()
    chain.begin_call()
    decision = fail(chain, retry_after_s=10.0)
    assert decision == RetryIn(provider="primary", seconds=10.0, attempt_next=2,
                               failure_class=R, retry_after_s=10.0)
    chain.retry_ready()
    decision = fail(chain, retry_after_s=0.5)  # backoff 2.0 beats a 0.5 s Retry-After
    assert isinstance(decision, RetryIn)
    assert decision.seconds == 2.0


def test_retry_after_up_to_max_retry_after_is_waited() -> None:
    chain = make()
    chain.begin_call()
    decision = fail(chain, retry_after_s=120.0)
    assert isinstance(decision, RetryIn)
    assert decision.seconds == 120.0


def test_retry_after_above_max_retry_after_fails_over_at_once() -> None:
    chain = make()
    chain.begin_call()
    assert fail(chain, retry_after_s=120.5) == FailOver(
        from_provider="primary", to_provider="fallback", reason="retry_after_too_long")


def test_wait_never_outlives_the_remaining_budget() -> None:
    chain = make()
    chain.begin_call()
    assert fail(chain, remaining_s=0.99) == FailOver(
        from_provider="primary", to_provider="fallback", reason="no_time")
    chain.begin_call()
    decision = fail(chain, retry_after_s=30.0, remaining_s=29.0)
    assert isinstance(decision, Recover)  # fallback had no time either: the pass is spent


def test_a_wait_equal_to_the_remaining_budget_is_allowed() -> None:
    chain = make()
    chain.begin_call()
    decision = fail(chain, remaining_s=1.0)
    assert isinstance(decision, RetryIn)
    assert decision.seconds == 1.0


def test_attempts_spent_fails_over_after_max_attempts() -> None:
    chain = make(max_attempts=4)
    chain.begin_call()
    for n in range(2, 5):
        assert isinstance(fail(chain), RetryIn)
        assert chain.retry_ready() == Attempt(provider="primary", attempt=n)
    assert fail(chain) == FailOver(from_provider="primary", to_provider="fallback",
                                   reason="attempts_spent")


def test_attempts_spent_wins_over_a_long_retry_after() -> None:
    chain = make(max_attempts=1)
    chain.begin_call()
    decision = fail(chain, retry_after_s=500.0)
    assert isinstance(decision, FailOver)
    assert decision.reason == "attempts_spent"


def test_zero_api_max_retries_fails_over_after_one_attempt() -> None:
    chain = make(max_attempts=1)
    chain.begin_call()
    assert fail(chain) == FailOver(from_provider="primary", to_provider="fallback",
                                   reason="attempts_spent")


def test_deterministic_failure_fails_over_without_a_retry() -> None:
    chain = make()
    chain.begin_call()
    assert fail(chain, D) == FailOver(from_provider="primary", to_provider="fallback",
                                      reason="deterministic")


def test_deterministic_failure_after_retries_still_fails_over_at_once() -> None:
    chain = make()
    chain.begin_call()
    fail(chain)
    chain.retry_ready()
    decision = fail(chain, D)
    assert isinstance(decision, FailOver)
    assert decision.reason == "deterministic"


# -- failover ----------------------------------------------------------------------------

def test_failover_hop_resets_provider_attempts() -> None:
    chain = make()
    chain.begin_call()
    fail(chain)
    chain.retry_ready()
    assert chain.provider_attempts == 2
    fail(chain, D)
    assert chain.provider_attempts == 0
    assert chain.begin_call() == Attempt(provider="fallback", attempt=1)


def test_failover_hop_increments_fallback_hops() -> None:
    chain = make(("a", "b", "c"))
    chain.begin_call()
    fail(chain, D)
    assert chain.fallback_hops == 1
    assert chain.current_provider == "b"
    chain.begin_call()
    assert fail(chain, D) == FailOver(from_provider="b", to_provider="c",
                                      reason="deterministic")
    assert chain.fallback_hops == 2
    assert chain.pass_exits == ("deterministic", "deterministic")


def test_breaker_open_fails_over_without_an_attempt() -> None:
    chain = make()
    chain.begin_call()
    assert chain.on_breaker_open() == FailOver(from_provider="primary",
                                               to_provider="fallback", reason="breaker_open")
    assert chain.provider_attempts == 0
    assert chain.fallback_hops == 1
    assert chain.begin_call() == Attempt(provider="fallback", attempt=1)


def test_a_breaker_found_open_before_a_backoff_sleep_fails_over_without_sleeping() -> None:
    chain = make()
    chain.begin_call()
    assert isinstance(fail(chain), RetryIn)
    assert chain.on_breaker_open() == FailOver(from_provider="primary", to_provider="fallback",
                                               reason="breaker_open")
    assert chain.begin_call() == Attempt(provider="fallback", attempt=1)


def test_retry_refused_by_the_budget_fails_over_instead_of_sleeping() -> None:
    chain = make()
    chain.begin_call()
    assert isinstance(fail(chain), RetryIn)
    assert chain.on_retry_refused() == FailOver(from_provider="primary",
                                                to_provider="fallback", reason="retry_budget")
    assert chain.provider_attempts == 0


def test_the_call_after_a_failover_starts_on_the_provider_that_answered() -> None:
    chain = make()
    chain.begin_call()
    fail(chain, D)
    chain.begin_call()
    chain.on_success()
    # Until the next call, the counters describe the call that succeeded...
    assert (chain.current_provider, chain.fallback_hops) == ("fallback", 1)
    assert chain.next_provider == "fallback"
    # ...which starts a new pass on the fallback: fallback is scoped to the turn.
    assert chain.begin_call() == Attempt(provider="fallback", attempt=1)
    assert chain.fallback_hops == 0


def test_a_pass_that_starts_on_a_fallback_wraps_round_to_the_primary() -> None:
    chain = make(("a", "b", "c"), max_attempts=1)
    chain.begin_call()
    fail(chain)
    chain.begin_call()
    chain.on_success()  # b answered
    assert chain.begin_call() == Attempt(provider="b", attempt=1)
    assert fail(chain) == FailOver(from_provider="b", to_provider="c",
                                   reason="attempts_spent")
    chain.begin_call()
    assert fail(chain) == FailOver(from_provider="c", to_provider="a",
                                   reason="attempts_spent")
    assert chain.begin_call() == Attempt(provider="a", attempt=1)
    # Each provider once per pass: the third exit spends the pass.
    assert isinstance(fail(chain), Recover)
    assert chain.fallback_hops == 3
    # A recovery cycle starts its pass at the primary.
    assert chain.next_provider == "a"
    assert chain.recovery_done() == Attempt(provider="a", attempt=1)


def test_a_new_chain_the_next_turn_s_starts_at_the_primary() -> None:
    chain = make()
    chain.begin_call()
    fail(chain, D)
    chain.begin_call()
    chain.on_success()
    assert make().begin_call() == Attempt(provider="primary", attempt=1)


def test_the_chain_position_survives_a_checkpoint() -> None:
    chain = make()
    chain.begin_call()
    fail(chain, D)
    chain.begin_call()
    chain.on_success()
    restored = ProviderChain.restore(json.loads(json.dumps(chain.snapshot())), **SETTINGS)
    assert restored.begin_call() == Attempt(provider="fallback", attempt=1)
    assert restored.snapshot()["pass_start"] == 1
    # Mid-pass too: a pass started on the fallback and moved on to the primary.
    assert restored.on_failure(D) == FailOver(from_provider="fallback",
                                              to_provider="primary", reason="deterministic")
    again = ProviderChain.restore(json.loads(json.dumps(restored.snapshot())), **SETTINGS)
    assert (again.current_provider, again.fallback_hops) == ("primary", 1)
    assert again.begin_call() == Attempt(provider="primary", attempt=1)


def test_counters_read_in_one_call_are_the_properties_at_every_move() -> None:
    def read(c: ProviderChain) -> tuple[int, int, int, str]:
        return (c.provider_attempts, c.fallback_hops, c.recovery_cycles, c.current_provider)

    chain = make()
    assert chain.counters() == read(chain) == (0, 0, 0, "primary")
    chain.begin_call()
    assert chain.counters() == read(chain) == (1, 0, 0, "primary")
    fail(chain, D)
    assert chain.counters() == read(chain) == (0, 1, 0, "fallback")
    chain.begin_call()
    chain.on_success()
    restored = ProviderChain.restore(json.loads(json.dumps(chain.snapshot())), **SETTINGS)
    assert restored.counters() == read(restored) == read(chain)
    restored.begin_call()  # the next pass starts where the last call was answered
    assert restored.counters() == read(restored) == (1, 0, 0, "fallback")


def test_a_snapshot_with_a_pass_start_outside_the_chain_is_refused() -> None:
    snap = make().snapshot()
    with pytest.raises(ValueError, match="pass_start"):
        ProviderChain.restore({**snap, "pass_start": 2}, **SETTINGS)
    # An older snapshot without one starts its pass at the primary.
    del snap["pass_start"]
    assert ProviderChain.restore(snap, **SETTINGS).begin_call() == Attempt(
        provider="primary", attempt=1)


def test_a_provider_inside_its_retry_after_window_is_a_hop_with_no_attempt() -> None:
    chain = make()
    chain.begin_call()
    assert chain.on_retry_after(wait_s=25.0) == FailOver(
        from_provider="primary", to_provider="fallback", reason="retry_after")
    assert (chain.provider_attempts, chain.fallback_hops) == (0, 1)
    assert chain.begin_call() == Attempt(provider="fallback", attempt=1)


def test_a_pass_of_windows_and_open_breakers_waits_until_the_first_window_ends() -> None:
    chain = make(recovery_schedule=(1.5,), recovery_jitter=0.0)
    chain.begin_call()
    chain.on_retry_after(wait_s=25.0)
    chain.begin_call()
    decision = chain.on_breaker_open(reopens_in_s=40.0)
    assert decision == Recover(cycle=1, of_cycles=5, wait_s=25.0)
    assert isinstance(decision, Recover)
    assert decision.waits_for == "retry_after"
    assert "Retry-After window" in decision.why
    chain.recovery_done()
    assert chain.recovery_cycles == 1  # a breaker was open: a recovery cycle


def test_a_pass_where_every_provider_asked_to_wait_waits_for_the_first_window_uncharged(
        ) -> None:
    """No provider failed and each said when it can be asked: the turn waits until the
    first window ends, not the schedule's 15 s, and no recovery cycle is spent, even with
    none left."""
    chain = make(recovery_jitter=0.0, auto_recovery_cycles=0)
    chain.begin_call()
    chain.on_retry_after(wait_s=3.0)
    chain.begin_call()
    decision = chain.on_retry_after(wait_s=2.0)
    assert decision == Recover(cycle=1, of_cycles=0, wait_s=2.0)
    assert isinstance(decision, Recover) and decision.waits_for == "retry_after"
    assert "no recovery cycle" in decision.why
    restored = ProviderChain.restore(json.loads(json.dumps(chain.snapshot())),
                                     **{**SETTINGS, "auto_recovery_cycles": 0})
    for c in (chain, restored):
        assert c.recovery_done() == Attempt(provider="primary", attempt=1)
        assert c.recovery_cycles == 0


def test_a_window_wait_is_jittered_up_to_recovery_jitter() -> None:
    chain = make(recovery_jitter=0.2)
    chain.begin_call()
    chain.on_retry_after(wait_s=10.0)
    chain.begin_call()
    assert chain.on_retry_after(wait_s=10.0, rand=upper) == Recover(cycle=1, of_cycles=5,
                                                                   wait_s=12.0)


def test_a_recovery_wait_stretched_to_a_breaker_cooldown_says_so() -> None:
    chain = make(recovery_schedule=(1.5,), recovery_jitter=0.0)
    chain.begin_call()
    chain.on_breaker_open(reopens_in_s=30.0)
    chain.begin_call()
    decision = chain.on_breaker_open(reopens_in_s=45.0)
    assert isinstance(decision, Recover)
    assert (decision.wait_s, decision.waits_for) == (30.0, "breaker")
    assert "circuit breaker" in decision.why and "1.5 s" in decision.why


def test_a_recovery_wait_on_the_schedule_says_so() -> None:
    chain = make(max_attempts=1, recovery_schedule=(1.5,), recovery_jitter=0.0)
    chain.begin_call()
    decision = exhaust_pass(chain)
    assert isinstance(decision, Recover)
    assert (decision.wait_s, decision.waits_for) == (1.5, "schedule")


def test_a_retry_after_window_opened_during_a_backoff_is_a_hop() -> None:
    chain = make()
    chain.begin_call()
    assert isinstance(fail(chain), RetryIn)
    assert chain.on_retry_after(wait_s=10.0) == FailOver(
        from_provider="primary", to_provider="fallback", reason="retry_after")


def test_a_success_forgets_the_retry_after_of_its_pass() -> None:
    chain = make(max_attempts=1)
    chain.begin_call()
    fail(chain, R, retry_after_s=100.0)  # step 1: primary asks for 100 s, fallback answers
    chain.begin_call()
    chain.on_success()
    chain.begin_call()  # a later step: both fail with no Retry-After
    assert exhaust_pass(chain) == Recover(cycle=1, of_cycles=5, wait_s=18.0)


def test_a_success_forgets_the_breaker_reopening_of_its_pass() -> None:
    chain = make()
    chain.begin_call()
    chain.on_breaker_open(reopens_in_s=90.0)
    chain.begin_call()
    chain.on_success()
    chain.begin_call()
    chain.on_breaker_open(reopens_in_s=None, rand=upper)
    chain.begin_call()
    assert chain.on_breaker_open(rand=upper) == Recover(cycle=1, of_cycles=5, wait_s=18.0)


def test_a_new_retry_after_after_a_success_still_raises_the_wait() -> None:
    chain = make(max_attempts=1)
    chain.begin_call()
    chain.on_success()
    chain.begin_call()
    fail(chain, R, retry_after_s=40.0)
    chain.begin_call()
    assert fail(chain, R) == Recover(cycle=1, of_cycles=5, wait_s=40.0)


def test_a_reload_that_changes_the_providers_keeps_the_recovery_cycles() -> None:
    chain = _parked_in_cycle_2()
    carried = ProviderChain.carry_over(chain.snapshot(), ("new", "primary"),
                                       **{**SETTINGS, "max_attempts": 1})
    assert carried.phase is Phase.RECOVERING
    assert carried.recovery_cycles == 1
    assert carried.resume(now=100.0, recover_until=101.0) == Recover(
        cycle=2, of_cycles=5, wait_s=1.0)
    assert carried.recovery_done() == Attempt(provider="new", attempt=1)
    assert carried.recovery_cycles == 2


def test_a_reload_that_changes_the_providers_starts_a_new_pass() -> None:
    chain = make()
    chain.begin_call()
    fail(chain, D)
    carried = ProviderChain.carry_over(chain.snapshot(), ("a", "b", "c"), **SETTINGS)
    assert carried.phase is Phase.READY
    assert carried.fallback_hops == 0
    assert carried.begin_call() == Attempt(provider="a", attempt=1)


def test_new_chain_starts_at_the_primary() -> None:
    old = make()
    old.begin_call()
    fail(old, D)
    assert old.current_provider == "fallback"
    assert make().begin_call() == Attempt(provider="primary", attempt=1)


def test_success_resets_provider_attempts() -> None:
    chain = make()
    chain.begin_call()
    fail(chain)
    chain.retry_ready()
    chain.on_success()
    assert chain.provider_attempts == 0
    assert chain.begin_call() == Attempt(provider="primary", attempt=1)


def test_begin_call_starts_fresh_provider_attempts_for_each_step() -> None:
    chain = make(max_attempts=2)
    chain.begin_call()
    fail(chain)
    chain.retry_ready()
    chain.on_success()
    chain.begin_call()
    assert isinstance(fail(chain), RetryIn)  # a new call gets its full attempts again


# -- end of the pass: rejected, recovery, exhausted --------------------------------------

def test_401_on_every_provider_ends_providers_rejected_with_no_recovery_cycle() -> None:
    chain = make()
    chain.begin_call()
    assert fail(chain, D) == FailOver(from_provider="primary", to_provider="fallback",
                                      reason="deterministic")
    chain.begin_call()
    stop = fail(chain, D)
    assert stop == Stop(code=StopCode.PROVIDERS_REJECTED,
                        message="all 2 providers rejected the request", value=2, limit=2)
    assert isinstance(stop, Stop)
    assert stop.counter == "fallback_hops"
    assert chain.recovery_cycles == 0
    assert chain.phase is Phase.STOPPED


def test_a_single_provider_that_rejects_stops_at_once() -> None:
    chain = make(("only",))
    chain.begin_call()
    assert fail(chain, D) == Stop(code=StopCode.PROVIDERS_REJECTED,
                                  message="the provider rejected the request", value=1, limit=1)


def test_rejection_counts_only_the_exits_since_the_last_success() -> None:
    chain = make()
    chain.begin_call()
    fail(chain, D)
    chain.begin_call()
    chain.on_success()  # step 1 answered by the fallback
    chain.begin_call()
    assert isinstance(fail(chain, D), FailOver)  # step 2: the primary again, a new pass
    chain.begin_call()
    stop = fail(chain, D)
    assert isinstance(stop, Stop)
    assert stop.code is StopCode.PROVIDERS_REJECTED


def test_one_retryable_exit_in_the_pass_means_recovery_not_rejection() -> None:
    chain = make(max_attempts=1)
    chain.begin_call()
    fail(chain, R)
    chain.begin_call()
    assert fail(chain, D) == Recover(cycle=1, of_cycles=5, wait_s=18.0)


def test_a_breaker_open_hop_counts_as_non_deterministic() -> None:
    chain = make()
    chain.begin_call()
    fail(chain, D)
    chain.begin_call()
    assert chain.on_breaker_open(rand=upper) == Recover(cycle=1, of_cycles=5, wait_s=18.0)


def test_a_pass_of_open_breakers_waits_until_the_first_breaker_lets_a_probe_through() -> None:
    chain = make()
    chain.begin_call()
    chain.on_breaker_open(reopens_in_s=40.0, rand=upper)
    chain.begin_call()
    decision = chain.on_breaker_open(reopens_in_s=25.0, rand=upper)
    assert decision == Recover(cycle=1, of_cycles=5, wait_s=25.0)  # not 18: no cycle wasted


def test_a_breaker_reopening_sooner_than_the_schedule_leaves_the_schedule_alone() -> None:
    chain = make(("only",))
    chain.begin_call()
    assert chain.on_breaker_open(reopens_in_s=3.0, rand=upper) == Recover(
        cycle=1, of_cycles=5, wait_s=18.0)


def test_the_breaker_wait_applies_only_when_no_provider_of_the_pass_was_attempted() -> None:
    chain = make()
    chain.begin_call()
    chain.on_breaker_open(reopens_in_s=40.0, rand=upper)
    chain.begin_call()
    assert fail(chain, D) == Recover(cycle=1, of_cycles=5, wait_s=18.0)


def test_the_breaker_wait_is_capped_by_max_retry_after() -> None:
    chain = make(("only",), max_retry_after_s=20.0)
    chain.begin_call()
    assert chain.on_breaker_open(reopens_in_s=300.0, rand=upper) == Recover(
        cycle=1, of_cycles=5, wait_s=20.0)


def test_recovery_runs_exactly_auto_recovery_cycles_on_the_schedule() -> None:
    chain = make(max_attempts=1, auto_recovery_cycles=5)
    chain.begin_call()
    waits = []
    for cycle in range(1, 6):
        decision = exhaust_pass(chain)
        assert isinstance(decision, Recover)
        assert (decision.cycle, decision.of_cycles) == (cycle, 5)
        assert chain.recovery_cycles == cycle - 1
        waits.append(decision.wait_s)
        assert chain.recovery_done() == Attempt(provider="primary", attempt=1)
        assert chain.recovery_cycles == cycle
    # schedule (15, 30, 60) with the last wait repeating, each raised by the full 20 %
    assert waits == [18.0, 36.0, 72.0, 72.0, 72.0]
    stop = exhaust_pass(chain)
    assert stop == Stop(code=StopCode.PROVIDERS_EXHAUSTED,
                        message="all 2 providers failed after 5 of 5 recovery cycles",
                        value=5, limit=5)
    assert isinstance(stop, Stop)
    assert stop.counter == "recovery_cycles"


def test_recovery_jitter_draws_between_zero_and_recovery_jitter() -> None:
    rec = Recorder(result="lower")
    chain = make(("only",), max_attempts=1, recovery_jitter=0.5)
    chain.begin_call()
    assert chain.on_failure(R, rand=rec) == Recover(cycle=1, of_cycles=5, wait_s=15.0)
    assert rec.calls == [(0.0, 0.5)]


def test_zero_auto_recovery_cycles_stops_exhausted_after_one_pass() -> None:
    chain = make(max_attempts=1, auto_recovery_cycles=0)
    chain.begin_call()
    assert exhaust_pass(chain) == Stop(
        code=StopCode.PROVIDERS_EXHAUSTED,
        message="all 2 providers failed after 0 of 0 recovery cycles", value=0, limit=0)


def test_a_providers_retry_after_wins_over_a_shorter_recovery_wait() -> None:
    chain = make(max_attempts=1)
    chain.begin_call()
    fail(chain, retry_after_s=100.0)
    chain.begin_call()
    assert fail(chain, retry_after_s=40.0) == Recover(cycle=1, of_cycles=5, wait_s=100.0)


def test_a_retry_after_above_max_retry_after_does_not_set_the_recovery_wait() -> None:
    chain = make()
    chain.begin_call()
    fail(chain, retry_after_s=500.0)  # retry_after_too_long
    chain.begin_call()
    assert chain.on_breaker_open(rand=upper) == Recover(cycle=1, of_cycles=5, wait_s=18.0)


def test_retry_after_of_an_earlier_pass_is_forgotten() -> None:
    chain = make(max_attempts=1)
    chain.begin_call()
    fail(chain, retry_after_s=100.0)
    chain.begin_call()
    fail(chain)
    chain.recovery_done()
    assert exhaust_pass(chain) == Recover(cycle=2, of_cycles=5, wait_s=36.0)


def test_recovery_done_starts_a_new_pass_at_the_primary() -> None:
    chain = make()
    chain.begin_call()
    fail(chain, D)
    chain.begin_call()
    chain.on_breaker_open()
    assert chain.fallback_hops == 2
    assert chain.recovery_done() == Attempt(provider="primary", attempt=1)
    assert chain.fallback_hops == 0
    assert chain.pass_exits == ()
    assert chain.provider_attempts == 1
    assert chain.current_provider == "primary"


def test_a_successful_call_resets_recovery_cycles() -> None:
    chain = make(max_attempts=1)
    chain.begin_call()
    exhaust_pass(chain)
    chain.recovery_done()
    exhaust_pass(chain)
    chain.recovery_done()
    assert chain.recovery_cycles == 2
    chain.on_success()
    assert chain.recovery_cycles == 0
    chain.begin_call()
    assert exhaust_pass(chain) == Recover(cycle=1, of_cycles=5, wait_s=18.0)


def test_recovery_wait_without_any_rand_takes_its_upper_bound() -> None:
    chain = make(("only",))
    chain.begin_call()
    assert chain.on_breaker_open() == Recover(cycle=1, of_cycles=5, wait_s=18.0)


def test_the_constructor_rand_serves_events_given_none() -> None:
    chain = make(("only",), rand=lower)
    chain.begin_call()
    assert chain.on_breaker_open() == Recover(cycle=1, of_cycles=5, wait_s=15.0)
    chain2 = make(rand=lower)
    chain2.begin_call()
    decision = chain2.on_failure(R)
    assert isinstance(decision, RetryIn)
    assert decision.seconds == 0.0


# -- illegal sequences -----------------------------------------------------------------

def test_on_failure_without_an_attempt_raises_naming_phase_and_event() -> None:
    chain = make()
    with pytest.raises(ChainError, match="'on_failure' is not allowed in phase 'ready'"):
        chain.on_failure(R, rand=upper)


def test_an_illegal_event_poisons_the_chain() -> None:
    chain = make()
    with pytest.raises(ChainError):
        chain.retry_ready()
    assert chain.phase is Phase.ERROR
    with pytest.raises(ChainError, match="'begin_call' is not allowed in phase 'error'"):
        chain.begin_call()


@pytest.mark.parametrize("event", ["begin_call", "retry_ready", "recovery_done",
                                   "on_retry_refused"])
def test_only_outcome_events_follow_an_attempt(event: str) -> None:
    chain = make()
    chain.begin_call()
    with pytest.raises(ChainError, match=f"'{event}' is not allowed in phase 'attempting'"):
        getattr(chain, event)()


def test_nothing_follows_a_stop() -> None:
    chain = make(("only",))
    chain.begin_call()
    fail(chain, D)
    with pytest.raises(ChainError, match="phase 'stopped'"):
        chain.begin_call()


def test_a_recovering_chain_only_takes_recovery_done() -> None:
    chain = make(("only",))
    chain.begin_call()
    chain.on_breaker_open()
    with pytest.raises(ChainError, match="'begin_call' is not allowed in phase 'recovering'"):
        chain.begin_call()


def test_abandon_returns_a_cancelled_attempt_or_sleep_to_ready() -> None:
    chain = make()
    chain.begin_call()
    chain.abandon()
    assert chain.phase is Phase.READY
    chain.begin_call()
    fail(chain)
    chain.abandon()
    assert chain.begin_call() == Attempt(provider="primary", attempt=1)


def test_a_user_message_during_recovery_starts_a_new_pass_without_charging_a_cycle() -> None:
    chain = make(max_attempts=1, auto_recovery_cycles=2)
    chain.begin_call()
    first = exhaust_pass(chain)
    assert isinstance(first, Recover) and first.cycle == 1
    chain.user_message()
    assert (chain.phase, chain.fallback_hops, chain.recovery_cycles) == (Phase.READY, 0, 0)
    assert chain.begin_call() == Attempt(provider="primary", attempt=1)
    again = exhaust_pass(chain)
    assert isinstance(again, Recover) and again.cycle == 1  # the same cycle, not the next
    chain.recovery_done()
    assert isinstance(exhaust_pass(chain), Recover)
    chain.recovery_done()
    stop = exhaust_pass(chain)
    assert isinstance(stop, Stop) and (stop.code, stop.value, stop.limit) == (
        StopCode.PROVIDERS_EXHAUSTED, 2, 2)


def test_a_user_message_is_only_taken_while_recovering() -> None:
    chain = make()
    chain.begin_call()
    with pytest.raises(ChainError, match="'user_message' is not allowed in phase"):
        chain.user_message()


# -- checkpoints -------------------------------------------------------------------------

def test_snapshot_is_json_and_restore_keeps_the_counters() -> None:
    chain = make(("a", "b", "c"))
    chain.begin_call()
    fail(chain, D, retry_after_s=7.0)  # a failover mid-pass: what the pass remembers
    snap = json.loads(json.dumps(chain.snapshot()))
    assert snap == {"version": 1, "providers": ["a", "b", "c"], "phase": "ready",
                    "current_provider": "b", "pass_start": 0, "provider_attempts": 0,
                    "fallback_hops": 1,
                    "recovery_cycles": 0, "pass_exits": ["deterministic"],
                    "pass_retry_after_s": 7.0, "pass_reopen_s": None, "pass_reopen_by": None,
                    "previous_delay_s": None, "pass_done": False}
    again = ProviderChain.restore(snap, **SETTINGS)
    assert again.snapshot() == snap
    assert again.begin_call() == Attempt(provider="b", attempt=1)


def test_a_turn_parked_in_recovery_keeps_its_cycle_across_a_restore() -> None:
    chain = make(max_attempts=1)
    chain.begin_call()
    exhaust_pass(chain)
    chain.recovery_done()
    assert exhaust_pass(chain) == Recover(cycle=2, of_cycles=5, wait_s=36.0)
    restored = ProviderChain.restore(chain.snapshot(), ("primary", "fallback"), **SETTINGS)
    assert restored.phase is Phase.RECOVERING
    assert restored.recovery_cycles == 1
    assert restored.recovery_done() == Attempt(provider="primary", attempt=1)
    assert restored.recovery_cycles == 2


def test_a_call_in_flight_at_the_checkpoint_resumes_ready_for_a_new_call() -> None:
    chain = make()
    chain.begin_call()
    fail(chain)
    snap = chain.snapshot()
    assert snap["phase"] == "backing_off"
    restored = ProviderChain.restore(snap, **SETTINGS)
    assert restored.phase is Phase.READY
    assert restored.begin_call() == Attempt(provider="primary", attempt=1)


def test_restore_refuses_a_snapshot_of_another_chain() -> None:
    snap = make().snapshot()
    with pytest.raises(ValueError, match="snapshot is for"):
        ProviderChain.restore(snap, ("primary", "other"), **SETTINGS)


def test_restore_refuses_an_unknown_snapshot_version() -> None:
    snap = {**make().snapshot(), "version": 99}
    with pytest.raises(ValueError, match="version"):
        ProviderChain.restore(snap, **SETTINGS)


# -- construction and repr ---------------------------------------------------------------

@pytest.mark.parametrize("kwargs", [{"max_attempts": 0}, {"recovery_schedule": ()},
                                    {"recovery_jitter": -0.1},
                                    {"auto_recovery_cycles": -1},
                                    {"max_retry_after_s": -1.0}])
def test_invalid_settings_are_refused(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        make(**kwargs)


def test_an_empty_chain_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one provider"):
        make(())


def test_repr_shows_phase_position_and_counters() -> None:
    chain = make()
    chain.begin_call()
    assert repr(chain) == ("ProviderChain(phase=attempting, current='primary', "
                           "provider_attempts=1/4, fallback_hops=0/2, recovery_cycles=0/5)")


# -- resuming a call -------------------------------------------------------------------


def _parked_in_cycle_2() -> ProviderChain:
    chain = make(max_attempts=1)
    chain.begin_call()
    assert isinstance(exhaust_pass(chain), Recover)
    chain.recovery_done()
    assert isinstance(exhaust_pass(chain), Recover)
    return ProviderChain.restore(chain.snapshot(), **{**SETTINGS, "max_attempts": 1})


def test_resume_outside_recovery_is_a_plain_first_attempt() -> None:
    assert make().resume(now=100.0, recover_until=None) == Attempt("primary", 1)


def test_resume_parked_in_recovery_waits_out_the_same_cycle_until_its_wake_up_time() -> None:
    chain = _parked_in_cycle_2()
    decision = chain.resume(now=100.0, recover_until=112.5)
    assert decision == Recover(cycle=2, of_cycles=5, wait_s=12.5)
    assert chain.recovery_cycles == 1
    assert chain.recovery_done() == Attempt(provider="primary", attempt=1)
    assert chain.recovery_cycles == 2


def test_resume_past_the_wake_up_time_waits_zero_seconds() -> None:
    decision = _parked_in_cycle_2().resume(now=200.0, recover_until=112.5)
    assert isinstance(decision, Recover) and decision.wait_s == 0.0


def test_resume_after_a_steer_cut_the_wait_starts_a_new_pass_without_charging_a_cycle(
        ) -> None:
    chain = _parked_in_cycle_2()
    assert chain.resume(now=100.0, recover_until=None) == Attempt("primary", 1)
    assert chain.recovery_cycles == 1


def test_a_chain_waiting_out_a_recovery_cycle_names_the_primary_as_the_next_provider() -> None:
    chain = make(max_attempts=1)
    chain.begin_call()
    assert isinstance(exhaust_pass(chain), Recover)
    # The last provider tried is the fallback; the next attempt goes to the primary.
    assert (chain.current_provider, chain.next_provider) == ("fallback", "primary")
    restored = ProviderChain.restore(json.loads(json.dumps(chain.snapshot())), **SETTINGS)
    assert restored.next_provider == "primary"
