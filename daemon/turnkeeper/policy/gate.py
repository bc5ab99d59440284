"""The mode gate: whether a guard's stop ends the turn.

Each guard family (budget, loop detection, failure loop) runs in one of three modes.
`enforce` ends the turn. `warn` and `observe` let it go on and record, once per stop
code, that the guard would have stopped it (`would_have_stopped`), so an operator can try
a limit on real traffic before enforcing it; `warn` also tells the agent, so it can wrap
up. Stops outside the families (the step backstop, the deadline, provider and internal
stops) always end the turn: no mode can make a turn unbounded.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

from turnkeeper.policy.outcome import GUARD_FAMILY, Stop


@dataclass(frozen=True, slots=True)
class WouldStop:
    """Record the stop as `would_have_stopped` and go on; `note`, when set, is told to
    the agent."""

    stop: Stop
    mode: str
    note: str | None


class ModeGate:
    def __init__(self, modes: Mapping[str, str]) -> None:
        self.modes = dict(modes)

    def __repr__(self) -> str:
        return f"ModeGate({self.modes!r})"

    def decide(self, stop: Stop, *, recorded: Collection[str]) -> Stop | WouldStop | None:
        """The stop itself when it ends the turn; a `WouldStop` to record it; None when
        its code is already in `recorded` (the codes of `would_have_stopped`)."""
        family = GUARD_FAMILY.get(stop.code)
        if family is None or self.modes[family] == "enforce":
            return stop
        if stop.code.value in recorded:
            return None
        mode = self.modes[family]
        note = (f"{stop.message}. This limit is in warn mode, so the turn goes on: finish "
                "soon, or call report_blocked." if mode == "warn" else None)
        return WouldStop(stop=stop, mode=mode, note=note)
