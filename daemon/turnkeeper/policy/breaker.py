"""The daemon-wide circuit breaker, one per provider and one per tool.

Everything that affects the breaker's state lives in this module: the state is derived
from two stored facts (the consecutive failure streak and the time the breaker is open
until), and the reaction to each reported outcome is the `_TRANSITIONS` table below.

    CLOSED    --failure_threshold consecutive retryable/unknown failures-->  OPEN
    OPEN      --cooldown passes (no event: the clock alone)-------------->  HALF_OPEN
    HALF_OPEN --the probe succeeds, or is answered deterministically---->  CLOSED
    HALF_OPEN --the probe fails (retryable/unknown)-------------------->  OPEN again

Protocol for callers: every `try_acquire(now)` that returned True is followed by exactly
one of `record_success`, `record_failure` or `release` (the call was abandoned, e.g.
cancelled: it frees a probe slot and changes nothing else).

An open period lasts ``max(cooldown_s, retry_after_s or 0)``: a provider that says
"come back in 90 s" is not probed after 30.

A deterministic failure (a 400, a 401...) means the peer answered: it is alive, the
request was wrong. It resets the streak in CLOSED and counts like a success for a
half-open probe. A dead endpoint does not return well-formed 401s.

Without a per-call token the breaker cannot tell a probe's outcome from that of a call
admitted before it opened (a slow request can outlive the cooldown). It does not try:
any outcome reported in HALF_OPEN is evidence about the peer and is treated as the
probe's; an outcome reported while OPEN (a straggler) changes nothing, so the cooldown
stands. The cost is that a straggler can free a probe slot early, letting one extra
probe through; the breaker never gets stuck.

Several daemons sharing a store (a fleet) count one streak: `observer` hears every
change of the streak and every opening (`BreakerChange`), for the node to publish; the
shared streak comes back through `share_streak`, an opening by another node through
`open_from_peer`. The decisions stay here; the sharing is I/O, done elsewhere.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

from turnkeeper.policy.classify import FailureClass


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class _Outcome(StrEnum):
    SUCCESS = "success"
    FAILURE = "failure"  # retryable or unknown: the peer did not answer usefully
    ANSWERED = "answered"  # deterministic: the peer answered, the request was wrong
    RELEASED = "released"  # abandoned (cancelled): tells nothing about the peer


class _Action(StrEnum):
    RESET_STREAK = "reset_streak"
    COUNT_FAILURE = "count_failure"  # and open when the streak reaches the threshold
    CLOSE = "close"
    REOPEN = "reopen"
    NOTHING = "nothing"


# The rules, in one place: (state when the outcome is reported, outcome) -> action.
_TRANSITIONS: dict[tuple[BreakerState, _Outcome], _Action] = {
    (BreakerState.CLOSED, _Outcome.SUCCESS): _Action.RESET_STREAK,
    (BreakerState.CLOSED, _Outcome.ANSWERED): _Action.RESET_STREAK,
    (BreakerState.CLOSED, _Outcome.FAILURE): _Action.COUNT_FAILURE,
    (BreakerState.CLOSED, _Outcome.RELEASED): _Action.NOTHING,
    # A straggler admitted before the breaker opened: the cooldown stands.
    (BreakerState.OPEN, _Outcome.SUCCESS): _Action.NOTHING,
    (BreakerState.OPEN, _Outcome.ANSWERED): _Action.NOTHING,
    (BreakerState.OPEN, _Outcome.FAILURE): _Action.NOTHING,
    (BreakerState.OPEN, _Outcome.RELEASED): _Action.NOTHING,
    (BreakerState.HALF_OPEN, _Outcome.SUCCESS): _Action.CLOSE,
    (BreakerState.HALF_OPEN, _Outcome.ANSWERED): _Action.CLOSE,
    (BreakerState.HALF_OPEN, _Outcome.FAILURE): _Action.REOPEN,
    (BreakerState.HALF_OPEN, _Outcome.RELEASED): _Action.NOTHING,
}


class ChangeKind(StrEnum):
    FAILURE = "failure"  # the streak grew by one
    RESET = "reset"  # the streak went back to zero (a success, an answer, a close)
    OPENED = "opened"  # opened (or opened again) for `open_for_s`


@dataclass(frozen=True, slots=True)
class BreakerChange:
    """What changed in a breaker, for its observer (a fleet shares it)."""

    name: str
    kind: ChangeKind
    open_for_s: float | None = None


class BreakerSettings(Protocol):
    """What `CircuitBreaker.from_config` reads (`config.CircuitBreakerConfig` fits)."""

    @property
    def failure_threshold(self) -> int: ...
    @property
    def cooldown(self) -> float: ...
    @property
    def half_open_probes(self) -> int: ...


def _check(failure_threshold: int, cooldown_s: float, half_open_probes: int) -> None:
    if failure_threshold < 1:
        raise ValueError(f"failure_threshold must be >= 1, got {failure_threshold}")
    if not cooldown_s >= 0:
        raise ValueError(f"cooldown_s must be >= 0, got {cooldown_s!r}")
    if half_open_probes < 1:
        raise ValueError(f"half_open_probes must be >= 1, got {half_open_probes}")


class CircuitBreaker:
    """One provider's (or tool's) breaker, shared by every turn of the daemon."""

    def __init__(self, name: str, *, failure_threshold: int = 5, cooldown_s: float = 30.0,
                 half_open_probes: int = 1) -> None:
        _check(failure_threshold, cooldown_s, half_open_probes)
        self.name = name
        self.failure_threshold = failure_threshold
        self.cooldown_s = cooldown_s
        self.half_open_probes = half_open_probes
        self._consecutive_failures = 0
        self._open_until: float | None = None  # None: closed; else open/half-open by clock
        self._probes_in_flight = 0
        self.observer: Callable[[BreakerChange], None] | None = None

    @classmethod
    def from_config(cls, name: str, config: BreakerSettings) -> CircuitBreaker:
        return cls(name, failure_threshold=config.failure_threshold,
                   cooldown_s=config.cooldown, half_open_probes=config.half_open_probes)

    def __repr__(self) -> str:
        return (f"CircuitBreaker({self.name!r}, consecutive_failures="
                f"{self._consecutive_failures}, open_until={self._open_until!r}, "
                f"probes_in_flight={self._probes_in_flight}, failure_threshold="
                f"{self.failure_threshold}, cooldown_s={self.cooldown_s}, "
                f"half_open_probes={self.half_open_probes})")

    # -- reading ---------------------------------------------------------------------

    def state(self, now: float) -> BreakerState:
        """Derived, never stored: open until `_open_until`, half-open from then on until
        an outcome closes or reopens it."""
        if self._open_until is None:
            return BreakerState.CLOSED
        if now < self._open_until:
            return BreakerState.OPEN
        return BreakerState.HALF_OPEN

    def open_for(self, now: float) -> float | None:
        """Seconds until an open breaker lets a probe through; None unless it is open."""
        if self.state(now) is not BreakerState.OPEN or self._open_until is None:
            return None
        return self._open_until - now

    @property
    def consecutive_failures(self) -> int:
        return self._consecutive_failures

    @property
    def probes_in_flight(self) -> int:
        return self._probes_in_flight

    def snapshot(self, now: float) -> dict[str, Any]:
        """For status output: JSON-able, `open_until_in_s` is None unless open."""
        state = self.state(now)
        open_in = (self._open_until - now
                   if state is BreakerState.OPEN and self._open_until is not None else None)
        return {"name": self.name, "state": state.value,
                "consecutive_failures": self._consecutive_failures,
                "open_until_in_s": open_in, "probes_in_flight": self._probes_in_flight}

    # -- admission -------------------------------------------------------------------

    def try_acquire(self, now: float) -> bool:
        """May a call go to the peer now? Closed: yes. Open: no. Half-open: while fewer
        than `half_open_probes` probes are in flight (this call becomes one)."""
        if self._open_until is None:  # closed (`state`, without its call: every step)
            return True
        state = self.state(now)
        if state is BreakerState.CLOSED:
            return True
        if state is BreakerState.OPEN:
            return False
        if self._probes_in_flight < self.half_open_probes:
            self._probes_in_flight += 1
            return True
        return False

    # -- outcomes --------------------------------------------------------------------

    def record_success(self, now: float) -> None:
        if self._open_until is None and not self._consecutive_failures:
            return  # closed with no streak: the table's RESET_STREAK changes nothing
        self._report(now, _Outcome.SUCCESS, None)

    def record_failure(self, now: float, failure_class: FailureClass,
                       retry_after_s: float | None = None) -> None:
        """A retryable or unknown failure counts towards opening; a deterministic one
        means the peer answered (see the module docstring)."""
        outcome = (_Outcome.ANSWERED if failure_class is FailureClass.DETERMINISTIC
                   else _Outcome.FAILURE)
        self._report(now, outcome, retry_after_s)

    def release(self, now: float) -> None:
        """The acquired call was abandoned (cancelled): free its probe slot, if any."""
        self._report(now, _Outcome.RELEASED, None)

    def _report(self, now: float, outcome: _Outcome, retry_after_s: float | None) -> None:
        state = self.state(now)
        if state is not BreakerState.CLOSED and self._probes_in_flight > 0:
            self._probes_in_flight -= 1
        action = _TRANSITIONS[state, outcome]
        if action in (_Action.RESET_STREAK, _Action.CLOSE):
            if self._consecutive_failures:
                self._tell(ChangeKind.RESET)
            self._consecutive_failures = 0
            if action is _Action.CLOSE:
                self._open_until = None
                self._probes_in_flight = 0
        elif action is _Action.COUNT_FAILURE:
            self._consecutive_failures += 1
            self._tell(ChangeKind.FAILURE)
            if self._consecutive_failures >= self.failure_threshold:
                self._open(now, retry_after_s)
        elif action is _Action.REOPEN:
            self._consecutive_failures += 1
            self._tell(ChangeKind.FAILURE)
            self._open(now, retry_after_s)

    def _tell(self, kind: ChangeKind, open_for_s: float | None = None) -> None:
        if self.observer is not None:
            self.observer(BreakerChange(self.name, kind, open_for_s))

    def _open(self, now: float, retry_after_s: float | None) -> None:
        """Open for ``max(cooldown_s, retry_after_s or 0)`` seconds from `now`."""
        wait = max(self.cooldown_s, retry_after_s or 0.0)
        self._open_until = now + wait if math.isfinite(wait) else math.inf
        self._tell(ChangeKind.OPENED, wait)

    def share_streak(self, failures: int, now: float) -> None:
        """The fleet's streak, as the store holds it after this node's failures were
        added: a closed breaker counts on from it. Not told to the observer: it is not
        this node's change."""
        if self.state(now) is BreakerState.CLOSED and failures >= 0:
            self._consecutive_failures = failures

    def open_from_peer(self, now: float, for_s: float) -> bool:
        """Another daemon sharing the work found the peer down: open for `for_s` seconds
        from `now`, unless already open at least that long. True when it changed."""
        until = now + for_s
        if self._open_until is not None and self._open_until >= until:
            return False
        self._open_until = until
        return True

    # -- reload ----------------------------------------------------------------------

    def reconfigure(self, *, failure_threshold: int | None = None,
                    cooldown_s: float | None = None,
                    half_open_probes: int | None = None) -> None:
        """New limits for a breaker a reload keeps (None: unchanged). The current state,
        streak and open period carry over; a streak already past a lowered threshold
        opens the breaker at the next failure, not retroactively."""
        new_threshold = self.failure_threshold if failure_threshold is None else failure_threshold
        new_cooldown = self.cooldown_s if cooldown_s is None else cooldown_s
        new_probes = self.half_open_probes if half_open_probes is None else half_open_probes
        _check(new_threshold, new_cooldown, new_probes)
        self.failure_threshold = new_threshold
        self.cooldown_s = new_cooldown
        self.half_open_probes = new_probes
