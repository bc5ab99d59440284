from __future__ import annotations

from turnkeeper.policy.store_outage import StoreOutage


def top(lo: float, hi: float) -> float:
    return hi


def test_a_healthy_store_is_not_degraded_and_never_fatal() -> None:
    o = StoreOutage(fatal_after_s=10.0)
    assert not o.degraded
    assert not o.fatal(now=1e9)
    assert o.failing_for(now=5.0) == 0.0


def test_a_failure_degrades_and_waits_longer_each_time_up_to_the_cap() -> None:
    o = StoreOutage(fatal_after_s=300.0)
    delays = [o.failed("disk full", now=100.0 + i, rand=top) for i in range(12)]
    assert o.degraded
    assert delays[0] == 0.05
    assert delays == sorted(delays)
    assert max(delays) == 5.0
    assert o.failing_since == 100.0  # the first failure, not the last
    assert o.last_error == "disk full"


def test_the_outage_is_fatal_after_fatal_after_s_of_failures_without_a_success() -> None:
    o = StoreOutage(fatal_after_s=300.0)
    o.failed("disk full", now=1000.0, rand=top)
    assert not o.fatal(now=1299.9)
    assert o.fatal(now=1300.0)


def test_a_success_ends_the_outage_and_restarts_the_fatal_clock() -> None:
    o = StoreOutage(fatal_after_s=300.0)
    o.failed("disk full", now=1000.0, rand=top)
    assert o.recovered() is True
    assert not o.degraded
    assert o.recovered() is False  # nothing to end
    o.failed("disk full", now=1250.0, rand=top)
    assert not o.fatal(now=1500.0)
    assert o.fatal(now=1550.0)


def test_a_refused_submit_is_told_to_come_back_after_at_least_a_second() -> None:
    o = StoreOutage()
    o.failed("disk full", now=0.0, rand=top)
    assert o.retry_after_s() == 1
    for i in range(20):
        o.failed("disk full", now=float(i), rand=top)
    assert o.retry_after_s() == 5


def test_the_repr_names_the_last_error() -> None:
    o = StoreOutage()
    assert repr(o) == "StoreOutage(ok)"
    o.failed("database or disk is full", now=3.0, rand=top)
    assert "database or disk is full" in repr(o)
