"""What one model call holds of the protection every turn shares, and gives back on every
way out: a breaker slot while an attempt is on the wire, a retry of the provider's retry
budget from the retry's sleep to the end of its attempt.
"""

from __future__ import annotations

from turnkeeper.clock import Clock
from turnkeeper.policy.breaker import CircuitBreaker
from turnkeeper.policy.classify import FailureClass
from turnkeeper.runtime import Shared


class Claims:
    """What one model call holds of the shared protection: at most one breaker slot (an
    attempt on the wire) and at most one retry of a provider's retry budget (from the
    retry's sleep to the end of its attempt). `give_back` at the end of the call, however
    it ends, gives back whatever is still held; the turn's model calls share the one
    object (`ModelCall`), each starting with nothing held."""

    def __init__(self, shared: Shared, clock: Clock) -> None:
        self._shared = shared
        self._clock = clock
        self._retry_of: str | None = None
        self._breaker: CircuitBreaker | None = None
        # The last failure was excused (`policy/stall.py`): its retry is not the peer's
        # doing, and takes nothing from the retry budget.
        self._excused = False

    def give_back(self) -> None:
        """The call is over: whatever it still holds goes back, and nothing is left of
        it for the next call."""
        if self._retry_of is not None:  # `end_retry`, without its call when none is held
            self.end_retry()
        if self._breaker is not None:
            self._breaker.release(self._clock.monotonic())
            self._breaker = None
        self._excused = False

    def begin_retry(self, provider: str) -> bool:
        """Take a retry from the provider's budget; False when the budget refuses. The
        retry of an excused failure takes nothing from it."""
        if self._excused:
            self._excused = False
            return True
        if not self._shared.retry_budgets[provider].try_begin_retry():
            return False
        self._retry_of = provider
        return True

    def end_retry(self) -> None:
        if self._retry_of is not None:
            self._shared.retry_budgets[self._retry_of].end_retry()
            self._retry_of = None

    def acquire(self, breaker: CircuitBreaker) -> bool:
        if not breaker.try_acquire(self._clock.monotonic()):
            return False
        self._breaker = breaker
        return True

    def succeeded(self) -> None:
        assert self._breaker is not None
        self._breaker.record_success(self._clock.monotonic())
        self._breaker = None

    def failed(self, failure_class: FailureClass, retry_after_s: float | None, *,
               local: bool = False, excused: bool = False) -> None:
        """A failure of the peer feeds its breaker; one of our own resources (`local`),
        or one `excused` (the process stalled, or its fleet lease lapsed, while the
        call was out) only gives the slot back."""
        assert self._breaker is not None
        self._excused = excused
        if local or excused:
            self._breaker.release(self._clock.monotonic())
        else:
            self._breaker.record_failure(self._clock.monotonic(), failure_class,
                                         retry_after_s=retry_after_s)
        self._breaker = None
