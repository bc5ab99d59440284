"""Which tool calls wait for a person's approval, and what the wait's end does.

A tool's `approval` setting says which of its calls need one:

- `never` (the default): none; the call runs as soon as the model asks;
- `always`: every call;
- `effects`: every call that may change something: a tool that is not idempotent, or
  one declared destructive (an MCP server's `destructiveHint`, or an override). A
  read-only or idempotent tool's calls run at once.

The setting is an input, not read here from a tool: whoever knows the tool's setting
(today the `[[tools]]` entry; a named agent may override it per tool) passes it in.

A call that needs approval is not sent until a person approves it (possibly with edited
arguments) or denies it; a denied call never runs, and the agent reads
`denied by the operator: REASON` as its result (a decision, not a failure: nothing counts
it). A wait has a deadline, `[approvals] timeout` seconds after the call was asked for
(`requested_at`, kept with the turn so a restart does not start the clock again). At the
deadline `on_timeout` decides: `stop` ends the turn `approval.timeout` (its counter,
`approval_seconds`, is how long the oldest pending call waited), `deny` denies every
pending call with the reason `approval timed out` and the turn goes on.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from turnkeeper.policy.outcome import Stop, StopCode

ApprovalSetting = Literal["never", "always", "effects"]
OnTimeout = Literal["stop", "deny"]
APPROVAL_SETTINGS: tuple[ApprovalSetting, ...] = ("never", "always", "effects")
DECISIONS = ("approve", "deny")
TIMED_OUT_REASON = "approval timed out"


def needs_approval(setting: ApprovalSetting, *, idempotent: bool, destructive: bool) -> bool:
    """Whether a call of a tool with this `setting` waits for a person (see the module
    docstring)."""
    if setting == "always":
        return True
    if setting == "effects":
        return destructive or not idempotent
    return False


def denial_text(reason: str) -> str:
    """What the agent reads as the result of a denied call."""
    reason = reason.strip()
    return f"denied by the operator: {reason}" if reason else "denied by the operator"


@dataclass(frozen=True, slots=True)
class TimeoutDeny:
    """The wait's deadline passed with `on_timeout = "deny"`: every pending call is
    denied with `reason` and the turn goes on."""

    reason: str = TIMED_OUT_REASON


@dataclass(frozen=True, slots=True)
class ApprovalWait:
    """The deadline of a turn's wait for approvals. `timeout_s` counts from the oldest
    pending call's `requested_at` (epoch seconds): the calls of one step are asked for
    together, so one deadline serves them all."""

    timeout_s: float
    on_timeout: OnTimeout = "stop"

    def __repr__(self) -> str:
        return f"ApprovalWait(timeout_s={self.timeout_s:g}, on_timeout={self.on_timeout!r})"

    def deadline(self, requested_at: Iterable[float]) -> float:
        """When the wait ends without a decision: `timeout_s` after the oldest request."""
        return min(requested_at) + self.timeout_s

    def at(self, requested_at: Iterable[float], *, now: float) -> Stop | TimeoutDeny | None:
        """What the wait does at time `now`: None while the deadline is ahead (keep
        waiting); at or past it, the stop (`on_timeout = "stop"`) or the denial
        (`"deny"`). A daemon restarted after the deadline gets the same answer at once."""
        times = tuple(requested_at)
        if not times:
            return None
        oldest = min(times)
        if now < oldest + self.timeout_s:
            return None
        if self.on_timeout == "deny":
            return TimeoutDeny()
        return Stop(StopCode.APPROVAL_TIMEOUT,
                    f"no decision on {len(times)} tool call(s) awaiting approval within "
                    f"{self.timeout_s:g} s", value=round(now - oldest, 3),
                    limit=self.timeout_s)
