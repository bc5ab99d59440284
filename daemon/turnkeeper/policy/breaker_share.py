"""What a node of a fleet owes the shared breaker streaks: the changes its breakers
reported since its last flush, per breaker, folded into one delta each.

A fleet counts one failure streak per peer (provider or tool) across its nodes, so that
three nodes meeting a dead peer at once open its breaker after `failure_threshold`
failures in all, not that many each. A node's breakers tell their changes
(`policy/breaker.py` `BreakerChange`); this module folds them, and the node sends the
folds to the store (`add_breaker_failures`) as soon as it can. A delta reads "reset the
streak first if `reset`, then add `failures`": a success anywhere in the fleet breaks
the streak, and the failures after it count from zero. An opening is kept as the
longest one seen since the last flush, for the node to publish at once. Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from turnkeeper.policy.breaker import BreakerChange, ChangeKind


@dataclass(frozen=True, slots=True)
class StreakDelta:
    reset: bool = False
    failures: int = 0
    opened_for_s: float | None = None  # this node opened it, for that long

    def then(self, later: StreakDelta) -> StreakDelta:
        """This delta followed by `later`, as one."""
        opened = [s for s in (self.opened_for_s, later.opened_for_s) if s is not None]
        if later.reset:
            return StreakDelta(reset=True, failures=later.failures,
                               opened_for_s=max(opened, default=None))
        return StreakDelta(reset=self.reset, failures=self.failures + later.failures,
                           opened_for_s=max(opened, default=None))


@dataclass(slots=True)
class StreakShare:
    """The deltas not yet flushed, per breaker name."""

    pending: dict[str, StreakDelta] = field(default_factory=dict)

    def record(self, change: BreakerChange) -> None:
        if change.kind is ChangeKind.FAILURE:
            step = StreakDelta(failures=1)
        elif change.kind is ChangeKind.RESET:
            step = StreakDelta(reset=True)
        else:
            step = StreakDelta(opened_for_s=change.open_for_s)
        before = self.pending.get(change.name)
        self.pending[change.name] = step if before is None else before.then(step)

    def take(self) -> dict[str, StreakDelta]:
        """Everything to flush now; the share starts empty again."""
        taken, self.pending = self.pending, {}
        return taken

    def put_back(self, name: str, delta: StreakDelta) -> None:
        """A flush that failed: its delta goes before whatever came since."""
        since = self.pending.get(name)
        self.pending[name] = delta if since is None else delta.then(since)

    def __bool__(self) -> bool:
        return bool(self.pending)
