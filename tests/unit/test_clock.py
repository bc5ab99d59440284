"""A scope whose deadline is set part-way (`Clock.scope` and `Clock.set_deadline`), on
both clocks: cut at its deadline, at once for a deadline already passed, not at all
without one, and forgotten by the fake clock once left."""

from __future__ import annotations

import anyio
import anyio.lowlevel
import pytest

from turnkeeper.clock import FakeClock, SystemClock

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
