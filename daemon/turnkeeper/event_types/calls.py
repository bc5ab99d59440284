"""The events of the calls a turn makes: each model call (queued for a slot, its
attempts, retries, failover, its answer streamed and whole) and each tool call (called,
retried, held for approval, its result, an outcome nobody can vouch for)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from turnkeeper.event_types.body import OMIT_NONE, EventBody

# -- the model ----------------------------------------------------------------------------

@dataclass(slots=True, kw_only=True)
class ModelQueued(EventBody):
    """A model call waits for an in-flight slot of its provider: `limit` calls are in
    flight (the provider's max_in_flight, or its adaptive limit now), `waiting` wait."""

    TYPE = "model.queued"
    provider: str
    limit: int
    in_flight: int
    waiting: int


@dataclass(slots=True, kw_only=True)
class ModelRequest(EventBody):
    TYPE = "model.request"
    provider: str
    attempt: int
    step: int
    messages: int


@dataclass(slots=True, kw_only=True)
class ModelDelta(EventBody):
    """Streamed answer text: live only, never stored."""

    TYPE = "model.delta"
    text: str


@dataclass(slots=True, kw_only=True)
class ModelResponse(EventBody):
    TYPE = "model.response"
    provider: str
    usage: dict[str, int]
    cost_usd: float
    finish_reason: str | None
    tool_calls: int


@dataclass(slots=True, kw_only=True)
class ModelAttemptFailed(EventBody):
    """One attempt failed; `error` is its one-line cause, secrets redacted."""

    TYPE = "model.attempt_failed"
    provider: str
    attempt: int
    class_: str
    status: int | None
    error: str | None = None


@dataclass(slots=True, kw_only=True)
class ModelRetryScheduled(EventBody):
    TYPE = "model.retry_scheduled"
    provider: str
    attempt: int
    delay: float
    class_: str
    status: int | None
    retry_after: float | None


@dataclass(slots=True, kw_only=True)
class ModelFailover(EventBody):
    TYPE = "model.failover"
    from_: str
    to: str
    reason: str


@dataclass(slots=True, kw_only=True)
class ModelRedirected(EventBody):
    """A steer with redirect cut the in-flight call; the step restarts with it."""

    TYPE = "model.redirected"
    provider: str


# -- tools --------------------------------------------------------------------------------

@dataclass(slots=True, kw_only=True)
class ToolCalled(EventBody):
    TYPE = "tool.call"
    tool: str
    call_id: str
    key: str
    arguments: dict[str, Any]


@dataclass(slots=True, kw_only=True)
class ToolResult(EventBody):
    """`ok` is True (with `content`, `state`), False (with `class_`, `error`,
    `failure_streak`, `limit`) or None: the outcome is unknown (`outcome`)."""

    TYPE = "tool.result"
    tool: str
    call_id: str
    key: str | None  # None: nothing was sent (unknown tool, bad arguments, a refusal)
    ok: bool | None
    outcome: str | None = field(default=None, metadata=OMIT_NONE)
    content: str | None = field(default=None, metadata=OMIT_NONE)
    state: Any = field(default=None, metadata=OMIT_NONE)
    class_: str | None = field(default=None, metadata=OMIT_NONE)
    error: str | None = field(default=None, metadata=OMIT_NONE)
    failure_streak: int | None = field(default=None, metadata=OMIT_NONE)
    limit: int | None = field(default=None, metadata=OMIT_NONE)


@dataclass(slots=True, kw_only=True)
class ToolApprovalRequested(EventBody):
    """A call held for a person's decision (`[[tools]] approval`): not sent until it is
    approved. `key` is the Idempotency-Key it would be sent with; `timeout_at` when the
    wait ends without a decision (`[approvals] timeout`)."""

    TYPE = "tool.approval_requested"
    tool: str
    call_id: str
    key: str
    arguments: dict[str, Any]
    requested_at: float
    timeout_at: float | None = field(default=None, metadata=OMIT_NONE)


@dataclass(slots=True, kw_only=True)
class ToolApprovalDecided(EventBody):
    """A held call decided: `approve` (it runs once, with `arguments`, which differ from
    `requested_arguments` when the person edited them) or `deny` (it never runs; the
    agent reads the reason). `by` is `operator`, or `timeout` for `on_timeout = "deny"`."""

    TYPE = "tool.approval_decided"
    tool: str
    call_id: str
    decision: str
    by: str
    requested_arguments: dict[str, Any]
    arguments: dict[str, Any]
    waited_s: float
    reason: str | None = field(default=None, metadata=OMIT_NONE)


@dataclass(slots=True, kw_only=True)
class ToolRetryScheduled(EventBody):
    TYPE = "tool.retry_scheduled"
    tool: str
    key: str
    attempt: int
    delay: float
    class_: str
    status: int | None


@dataclass(slots=True, kw_only=True)
class ToolOutcomeUnknown(EventBody):
    """A non-idempotent call may have had its effect and no answer says whether: it is
    not retried, and stays an open issue of the turn until someone checks. `reason` says
    what cut it (a timeout, a reset after sending, cancel --now, a stop, a crash)."""

    TYPE = "tool.outcome_unknown"
    tool: str
    call_id: str
    key: str
    arguments: Any
    reason: str

