"""One tool attempt's outcome, shared by every kind of tool (http, echo, MCP) and the
journal, which stores it as JSON."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from turnkeeper.policy.classify import CallFailure, Redactor
from turnkeeper.policy.effects import EffectOutcome
from turnkeeper.values import value_class

MAX_RESULT_CHARS = 32_768


@value_class
class ToolOutcome:
    """One attempt's outcome. `state` is the tool's own declared state value (a JSON
    object's top-level "state" key), used by loop detection. `attempted` is False when
    nothing reached the tool (its MCP server is down and being restarted): the peer's
    circuit breaker learns nothing from that.

    `kind` says what is known of the effect: ok, failed (it did not happen, or the
    server answered with a failure) or unknown (a non-idempotent request may have
    reached the server and no answer came back), derived from `failure` and `unknown`
    so it cannot disagree with them. An unknown outcome still carries the failure that
    ended the attempt (what the model is told)."""

    content: str
    failure: CallFailure | None = None
    state: str | None = None
    attempted: bool = True
    unknown: bool = False

    def __post_init__(self) -> None:
        if self.unknown and self.failure is None:
            raise ValueError("an unknown outcome carries the failure that ended it")

    @property
    def kind(self) -> EffectOutcome:
        if self.unknown:
            return EffectOutcome.UNKNOWN
        return EffectOutcome.OK if self.failure is None else EffectOutcome.FAILED

    @property
    def ok(self) -> bool:
        return self.failure is None

    def redacted(self, redactor: Redactor) -> ToolOutcome:
        """This outcome with every secret `redactor` holds replaced, in all the
        outcome carries on to the journal, the events, the conversation and the model:
        its content, its state and its failure's message."""
        content, state = redactor.held(self.content), self.state
        state = redactor.held(state) if state is not None else None
        failure = self.failure
        if failure is not None and failure.message:
            failure = replace(failure, message=redactor.held(failure.message))
        if content == self.content and state == self.state and failure == self.failure:
            return self
        return replace(self, content=content, state=state, failure=failure)

    def to_json(self) -> dict[str, Any]:
        return {"content": self.content, "state": self.state, "kind": str(self.kind),
                "failure": self.failure.to_json() if self.failure else None}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> ToolOutcome:
        f = d.get("failure")
        failure = None
        if f:
            failure = CallFailure(status=f.get("status"), error_type=f.get("error_type"),
                                  exception=tuple(f.get("exception") or ()),
                                  message=f.get("message", ""),
                                  retry_after_s=f.get("retry_after_s"),
                                  local=bool(f.get("local", False)))
        # "kind" is absent in rows written before outcomes had one: ok or failed then.
        return cls(content=d.get("content", ""), failure=failure, state=d.get("state"),
                   unknown=d.get("kind") == EffectOutcome.UNKNOWN and failure is not None)


def truncate(text: str) -> str:
    if len(text) <= MAX_RESULT_CHARS:
        return text
    return text[:MAX_RESULT_CHARS] + f"\n[truncated: {len(text)} characters in all]"
