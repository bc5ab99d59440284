"""How long finished turns are kept, and how often the daemon prunes the older ones.

A finished turn (its record, checkpoint, events, journal and conversation rows) is kept
`store.keep_finished` after it ended, then deleted in small batches by a background task,
so a daemon under steady load holds a bounded store. Dead letters are kept until they
are replayed or pruned explicitly (`turnkeeper prune --dead-letters`): they wait for an
operator's decision, not for a clock. `0` keeps everything.
"""

from __future__ import annotations

# Rows deleted per transaction: the store's single writer is shared with every running
# turn, so a prune never holds it long.
PRUNE_BATCH = 200
PRUNE_EVERY_MIN_S = 1.0
PRUNE_EVERY_MAX_S = 600.0


def prune_every_s(keep_s: float) -> float:
    """How often to look for turns past their keep: a tenth of the keep, from a second
    to ten minutes (a 30-day keep need not be exact to the second)."""
    return min(PRUNE_EVERY_MAX_S, max(PRUNE_EVERY_MIN_S, keep_s / 10.0))


def prune_before(now: float, keep_s: float) -> float | None:
    """Turns that finished before this time are past their keep; None keeps them all."""
    return None if keep_s <= 0 else now - keep_s
