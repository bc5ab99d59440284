"""When a node renews its leases, and when it must consider them lost.

A node holds its claimed turns under a lease of `lease_s` seconds, counted by the
database from each renewal. The node cannot read the database's clock, but it knows a
lower bound: a renewal the database accepted was made after the node sent it, so the
lease runs at least until `sent_at + lease_s` on the node's own monotonic clock.

The node considers its leases lost a `margin_s` before that bound: it stops its turns
(no write, no effect) while they are still its own, so that another node, which may
claim them only once the database sees them expired, never runs a turn this one still
runs. The margin covers the difference between the two clocks' rates and the time the
node takes to stop. Renewals come every `renew_every_s`, a third of the lease by
default: two can fail (a restarting database) before the lease is lost.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LeaseTiming:
    lease_s: float

    @property
    def renew_every_s(self) -> float:
        return self.lease_s / 3

    @property
    def margin_s(self) -> float:
        """What the node keeps in hand before the lease's earliest expiry."""
        return min(2.0, self.lease_s / 5)

    def valid_until(self, sent_at: float) -> float:
        """The local time until which a lease renewed by a request sent at `sent_at`
        (local monotonic) is still this node's for sure, the margin taken off."""
        return sent_at + self.lease_s - self.margin_s

    def lost(self, valid_until: float, now: float) -> bool:
        return now >= valid_until

    def next_renewal(self, last_sent_at: float) -> float:
        return last_sent_at + self.renew_every_s


@dataclass(frozen=True, slots=True)
class RenewalOutcome:
    """What a renewal tells the node: the turns it still holds and those it lost (another
    node claimed them after they expired, or they ended)."""

    kept: frozenset[str]
    lost: frozenset[str]


def sort_renewal(held: dict[str, int], renewed: dict[str, int]) -> RenewalOutcome:
    """`held`: turn -> epoch the node holds; `renewed`: turn -> epoch the database renewed
    for this node. A turn renewed under another epoch is not the claim the node holds."""
    kept = frozenset(t for t, epoch in held.items() if renewed.get(t) == epoch)
    return RenewalOutcome(kept=kept, lost=frozenset(held) - kept)
