"""Claims, leases and fencing in the PostgreSQL store, with two or three nodes on one
fresh database of a real server. A lease runs out by the database's clock being moved
past it (lease_until set in the past), never by a test sleeping."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anyio
import asyncpg
import pytest

from turnkeeper.events import Event
from turnkeeper.store import postgres_fleet
from turnkeeper.store.base import StoreError
from turnkeeper.store.fleet import (
    CHANNEL_RETRY_AFTER,
    MailTaken,
    StaleLease,
    read_breaker_notice,
)
from turnkeeper.store.postgres import PostgresStore
from turnkeeper.store.postgres_fleet import EVENT_BLOCK

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def listening(url: str) -> None:
    """Until a session of the database listens on every fleet channel: the LISTEN for the
    retry-after channel, the last of them, is the last thing it asked, and it is idle."""
    conn = await asyncpg.connect(url)
    try:
        with anyio.fail_after(10):
            while True:
                if await conn.fetchval(
                        "SELECT count(*) FROM pg_stat_activity WHERE datname ="
                        " current_database() AND state = 'idle' AND query LIKE $1",
                        f"LISTEN %{CHANNEL_RETRY_AFTER}%"):
                    return
                await anyio.sleep(0.01)
    finally:
        await conn.close()


@pytest.fixture
async def nodes(db: str) -> AsyncIterator[list[PostgresStore]]:
    stores = [PostgresStore(db, node_id=f"n{i}") for i in range(3)]
    async with anyio.create_task_group() as tg:
        for store in stores:
            await store.open()
            await tg.start(store.run)
        try:
            yield stores
        finally:
            for store in stores:
                await store.close()


def record(turn_id: str, session: str | None = None, **extra: Any) -> dict[str, Any]:
    return {"id": turn_id, "session": session or turn_id, "state": "queued",
            "message": "m", "created_at": 1.0, "updated_at": 1.0, "inbox": [], **extra}


async def expire(db: str, turn_id: str) -> None:
    conn = await asyncpg.connect(db)
    try:
        await conn.execute("UPDATE turns SET lease_until = now() - interval '1 second'"
                           " WHERE id = $1", turn_id)
    finally:
        await conn.close()


async def test_claims_take_the_oldest_turns_once_each_across_nodes(
        nodes: list[PostgresStore]) -> None:
    a, b, c = nodes
    for i in range(10):
        await a.insert_turn(record(f"t_{i}", message=f"task {i}"), {"i": i})
    first = await b.claim(3)
    assert [x.record["id"] for x in first] == ["t_0", "t_1", "t_2"]
    assert [x.record["message"] for x in first] == ["task 0", "task 1", "task 2"]
    assert [x.checkpoint for x in first] == [{"i": 0}, {"i": 1}, {"i": 2}]
    assert {x.epoch for x in first} == {1}
    taken: list[str] = [x.record["id"] for x in first]

    async def grab(store: PostgresStore) -> None:
        for claimed in await store.claim(10):
            taken.append(str(claimed.record["id"]))

    async with anyio.create_task_group() as tg:  # two claims at once: SKIP LOCKED
        tg.start_soon(grab, a)
        tg.start_soon(grab, c)
    assert sorted(taken) == sorted(f"t_{i}" for i in range(10))
    assert await b.claim(5) == []


async def test_the_backlog_counts_the_unfinished_turns_no_live_node_holds(
        db: str, nodes: list[PostgresStore]) -> None:
    a, b, _ = nodes
    for i in range(5):
        await a.insert_turn(record(f"t_{i}"), {})
    assert await b.backlog() == 5
    await a.claim(2)
    assert await b.backlog() == 3
    await a.save_turn({**record("t_0"), "state": "completed"})
    await expire(db, "t_1")  # a lease run out: the turn waits for a claim again
    assert await a.backlog() == 4


async def test_a_sessions_turns_are_claimed_in_order_across_the_fleet(
        nodes: list[PostgresStore]) -> None:
    a, b, _ = nodes
    for i in range(3):
        await a.insert_turn(record(f"s_{i}", session="s"), {})
    await a.insert_turn(record("other"), {})
    got = await a.claim(1)
    assert [x.record["id"] for x in got] == ["s_0"]
    # s_1 waits for s_0, held by a: b takes the other session's turn only.
    assert [x.record["id"] for x in await b.claim(5)] == ["other"]
    # a holds s_0 and orders its session itself: it may take the next one, and the one
    # after that once s_1 is its own (a claim sees the session as it was at its start).
    assert [x.record["id"] for x in await a.claim(5)] == ["s_1"]
    assert [x.record["id"] for x in await a.claim(5)] == ["s_2"]
    await a.save_turn({**record("s_0", session="s"), "state": "completed"})
    assert "s_0" not in a.claims


async def test_an_expired_claim_is_taken_over_and_the_old_holder_is_fenced(
        db: str, nodes: list[PostgresStore]) -> None:
    a, b, _ = nodes
    await a.insert_turn(record("t"), {"step": 0})
    [mine] = await a.claim(1)
    await a.save_turn({**record("t"), "state": "running"}, {"step": 1})
    await expire(db, "t")
    [theirs] = await b.claim(1)
    assert theirs.epoch == mine.epoch + 1 and theirs.checkpoint == {"step": 1}
    # The old holder wakes up (SIGCONT): every write of the turn is refused.
    with pytest.raises(StaleLease):
        await a.save_turn({**record("t"), "state": "running"}, {"step": 2})
    with pytest.raises(StaleLease):
        await a.journal_intent("k1", turn="t", tool="mail", arguments="{}",
                               idempotent=False)
    a.append_event(Event(seq=1, ts=1.0, type="turn.step", turn="t", data={}))
    await a.flush()
    assert await a.journal_get("k1") is None
    assert await a.events() == []
    assert await a.get_checkpoint("t") == {"step": 1}
    await b.save_turn({**record("t"), "state": "running"}, {"step": 2})
    assert await b.get_checkpoint("t") == {"step": 2}


async def test_a_non_idempotent_call_needs_a_live_lease_even_if_nobody_took_it(
        db: str, nodes: list[PostgresStore]) -> None:
    a = nodes[0]
    await a.insert_turn(record("t"), {})
    await a.claim(1)
    await a.journal_intent("k_ok", turn="t", tool="mail", arguments="{}",
                           idempotent=False)
    await expire(db, "t")
    with pytest.raises(StaleLease, match=r"lease .* has run out"):
        await a.journal_intent("k_late", turn="t", tool="mail", arguments="{}",
                               idempotent=False)
    assert await a.journal_get("k_ok") is not None
    assert await a.journal_get("k_late") is None
    # The epoch still holds: a checkpoint is written (the fence is the epoch).
    await a.save_turn({**record("t"), "state": "running"}, {"step": 1})
    # Renewing brings the lease back.
    assert await a.renew() == {"t": 1}
    await a.journal_intent("k_late", turn="t", tool="mail", arguments="{}",
                           idempotent=False)


async def test_renew_reports_lost_claims_and_abandon_refuses_writes_locally(
        db: str, nodes: list[PostgresStore]) -> None:
    a, b, _ = nodes
    for i in range(2):
        await a.insert_turn(record(f"t_{i}"), {})
    await a.claim(2)
    await expire(db, "t_1")
    await b.claim(1)
    assert await a.renew() == {"t_0": 1}
    a.abandon(["t_1"])
    with pytest.raises(StaleLease, match="lost its claim"):
        await a.save_turn(record("t_1"), {})


async def test_after_an_outage_renew_retakes_the_claims_whose_epoch_is_still_ours(
        db: str, nodes: list[PostgresStore]) -> None:
    a, b, _ = nodes
    for i in range(3):
        await a.insert_turn(record(f"t_{i}"), {})
    held = {c.record["id"]: c.epoch for c in await a.claim(3)}
    for i in range(3):  # the database was unreachable past every lease
        await expire(db, f"t_{i}")
    # The node itself never claims anew a turn it holds (that would change the epoch
    # its own writes carry); another node may take an expired one.
    assert await a.claim(3) == []
    [taken] = await b.claim(1)
    assert taken.record["id"] == "t_0"
    renewed = await a.renew()
    assert renewed == {"t_1": held["t_1"], "t_2": held["t_2"]}
    # Re-taken under the same epoch: the lease is live again, a call may be journalled.
    await a.journal_intent("k", turn="t_1", tool="mail", arguments="{}",
                           idempotent=False)
    await a.save_turn({**record("t_1"), "state": "running"}, {"step": 1})
    assert await b.claim(3) == []


async def test_release_hands_turns_back_at_once(nodes: list[PostgresStore]) -> None:
    a, b, _ = nodes
    for i in range(3):
        await a.insert_turn(record(f"t_{i}"), {})
    assert len(await a.claim(3)) == 3
    assert await b.claim(3) == []
    assert await a.release() == 3
    assert [x.record["id"] for x in await b.claim(3)] == ["t_0", "t_1", "t_2"]
    [n0] = [n for n in await b.nodes() if n["node_id"] == "n0"]
    assert n0["stopped_at"] is not None and not n0["alive"]


async def test_a_nodes_silence_is_measured_by_the_databases_clock(
        nodes: list[PostgresStore]) -> None:
    """The age of a heartbeat is the database's own `now() - heartbeat_at`, never a
    node's wall clock against the database's timestamp (a node with a skewed clock
    showed every heartbeat as 0 s old)."""
    a, b, _ = nodes
    await a.renew()
    [n0] = [n for n in await b.nodes() if n["node_id"] == "n0"]
    assert 0.0 <= n0["silent_s"] < 5.0
    await a.db.fetch("UPDATE nodes SET heartbeat_at = now() - interval '100 seconds'"
                     " WHERE node_id = 'n0'")
    [n0] = [n for n in await b.nodes() if n["node_id"] == "n0"]
    assert 100.0 <= n0["silent_s"] < 105.0
    assert not n0["alive"]


async def test_retry_budget_counts_are_summed_over_the_other_live_nodes(
        nodes: list[PostgresStore]) -> None:
    a, b, c = nodes
    assert await a.share_budgets({"p": (10, 2)}) == {}
    assert await b.share_budgets({"p": (4, 1), "q": (1, 0)}) == {"p": (10, 2)}
    assert await c.share_budgets({}) == {"p": (14, 3), "q": (1, 0)}
    await b.release()  # a stopped node counts no more
    assert await c.share_budgets({}) == {"p": (10, 2)}


async def test_sessions_idle_in_a_transaction_end_at_a_third_of_the_lease(
        nodes: list[PostgresStore]) -> None:
    """A node paused inside a transaction would keep its turns' rows locked, and claims
    skip locked rows: the server ends such a session (lease 15 s: at 5 s)."""
    async def setting(conn: Any) -> str:
        return str(await conn.fetchval("SHOW idle_in_transaction_session_timeout"))

    assert await nodes[0].db.read(setting) == "5s"


async def test_a_message_by_mail_is_taken_once_and_only_by_the_turns_holder(
        db: str, nodes: list[PostgresStore]) -> None:
    a, b, c = nodes
    await a.insert_turn(record("t"), {})
    await a.claim(1)
    await b.post_mail("t", "message", {"text": "left"})
    [(mail_id, turn, kind, _)] = await a.pending_mail()
    assert (turn, kind) == ("t", "message")
    await a.append_message("t", {"text": "left"}, updated_at=2.0, mail_id=mail_id)
    with pytest.raises(MailTaken):  # a second delivery finds it gone: nothing written
        await a.append_message("t", {"text": "left"}, updated_at=3.0, mail_id=mail_id)
    assert (await a.get_turn("t") or {})["inbox"] == [{"text": "left"}]
    assert await a.pending_mail() == []
    # Taken over: the old holder cannot take the new holder's mail.
    await b.post_mail("t", "message", {"text": "right"})
    await expire(db, "t")
    await c.claim(1)
    [(mail_id, *_)] = await c.pending_mail()
    with pytest.raises(MailTaken):
        await a.append_message("t", {"text": "right"}, updated_at=4.0, mail_id=mail_id)
    await c.append_message("t", {"text": "right"}, updated_at=5.0, mail_id=mail_id)
    assert [m["text"] for m in (await c.get_turn("t") or {})["inbox"]] == ["left", "right"]


async def test_a_cancel_by_mail_stays_until_the_turns_end_commits(
        db: str, nodes: list[PostgresStore]) -> None:
    a, b, c = nodes
    await a.insert_turn(record("t"), {})
    await a.claim(1)
    await b.post_mail("t", "cancel", {"now": False})
    await a.save_turn({**record("t"), "state": "running"}, {})
    assert [m[2] for m in await a.pending_mail()] == ["cancel"]  # applied, not yet done
    # The holder dies before the turn ends: the next holder gets the cancel.
    await expire(db, "t")
    await c.claim(1)
    with pytest.raises(StaleLease):  # the old holder's end is refused, mail and all
        await a.save_turn({**record("t"), "state": "cancelled"}, {})
    assert [m[2] for m in await c.pending_mail()] == ["cancel"]
    await c.save_turn({**record("t"), "state": "cancelled"}, {})
    conn = await asyncpg.connect(db)
    try:
        assert await conn.fetchval("SELECT count(*) FROM mail") == 0
    finally:
        await conn.close()


async def test_breaker_failures_add_up_across_nodes_and_open_for_the_fleet(
        nodes: list[PostgresStore]) -> None:
    a, b, c = nodes
    heard: list[str] = []
    announced = anyio.Event()

    def on_notify(channel: str, payload: str) -> None:
        heard.append(f"{channel}:{payload}")
        announced.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(c.listen, on_notify)
        await listening(c.url)
        add = {"threshold": 8, "cooldown_s": 30.0}
        assert await a.add_breaker_failures("provider:p", 3, reset=False, **add) == (3, None)
        assert await b.add_breaker_failures("provider:p", 2, reset=False, **add) == (5, None)
        # A success on a node breaks the fleet's streak; its failures since count on.
        assert await c.add_breaker_failures("provider:p", 1, reset=True, **add) == (1, None)
        assert await a.add_breaker_failures("provider:p", 4, reset=False, **add) == (5, None)
        assert heard == []
        streak, left = await b.add_breaker_failures("provider:p", 3, reset=False, **add)
        assert streak == 8 and left is not None and 29.0 < left <= 30.0
        with anyio.fail_after(5):
            await announced.wait()
        [notice] = heard  # the name and the seconds it stays open: applied at once
        assert notice.startswith("turnkeeper_breakers:provider:p ")
        assert read_breaker_notice(notice.split(":", 1)[1])[0] == "provider:p"
        # Open already: a straggler's failure neither opens it again nor announces it.
        streak, left = await a.add_breaker_failures("provider:p", 1, reset=False, **add)
        assert streak == 9 and left is not None
        await anyio.sleep(0.2)  # an absence: no second notice comes
        assert len(heard) == 1
        tg.cancel_scope.cancel()
    shared = await c.shared_breakers()
    assert shared["provider:p"][0] == 9 and shared["provider:p"][1] is not None
    await a.add_breaker_failures("tool:t", 1, reset=False, threshold=8, cooldown_s=30.0)
    assert (await b.shared_breakers())["tool:t"] == (1, None)


async def test_a_retry_after_window_is_told_to_every_node_and_the_longest_is_kept(
        db: str, nodes: list[PostgresStore]) -> None:
    a, b, c = nodes
    heard: list[str] = []
    announced = anyio.Event()

    def on_notify(channel: str, payload: str) -> None:
        heard.append(f"{channel}:{payload}")
        announced.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(c.listen, on_notify)
        await listening(c.url)
        await a.share_retry_after("provider:p", 30.0)
        with anyio.fail_after(5):
            await announced.wait()
        [notice] = heard  # the name and the seconds left: applied at once
        assert notice.startswith("turnkeeper_retry_after:provider:p ")
        assert read_breaker_notice(notice.split(":", 1)[1]) == ("provider:p", 30.0)
        tg.cancel_scope.cancel()
    await b.share_retry_after("provider:p", 5.0)  # a shorter one shortens nothing
    await b.share_retry_after("tool:t", 10.0)
    windows = await c.shared_retry_after()
    assert set(windows) == {"provider:p", "tool:t"}
    assert 29.0 < windows["provider:p"] <= 30.0 and 9.0 < windows["tool:t"] <= 10.0
    conn = await asyncpg.connect(db)
    try:  # a window that has ended is not shared any more
        await conn.execute("UPDATE retry_after SET until = now() - interval '1 second'"
                           " WHERE name = 'tool:t'")
    finally:
        await conn.close()
    assert set(await a.shared_retry_after()) == {"provider:p"}


async def test_one_node_sends_each_webhook_delivery_until_its_lease_ends(
        nodes: list[PostgresStore]) -> None:
    a, b, _ = nodes
    for node in nodes:
        node.set_webhook_route(lambda e: ("hook",))
    for seq in (1, 2, 3):
        a.append_event(Event(seq=seq, ts=10.0, type="turn.finished", turn=None, data={}))
    await a.flush()
    taken = await a.webhook_due("hook", now=100.0, limit=2, lease_s=30.0)
    assert [d.seq for d in taken] == [1, 2]
    # claimed by a: b gets only the third, and nothing more while a's lease holds
    assert [d.seq for d in await b.webhook_due("hook", now=110.0, limit=5,
                                               lease_s=30.0)] == [3]
    assert await b.webhook_due("hook", now=129.0, limit=5, lease_s=30.0) == []
    # a settles the first; its claim of the second runs out (a killed while sending)
    await a.webhook_settle("hook", 1, state="delivered", attempts=1, next_at=101.0,
                           error=None, now=101.0)
    again = await b.webhook_due("hook", now=131.0, limit=5, lease_s=30.0)
    assert [d.seq for d in again] == [2]
    # a's late answer for a row b holds now is not written over b's claim
    await a.webhook_settle("hook", 2, state="failed", attempts=1, next_at=132.0,
                           error="late", now=132.0)
    backlog = await b.webhook_backlog()
    assert backlog["hook"].pending == 2 and backlog["hook"].delivered == 1


async def test_a_node_that_stops_hands_its_webhook_deliveries_back_at_once(
        nodes: list[PostgresStore]) -> None:
    a, b, _ = nodes
    for node in nodes:
        node.set_webhook_route(lambda e: ("hook",))
    a.append_event(Event(seq=1, ts=10.0, type="turn.finished", turn=None, data={}))
    await a.flush()
    assert [d.seq for d in await a.webhook_due("hook", now=100.0, limit=5,
                                               lease_s=30.0)] == [1]
    assert await b.webhook_due("hook", now=101.0, limit=5, lease_s=30.0) == []
    await a.webhook_release()
    assert [d.seq for d in await b.webhook_due("hook", now=101.0, limit=5,
                                               lease_s=30.0)] == [1]


async def test_webhook_delivery_of_a_lost_turn_is_not_written(
        db: str, nodes: list[PostgresStore]) -> None:
    a, b, _ = nodes
    for node in nodes:
        node.set_webhook_route(lambda e: ("hook",) if e.type == "turn.finished" else ())
    rec = record("t_w")
    await a.insert_turn(rec, {})
    [claimed] = await b.claim(1)
    await expire(db, "t_w")
    [taken] = await a.claim(1)
    assert taken.record["id"] == "t_w"
    b.append_event(Event(seq=5, ts=10.0, type="turn.finished", turn="t_w", data={}))
    await b.flush()
    assert await a.webhook_due("hook", now=1e9, limit=5) == []
    a.append_event(Event(seq=6, ts=10.0, type="turn.finished", turn="t_w", data={}))
    await a.flush()
    assert [d.seq for d in await a.webhook_due("hook", now=1e9, limit=5)] == [6]
    assert claimed.record["id"] == "t_w"


async def test_a_follower_never_steps_over_an_event_that_commits_after_later_ones(
        db: str, nodes: list[PostgresStore]) -> None:
    """Two writers in flight: the first takes the lower position and commits last. A
    follower that read the second's row must still get the first's when it commits."""
    reader = nodes[0]
    await reader.event_block_start()
    other = reader.event_base + 5 * EVENT_BLOCK  # another node's numbers
    insert = ("INSERT INTO events (seq, turn, ts, type, data) VALUES ($1, 't', 1.0,"
              " 'turn.progress', $2)")
    cursor = await reader.events_cursor()
    first, second = await asyncpg.connect(db), await asyncpg.connect(db)
    seen: list[int] = []
    try:
        slow = first.transaction()
        await slow.start()
        await first.execute(insert, other + 1, '{"seq": 1}')  # the lower position
        await second.execute(insert, other + 2, '{"seq": 2}')  # committed at once
        got, cursor = await reader.peer_events(after=cursor)
        seen += [e["seq"] for e in got]
        await slow.commit()
        got, cursor = await reader.peer_events(after=cursor)
        seen += [e["seq"] for e in got]
        got, cursor = await reader.peer_events(after=cursor)
        assert got == []  # nothing twice
    finally:
        await first.close()
        await second.close()
    assert sorted(seen) == [1, 2], seen


# A node's connections: made at open, the writers' plans kept, a pooled connection
# handed back rolled back; a claim whose rows cannot be read.

async def test_a_claim_whose_rows_cannot_be_read_hands_its_turns_back_at_once(
        nodes: list[PostgresStore], db: str, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b, _ = nodes
    await a.insert_turn(record("t_0"), {"i": 0})
    # The claim commits on its own; the read of its rows after it fails.
    monkeypatch.setattr(postgres_fleet, "CLAIMED_ROWS", "SELECT no_such_column")
    with pytest.raises(StoreError):
        await a.claim(1)
    assert a.claims == {}
    conn = await asyncpg.connect(db)
    try:
        row = await conn.fetchrow("SELECT owner, epoch FROM turns WHERE id = 't_0'")
    finally:
        await conn.close()
    assert (row["owner"], row["epoch"]) == (None, 1)
    monkeypatch.undo()
    # Not left to its lease: another node takes it now, under a new epoch.
    [got] = await b.claim(1)
    assert (got.record["id"], got.epoch, got.checkpoint) == ("t_0", 2, {"i": 0})


async def test_a_nodes_connections_are_made_at_open_the_writers_keeping_their_plans(
        nodes: list[PostgresStore]) -> None:
    a = nodes[0]
    assert all(d.conn is not None for d in (*a.db.writer_conns, a.db.lease_conn,
                                            a.intake.connection))
    writer = a.db.writer_conns[0].conn
    assert writer is not None
    assert await writer.fetchval("SHOW plan_cache_mode") == "force_generic_plan"
    pool = a.db.require_pool()
    async with pool.acquire() as conn:
        assert await conn.fetchval("SHOW plan_cache_mode") == "auto"
        await conn.execute("BEGIN")  # handed back in a transaction: rolled back
        await conn.execute("UPDATE turns SET owner = 'x'")
    async with pool.acquire() as conn:
        assert not conn.is_in_transaction()
        assert await conn.fetchval("SELECT count(*) FROM turns WHERE owner = 'x'") == 0
