from __future__ import annotations

from typing import Any

from turnkeeper.policy.history import TURN_OVERHEAD_TOKENS, bound_history, turn_tokens


def past(n: int, *, chars: int = 400) -> dict[str, Any]:
    return {"id": f"t{n}", "message": "m" * chars, "result": {"answer": "a" * chars}}


def test_a_past_turn_counts_its_message_and_answer_at_four_characters_a_token() -> None:
    assert turn_tokens(past(1, chars=400)) == TURN_OVERHEAD_TOKENS + 200


def test_a_turn_that_ended_without_an_answer_counts_its_message() -> None:
    assert turn_tokens({"message": "x" * 40, "result": {"answer": None}}) == \
        TURN_OVERHEAD_TOKENS + 10


def test_the_newest_turns_that_fit_are_kept_oldest_first() -> None:
    turns = [past(i) for i in range(10)]
    size = turn_tokens(turns[0])
    kept = bound_history(turns, max_tokens=3 * size + size // 2)
    assert [t["id"] for t in kept] == ["t7", "t8", "t9"]


def test_a_history_under_the_bound_is_kept_whole() -> None:
    turns = [past(i) for i in range(3)]
    assert bound_history(turns, max_tokens=10_000) == turns


def test_a_bound_of_zero_keeps_no_history() -> None:
    assert bound_history([past(1)], max_tokens=0) == []


def test_a_single_turn_larger_than_the_bound_is_dropped_not_cut() -> None:
    turns = [past(1), past(2, chars=100_000)]
    assert bound_history(turns, max_tokens=1_000) == []


def test_a_two_thousand_turn_session_stays_within_the_bound() -> None:
    turns = [past(i) for i in range(2_000)]
    kept = bound_history(turns, max_tokens=32_000)
    assert sum(turn_tokens(t) for t in kept) <= 32_000
    assert kept[-1]["id"] == "t1999"
