"""The live, mutable record of one turn: what `/v1/turns/{id}` shows and the store keeps.

Only the supervisor and the turn's own runner write it, both on the event loop."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from turnkeeper.policy import turn_state
from turnkeeper.policy.turn_state import TurnState

COUNTER_NAMES = ("provider_attempts", "fallback_hops", "restarts", "recovery_cycles", "steps",
                 "tool_attempts", "output_attempts")
# The states live with their transition table; the modules that have always taken these
# from the record get them here, as the plain strings a record and the store hold.
TERMINAL_STATES: frozenset[str] = frozenset(s.value for s in turn_state.TERMINAL_STATES)
LIVE_STATES: tuple[str, ...] = tuple(s.value for s in turn_state.LIVE_STATES)


@dataclass(slots=True)
class Counters:
    """The turn's named counters, one per concern (a provider attempt is not a restart,
    a restart not a recovery cycle). `tool_attempts` counts the attempts of the latest
    tool call; `output_attempts` the final answers checked against the turn's output
    schema (0 without one); the others are the turn's."""

    provider_attempts: int = 0
    fallback_hops: int = 0
    restarts: int = 0
    recovery_cycles: int = 0
    steps: int = 0
    tool_attempts: int = 0
    output_attempts: int = 0

    def to_json(self) -> dict[str, int]:
        return {"provider_attempts": self.provider_attempts,
                "fallback_hops": self.fallback_hops, "restarts": self.restarts,
                "recovery_cycles": self.recovery_cycles, "steps": self.steps,
                "tool_attempts": self.tool_attempts, "output_attempts": self.output_attempts}

    @classmethod
    def from_json(cls, d: dict[str, Any] | None) -> Counters:
        """Missing names are 0: a record written before a counter existed still loads."""
        d = d or {}
        return cls(**{name: int(d.get(name, 0)) for name in COUNTER_NAMES})


@dataclass(slots=True)
class TurnUsage:
    """What the turn has spent: tokens, active seconds (parked time excluded) and cost."""

    input_tokens: int = 0
    output_tokens: int = 0
    seconds: float = 0.0
    cost_usd: float = 0.0

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens

    def to_json(self) -> dict[str, Any]:
        return {"input_tokens": self.input_tokens, "output_tokens": self.output_tokens,
                "total_tokens": self.input_tokens + self.output_tokens,  # no property call
                "seconds": self.seconds,
                "cost_usd": self.cost_usd}

    @classmethod
    def from_json(cls, d: dict[str, Any] | None) -> TurnUsage:
        d = d or {}
        return cls(input_tokens=int(d.get("input_tokens", 0)),
                   output_tokens=int(d.get("output_tokens", 0)),
                   seconds=float(d.get("seconds", 0.0)), cost_usd=float(d.get("cost_usd", 0.0)))


@dataclass(slots=True)
class TurnRecord:
    id: str
    session: str
    message: str
    created_at: float
    updated_at: float
    state: str = TurnState.QUEUED.value
    policy_version: int = 0
    seq: int = 0
    budget: dict[str, Any] = field(default_factory=dict)
    deadline: float | None = None
    provider: str | None = None
    counters: Counters = field(default_factory=Counters)
    usage: TurnUsage = field(default_factory=TurnUsage)
    next_attempt_at: float | None = None
    question: str | None = None
    result: dict[str, Any] | None = None
    last_error: str | None = None
    replay_of: str | None = None
    # The results a replayed dead letter had before each replay, oldest first.
    previous_results: list[dict[str, Any]] = field(default_factory=list)
    inbox: list[dict[str, Any]] = field(default_factory=list)
    profile: str | None = None
    # The `model` the turn was submitted with (an alias or a provider's name); None for
    # the default chain.
    model: str | None = None
    # The named agent (`[agents.NAME]`) the turn runs as; None for the default agent.
    agent: str | None = None
    would_have_stopped: list[dict[str, Any]] = field(default_factory=list)
    # The effective budget limits (policy `[budget]` with the submit's overrides), set
    # when the turn starts; `active_since` (epoch) is set while its active time runs, so
    # a client can show live seconds against max_seconds.
    limits: dict[str, Any] = field(default_factory=dict)
    active_since: float | None = None
    # When the turn first started running (epoch): its wall-clock budget counts from
    # here, every second after it (parked, suspended, the daemon down) included.
    started_at: float | None = None
    # The W3C traceparent the turn's spans are children of: the caller's, submitted
    # with it, or (tracing on, none submitted) its first span's. Kept with the turn, so
    # a turn resumed after a restart or on another node continues the same trace.
    traceparent: str | None = None
    # The step's tool calls held for a person's approval, not decided yet: each
    # {call_id, tool, arguments, key, requested_at, timeout_at}. Kept with the record (as
    # a clarify question is) so a restart waits on, and any node can list them.
    pending_approvals: list[dict[str, Any]] = field(default_factory=list)
    # The JSON Schema the submit asked the final answer to match (None: the agent's,
    # if it has one; see `TurnSettings.output_schema_for`).
    output_schema: dict[str, Any] | None = None
    # Told of each move (`set_state`), before it, while the turn is in the supervisor's
    # memory: its index of turns by state. Not part of the record.
    on_move: Callable[[TurnRecord, str], None] | None = field(
        default=None, repr=False, compare=False)

    def set_state(self, state: str) -> None:
        """Move to `state` (checked against the table by the caller, `moved`): every write
        of `state` goes through here, so the supervisor's count of turns by state is
        never a recount."""
        if self.on_move is not None:
            self.on_move(self, state)
        self.state = state

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_STATES

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id, "session": self.session, "state": self.state,
            "policy_version": self.policy_version, "created_at": self.created_at,
            "updated_at": self.updated_at, "provider": self.provider,
            "counters": self.counters.to_json(), "usage": self.usage.to_json(),
            "message": self.message, "budget": dict(self.budget), "deadline": self.deadline,
            "result": self.result, "seq": self.seq,
        }
        if self.limits:
            out["limits"] = dict(self.limits)
        if self.active_since is not None:
            out["active_since"] = self.active_since
        if self.started_at is not None:
            out["started_at"] = self.started_at
        if self.next_attempt_at is not None:
            out["next_attempt_at"] = self.next_attempt_at
        if self.question is not None:
            out["question"] = self.question
        if self.last_error is not None:
            out["last_error"] = self.last_error
        if self.replay_of is not None:
            out["replay_of"] = self.replay_of
        if self.previous_results:
            out["previous_results"] = list(self.previous_results)
        if self.inbox:
            out["inbox"] = list(self.inbox)
        if self.traceparent is not None:
            out["traceparent"] = self.traceparent
        if self.pending_approvals:
            out["pending_approvals"] = [dict(p) for p in self.pending_approvals]
        out["profile"] = self.profile
        out["model"] = self.model
        out["agent"] = self.agent
        out["would_have_stopped"] = list(self.would_have_stopped)
        if self.output_schema is not None:
            out["output_schema"] = self.output_schema
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TurnRecord:
        return cls(
            id=d["id"], session=d["session"], message=d["message"],
            created_at=d["created_at"], updated_at=d["updated_at"], state=d["state"],
            policy_version=d.get("policy_version", 0), seq=d.get("seq", 0),
            budget=d.get("budget") or {}, deadline=d.get("deadline"),
            provider=d.get("provider"), counters=Counters.from_json(d.get("counters")),
            usage=TurnUsage.from_json(d.get("usage")),
            next_attempt_at=d.get("next_attempt_at"), question=d.get("question"),
            result=d.get("result"), last_error=d.get("last_error"),
            replay_of=d.get("replay_of"), inbox=list(d.get("inbox", [])),
            previous_results=list(d.get("previous_results") or []),
            profile=d.get("profile"), model=d.get("model"), agent=d.get("agent"),
            would_have_stopped=list(d.get("would_have_stopped", [])),
            limits=dict(d.get("limits") or {}), started_at=d.get("started_at"),
            traceparent=d.get("traceparent"),
            pending_approvals=[dict(p) for p in d.get("pending_approvals") or ()],
            output_schema=d.get("output_schema"))
