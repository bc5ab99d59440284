from __future__ import annotations

import random

from turnkeeper.policy.scheduler import Dispatch, Refusal, SessionScheduler, queue_full


def scheduler(max_concurrent: int = 2, max_queued: int = 10) -> SessionScheduler:
    return SessionScheduler(max_concurrent=max_concurrent, max_queued=max_queued)


def test_turns_of_one_session_run_one_at_a_time_in_submission_order() -> None:
    s = scheduler(max_concurrent=4)
    s.enqueue("a1", "A")
    s.enqueue("a2", "A")
    s.enqueue("b1", "B")
    assert s.dispatch(intake_open=True) == Dispatch(started=("a1", "b1"))
    assert list(s.queue) == ["a2"] and s.running_sessions == {"A", "B"}
    assert s.dispatch(intake_open=True) == Dispatch()
    s.finished("a1")
    assert s.dispatch(intake_open=True) == Dispatch(started=("a2",))


def test_no_more_than_max_concurrent_hold_a_slot() -> None:
    s = scheduler(max_concurrent=2)
    for t in ("x", "y", "z"):
        s.enqueue(t, t)
    assert s.dispatch(intake_open=True).started == ("x", "y")
    assert s.active == 2 and list(s.queue) == ["z"]
    s.finished("y")
    assert s.dispatch(intake_open=True).started == ("z",)


def test_a_parked_turn_gives_its_slot_back_keeps_its_session_and_wakes_first() -> None:
    s = scheduler(max_concurrent=1)
    s.enqueue("p", "S")
    s.enqueue("p2", "S")
    s.enqueue("q", "Q")
    assert s.dispatch(intake_open=True).started == ("p",)
    assert s.release_slot("p") and not s.release_slot("p")
    assert s.dispatch(intake_open=True).started == ("q",)  # not p2: S is still taken
    assert s.running == 2 and s.active == 1
    s.want_slot("p")
    assert s.dispatch(intake_open=True) == Dispatch()  # q holds the only slot
    s.finished("q")
    assert s.dispatch(intake_open=True) == Dispatch(woken=("p",))
    assert s.holds_slot("p")


def test_closed_intake_holds_queued_turns_but_not_woken_ones() -> None:
    s = scheduler(max_concurrent=2)
    s.enqueue("p", "P")
    s.dispatch(intake_open=True)
    s.release_slot("p")
    s.enqueue("n", "N")
    s.want_slot("p")
    assert s.dispatch(intake_open=False) == Dispatch(woken=("p",))
    assert list(s.queue) == ["n"]


def test_stop_wanting_withdraws_a_slot_request() -> None:
    s = scheduler(max_concurrent=1)
    s.enqueue("p", "P")
    s.dispatch(intake_open=True)
    s.release_slot("p")
    s.want_slot("p")
    s.stop_wanting("p")
    assert s.dispatch(intake_open=True) == Dispatch()


def queue_refusal(s: SessionScheduler) -> Refusal | None:
    """What intake answers a submit with this scheduler's queue."""
    return queue_full(len(s.queue), max_queued=s.max_queued, running=s.running)


def test_the_queue_limit_refuses_with_a_retry_after_per_running_turn() -> None:
    s = scheduler(max_concurrent=1, max_queued=3)
    assert queue_refusal(s) is None
    for t in ("a", "b", "c", "d"):
        s.enqueue(t, t)
    refusal = queue_refusal(s)
    assert refusal is not None and refusal.retry_after_s == 4
    assert "4 turns waiting" in refusal.reason
    s.dispatch(intake_open=True)  # one running, three queued
    refusal = queue_refusal(s)
    assert refusal is not None and refusal.retry_after_s == 3


def test_retry_after_is_between_one_second_and_a_minute() -> None:
    s = scheduler(max_concurrent=1, max_queued=0)
    refusal = queue_refusal(s)
    assert refusal is not None and refusal.retry_after_s == 1
    for i in range(500):
        s.enqueue(f"t{i}", f"s{i}")
    refusal = queue_refusal(s)
    assert refusal is not None and refusal.retry_after_s == 60


def test_dequeue_and_enqueue_first() -> None:
    s = scheduler(max_concurrent=1)
    s.enqueue("new", "N")
    s.enqueue("gone", "G")
    assert s.dequeue("gone") and not s.dequeue("gone")
    s.enqueue_first([("r1", "R1"), ("r2", "R2")])
    assert list(s.queue) == ["r1", "r2", "new"]
    assert s.dispatch(intake_open=True).started == ("r1",)


def test_new_limits_apply_from_the_next_decision() -> None:
    s = scheduler(max_concurrent=1, max_queued=1)
    s.enqueue("a", "A")
    s.enqueue("b", "B")
    s.set_limits(max_concurrent=2, max_queued=5)
    assert queue_refusal(s) is None
    assert s.dispatch(intake_open=True).started == ("a", "b")


def test_a_pause_holds_queued_turns_not_woken_ones_and_the_queue_still_fills() -> None:
    s = scheduler(max_concurrent=2)
    s.enqueue("p", "P")
    s.dispatch(intake_open=True)
    s.release_slot("p")
    s.paused = True
    s.enqueue("n", "N")
    assert queue_refusal(s) is None  # submits are still taken
    s.want_slot("p")
    assert s.dispatch(intake_open=True) == Dispatch(woken=("p",))
    assert list(s.queue) == ["n"]
    s.paused = False
    assert s.dispatch(intake_open=True) == Dispatch(started=("n",))


def test_the_busy_sessions_follow_every_start_and_finish() -> None:
    """The sessions taken are kept as turns start and end, not recomputed: after any mix
    of submits, dispatches, parks, wake-ups, cancels and finishes they are exactly the
    sessions of the turns with a task, and no session ever runs two turns at once."""
    rng = random.Random(7)
    s = scheduler(max_concurrent=5, max_queued=1000)
    running: dict[str, str] = {}
    for i in range(3000):
        op = rng.random()
        if op < 0.35:
            s.enqueue(f"t{i}", f"S{rng.randrange(8)}")
        elif op < 0.5 and s.queue:
            s.dequeue(rng.choice(list(s.queue)))
        elif op < 0.75 and running:
            turn = rng.choice(sorted(running))
            s.finished(turn)
            del running[turn]
        elif op < 0.85 and running:
            turn = rng.choice(sorted(running))
            if not s.release_slot(turn):
                s.want_slot(turn)
        plan = s.dispatch(intake_open=True)
        for turn in plan.started:
            assert s._session_of[turn] not in running.values()
            running[turn] = s._session_of[turn]
        assert s.running_sessions == frozenset(running.values())
        assert s.running == len(running)
