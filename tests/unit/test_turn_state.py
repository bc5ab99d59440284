"""The table of a turn's moves: `TurnState.to` and `moved`, its lookup as strings."""

from __future__ import annotations

import itertools

import pytest

from turnkeeper.policy.turn_state import IllegalTransition, TurnState, moved


def test_moved_is_the_table_for_every_pair_as_members_or_strings() -> None:
    allowed = 0
    for old, new in itertools.product(TurnState, repeat=2):
        try:
            expected: str | None = old.to(new).value
        except IllegalTransition:
            expected = None
        for a, b in ((old, new), (old.value, new.value), (old, new.value), (old.value, new)):
            if expected is None:
                with pytest.raises(IllegalTransition):
                    moved(a, b)
            else:
                got = moved(a, b)
                assert got == expected and type(got) is str
        allowed += expected is not None
    # Staying put is always allowed; a few moves, for the table's sake.
    assert allowed == 10 + 39 and moved("running", "running") == "running"
    assert moved("suspended", TurnState.QUEUED) == "queued"
    with pytest.raises(IllegalTransition, match="from completed to running"):
        moved("completed", "running")


def test_a_name_that_is_not_a_state_is_refused() -> None:
    with pytest.raises(ValueError):
        moved("running", "sleeping")
    with pytest.raises(ValueError):
        moved("sleeping", "running")
