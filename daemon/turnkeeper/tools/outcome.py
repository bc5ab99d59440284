"""One tool attempt's outcome, shared by every kind of tool (http, echo, MCP) and the
journal, which stores it as JSON."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from turnkeeper.policy.classify import CallFailure

MAX_RESULT_CHARS = 32_768


@dataclass(frozen=True, slots=True)
class ToolOutcome:
    """One attempt's outcome. `state` is the tool's own declared state value (a JSON
    object's top-level "state" key), used by loop detection. `attempted` is False when
    nothing reached the tool (its MCP server is down and being restarted): the peer's
    circuit breaker learns nothing from that."""

    content: str
    failure: CallFailure | None = None
    state: str | None = None
    attempted: bool = True

    @property
    def ok(self) -> bool:
        return self.failure is None

    def to_json(self) -> dict[str, Any]:
        return {"content": self.content, "state": self.state,
                "failure": self.failure.to_json() if self.failure else None}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> ToolOutcome:
        f = d.get("failure")
        failure = None
        if f:
            failure = CallFailure(status=f.get("status"), error_type=f.get("error_type"),
                                  exception=tuple(f.get("exception") or ()),
                                  message=f.get("message", ""),
                                  retry_after_s=f.get("retry_after_s"))
        return cls(content=d.get("content", ""), failure=failure, state=d.get("state"))


def truncate(text: str) -> str:
    if len(text) <= MAX_RESULT_CHARS:
        return text
    return text[:MAX_RESULT_CHARS] + f"\n[truncated: {len(text)} characters in all]"
