"""When a fleet node claims turns, and how many.

A node claims up to its free slots (`max_concurrent_turns` less the turns it runs and
those queued on it) when turns may have become claimable for it, and never when it has
no free slot. What may have made some claimable:

- a notice (`heard`): turns submitted here, or another node's NOTIFY (a submit, turns
  handed back or requeued): claim at once;
- a slot of its own freed: claim at once only if the node's last claim filled every
  slot it asked for (more may be waiting) or a notice came since that claim; a claim
  that took fewer than it asked for saw every turn it could take, and what becomes
  claimable after it without a notice is found by the tick;
- the tick (each second): the fleet's queue is read then (`backlog`: turns no live node
  holds, a dead node's whose lease ran out among them); claim when it holds any, when
  it could not be read, or when a notice came that no claim answered yet.

So an idle node, or a busy one whose last claim found the fleet's queue empty, sends no
claim that can only come back empty: each node's finished turn or tick does not cost the
database a claim, at any number of nodes. The decisions are the caller's clock-free
inputs: the class holds a count of notices, no time.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class ClaimPacer:
    notices: int = 0  # notices heard so far
    # Whether a claim now may find turns without a notice: the last claim filled every
    # slot it asked for (or there was none yet).
    maybe_more: bool = True
    _seen: int = 0  # the notices heard when the last claim was sent

    def heard(self) -> None:
        """Turns may have become claimable: submitted here, or a peer's notice."""
        self.notices += 1

    def limit(self, *, free: int, ticked: bool, backlog: int | None) -> int:
        """How many turns to claim now (0: no claim). `free`: the node's free slots;
        `ticked`: the tick, not a wake, with `backlog` the fleet's queue read at it
        (None: the read failed)."""
        if free <= 0:
            return 0
        pending = self.notices != self._seen  # a notice no claim answered yet
        if ticked:
            return free if backlog is None or backlog > 0 or pending else 0
        return free if self.maybe_more or pending else 0

    def sent(self) -> int:
        """A claim is sent: the token to give `claimed` with its answer."""
        return self.notices

    def claimed(self, *, token: int, asked: int, got: int) -> None:
        """A claim sent with `token` asked for `asked` turns and took `got`. Notices
        heard while it ran still count for the next wake."""
        self._seen = token
        self.maybe_more = got >= asked
