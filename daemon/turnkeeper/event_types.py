"""The catalogue of events: one slotted dataclass per event type the daemon publishes.

An event on the wire (the NDJSON streams, the store) is a flat JSON object: the envelope
(`seq`, `ts`, `turn`, `type`) and the fields of its type. Each class here names its wire
`type` and its fields, so a publisher cannot misspell one and a reader (metrics, the
CLI, the live follow view) dispatches on a class instead of re-reading strings.

Readers must survive another daemon version: `from_json` keeps fields it does not know
in `extra` (and `to_json` writes them back), and `parse` answers None for a type it does
not know or a body it cannot read, so the caller shows it generically instead of
crashing. Two wire names are Python keywords (`class`, `from`): their attributes are
`class_` and `from_`, and the JSON keeps the wire names.

An event is treated as a value: nothing in the daemon changes one once built, by
convention, not enforcement. The classes are not frozen dataclasses because a frozen
one's `__init__` sets each field through `object.__setattr__`, twice the cost of building
a plain one, and a step builds five.

Imported by the CLI, so it imports only the standard library (no anyio, pydantic...).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, cast

ENVELOPE = ("seq", "ts", "turn", "type")

# Attribute name -> wire name, for the fields whose wire name is a Python keyword.
_WIRE = {"class_": "class", "from_": "from"}
# Fields written only when set: `tool.result` carries a different set for each outcome.
_OPTIONAL = "optional"
_OMIT_NONE = {_OPTIONAL: True}


@dataclass(slots=True, kw_only=True)
class EventBody:
    """The fields of one event, without its envelope. Subclasses set `TYPE`."""

    TYPE = ""
    # Fields a newer sender wrote that this version does not know (None: there were none).
    extra: dict[str, Any] | None = field(default=None, compare=False, repr=False)

    def to_json(self) -> dict[str, Any]:
        """The wire fields (without `type`), unknown ones kept from `from_json` last."""
        cls = type(self)
        writer = _TO_JSON.get(cls)
        if writer is None:
            writer = _TO_JSON[cls] = _to_json_of(cls)
        return writer(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> EventBody:
        """The event from its wire fields (the envelope keys are ignored). Fields this
        version does not know go to `extra`; one it expects and the sender did not write
        (an older daemon) takes its default, or None: a reader must not crash on it."""
        known: dict[str, Any] = {}
        spec = _spec(cls)
        for name, wire, _optional, required in spec:
            if wire in data:
                known[name] = data[wire]
            elif required:
                known[name] = None
        wire_names = {wire for _name, wire, _optional, _required in spec}
        extra = {k: v for k, v in data.items() if k not in wire_names and k not in ENVELOPE}
        return cls(**known, extra=extra or None)


# Per class: (attribute, wire name, written only when set, has no default), computed once;
# `dataclasses.fields()` on every event was a measurable part of a step.
_SPECS: dict[type[EventBody], tuple[tuple[str, str, bool, bool], ...]] = {}


def _spec(cls: type[EventBody]) -> tuple[tuple[str, str, bool, bool], ...]:
    spec = _SPECS.get(cls)
    if spec is None:
        spec = _SPECS[cls] = tuple(
            (f.name, _WIRE.get(f.name, f.name), bool(f.metadata.get(_OPTIONAL)),
             f.default is MISSING and f.default_factory is MISSING)
            for f in fields(cls) if f.name != "extra")
    return spec


# Per class: its `to_json`, written out field by field the first time an event of the
# class is encoded. A loop over the fields with `getattr` cost 1.0 us for `tool.result`,
# the function 0.3; the CLI, which imports this module to read events, never builds one.
_TO_JSON: dict[type[EventBody], Callable[[Any], dict[str, Any]]] = {}


def _to_json_of(cls: type[EventBody]) -> Callable[[Any], dict[str, Any]]:
    """`to_json` for `cls`: the fields always written in one dict display, then each
    optional one when set, then `extra`. Its source is built from the class's own field
    names (identifiers) and wire names (written with `repr`), nothing from outside."""
    spec = _spec(cls)
    always = ", ".join(f"{wire!r}: self.{name}" for name, wire, optional, _ in spec
                       if not optional)
    lines = ["def to_json(self):", f"    out = {{{always}}}"]
    for name, wire, optional, _ in spec:
        if optional:
            lines += [f"    if self.{name} is not None:", f"        out[{wire!r}] = self.{name}"]
    lines += ["    if self.extra:", "        out.update(self.extra)", "    return out"]
    namespace: dict[str, Any] = {}
    exec("\n".join(lines), namespace)
    return cast(Callable[[Any], dict[str, Any]], namespace["to_json"])


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
    outcome: str | None = field(default=None, metadata=_OMIT_NONE)
    content: str | None = field(default=None, metadata=_OMIT_NONE)
    state: Any = field(default=None, metadata=_OMIT_NONE)
    class_: str | None = field(default=None, metadata=_OMIT_NONE)
    error: str | None = field(default=None, metadata=_OMIT_NONE)
    failure_streak: int | None = field(default=None, metadata=_OMIT_NONE)
    limit: int | None = field(default=None, metadata=_OMIT_NONE)


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
    timeout_at: float | None = field(default=None, metadata=_OMIT_NONE)


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
    reason: str | None = field(default=None, metadata=_OMIT_NONE)


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


# -- the daemon ---------------------------------------------------------------------------

@dataclass(slots=True, kw_only=True)
class DaemonReloading(EventBody):
    TYPE = "daemon.reloading"
    trigger: str
    policy_version: int


@dataclass(slots=True, kw_only=True)
class DaemonReloadFailed(EventBody):
    TYPE = "daemon.reload_failed"
    trigger: str
    error: str
    policy_version: int


@dataclass(slots=True, kw_only=True)
class DaemonReloaded(EventBody):
    TYPE = "daemon.reloaded"
    trigger: str
    policy_version: int
    content_hash: str | None
    pending_restart: list[str]
    duration_s: float
    resumed: int
    unchanged: bool = False  # the running policy again: no drain, no new version


@dataclass(slots=True, kw_only=True)
class DaemonStopping(EventBody):
    TYPE = "daemon.stopping"
    running: int
    parked: int
    queued: int


# -- webhooks -----------------------------------------------------------------------------

@dataclass(slots=True, kw_only=True)
class WebhookFailed(EventBody):
    """A webhook delivery given up for good: the receiver refused it, its attempts ran
    out, or the webhook's outbox was full. It stays in the outbox as failed."""

    TYPE = "webhook.failed"
    webhook: str
    webhook_id: str  # the delivery's `webhook-id` header
    event_seq: int
    event_type: str
    attempts: int
    error: str


EVENT_TYPES: dict[str, type[EventBody]] = {cls.TYPE: cls for cls in (
    TurnQueued, TurnStarted, TurnResumed, TurnAgentRemoved, TurnSuspended, TurnRecovering,
    TurnWaiting,
    TurnMessage, TurnFinished, TurnReplayed, StepStarted, BudgetWarning, BudgetExtended,
    GuardWouldStop,
    LoopWarning,
    ModelQueued, ModelRequest, ModelDelta, ModelResponse, ModelAttemptFailed,
    ModelRetryScheduled,
    ModelFailover, ModelRedirected, ToolCalled, ToolResult, ToolRetryScheduled,
    ToolOutcomeUnknown, ToolApprovalRequested, ToolApprovalDecided,
    DaemonReloading, DaemonReloadFailed, DaemonReloaded, DaemonStopping, WebhookFailed)}


def parse(event: dict[str, Any]) -> EventBody | None:
    """The typed body of a wire event (envelope included or not); None for a type this
    version does not know, which the caller shows generically."""
    cls = EVENT_TYPES.get(str(event.get("type")))
    return None if cls is None else cls.from_json(event)
