"""The catalogue of events: one slotted dataclass per event type the daemon publishes.

An event on the wire (the NDJSON streams, the store) is a flat JSON object: the envelope
(`seq`, `ts`, `turn`, `type`) and the fields of its type. Each class names its wire
`type` and its fields, so a publisher cannot misspell one and a reader (metrics, the
CLI, the live follow view) dispatches on a class instead of re-reading strings.

`body.py` holds what every event shares (the envelope, the wire JSON in and out); the
classes are grouped by what they tell of: a turn's course and its guards (`turns.py`),
the model and tool calls a turn makes (`calls.py`), the daemon itself (`daemon.py`).
Every class is named here, so `from turnkeeper import event_types as ev; ev.TurnFinished`
is the one way in; `EVENT_TYPES` and `parse` read a wire event back.

Imported by the CLI, so it imports only the standard library (no anyio, pydantic...).
"""

from __future__ import annotations

from typing import Any

from turnkeeper.event_types.body import ENVELOPE, EventBody
from turnkeeper.event_types.calls import (
    ModelAttemptFailed,
    ModelDelta,
    ModelFailover,
    ModelQueued,
    ModelRedirected,
    ModelRequest,
    ModelResponse,
    ModelRetryScheduled,
    ToolApprovalDecided,
    ToolApprovalRequested,
    ToolCalled,
    ToolOutcomeUnknown,
    ToolResult,
    ToolRetryScheduled,
)
from turnkeeper.event_types.daemon import (
    DaemonReloaded,
    DaemonReloadFailed,
    DaemonReloading,
    DaemonStopping,
    WebhookFailed,
)
from turnkeeper.event_types.turns import (
    BudgetExtended,
    BudgetWarning,
    GuardWouldStop,
    LoopWarning,
    StepStarted,
    TurnAgentRemoved,
    TurnFinished,
    TurnMessage,
    TurnQueued,
    TurnRecovering,
    TurnReplayed,
    TurnResumed,
    TurnStarted,
    TurnSuspended,
    TurnWaiting,
)

__all__ = [
    "ENVELOPE", "EVENT_TYPES", "BudgetExtended", "BudgetWarning", "DaemonReloadFailed",
    "DaemonReloaded", "DaemonReloading", "DaemonStopping", "EventBody", "GuardWouldStop",
    "LoopWarning", "ModelAttemptFailed", "ModelDelta", "ModelFailover", "ModelQueued",
    "ModelRedirected", "ModelRequest", "ModelResponse", "ModelRetryScheduled",
    "StepStarted", "ToolApprovalDecided", "ToolApprovalRequested", "ToolCalled",
    "ToolOutcomeUnknown", "ToolResult", "ToolRetryScheduled", "TurnAgentRemoved",
    "TurnFinished", "TurnMessage", "TurnQueued", "TurnRecovering", "TurnReplayed",
    "TurnResumed", "TurnStarted", "TurnSuspended", "TurnWaiting", "WebhookFailed", "parse",
]

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
