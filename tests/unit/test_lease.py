"""A node's leases (policy/lease.py), on a fake clock: it renews often enough that two
renewals may fail, it counts its leases lapsed before the database can expire them, and
a lapsed lease is confirmed again by a renewal that answers in time, the turns another
node took meanwhile sorted out as lost."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from turnkeeper.clock import FakeClock
from turnkeeper.policy.lease import Lease, LeaseTiming, sort_renewal


def test_a_node_whose_renewals_fail_lapses_before_the_database_expires_its_lease() -> None:
    clock = FakeClock()
    timing = LeaseTiming(15.0)
    assert timing.renew_every_s == 5.0 and timing.margin_s == 2.0
    sent_at = clock.monotonic()  # the last renewal the database accepted
    lease = Lease.starting(timing, sent_at)
    database_expiry_at_the_earliest = sent_at + 15.0
    clock.advance(timing.renew_every_s)  # a renewal fails
    assert not lease.lapsed(clock.monotonic())
    clock.advance(timing.renew_every_s)  # a second one fails
    assert not lease.lapsed(clock.monotonic())
    clock.advance(timing.renew_every_s - timing.margin_s)  # 13 s after the last success
    assert lease.lapsed(clock.monotonic())
    assert clock.monotonic() < database_expiry_at_the_earliest


def test_a_renewal_moves_the_deadline_on() -> None:
    clock = FakeClock()
    timing = LeaseTiming(6.0)
    lease = Lease.starting(timing, clock.monotonic())
    clock.advance(timing.renew_every_s)
    sent_at = clock.monotonic()
    outcome = lease.after_renewal({"t_a": 1}, {"t_a": 1}, sent_at=sent_at,
                                  now=sent_at + 0.1)
    assert outcome.confirmed and outcome.kept == {"t_a"}
    clock.advance(6.0 - timing.margin_s)
    assert not lease.lapsed(clock.monotonic() - 0.01)
    assert lease.lapsed(clock.monotonic() + timing.renew_every_s)


def test_a_lapsed_lease_is_confirmed_again_by_a_renewal_after_the_outage() -> None:
    clock = FakeClock()
    timing = LeaseTiming(3.0)
    lease = Lease.starting(timing, clock.monotonic())
    clock.advance(20.0)  # the database was unreachable for much longer than a lease
    assert lease.lapsed(clock.monotonic())
    sent_at = clock.monotonic()
    # t_b was claimed by another node meanwhile (its epoch moved on); t_a was not.
    outcome = lease.after_renewal({"t_a": 2, "t_b": 5}, {"t_a": 2}, sent_at=sent_at,
                                  now=sent_at + 0.2)
    assert outcome.confirmed
    assert outcome.kept == {"t_a"} and outcome.lost == {"t_b"}
    assert not lease.lapsed(sent_at + 0.2)


def test_a_renewal_answered_too_late_still_sorts_but_does_not_confirm() -> None:
    timing = LeaseTiming(3.0)
    lease = Lease.starting(timing, 0.0)
    sent_at = 10.0
    outcome = lease.after_renewal({"t_a": 1, "t_b": 1}, {"t_a": 1}, sent_at=sent_at,
                                  now=sent_at + timing.lease_s)
    assert not outcome.confirmed
    assert outcome.lost == {"t_b"}  # lost whenever the answer came
    assert lease.lapsed(sent_at + timing.lease_s)


@given(lease_s=st.floats(min_value=1.0, max_value=3600.0),
       sent_at=st.floats(min_value=0.0, max_value=1e6))
def test_for_any_lease_two_renewals_may_fail_and_the_node_lapses_first(
        lease_s: float, sent_at: float) -> None:
    timing = LeaseTiming(lease_s)
    lease = Lease.starting(timing, sent_at)
    assert lease.valid_until < sent_at + lease_s  # before the database's earliest expiry
    assert not lease.lapsed(sent_at + 2 * timing.renew_every_s)
    assert timing.margin_s > 0


def test_a_renewal_sorts_held_turns_into_kept_and_lost() -> None:
    held = {"t_a": 1, "t_b": 3, "t_c": 2}
    outcome = sort_renewal(held, {"t_a": 1, "t_b": 4})  # t_b: claimed again since
    assert outcome.kept == {"t_a"}
    assert outcome.lost == {"t_b", "t_c"}
    assert sort_renewal({}, {"t_x": 1}).kept == frozenset()
