"""The events of a turn's course, published by the turn and the supervisor that runs
it: queued, started, parked, resumed, finished, each step; and its guards' warnings,
would-be stops and extensions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from turnkeeper.event_types.body import EventBody

# -- turns --------------------------------------------------------------------------------

@dataclass(slots=True, kw_only=True)
class TurnQueued(EventBody):
    TYPE = "turn.queued"
    session: str
    message: str
    policy_version: int


@dataclass(slots=True, kw_only=True)
class TurnStarted(EventBody):
    TYPE = "turn.started"
    policy_version: int
    provider: str | None


@dataclass(slots=True, kw_only=True)
class TurnResumed(EventBody):
    TYPE = "turn.resumed"
    state: str
    step: int
    policy_version: int


@dataclass(slots=True, kw_only=True)
class TurnAgentRemoved(EventBody):
    """The agent a turn was submitted as is not in the policy it resumed under (a reload
    removed it): the turn goes on as the default agent (`[agent]`)."""

    TYPE = "turn.agent_removed"
    agent: str
    policy_version: int


@dataclass(slots=True, kw_only=True)
class TurnSuspended(EventBody):
    TYPE = "turn.suspended"
    step: int


@dataclass(slots=True, kw_only=True)
class TurnRecovering(EventBody):
    TYPE = "turn.recovering"
    cycle: int
    of: int
    wait: float
    next_attempt_at: float | None
    # What set the wait: "schedule" (recovery_schedule), "retry_after" (a provider's
    # Retry-After), "breaker" (no provider could be asked until a circuit breaker lets a
    # probe through); `reason` says it in words, with the schedule's wait when stretched.
    waits_for: str = "schedule"
    reason: str = ""


@dataclass(slots=True, kw_only=True)
class TurnWaiting(EventBody):
    TYPE = "turn.waiting"
    question: str
    timeout_at: float | None


@dataclass(slots=True, kw_only=True)
class TurnMessage(EventBody):
    TYPE = "turn.message"
    kind: str  # steer | answer
    text: str
    redirect: bool


@dataclass(slots=True, kw_only=True)
class TurnFinished(EventBody):
    TYPE = "turn.finished"
    result: dict[str, Any]


@dataclass(slots=True, kw_only=True)
class TurnReplayed(EventBody):
    """A dead letter put back in the queue: it resumes from its last checkpoint, same
    turn, same journal. `previous` is the result it had, kept on the record too."""

    TYPE = "turn.replayed"
    previous: dict[str, Any]
    policy_version: int


@dataclass(slots=True, kw_only=True)
class StepStarted(EventBody):
    TYPE = "step.started"
    step: int
    provider: str | None


# -- guards -------------------------------------------------------------------------------

@dataclass(slots=True, kw_only=True)
class BudgetWarning(EventBody):
    """A budget dimension crossed its warning fraction; carries the turn's counters."""

    TYPE = "budget.warning"
    dimensions: list[str]
    message: str
    mode: str
    provider_attempts: int = 0
    fallback_hops: int = 0
    restarts: int = 0
    recovery_cycles: int = 0
    steps: int = 0
    tool_attempts: int = 0
    output_attempts: int = 0
    tokens: int = 0
    seconds: float = 0.0
    cost_usd: float = 0.0


@dataclass(slots=True, kw_only=True)
class GuardWouldStop(EventBody):
    """A guard in `warn` or `observe` mode would have stopped the turn here."""

    TYPE = "guard.would_stop"
    code: str
    counter: str | None
    value: float | None
    limit: float | None
    step: int
    mode: str
    message: str


@dataclass(slots=True, kw_only=True)
class BudgetExtended(EventBody):
    """A turn reached its step or time limit while still making progress and was given
    more: `number` of `of` extensions, the limits now in force."""

    TYPE = "budget.extended"
    number: int
    of: int
    reason: str
    added_steps: int
    added_seconds: float
    max_steps: int
    max_seconds: float
    step: int
    last_progress_step: int


@dataclass(slots=True, kw_only=True)
class LoopWarning(EventBody):
    TYPE = "loop.warning"
    code: str
    count: int
    limit: int
    tool: str

