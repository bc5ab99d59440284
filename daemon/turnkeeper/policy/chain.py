"""The provider chain of one turn: retries, failover and auto-recovery.

Sans-I/O, in the manner of h11: the turn runner reports what happened (an event method)
and gets back what to do next (a decision). The runner owns the I/O, the clock, the
daemon-wide breakers and retry budgets; it asks them and reports their answers here.
This module is the events and the rules; what they move (the settings, the counters
below, the current pass) and its checkpoint form are `ChainState`'s
(policy/chain_state.py).

Counters, each with one meaning:

- ``provider_attempts``: attempts of the current model call on the current provider,
  limited by ``max_attempts = api_max_retries + 1``. Reset by a failover hop, a success,
  a recovery cycle (and at the start of every call).
- ``fallback_hops``: moves to the next provider in this pass, an open breaker or a
  remembered Retry-After window included (a hop with no attempt). The move past the
  last provider of the pass counts too, so a pass that spent every provider reads
  ``len(providers)`` of ``len(providers)``. Reset when a new pass starts: the start of
  the turn (a new chain), the call after a successful one, or a recovery cycle.
- ``recovery_cycles``: completed waits after the whole chain was exhausted by retryable
  or unknown failures, limited by ``auto_recovery_cycles``. Reset by a successful call,
  and nothing else: a reload that changes the provider list keeps it (`carry_over`).

Within one model call the position in the chain only moves forward: each provider is
tried at most once per pass, so a pass is a walk along the list from where it started,
wrapping round past the end; the reason each provider was left is recorded
(`pass_exits`) and `fallback_hops` is its length. A successful call ends the pass: what
it remembered (the providers already left, the largest Retry-After, the soonest breaker
reopening) described an outage that is over, so the next call starts a new pass, and
its first recovery wait is the schedule's, unless a new Retry-After raises it.

Fallback is scoped to the turn: the next call's pass starts at the provider that
answered the last one, so a turn that failed over stays on its fallback instead of
asking the primary again at every step (a fresh chain, the next turn's, starts at the
primary, whose breaker or Retry-After window turns it away at once if it is still
down). A recovery cycle, and a steer that cut one short, start their pass at the
primary. Until that next call begins, the position and `fallback_hops` still describe
the call that succeeded (which provider answered, after how many hops).

The flow, one model call::

    begin_call() -> Attempt
      breaker refused      -> on_breaker_open()   -> FailOver | Recover | Stop
      Retry-After window   -> on_retry_after()    -> FailOver | Recover | Stop
      call succeeded       -> on_success()        -> None (next step: begin_call())
      call failed          -> on_failure(...)     -> RetryIn | FailOver | Recover | Stop
    RetryIn
      budget refused       -> on_retry_refused()  -> FailOver | Recover | Stop
      breaker opened       -> on_breaker_open()   -> FailOver | Recover | Stop (no sleep)
      window opened        -> on_retry_after()    -> FailOver | Recover | Stop (no sleep)
      slept RetryIn.seconds-> retry_ready()       -> Attempt
    FailOver               -> begin_call()        -> Attempt on FailOver.to_provider
    Recover                -> (park, sleep wait_s) recovery_done() -> Attempt on the primary
      a user message cut the wait short -> user_message() -> None (then begin_call())
    Stop                   -> the turn ends with it
    any time before a Stop -> abandon()  (the call or sleep was cancelled: no decision)

The rules of one failed attempt, in `on_failure`:

- deterministic: fail over at once ("deterministic"), never retried on this provider;
- retryable/unknown, attempts spent: fail over ("attempts_spent");
- Retry-After above ``max_retry_after_s``: the provider is unavailable, fail over at
  once ("retry_after_too_long");
- else ``wait = max(backoff.delay(attempt=provider_attempts - 1), retry_after_s or 0)``
  (Retry-After is a floor); a wait longer than the turn's remaining active time fails
  over ("no_time"); else `RetryIn(wait)`.

When a hop finds no provider left in the pass:

- every provider of the pass failed deterministically: ``Stop(providers.rejected,
  value=fallback_hops, limit=len(providers))`` at once; waiting does not fix a 401;
- else, while ``recovery_cycles < auto_recovery_cycles``: ``Recover(cycle, of_cycles,
  wait_s)`` with ``wait_s = max(schedule[min(cycle - 1, len(schedule) - 1)] * (1 +
  rand(0, recovery_jitter)), largest Retry-After <= max_retry_after_s seen in the pass)``:
  a provider's Retry-After wins up to max_retry_after; when every exit of the pass was an
  open breaker or a remembered Retry-After window (no provider could be asked at all),
  the wait also lasts until the first of them lets a call through (up to
  max_retry_after_s). `Recover.waits_for` says which of these set the wait;
- when every provider of the pass was skipped for a Retry-After window (none failed,
  each said when it can be asked), even with the cycles spent: ``Recover`` until the
  first window ends (+ jitter), and `recovery_done` charges no cycle for it;
- else ``Stop(providers.exhausted, value=recovery_cycles, limit=auto_recovery_cycles)``.

Any other sequence of events is a bug in the caller: `ChainError` names the phase and
the event, and poisons the chain (every later event raises too), as h11 does.
"""

from __future__ import annotations

import math
from enum import StrEnum
from typing import TypeVar

from turnkeeper.policy.backoff import Rand
from turnkeeper.policy.chain_decisions import Attempt as Attempt
from turnkeeper.policy.chain_decisions import ChainError as ChainError
from turnkeeper.policy.chain_decisions import Decision as Decision
from turnkeeper.policy.chain_decisions import FailOver as FailOver
from turnkeeper.policy.chain_decisions import FailOverReason as FailOverReason
from turnkeeper.policy.chain_decisions import Phase as Phase
from turnkeeper.policy.chain_decisions import Recover as Recover
from turnkeeper.policy.chain_decisions import RetryIn as RetryIn
from turnkeeper.policy.chain_decisions import WaitsFor
from turnkeeper.policy.chain_state import ChainState
from turnkeeper.policy.classify import FailureClass
from turnkeeper.policy.outcome import Stop, StopCode

_D = TypeVar("_D")


class _Event(StrEnum):
    BEGIN_CALL = "begin_call"
    BREAKER_OPEN = "on_breaker_open"
    RETRY_AFTER = "on_retry_after"
    SUCCESS = "on_success"
    FAILURE = "on_failure"
    RETRY_REFUSED = "on_retry_refused"
    RETRY_READY = "retry_ready"
    RECOVERY_DONE = "recovery_done"
    USER_MESSAGE = "user_message"
    ABANDON = "abandon"


# Which events each phase takes...
_ALLOWED: dict[Phase, frozenset[_Event]] = {
    Phase.READY: frozenset({_Event.BEGIN_CALL, _Event.ABANDON}),
    Phase.ATTEMPTING: frozenset({_Event.BREAKER_OPEN, _Event.RETRY_AFTER, _Event.SUCCESS,
                                 _Event.FAILURE, _Event.ABANDON}),
    Phase.BACKING_OFF: frozenset({_Event.RETRY_REFUSED, _Event.RETRY_READY,
                                  _Event.BREAKER_OPEN, _Event.RETRY_AFTER,
                                  _Event.ABANDON}),
    Phase.RECOVERING: frozenset({_Event.RECOVERY_DONE, _Event.USER_MESSAGE}),
    Phase.STOPPED: frozenset(),
    Phase.ERROR: frozenset(),
}

# ...and the phase each decision leaves it in (None: an event with no decision).
_PHASE_AFTER: dict[type[object], Phase] = {
    Attempt: Phase.ATTEMPTING,
    RetryIn: Phase.BACKING_OFF,
    FailOver: Phase.READY,
    Recover: Phase.RECOVERING,
    Stop: Phase.STOPPED,
    type(None): Phase.READY,
}


def _upper_bound(a: float, b: float) -> float:
    """The rand used when the caller gave none: every wait takes its upper bound (the
    conservative choice; never a burst of zero waits)."""
    return b


class ProviderChain(ChainState):
    """One turn's walk through the provider chain. Create one per turn. Its settings,
    counters and checkpoint form (`snapshot`, `restore`, `carry_over`) are `ChainState`'s;
    this class moves them, one event at a time."""

    # -- events in -------------------------------------------------------------------

    def begin_call(self) -> Attempt:
        """A new model call (a step, or the step again after a failover) on the current
        provider, with fresh provider_attempts."""
        self._expect(_Event.BEGIN_CALL)
        if self._pass_done:  # the turn stays on the provider that answered last
            self._start_pass(self._index())
        self._provider_attempts = 0
        self._previous_delay_s = None
        self._phase = Phase.ATTEMPTING  # `_enter` of the Attempt, written out: every step
        return self._attempt()

    def on_success(self) -> None:
        """The call succeeded: the outage is over. recovery_cycles starts over and so
        does the pass: the next call begins on this provider with no Retry-After, no
        breaker reopening and no providers left behind."""
        self._expect(_Event.SUCCESS)
        self._recovery_cycles = 0
        self._provider_attempts = 0
        self._previous_delay_s = None
        self._pass_retry_after_s = None
        self._pass_reopen_s = None
        self._pass_reopen_by = None
        self._pass_done = True  # the next begin_call() starts a new pass
        self._phase = Phase.READY  # `_enter(None)`, written out: every step

    def on_failure(self, failure_class: FailureClass, *, retry_after_s: float | None = None,
                   remaining_s: float = math.inf,
                   rand: Rand | None = None) -> RetryIn | FailOver | Recover | Stop:
        """The outstanding attempt failed. `remaining_s` is the turn's remaining active
        time: no wait may outlive it. See the module docstring for the rules."""
        self._expect(_Event.FAILURE)
        if (retry_after_s is not None and retry_after_s <= self.max_retry_after_s
                and (self._pass_retry_after_s is None
                     or retry_after_s > self._pass_retry_after_s)):
            self._pass_retry_after_s = retry_after_s
        decision: RetryIn | FailOver | Recover | Stop
        if failure_class is FailureClass.DETERMINISTIC:
            decision = self._hop("deterministic", rand)
        elif self._provider_attempts >= self.max_attempts:
            decision = self._hop("attempts_spent", rand)
        elif retry_after_s is not None and retry_after_s > self.max_retry_after_s:
            decision = self._hop("retry_after_too_long", rand)
        else:
            delay = self.backoff.delay(attempt=self._provider_attempts - 1,
                                       previous_s=self._previous_delay_s,
                                       rand=self._rand_of(rand))
            wait = max(delay, retry_after_s or 0.0)
            if wait > remaining_s:
                decision = self._hop("no_time", rand)
            else:
                self._previous_delay_s = delay
                decision = RetryIn(provider=self.current_provider, seconds=wait,
                                   attempt_next=self._provider_attempts + 1,
                                   failure_class=failure_class, retry_after_s=retry_after_s)
        return self._enter(decision)

    def on_breaker_open(self, *, reopens_in_s: float | None = None,
                        rand: Rand | None = None) -> FailOver | Recover | Stop:
        """The current provider's breaker refused the outstanding attempt, or is open when a
        RetryIn is about to sleep (other turns opened it): a hop with no attempt and no
        sleep. Counts as a non-deterministic exit for providers.rejected. `reopens_in_s`
        is how long until the breaker lets a probe through: when no provider of the pass
        could be attempted at all, the recovery wait lasts at least until the first of
        them does (up to max_retry_after_s), so that a cycle is not spent on a pass that
        cannot make a single attempt."""
        self._expect(_Event.BREAKER_OPEN)
        self._reopens_in(reopens_in_s, "breaker")
        return self._enter(self._hop("breaker_open", rand))

    def on_retry_after(self, *, wait_s: float, rand: Rand | None = None
                       ) -> FailOver | Recover | Stop:
        """The current provider asked, in a Retry-After this turn or another one heard,
        not to be called for `wait_s` more seconds (policy/retry_after.py): a hop with no
        attempt and no sleep, like an open breaker. When no provider of the pass could
        be asked, the recovery wait lasts until the first of them can be."""
        self._expect(_Event.RETRY_AFTER)
        self._reopens_in(wait_s, "retry_after")
        return self._enter(self._hop("retry_after", rand))

    def _reopens_in(self, seconds: float | None, by: WaitsFor) -> None:
        if seconds is not None and seconds >= 0 and (
                self._pass_reopen_s is None or seconds < self._pass_reopen_s):
            self._pass_reopen_s = seconds
            self._pass_reopen_by = by

    def on_retry_refused(self, *, rand: Rand | None = None) -> FailOver | Recover | Stop:
        """The retry budget refused the RetryIn: fail over instead of sleeping."""
        self._expect(_Event.RETRY_REFUSED)
        return self._enter(self._hop("retry_budget", rand))

    def resume(self, *, now: float, recover_until: float | None) -> Attempt | Recover:
        """The first decision of a model call, `begin_call()` but for a chain restored
        parked in recovery. Parked with its wake-up time (`recover_until`, wall clock):
        the same cycle goes on waiting until then, nothing counted again (call
        `recovery_done()` after the wait). Parked without one: a steer had cut the wait
        short before the checkpoint, so a new pass starts at the primary, no cycle
        charged."""
        if self._phase is Phase.RECOVERING and recover_until is None:
            self.user_message()
            return self.begin_call()
        if self._phase is Phase.RECOVERING and recover_until is not None:
            return Recover(cycle=self._recovery_cycles + 1, of_cycles=self.auto_recovery_cycles,
                           wait_s=max(0.0, recover_until - now),
                           why="the rest of a recovery wait begun before a resume")
        return self.begin_call()

    def retry_ready(self) -> Attempt:
        """The RetryIn sleep is over: the next attempt on the same provider."""
        self._expect(_Event.RETRY_READY)
        return self._enter(self._attempt())

    def recovery_done(self) -> Attempt:
        """The Recover wait is over: count the cycle (unless every provider of the pass
        was only waited for, in its Retry-After window) and start a new pass at the
        primary (fallback_hops 0, fresh provider_attempts)."""
        self._expect(_Event.RECOVERY_DONE)
        if not self._only_windows():  # a wait for Retry-After windows charges no cycle
            self._recovery_cycles += 1
        self._start_pass(0)
        return self._enter(self._attempt())

    def user_message(self) -> None:
        """A user message (a steer) cut the Recover wait short: a new pass starts at the
        primary (call `begin_call()` next) without counting the cycle, because a user
        message is never charged to any counter. If the new pass is spent too,
        the next Recover is the same cycle again, on the same schedule."""
        self._expect(_Event.USER_MESSAGE)
        self._start_pass(0)
        self._enter(None)

    def abandon(self) -> None:
        """The outstanding attempt or retry sleep was cancelled (e.g. a steer with
        redirect): no decision; the next call starts with `begin_call()`. Counters are
        left alone; the caller releases the breaker slot and the retry budget."""
        self._expect(_Event.ABANDON)
        self._enter(None)

    # -- the rules -------------------------------------------------------------------

    def _attempt(self) -> Attempt:
        self._provider_attempts += 1
        return Attempt(provider=self._current, attempt=self._provider_attempts)

    def _hop(self, reason: FailOverReason, rand: Rand | None) -> FailOver | Recover | Stop:
        """Leave the current provider: a hop, and the end of the pass when none is left."""
        from_provider = self.current_provider
        self._pass_exits.append(reason)
        self._moved()
        self._provider_attempts = 0
        self._previous_delay_s = None
        n = len(self.providers)
        if len(self._pass_exits) < n:
            return FailOver(from_provider=from_provider, to_provider=self.current_provider,
                            reason=reason)
        if all(r == "deterministic" for r in self._pass_exits):
            who = "the provider" if n == 1 else f"all {n} providers"
            return Stop(code=StopCode.PROVIDERS_REJECTED,
                        message=f"{who} rejected the request",
                        value=self.fallback_hops, limit=n)
        if self._only_windows():
            return self._window_wait(rand)
        if self._recovery_cycles < self.auto_recovery_cycles:
            return self._recover(rand)
        who = "the provider" if n == 1 else f"all {n} providers"
        return Stop(code=StopCode.PROVIDERS_EXHAUSTED,
                    message=(f"{who} failed after {self._recovery_cycles} of "
                             f"{self.auto_recovery_cycles} recovery cycles"),
                    value=self._recovery_cycles, limit=self.auto_recovery_cycles)

    def _only_windows(self) -> bool:
        """Every provider of the pass was skipped for its Retry-After window: none failed,
        none could be asked, and each said when it can be."""
        return bool(self._pass_exits) and all(r == "retry_after" for r in self._pass_exits)

    def _window_wait(self, rand: Rand | None) -> Recover:
        """Wait until the first window ends (jittered up, so the turns waiting on one
        provider do not all come back at once), parked like a recovery wait, but no
        cycle is charged (`recovery_done`): nothing was attempted, and the providers
        said when to come back."""
        drawn = self._rand_of(rand)(0.0, self.recovery_jitter)
        jitter = min(self.recovery_jitter, max(0.0, drawn))
        first = min(self._pass_reopen_s or 0.0, self.max_retry_after_s)
        return Recover(cycle=self._recovery_cycles + 1, of_cycles=self.auto_recovery_cycles,
                       wait_s=first * (1.0 + jitter), waits_for="retry_after",
                       why=(f"every provider asked to wait (Retry-After): the first window "
                            f"ends in {first:.3g} s; no recovery cycle is charged"))

    def _recover(self, rand: Rand | None) -> Recover:
        """The next recovery cycle's wait: the schedule's (jittered), raised to the largest
        Retry-After of the pass, and stretched until the first provider can be asked when
        none of the pass could be (an open breaker, a Retry-After window)."""
        cycle = self._recovery_cycles + 1
        scheduled = self.recovery_schedule[min(cycle - 1, len(self.recovery_schedule) - 1)]
        drawn = self._rand_of(rand)(0.0, self.recovery_jitter)
        jitter = min(self.recovery_jitter, max(0.0, drawn))
        wait = scheduled * (1.0 + jitter)
        waits_for: WaitsFor = "schedule"
        why = f"recovery_schedule: {wait:.3g} s"
        if self._pass_retry_after_s is not None and self._pass_retry_after_s > wait:
            wait, waits_for = self._pass_retry_after_s, "retry_after"
            why = f"a provider answered Retry-After: {wait:.3g} s"
        if self._pass_reopen_s is not None and self._pass_reopen_by is not None and all(
                r in ("breaker_open", "retry_after") for r in self._pass_exits):
            reopen = min(self._pass_reopen_s, self.max_retry_after_s)
            if reopen > wait:
                what = ("a circuit breaker lets a probe through"
                        if self._pass_reopen_by == "breaker"
                        else "a provider's Retry-After window ends")
                why = (f"no provider could be asked; {what} in {reopen:.3g} s "
                       f"(the schedule said {wait:.3g} s)")
                wait, waits_for = reopen, self._pass_reopen_by
        return Recover(cycle=cycle, of_cycles=self.auto_recovery_cycles, wait_s=wait,
                       waits_for=waits_for, why=why)

    def _start_pass(self, start: int) -> None:
        self._pass_done = False
        self._pass_start = start
        self._pass_exits = []
        self._current = self.providers[start]  # `_moved()`, with no provider left yet
        self._pass_retry_after_s = None
        self._pass_reopen_s = None
        self._pass_reopen_by = None
        self._provider_attempts = 0
        self._previous_delay_s = None

    def _rand_of(self, rand: Rand | None) -> Rand:
        if rand is not None:
            return rand
        return self._rand if self._rand is not None else _upper_bound

    def _expect(self, event: _Event) -> None:
        if event not in _ALLOWED[self._phase]:
            phase = self._phase
            self._phase = Phase.ERROR
            raise ChainError(phase.value, event.value)

    def _enter(self, decision: _D) -> _D:
        self._phase = _PHASE_AFTER[type(decision)]
        return decision
