"""The bodies the control API accepts, as strict pydantic models.

Strict because the daemon once took `"max_steps": "5"` and `true` as numbers, and a
`"deadline": Infinity` queued a turn that never ran: a number is a JSON number, finite,
never a string or a boolean; an unknown field is an error, not ignored.
"""

from __future__ import annotations

import math
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator

from turnkeeper.durations import parse_duration
from turnkeeper.policy.output import schema_problem
from turnkeeper.tracecontext import MAX_LENGTH, PATTERN, traceparent_problem


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


StrictFiniteFloat = Annotated[float, Field(strict=True, allow_inf_nan=False)]


class BudgetOverride(Body):
    max_tokens: Annotated[StrictInt, Field(gt=0)] | None = None
    max_seconds: Annotated[StrictFiniteFloat, Field(gt=0)] | None = None
    max_steps: Annotated[StrictInt, Field(gt=0)] | None = None
    max_cost_usd: Annotated[StrictFiniteFloat, Field(ge=0)] | None = None
    # Every second from the turn's first start, waits included; 0 = off for this turn.
    max_wall_seconds: Annotated[StrictFiniteFloat, Field(ge=0)] | None = None


class SubmitBody(Body):
    message: Annotated[str, Field(min_length=1, max_length=512 * 1024)]
    session: Annotated[str, Field(min_length=1, max_length=200,
                                  pattern=r"^[A-Za-z0-9_.:\-]+$")] | None = None
    budget: BudgetOverride | None = None
    deadline: float | datetime | None = None
    profile: Annotated[str, Field(min_length=1, max_length=64)] | None = None
    model: Annotated[str, Field(min_length=1, max_length=64)] | None = None
    # A named agent (`[agents.NAME]`): its system prompt, tools, model and profile.
    agent: Annotated[str, Field(min_length=1, max_length=64)] | None = None
    # The same key with the same body within `[daemon] idempotency_window` answers the
    # turn it made (200); also the `Idempotency-Key` header.
    idempotency_key: Annotated[str, Field(min_length=1, max_length=255,
                                          pattern=r"^[ -~]+$")] | None = None
    # W3C trace context: the turn's spans (and the requests it makes) join the caller's
    # trace; also the `traceparent` header.
    traceparent: Annotated[str, Field(max_length=MAX_LENGTH, pattern=PATTERN)] | None = None

    @field_validator("traceparent")
    @classmethod
    def _traceparent(cls, v: str | None) -> str | None:
        if v is not None:
            problem = traceparent_problem(v)
            if problem is not None:
                raise ValueError(problem)
        return v

    # A JSON Schema the final answer must match: the result then carries it parsed as
    # `output`. It wins over the agent's.
    output_schema: dict[str, Any] | None = None

    @field_validator("output_schema")
    @classmethod
    def _json_schema(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        """A schema its metaschema accepts (its `$schema`'s draft, else 2020-12)."""
        if v is not None:
            problem = schema_problem(v)
            if problem is not None:
                raise ValueError(problem)
        return v

    @field_validator("deadline", mode="before")
    @classmethod
    def _epoch(cls, v: Any) -> float | datetime | None:
        """Epoch seconds as a JSON number, or an ISO 8601 string with a zone; nothing
        else (pydantic would read "5" as a timestamp and `true` as 1)."""
        if v is None:
            return None
        if isinstance(v, bool):
            raise ValueError("must be a number of epoch seconds or an ISO 8601 time")
        if isinstance(v, (int, float)):
            if not math.isfinite(v):
                raise ValueError("must be a finite number")
            return float(v)
        if isinstance(v, str):
            try:
                when = datetime.fromisoformat(v)
            except ValueError:
                raise ValueError("must be an ISO 8601 time such as "
                                 "2026-12-01T10:00:00Z") from None
            if when.tzinfo is None:
                raise ValueError("needs a time zone (e.g. 2026-12-01T10:00:00Z)")
            return when
        raise ValueError("must be a number of epoch seconds or an ISO 8601 time")

    def deadline_epoch(self) -> float | None:
        if isinstance(self.deadline, datetime):
            return self.deadline.timestamp()
        return self.deadline


class MessageBody(Body):
    kind: Literal["steer", "answer"]
    text: Annotated[str, Field(min_length=1, max_length=512 * 1024)]
    redirect: StrictBool = False




class ApprovalBody(Body):
    """A person's decision on a tool call the turn holds for approval. `arguments`
    (approve only) replaces the call's arguments before it runs; they must satisfy the
    tool's input schema. `reason` (deny) is what the agent reads."""

    call_id: Annotated[str, Field(min_length=1, max_length=200)]
    decision: Literal["approve", "deny"]
    reason: Annotated[str, Field(max_length=64 * 1024)] = ""
    arguments: dict[str, Any] | None = None


class CancelBody(Body):
    """Optional: an empty body is a plain cancel (a side effect in flight finishes)."""

    now: StrictBool = False


class IntakeBody(Body):
    """`{"open": false}` pauses the start of queued turns, `{"open": true}` resumes it."""

    open: StrictBool


class PruneBody(Body):
    """`{"older_than": "7d"}` deletes the turns that finished more than that ago;
    `"dead_letters": true` takes the dead letters among them too."""

    older_than: Annotated[str, Field(min_length=1, max_length=32)]
    dead_letters: StrictBool = False

    @field_validator("older_than")
    @classmethod
    def _duration(cls, v: str) -> str:
        parse_duration(v)
        return v
