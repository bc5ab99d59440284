"""A node's lease timing (policy/lease.py), on a fake clock: it renews often enough that
two renewals may fail, and it counts its leases lost before the database can expire
them, so no other node ever runs a turn this one still runs."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from turnkeeper.clock import FakeClock
from turnkeeper.policy.lease import LeaseTiming, sort_renewal


def test_a_node_whose_renewals_fail_stops_before_the_database_expires_its_lease() -> None:
    clock = FakeClock()
    timing = LeaseTiming(15.0)
    assert timing.renew_every_s == 5.0 and timing.margin_s == 2.0
    sent_at = clock.monotonic()  # the last renewal the database accepted
    valid_until = timing.valid_until(sent_at)
    database_expiry_at_the_earliest = sent_at + 15.0
    clock.advance(timing.renew_every_s)  # a renewal fails
    assert not timing.lost(valid_until, clock.monotonic())
    clock.advance(timing.renew_every_s)  # a second one fails
    assert not timing.lost(valid_until, clock.monotonic())
    clock.advance(timing.renew_every_s - timing.margin_s)  # 13 s after the last success
    assert timing.lost(valid_until, clock.monotonic())
    assert clock.monotonic() < database_expiry_at_the_earliest


def test_a_renewal_moves_the_deadline_on() -> None:
    clock = FakeClock()
    timing = LeaseTiming(6.0)
    valid_until = timing.valid_until(clock.monotonic())
    clock.advance(timing.renew_every_s)
    assert timing.next_renewal(0.0) == clock.monotonic()
    valid_until = timing.valid_until(clock.monotonic())  # renewed now
    clock.advance(6.0 - timing.margin_s)
    assert not timing.lost(valid_until, clock.monotonic() - 0.01)
    assert timing.lost(valid_until, clock.monotonic() + timing.renew_every_s)


@given(lease=st.floats(min_value=1.0, max_value=3600.0),
       sent_at=st.floats(min_value=0.0, max_value=1e6))
def test_for_any_lease_two_renewals_may_fail_and_the_node_stops_first(
        lease: float, sent_at: float) -> None:
    timing = LeaseTiming(lease)
    valid_until = timing.valid_until(sent_at)
    assert valid_until < sent_at + lease  # before the database's earliest expiry
    assert not timing.lost(valid_until, sent_at + 2 * timing.renew_every_s)
    assert timing.margin_s > 0


def test_a_renewal_sorts_held_turns_into_kept_and_lost() -> None:
    held = {"t_a": 1, "t_b": 3, "t_c": 2}
    outcome = sort_renewal(held, {"t_a": 1, "t_b": 4})  # t_b: claimed again since
    assert outcome.kept == {"t_a"}
    assert outcome.lost == {"t_b", "t_c"}
    assert sort_renewal({}, {"t_x": 1}).kept == frozenset()
