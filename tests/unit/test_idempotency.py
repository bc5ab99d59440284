"""The rule of idempotent submits: a key within its window answers its turn, the same key
with another submit is a conflict, a key past its window is free."""

from __future__ import annotations

from turnkeeper.policy.idempotency import (
    KeyConflict,
    NewTurn,
    SameTurn,
    StoredKey,
    decide,
    fingerprint,
    key_problem,
    new_key,
)

DAY = 86400.0


def stored(fp: str = "f", at: float = 1000.0) -> StoredKey:
    return StoredKey(key="k", turn="t_1", fingerprint=fp, created_at=at)


def test_no_stored_key_makes_a_new_turn() -> None:
    assert decide(None, fingerprint="f", now=1000.0, window_s=DAY) == NewTurn()


def test_the_same_key_and_submit_within_the_window_is_the_same_turn() -> None:
    assert decide(stored(), fingerprint="f", now=1000.0 + DAY - 1, window_s=DAY) \
        == SameTurn("t_1")


def test_the_same_key_with_another_submit_is_a_conflict_naming_the_key() -> None:
    decision = decide(stored(), fingerprint="g", now=1001.0, window_s=DAY)
    assert decision == KeyConflict(turn="t_1", key="k")
    assert isinstance(decision, KeyConflict) and "'k'" in decision.message


def test_a_key_past_its_window_is_free_again() -> None:
    assert decide(stored(fp="g"), fingerprint="f", now=1000.0 + DAY + 1,
                  window_s=DAY) == NewTurn()


def test_a_new_key_replaces_rows_written_before_the_window() -> None:
    key = new_key("k", fingerprint="f", now=5000.0, window_s=1000.0)
    assert (key.created_at, key.stale_before) == (5000.0, 4000.0)


def test_the_fingerprint_ignores_absent_and_null_fields_and_key_order() -> None:
    assert fingerprint({"message": "hi", "session": None, "budget": {}}) \
        == fingerprint({"message": "hi"})
    assert fingerprint({"a": 1, "b": {"x": 1, "y": 2}}) \
        == fingerprint({"b": {"y": 2, "x": 1}, "a": 1})
    assert fingerprint({"message": "hi"}) != fingerprint({"message": "hi!"})


def test_a_key_is_1_to_255_printable_ascii_characters() -> None:
    assert key_problem("order-42:retry") is None
    assert key_problem("") is not None
    assert key_problem("x" * 256) is not None
    assert key_problem("tab\there") is not None
    assert key_problem("é") is not None
