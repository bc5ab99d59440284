"""The one injectable clock: what time it is, and how to wait for it.

Policy objects never read time themselves: the runner and the supervisor pass
`clock.monotonic()` (durations) or `clock.time()` (epoch, for deadlines and timestamps
shown to people) into them, and every wait of a turn or of the supervisor goes through
`clock.sleep()` or `clock.move_on_after()`. `SystemClock` is anyio's; `FakeClock` moves
only when a test says so (or jumps to the next timer once every task is blocked), so a
15 s recovery wait or a 30 s drain is tested in microseconds with no real sleep.

The deadlines `SystemClock.set_deadline` gives (a model call's bound, every step) share
one event-loop timer, where anyio's own deadline takes one a scope: a call that ends in
time has pushed an entry on a heap, where it would have set and cancelled a loop timer
(`_Deadlines`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from heapq import heapify, heappop, heappush
from itertools import count
from typing import Any, Protocol

import anyio

# The asyncio backend's own cancel scope: what `anyio.CancelScope()` builds on the
# daemon's loop once it has found the backend (four Python calls and a getpid a scope).
# It is anyio's private module, and `_Deadlines` reads two of its scopes' own fields:
# should a release move either, the public class and anyio's own deadlines serve (one
# loop timer a deadline, as before), and tests/unit/test_clock.py says so.
try:
    from anyio._backends._asyncio import CancelScope as _AsyncioScope
except ImportError:  # pragma: no cover - anyio moved its backend's scope
    _AsyncioScope = anyio.CancelScope  # type: ignore[misc,assignment]


def _keeps_deadline_fields() -> bool:
    if _AsyncioScope is anyio.CancelScope:  # pragma: no cover - the fallback above
        return False
    probe = _AsyncioScope()
    return hasattr(probe, "_deadline") and hasattr(probe, "_active")


SHARED_DEADLINES = _keeps_deadline_fields()


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


class _Deadlines:
    """The deadlines `SystemClock.set_deadline` gave the scopes of one event loop, on one
    loop timer.

    A deadline is the scope's own (`scope.deadline`, as anyio's setter leaves it) and a
    heap entry `(when, seq, scope)`; the loop timer is set for the earliest entry, or
    earlier. When it fires, every scope still inside whose deadline has come is
    cancelled, as anyio's own timer would have done; the entries of scopes left (or
    given another deadline since) are dropped unread. Nothing is done when a scope is
    left: its entry goes when its time comes, or when the heap, grown to twice what it
    held after its last sweep, is swept of them. So a deadline that its call ends long
    before (a 600 s bound on a call of a second) costs a heap push, neither a loop timer
    set and cancelled nor a call on the way out."""

    __slots__ = ("heap", "limit", "loop", "seq", "timer", "timer_at")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.heap: list[tuple[float, int, Any]] = []
        self.limit = SWEEP_AT
        self.timer: asyncio.TimerHandle | None = None
        self.timer_at = 0.0
        self.seq = count()

    def sweep(self) -> None:
        """Drop the entries of scopes left, or given another deadline since."""
        heap = self.heap
        # `_active` and `_deadline` are the scope's own, as anyio keeps them.
        heap[:] = [e for e in heap if e[2]._active and e[2]._deadline == e[0]]
        heapify(heap)
        self.limit = max(SWEEP_AT, 2 * len(heap))

    def set_timer(self, when: float) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.timer_at = when
        self.timer = self.loop.call_at(when, self._fire)

    def _fire(self) -> None:
        self.timer = None
        heap = self.heap
        now = self.loop.time()
        while heap and heap[0][0] <= now:
            scope = heappop(heap)[2]
            if scope._active and scope._deadline <= now:
                scope.cancel()
        if heap:
            self.set_timer(heap[0][0])


# The size of the heap of deadlines that is swept first (see `_Deadlines`).
SWEEP_AT = 64


class SystemClock:
    # The C functions themselves, not methods that call them: a turn asks the time about
    # thirty times a step.
    monotonic = staticmethod(time.monotonic)
    time = staticmethod(time.time)

    def __init__(self) -> None:
        # The deadlines of `set_deadline`, for the loop it was last called on.
        self._deadlines: _Deadlines | None = None

    async def sleep(self, seconds: float) -> None:
        await anyio.sleep(seconds)

    def move_on_after(self, seconds: float) -> AbstractContextManager[anyio.CancelScope]:
        # `anyio.move_on_after` on the asyncio backend (the daemon's), as `scope` is: the
        # same scope, without finding the backend.
        return _AsyncioScope(deadline=asyncio.get_running_loop().time() + seconds)

    def scope(self) -> AbstractContextManager[anyio.CancelScope]:
        # `anyio.CancelScope()` on the asyncio backend, built directly: a model call
        # enters one every step.
        return _AsyncioScope()

    def set_deadline(self, scope: anyio.CancelScope, seconds: float) -> None:
        # What anyio's `scope.deadline = anyio.current_time() + seconds` does, on the
        # timer every deadline of the loop shares (`_Deadlines`): a model call sets one a
        # step, and most calls end long before it.
        loop = asyncio.get_running_loop()
        when = loop.time() + seconds
        if not SHARED_DEADLINES:  # pragma: no cover - an anyio without those fields
            scope.deadline = when
            return
        scope._deadline = when  # type: ignore[attr-defined]
        if seconds <= 0:  # passed already: cut at once, as anyio does
            scope.cancel()
            return
        deadlines = self._deadlines
        if deadlines is None or deadlines.loop is not loop:
            deadlines = self._deadlines = _Deadlines(loop)
        heap = deadlines.heap
        heappush(heap, (when, next(deadlines.seq), scope))
        if deadlines.timer is None or when < deadlines.timer_at:
            deadlines.set_timer(when)
        elif len(heap) > deadlines.limit:
            deadlines.sweep()

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
