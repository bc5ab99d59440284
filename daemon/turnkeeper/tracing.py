"""The tracer a turn reports its spans to: a turn (`invoke_agent`), each model attempt
(`chat`) and each tool attempt (`execute_tool`).

Tracing is an edge. The turn asks the tracer it was given (`Shared.tracer`) at the few
places that already mark a turn's start and end, a model attempt and a tool attempt, and
never looks at what it answers but for the `traceparent` to send on. By default that
tracer is `NOOP`: its methods do nothing and allocate nothing on a step (a model or tool
attempt's span is its turn's span, handed back), and nothing of OpenTelemetry is
imported. `[tracing] enabled = true` makes the daemon build the OpenTelemetry tracer
(`turnkeeper/otel.py`, imported only then) in its place.

With tracing off, a traceparent submitted with a turn is still kept with it and passed on
unchanged to the providers and tools the turn calls (the trace stays connected through a
daemon that does not record spans itself); a turn submitted without one sends none.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from turnkeeper.config import Config
    from turnkeeper.policy.classify import CallFailure
    from turnkeeper.policy.outcome import TurnResult
    from turnkeeper.providers.base import ModelReply, ModelRequest
    from turnkeeper.tools.outcome import ToolOutcome


class Span:
    """A span as the turn holds it: only the `traceparent` the requests made under it
    carry (None: none is sent). The OpenTelemetry tracer's spans subclass it."""

    __slots__ = ("traceparent",)

    def __init__(self, traceparent: str | None = None) -> None:
        self.traceparent = traceparent


class _Counted(Protocol):
    def to_json(self) -> dict[str, int]: ...


class _Spent(Protocol):
    @property
    def input_tokens(self) -> int: ...
    @property
    def output_tokens(self) -> int: ...
    @property
    def cost_usd(self) -> float: ...


class TracedTurn(Protocol):
    """What a tracer reads of a turn (a `turn.record.TurnRecord` is one, named so that
    this room need not import the turn's): its identity, its message and agent, the trace it
    belongs to (a tracer that starts one records it here), its counters and spending."""

    traceparent: str | None

    @property
    def id(self) -> str: ...
    @property
    def session(self) -> str: ...
    @property
    def message(self) -> str: ...
    @property
    def agent(self) -> str | None: ...
    @property
    def policy_version(self) -> int: ...
    @property
    def counters(self) -> _Counted: ...
    @property
    def usage(self) -> _Spent: ...


# The span of a turn with no trace context and tracing off: nothing to send.
NO_SPAN = Span()


class Tracer:
    """The no-op tracer, and the interface of a real one. A model or tool attempt's span
    is its turn's span: what the turn sends on is the submitted traceparent, if any.

    `enabled` False (this no-op tracer): the model and tool attempts do not call their
    hooks at all (`chat`, `chat_ended`, `tool`, `tool_ended`) and send the turn's span's
    traceparent, as these would have answered. A real tracer says True."""

    enabled = False

    def turn(self, record: TracedTurn, *, resumed: bool) -> Span:
        """The span of the turn's run in this process, from its start or resume to its
        result or suspension (a resumed turn is a new segment of the same trace)."""
        tp = record.traceparent
        return NO_SPAN if tp is None else Span(tp)

    def turn_ended(self, span: Span, record: TracedTurn, result: TurnResult | None) -> None:
        """The turn's run here ended: with its result, or suspended (None)."""

    def chat(self, turn: Span, *, provider: str, attempt: int, config: Config) -> Span:
        """A model attempt on `provider` (named in `config`), about to be sent."""
        return turn

    def chat_ended(self, span: Span, request: ModelRequest, reply: ModelReply | None,
                   failure: CallFailure | None) -> None:
        """The attempt's reply, or its failure, or neither (cut: a steer, a stop)."""

    def tool(self, turn: Span, *, tool: str, call_id: str, key: str, attempt: int,
             arguments: dict[str, Any]) -> Span:
        return turn

    def tool_ended(self, span: Span, outcome: ToolOutcome | None) -> None:
        """None: the attempt did not end with an outcome (cancelled, or a bug)."""

    async def aclose(self) -> None:
        """Send what is left and stop (the daemon's stop)."""


NOOP = Tracer()
