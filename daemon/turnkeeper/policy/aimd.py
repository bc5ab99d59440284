"""How many model calls may be in flight against one provider at once.

A provider that answers 429 (or 529, or sends Retry-After) is telling every turn the
same thing: fewer requests. Handling that per call (each backs off and tries again) keeps
the daemon starting as many new calls as ever, so the storm goes on. `InFlightLimit` is
the daemon-wide answer, one per provider: an additive-increase, multiplicative-decrease
limit on calls in flight.

- it starts low, at `min`, in slow start: until the first overload each success adds
  `increase`, so the limit doubles with each window of calls and finds the provider's
  capacity in a few round trips instead of sending a thousand calls at once to learn it;
- after that, a call that succeeds adds `increase / limit`, so the limit grows by about
  `increase` for each full window of successful calls (one round trip at the limit);
- an overload signal multiplies the limit by `decrease` (never below `min`), once per
  window: the calls already in flight when the limit was cut were sent under the old
  limit, and their 429s say nothing new. Each admitted call carries the epoch it was
  admitted in; only a signal from a call admitted since the last cut cuts again;
- the limit never exceeds `ceiling` (the provider's `max_in_flight`).

Without adaptation the limit is fixed at the ceiling (`adaptive = False`), which is how
`max_in_flight` alone is enforced. A ceiling of None means no fixed cap: without
adaptation nothing limits the calls, with it only the adaptive limit does.

The object only counts; the waiting is the caller's (`turnkeeper.concurrency`).
"""

from __future__ import annotations

import math
from typing import Any


class InFlightLimit:
    def __init__(self, *, ceiling: int | None, adaptive: bool, minimum: int = 1,
                 increase: float = 1.0, decrease: float = 0.5,
                 start: float | None = None) -> None:
        if minimum < 1:
            raise ValueError(f"min must be at least 1, got {minimum}")
        if ceiling is not None and ceiling < 1:
            raise ValueError(f"max_in_flight must be at least 1, got {ceiling}")
        if not increase > 0:
            raise ValueError(f"increase must be greater than 0, got {increase}")
        if not 0 < decrease < 1:
            raise ValueError(f"decrease must be between 0 and 1, got {decrease}")
        self.ceiling = ceiling
        self.adaptive = adaptive
        self.minimum = minimum if ceiling is None else min(minimum, ceiling)
        self.increase = increase
        self.decrease = decrease
        self._slow_start = adaptive
        first = start if start is not None else self._first()
        self._limit = self._bounded(first)
        self._in_flight = 0
        self._epoch = 0
        # Figures for status and metrics.
        self.decreases = 0
        self.overloads = 0
        self.lowest: float | None = None  # the lowest limit after a cut
        self.highest = self._limit

    def __repr__(self) -> str:
        return (f"InFlightLimit(limit={self._limit:.2f}, in_flight={self._in_flight}, "
                f"ceiling={self.ceiling}, adaptive={self.adaptive}, min={self.minimum}, "
                f"increase={self.increase}, decrease={self.decrease})")

    def _first(self) -> float:
        """Where the limit starts: the minimum in slow start when adaptive, else the
        ceiling (a fixed max_in_flight)."""
        if self.adaptive:
            return float(self.minimum)
        return float(self.ceiling) if self.ceiling is not None else math.inf

    def _bounded(self, value: float) -> float:
        top = math.inf if self.ceiling is None else float(self.ceiling)
        return max(float(self.minimum), min(top, value))

    @property
    def limit(self) -> int:
        """The whole number of calls admitted at once now (the fraction is growth)."""
        if not self.adaptive and self.ceiling is None:
            return 2**31 - 1
        return max(self.minimum, math.floor(self._limit))

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def bounded(self) -> bool:
        """Whether any limit applies at all (else calls never wait)."""
        return self.adaptive or self.ceiling is not None

    def try_acquire(self) -> int | None:
        """Admit one call if fewer than `limit` are in flight: its epoch (hand it back to
        `release`), or None when it must wait."""
        if self.bounded and self._in_flight >= self.limit:
            return None
        self._in_flight += 1
        return self._epoch

    def release(self, epoch: int, *, success: bool = False, overload: bool = False) -> bool:
        """A call admitted in `epoch` is over: a success grows the limit, an overload
        (429, 529 or a Retry-After) cuts it; any other ending only frees the slot. True
        when the limit changed so that waiting calls may be admitted or must wait."""
        self._in_flight = max(0, self._in_flight - 1)
        if not self.adaptive:
            return True
        if overload:
            self.overloads += 1
            if epoch < self._epoch:  # sent before the last cut: nothing new
                return True
            self._slow_start = False
            self._limit = self._bounded(self._limit * self.decrease)
            self._epoch += 1
            self.decreases += 1
            self.lowest = self._limit if self.lowest is None else min(self.lowest, self._limit)
            return True
        if success:
            step = self.increase if self._slow_start else self.increase / max(1.0, self._limit)
            self._limit = self._bounded(self._limit + step)
            self.highest = max(self.highest, self._limit)
        return True

    def reconfigure(self, *, ceiling: int | None, adaptive: bool, minimum: int,
                    increase: float, decrease: float) -> None:
        """New settings after a reload; the calls in flight stay counted. Turning
        adaptation on or off, or a new ceiling, starts the limit again from the top."""
        restart = adaptive != self.adaptive or ceiling != self.ceiling
        self.ceiling, self.adaptive = ceiling, adaptive
        self.minimum = minimum if ceiling is None else min(minimum, ceiling)
        self.increase, self.decrease = increase, decrease
        if restart:
            self._slow_start = adaptive
            self._limit = self._bounded(self._first())
        else:
            self._limit = self._bounded(self._limit)

    def snapshot(self) -> dict[str, Any]:
        """What status, metrics and the follow view show."""
        return {"limit": self.limit if self.bounded else None,
                "in_flight": self._in_flight, "max_in_flight": self.ceiling,
                "adaptive": self.adaptive, "decreases": self.decreases,
                "overloads": self.overloads,
                "lowest": None if self.lowest is None else math.floor(self.lowest),
                "highest": math.floor(self.highest) if self.bounded else None}


def is_overload(status: int | None, retry_after_s: float | None) -> bool:
    """Whether a failed call says the provider wants fewer requests: 429 (rate limited),
    529 (overloaded), or any answer carrying a Retry-After."""
    return status in (429, 529) or retry_after_s is not None
