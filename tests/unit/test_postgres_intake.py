"""The intake's one statement for a batch of submits, built without a server (the
writes themselves run in tests/unit/test_store_conformance.py and the fleet tests)."""

from __future__ import annotations

from turnkeeper.store import postgres_intake as pi
from turnkeeper.store.fleet import CHANNEL_TURNS


def insert(turn: str, events: int = 1) -> pi.TurnInsert:
    row = (turn, "s", "queued", 1.0, 1.0, f'{{"id":"{turn}"}}', '"hi"', "{}", None)
    return pi.TurnInsert({"id": turn}, row,
                         [(n, turn, 1.0, "turn.queued", "{}") for n in range(events)])


def test_a_batch_is_one_statement_of_arrays_with_one_notify() -> None:
    args = pi.turns_insert([insert("t_a"), insert("t_b", events=2)])
    assert len(args) == 15 and args[-1] == CHANNEL_TURNS
    assert args[0] == ["t_a", "t_b"] and args[8] == [None, None]
    assert args[9] == [0, 0, 1] and args[10] == ["t_a", "t_b", "t_b"]
    sql = pi.TURNS_INSERT
    assert sql.count("unnest(") == 2 and sql.count("pg_notify(") == 1
    assert "ON CONFLICT (id) DO NOTHING" in sql and "ON CONFLICT (seq) DO NOTHING" in sql


def test_a_batch_without_events_sends_empty_event_arrays() -> None:
    args = pi.turns_insert([insert("t_a", events=0)])
    assert [list(a) for a in args[9:14]] == [[], [], [], [], []]
