"""The one injectable clock. Policy objects never read time themselves: the runner and
the supervisor pass `clock.monotonic()` (durations) or `clock.time()` (epoch, for
deadlines and timestamps shown to people) into them."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float: ...

    def time(self) -> float: ...


class SystemClock:
    def monotonic(self) -> float:
        return time.monotonic()

    def time(self) -> float:
        return time.time()

    def __repr__(self) -> str:
        return "SystemClock()"
