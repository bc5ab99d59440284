"""When the cyclic collector walks what, so that no pass of it holds the event loop long.

A pass of CPython's collector walks every object of the generations it collects, and
holds the event loop (and every thread: it holds the GIL) while it does. Under thousands
of turns in flight the young generation is mostly their live state: it survives the
pass, and the next pass of the older generation walks it again. Left to its allocation
counts the young generation also grows past its threshold (the count is allocations less
deallocations of any age: turns that end free old objects while new ones are made), and
a pass of it lasted 10 to 155 ms under 5,000 turns, longer as the run went on.

So while the daemon is busy (more than `quiet_turns` turns running) the collector is
paced by the clock. Every `every_s` the young generation (what was made since the last
look and is still alive) is frozen: moved to the permanent generation, which no pass
walks. Reference counting still frees a frozen object when its last reference goes, so
live state that ends is freed as before; only what a reference cycle holds waits for a
full pass. (Collecting the young generation before freezing it was measured too: a
pass every 50 ms walked 10-30 ms of objects that all lived on; 5,000 turns, 115 passes,
1.4 s a run, none of them finding garbage.) A full pass (the frozen objects thawed, the
whole heap collected, what survives frozen again) comes once the daemon is quiet again,
when its heap is small, no sooner than `quiet_after_s` after the last; and under load
every `thaw_every_s`: cyclic garbage made under load lives at most that long, and a
full pass under load, as long as the heap is large, comes no more often. While quiet
and with nothing frozen since the last full pass, the collector runs as CPython runs
it, on its allocation counts.

Pure: the caller passes the clock's readings and the running turns.
"""

from __future__ import annotations

from enum import Enum

EVERY_S = 0.05
QUIET_TURNS = 10
QUIET_AFTER_S = 30.0
THAW_EVERY_S = 300.0


class Pass(Enum):
    NONE = "none"  # nothing: the collector runs on its own counts
    FREEZE = "freeze"  # the young generation frozen as it is
    FULL = "full"  # everything thawed, collected, what survived frozen


class CollectorPace:
    """Which pass the collector makes at each look, every `every_s`."""

    __slots__ = ("every_s", "frozen", "quiet_after_s", "quiet_turns", "thaw_every_s",
                 "thawed_at")

    def __init__(self, now: float, *, every_s: float = EVERY_S,
                 quiet_turns: int = QUIET_TURNS, quiet_after_s: float = QUIET_AFTER_S,
                 thaw_every_s: float = THAW_EVERY_S) -> None:
        if not 0 < every_s <= quiet_after_s <= thaw_every_s:
            raise ValueError("want 0 < every_s <= quiet_after_s <= thaw_every_s, got "
                             f"{every_s!r}, {quiet_after_s!r}, {thaw_every_s!r}")
        self.every_s = every_s
        self.quiet_turns = quiet_turns
        self.quiet_after_s = quiet_after_s
        self.thaw_every_s = thaw_every_s
        self.thawed_at = now  # the last full pass (start-up's)
        self.frozen = False  # objects frozen since the last full pass

    def __repr__(self) -> str:
        return (f"CollectorPace(every_s={self.every_s}, quiet_turns={self.quiet_turns}, "
                f"quiet_after_s={self.quiet_after_s}, thaw_every_s={self.thaw_every_s}, "
                f"frozen={self.frozen})")

    def look(self, now: float, running: int) -> Pass:
        """The pass to make now, with `running` turns running. A full pass is taken as
        made: the next is counted from now."""
        since = now - self.thawed_at
        if running > self.quiet_turns:
            if since >= self.thaw_every_s:
                self.thawed_at = now
                return Pass.FULL
            self.frozen = True
            return Pass.FREEZE
        if self.frozen and since >= self.quiet_after_s:
            self.thawed_at = now
            self.frozen = False
            return Pass.FULL
        return Pass.NONE
