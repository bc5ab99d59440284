"""The budget limits in force for one turn, kept once.

A turn's limits are its base ones (the policy's `[budget]` of its profile, the submit's
overrides, its deadline and its first start) and the extensions granted on top of them
(`Extension`, checkpointed with the turn). Three readers want them, each in its own
form: the guard that enforces (every limit; in a budget's `warn` or `observe` mode only
the step backstop and the clock limits), the guard that watches (the real limits, when
the budget does not enforce them) and the turn's record (what the API shows). Each form
is worked out here from the base limits and the extension, and nothing is kept beside
them: `TurnContext` hands the guards and the record what this says, when the turn is
built and after each grant.
"""

from __future__ import annotations

from typing import Any

from turnkeeper.policy.budget import BudgetLimits
from turnkeeper.policy.extension import Extension


class LimitsInForce:
    __slots__ = ("_enforced", "_extension", "base", "enforce")

    def __init__(self, base: BudgetLimits, *, enforce: bool, extension: Extension) -> None:
        self.base = base
        self.enforce = enforce
        # Worked out once: while nothing is granted the guard keeps the very same limits
        # object (a guard's limits are replaced, never changed, and the meter's answers
        # are kept for as long as they are the same object).
        self._enforced = base if enforce else base.backstop_only()
        self._extension = extension

    def __repr__(self) -> str:
        return (f"LimitsInForce(base={self.base!r}, enforce={self.enforce}, "
                f"granted={self._extension.granted})")

    @property
    def current(self) -> BudgetLimits:
        """The base limits with every extension granted so far."""
        return self._extension.extended(self.base)

    def for_guard(self) -> BudgetLimits:
        """What the enforcing guard compares with: the current limits, or only their
        backstop and clock limits when the budget does not enforce."""
        return self._extension.extended(self._enforced)

    def for_watch(self) -> BudgetLimits | None:
        """What the watching guard compares with; None when the budget enforces (there
        is no watching guard)."""
        return None if self.enforce else self.current

    def shown(self) -> dict[str, Any]:
        """What the turn's record shows: the current limits, with the base step and
        time limits beside them once an extension was granted."""
        if not self._extension.granted:
            return self.base.snapshot()
        return {**self.current.snapshot(), "base_max_steps": self.base.max_steps,
                "base_max_seconds": self.base.max_seconds}
