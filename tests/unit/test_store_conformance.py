"""One suite, every store: each backend must give the same answers to the same calls.

The fixture opens each backend (SQLite on a temporary file, the in-memory store, a fresh
PostgreSQL database dropped after the test) and runs its writer task where it has one; a
new backend joins by adding itself to `BACKENDS`.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
from tests.pg import FreshPostgresStore

import turnkeeper
from turnkeeper.events import Event
from turnkeeper.policy.idempotency import IdempotencyKey, StoredKey
from turnkeeper.policy.limits import FinishedTurn
from turnkeeper.store.base import KeyTaken, MessageRows, Store, StoreError, rows_of
from turnkeeper.store.memory import MemoryStore
from turnkeeper.store.sqlite import (
    EVENTS_OF_TURN,
    SCHEMA_VERSION,
    SQLiteStore,
    prune_statements,
)
from turnkeeper.store.sqlite_schema import migrate, prepare

BACKENDS: dict[str, Callable[[Path], Any]] = {
    "sqlite": lambda tmp: SQLiteStore(tmp / "state.db"),
    "memory": lambda tmp: MemoryStore(),
    "postgres": lambda tmp: FreshPostgresStore(),
}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(params=sorted(BACKENDS), name="store")
async def every_store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Store]:
    """Each backend, open with its writer running (import `every_store`, ask for `store`)."""
    backend = BACKENDS[request.param](tmp_path)
    await backend.open()
    async with anyio.create_task_group() as tg:
        await tg.start(backend.run)
        try:
            yield backend
        finally:
            await backend.close()


def record(turn_id: str, *, session: str | None = None, state: str = "queued",
           at: float = 100.0, **extra: Any) -> dict[str, Any]:
    return {"id": turn_id, "session": session or turn_id, "state": state,
            "message": f"message of {turn_id}", "created_at": at, "updated_at": at,
            "inbox": [], "budget": {"max_steps": 3}, "deadline": None, **extra}


def finished(rec: dict[str, Any], state: str, code: str, *, at: float = 200.0
             ) -> dict[str, Any]:
    return {**rec, "state": state, "updated_at": at,
            "result": {"status": state, "stopped_because": {"code": code}}}


def event(seq: int, turn: str | None = None, type: str = "turn.step") -> Event:
    return Event(seq=seq, ts=1.0 + seq, type=type, turn=turn, data={"n": seq})


pytestmark = pytest.mark.anyio


async def test_insert_numbers_turns_in_submission_order_and_get_reads_them(store: Store
                                                                           ) -> None:
    a, b = record("t_a"), record("t_b")
    assert await store.insert_turn(a, {"step": 0}) == 1
    assert await store.insert_turn(b, {}) == 2
    assert a["seq"] == 1 and b["seq"] == 2  # the caller's record learns its number
    got = await store.get_turn("t_a")
    assert got is not None and got["seq"] == 1 and got["message"] == "message of t_a"
    assert await store.get_checkpoint("t_a") == {"step": 0}
    assert await store.get_turn("t_missing") is None
    assert await store.get_checkpoint("t_missing") is None


async def test_stored_data_is_a_copy_of_what_was_written(store: Store) -> None:
    a = record("t_a", tags=("x", "y"))
    checkpoint: dict[str, Any] = {"conversation": [1]}
    await store.insert_turn(a, checkpoint)
    a["message"] = "changed after the write"
    checkpoint["conversation"].append(2)
    got = await store.get_turn("t_a")
    assert got is not None and got["message"] == "message of t_a"
    assert got["tags"] == ["x", "y"]  # JSON gives lists back
    assert await store.get_checkpoint("t_a") == {"conversation": [1]}


async def test_save_turn_replaces_the_record_and_the_checkpoint_only_when_given(
        store: Store) -> None:
    a = record("t_a")
    await store.insert_turn(a, {"step": 0})
    await store.save_turn({**a, "state": "running", "updated_at": 150.0}, {"step": 1})
    got = await store.get_turn("t_a")
    assert got is not None and got["state"] == "running"
    assert await store.get_checkpoint("t_a") == {"step": 1}
    await store.save_turn(finished(a, "completed", "completed"))
    assert await store.get_checkpoint("t_a") == {"step": 1}
    got = await store.get_turn("t_a")
    assert got is not None and got["state"] == "completed"
    await store.save_turn(record("t_never_inserted", state="running"))  # no row: no-op
    assert await store.get_turn("t_never_inserted") is None


async def test_a_turns_agent_is_kept_with_its_record_across_writes_and_reads(
        store: Store) -> None:
    # What a restart or another fleet node reads back: the turn's agent, with the model
    # and profile it was given, from the record the store holds.
    a = record("t_a", agent="support", model="cheap", profile="quick")
    await store.insert_turn(a, {"step": 0})
    await store.save_turn({**a, "state": "suspended", "updated_at": 150.0}, {"step": 1})
    got = await store.get_turn("t_a")
    assert got is not None
    assert (got["agent"], got["model"], got["profile"]) == ("support", "cheap", "quick")
    ((unfinished, _),) = await store.unfinished_turns()
    assert unfinished["agent"] == "support"


async def test_append_message_adds_to_the_stored_inbox_and_nothing_else(store: Store
                                                                       ) -> None:
    a = record("t_a")
    await store.insert_turn(a, {"step": 0})
    message = {"kind": "steer", "text": "left", "redirect": False, "at": 120.0}
    await store.append_message("t_a", message, updated_at=120.0,
                               events=[event(1, "t_a", "turn.message")])
    await store.append_message("t_a", {**message, "text": "right"}, updated_at=121.0)
    got = await store.get_turn("t_a")
    assert got is not None
    assert [m["text"] for m in got["inbox"]] == ["left", "right"]
    assert got["updated_at"] == 121.0 and got["state"] == "queued"
    assert await store.get_checkpoint("t_a") == {"step": 0}
    assert [e["type"] for e in await store.events(turn="t_a")] == ["turn.message"]


async def test_events_commit_with_their_write_in_order_and_filter_by_turn(store: Store
                                                                         ) -> None:
    await store.insert_turn(record("t_a"), {}, events=[event(1, "t_a", "turn.queued")])
    store.append_event(event(2, "t_a"))
    store.append_event(event(3, None, "daemon.reloading"))
    store.append_event(event(4, "t_b"))
    store.append_event(event(2, "t_a", "duplicate"))  # a number is stored once
    await store.flush()
    assert [e["seq"] for e in await store.events()] == [1, 2, 3, 4]
    assert [e["seq"] for e in await store.events(turn="t_a")] == [1, 2]
    assert (await store.events(turn="t_a"))[1]["type"] == "turn.step"
    assert [e["seq"] for e in await store.events(after_seq=2, limit=1)] == [3]
    first = (await store.events())[0]
    assert first == {"seq": 1, "ts": 2.0, "turn": "t_a", "type": "turn.queued", "n": 1}


async def test_max_event_seq_covers_stored_and_reserved_numbers(store: Store) -> None:
    assert await store.max_event_seq() == 0
    store.append_event(event(5))
    await store.flush()
    assert await store.max_event_seq() == 5
    store.reserve_event_seqs(100)
    store.reserve_event_seqs(50)  # a reservation never goes down
    await store.flush()
    assert await store.max_event_seq() == 100


async def test_list_turns_newest_first_with_filters_and_limit(store: Store) -> None:
    for i, (session, state) in enumerate([("s1", "queued"), ("s2", "running"),
                                          ("s1", "running"), ("s1", "queued")]):
        rec = record(f"t_{i}", session=session)
        await store.insert_turn(rec, {})
        await store.save_turn({**rec, "state": state})
    ids = [r["id"] for r in await store.list_turns()]
    assert ids == ["t_3", "t_2", "t_1", "t_0"]
    assert [r["id"] for r in await store.list_turns(state="running")] == ["t_2", "t_1"]
    assert [r["id"] for r in await store.list_turns(session="s1")] == ["t_3", "t_2", "t_0"]
    assert [r["id"] for r in await store.list_turns(state="queued", session="s1")] == [
        "t_3", "t_0"]
    assert [r["id"] for r in await store.list_turns(limit=2)] == ["t_3", "t_2"]


async def test_list_turns_pages_by_seq_and_filters_by_submission_time(store: Store) -> None:
    for i in range(5):
        await store.insert_turn(record(f"t_{i}", at=100.0 + i), {})
    first = await store.list_turns(limit=2)
    assert [r["id"] for r in first] == ["t_4", "t_3"]
    second = await store.list_turns(limit=2, before_seq=first[-1]["seq"])
    assert [r["id"] for r in second] == ["t_2", "t_1"]
    assert [r["id"] for r in await store.list_turns(since=102.0)] == ["t_4", "t_3", "t_2"]
    assert [r["id"] for r in await store.list_turns(since=102.0, before_seq=4)] == ["t_2"]


async def test_unfinished_turns_in_submission_order_with_their_checkpoints(store: Store
                                                                          ) -> None:
    states = ["running", "completed", "suspended", "failed", "waiting", "queued"]
    for i, state in enumerate(states):
        rec = record(f"t_{i}")
        await store.insert_turn(rec, {"i": i})
        if state != "queued":
            await store.save_turn({**rec, "state": state})
    unfinished = await store.unfinished_turns()
    assert [(r["id"], c["i"]) for r, c in unfinished] == [
        ("t_0", 0), ("t_2", 2), ("t_4", 4), ("t_5", 5)]


async def test_session_history_is_the_finished_turns_before_a_seq(store: Store) -> None:
    seqs = []
    for i, (session, state) in enumerate([("s", "completed"), ("other", "completed"),
                                          ("s", "partial"), ("s", "running"),
                                          ("s", "completed")]):
        rec = record(f"t_{i}", session=session)
        seqs.append(await store.insert_turn(rec, {}))
        await store.save_turn({**rec, "state": state})
    history = await store.session_history("s", before_seq=seqs[4])
    assert [r["id"] for r in history] == ["t_0", "t_2"]
    assert await store.session_history("s", before_seq=seqs[0]) == []


async def test_a_turns_message_is_written_once_and_every_read_gives_it_back(
        store: Store) -> None:
    """The message is the one the turn was inserted with: later saves of its record (a
    checkpoint's, twice a step; a replay's) do not write it, and every read has it."""
    rec = record("t_0", session="s")
    seq = await store.insert_turn(rec, {})
    running = {**rec, "state": "running", "updated_at": 150.0, "message": "not stored"}
    await store.save_turn(running, {"step": 1})
    got = await store.get_turn("t_0")
    assert got is not None and got["state"] == "running"
    assert got["message"] == "message of t_0"
    assert [r["message"] for r, _ in await store.unfinished_turns()] == ["message of t_0"]
    assert [r["message"] for r in await store.list_turns()] == ["message of t_0"]
    await store.save_turn(finished(running, "failed", "providers.rejected"))
    assert [r["message"] for r in await store.session_history("s", before_seq=seq + 1)
            ] == ["message of t_0"]
    assert [x["message"] for x in await store.dead_letters()] == ["message of t_0"]
    await store.requeue_turn({**running, "state": "queued", "updated_at": 300.0}, {})
    got = await store.get_turn("t_0")
    assert got is not None and got["message"] == "message of t_0"
    # Any text, a NUL character included (PostgreSQL's text refuses one unescaped).
    await store.insert_turn(record("t_1", message="a\x00b \u00e9 \U0001f600"), {})
    got = await store.get_turn("t_1")
    assert got is not None and got["message"] == "a\x00b \u00e9 \U0001f600"


async def test_journal_keeps_the_first_intent_and_its_outcome(store: Store) -> None:
    await store.journal_intent("k1", turn="t_a", tool="write", arguments='{"x":1}',
                               idempotent=False)
    await store.journal_intent("k1", turn="t_a", tool="other", arguments="{}",
                               idempotent=False)
    assert await store.journal_get("k1") == {"key": "k1", "tool": "write",
                                             "arguments": '{"x":1}', "idempotent": False,
                                             "outcome": None}
    await store.journal_outcome("k1", {"ok": True})
    got = await store.journal_get("k1")
    assert got is not None and got["outcome"] == {"ok": True}
    await store.journal_intent("k2", turn="t_a", tool="read", arguments="{}",
                               idempotent=True)
    await store.journal_outcome("k2", {"ok": False})
    await store.flush()
    got = await store.journal_get("k2")
    assert got is not None and got["idempotent"] is True and got["outcome"] == {"ok": False}
    assert await store.journal_get("k_missing") is None


async def test_a_second_intent_of_a_key_clears_the_outcome_of_the_attempt_before(
        store: Store) -> None:
    """A non-idempotent action sent again with the same key (after a failure or an
    unknown outcome): until its own outcome is written, the journal says it is in
    flight, never what the attempt before it answered."""
    await store.journal_intent("k1", turn="t_a", tool="pay", arguments='{"x":1}',
                               idempotent=False)
    await store.journal_outcome("k1", {"kind": "failed"})
    await store.journal_intent("k1", turn="t_a", tool="pay", arguments='{"x":1}',
                               idempotent=False)
    assert await store.journal_get("k1") == {"key": "k1", "tool": "pay",
                                             "arguments": '{"x":1}', "idempotent": False,
                                             "outcome": None}
    await store.journal_outcome("k1", {"kind": "ok"})
    got = await store.journal_get("k1")
    assert got is not None and got["outcome"] == {"kind": "ok"}


async def test_finished_usage_newest_first_since_a_time_with_only_what_it_used(
        store: Store) -> None:
    for i, (state, at) in enumerate([("completed", 100.0), ("running", 300.0),
                                     ("partial", 300.0), ("cancelled", 400.0)]):
        rec = record(f"t_{i}", profile="deep" if i == 2 else None,
                     usage={"total_tokens": 10 * i, "seconds": 1.5 * i, "cost_usd": 0.01},
                     counters={"steps": i},
                     would_have_stopped=[{"code": "budget.steps"}] if i == 3 else [])
        await store.insert_turn(rec, {})
        done = finished(rec, state, "completed" if state == "completed" else "cancelled",
                        at=at) if state != "running" else {**rec, "state": state,
                                                             "updated_at": at}
        await store.save_turn(done)
    usage = await store.finished_usage()
    assert usage == [
        FinishedTurn(profile="default", status="cancelled", code="cancelled", tokens=30,
                  seconds=4.5, steps=3, cost_usd=0.01, would_have_stopped=("budget.steps",)),
        FinishedTurn(profile="deep", status="partial", code="cancelled", tokens=20,
                  seconds=3.0, steps=2, cost_usd=0.01),
        FinishedTurn(profile="default", status="completed", code="completed", tokens=0,
                  seconds=0.0, steps=0, cost_usd=0.01)]
    assert [u.status for u in await store.finished_usage(since=300.0)] == [
        "cancelled", "partial"]
    assert len(await store.finished_usage(limit=1)) == 1
    # A record may hold any text: a NUL character (which PostgreSQL's jsonb refuses) and
    # the six characters of its JSON escape, in the answer and the last error.
    rec = record("t_9", last_error="a\x00b", counters={"steps": 1},
                 usage={"total_tokens": 7, "seconds": 1.0, "cost_usd": 0.0})
    await store.insert_turn(rec, {})
    done = finished(rec, "completed", "completed", at=500.0)
    done["result"]["answer"] = "nul \x00, its escape \\u0000, a backslash \\"
    await store.save_turn(done)
    assert [(u.status, u.tokens) for u in await store.finished_usage(since=500.0)] == [
        ("completed", 7)]
    got = await store.get_turn("t_9")
    assert got is not None and got["result"]["answer"] == done["result"]["answer"]


async def test_dead_letters_are_the_turns_the_rule_names_and_remember_replays(
        store: Store) -> None:
    ends = [("failed", "providers.rejected"), ("partial", "providers.exhausted"),
            ("failed", "internal"), ("partial", "budget.steps"),
            ("completed", "completed"), ("cancelled", "cancelled")]
    for i, (state, code) in enumerate(ends):
        rec = record(f"t_{i}", session="s", last_error=f"error {i}")
        await store.insert_turn(rec, {})
        await store.save_turn(finished(rec, state, code, at=200.0 + i))
    letters = await store.dead_letters()
    assert [x["id"] for x in letters] == ["t_2", "t_1", "t_0"]
    assert letters[2] == {
        "id": "t_0", "turn": "t_0", "session": "s", "message": "message of t_0",
        "budget": {"max_steps": 3}, "deadline": None,
        "stopped_because": {"code": "providers.rejected"}, "last_error": "error 0",
        "finished_at": 200.0, "replayed_by": None}
    await store.mark_replayed("t_0", "t_new")
    assert (await store.dead_letters())[2]["replayed_by"] == "t_new"
    got = await store.get_turn("t_0")
    assert got is not None and got["replayed_by"] == "t_new"


async def test_a_replayed_dead_letter_is_queued_again_with_its_event_and_checkpoint(
        store: Store) -> None:
    rec = record("t_0", session="s")
    await store.insert_turn(rec, {"conversation": ["before"]})
    done = finished(rec, "partial", "providers.exhausted")
    await store.save_turn(done)
    assert [x["id"] for x in await store.dead_letters()] == ["t_0"]
    again = {**done, "state": "queued", "result": None, "updated_at": 300.0,
             "previous_results": [done["result"]]}
    await store.requeue_turn(again, {"conversation": ["before"], "chain": None},
                             events=[event(7, "t_0", "turn.replayed")])
    assert await store.dead_letters() == []
    got = await store.get_turn("t_0")
    assert got is not None and got["state"] == "queued" and got["result"] is None
    assert got["previous_results"] == [done["result"]]
    assert await store.get_checkpoint("t_0") == {"conversation": ["before"], "chain": None}
    assert [e["type"] for e in await store.events(turn="t_0")] == ["turn.replayed"]
    assert [r["id"] for r, _ in await store.unfinished_turns()] == ["t_0"]


async def test_prune_deletes_finished_turns_past_their_keep_with_all_they_hold(
        store: Store) -> None:
    for i, (state, code, at) in enumerate([
            ("completed", "completed", 100.0), ("failed", "providers.rejected", 110.0),
            ("completed", "completed", 120.0), ("completed", "completed", 500.0)]):
        rec = record(f"t_{i}", at=at)
        await store.insert_turn(rec, {"n": i}, events=[event(10 * i + 1, f"t_{i}")])
        await store.journal_intent(f"k{i}", turn=f"t_{i}", tool="send", arguments="{}",
                                   idempotent=False)
        await store.save_turn(finished(rec, state, code, at=at))
    live = record("t_live", at=50.0)
    await store.insert_turn(live, {}, events=[event(60, "t_live")])
    store.append_event(Event(seq=70, ts=100.0, type="daemon.reloaded", turn=None, data={}))
    store.append_event(Event(seq=71, ts=400.0, type="daemon.reloaded", turn=None, data={}))
    await store.flush()
    assert await store.prune(finished_before=300.0, limit=1) == 1  # oldest first
    assert await store.get_turn("t_0") is None
    assert await store.prune(finished_before=300.0, limit=10) == 1  # t_2: not the letter
    assert await store.prune(finished_before=300.0, limit=10) == 0
    assert [r["id"] for r in await store.list_turns()] == ["t_live", "t_3", "t_1"]
    assert await store.events(turn="t_2") == []
    assert await store.journal_get("k2") is None
    assert await store.get_checkpoint("t_2") is None
    assert await store.journal_get("k3") is not None  # not due yet
    assert [e["seq"] for e in await store.events() if e.get("turn") is None] == [71]
    assert [x["id"] for x in await store.dead_letters()] == ["t_1"]
    assert await store.prune(finished_before=300.0, dead_letters=True, limit=10) == 1
    assert await store.dead_letters() == []
    assert [r["id"] for r, _ in await store.unfinished_turns()] == ["t_live"]


def key(name: str, *, fp: str = "fp1", at: float = 100.0, stale_before: float = 0.0
        ) -> IdempotencyKey:
    return IdempotencyKey(key=name, fingerprint=fp, created_at=at, stale_before=stale_before)


async def test_an_idempotency_key_is_written_with_its_turn_and_read_back(store: Store
                                                                         ) -> None:
    assert await store.idempotency_key("k-1") is None
    await store.insert_turn(record("t_a"), {}, idempotency=key("k-1"))
    assert await store.idempotency_key("k-1") == StoredKey("k-1", "t_a", "fp1", 100.0)


async def test_a_live_key_makes_one_turn_and_the_second_insert_writes_nothing(
        store: Store) -> None:
    await store.insert_turn(record("t_a"), {}, idempotency=key("k-1"))
    with pytest.raises(KeyTaken):
        await store.insert_turn(record("t_b"), {}, events=[event(5, "t_b")],
                                idempotency=key("k-1", fp="fp2", at=150.0,
                                                stale_before=50.0))
    assert await store.get_turn("t_b") is None
    assert await store.events(turn="t_b") == []
    assert (await store.idempotency_key("k-1")) == StoredKey("k-1", "t_a", "fp1", 100.0)


async def test_two_inserts_with_one_key_at_once_make_one_turn(store: Store) -> None:
    outcomes: list[BaseException | None] = []

    async def insert(turn: str) -> None:
        try:
            await store.insert_turn(record(turn), {}, idempotency=key("k-1"))
            outcomes.append(None)
        except StoreError as exc:
            outcomes.append(exc)

    async with anyio.create_task_group() as tg:
        for turn in ("t_a", "t_b", "t_c"):
            tg.start_soon(insert, turn)
    assert sum(o is None for o in outcomes) == 1
    assert all(isinstance(o, KeyTaken) for o in outcomes if o is not None)
    held = await store.idempotency_key("k-1")
    assert held is not None
    assert [r["id"] for r in await store.list_turns()] == [held.turn]


async def test_an_expired_key_or_one_whose_turn_is_gone_is_replaced(store: Store) -> None:
    await store.insert_turn(record("t_a"), {}, idempotency=key("k-1", at=100.0))
    await store.insert_turn(record("t_b"), {},
                            idempotency=key("k-1", fp="fp2", at=200.0, stale_before=150.0))
    assert await store.idempotency_key("k-1") == StoredKey("k-1", "t_b", "fp2", 200.0)
    await store.save_turn(finished(record("t_b"), "completed", "completed", at=210.0))
    assert await store.prune(finished_before=300.0, limit=10) == 1  # t_b
    await store.insert_turn(record("t_c"), {},
                            idempotency=key("k-1", fp="fp3", at=220.0, stale_before=150.0))
    assert await store.idempotency_key("k-1") == StoredKey("k-1", "t_c", "fp3", 220.0)


async def test_prune_idempotency_keys_deletes_those_written_before_a_time(store: Store
                                                                          ) -> None:
    for i, at in enumerate((100.0, 110.0, 300.0)):
        await store.insert_turn(record(f"t_{i}"), {}, idempotency=key(f"k{i}", at=at))
    assert await store.prune_idempotency_keys(created_before=200.0, limit=1) == 1
    assert await store.idempotency_key("k0") is None
    assert await store.prune_idempotency_keys(created_before=200.0, limit=10) == 1
    assert await store.prune_idempotency_keys(created_before=200.0, limit=10) == 0
    assert await store.idempotency_key("k2") is not None
    assert await store.get_turn("t_0") is not None  # the key goes, not its turn


@pytest.mark.postgres  # every backend, PostgreSQL among them
async def test_a_write_after_close_is_refused(tmp_path: Path) -> None:
    for make in BACKENDS.values():
        backend = make(tmp_path)
        await backend.open()
        async with anyio.create_task_group() as tg:
            await tg.start(backend.run)
            await backend.close()
        with pytest.raises(StoreError):
            await backend.insert_turn(record("t_late"), {})


# -- the conversation as message rows -------------------------------------------------------


def msg(text: str, role: str = "user") -> dict[str, Any]:
    return {"role": role, "content": text}


def rows(start: int, *texts: str) -> MessageRows:
    return MessageRows(start, tuple(json.dumps(msg(t)) for t in texts))


def conv_cp(count: int, **extra: Any) -> dict[str, Any]:
    """A checkpoint as the turn writes it: the conversation's counts, no messages."""
    return {"conversation": {"count": count, "turn_start": 0}, "budget": {"n": count},
            **extra}


def contents(checkpoint: dict[str, Any] | None) -> list[str]:
    assert checkpoint is not None
    return [m["content"] for m in checkpoint["conversation"]["messages"]]


async def test_message_rows_are_appended_across_saves_and_read_back_inline(
        store: Store) -> None:
    a = record("t_a", state="running")
    await store.insert_turn(a, {})
    await store.save_turn(a, conv_cp(2), messages=rows(0, "task", "step 1"))
    await store.save_turn(a, conv_cp(3), messages=rows(2, "step 2"))
    await store.save_turn(a, conv_cp(3), messages=MessageRows(3, ()))
    got = await store.get_checkpoint("t_a")
    assert got == {"conversation": {"count": 3, "turn_start": 0,
                                    "messages": [msg("task"), msg("step 1"), msg("step 2")]},
                   "budget": {"n": 3}}
    await store.save_turn(finished(a, "completed", "completed"))  # the record alone
    assert contents(await store.get_checkpoint("t_a")) == ["task", "step 1", "step 2"]


async def test_rows_from_a_lower_start_replace_every_row_after_it(store: Store) -> None:
    a = record("t_a", state="running")
    await store.insert_turn(a, {})
    await store.save_turn(a, conv_cp(4), messages=rows(0, "m0", "m1", "m2", "m3"))
    await store.save_turn(a, conv_cp(2), messages=rows(1, "note"))  # a compaction
    assert contents(await store.get_checkpoint("t_a")) == ["m0", "note"]
    # The rows after it are gone, not merely hidden by the count.
    await store.save_turn(a, conv_cp(4))
    assert contents(await store.get_checkpoint("t_a")) == ["m0", "note"]
    await store.save_turn(a, conv_cp(3), messages=rows(0, "x", "y", "z"))
    assert contents(await store.get_checkpoint("t_a")) == ["x", "y", "z"]


async def test_unfinished_turns_get_their_own_messages_back(store: Store) -> None:
    for i, state in enumerate(["running", "completed", "suspended", "queued"]):
        rec = record(f"t_{i}", state=state)
        await store.insert_turn(rec, {})
        if state != "queued":
            await store.save_turn(rec, conv_cp(i + 1),
                                  messages=rows(0, *(f"{i}.{n}" for n in range(i + 1))))
    unfinished = await store.unfinished_turns()
    assert [(r["id"], contents(c) if c else None) for r, c in unfinished] == [
        ("t_0", ["0.0"]), ("t_2", ["2.0", "2.1", "2.2"]), ("t_3", None)]
    assert unfinished[2][1] == {}
    assert contents(await store.get_checkpoint("t_1")) == ["1.0", "1.1"]


async def test_a_checkpoint_with_no_messages_yet_reads_back_an_empty_list(store: Store
                                                                         ) -> None:
    await store.insert_turn(record("t_a"), conv_cp(0))
    assert contents(await store.get_checkpoint("t_a")) == []
    assert [contents(c) for _, c in await store.unfinished_turns()] == [[]]


async def test_a_checkpoint_from_before_rows_reads_back_as_stored(store: Store) -> None:
    legacy = {"conversation": {"messages": [msg("task"), msg("old")], "turn_start": 0},
              "budget": {"n": 1}}
    a = record("t_a", state="running")
    await store.insert_turn(a, {})
    await store.save_turn(a, legacy)
    assert await store.get_checkpoint("t_a") == legacy
    assert [c for _, c in await store.unfinished_turns()] == [legacy]
    # Its first save after the resume writes every row from index 0.
    await store.save_turn(a, conv_cp(3), messages=rows(0, "task", "old", "new"))
    assert contents(await store.get_checkpoint("t_a")) == ["task", "old", "new"]


async def test_rows_for_a_turn_never_inserted_are_not_kept(store: Store) -> None:
    ghost = record("t_ghost", state="running")
    await store.save_turn(ghost, trail_cp(1, 1), messages=rows(0, "lost"),
                          trail=MessageRows(0, ("plost",)))
    await store.insert_turn(ghost, conv_cp(0))
    # A checkpoint that counts a row no write gave it: had the ghost's rows been kept,
    # they would be read back here.
    await store.save_turn(ghost, trail_cp(1, 1))
    got = await store.get_checkpoint("t_ghost")
    assert contents(got) == [] and trail_of(got) == []


async def test_a_replay_requeues_the_messages_it_read_as_rows(store: Store) -> None:
    rec = record("t_0", session="s", state="running")
    await store.insert_turn(rec, {})
    await store.save_turn(rec, conv_cp(2), messages=rows(0, "task", "reply"))
    done = finished(rec, "partial", "providers.exhausted")
    await store.save_turn(done)
    read = await store.get_checkpoint("t_0")
    assert read is not None
    checkpoint, again_rows, no_trail = rows_of({**read, "chain": None})
    assert checkpoint["conversation"] == {"count": 2, "turn_start": 0}
    assert again_rows is not None and again_rows.start == 0 and no_trail is None
    again = {**done, "state": "queued", "result": None, "updated_at": 300.0}
    await store.requeue_turn(again, checkpoint, messages=again_rows,
                             events=[event(7, "t_0", "turn.replayed")])
    assert await store.get_checkpoint("t_0") == {**read, "chain": None}
    [(_, resumed)] = await store.unfinished_turns()
    assert contents(resumed) == ["task", "reply"] and resumed["chain"] is None
    # A requeue may also rewrite from a later index, as a save does.
    await store.requeue_turn(again, conv_cp(3), messages=rows(2, "more"))
    assert contents(await store.get_checkpoint("t_0")) == ["task", "reply", "more"]


async def test_a_replay_of_a_checkpoint_from_before_rows_stores_its_rows(store: Store
                                                                        ) -> None:
    legacy = {"conversation": {"messages": [msg("task"), msg("old")], "turn_start": 0,
                               "held_notes": ["note"]}}
    rec = record("t_0", state="failed")
    await store.insert_turn(rec, legacy)
    checkpoint, again_rows, _ = rows_of(legacy)
    assert checkpoint["conversation"] == {"count": 2, "turn_start": 0,
                                          "held_notes": ["note"]}
    await store.requeue_turn({**rec, "state": "queued"}, checkpoint, messages=again_rows)
    got = await store.get_checkpoint("t_0")
    assert got is not None and contents(got) == ["task", "old"]
    assert got["conversation"]["held_notes"] == ["note"]


def trail_cp(messages: int, lines: int) -> dict[str, Any]:
    return {**conv_cp(messages), "trail": {"count": lines}}


def trail_of(checkpoint: dict[str, Any] | None) -> list[str]:
    assert checkpoint is not None
    return list(checkpoint["trail"]["rows"])


async def test_trail_rows_are_appended_and_read_back_with_the_checkpoint(store: Store
                                                                        ) -> None:
    """A turn's trail is a second list of rows beside its messages: each save writes
    the lines added since the last one, and every read gives back the rows the
    checkpoint counts, in order."""
    rec = record("t_0", state="running")
    await store.insert_turn(rec, {})
    await store.save_turn(rec, trail_cp(1, 2), messages=rows(0, "task"),
                          trail=MessageRows(0, ("pa", "lrb")))
    await store.save_turn(rec, trail_cp(1, 3), trail=MessageRows(2, ("ec",)))
    got = await store.get_checkpoint("t_0")
    assert trail_of(got) == ["pa", "lrb", "ec"] and contents(got) == ["task"]
    [(_, resumed)] = await store.unfinished_turns()
    assert trail_of(resumed) == ["pa", "lrb", "ec"]
    # Rows past the checkpoint's count are not read: the count is what the turn holds.
    await store.save_turn(rec, trail_cp(1, 2))
    assert trail_of(await store.get_checkpoint("t_0")) == ["pa", "lrb"]
    # A write from an index replaces the rows from there.
    await store.save_turn(rec, trail_cp(1, 3), trail=MessageRows(2, ("pd",)))
    assert trail_of(await store.get_checkpoint("t_0")) == ["pa", "lrb", "pd"]


async def test_a_replay_requeues_the_trail_it_read_as_rows(store: Store) -> None:
    rec = record("t_0", state="running")
    await store.insert_turn(rec, {})
    await store.save_turn(rec, trail_cp(1, 2), messages=rows(0, "task"),
                          trail=MessageRows(0, ("pa", "pb")))
    await store.save_turn(finished(rec, "partial", "providers.exhausted"))
    read = await store.get_checkpoint("t_0")
    assert read is not None
    checkpoint, _, lines = rows_of(read)
    assert checkpoint["trail"] == {"count": 2}
    assert lines == MessageRows(0, ("pa", "pb"))
    await store.requeue_turn({**rec, "state": "queued"}, {**checkpoint, "trail": {"count": 3}},
                             trail=MessageRows(0, ("pa", "pb", "pz")))
    assert trail_of(await store.get_checkpoint("t_0")) == ["pa", "pb", "pz"]


async def test_prune_takes_a_turns_trail_with_it(store: Store) -> None:
    rec = record("t_0", state="running")
    await store.insert_turn(rec, {})
    await store.save_turn(rec, trail_cp(1, 1), messages=rows(0, "task"),
                          trail=MessageRows(0, ("pa",)))
    await store.save_turn(finished(rec, "completed", "completed"))
    assert await store.prune(finished_before=10**12, limit=10) == 1
    # A turn of the same id inserted again starts with no trail.
    await store.insert_turn(record("t_0", state="running"), {})
    await store.save_turn(record("t_0", state="running"), trail_cp(0, 0))
    assert trail_of(await store.get_checkpoint("t_0")) == []


# -- SQLite: what a crash leaves, and how a resume reads ------------------------------------

# Three turns save concurrently in a child process, each save appending two messages or,
# every fifth, rewriting from index 1 (a compaction); each checkpoint also carries the
# contents its rows must have. The parent kills it with SIGKILL mid-stream.
CRASH_CHILD = """
import json, sys
from pathlib import Path
import anyio
from turnkeeper.store.base import MessageRows
from turnkeeper.store.sqlite import SQLiteStore

async def turn(store, n):
    rec = {"id": f"t_{n}", "session": "s", "state": "running", "message": "m",
           "created_at": 1.0, "updated_at": 1.0}
    await store.insert_turn(rec, {})
    contents = []
    for save in range(1, 100_000):
        if save % 5 == 0:
            start, new = 1, [f"c{save}"]
        else:
            start, new = len(contents), [f"a{save}", f"b{save}"]
        contents[start:] = new
        text = tuple(json.dumps({"role": "user", "content": c}) for c in new)
        await store.save_turn(rec, {"conversation": {"count": len(contents),
                                                     "turn_start": 0},
                                    "expect": contents}, messages=MessageRows(start, text))
        print(n, save, flush=True)

async def main():
    store = SQLiteStore(Path(sys.argv[1]))
    await store.open()
    async with anyio.create_task_group() as tg:
        await tg.start(store.run)
        for n in range(3):
            tg.start_soon(turn, store, n)

anyio.run(main)
"""


def save_until_killed(db: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(turnkeeper.__file__).parent.parent)}
    child = subprocess.Popen([sys.executable, "-c", CRASH_CHILD, str(db)], env=env,
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    saves = 0
    for line in child.stdout:
        saves = max(saves, int(line.split()[1]))
        if saves >= 23:  # past a few compactions: kill it while it writes
            break
    child.send_signal(signal.SIGKILL)
    assert child.wait() == -signal.SIGKILL and saves >= 23  # killed while it was saving
    child.stdout.close()


async def test_a_crash_between_saves_leaves_checkpoints_and_rows_that_agree(
        tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    await anyio.to_thread.run_sync(save_until_killed, db)
    store = SQLiteStore(db)
    await store.open()
    try:
        unfinished = await store.unfinished_turns()
        assert [r["id"] for r, _ in unfinished] == ["t_0", "t_1", "t_2"]
        for _, checkpoint in unfinished:
            assert contents(checkpoint) == checkpoint["expect"]
            assert len(checkpoint["expect"]) >= 2
        # No row beyond what a checkpoint counts was left behind either.
        raw = sqlite3.connect(db)
        try:
            for record_, checkpoint in unfinished:
                (n,) = raw.execute("SELECT COUNT(*) FROM messages JOIN turns ON"
                                   " turns.seq = messages.turn_no WHERE turns.id = ?",
                                   (record_["id"],)).fetchone()
                assert n == checkpoint["conversation"]["count"]
        finally:
            raw.close()
    finally:
        await store.close()


async def test_unfinished_turns_are_read_in_three_queries_however_many_there_are(
        tmp_path: Path) -> None:
    store = SQLiteStore(tmp_path / "state.db")
    await store.open()
    async with anyio.create_task_group() as tg:
        await tg.start(store.run)
        try:
            for i in range(50):
                rec = record(f"t_{i:02}", state="running")
                await store.insert_turn(rec, {})
                await store.save_turn(rec, conv_cp(3), messages=rows(0, "a", "b", str(i)))
            statements: list[str] = []
            assert store.connection.reader is not None
            store.connection.reader.set_trace_callback(statements.append)
            unfinished = await store.unfinished_turns()
            store.connection.reader.set_trace_callback(None)
            assert [contents(c)[2] for _, c in unfinished] == [str(i) for i in range(50)]
            # the turns, their message rows, their trail rows
            assert len([s for s in statements if s.lstrip().startswith("SELECT")]) == 3
        finally:
            await store.close()


async def test_sqlite_writes_a_turns_message_once_and_no_record_carries_it(
        tmp_path: Path) -> None:
    """A checkpoint rewrites the turn's row (SQLite writes a row whole): the message is
    in `turn_input`, written with the insert, and in no record."""
    db = tmp_path / "state.db"
    store = SQLiteStore(db)
    await store.open()
    long = "x" * 20_000
    async with anyio.create_task_group() as tg:
        await tg.start(store.run)
        try:
            rec = record("t_0", message=long)
            await store.insert_turn(rec, {})
            for step in range(3):
                await store.save_turn({**rec, "state": "running"}, {"step": step})
            got = await store.get_turn("t_0")
            assert got is not None and got["message"] == long
        finally:
            await store.close()
    raw = sqlite3.connect(db)
    try:
        assert raw.execute("SELECT json_extract(record, '$.message') FROM turns"
                           ).fetchall() == [(None,)]
        assert raw.execute("SELECT turn, message FROM turn_input").fetchall() == [
            ("t_0", json.dumps(long))]
    finally:
        raw.close()


def schema_5_with_a_turn(db: Path, record_json: str) -> None:
    """A store as schema 5 left it (before the message was kept apart), holding one
    running turn `t_0` whose record is `record_json`."""
    raw = sqlite3.connect(db)
    migrate(raw, to=5)
    raw.execute("INSERT INTO turns (id, seq, session, state, created_at, updated_at,"
                " record) VALUES ('t_0', 1, 't_0', 'running', 100.0, 100.0, ?)",
                (record_json,))
    raw.commit()
    raw.close()


async def test_a_sqlite_store_of_schema_5_gets_its_messages_apart_and_reads_the_same(
        tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    # A NUL character in a message: SQLite's json_extract would stop at it.
    old = record("t_0", state="running", message="before\x00after")
    schema_5_with_a_turn(db, json.dumps(old))
    store = SQLiteStore(db)
    await store.open()
    async with anyio.create_task_group() as tg:
        await tg.start(store.run)
        try:
            [(unfinished, _)] = await store.unfinished_turns()
            assert unfinished == old
            await store.save_turn({**old, "updated_at": 150.0}, {"step": 1})
            got = await store.get_turn("t_0")
            assert got is not None and got["message"] == "before\x00after"
        finally:
            await store.close()
    raw = sqlite3.connect(db)
    try:
        assert raw.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert raw.execute("SELECT turn, message FROM turn_input").fetchall() == [
            ("t_0", json.dumps("before\x00after"))]
        assert raw.execute("SELECT json_extract(record, '$.message') FROM turns"
                           ).fetchone()[0] is None
    finally:
        raw.close()


async def test_a_damaged_row_stops_the_migration_with_a_store_error_and_no_change(
        tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    schema_5_with_a_turn(db, '{"id": broken')
    with pytest.raises(StoreError, match="damaged row"):
        await SQLiteStore(db).open()
    raw = sqlite3.connect(db)
    try:
        assert raw.execute("PRAGMA user_version").fetchone()[0] == 5
    finally:
        raw.close()


def schema_6_with_two_turns(db: Path) -> list[dict[str, Any]]:
    """A store as schema 6 left it (a turn's rows keyed by its id): `t_0` running and
    `t_1` finished, each with three message rows, a trail row and two events, and one
    event of the daemon's own. Returns the events as stored."""
    raw = sqlite3.connect(db)
    migrate(raw, to=6)
    events: list[dict[str, Any]] = [{"seq": 1, "ts": 50, "type": "daemon.started"}]
    for seq, (turn, state) in enumerate((("t_0", "running"), ("t_1", "completed")), 1):
        checkpoint = {"conversation": {"count": 3, "turn_start": 0},
                      "trail": {"count": 1, "tail": []}}
        raw.execute("INSERT INTO turns (id, seq, session, state, created_at, updated_at,"
                    " record, checkpoint) VALUES (?, ?, ?, ?, 100.0, 100.0, ?, ?)",
                    (turn, seq, turn, state, json.dumps({"id": turn, "state": state}),
                     json.dumps(checkpoint)))
        raw.executemany("INSERT INTO messages (turn, idx, data) VALUES (?, ?, ?)", [
            (turn, i, json.dumps({"role": "user", "content": f"{turn} {i}"}))
            for i in range(3)])
        raw.execute("INSERT INTO trail (turn, idx, data) VALUES (?, 0, ?)",
                    (turn, f"lines of {turn}"))
        for step_no in (1, 2):
            events.append({"seq": len(events) + 1, "ts": 100, "turn": turn,
                           "type": "step.started", "step": step_no})
    raw.executemany("INSERT INTO events (seq, turn, ts, type, data) VALUES (?, ?, ?, ?, ?)",
                    [(e["seq"], e.get("turn"), e["ts"], e["type"], json.dumps(e))
                     for e in events])
    raw.commit()
    raw.close()
    return events


async def test_a_sqlite_store_of_schema_6_keys_rows_by_turn_number_and_reads_the_same(
        tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    events = schema_6_with_two_turns(db)
    store = SQLiteStore(db)
    await store.open()
    # What the migration wrote is in the file, not left in a write-ahead log.
    assert (tmp_path / "state.db-wal").stat().st_size == 0
    async with anyio.create_task_group() as tg:
        await tg.start(store.run)
        try:
            for turn in ("t_0", "t_1"):
                got = await store.get_checkpoint(turn)
                assert contents(got) == [f"{turn} {i}" for i in range(3)]
                assert got is not None and got["trail"]["rows"] == [f"lines of {turn}"]
                assert await store.events(turn=turn) == [
                    e for e in events if e.get("turn") == turn]
            [(running, checkpoint)] = await store.unfinished_turns()
            assert running["id"] == "t_0" and contents(checkpoint) == [
                "t_0 0", "t_0 1", "t_0 2"]
            assert await store.events() == events
            # Rows written after the migration land beside the migrated ones, and the
            # turn's events are read across the two keys, in order.
            step = Event(seq=7, ts=150.0, type="step.started", turn="t_0",
                         data={"step": 3})
            await store.save_turn({"id": "t_0", "state": "running", "updated_at": 150.0},
                                  {"conversation": {"count": 4, "turn_start": 0},
                                   "trail": {"count": 1, "tail": []}},
                                  messages=rows(3, "t_0 3"), events=[step])
            assert contents(await store.get_checkpoint("t_0")) == [
                f"t_0 {i}" for i in range(4)]
            of_t_0 = [e for e in events if e.get("turn") == "t_0"] + [step.to_json()]
            assert await store.events(turn="t_0") == of_t_0
            # A finished turn is pruned with everything it holds, and the daemon's own
            # old event with it; the running turn keeps its rows.
            assert await store.prune(finished_before=1000.0, limit=10) == 1
            assert await store.events(turn="t_1") == []
            assert await store.events() == of_t_0
            assert contents(await store.get_checkpoint("t_0")) == [
                f"t_0 {i}" for i in range(4)]
        finally:
            await store.close()
    raw = sqlite3.connect(db)
    try:
        assert raw.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        # The events stored before keep no number (they are not rewritten); a new one has it.
        assert raw.execute("SELECT seq, turn_no FROM events").fetchall() == [
            (2, None), (3, None), (7, 1)]
        assert raw.execute("SELECT DISTINCT turn_no FROM messages").fetchall() == [(1,)]
        assert raw.execute("SELECT turn_no FROM trail").fetchall() == [(1,)]
    finally:
        raw.close()


def test_sqlite_finds_a_turns_events_and_pruned_rows_through_indexes(tmp_path: Path) -> None:
    """No statement that looks for a turn's rows reads a whole table or sorts what it
    read. (A value compared with the events' index that has a type affinity, `seq`
    where `+seq` is written, makes SQLite convert each of the index's values instead,
    and read every event there is.)"""
    db = tmp_path / "state.db"
    conn = sqlite3.connect(db, isolation_level=None)
    try:
        prepare(conn, db)
        for sql, params in [(EVENTS_OF_TURN, ("t_0", 0, "t_0", 0, 10)),
                            *prune_statements(["t_0", "t_1"])]:
            plan = [str(r[3]) for r in conn.execute("EXPLAIN QUERY PLAN " + sql, params)]
            # Each table is searched through an index (a range of rowids is every event
            # after a seq), and nothing is sorted.
            assert not [step for step in plan if "TEMP B-TREE" in step or (
                step.startswith(("SCAN", "SEARCH")) and not step.startswith("SCAN (subquery")
                and " USING INDEX " not in step and " USING COVERING INDEX " not in step)], (
                sql, plan)
    finally:
        conn.close()


async def test_a_step_s_sqlite_rows_carry_the_turn_s_number_and_delete_only_to_trim(
        tmp_path: Path) -> None:
    """A live turn's event and message rows get its number from the store (no lookup by
    id each); a write that does not trim adds its rows and deletes nothing, one that
    does still leaves no row past its end. A turn the store has not inserted (whatever
    number its record claims) or one that finished has its number looked up, and rows
    for a turn with no row are not kept."""
    db = tmp_path / "state.db"
    store = SQLiteStore(db)
    await store.open()
    statements: list[str] = []
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(store.run)
            a = record("t_a", state="running")
            await store.insert_turn(a, {})
            store.append_event(event(1, "t_a"))
            store.append_event(event(2, "t_ghost"))
            assert store.connection.writer is not None
            await store.save_turn(a, conv_cp(3), messages=rows(0, "m0", "m1", "m2"))
            store.connection.writer.set_trace_callback(statements.append)
            await store.save_turn(a, conv_cp(4), messages=MessageRows(
                3, rows(3, "m3").rows, trims=False))
            store.connection.writer.set_trace_callback(None)
            assert contents(await store.get_checkpoint("t_a")) == ["m0", "m1", "m2", "m3"]
            step = [s for s in statements if "messages" in s]
            assert step and not [s for s in step if s.startswith("DELETE")], step
            assert not [s for s in statements if "SELECT seq FROM turns" in s], statements
            await store.save_turn(a, conv_cp(2), messages=rows(1, "note"))  # trims
            assert contents(await store.get_checkpoint("t_a")) == ["m0", "note"]
            await store.save_turn(finished(a, "completed", "completed"),
                                  events=[event(3, "t_a")])
            store.append_event(event(4, "t_a"))  # after the finish: looked up
            await store.save_turn(record("t_ghost", state="running", seq=99), conv_cp(1),
                                  messages=rows(0, "lost"))
            tg.cancel_scope.cancel()
        raw = sqlite3.connect(db)
        try:
            assert raw.execute("SELECT seq, turn_no FROM events ORDER BY seq").fetchall() == [
                (1, 1), (2, None), (3, 1), (4, 1)]
            assert raw.execute("SELECT turn_no, idx FROM messages ORDER BY idx").fetchall() \
                == [(1, 0), (1, 1)]
        finally:
            raw.close()
    finally:
        await store.close()


async def test_a_turn_read_back_unfinished_writes_its_rows_by_its_number(
        tmp_path: Path) -> None:
    db = tmp_path / "state.db"
    statements: list[str] = []
    for reopened in (False, True):
        store = SQLiteStore(db)
        await store.open()
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(store.run)
                if not reopened:
                    await store.insert_turn(record("t_a", state="running"), {})
                else:
                    [(a, _)] = await store.unfinished_turns()
                    assert store.connection.writer is not None
                    store.connection.writer.set_trace_callback(statements.append)
                    await store.save_turn(a, conv_cp(1), messages=rows(0, "m0"),
                                          events=[event(1, "t_a")])
                tg.cancel_scope.cancel()
        finally:
            await store.close()
    assert [s for s in statements if "INSERT" in s] and not [
        s for s in statements if "SELECT seq FROM turns" in s], statements
