"""A step batch as one statement (`postgres_fused`): which batches it holds, and against
a real server that it writes what `postgres_commit.commit` writes, fenced as it fences
(a stale claim fails its own write alone, with every row of it left out; a lapsed
intent is not written; a claim another node commits while the statement waits for the
turn's row is seen), in one round trip and no BEGIN or COMMIT."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anyio
import asyncpg
import pytest
from tests.pg import fresh_database
from tests.pg_wire import CountingProxy
from tests.unit.test_postgres_lock_order import waiting_for_locks

from turnkeeper.events import Event
from turnkeeper.store import postgres_batch as pb
from turnkeeper.store import postgres_fused as pf
from turnkeeper.store.base import MessageRows
from turnkeeper.store.fleet import StaleLease
from turnkeeper.store.postgres import PostgresStore
from turnkeeper.store.postgres_schema import prepare
from turnkeeper.store.writer import TRAIL, MessageWrite


def upd(turn: str, epoch: int | None = None, checkpoint: str | None = None) -> pb.TurnUpdate:
    return pb.TurnUpdate(turn=turn, state="running", updated_at=1.0, record=f'{{"id":"{turn}"}}',
                         stop_code=None, checkpoint=checkpoint,
                         owner=None if epoch is None else "n1", epoch=epoch)


def event(seq: int, turn: str, epoch: int | None = None) -> pb.Statement:
    if epoch is None:
        return (pb.EVENT_INSERT, (seq, turn, 1.0, "turn.step", "{}"))
    return (pb.EVENT_INSERT_FENCED, (seq, turn, 1.0, "turn.step", "{}", epoch))


def outbox(seq: int, turn: str, epoch: int) -> pb.Statement:
    return (pb.OUTBOX_INSERT_FENCED, ("hook", seq, "turn.step", "{}", 1.0, 1.0, 1.0, turn,
                                      epoch))


def intent(key: str, turn: str, epoch: int = 1) -> pb.FencedIntent:
    return pb.FencedIntent(key, turn, "effect", "{}", "n1", epoch)


async def fused(conn: Any, writes: list[list[pb.Op]]) -> list[BaseException | None]:
    batch = pf.fuse(writes)
    assert batch is not None
    return await pf.commit_fused(conn, batch, len(writes))


def test_a_step_batch_is_fused_and_what_it_cannot_hold_is_not() -> None:
    step: list[list[pb.Op]] = [
        [upd("a", 1, "{}"), MessageWrite("a", 0, ('"m"',)),
         MessageWrite("a", 0, ("p",), TRAIL)],
        [event(1, "a", 1), outbox(1, "a", 1)], [intent("k1", "a")],
        [(pf.JOURNAL_OUTCOME, ("{}", "k0"))], [upd("b", 1), (pf.MAIL_TAKEN, ("b",))]]
    assert pf.fuse(step) is not None

    async def call(conn: Any) -> None:
        return None

    assert pf.fuse([[upd("a")], [call]]) is None  # a call: run in place
    assert pf.fuse([[MessageWrite("a", 0, ('"m"',))]]) is None  # rows without their turn's row
    assert pf.fuse([[intent("k1", "a"), event(1, "a", 1)]]) is None  # an intent and more
    assert pf.fuse([[intent("k1", "a")], [(pf.JOURNAL_OUTCOME, ("{}", "k1"))]]) is None
    assert pf.fuse([[upd("a")], [("INSERT INTO meta (key, value) VALUES ($1, $2)",
                                  ("k", 1))]]) is None  # a statement it does not write
    assert pf.fuse([[upd("a")], [upd("a")]]) is None  # two segments


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def url() -> AsyncIterator[str]:
    async with fresh_database() as url:
        c = await asyncpg.connect(url)
        try:
            await prepare(c, "test")
            for turn, epoch in (("a", 1), ("b", 1), ("c", 0)):
                await c.execute("INSERT INTO turns (id, seq, session, state, created_at,"
                                " updated_at, record, owner, epoch, lease_until) VALUES ($1,"
                                " $2, $1, 'queued', 0, 0, '{}', 'n1', $3, now() + interval"
                                " '1 hour')", turn, ord(turn), epoch)
            await c.execute("INSERT INTO mail (turn, kind, body) VALUES ('a', 'cancel', '{}'),"
                            " ('b', 'cancel', '{}')")
        finally:
            await c.close()
        yield url


async def _rows(conn: asyncpg.Connection, sql: str) -> list[tuple[Any, ...]]:
    return [tuple(r) for r in await conn.fetch(sql)]


@pytest.mark.anyio
async def test_a_stale_claim_fails_its_own_write_with_every_row_of_it_left_out(
        url: str) -> None:
    conn = await asyncpg.connect(url)
    try:
        errors = await fused(conn, [
            [upd("a", 1, '{"n":1}'), MessageWrite("a", 0, ('"a0"', '"a1"')),
             MessageWrite("a", 0, ("pa",), TRAIL), event(1, "a", 1), outbox(1, "a", 1),
             (pf.MAIL_TAKEN, ("a",))],
            [upd("b", 7, '{"n":2}'), MessageWrite("b", 0, ('"b0"',)),
             MessageWrite("b", 0, ("pb",), TRAIL), event(2, "b", 7), outbox(2, "b", 7),
             (pf.MAIL_TAKEN, ("b",))],
            [upd("c"), event(3, "c")],
        ])
        assert errors[0] is None and errors[2] is None
        assert isinstance(errors[1], StaleLease)
        assert await _rows(conn, "SELECT id, state, checkpoint FROM turns ORDER BY id") == [
            ("a", "running", '{"n":1}'), ("b", "queued", "{}"), ("c", "running", "{}")]
        assert await _rows(conn, "SELECT turn, idx, data FROM messages ORDER BY idx") == [
            ("a", 0, '"a0"'), ("a", 1, '"a1"')]
        assert await _rows(conn, "SELECT turn, idx, data FROM trail") == [("a", 0, "pa")]
        assert await _rows(conn, "SELECT seq FROM events ORDER BY seq") == [(1,), (3,)]
        assert await _rows(conn, "SELECT seq FROM webhook_outbox") == [(1,)]
        assert await _rows(conn, "SELECT turn FROM mail") == [("b",)]  # b's end not written
    finally:
        await conn.close()


@pytest.mark.anyio
async def test_an_intent_is_written_only_while_its_claim_and_lease_hold(url: str) -> None:
    conn = await asyncpg.connect(url)
    try:
        await conn.execute("UPDATE turns SET lease_until = now() - interval '1 second'"
                           " WHERE id = 'b'")
        errors = await fused(conn, [[intent("k1", "a")], [intent("k2", "b")],
                                    [intent("k3", "a", epoch=5)], [upd("a", 1)],
                                    [(pf.JOURNAL_OUTCOME, ('{"ok":1}', "k0"))]])
        assert errors[0] is None and errors[3] is None and errors[4] is None
        assert isinstance(errors[1], StaleLease) and isinstance(errors[2], StaleLease)
        assert await _rows(conn, "SELECT key FROM journal") == [("k1",)]
    finally:
        await conn.close()


@pytest.mark.anyio
async def test_a_claim_committed_while_the_statement_waits_for_the_row_is_seen(
        url: str) -> None:
    """Another node takes turn a over while this node's batch waits for a's row: the
    batch's update and intent of a see the new epoch (not the statement's snapshot) and
    write nothing of a; b's write commits."""
    other = await asyncpg.connect(url)
    conn = await asyncpg.connect(url)
    try:
        tx = other.transaction()
        await tx.start()
        await other.execute("UPDATE turns SET owner = 'n2', epoch = 2 WHERE id = 'a'")
        errors: list[BaseException | None] = []

        async def write() -> None:
            errors.extend(await fused(conn, [
                [upd("a", 1, '{"n":1}'), MessageWrite("a", 0, ('"a0"',)), event(1, "a", 1)],
                [intent("k1", "a")], [upd("b", 1, '{"n":2}'), event(2, "b", 1)]]))

        async with anyio.create_task_group() as tg:
            tg.start_soon(write)
            await waiting_for_locks(url, 1)  # the batch waits for a's row
            await tx.commit()
        assert isinstance(errors[0], StaleLease) and isinstance(errors[1], StaleLease)
        assert errors[2] is None
        assert await _rows(conn, "SELECT id, checkpoint FROM turns WHERE id IN ('a', 'b')"
                                 " ORDER BY id") == [("a", "{}"), ("b", '{"n":2}')]
        assert await _rows(conn, "SELECT turn FROM messages") == []
        assert await _rows(conn, "SELECT key FROM journal") == []
        assert await _rows(conn, "SELECT seq FROM events") == [(2,)]
    finally:
        await other.close()
        await conn.close()


@pytest.mark.anyio
async def test_a_step_batch_is_one_round_trip_without_begin_or_commit(url: str) -> None:
    proxy = CountingProxy(url).start()
    try:
        conn = await asyncpg.connect(proxy.url())
        try:
            await fused(conn, [[upd("c")]])  # the statement prepared once per connection
            before = proxy.snapshot()
            await fused(conn, [
                [upd("a", 1, "{}"), MessageWrite("a", 0, ('"m"',)),
                 MessageWrite("a", 0, ("p",), TRAIL)],
                [event(1, "a", 1)], [intent("k1", "a")], [(pf.JOURNAL_OUTCOME, ("{}", "k0"))]])
            sent = proxy.snapshot() - before
        finally:
            await conn.close()
    finally:
        proxy.stop()
    assert sent.round_trips == 1 and sent.statements == 1
    assert sent.tags["BEGIN"] == 0 and sent.tags["COMMIT"] == 0


@pytest.mark.anyio
async def test_a_claimed_turns_step_through_the_store_is_one_round_trip_a_write(
        url: str) -> None:
    """Through the store, as a step writes: its checkpoint queued (the row, a message
    row, a trail row) with an event, then its call's intent awaited, then the outcome
    awaited, then the next checkpoint awaited: three commits, three round trips (the
    tree before sent BEGIN, a statement per kind of row and COMMIT: 13)."""
    proxy = CountingProxy(url).start()
    store = PostgresStore(proxy.url(), node_id="n9", lease_s=60.0)
    try:
        async with anyio.create_task_group() as tg:
            await store.open()
            await tg.start(store.run)
            try:
                record = {"id": "t_1", "session": "t_1", "state": "queued", "message": "m",
                          "created_at": 1.0, "updated_at": 1.0, "inbox": []}
                await store.insert_turn(record, {})
                [claimed] = await store.claim(1)
                record = {**claimed.record, "state": "running", "updated_at": 2.0}
                await store.save_turn(record, {"step": 0})  # the statement prepared
                before = proxy.snapshot()
                store.queue_turn(record, {"step": 1}, messages=MessageRows(0, ('"m0"',)),
                                 trail=MessageRows(0, ("p0",)))
                store.append_event(Event(seq=1, turn="t_1", ts=2.0, type="turn.step",
                                         data={}))
                await store.journal_intent("k1", turn="t_1", tool="effect", arguments="{}",
                                           idempotent=False)
                await store.journal_outcome("k1", {"ok": True})
                await store.save_turn(record, {"step": 2},
                                      messages=MessageRows(1, ('"m1"',)))
                sent = proxy.snapshot() - before
            finally:
                await store.close()
    finally:
        proxy.stop()
    assert sent.round_trips == 3 and sent.tags["BEGIN"] == 0
    conn = await asyncpg.connect(url)
    try:
        assert await conn.fetchval("SELECT checkpoint FROM turns WHERE id = 't_1'") == (
            '{"step":2}')
        assert await _rows(conn, "SELECT idx, data FROM messages WHERE turn = 't_1'"
                                 " ORDER BY idx") == [
            (0, '"m0"'), (1, '"m1"')]
        assert await _rows(conn, "SELECT key, outcome FROM journal") == [("k1", '{"ok":true}')]
        assert await _rows(conn, "SELECT seq FROM events WHERE turn = 't_1' AND seq = 1") == [
            (1,)]
    finally:
        await conn.close()
