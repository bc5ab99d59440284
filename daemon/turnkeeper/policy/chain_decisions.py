"""The decisions the provider chain hands out, its phases and its error: the vocabulary
a caller of `ProviderChain` (policy/chain.py) reads, kept apart from the state machine
that produces them so each stays a size one can read at once."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal, get_args

from turnkeeper.errors import TurnkeeperError
from turnkeeper.policy.classify import FailureClass
from turnkeeper.policy.outcome import Stop
from turnkeeper.values import value_class

FailOverReason = Literal["deterministic", "attempts_spent", "retry_after_too_long",
                         "retry_budget", "breaker_open", "retry_after", "no_time"]
REASONS: frozenset[str] = frozenset(get_args(FailOverReason))
# What a recovery wait lasts for: the schedule, a Retry-After a provider answered in the
# pass, or (when no provider of the pass could be asked at all) the first circuit
# breaker to let a probe through, or the first remembered Retry-After window to pass.
WaitsFor = Literal["schedule", "retry_after", "breaker"]

# -- decisions out ---------------------------------------------------------------------

@value_class
class Attempt:
    """Call `provider` now. `attempt` is provider_attempts counting this one (1-based)."""

    provider: str
    attempt: int


@dataclass(frozen=True, slots=True)
class RetryIn:
    """Sleep `seconds`, then `retry_ready()` for attempt `attempt_next` on `provider`.
    Ask the provider's retry budget first: a refusal is `on_retry_refused()`."""

    provider: str
    seconds: float
    attempt_next: int
    failure_class: FailureClass
    retry_after_s: float | None = None


@dataclass(frozen=True, slots=True)
class FailOver:
    """Leave `from_provider` for `to_provider` (call `begin_call()` next). `reason` is one
    of FailOverReason."""

    from_provider: str
    to_provider: str
    reason: FailOverReason


@dataclass(frozen=True, slots=True)
class Recover:
    """The chain is exhausted: park the turn for `wait_s` (not active time), then
    `recovery_done()` starts pass `cycle` of `of_cycles` at the primary. `waits_for`
    says what set the wait (anything but "schedule" stretched it past the schedule's),
    `why` the same in words."""

    cycle: int
    of_cycles: int
    wait_s: float
    # What set the wait, read by the event; not part of the decision's identity.
    waits_for: WaitsFor = field(default="schedule", compare=False)
    why: str = field(default="", compare=False)


Decision = Attempt | RetryIn | FailOver | Recover | Stop


# -- phases and errors ---------------------------------------------------------------

class ChainError(TurnkeeperError, RuntimeError):
    """An event the chain cannot take in its current phase: a bug in the caller."""

    def __init__(self, phase: str, event: str, detail: str = "") -> None:
        self.phase = phase
        self.event = event
        msg = f"provider chain: event {event!r} is not allowed in phase {phase!r}"
        super().__init__(f"{msg}: {detail}" if detail else msg)


class Phase(StrEnum):
    READY = "ready"  # no call outstanding: begin_call()
    ATTEMPTING = "attempting"  # an Attempt is outstanding
    BACKING_OFF = "backing_off"  # a RetryIn is outstanding
    RECOVERING = "recovering"  # a Recover is outstanding
    STOPPED = "stopped"  # a Stop was returned: terminal
    ERROR = "error"  # an illegal event poisoned the chain: terminal
