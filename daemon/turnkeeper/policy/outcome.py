"""Stop codes, the counter each one names, and the one result every turn ends with.

The set of codes is closed: a stop that does not fit one of these is a bug, reported as
`internal`, never as a generic loop error.
"""

from __future__ import annotations

from dataclasses import field
from enum import StrEnum
from typing import Any

from turnkeeper.values import value_class


class Status(StrEnum):
    COMPLETED = "completed"
    BLOCKED = "blocked"
    PARTIAL = "partial"
    FAILED = "failed"
    CANCELLED = "cancelled"


class StopCode(StrEnum):
    COMPLETED = "completed"
    BLOCKED = "blocked"
    BUDGET_TOKENS = "budget.tokens"
    BUDGET_SECONDS = "budget.seconds"
    BUDGET_STEPS = "budget.steps"
    BUDGET_COST = "budget.cost"
    BUDGET_WALL_SECONDS = "budget.wall_seconds"
    DEADLINE = "deadline"
    LOOP_REPEATED_ACTION = "loop.repeated_action"
    LOOP_STATE_CYCLE = "loop.state_cycle"
    LOOP_NO_PROGRESS = "loop.no_progress"
    FAILURE_DETERMINISTIC = "failure.deterministic"
    FAILURE_UNKNOWN = "failure.unknown"
    FAILURE_RETRYABLE = "failure.retryable"
    PROVIDERS_REJECTED = "providers.rejected"
    PROVIDERS_EXHAUSTED = "providers.exhausted"
    RESTARTS_EXHAUSTED = "restarts.exhausted"
    CONTEXT_EXHAUSTED = "context.exhausted"
    CLARIFY_TIMEOUT = "clarify.timeout"
    APPROVAL_TIMEOUT = "approval.timeout"
    MODEL_REFUSED = "model.refused"
    MODEL_TRUNCATED = "model.truncated"
    OUTPUT_INVALID = "output.invalid"
    CANCELLED = "cancelled"
    INTERNAL = "internal"


# The counter each stop code names. Codes that end a turn normally name none.
COUNTER_OF: dict[StopCode, str | None] = {
    StopCode.COMPLETED: None,
    StopCode.BLOCKED: None,
    StopCode.BUDGET_TOKENS: "tokens",
    StopCode.BUDGET_SECONDS: "seconds",
    StopCode.BUDGET_STEPS: "steps",
    StopCode.BUDGET_COST: "cost_usd",
    StopCode.BUDGET_WALL_SECONDS: "wall_seconds",
    StopCode.DEADLINE: "deadline",
    StopCode.LOOP_REPEATED_ACTION: "repeats",
    StopCode.LOOP_STATE_CYCLE: "state_revisits",
    StopCode.LOOP_NO_PROGRESS: "no_progress",
    StopCode.FAILURE_DETERMINISTIC: "failure_streak",
    StopCode.FAILURE_UNKNOWN: "failure_streak",
    StopCode.FAILURE_RETRYABLE: "failure_streak",
    StopCode.PROVIDERS_REJECTED: "fallback_hops",
    StopCode.PROVIDERS_EXHAUSTED: "recovery_cycles",
    StopCode.RESTARTS_EXHAUSTED: "restarts",
    StopCode.CONTEXT_EXHAUSTED: "context_tokens",
    StopCode.CLARIFY_TIMEOUT: "clarify_seconds",
    # The oldest pending call's wait for a person's decision, against `[approvals] timeout`.
    StopCode.APPROVAL_TIMEOUT: "approval_seconds",
    # The model (or its provider's filter) declined: no counter reached a limit, and no
    # retry inside the turn would change the answer, so it names none.
    StopCode.MODEL_REFUSED: None,
    # The answer was cut by the output cap: the reply's output tokens against the cap sent.
    StopCode.MODEL_TRUNCATED: "output_tokens",
    # The final answers checked against the output schema, this last failing one
    # included, against `max_output_attempts`.
    StopCode.OUTPUT_INVALID: "output_attempts",
    StopCode.CANCELLED: None,
    StopCode.INTERNAL: None,
}

# The guard family each guard stop belongs to; a family's `mode` (enforce / warn /
# observe) decides whether its stops end the turn. Codes not listed always end it.
GUARD_FAMILY: dict[StopCode, str] = {
    StopCode.BUDGET_TOKENS: "budget",
    StopCode.BUDGET_SECONDS: "budget",
    StopCode.BUDGET_COST: "budget",
    StopCode.LOOP_REPEATED_ACTION: "loop_detection",
    StopCode.LOOP_STATE_CYCLE: "loop_detection",
    StopCode.LOOP_NO_PROGRESS: "loop_detection",
    StopCode.FAILURE_DETERMINISTIC: "failure_loop",
    StopCode.FAILURE_UNKNOWN: "failure_loop",
    StopCode.FAILURE_RETRYABLE: "failure_loop",
}
# `budget.steps` (the backstop), `budget.wall_seconds` and `deadline` are in no family:
# no mode can make a turn endless.

# Codes whose turns go to the dead-letter list: the turns that stopped for a reason no
# retry inside the turn could fix (every provider refused or stayed down, a tool that
# fails the same way every time, a model that declined the task, an answer that never
# matched its output schema, or a bug), and that an
# operator may replay, from their last checkpoint, once the cause is dealt with.
# `goes_to_dead_letters` is the rule; the stores build their dead-letter query from this
# same set.
DEAD_LETTER_CODES = frozenset({StopCode.PROVIDERS_REJECTED, StopCode.PROVIDERS_EXHAUSTED,
                               StopCode.FAILURE_DETERMINISTIC, StopCode.MODEL_REFUSED,
                               StopCode.OUTPUT_INVALID, StopCode.INTERNAL})


def status_of(code: StopCode) -> Status:
    """`completed`, `blocked` and `cancelled` map to themselves; `providers.rejected`,
    `model.refused`, `output.invalid` (no answer the caller can use) and `internal` fail
    the turn; every other code returns partial work."""
    if code is StopCode.COMPLETED:
        return Status.COMPLETED
    if code is StopCode.BLOCKED:
        return Status.BLOCKED
    if code is StopCode.CANCELLED:
        return Status.CANCELLED
    if code in (StopCode.PROVIDERS_REJECTED, StopCode.MODEL_REFUSED, StopCode.OUTPUT_INVALID,
                StopCode.INTERNAL):
        return Status.FAILED
    return Status.PARTIAL


@value_class
class Stop:
    """A decision to end the turn: which code, which counter, its value and its limit.
    `last_error` (for the provider stops) is each provider's last failure, one line, so
    the result says why without a look at the daemon's log. `base_limit` is set when the
    limit reached was extended for progress: the limit the turn started with."""

    code: StopCode
    message: str
    value: float | int | None = None
    limit: float | int | None = None
    last_error: dict[str, str] | None = field(default=None, compare=False)
    base_limit: float | int | None = None

    @property
    def counter(self) -> str | None:
        return COUNTER_OF[self.code]

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"code": self.code.value, "counter": self.counter,
                               "value": self.value, "limit": self.limit,
                               "message": self.message}
        if self.last_error is not None:
            out["last_error"] = dict(self.last_error)
        if self.base_limit is not None:
            out["base_limit"] = self.base_limit
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Stop:
        last = data.get("last_error")
        return cls(code=StopCode(data["code"]), message=data.get("message", ""),
                   value=data.get("value"), limit=data.get("limit"),
                   last_error=dict(last) if isinstance(last, dict) else None,
                   base_limit=data.get("base_limit"))


@value_class
class TurnResult:
    """The one result a turn ends with. Never an exception."""

    stopped_because: Stop
    answer: str | None = None
    partial: tuple[str, ...] = ()
    open_issues: tuple[str, ...] = ()
    error_id: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def status(self) -> Status:
        return status_of(self.stopped_because.code)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "status": self.status.value,
            "stopped_because": self.stopped_because.to_json(),
            "answer": self.answer,
            "partial": list(self.partial),
            "open_issues": list(self.open_issues),
        }
        if self.error_id is not None:
            out["error_id"] = self.error_id
        out.update(self.extra)
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TurnResult:
        known = {"status", "stopped_because", "answer", "partial", "open_issues", "error_id"}
        return cls(stopped_because=Stop.from_json(data["stopped_because"]),
                   answer=data.get("answer"), partial=tuple(data.get("partial", ())),
                   open_issues=tuple(data.get("open_issues", ())),
                   error_id=data.get("error_id"),
                   extra={k: v for k, v in data.items() if k not in known})


def goes_to_dead_letters(outcome: Stop | TurnResult | dict[str, Any] | None) -> bool:
    """Whether a turn that ended so is a dead letter: listed for an operator, and the only
    kind of turn a replay accepts. Takes the stop, the result, or a stored result's JSON
    (None, a turn with no result, is not one)."""
    if outcome is None:
        return False
    if isinstance(outcome, TurnResult):
        return outcome.stopped_because.code in DEAD_LETTER_CODES
    if isinstance(outcome, Stop):
        return outcome.code in DEAD_LETTER_CODES
    code = (outcome.get("stopped_because") or {}).get("code")
    return code in DEAD_LETTER_CODES
