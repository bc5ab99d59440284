"""When the cyclic collector walks what, so that no pass of it holds the event loop long.

A pass of CPython's collector walks every object of the generations it collects, and
holds the event loop (and every thread: it holds the GIL) while it does. Under thousands
of turns in flight the young generation is mostly their live state: it survives the
pass, and the next pass of the older generation walks it again. Left to its allocation
counts the young generation also grows past its threshold (the count is allocations less
deallocations of any age: turns that end free old objects while new ones are made), and
a pass of it lasted 10 to 155 ms under 5,000 turns, longer as the run went on.

So the collector is paced by the clock instead. Every `every_s` the young generation
(what was made since the last look and is still alive) is frozen: moved to the
permanent generation, which no pass walks. Reference counting still frees a frozen
object when its last reference goes, so live state that ends is freed as before; only
what a reference cycle holds waits for a full pass. Before it is frozen, the young
generation is collected while the daemon is quiet (at most `quiet_turns` turns
running: few young objects, a short pass), and not under load, where a pass every 50 ms
walked 10-30 ms of objects that all lived on (5,000 turns: 115 passes, 1.4 s a run,
none of them finding garbage). A full pass (the frozen objects thawed, the whole heap
collected, what survives frozen again: as long as the heap is large) comes once the
daemon is quiet and `quiet_after_s` has passed since the last, and under load every
`thaw_every_s`: cyclic garbage lives at most that long, and a full pass comes no more
often.

Pure: the caller passes the clock's readings and the running turns.
"""

from __future__ import annotations

from enum import Enum

EVERY_S = 0.05
QUIET_TURNS = 10
QUIET_AFTER_S = 30.0
THAW_EVERY_S = 300.0


class Pass(Enum):
    FREEZE = "freeze"  # the young generation frozen as it is
    YOUNG = "young"  # collected, then what survived frozen
    FULL = "full"  # everything thawed, collected, what survived frozen


class CollectorPace:
    """Which pass the collector makes at each look, every `every_s`."""

    __slots__ = ("every_s", "quiet_after_s", "quiet_turns", "thaw_every_s", "thawed_at")

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

    def __repr__(self) -> str:
        return (f"CollectorPace(every_s={self.every_s}, quiet_turns={self.quiet_turns}, "
                f"quiet_after_s={self.quiet_after_s}, thaw_every_s={self.thaw_every_s})")

    def look(self, now: float, running: int) -> Pass:
        """The pass to make now, with `running` turns running. A full pass is taken as
        made: the next is counted from now."""
        since = now - self.thawed_at
        quiet = running <= self.quiet_turns
        if since >= self.thaw_every_s or (quiet and since >= self.quiet_after_s):
            self.thawed_at = now
            return Pass.FULL
        return Pass.YOUNG if quiet else Pass.FREEZE
