"""The control plane's admission limits, decided in one pure place."""

from __future__ import annotations

from turnkeeper.policy.admission import ControlLimits, FollowerBacklog, default_max_connections

LIMITS = ControlLimits(max_connections=3, max_followers_per_client=2, max_message_bytes=10)


def test_a_connection_is_admitted_only_below_max_connections() -> None:
    assert LIMITS.admits_connection(2)
    assert not LIMITS.admits_connection(3)


def test_a_follower_is_admitted_only_below_the_per_client_cap() -> None:
    assert LIMITS.admits_follower(1)
    assert not LIMITS.admits_follower(2)


def test_a_message_of_exactly_max_message_bytes_is_not_too_large() -> None:
    assert not LIMITS.message_too_large(10)
    assert LIMITS.message_too_large(11)


def test_default_connections_leave_three_quarters_of_the_descriptors() -> None:
    assert default_max_connections(1024) == 256
    assert default_max_connections(65536) == 1024
    assert default_max_connections(None) == 1024
    assert default_max_connections(2) == 1


def test_root_and_the_daemons_uid_may_use_every_slot() -> None:
    limits = ControlLimits(max_connections=16, max_followers_per_client=2, max_message_bytes=10)
    assert limits.admits_peer(15, 15, privileged=True)
    assert not limits.admits_peer(16, 16, privileged=True)


def test_another_uid_gets_half_the_slots_and_none_of_those_kept_for_the_operator() -> None:
    limits = ControlLimits(max_connections=16, max_followers_per_client=2, max_message_bytes=10)
    assert limits.per_uid_connections == 8
    assert limits.reserved_slots == 1
    assert limits.admits_peer(7, 7, privileged=False)
    assert not limits.admits_peer(8, 8, privileged=False)  # its half is taken
    assert limits.admits_peer(14, 0, privileged=False)
    assert not limits.admits_peer(15, 0, privileged=False)  # the last slot is the operator's


def test_a_single_slot_is_nobodys_reserve() -> None:
    limits = ControlLimits(max_connections=1, max_followers_per_client=2, max_message_bytes=10)
    assert limits.admits_peer(0, 0, privileged=False)


def test_a_follower_past_its_backlog_bound_is_dropped_at_once() -> None:
    rule = FollowerBacklog(max_bytes=1000, stall_timeout_s=30.0)
    assert rule.judge(1000, None, now=5.0) == (None, 5.0)  # behind, not over
    assert rule.judge(1001, None, now=5.0) == ("buffer", 5.0)


def test_a_follower_under_half_its_bound_is_not_behind() -> None:
    rule = FollowerBacklog(max_bytes=1000, stall_timeout_s=30.0)
    assert rule.judge(500, 2.0, now=100.0) == (None, None)  # caught up: the clock resets
    assert rule.judge(0, None, now=100.0) == (None, None)


def test_a_follower_that_stays_behind_for_the_stall_timeout_is_dropped() -> None:
    rule = FollowerBacklog(max_bytes=1000, stall_timeout_s=30.0)
    why, since = rule.judge(600, None, now=10.0)
    assert (why, since) == (None, 10.0)
    assert rule.judge(900, since, now=39.9) == (None, 10.0)
    assert rule.judge(700, since, now=40.0) == ("stalled", 10.0)
