"""The steps' writer on PostgreSQL keeps up to two transactions in flight, never two that
write rows of the same turn: which turns a write touches (`turns_of`), which queued
writes may go in flight beside the transactions already there (`_take`), and against a
real server that a step's commit does not wait for another turn's transaction in
flight."""

from __future__ import annotations

import anyio
import asyncpg
import pytest
from tests.unit.test_postgres_lock_order import running, waiting_for_locks

from turnkeeper.store import postgres_batch as pb
from turnkeeper.store import postgres_fused as pf
from turnkeeper.store.postgres import PostgresStore
from turnkeeper.store.postgres_conn import PgConnection
from turnkeeper.store.postgres_writer import StepWriter, _Flight, turns_of
from turnkeeper.store.writer import MessageWrite, Write


def upd(turn: str) -> pb.TurnUpdate:
    return pb.TurnUpdate(turn, "running", 1.0, "{}", None)


def event(seq: int, turn: str | None) -> pb.Statement:
    return (pb.EVENT_INSERT, (seq, turn, 1.0, "turn.step", "{}"))


def test_the_turns_a_write_touches_and_the_writes_that_may_touch_anything() -> None:
    assert turns_of([upd("a"), MessageWrite("a", 0, ("x",)), event(1, "b")]) == {"a", "b"}
    assert turns_of([event(1, None)]) == set()  # an event of no turn: no turn's rows
    assert turns_of([(pf.JOURNAL_OUTCOME_OF, ("{}", "k", "c"))]) == {"c"}
    assert turns_of([(pf.MAIL_TAKEN, ("d",))]) == {"d"}
    assert turns_of([]) is None  # a flush: after everything before it
    assert turns_of([(pf.JOURNAL_OUTCOME, ("{}", "k"))]) is None  # its turn unknown
    assert turns_of([("INSERT INTO meta (key, value) VALUES ($1, $2)", ("k", 1))]) is None


def _writer(*writes: list[pb.Op]) -> StepWriter:
    w = StepWriter(PgConnection("postgresql://unset/", clock=None, fatal_after=1.0,
                                pool_size=1, node_id="n"))
    for ops in writes:
        w._queue.append(Write(ops))
    return w


def test_a_write_of_a_turn_in_flight_waits_and_so_do_that_turns_later_writes() -> None:
    w = _writer([upd("a")], [upd("b"), event(1, "a")], [upd("c")], [event(2, "b")],
                [upd("d")])
    w._flights.append(_Flight({"a"}, False))
    batch, flight = w._take()
    # b's write also writes a's event: it waits, and b's later event with it
    assert [list(x.ops) for x in batch] == [[upd("c")], [upd("d")]]
    assert flight.turns == {"c", "d"} and not flight.alone
    assert [list(x.ops) for x in w._queue] == [[upd("a")], [upd("b"), event(1, "a")],
                                              [event(2, "b")]]


def test_a_write_that_may_touch_anything_goes_alone_after_everything_before_it() -> None:
    w = _writer([upd("a")], [], [upd("b")])
    w._flights.append(_Flight({"z"}, False))
    batch, _ = w._take()
    assert [list(x.ops) for x in batch] == [[upd("a")]]  # the flush waits for the flight
    assert [list(x.ops) for x in w._queue] == [[], [upd("b")]]
    w._flights.clear()
    batch, flight = w._take()  # nothing in flight: it goes, with what follows it
    assert [list(x.ops) for x in batch] == [[], [upd("b")]] and flight.alone


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_a_turns_commit_goes_beside_another_turns_transaction_in_flight(
        db: str) -> None:
    """Turn a's commit waits for a row lock someone else holds; turn b's commit, queued
    after it, goes in flight beside it and commits (with one transaction at a time it
    waited for a's)."""
    store = PostgresStore(db, node_id="n0", lease_s=60.0)
    other = await asyncpg.connect(db)
    try:
        async with anyio.create_task_group() as tg:
            await store.open()
            await tg.start(store.run)
            for turn_id in ("t_a", "t_b"):
                await store.insert_turn({**running(turn_id), "state": "queued"}, {})
            assert len(await store.claim(2)) == 2
            tx = other.transaction()
            await tx.start()
            await other.execute("SELECT 1 FROM turns WHERE id = 't_a' FOR UPDATE")
            done: list[str] = []
            a_done = anyio.Event()

            async def save(turn_id: str) -> None:
                await store.save_turn(running(turn_id), {"n": 1})
                done.append(turn_id)
                if turn_id == "t_a":
                    a_done.set()

            tg.start_soon(save, "t_a")
            try:
                await waiting_for_locks(db, 1)  # a's commit waits for the held row
                with anyio.fail_after(30):  # a guard against a hang, not a timing
                    await save("t_b")
                assert done == ["t_b"]
            finally:
                await tx.rollback()
            with anyio.fail_after(30):
                await a_done.wait()
            await store.close()
    finally:
        await other.close()
    assert done == ["t_b", "t_a"]


