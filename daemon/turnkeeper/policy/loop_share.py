"""How much turn work one turn of the event loop lets through.

The event loop runs every task that is ready before it looks at a timer or reads a new
request. When thousands of turns are ready at once (a queue let go, commits that resume
their callers, model answers that come back together), each runs its step's stretch
(the step boundary, the request built and sent) in the same turn of the loop, and
`GET /v1/status` and the lag probe waited behind them: under 5,000 turns a turn of the
loop took 25 to 100 ms of CPU a hundred times a run. So each step asks for a share of
the loop before it starts. With the requests sent a slice at a time, their answers (from
a provider that takes about as long for each) come back a slice at a time too.

The rule: within one turn of the loop, steps go through while that turn has spent less
than `slice_s` on them (measured from the first let through); past that, each is held
for a later turn, first come first through, and the timers, the I/O and the control
socket's requests run in between. The held steps are let out `fits` a turn: as many as
went through the last time a turn ran out of its share, doubled after a turn that let
all it could through without running out, so a loop that keeps up lets everything
through and one that does not settles on what a slice holds. A step let out runs (it
is not held twice: each hold costs a few microseconds, and asking again cost a step
1.4% more instructions under bench_instructions, where valgrind's slowness spends every
slice at once); the rule learns from it as from the others.

A turn whose step awaited nothing that suspended it (a model answering at once, a store
that keeps nothing) asks again for its next step in the same turn of the loop. It goes
on while the share lasts, ahead of turns held before, and what a slice held counts it
once (`ask(..., again=True)`: it uses the share, it is not one more to let out).
Holding it instead would let one more held turn out in its place, to run one step past
the share and be held in its turn: in bench_step, where every step is such a step, a
step was held 0.95 times, and 0.21 times so (the 200 turns' first asks, mostly).

The control plane (status, health, listings, submits) never asks: it is not paced.

Pure: the caller passes the monotonic clock's readings and says when a turn of the loop
ends.
"""

from __future__ import annotations

SLICE_S = 0.005  # a turn of the loop's share of turn work
MAX_FITS = 4096  # what is let out of the held pieces in one turn of the loop, at most


class LoopShare:
    """The share of one turn of the event loop that turn work may take."""

    __slots__ = ("admitted", "fits", "full", "slice_s", "started")

    def __init__(self, *, slice_s: float = SLICE_S) -> None:
        if not slice_s > 0:
            raise ValueError(f"slice_s must be > 0, got {slice_s!r}")
        self.slice_s = slice_s
        self.started: float | None = None  # the first piece let through in this turn
        self.admitted = 0  # pieces (turns) let through in this turn
        self.full = False  # this turn's share was used up
        self.fits = 1  # pieces to let out of the held ones at the next turn

    def __repr__(self) -> str:
        return (f"LoopShare(slice_s={self.slice_s}, admitted={self.admitted}, "
                f"fits={self.fits}, full={self.full})")

    def ask(self, now: float, *, again: bool = False) -> bool:
        """A piece of turn work asks to run now, in the current turn of the loop: True,
        it runs; False, it waits for a later turn. `again`: the piece went through
        already in this turn of the loop and asks for its next stretch (it uses the
        share, it is not counted again in what the turn let through)."""
        started = self.started
        if started is None:
            self.started = now
        elif self.full or now - started >= self.slice_s:
            if not self.full:
                self.full = True
                self.fits = max(1, self.admitted)
            return False
        if not again:
            self.admitted += 1
        return True

    def let_in(self, now: float) -> None:
        """A held piece let out starts now, in the current turn of the loop: it runs
        whatever is left of the share, and counts as one let through."""
        started = self.started
        if started is None:
            self.started = now
        elif not self.full and now - started >= self.slice_s:
            self.full = True
            self.fits = max(1, self.admitted)
        self.admitted += 1

    def next_turn(self) -> None:
        """The turn of the loop ended: the next starts with its whole share. A turn that
        let its pieces through without running out lets twice as many out next time."""
        if not self.full and self.admitted >= self.fits:
            self.fits = min(MAX_FITS, self.fits * 2)
        self.started = None
        self.admitted = 0
        self.full = False

    def to_let_out(self, waiting: int) -> int:
        """How many of the `waiting` held pieces to let out for the next turn."""
        return min(waiting, self.fits)
