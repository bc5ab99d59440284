"""A turn's checkpoint queued, not awaited (`queue_turn`), and the writer's queue that
carries it: on SQLite (a real file, its writer task running), PostgreSQL (a fresh
database on the test server) and the memory store.

A queued checkpoint commits in order before any later write of its turn; one that a
newer checkpoint of the turn supersedes before its commit is dropped and its message
rows go with the newer one; event rows queued back to back make one write.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import pytest
from tests.unit.test_store_conformance import (  # noqa: F401 - fixtures `anyio_backend`, `store`
    anyio_backend,
    every_store,
)

from turnkeeper.events import Event
from turnkeeper.store.base import MessageRows, QueuesTurns
from turnkeeper.store.memory import MemoryStore
from turnkeeper.store.postgres import PostgresStore
from turnkeeper.store.sqlite import SQLiteStore
from turnkeeper.store.writer import TRAIL, MessageWrite, join_messages

pytestmark = pytest.mark.anyio

Queueing = SQLiteStore | MemoryStore | PostgresStore


def record(state: str, at: float) -> dict[str, Any]:
    return {"id": "t_a", "session": "t_a", "state": state, "message": "m",
            "created_at": 1.0, "updated_at": at, "inbox": []}


def checkpoint(count: int, step: int) -> dict[str, Any]:
    return {"conversation": {"count": count, "turn_start": 0}, "step": step}


def rows(start: int, *texts: str) -> MessageRows:
    return MessageRows(start, tuple(json.dumps({"role": "user", "content": t})
                                    for t in texts))


def contents(cp: dict[str, Any] | None) -> list[str]:
    assert cp is not None
    return [m["content"] for m in cp["conversation"]["messages"]]


async def test_every_store_queues_checkpoints(store: Queueing) -> None:
    assert isinstance(store, QueuesTurns)


async def test_a_queued_checkpoint_is_stored_by_the_next_durable_write(
        store: Queueing) -> None:
    await store.insert_turn(record("queued", 1.0), {})
    assert store.queue_turn(record("running", 2.0), checkpoint(2, 1),
                            messages=rows(0, "task", "step 1"))
    await store.flush()
    got = await store.get_turn("t_a")
    assert got is not None and got["state"] == "running" and got["updated_at"] == 2.0
    cp = await store.get_checkpoint("t_a")
    assert cp is not None and cp["step"] == 1 and contents(cp) == ["task", "step 1"]


async def test_a_superseded_checkpoint_is_dropped_and_its_rows_go_with_the_newer_one(
        store: Queueing) -> None:
    await store.insert_turn(record("queued", 1.0), {})
    # No await between them: the writer cannot take the first before the second comes.
    store.queue_turn(record("running", 2.0), checkpoint(2, 1), messages=rows(0, "a", "b"))
    store.queue_turn(record("running", 3.0), checkpoint(3, 2), messages=rows(2, "c"))
    await store.save_turn(record("running", 4.0), checkpoint(4, 3), messages=rows(3, "d"))
    if not isinstance(store, MemoryStore):
        assert store.superseded == 2
    cp = await store.get_checkpoint("t_a")
    assert cp is not None and cp["step"] == 3 and contents(cp) == ["a", "b", "c", "d"]


async def test_a_queued_checkpoint_commits_before_a_later_write_of_its_turn(
        store: Queueing) -> None:
    await store.insert_turn(record("queued", 1.0), {})
    store.queue_turn(record("running", 2.0), checkpoint(1, 1), messages=rows(0, "task"))
    message = {"kind": "steer", "text": "left", "redirect": False, "at": 3.0}
    await store.append_message("t_a", message, updated_at=3.0)
    got = await store.get_turn("t_a")
    # The steer joined the inbox of the queued record, not of the one before it.
    assert got is not None and got["state"] == "running"
    assert [m["text"] for m in got["inbox"]] == ["left"]
    assert contents(await store.get_checkpoint("t_a")) == ["task"]


async def test_a_record_only_write_does_not_supersede_a_queued_checkpoint(
        store: Queueing) -> None:
    await store.insert_turn(record("queued", 1.0), {})
    store.queue_turn(record("running", 2.0), checkpoint(1, 1), messages=rows(0, "task"))
    await store.save_turn({**record("completed", 3.0), "result": {"status": "completed"}})
    got = await store.get_turn("t_a")
    assert got is not None and got["state"] == "completed"
    cp = await store.get_checkpoint("t_a")
    assert cp is not None and cp["step"] == 1 and contents(cp) == ["task"]


async def test_nothing_is_queued_once_the_store_is_closed(tmp_path: Path) -> None:
    for backend in (SQLiteStore(tmp_path / "closed.db"), MemoryStore()):
        await backend.open()
        async with anyio.create_task_group() as tg:
            await tg.start(backend.run)
            await backend.insert_turn(record("queued", 1.0), {})
            await backend.close()
        assert not backend.queue_turn(record("running", 2.0), checkpoint(0, 1))


async def test_event_rows_queued_back_to_back_make_one_write(tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "state.db")
    await store.open()
    async with anyio.create_task_group() as tg:
        await tg.start(store.run)
        try:
            await store.insert_turn(record("queued", 1.0), {})
            for seq in (1, 2, 3, 2, 4):  # a number is stored once
                store.append_event(Event(seq=seq, ts=float(seq), type="turn.step",
                                         turn="t_a", data={"n": seq}))
            assert len(store.writer._queue) == 1 and len(store.writer._queue[0].ops) == 5
            store.queue_turn(record("running", 2.0), checkpoint(0, 1))
            store.append_event(Event(seq=5, ts=5.0, type="turn.step", turn="t_a",
                                     data={"n": 5}))
            assert len(store.writer._queue) == 3  # an event after a checkpoint starts a write
            await store.flush()
            events = await store.events(turn="t_a")
            assert [(e["seq"], e["n"]) for e in events] == [(1, 1), (2, 2), (3, 3),
                                                              (4, 4), (5, 5)]
        finally:
            await store.close()


def test_a_dropped_checkpoint_s_rows_join_the_newer_rows_they_run_on_to() -> None:
    head = ("UPDATE turns ...", ())
    a01, a2 = MessageWrite("t_a", 0, ("m0", "m1")), MessageWrite("t_a", 2, ("m2",))
    # Running on, or rewriting the last of them: one conversation write.
    assert join_messages([a01], [head, a2]) == [head, MessageWrite("t_a", 0, ("m0", "m1", "m2"))]
    assert join_messages([a01], [head, MessageWrite("t_a", 1, ("x",))]) == [
        head, MessageWrite("t_a", 0, ("m0", "x"))]
    # A gap, a rewrite from before them, or rows that are not a MessageWrite: both go,
    # the dropped ones first.
    for newer in (MessageWrite("t_a", 3, ("m3",)), MessageWrite("t_b", 2, ("m2",))):
        assert join_messages([a01], [head, newer]) == [head, a01, newer]
    assert join_messages([("DELETE ...", ())], [head, a2]) == [head, ("DELETE ...", ()), a2]


def test_a_joined_write_trims_when_either_write_did() -> None:
    """Rows past the joined write's end may be stored when they were past the end of
    either: a compaction between the two (the newer one trims) or before the first."""
    head = ("UPDATE turns ...", ())
    a01 = MessageWrite("t_a", 0, ("m0", "m1"), trims=False, turn_no=7)
    assert join_messages([a01], [head, MessageWrite("t_a", 2, ("m2",), trims=False,
                                                    turn_no=7)]) == [
        head, MessageWrite("t_a", 0, ("m0", "m1", "m2"), trims=False, turn_no=7)]
    assert join_messages([a01], [head, MessageWrite("t_a", 1, ("x",), turn_no=7)]) == [
        head, MessageWrite("t_a", 0, ("m0", "x"), trims=True, turn_no=7)]
    assert join_messages([MessageWrite("t_a", 0, ("m0",))], [
        head, MessageWrite("t_a", 1, ("m1",), trims=False)]) == [
        head, MessageWrite("t_a", 0, ("m0", "m1"), trims=True)]


def test_a_dropped_checkpoint_s_trail_rows_join_the_newer_trail_rows() -> None:
    """Each list joins its own: the dropped messages with the newer messages, the dropped
    trail lines with the newer trail lines, never one list's rows with the other's."""
    head = ("UPDATE turns ...", ())
    m01, m2 = MessageWrite("t_a", 0, ("m0", "m1")), MessageWrite("t_a", 2, ("m2",))
    t0, t1 = MessageWrite("t_a", 0, ("pa",), TRAIL), MessageWrite("t_a", 1, ("lb",), TRAIL)
    assert join_messages([m01, t0], [head, m2, t1]) == [
        head, MessageWrite("t_a", 0, ("m0", "m1", "m2")),
        MessageWrite("t_a", 0, ("pa", "lb"), TRAIL)]
    # The newer checkpoint added no trail line: the dropped ones still go, ahead of it.
    assert join_messages([m01, t0], [head, m2]) == [
        head, t0, MessageWrite("t_a", 0, ("m0", "m1", "m2"))]
    # Trail rows never join message rows at the same index.
    assert join_messages([MessageWrite("t_a", 2, ("x",), TRAIL)], [head, m2]) == [
        head, MessageWrite("t_a", 2, ("x",), TRAIL), m2]


async def test_a_superseded_checkpoint_s_trail_goes_with_the_newer_one(
        store: Queueing) -> None:
    await store.insert_turn(record("queued", 1.0), {})
    store.queue_turn(record("running", 2.0), {**checkpoint(2, 1), "trail": {"count": 2}},
                     messages=rows(0, "a", "b"), trail=MessageRows(0, ("pa", "lb")))
    await store.save_turn(record("running", 3.0), {**checkpoint(3, 2), "trail": {"count": 3}},
                          messages=rows(2, "c"), trail=MessageRows(2, ("ec",)))
    cp = await store.get_checkpoint("t_a")
    assert cp is not None and cp["trail"]["rows"] == ["pa", "lb", "ec"]
    assert contents(cp) == ["a", "b", "c"]
