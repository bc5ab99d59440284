"""The control plane's admission limits, decided in one pure place."""

from __future__ import annotations

from turnkeeper.policy.admission import ControlLimits, default_max_connections

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
