"""The in-flight limit of one provider: fixed at max_in_flight, or AIMD; and the gate
that makes calls over it wait, in fake time."""

from __future__ import annotations

import anyio
import pytest

from turnkeeper.cli.follow_state import FollowState
from turnkeeper.clock import FakeClock
from turnkeeper.concurrency import ProviderGate
from turnkeeper.policy.aimd import InFlightLimit, is_overload
from turnkeeper.policy.classify import CallFailure
from turnkeeper.providers.base import ProviderError


def test_a_fixed_limit_admits_max_in_flight_calls_and_no_more() -> None:
    lim = InFlightLimit(ceiling=2, adaptive=False)
    a, b = lim.try_acquire(), lim.try_acquire()
    assert a is not None and b is not None
    assert lim.try_acquire() is None
    lim.release(a, overload=True)  # a fixed limit learns nothing
    assert lim.limit == 2
    assert lim.try_acquire() is not None


def test_no_ceiling_and_no_adaptation_never_makes_a_call_wait() -> None:
    lim = InFlightLimit(ceiling=None, adaptive=False)
    assert all(lim.try_acquire() is not None for _ in range(10_000))
    assert lim.snapshot()["limit"] is None


def test_an_overload_halves_the_limit_once_per_window() -> None:
    lim = InFlightLimit(ceiling=16, adaptive=True, minimum=2, decrease=0.5, start=16.0)
    epochs = [lim.try_acquire() for _ in range(16)]
    assert None not in epochs
    # Sixteen 429s from calls sent under the same limit: one cut, not sixteen.
    for e in epochs:
        assert e is not None
        lim.release(e, overload=True)
    assert lim.limit == 8
    assert (lim.decreases, lim.overloads) == (1, 16)
    # A call admitted after the cut that is throttled again cuts again, down to min.
    for expected in (4, 2, 2):
        e = lim.try_acquire()
        assert e is not None
        lim.release(e, overload=True)
        assert lim.limit == expected


def _finish(lim: InFlightLimit, n: int, **how: bool) -> None:
    for _ in range(n):
        e = lim.try_acquire()
        assert e is not None
        lim.release(e, **how)


def test_slow_start_doubles_each_window_until_the_first_overload() -> None:
    lim = InFlightLimit(ceiling=100, adaptive=True, minimum=1)
    assert lim.limit == 1  # adaptation starts low and finds the capacity
    _finish(lim, 1, success=True)
    assert lim.limit == 2
    _finish(lim, 2, success=True)
    assert lim.limit == 4
    _finish(lim, 4, success=True)
    assert lim.limit == 8
    _finish(lim, 1, overload=True)
    assert lim.limit == 4 and lim.snapshot()["lowest"] == 4
    _finish(lim, 4, success=True)  # no more doubling: about +1 a window
    assert lim.limit == 4 and lim.snapshot()["highest"] == 8


def test_successes_grow_the_limit_by_increase_per_window_up_to_the_ceiling() -> None:
    lim = InFlightLimit(ceiling=10, adaptive=True, increase=1.0, start=8.0)
    _finish(lim, 1, overload=True)  # out of slow start, at 4
    assert lim.limit == 4
    _finish(lim, 5, success=True)  # about one window at limit 4: +1
    assert lim.limit == 5
    _finish(lim, 200, success=True)
    assert lim.limit == 10  # never above max_in_flight


def test_a_plain_failure_only_frees_the_slot() -> None:
    lim = InFlightLimit(ceiling=4, adaptive=True, start=3.0)
    e = lim.try_acquire()
    assert e is not None
    lim.release(e)
    assert (lim.limit, lim.in_flight) == (3, 0)


def test_overload_signals() -> None:
    assert is_overload(429, None) and is_overload(529, None)
    assert is_overload(503, 2.0)
    assert not is_overload(503, None) and not is_overload(None, None)


def test_bad_settings_are_refused_with_their_name() -> None:
    with pytest.raises(ValueError, match="decrease"):
        InFlightLimit(ceiling=4, adaptive=True, decrease=1.0)
    with pytest.raises(ValueError, match="min"):
        InFlightLimit(ceiling=4, adaptive=True, minimum=0)


def test_reconfigure_keeps_the_calls_in_flight_counted() -> None:
    lim = InFlightLimit(ceiling=4, adaptive=False)
    assert lim.try_acquire() is not None
    lim.reconfigure(ceiling=8, adaptive=True, minimum=1, increase=1.0, decrease=0.5)
    # Adaptation turned on starts in slow start; the call in flight is still counted.
    assert (lim.limit, lim.in_flight, lim.adaptive) == (1, 1, True)
    assert lim.try_acquire() is None


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_calls_over_the_limit_wait_their_turn_in_order() -> None:
    clock = FakeClock()
    gate = ProviderGate("main", InFlightLimit(ceiling=1, adaptive=False))
    release = anyio.Event()
    order: list[str] = []

    async def call(name: str) -> str:
        order.append(name)
        if name == "first":
            await release.wait()
        return name

    told: list[tuple[int, int, int]] = []

    async def run(name: str) -> None:
        await gate.run(call(name), clock=clock, wait_s=60.0,
                       on_wait=lambda *seen: told.append(seen))

    async with anyio.create_task_group() as tg:
        tg.start_soon(run, "first")
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(run, "second")
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(run, "third")
        await anyio.wait_all_tasks_blocked()
        assert order == ["first"] and gate.waiting == 2
        release.set()
    assert order == ["first", "second", "third"]
    assert gate.limit.in_flight == 0 and gate.waiting == 0
    assert told == [(1, 1, 1), (1, 1, 2)]  # (limit, in flight, waiting), once each


def test_the_follow_view_shows_a_call_waiting_for_a_slot() -> None:
    st = FollowState("t1")
    st.apply({"type": "model.queued", "ts": 1.0, "turn": "t1", "provider": "primary",
              "limit": 4, "in_flight": 4, "waiting": 12}, None)
    assert st.activity == ("waiting for an in-flight slot on primary: limit 4, 4 in "
                           "flight, 12 waiting")


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_wait_longer_than_the_budget_allows_fails_locally() -> None:
    clock = FakeClock()
    gate = ProviderGate("main", InFlightLimit(ceiling=1, adaptive=False))
    hold = anyio.Event()
    failures: list[CallFailure] = []

    async def held() -> None:
        await gate.run(hold.wait(), clock=clock, wait_s=60.0)

    async def late() -> None:
        async def never() -> None:
            raise AssertionError("a call over the limit was sent")
        call = never()
        try:
            await gate.run(call, clock=clock, wait_s=5.0)
        except ProviderError as exc:
            failures.append(exc.failure)
        assert call.cr_frame is None  # closed unstarted: never awaited, never sent

    async with anyio.create_task_group() as tg:
        tg.start_soon(held)
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(late)
        await clock.settle()  # the 5 s wait runs out
        await anyio.wait_all_tasks_blocked()
        assert len(failures) == 1 and failures[0].local
        assert clock.monotonic() == pytest.approx(5.0)
        hold.set()
    assert gate.waiting == 0 and gate.limit.in_flight == 0


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_429_through_the_gate_cuts_the_adaptive_limit() -> None:
    clock = FakeClock()
    gate = ProviderGate("main", InFlightLimit(ceiling=8, adaptive=True, start=8.0))

    async def throttled() -> None:
        raise ProviderError(CallFailure(status=429, retry_after_s=1.0))

    with pytest.raises(ProviderError) as raised:
        await gate.run(throttled(), clock=clock, wait_s=1.0)
    assert gate.limit.limit == 4
    # Throttling is the limit's to answer: the provider's breaker is not told.
    assert raised.value.failure.local and raised.value.failure.status == 429
    fixed = ProviderGate("main", InFlightLimit(ceiling=8, adaptive=False))
    with pytest.raises(ProviderError) as raised:
        await fixed.run(throttled(), clock=clock, wait_s=1.0)
    assert not raised.value.failure.local
