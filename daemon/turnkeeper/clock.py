"""The one injectable clock: what time it is, and how to wait for it.

Policy objects never read time themselves: the runner and the supervisor pass
`clock.monotonic()` (durations) or `clock.time()` (epoch, for deadlines and timestamps
shown to people) into them, and every wait of a turn or of the supervisor goes through
`clock.sleep()` or `clock.move_on_after()`. `SystemClock` is anyio's; `FakeClock` moves
only when a test says so (or jumps to the next timer once every task is blocked), so a
15 s recovery wait or a 30 s drain is tested in microseconds with no real sleep.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Protocol

import anyio

# The asyncio backend's own cancel scope: what `anyio.CancelScope()` builds on the
# daemon's loop once it has found the backend (four Python calls and a getpid a scope).
# It is anyio's private module: should a release move it, the public class serves.
try:
    from anyio._backends._asyncio import CancelScope as _AsyncioScope
except ImportError:  # pragma: no cover - anyio moved its backend's scope
    _AsyncioScope = anyio.CancelScope  # type: ignore[misc,assignment]


def to_micros(seconds: float) -> float:
    """`seconds` to the nearest microsecond, for the wire: `round(seconds * 1e6) / 1e6`,
    a quarter of the cost of `round(seconds, 6)` and its exact decimal rounding. The two
    agree on durations; on an epoch time they may differ in the last digit, where a
    double holds the time to a quarter of a microsecond anyway."""
    return round(seconds * 1_000_000) / 1_000_000


class Clock(Protocol):
    def monotonic(self) -> float: ...

    def time(self) -> float: ...

    async def sleep(self, seconds: float) -> None: ...

    def move_on_after(self, seconds: float) -> AbstractContextManager[anyio.CancelScope]:
        """A cancel scope cancelled `seconds` from now: a timeout that is a decision (the
        caller reads `cancelled_caught`), not an error."""
        ...

    def scope(self) -> AbstractContextManager[anyio.CancelScope]:
        """A cancel scope with no deadline yet: `set_deadline` may give it one once
        inside, for a bound that starts part-way (one scope where a scope inside another
        would cost a second scope)."""
        ...

    def set_deadline(self, scope: anyio.CancelScope, seconds: float) -> None:
        """Cancel `scope`, entered from this clock's `scope()`, `seconds` from now."""
        ...


class SystemClock:
    # The C functions themselves, not methods that call them: a turn asks the time about
    # thirty times a step.
    monotonic = staticmethod(time.monotonic)
    time = staticmethod(time.time)

    async def sleep(self, seconds: float) -> None:
        await anyio.sleep(seconds)

    def move_on_after(self, seconds: float) -> AbstractContextManager[anyio.CancelScope]:
        # `anyio.move_on_after` on the asyncio backend (the daemon's), as `scope` and
        # `set_deadline` are: the same scope, without finding the backend twice.
        return _AsyncioScope(deadline=asyncio.get_running_loop().time() + seconds)

    def scope(self) -> AbstractContextManager[anyio.CancelScope]:
        # `anyio.CancelScope()` on the asyncio backend, built directly: a model call
        # enters one every step.
        return _AsyncioScope()

    def set_deadline(self, scope: anyio.CancelScope, seconds: float) -> None:
        # `anyio.current_time()` on the asyncio backend (the daemon's), without the three
        # calls it takes to find the backend: a model call sets one deadline a step.
        scope.deadline = asyncio.get_running_loop().time() + seconds

    def __repr__(self) -> str:
        return "SystemClock()"


class FakeClock:
    """A clock for tests. Time stands still until `advance(seconds)`, which fires every
    timer due by then; `await settle()` waits until every task is blocked and then jumps
    to the earliest timer, as a simulation would (False when there is none: the system is
    idle). `time()` is `start + monotonic()`."""

    def __init__(self, *, start: float = 1_800_000_000.0) -> None:
        self._now = 0.0
        self._start = start
        self._timers: list[tuple[float, int, anyio.CancelScope]] = []
        # The deadlines `set_deadline` gave the scopes of `scope()`, in `_timers` too.
        self._deadlines: dict[int, tuple[float, int, anyio.CancelScope]] = {}
        self._seq = 0

    def __repr__(self) -> str:
        return f"FakeClock(monotonic={self._now:g}, timers={len(self._timers)})"

    def monotonic(self) -> float:
        return self._now

    def time(self) -> float:
        return self._start + self._now

    @property
    def next_timer_in(self) -> float | None:
        """Seconds until the earliest pending timer, or None."""
        return min(t[0] for t in self._timers) - self._now if self._timers else None

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("a clock does not go backwards")
        self._now += seconds
        for due, _, scope in list(self._timers):
            if due <= self._now:
                scope.cancel()

    async def settle(self) -> bool:
        """Let every task run until blocked, then jump to the earliest timer."""
        await anyio.wait_all_tasks_blocked()
        wait = self.next_timer_in
        if wait is None:
            return False
        self.advance(max(0.0, wait))
        await anyio.wait_all_tasks_blocked()
        return True

    async def sleep(self, seconds: float) -> None:
        with self.move_on_after(seconds):
            await anyio.sleep_forever()

    def move_on_after(self, seconds: float) -> AbstractContextManager[anyio.CancelScope]:
        return self._timer(seconds)

    @contextmanager
    def scope(self) -> Iterator[anyio.CancelScope]:
        with anyio.CancelScope() as scope:
            try:
                yield scope
            finally:
                entry = self._deadlines.pop(id(scope), None)
                if entry is not None:
                    self._timers.remove(entry)

    def set_deadline(self, scope: anyio.CancelScope, seconds: float) -> None:
        old = self._deadlines.pop(id(scope), None)
        if old is not None:
            self._timers.remove(old)
        self._seq += 1
        entry = (self._now + max(0.0, seconds), self._seq, scope)
        self._deadlines[id(scope)] = entry
        self._timers.append(entry)
        if seconds <= 0:
            scope.cancel()

    @contextmanager
    def _timer(self, seconds: float) -> Iterator[anyio.CancelScope]:
        self._seq += 1
        entry = (self._now + max(0.0, seconds), self._seq, anyio.CancelScope())
        self._timers.append(entry)
        try:
            with entry[2] as scope:
                if seconds <= 0:
                    scope.cancel()
                yield scope
        finally:
            self._timers.remove(entry)
