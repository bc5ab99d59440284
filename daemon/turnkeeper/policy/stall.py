"""Whether a failed call tells anything about its peer, or only about this process.

A call's timeout runs on the monotonic clock, which goes on while the process does not
run: stopped (SIGSTOP, a frozen container), swapped out, or its event loop blocked. When
the process runs again, every call whose timeout passed meanwhile fails at once, though
the peer may have answered in time. Counted, those failures would open the peer's
breaker (on a fleet, for every node: the streak is shared) and spend its retry budget,
for a fault that was this process's. So they are not counted.

A failure is excused, and counts in no breaker streak and no retry budget, when the
call overlapped

- a stall: a gap of at least `stall_s` in which the process did not run, as a watch
  that wakes every `tick_s` sees it (a wake-up late by `stall_s` or more); or one under
  way, when the watch has not woken since it was due (the failure is handled before
  the watch's own wake-up after a pause, in whatever order the loop runs them);
- on a fleet, a time when the node's lease had lapsed (`policy/lease.py`): the node
  could not know whether it still held its turns, and its view of the peer is as stale.

`stall_s` is far above the lag a busy event loop shows (tens to hundreds of
milliseconds), so load alone excuses nothing; a call that overlapped a stall is excused
whatever its timeout, since what it would have seen had the process run is unknown. The
cost: the calls in flight across a stall teach the breaker nothing; the next ones do.

Pure: the caller passes the clock's readings.
"""

from __future__ import annotations

from collections import deque
from enum import StrEnum

STALL_S = 2.0
KEEP = 32  # past stalls and lapses remembered: more than the calls in flight across them


class Excuse(StrEnum):
    STALLED = "stalled"  # the process did not run during the call
    LEASE_LAPSED = "lease_lapsed"  # the node's lease lapsed during the call


class StallWatch:
    """When this process did not run, and when its fleet lease had lapsed."""

    def __init__(self, *, stall_s: float = STALL_S) -> None:
        if not stall_s > 0:
            raise ValueError(f"stall_s must be > 0, got {stall_s!r}")
        self.stall_s = stall_s
        self._stalls: deque[tuple[float, float]] = deque(maxlen=KEEP)
        self._lapses: deque[tuple[float, float]] = deque(maxlen=KEEP)
        self._last_tick: float | None = None  # None: no watch runs (a test's fake clock)
        self._tick_s = 0.0
        self._lease_until: float | None = None  # None: not a fleet node
        self.stalls = 0

    def __repr__(self) -> str:
        return (f"StallWatch(stall_s={self.stall_s}, stalls={self.stalls}, "
                f"last_tick={self._last_tick!r}, lease_until={self._lease_until!r})")

    def tick(self, now: float, *, tick_s: float) -> float | None:
        """The watch woke at `now` and sleeps `tick_s` until the next wake-up. Returns
        the length of the stall it ends (None: the process ran on time)."""
        stall = self._under_way(now)
        if stall is not None:
            self._stalls.append((stall, now))
            self.stalls += 1
        self._last_tick, self._tick_s = now, tick_s
        return None if stall is None else now - stall

    def _under_way(self, now: float) -> float | None:
        """Since when the process has not run, if the watch is `stall_s` late or more."""
        if self._last_tick is None:
            return None
        if now - self._last_tick - self._tick_s >= self.stall_s:
            return self._last_tick
        return None

    def lease(self, valid_until: float, *, now: float) -> None:
        """A fleet node's leases hold until `valid_until` now (a claim or a renewal
        confirmed them at `now`): a lapse that ends here is remembered."""
        before = self._lease_until
        if before is not None and now >= before:
            self._lapses.append((before, now))
        self._lease_until = valid_until

    def excuse(self, *, started_at: float, now: float) -> Excuse | None:
        """Why a call that ran from `started_at` to `now` and failed says nothing about
        its peer; None when its failure counts."""
        if self._under_way(now) is not None or _overlap(self._stalls, started_at, now):
            return Excuse.STALLED
        if self._lease_until is not None and now >= self._lease_until:
            return Excuse.LEASE_LAPSED
        if _overlap(self._lapses, started_at, now):
            return Excuse.LEASE_LAPSED
        return None


def _overlap(windows: deque[tuple[float, float]], start: float, end: float) -> bool:
    return any(a < end and b > start for a, b in windows)
