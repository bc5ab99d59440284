"""A scope whose deadline is set part-way (`Clock.scope` and `Clock.set_deadline`), on
both clocks: cut at its deadline, at once for a deadline already passed, not at all
without one, and forgotten by the fake clock once left; on the system clock, the
deadlines of many scopes on one shared timer, each cut at its own, a deadline set again
replacing the first, and the scopes left in time neither cut nor kept."""

from __future__ import annotations

import anyio
import anyio.lowlevel
import pytest

from turnkeeper import clock
from turnkeeper.clock import SWEEP_AT, FakeClock, SystemClock

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_a_fake_deadline_set_inside_cuts_the_scope_when_time_reaches_it() -> None:
    clock = FakeClock()
    results: list[bool] = []

    async def call() -> None:
        with clock.scope() as scope:
            await clock.sleep(5)  # not cut: no deadline yet
            clock.set_deadline(scope, 10)
            await anyio.sleep_forever()
        results.append(scope.cancelled_caught)

    async with anyio.create_task_group() as tg:
        tg.start_soon(call)
        while not results:
            assert await clock.settle()
    assert results == [True]
    assert clock.monotonic() == 15.0
    assert clock.next_timer_in is None  # the scope's timer went with it


async def test_a_fake_deadline_set_again_replaces_the_first_and_one_passed_cuts_at_once(
        ) -> None:
    clock = FakeClock()
    with clock.scope() as scope:
        clock.set_deadline(scope, 10)
        clock.set_deadline(scope, 20)
        assert clock.next_timer_in == 20.0
        clock.advance(10)
        assert not scope.cancel_called
    assert clock.next_timer_in is None
    with clock.scope() as scope:
        clock.set_deadline(scope, 0)
        await anyio.lowlevel.checkpoint()  # the cancellation is delivered here
    assert scope.cancelled_caught


async def test_a_fake_scope_without_a_deadline_is_left_as_entered() -> None:
    clock = FakeClock()
    with clock.scope() as scope:
        await anyio.lowlevel.checkpoint()
    assert not scope.cancelled_caught
    assert clock.next_timer_in is None


async def test_a_system_deadline_set_inside_cuts_the_scope() -> None:
    clock = SystemClock()
    with clock.scope() as scope:
        clock.set_deadline(scope, 0.01)
        await anyio.sleep_forever()
    assert scope.cancelled_caught
    with clock.scope() as scope:
        await anyio.lowlevel.checkpoint()
    assert not scope.cancelled_caught


async def test_system_deadlines_share_one_timer_each_scope_cut_at_its_own() -> None:
    clock = SystemClock()
    cut: dict[str, bool] = {}

    async def call(name: str, seconds: float) -> None:
        with clock.scope() as scope:
            clock.set_deadline(scope, seconds)
            await anyio.sleep_forever()
        cut[name] = scope.cancelled_caught

    async with anyio.create_task_group() as tg:
        tg.start_soon(call, "late", 0.05)
        tg.start_soon(call, "early", 0.01)  # earlier than the timer set: set again
    assert cut == {"late": True, "early": True}


async def test_a_system_deadline_set_again_replaces_the_first() -> None:
    clock = SystemClock()
    with clock.scope() as scope:
        clock.set_deadline(scope, 0.01)
        clock.set_deadline(scope, 3600)
        assert scope.deadline == pytest.approx(anyio.current_time() + 3600, abs=1)
        await anyio.sleep(0.05)  # past the first: not cut
    assert not scope.cancel_called
    with clock.scope() as scope:
        clock.set_deadline(scope, 3600)
        clock.set_deadline(scope, 0.01)  # earlier: cut at it
        await anyio.sleep_forever()
    assert scope.cancelled_caught


async def test_a_system_scope_left_in_time_is_not_cut_and_not_kept() -> None:
    clock = SystemClock()
    with clock.scope() as left:
        clock.set_deadline(left, 0.01)
    for _ in range(1000):  # calls that end long before their bound
        with clock.scope() as scope:
            clock.set_deadline(scope, 3600)
            await anyio.lowlevel.checkpoint()
        assert not scope.cancelled_caught
    await anyio.sleep(0.05)  # past the first scope's deadline: it is left, not cut
    assert not left.cancel_called
    deadlines = clock._deadlines
    assert deadlines is not None
    assert len(deadlines.heap) <= 2 * SWEEP_AT  # swept of the scopes left


def test_the_installed_anyio_keeps_the_scope_fields_the_shared_deadlines_read() -> None:
    """Else set_deadline falls back to anyio's own deadline, a loop timer each: correct,
    but the cost the shared timer saves comes back (a release moved them)."""
    assert clock.SHARED_DEADLINES
