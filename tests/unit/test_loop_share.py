"""The event loop's share for turn work: the rule (`policy/loop_share.py`) and its edge
(`runtime.LoopGate`): within a turn of the loop, pieces go through until the slice is
spent; the rest wait for later turns, first come first through, and whatever else was
ready (a control request, a timer) runs in between."""

from __future__ import annotations

import asyncio

import pytest

from turnkeeper.policy.loop_share import MAX_FITS, LoopShare
from turnkeeper.runtime import LoopGate


def test_a_turn_lets_work_through_until_its_slice_is_spent() -> None:
    share = LoopShare(slice_s=0.005)
    assert share.ask(10.000)  # the first piece starts the turn's slice
    assert share.ask(10.002)
    assert share.ask(10.0049)
    assert not share.ask(10.005)  # spent
    assert not share.ask(10.001)  # once spent, spent for the rest of the turn
    assert share.fits == 3  # what the slice held


def test_the_next_turn_starts_with_a_whole_slice() -> None:
    share = LoopShare(slice_s=0.005)
    share.ask(1.0)
    assert not share.ask(1.01)
    share.next_turn()
    assert share.ask(5.0)
    assert share.ask(5.004)


def test_the_pieces_let_out_follow_what_a_slice_held() -> None:
    share = LoopShare(slice_s=0.005)
    assert share.to_let_out(100) == 1  # nothing learned yet: one
    for k in range(4):
        share.ask(1.0 + k * 0.001)
    assert not share.ask(1.006)
    assert share.to_let_out(100) == 4
    assert share.to_let_out(2) == 2  # never more than wait


def test_a_turn_that_kept_up_lets_twice_as_many_out_next_time() -> None:
    share = LoopShare(slice_s=0.005)
    share.ask(1.0)
    share.next_turn()  # 1 let through (all it was to let out), the slice not spent
    assert share.fits == 2
    share.ask(2.0)
    share.next_turn()  # fewer than it could let through asked: no growth
    assert share.fits == 2
    share.fits = MAX_FITS
    for _ in range(MAX_FITS):
        share.ask(3.0)
    share.next_turn()
    assert share.fits == MAX_FITS  # bounded


def test_a_turn_that_ran_out_does_not_grow() -> None:
    share = LoopShare(slice_s=0.005)
    share.ask(1.0)
    share.ask(1.001)
    assert not share.ask(1.01)
    share.next_turn()
    assert share.fits == 2


def test_a_piece_let_out_runs_and_the_rule_learns_from_it() -> None:
    share = LoopShare(slice_s=0.005)
    share.fits = 8
    share.let_in(1.000)
    share.let_in(1.003)
    share.let_in(1.006)  # past the slice: it runs all the same (it was let out)
    share.let_in(1.008)
    assert share.fits == 2  # what the slice held
    assert not share.ask(1.009)  # a new piece in this turn is held
    share.next_turn()
    assert share.to_let_out(10) == 2


def test_a_piece_asking_again_uses_the_share_but_is_not_one_more_to_let_out() -> None:
    share = LoopShare(slice_s=0.005)
    assert share.ask(1.000)
    assert share.ask(1.002, again=True)  # the same turn's next step: it goes on
    assert share.ask(1.004, again=True)
    assert share.ask(1.0045)
    assert not share.ask(1.006, again=True)  # the share is spent, for it too
    assert share.fits == 2  # two turns went through, not four steps
    share.next_turn()
    assert share.to_let_out(10) == 2


def test_the_slice_must_be_positive() -> None:
    with pytest.raises(ValueError):
        LoopShare(slice_s=0)


def tiny_gate() -> LoopGate:
    """A gate whose slice any second piece overruns: one piece a turn, then what the
    rule lets out."""
    return LoopGate(LoopShare(slice_s=1e-12))


@pytest.mark.anyio
async def test_work_past_the_slice_waits_and_a_request_runs_in_between() -> None:
    gate = tiny_gate()
    order: list[str] = []

    async def piece(i: int) -> None:
        await gate.through()
        order.append(f"piece {i}")

    loop = asyncio.get_running_loop()
    tasks = [asyncio.create_task(piece(i)) for i in range(10)]
    await asyncio.sleep(0)  # the ten run their first stretch in this turn of the loop
    loop.call_soon(order.append, "request")  # read meanwhile
    await asyncio.gather(*tasks)
    assert order[0] == "piece 0"  # the turn's first piece went through at once
    assert order.index("request") < 5  # answered while most pieces were held
    pieces = [o for o in order if o != "request"]
    assert pieces == [f"piece {i}" for i in range(10)]  # first come, first through
    assert gate.held >= 9
    assert gate.waiting == 0


@pytest.mark.anyio
async def test_a_held_piece_cancelled_does_not_hold_up_the_rest() -> None:
    gate = tiny_gate()
    through: list[int] = []

    async def piece(i: int) -> None:
        await gate.through()
        through.append(i)

    tasks = [asyncio.create_task(piece(i)) for i in range(5)]
    await asyncio.sleep(0)
    assert through == [0] and gate.waiting == 4
    tasks[1].cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert through == [0, 2, 3, 4]
    assert tasks[1].cancelled()


@pytest.mark.anyio
async def test_an_idle_loop_lets_every_piece_through_at_once() -> None:
    gate = LoopGate()  # the default slice: far more than three quick pieces take
    for _ in range(3):
        await gate.through()
    assert gate.held == 0


@pytest.mark.anyio
async def test_a_piece_let_out_goes_on_past_held_ones_while_the_share_lasts() -> None:
    """A turn whose step suspended on nothing asks again in the same turn of the loop:
    it goes on while the share lasts, even with others held (holding it would let one
    more out in its place), and the one still held comes next."""
    clock = [0.0]
    gate = LoopGate(LoopShare(slice_s=0.005), now=lambda: clock[0])
    order: list[str] = []

    async def piece(name: str, steps: int, cost_s: float) -> None:
        last = -1
        for k in range(steps):
            if not gate.passes(last):
                await gate.held_through()
            last = gate.turn
            order.append(f"{name}{k}")
            clock[0] += cost_s

    tasks = [asyncio.create_task(piece("x", 1, 0.006)),  # spends the first share
             asyncio.create_task(piece("a", 3, 0.001)),  # held, then let out alone
             asyncio.create_task(piece("b", 1, 0.001))]  # held behind a
    await asyncio.gather(*tasks)
    # a, let out, runs its three steps in one share; b waited for a later turn.
    assert order == ["x0", "a0", "a1", "a2", "b0"]
    assert gate.held == 2
