"""What only the PostgreSQL store has: its schema versions, one daemon per database until
claims exist, conversation and trail rows, a turn's message in a column of its own, the
writer riding out lost connections, and a URL whose password never shows. Each test runs
on a fresh database of a real server."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import asyncpg
import pytest
from tests.pg import CuttableProxy

from turnkeeper.config import ConfigError, load_config, redact_url
from turnkeeper.events import Event
from turnkeeper.store import open_store, postgres_schema
from turnkeeper.store.base import MessageRows, StoreError, StoreInUse
from turnkeeper.store.postgres import PostgresStore
from turnkeeper.store.postgres_schema import MIGRATIONS, SCHEMA_VERSION, prepare
from turnkeeper.supervisor.queries import health_problems, store_status

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Running:
    """A store opened with its writer task running, for `async with`."""

    def __init__(self, url: str) -> None:
        self.store = PostgresStore(url)
        self._tg: Any = None

    async def __aenter__(self) -> PostgresStore:
        await self.store.open()
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        await self._tg.start(self.store.run)
        return self.store

    async def __aexit__(self, *exc: object) -> None:
        await self.store.close()
        await self._tg.__aexit__(None, None, None)


def record(turn_id: str, **extra: Any) -> dict[str, Any]:
    return {"id": turn_id, "session": turn_id, "state": "queued", "message": "m",
            "created_at": 100.0, "updated_at": 100.0, "inbox": [], **extra}


def rows(*texts: str) -> tuple[str, ...]:
    return tuple(json.dumps({"role": "user", "content": t}) for t in texts)


def contents(checkpoint: dict[str, Any] | None) -> list[str]:
    assert checkpoint is not None
    return [m["content"] for m in checkpoint["conversation"]["messages"]]


async def test_conversation_rows_append_replace_and_come_back_with_the_checkpoint(
        db: str) -> None:
    async with Running(db) as store:
        rec = record("t_a")
        await store.insert_turn(rec, {})
        await store.save_turn(rec, {"conversation": {"count": 2, "turn_start": 0}},
                              messages=MessageRows(0, rows("a", "b")))
        await store.save_turn(rec, {"conversation": {"count": 4, "turn_start": 0}},
                              messages=MessageRows(2, rows("c", "d")))
        assert contents(await store.get_checkpoint("t_a")) == ["a", "b", "c", "d"]
        # A compaction rewrites from a lower index: the rows past the new end go.
        await store.save_turn(rec, {"conversation": {"count": 2, "turn_start": 0}},
                              messages=MessageRows(1, rows("summary")))
        assert contents(await store.get_checkpoint("t_a")) == ["a", "summary"]
        # A checkpoint counts what it holds: rows beyond its count are not read.
        await store.save_turn(rec, {"conversation": {"count": 1, "turn_start": 0}})
        assert contents(await store.get_checkpoint("t_a")) == ["a"]
        [(got, checkpoint)] = await store.unfinished_turns()
        assert got["id"] == "t_a" and contents(checkpoint) == ["a"]


async def test_unfinished_turns_attach_each_turns_own_rows_and_legacy_is_unchanged(
        db: str) -> None:
    async with Running(db) as store:
        for i in range(3):
            rec = record(f"t_{i}")
            await store.insert_turn(rec, {})
            await store.save_turn(rec, {"conversation": {"count": i + 1, "turn_start": 0}},
                                  messages=MessageRows(0, rows(*(f"{i}.{n}" for n in
                                                                 range(i + 1)))))
        legacy = {"conversation": {"messages": [{"role": "user", "content": "inline"}]}}
        await store.insert_turn(record("t_legacy"), legacy)
        unfinished = await store.unfinished_turns()
        assert [r["id"] for r, _ in unfinished] == ["t_0", "t_1", "t_2", "t_legacy"]
        assert [contents(c) for _, c in unfinished[:3]] == [
            ["0.0"], ["1.0", "1.1"], ["2.0", "2.1", "2.2"]]
        assert unfinished[3][1] == legacy
        assert await store.get_checkpoint("t_legacy") == legacy


async def test_requeue_writes_the_rows_it_is_given(db: str) -> None:
    async with Running(db) as store:
        rec = record("t_a")
        await store.insert_turn(rec, {})
        await store.save_turn(rec, {"conversation": {"count": 3, "turn_start": 0}},
                              messages=MessageRows(0, rows("a", "b", "c")))
        await store.requeue_turn(rec, {"conversation": {"count": 2, "turn_start": 0}},
                                 messages=MessageRows(1, rows("B")))
        assert contents(await store.get_checkpoint("t_a")) == ["a", "B"]


def trail_cp(messages: int, trail: int) -> dict[str, Any]:
    return {"conversation": {"count": messages, "turn_start": 0}, "trail": {"count": trail}}


async def table_rows(db: str, table: str) -> list[tuple[Any, ...]]:
    conn = await asyncpg.connect(db)
    try:
        return [tuple(r) for r in await conn.fetch(
            f"SELECT turn, idx, data FROM {table} ORDER BY turn, idx")]
    finally:
        await conn.close()


async def test_trail_rows_are_written_replaced_and_come_back_with_the_checkpoint(
        db: str) -> None:
    async with Running(db) as store:
        rec = record("t_a")
        await store.insert_turn(rec, {})
        await store.save_turn(rec, trail_cp(1, 2), messages=MessageRows(0, rows("x")),
                              trail=MessageRows(0, ("pa", "pb")))
        checkpoint = await store.get_checkpoint("t_a")
        assert checkpoint is not None
        assert checkpoint["trail"] == {"count": 2, "rows": ["pa", "pb"]}
        assert contents(checkpoint) == ["x"]
        # From index 1 on: the row there is replaced, the messages are left as they are.
        await store.save_turn(rec, trail_cp(1, 2), trail=MessageRows(1, ("pc",)))
        checkpoint = await store.get_checkpoint("t_a")
        assert checkpoint is not None
        assert checkpoint["trail"] == {"count": 2, "rows": ["pa", "pc"]}
        assert contents(checkpoint) == ["x"]
        # A checkpoint counts what it holds: trail rows beyond its count are not read.
        await store.save_turn(rec, trail_cp(1, 1))
        assert (await store.get_checkpoint("t_a") or {})["trail"] == {
            "count": 1, "rows": ["pa"]}
        assert await table_rows(db, "trail") == [("t_a", 0, "pa"), ("t_a", 1, "pc")]


async def test_a_queued_checkpoints_trail_rows_are_kept_with_the_next_save(db: str) -> None:
    async with Running(db) as store:
        rec = record("t_a")
        await store.insert_turn(rec, {})
        assert store.queue_turn(rec, trail_cp(1, 1), messages=MessageRows(0, rows("x")),
                                trail=MessageRows(0, ("p0",)))
        await store.save_turn(rec, trail_cp(2, 3), messages=MessageRows(1, rows("y")),
                              trail=MessageRows(1, ("p1", "p2")))
        checkpoint = await store.get_checkpoint("t_a")
        assert checkpoint is not None and contents(checkpoint) == ["x", "y"]
        assert checkpoint["trail"]["rows"] == ["p0", "p1", "p2"]


async def test_unfinished_turns_and_a_claim_give_each_turn_its_own_trail(db: str) -> None:
    async with Running(db) as store:
        for i in range(3):
            rec = record(f"t_{i}")
            await store.insert_turn(rec, {})
            await store.save_turn(rec, trail_cp(1, i), messages=MessageRows(0, rows(str(i))),
                                  trail=MessageRows(0, tuple(f"{i}.{n}" for n in range(i))))
        legacy = {"conversation": {"count": 0, "turn_start": 0}}  # no trail: left so
        await store.insert_turn(record("t_legacy"), legacy)
        expected = [{"count": 0, "rows": []}, {"count": 1, "rows": ["1.0"]},
                    {"count": 2, "rows": ["2.0", "2.1"]}]
        unfinished = await store.unfinished_turns()
        assert [r["id"] for r, _ in unfinished] == ["t_0", "t_1", "t_2", "t_legacy"]
        assert [c["trail"] for _, c in unfinished[:3]] == expected
        assert "trail" not in unfinished[3][1]
        claimed = await store.claim(10)
        assert [c.record["id"] for c in claimed] == ["t_0", "t_1", "t_2", "t_legacy"]
        assert [c.checkpoint["trail"] for c in claimed[:3]] == expected
        assert [contents(c.checkpoint) for c in claimed[:3]] == [["0"], ["1"], ["2"]]
        assert "trail" not in claimed[3].checkpoint


async def test_requeue_writes_the_trail_rows_it_is_given(db: str) -> None:
    async with Running(db) as store:
        rec = record("t_a")
        await store.insert_turn(rec, {})
        await store.save_turn(rec, trail_cp(0, 3), trail=MessageRows(0, ("a", "b", "c")))
        await store.requeue_turn(rec, trail_cp(0, 2), trail=MessageRows(1, ("B",)))
        assert (await store.get_checkpoint("t_a") or {})["trail"] == {
            "count": 2, "rows": ["a", "B"]}
        assert await table_rows(db, "trail") == [("t_a", 0, "a"), ("t_a", 1, "B")]


async def test_prune_takes_a_turns_trail_rows_with_it(db: str) -> None:
    async with Running(db) as store:
        for turn_id in ("t_old", "t_live"):
            rec = record(turn_id)
            await store.insert_turn(rec, {})
            await store.save_turn(rec, trail_cp(1, 1), messages=MessageRows(0, rows("m")),
                                  trail=MessageRows(0, (f"{turn_id} line",)))
        await store.save_turn({**record("t_old"), "state": "completed"})
        assert await store.prune(finished_before=200.0, limit=10) == 1
        assert await table_rows(db, "trail") == [("t_live", 0, "t_live line")]
        assert [r[0] for r in await table_rows(db, "messages")] == ["t_live"]


async def turn_row(db: str, turn_id: str) -> tuple[dict[str, Any], str | None]:
    """The turn's row as stored: its `record` column and its `message`, read as JSON."""
    conn = await asyncpg.connect(db)
    try:
        row = await conn.fetchrow("SELECT record, message FROM turns WHERE id = $1", turn_id)
    finally:
        await conn.close()
    assert row is not None
    message = row["message"]
    return json.loads(row["record"]), None if message is None else json.loads(message)


async def test_a_turns_message_is_written_once_apart_and_every_read_puts_it_back(
        db: str) -> None:
    async with Running(db) as store:
        rec = record("t_a", message="the task")
        await store.insert_turn(rec, {})
        stored, message = await turn_row(db, "t_a")
        assert stored["id"] == "t_a" and "message" not in stored and message == "the task"
        await store.save_turn({**rec, "state": "running", "updated_at": 110.0}, {"step": 1})
        assert store.queue_turn({**rec, "state": "running", "updated_at": 111.0}, {"step": 2})
        await store.append_message("t_a", {"kind": "steer", "text": "left"}, updated_at=112.0)
        stored, message = await turn_row(db, "t_a")
        assert stored["updated_at"] == 112.0 and stored["inbox"] == [
            {"kind": "steer", "text": "left"}]
        assert "message" not in stored and message == "the task"
        got = await store.get_turn("t_a")
        assert got is not None and got["message"] == "the task"
        assert [r["message"] for r in await store.list_turns()] == ["the task"]
        [(got, _)] = await store.unfinished_turns()
        assert got["message"] == "the task"
        await store.requeue_turn({**rec, "state": "queued", "updated_at": 120.0}, {})
        stored, message = await turn_row(db, "t_a")
        assert "message" not in stored and message == "the task"
        await store.save_turn({**rec, "state": "failed", "updated_at": 130.0, "result": {
            "status": "failed", "stopped_because": {"code": "internal"}}})
        [history] = await store.session_history("t_a", before_seq=2)
        assert history["message"] == "the task"
        [letter] = await store.dead_letters()
        assert letter["message"] == "the task"


async def schema_at(conn: asyncpg.Connection, version: int) -> None:
    """An empty database's schema at `version`, as a turnkeeper of that version left it."""
    async with conn.transaction():
        await conn.execute("CREATE TABLE schema_version (version INTEGER NOT NULL)")
        for migration in MIGRATIONS[:version]:
            for stmt in migration:
                await conn.execute(stmt)
        await conn.execute("INSERT INTO schema_version VALUES ($1)", version)


async def test_a_database_from_before_the_trail_gets_its_table_and_reads_as_before(
        db: str) -> None:
    conn = await asyncpg.connect(db)
    try:
        await schema_at(conn, 7)  # the last version without the trail
        assert await conn.fetchval("SELECT to_regclass('trail')") is None
        await conn.execute(
            "INSERT INTO turns (id, seq, session, state, created_at, updated_at, record,"
            " checkpoint) VALUES ('t_a', 1, 't_a', 'queued', 0, 0, $1, $2)",
            json.dumps(record("t_a")), json.dumps({"conversation": {"count": 1}}))
        await conn.execute("INSERT INTO messages VALUES ('t_a', 0, $1)", rows("old")[0])
        await prepare(conn, "test")
        assert await conn.fetchval("SELECT version FROM schema_version") == SCHEMA_VERSION
        assert await conn.fetchval("SELECT to_regclass('trail')::text") == "trail"
    finally:
        await conn.close()
    async with Running(db) as store:
        checkpoint = await store.get_checkpoint("t_a")
        assert checkpoint is not None and contents(checkpoint) == ["old"]
        assert "trail" not in checkpoint


async def test_a_database_from_before_the_message_column_fills_it_and_reads_as_before(
        db: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(postgres_schema, "MIGRATION_BATCH", 2)  # 5 turns: 3 batches
    conn = await asyncpg.connect(db)
    try:
        await schema_at(conn, 8)  # the last version with the message in the record only
        for seq, turn in enumerate(["t_a", "t_b", "t_c", "t_d", "t_e"], 1):
            await conn.execute(
                "INSERT INTO turns (id, seq, session, state, created_at, updated_at, record)"
                " VALUES ($1, $2, $1, 'queued', 0, 0, $3)", turn, seq,
                # A NUL character in a record: PostgreSQL's JSON operators refuse the row.
                json.dumps(record(turn, message="the\x00task" if turn == "t_a" else turn)))
        await prepare(conn, "test")
        assert await conn.fetchval("SELECT version FROM schema_version") == SCHEMA_VERSION
    finally:
        await conn.close()
    for turn in ["t_b", "t_c", "t_d", "t_e"]:
        assert (await turn_row(db, turn))[1] == turn
    stored, message = await turn_row(db, "t_a")
    assert stored["message"] == message == "the\x00task"  # the record keeps its own copy
    async with Running(db) as store:
        got = await store.get_turn("t_a")
        assert got is not None and got["message"] == "the\x00task"
        got = (await store.unfinished_turns())[0][0]
        assert got["message"] == "the\x00task"
        await store.save_turn({**got, "state": "running"}, {"step": 1})
        stored, message = await turn_row(db, "t_a")
        assert "message" not in stored and message == "the\x00task"
        got = await store.get_turn("t_a")
        assert got is not None and got["message"] == "the\x00task"


async def test_reopening_keeps_the_data_and_numbers_go_on(db: str) -> None:
    async with Running(db) as store:
        assert await store.insert_turn(record("t_a"), {"x": 1}) == 1
        store.append_event(Event(seq=7, ts=1.0, type="turn.step", turn="t_a", data={}))
    async with Running(db) as store:
        assert await store.get_checkpoint("t_a") == {"x": 1}
        assert await store.max_event_seq() == 7
        assert await store.insert_turn(record("t_b"), {}) == 2


async def test_nodes_share_a_database_but_a_node_id_is_held_by_one_daemon(
        db: str) -> None:
    first = Running(db)
    first.store = PostgresStore(db, node_id="n1")
    async with first, Running(db) as other:  # another node: welcome
        assert other.node_id != "n1"
        second = PostgresStore(db, node_id="n1")
        with pytest.raises(StoreInUse, match="node id 'n1' is in use") as err:
            await second.open()
        assert err.value.exit_code == 69
        nodes = {n["node_id"]: n for n in await other.nodes()}
        assert nodes["n1"]["alive"] and nodes[other.node_id]["alive"]
    again = Running(db)
    again.store = PostgresStore(db, node_id="n1")
    async with again as store:  # stopped cleanly: the id is free again
        assert store.node_id == "n1"


async def test_a_newer_schema_is_refused_and_left_as_it_was(db: str) -> None:
    async with Running(db):
        pass
    conn = await asyncpg.connect(db)
    try:
        await conn.execute("UPDATE schema_version SET version = $1", SCHEMA_VERSION + 1)
    finally:
        await conn.close()
    with pytest.raises(StoreError, match="newer than this turnkeeper") as err:
        await PostgresStore(db).open()
    assert err.value.exit_code == 74
    conn = await asyncpg.connect(db)
    try:
        assert await conn.fetchval("SELECT version FROM schema_version") == SCHEMA_VERSION + 1
    finally:
        await conn.close()


async def test_a_write_the_server_refuses_fails_alone_in_its_batch(db: str) -> None:
    async with Running(db) as store:
        results: dict[str, str] = {}

        async def write(name: str, seq: int) -> None:
            try:
                await store.save_turn(record(name), None, events=[
                    Event(seq=seq, ts=1.0, type="turn.step", turn=name, data={})])
                results[name] = "ok"
            except StoreError as exc:
                results[name] = str(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(write, "t_good1", 1)
            tg.start_soon(write, "t_bad", 2**70)  # no BIGINT holds it
            tg.start_soon(write, "t_good2", 3)
        assert results["t_good1"] == results["t_good2"] == "ok"
        assert "write failed" in results["t_bad"]
        assert [e["seq"] for e in await store.events()] == [1, 3]
        assert store.failed_writes == 1


async def test_writes_wait_through_killed_connections_and_lose_nothing(db: str) -> None:
    async with Running(db) as store:
        admin = await asyncpg.connect(db)
        try:
            for i in range(40):
                rec = record(f"t_{i}")
                await store.insert_turn(rec, {})
                store.append_event(Event(seq=i + 1, ts=1.0, type="turn.step",
                                         turn=rec["id"], data={}))
                if i % 10 == 5:  # every backend of the store's pool, mid-run
                    await admin.execute(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE"
                        " datname = current_database() AND pid <> pg_backend_pid()"
                        " AND application_name LIKE 'turnkeeper%'")
                await store.save_turn({**rec, "state": "completed"}, {"done": True})
        finally:
            await admin.close()
        assert len(await store.list_turns(state="completed", limit=100)) == 40
        assert [e["seq"] for e in await store.events()] == list(range(1, 41))
        assert store.reconnects >= 1
        assert store.degraded is None


async def test_an_unreachable_server_is_a_store_error_without_the_password() -> None:
    store = PostgresStore("postgresql://tk:s3cret@127.0.0.1:1/nowhere")
    with pytest.raises(StoreError) as err:
        await store.open()
    assert "s3cret" not in str(err.value)
    assert "<redacted>@127.0.0.1:1/nowhere" in str(err.value)
    assert err.value.exit_code == 74


def test_redact_url_hides_the_password_wherever_it_is() -> None:
    assert redact_url("postgresql://u:pw@h:5432/db") == "postgresql://<redacted>@h:5432/db"
    assert redact_url("postgresql://h/db?password=pw&sslmode=require") == (
        "postgresql://h/db?password=<redacted>&sslmode=require")
    assert redact_url("postgresql://h/db") == "postgresql://h/db"


def test_store_url_is_checked_and_picks_the_backend(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('[store]\nurl = "mysql://u:pw@h/db"\n')
    with pytest.raises(ConfigError, match=r"store\.url.*postgresql://") as err:
        load_config(f)
    assert "pw" not in str(err.value)
    assert err.value.exit_code == 78
    f.write_text('[[providers]]\nname = "offline"\nkind = "scripted"\n\n'
                 '[store]\nurl = "postgres://u:pw@h/db"\n[fleet]\nlease_seconds = 5\n')
    config, _ = load_config(f)
    assert config.redacted()["store"]["url"] == "postgres://<redacted>@h/db"
    assert isinstance(open_store(config, tmp_path), PostgresStore)
    default, _ = load_config(None)
    assert default.store.url == "" and default.fleet.lease_seconds == 15.0
    assert type(open_store(default, tmp_path)).__name__ == "SQLiteStore"


async def test_writes_wait_while_the_database_is_gone_and_commit_when_it_is_back(
        db: str) -> None:
    proxy = CuttableProxy(db)
    proxy.start()
    try:
        async with Running(proxy.url()) as store:
            await store.insert_turn(record("t_a"), {})
            proxy.cut()
            committed = anyio.Event()

            async def save() -> None:
                await store.save_turn({**record("t_a"), "state": "running"}, {"step": 1})
                committed.set()

            async with anyio.create_task_group() as tg:
                tg.start_soon(save)
                store.append_event(Event(seq=1, ts=1.0, type="turn.step", turn="t_a",
                                         data={}))
                while store.degraded is None:  # noqa: ASYNC110 - a state, not an event
                    await anyio.sleep(0.01)
                assert not committed.is_set()
                assert "unreachable" in store.degraded
                problems = health_problems({"state": "ready", "store": store_status(
                    store.outage, now=store.clock.monotonic())})
                assert len(problems) == 1 and problems[0].startswith("store unwritable")
                assert "unreachable" in problems[0]
                proxy.restore()  # back, on the same port
                await committed.wait()
            assert store.degraded is None
            assert await store.get_checkpoint("t_a") == {"step": 1}
            assert [e["seq"] for e in await store.events()] == [1]
    finally:
        proxy.close()


async def test_writes_fail_after_fatal_after_without_a_database(db: str) -> None:
    proxy = CuttableProxy(db)
    proxy.start()
    try:
        async with Running(proxy.url()) as store:
            store.outage.fatal_after_s = 0.3
            proxy.cut()
            with pytest.raises(StoreError, match="unreachable for"):
                await store.insert_turn(record("t_a"), {})
            assert store.degraded is not None and store.failed_writes == 1
    finally:
        proxy.close()


async def test_a_stale_claim_inside_a_batch_fails_only_its_own_writes(db: str) -> None:
    store = PostgresStore(db, node_id="n1")
    async with anyio.create_task_group() as tg:
        await store.open()
        await tg.start(store.run)
        try:
            for turn_id in ("t_a", "t_b", "t_c"):
                await store.insert_turn(record(turn_id), {})
            assert len(await store.claim(3)) == 3
            admin = await asyncpg.connect(db)
            try:  # another node took t_b over
                await admin.execute("UPDATE turns SET owner = 'n2', epoch = epoch + 1"
                                    " WHERE id = 't_b'")
            finally:
                await admin.close()
            results: dict[str, str] = {}

            async def step(turn_id: str, seq: int) -> None:
                try:
                    await store.save_turn(
                        record(turn_id, state="running"),
                        {"conversation": {"count": 1, "turn_start": 0}},
                        messages=MessageRows(0, rows(turn_id)),
                        events=[Event(seq=seq, ts=1.0, type="turn.step", turn=turn_id,
                                      data={})])
                    results[turn_id] = "ok"
                except StoreError as exc:
                    results[turn_id] = type(exc).__name__

            commits = store.commits
            async with anyio.create_task_group() as steps:
                for seq, turn_id in enumerate(("t_a", "t_b", "t_c"), start=1):
                    steps.start_soon(step, turn_id, seq)
            assert results == {"t_a": "ok", "t_b": "StaleLease", "t_c": "ok"}
            assert store.commits == commits + 1  # one transaction, not one per write
            assert contents(await store.get_checkpoint("t_a")) == ["t_a"]
            assert await store.get_checkpoint("t_b") == {}
            assert (await store.get_turn("t_b") or {})["state"] == "queued"
            assert [e["seq"] for e in await store.events()] == [1, 3]
        finally:
            await store.close()
