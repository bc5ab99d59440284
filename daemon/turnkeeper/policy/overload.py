"""When the daemon stops taking new work because its own event loop is behind.

The loop's lag (how late a short sleep wakes up) is the one figure that says the daemon
itself is the bottleneck: every turn step, every control request and every timer waits
that long. Past a point, taking more turns only makes every turn slower and the control
socket slow to answer, so new submits are refused (503 with Retry-After, as for a full
queue) until the loop catches up.

The decision is a two-state machine fed one lag sample at a time, with hysteresis so
that it does not flap around the threshold:

- `accepting` -> `shedding` after `enter_samples` samples in a row at or above
  `lag_threshold_s` (one slow sample is a hiccup, not an overload);
- `shedding` -> `accepting` once every sample for `clear_after_s` seconds has been
  below `lag_threshold_s * CLEAR_RATIO`; a sample above that starts the wait again.

`lag_threshold_s = 0` turns the guard off. Time comes in with each sample (monotonic
seconds), so the guard is tested without a clock.

A batch of submits is the other way new work can arrive faster than it can be taken:
`batch_refusal` says whether the queue has room for all of one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

# Lag must fall well below the threshold (not just under it) before intake reopens.
CLEAR_RATIO = 0.5
# The longest Retry-After the guard suggests, whatever the settings.
MAX_RETRY_AFTER_S = 60


class OverloadState(StrEnum):
    ACCEPTING = "accepting"
    SHEDDING = "shedding"


@dataclass(frozen=True, slots=True)
class OverloadSettings:
    """`lag_threshold_s` 0 = the guard is off."""

    lag_threshold_s: float = 0.5
    enter_samples: int = 2
    clear_after_s: float = 2.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.lag_threshold_s) and self.lag_threshold_s >= 0):
            raise ValueError(f"lag_threshold_s must be >= 0, not {self.lag_threshold_s!r}")
        if self.enter_samples < 1:
            raise ValueError(f"enter_samples must be >= 1, not {self.enter_samples!r}")
        if not (math.isfinite(self.clear_after_s) and self.clear_after_s >= 0):
            raise ValueError(f"clear_after_s must be >= 0, not {self.clear_after_s!r}")

    @property
    def enabled(self) -> bool:
        return self.lag_threshold_s > 0

    @property
    def clear_below_s(self) -> float:
        return self.lag_threshold_s * CLEAR_RATIO


@dataclass(frozen=True, slots=True)
class Shed:
    """Decision: intake closes. `lag_s` is the sample that tipped it."""

    lag_s: float
    threshold_s: float
    samples: int


@dataclass(frozen=True, slots=True)
class Cleared:
    """Decision: intake reopens after `shed_for_s` seconds of shedding."""

    lag_s: float
    shed_for_s: float
    refused: int


@dataclass(frozen=True, slots=True)
class OverloadRefusal:
    reason: str
    retry_after_s: int


class OverloadGuard:
    """Feed it every loop-lag sample (`observe`); ask it before taking a submit
    (`refusal`). It counts the submits it refused while shedding."""

    def __init__(self, settings: OverloadSettings | None = None) -> None:
        self.settings = settings or OverloadSettings()
        self.state = OverloadState.ACCEPTING
        self.last_lag_s = 0.0
        self.max_lag_s = 0.0  # the worst sample of the current (or last) shedding spell
        self.refused = 0  # submits refused during the current (or last) shedding spell
        self.refused_total = 0
        self.spells = 0  # how many times intake has closed
        self._above = 0  # samples in a row at or above the threshold
        self._shed_at = 0.0
        self._calm_since: float | None = None  # first of the run of calm samples

    def __repr__(self) -> str:
        s = self.settings
        return (f"OverloadGuard({self.state.value}, last_lag_s={self.last_lag_s:.3f}, "
                f"threshold_s={s.lag_threshold_s:g}, enter_samples={s.enter_samples}, "
                f"clear_after_s={s.clear_after_s:g}, refused={self.refused})")

    @property
    def shedding(self) -> bool:
        return self.state is OverloadState.SHEDDING

    def configure(self, settings: OverloadSettings) -> Cleared | None:
        """New settings (a reload). Turning the guard off reopens intake at once."""
        self.settings = settings
        if not settings.enabled and self.shedding:
            return self._clear(self.last_lag_s, self._shed_at)
        return None

    def observe(self, lag_s: float, *, now: float) -> Shed | Cleared | None:
        """One lag sample taken at monotonic time `now`; a decision when the state
        changes, else None."""
        lag_s = max(0.0, lag_s) if math.isfinite(lag_s) else 0.0
        self.last_lag_s = lag_s
        s = self.settings
        if not s.enabled:
            self._above = 0
            return None
        if self.state is OverloadState.ACCEPTING:
            self._above = self._above + 1 if lag_s >= s.lag_threshold_s else 0
            if self._above < s.enter_samples:
                return None
            self.state = OverloadState.SHEDDING
            self.spells += 1
            self._shed_at = now
            self._calm_since = None
            self.max_lag_s = lag_s
            self.refused = 0
            return Shed(lag_s=lag_s, threshold_s=s.lag_threshold_s, samples=self._above)
        self.max_lag_s = max(self.max_lag_s, lag_s)
        if lag_s >= s.clear_below_s:
            self._calm_since = None
            return None
        if self._calm_since is None:
            self._calm_since = now
        if now - self._calm_since < s.clear_after_s:
            return None
        return self._clear(lag_s, now)

    def _clear(self, lag_s: float, now: float) -> Cleared:
        self.state = OverloadState.ACCEPTING
        self._above = 0
        self._calm_since = None
        return Cleared(lag_s=lag_s, shed_for_s=max(0.0, now - self._shed_at),
                       refused=self.refused)

    def refusal(self) -> OverloadRefusal | None:
        """None while accepting; while shedding, why (naming the setting) and when to
        come back. Counts the refusal."""
        if not self.shedding:
            return None
        s = self.settings
        self.refused += 1
        self.refused_total += 1
        # Come back once intake can have cleared: the calm period plus the lag itself.
        retry = math.ceil(s.clear_after_s + self.last_lag_s)
        return OverloadRefusal(
            f"the daemon is overloaded: event-loop lag {self.last_lag_s:.3f} s is over "
            f"daemon.overload_lag ({s.lag_threshold_s:g} s); retry later",
            retry_after_s=max(1, min(MAX_RETRY_AFTER_S, retry)))

    def snapshot(self) -> dict[str, object]:
        """What `status` shows."""
        s = self.settings
        return {"state": self.state.value, "lag_s": round(self.last_lag_s, 4),
                "threshold_s": s.lag_threshold_s, "max_lag_s": round(self.max_lag_s, 4),
                "refused": self.refused, "refused_total": self.refused_total,
                "spells": self.spells}


def batch_refusal(*, batch: int, queued: int, max_queued: int,
                  running: int) -> OverloadRefusal | None:
    """A batch of submits is taken whole or not at all: refused when the queue has no
    room for every one of them (a partly taken batch would leave the client to work out
    which ones to send again). Retry-After as for a full queue: the queue's depth per
    running turn, at least 1 s."""
    if queued + batch <= max_queued:
        return None
    room = max(0, max_queued - queued)
    per_runner = (queued + batch - max_queued) // max(1, running)
    return OverloadRefusal(
        f"the queue has room for {room} more turns, not the {batch} of this batch "
        f"(daemon.max_queued_turns = {max_queued}, {queued} waiting)",
        retry_after_s=max(1, min(MAX_RETRY_AFTER_S, per_runner)))
