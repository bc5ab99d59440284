"""How a group commit on PostgreSQL is cut into set-based statements: the pure building
(segments, the one UPDATE, one rows statement per list (conversation, trail), which
writes are stale), then `commit` itself against a real server, where a stale claim fails
only its own write."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest
from tests.pg import fresh_database

from turnkeeper.store import postgres_batch as pb
from turnkeeper.store.fleet import StaleLease
from turnkeeper.store.postgres_commit import commit
from turnkeeper.store.postgres_schema import prepare
from turnkeeper.store.writer import TRAIL, MessageWrite


def upd(turn: str, epoch: int | None = None, checkpoint: str | None = None) -> pb.TurnUpdate:
    return pb.TurnUpdate(turn=turn, state="running", updated_at=1.0, record=f'{{"id":"{turn}"}}',
                         stop_code=None, checkpoint=checkpoint,
                         owner=None if epoch is None else "n1", epoch=epoch)


def event(seq: int, turn: str) -> pb.Statement:
    return (pb.EVENT_INSERT, (seq, turn, 1.0, "turn.step", "{}"))


JOURNAL = ("INSERT INTO journal (key, turn, tool, arguments, idempotent)"
           " VALUES ($1, $2, $3, $4, $5) ON CONFLICT (key) DO NOTHING")


async def noop(conn: Any) -> None:
    return None


def test_a_step_of_many_turns_is_one_segment() -> None:
    writes: list[list[pb.Op]] = [
        [upd(f"t{n}", 1), MessageWrite(f"t{n}", 2, ("{}",)), event(n, f"t{n}")]
        for n in range(50)]
    writes.append([(JOURNAL, ("k", "t1", "echo", "{}", True))])
    parts = pb.segments(writes)
    assert len(parts) == 1
    seg = parts[0]
    assert isinstance(seg, pb.Segment)
    assert [i for i, _ in seg.updates] == list(range(50))
    assert len(seg.messages) == 50 and len(seg.statements) == 51


def test_segments_end_at_a_call_a_second_write_of_a_turn_and_an_ordered_statement() -> None:
    prune = ("DELETE FROM turns WHERE id = $1", ("t9",))
    writes: list[list[pb.Op]] = [[upd("a")], [upd("b")], [noop], [upd("a")], [upd("a")],
                                 [prune], [(JOURNAL, ("k", "a", "x", "{}", True))],
                                 [upd("c")]]
    parts = pb.segments(writes)
    shapes = [("call" if isinstance(p, tuple) else [i for i, _ in p.updates])
              for p in parts]
    # a and b together; the call alone, in place; a's second write after its first;
    # nothing passes the DELETE (the journal entry may follow it in its segment).
    assert shapes == [[0, 1], "call", [3], [4], [7]]
    assert [i for i, _ in parts[3].statements] == [5, 6]  # type: ignore[union-attr]


def test_the_turn_update_is_one_statement_with_a_column_per_field() -> None:
    sql, args = pb.turn_update([upd("b", 3, checkpoint="{}"), upd("a")])
    assert "UPDATE turns" in sql and "unnest(" in sql and "RETURNING t.id" in sql
    assert args[0] == ["b", "a"]
    assert args[5] == ["{}", None]  # no checkpoint: the stored one kept (COALESCE)
    assert args[6] == ["n1", None] and args[7] == [3, None]
    # its rows are locked first, in id order, whatever the order of the batch
    assert "ORDER BY t.id FOR UPDATE" in sql and args[8] == ["a", "b"]


def test_a_batch_that_locks_turn_rows_at_several_points_takes_every_lock_first() -> None:
    async def nothing(_conn: object) -> None:
        return None

    check = pb.TurnCall("a", nothing)
    # one update segment: it locks its own rows, nothing up front
    one = pb.batch_locks(pb.segments([[upd("c")], [upd("b")]]))
    assert not one.up_front
    # an update, then a lease check of another turn, then a second write of c: one
    # ordered lock of a, b and c, taken by the first update
    several = pb.batch_locks(pb.segments([[upd("c")], [upd("b")], [check], [upd("c")]]))
    assert several.up_front and several.first_is_update
    assert (several.turns, several.points) == (["a", "b", "c"], 3)
    # the lease check first: the locks go ahead of it (LOCK_TURNS)
    first = pb.batch_locks(pb.segments([[check], [upd("b")]]))
    assert first.up_front and not first.first_is_update and first.turns == ["a", "b"]


def test_conversation_rows_of_every_turn_in_one_statement() -> None:
    [(sql, args)] = pb.message_upsert([MessageWrite("a", 2, ("x", "y")),
                                       MessageWrite("b", 0, ())])
    assert sql == pb.MESSAGE_UPSERT and sql.count("unnest(") == 2
    assert args == (["a", "b"], [4, 0], ["a", "a"], [2, 3], ["x", "y"])


def test_a_turns_messages_and_trail_share_a_segment_and_get_one_statement_per_table(
        ) -> None:
    writes: list[list[pb.Op]] = [
        [upd("a", 1), MessageWrite("a", 2, ("m2",)), MessageWrite("a", 0, ("p0", "p1"), TRAIL)],
        [upd("b", 1), MessageWrite("b", 1, ("p1",), TRAIL), MessageWrite("b", 0, ("m0",))],
    ]
    [seg] = pb.segments(writes)
    assert isinstance(seg, pb.Segment) and len(seg.messages) == 4
    upserts = pb.message_upsert([m for _, m in seg.messages])
    assert [sql for sql, _ in upserts] == [pb.MESSAGE_UPSERT, pb.TRAIL_UPSERT]
    assert "INTO messages " in pb.MESSAGE_UPSERT and "trail" not in pb.MESSAGE_UPSERT
    assert "INTO trail " in pb.TRAIL_UPSERT and "messages" not in pb.TRAIL_UPSERT
    assert upserts[0][1] == (["a", "b"], [3, 1], ["a", "b"], [2, 0], ["m2", "m0"])
    assert upserts[1][1] == (["a", "b"], [2, 2], ["a", "a", "b"], [0, 1, 1],
                             ["p0", "p1", "p1"])


def test_only_trail_rows_are_one_trail_statement() -> None:
    [(sql, args)] = pb.message_upsert([MessageWrite("a", 3, ("x",), TRAIL)])
    assert sql == pb.TRAIL_UPSERT
    assert args == (["a"], [4], ["a"], [3], ["x"])
    assert pb.message_upsert([]) == []


def test_a_second_write_of_the_same_list_of_a_turn_starts_a_new_segment() -> None:
    writes: list[list[pb.Op]] = [
        [MessageWrite("a", 0, ("p0",), TRAIL)],
        [MessageWrite("a", 0, ("m0",))],         # a's other list: same segment
        [MessageWrite("a", 1, ("p1",), TRAIL)],  # a's trail again: a new one
        [MessageWrite("b", 0, ("q0",), TRAIL)],
        [MessageWrite("a", 2, ("p2",), TRAIL)],  # a's trail a third time: a third one
    ]
    parts = pb.segments(writes)
    assert all(isinstance(p, pb.Segment) for p in parts)
    assert [[(i, m.turn, m.table) for i, m in p.messages]  # type: ignore[union-attr]
            for p in parts] == [
        [(0, "a", "trail"), (1, "a", "messages")],
        [(2, "a", "trail"), (3, "b", "trail")],
        [(4, "a", "trail")],
    ]


def test_a_write_to_any_other_table_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown tables"):
        pb.message_upsert([MessageWrite("a", 0, ("x",), "turns; DROP TABLE turns")])


def test_only_fenced_updates_the_database_did_not_return_are_stale() -> None:
    updates = [(0, upd("a", 1)), (1, upd("b", 2)), (2, upd("c"))]
    assert pb.stale_writes(updates, {"a"}) == {1: updates[1][1]}
    assert pb.stale_writes(updates, {"a", "b"}) == {}


def test_runs_group_consecutive_statements_of_one_shape() -> None:
    a, b = ("A", (1,)), ("B", (2,))
    assert pb.runs([a, a, b, a]) == [("A", [(1,), (1,)]), ("B", [(2,)]), ("A", [(1,)])]


# -- against a real server ------------------------------------------------------------


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
async def conn() -> AsyncIterator[asyncpg.Connection]:
    async with fresh_database() as url:
        c = await asyncpg.connect(url)
        try:
            await prepare(c, "test")
            for turn, epoch in (("a", 1), ("b", 1), ("c", 0)):
                await c.execute("INSERT INTO turns (id, seq, session, state, created_at,"
                                " updated_at, record, owner, epoch) VALUES ($1, $2, $1,"
                                " 'queued', 0, 0, '{}', 'n1', $3)", turn, ord(turn), epoch)
            yield c
        finally:
            await c.close()


@pytest.mark.anyio
async def test_a_stale_claim_fails_its_own_write_and_the_rest_commit(
        conn: asyncpg.Connection) -> None:
    writes: list[list[pb.Op]] = [
        [upd("a", 1, '{"n":1}'), MessageWrite("a", 0, ('"a0"', '"a1"')), event(1, "a")],
        [upd("b", 7, '{"n":2}'), MessageWrite("b", 0, ('"b0"',)), event(2, "b")],
        [upd("c"), event(3, "c")],
    ]
    errors = await commit(conn, writes)
    assert errors[0] is None and errors[2] is None
    assert isinstance(errors[1], StaleLease)
    got = {r["id"]: (r["state"], r["checkpoint"]) for r in await conn.fetch(
        "SELECT id, state, checkpoint FROM turns")}
    assert got == {"a": ("running", '{"n":1}'), "b": ("queued", "{}"),
                   "c": ("running", "{}")}
    assert [tuple(r) for r in await conn.fetch(
        "SELECT turn, idx, data FROM messages ORDER BY turn, idx")] == [
        ("a", 0, '"a0"'), ("a", 1, '"a1"')]
    assert [r[0] for r in await conn.fetch("SELECT seq FROM events ORDER BY seq")] == [1, 3]


@pytest.mark.anyio
async def test_conversation_rows_replace_from_start_and_drop_past_the_end(
        conn: asyncpg.Connection) -> None:
    await commit(conn, [[MessageWrite("a", 0, ('"0"', '"1"', '"2"', '"3"'))]])
    await commit(conn, [[MessageWrite("a", 1, ('"x"',))],
                           [MessageWrite("b", 0, ('"b"',))]])
    await commit(conn, [[MessageWrite("b", 1, ('"c"',))],
                           [MessageWrite("b", 2, ('"d"',))]])  # same turn: in order
    assert [tuple(r) for r in await conn.fetch(
        "SELECT turn, idx, data FROM messages ORDER BY turn, idx")] == [
        ("a", 0, '"0"'), ("a", 1, '"x"'), ("b", 0, '"b"'), ("b", 1, '"c"'),
        ("b", 2, '"d"')]


@pytest.mark.anyio
async def test_a_stale_claim_after_part_of_its_write_was_sent_rolls_back(
        conn: asyncpg.Connection) -> None:
    # a call first, then the stale update: the transaction cannot keep half the write.
    async def mark(c: Any) -> None:
        await c.execute("UPDATE turns SET stop_code = 'x' WHERE id = 'c'")

    with pytest.raises(StaleLease):
        await commit(conn, [[mark, upd("b", 7)], [upd("a", 1)]])
    assert await conn.fetchval("SELECT count(*) FROM turns WHERE state = 'running'"
                               " OR stop_code IS NOT NULL") == 0


async def _table(conn: asyncpg.Connection, table: str) -> list[tuple[Any, ...]]:
    return [tuple(r) for r in await conn.fetch(
        f"SELECT turn, idx, data FROM {table} ORDER BY turn, idx")]


@pytest.mark.anyio
async def test_a_turns_messages_and_trail_commit_together_each_in_its_table(
        conn: asyncpg.Connection) -> None:
    writes: list[list[pb.Op]] = [
        [upd("a", 1, '{"n":1}'), MessageWrite("a", 0, ('"m0"',)),
         MessageWrite("a", 0, ("pa", "pb"), TRAIL), event(1, "a")],
        [upd("b", 7, '{"n":2}'), MessageWrite("b", 0, ('"b0"',)),
         MessageWrite("b", 0, ("stale",), TRAIL), event(2, "b")],  # b's claim is stale
        [upd("c"), MessageWrite("c", 0, ("pc",), TRAIL)],
    ]
    assert len(pb.segments(writes)) == 1
    errors = await commit(conn, writes)
    assert errors[0] is None and errors[2] is None and isinstance(errors[1], StaleLease)
    assert await _table(conn, "messages") == [("a", 0, '"m0"')]
    assert await _table(conn, "trail") == [("a", 0, "pa"), ("a", 1, "pb"), ("c", 0, "pc")]


@pytest.mark.anyio
async def test_trail_rows_replace_from_start_and_drop_past_the_end_apart_from_messages(
        conn: asyncpg.Connection) -> None:
    await commit(conn, [[MessageWrite("a", 0, ('"0"', '"1"', '"2"')),
                            MessageWrite("a", 0, ("p0", "p1", "p2"), TRAIL)]])
    # Two trail writes of a in one batch: in order, in two segments.
    await commit(conn, [[MessageWrite("a", 1, ("x",), TRAIL)],
                           [MessageWrite("a", 2, ("y", "z"), TRAIL)]])
    assert await _table(conn, "trail") == [("a", 0, "p0"), ("a", 1, "x"), ("a", 2, "y"),
                                           ("a", 3, "z")]
    await commit(conn, [[MessageWrite("a", 1, ("q",), TRAIL)]])
    assert await _table(conn, "trail") == [("a", 0, "p0"), ("a", 1, "q")]
    assert await _table(conn, "messages") == [("a", 0, '"0"'), ("a", 1, '"1"'),
                                              ("a", 2, '"2"')]  # untouched


def intent(key: str, turn: str) -> pb.FencedIntent:
    return pb.FencedIntent(key, turn, "effect", "{}", "n1", 3)


def test_a_batchs_intents_share_its_segment_and_one_fenced_statement() -> None:
    writes: list[list[pb.Op]] = [[upd("a")], [intent("k1", "b")], [intent("k2", "c")],
                                 [("INSERT INTO events (seq) VALUES ($1)", (1,))]]
    [seg] = pb.segments(writes)
    assert isinstance(seg, pb.Segment) and [i for i, _ in seg.intents] == [1, 2]
    sql, args = pb.intent_insert([f for _, f in seg.intents])
    assert sql == pb.INTENT_INSERT and "lease_until > clock_timestamp()" in sql
    assert "ORDER BY t.id FOR SHARE OF t" in sql and "RETURNING key" in sql
    assert args == (["k1", "k2"], ["b", "c"], ["effect", "effect"], ["{}", "{}"],
                    ["n1", "n1"], [3, 3])
    # the update and the intents lock at two points: every row first, in order
    locks = pb.batch_locks([seg])
    assert locks.up_front and locks.first_is_update and locks.turns == ["a", "b", "c"]
    # intents alone lock at one point, in the statement's own order
    alone = pb.batch_locks(pb.segments([[intent("k1", "b")], [intent("k2", "a")]]))
    assert not alone.up_front and alone.turns == ["a", "b"]


def test_an_intent_does_not_pass_a_statement_it_may_depend_on() -> None:
    writes: list[list[pb.Op]] = [[("UPDATE turns SET owner = NULL WHERE id = $1", ("b",))],
                                 [intent("k1", "b")]]
    parts = pb.segments(writes)
    assert len(parts) == 2 and [i for i, _ in parts[1].intents] == [1]  # type: ignore[union-attr]
