"""policy/claims.py: when a fleet node claims, and how many."""

from __future__ import annotations

from turnkeeper.policy.claims import ClaimPacer


def claim(p: ClaimPacer, *, free: int, got: int, ticked: bool = False,
          backlog: int | None = None) -> int:
    """A pass of the claim loop: what it asked for (0: no claim sent)."""
    asked = p.limit(free=free, ticked=ticked, backlog=backlog)
    if asked:
        p.claimed(token=p.sent(), asked=asked, got=min(got, asked))
    return asked


def test_no_free_slot_no_claim() -> None:
    p = ClaimPacer()
    p.heard()
    assert p.limit(free=0, ticked=False, backlog=None) == 0
    assert p.limit(free=-2, ticked=True, backlog=5) == 0


def test_a_starting_node_claims_its_free_slots() -> None:
    assert ClaimPacer().limit(free=8, ticked=False, backlog=None) == 8


def test_a_freed_slot_claims_only_while_the_last_claim_filled_its_slots() -> None:
    p = ClaimPacer()
    assert claim(p, free=4, got=4) == 4  # filled: more may be waiting
    assert claim(p, free=1, got=0) == 1  # a slot freed: claimed, found none
    assert claim(p, free=2, got=5) == 0  # the next freed slot sends no claim


def test_a_notice_claims_even_after_an_empty_claim() -> None:
    p = ClaimPacer()
    assert claim(p, free=4, got=1) == 4
    assert p.limit(free=3, ticked=False, backlog=None) == 0
    p.heard()  # submitted here, or a peer's NOTIFY
    assert claim(p, free=3, got=0) == 3
    assert p.limit(free=3, ticked=False, backlog=None) == 0


def test_a_notice_heard_while_a_claim_runs_counts_for_the_next_wake() -> None:
    p = ClaimPacer()
    asked = p.limit(free=4, ticked=False, backlog=None)
    token = p.sent()
    p.heard()  # arrives before the claim answers (empty)
    p.claimed(token=token, asked=asked, got=0)
    assert p.limit(free=4, ticked=False, backlog=None) == 4


def test_a_failed_claim_leaves_the_notice_pending() -> None:
    p = ClaimPacer()
    claim(p, free=2, got=0)
    p.heard()
    p.sent()  # sent, and no answer: `claimed` is not called
    assert p.limit(free=2, ticked=False, backlog=None) == 2


def test_the_tick_claims_when_the_fleets_queue_holds_turns_or_was_not_read() -> None:
    p = ClaimPacer()
    claim(p, free=4, got=0)  # nothing was there
    assert p.limit(free=4, ticked=True, backlog=0) == 0
    assert p.limit(free=4, ticked=True, backlog=3) == 4  # a dead node's lease ran out
    assert p.limit(free=4, ticked=True, backlog=None) == 4
    p.heard()  # a notice no claim answered yet (its wake fell on the tick): claimed
    assert claim(p, free=4, got=0, ticked=True, backlog=0) == 4
    assert p.limit(free=4, ticked=True, backlog=0) == 0
