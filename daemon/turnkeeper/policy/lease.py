"""When a node renews its leases, when they have lapsed, and what a renewal tells it.

A node holds its claimed turns under a lease of `lease_s` seconds, counted by the
database from each renewal. The node cannot read the database's clock, but it knows a
lower bound: a renewal the database accepted was made after the node sent it, so the
lease runs at least until `sent_at + lease_s` on the node's own monotonic clock.

The node considers its leases lapsed a `margin_s` before that bound. A lapsed lease is
not a lost claim: the database lets another node claim the turns from then on, but until
one does, the claim (its epoch) is still this node's, and the next renewal that reaches
the database takes it again. So while the lease is lapsed (the database unreachable
for longer than a lease, or the node paused) the node sends no non-idempotent call: such
a call waits for a renewal to confirm the lease. Everything else may go on, since every
write of a claimed turn names its epoch and the database refuses it once another node
took the turn (StaleLease). A renewal's answer sorts the held turns: the ones renewed
under the epoch the node holds are kept, the others are lost and given up without a
write or a call. The margin covers the difference between the two clocks' rates and the
time a call takes to leave. Renewals come every `renew_every_s`, a third of the lease by
default: two can fail (a restarting database) before the lease lapses.
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


@dataclass(frozen=True, slots=True)
class RenewalOutcome:
    """What a renewal tells the node: the turns it still holds and those it lost (another
    node claimed them after they expired, or they ended); `confirmed`: the answer came
    in time for the renewed leases to count (a late one keeps and loses turns all the
    same, but the lease stays lapsed until the next renewal)."""

    kept: frozenset[str]
    lost: frozenset[str]
    confirmed: bool = True


def sort_renewal(held: dict[str, int], renewed: dict[str, int]) -> RenewalOutcome:
    """`held`: turn -> epoch the node holds; `renewed`: turn -> epoch the database renewed
    for this node. A turn renewed under another epoch is not the claim the node holds."""
    kept = frozenset(t for t, epoch in held.items() if renewed.get(t) == epoch)
    return RenewalOutcome(kept=kept, lost=frozenset(held) - kept)


@dataclass(slots=True)
class Lease:
    """The node's leases as the node knows them: valid until `valid_until` (local
    monotonic), lapsed from then until a renewal that answers in time. Pure: the caller
    passes the clock's readings."""

    timing: LeaseTiming
    valid_until: float

    @classmethod
    def starting(cls, timing: LeaseTiming, now: float) -> Lease:
        """A node that holds nothing yet: its first claims start their leases."""
        return cls(timing=timing, valid_until=timing.valid_until(now))

    def lapsed(self, now: float) -> bool:
        """No renewal confirmed the leases in time: another node may claim the turns, so
        no non-idempotent call may be sent until a renewal confirms them again."""
        return now >= self.valid_until

    def after_claim(self, sent_at: float) -> None:
        """A claim sent at `sent_at` gave the node the only turns it holds: their leases
        count from then."""
        self.valid_until = self.timing.valid_until(sent_at)

    def after_renewal(self, held: dict[str, int], renewed: dict[str, int], *,
                      sent_at: float, now: float) -> RenewalOutcome:
        """A renewal sent at `sent_at` answered `renewed` at `now`. Turns missing from it,
        or renewed under another epoch, are lost whenever the answer came; the leases
        count from `sent_at` only if the answer came before that lease lapsed."""
        outcome = sort_renewal(held, renewed)
        until = self.timing.valid_until(sent_at)
        if now >= until:
            return RenewalOutcome(kept=outcome.kept, lost=outcome.lost, confirmed=False)
        self.valid_until = until
        return outcome
