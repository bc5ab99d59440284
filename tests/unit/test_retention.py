from __future__ import annotations

import pytest

from turnkeeper.durations import parse_duration
from turnkeeper.policy.retention import prune_before, prune_every_s


@pytest.mark.parametrize(("text", "seconds"), [
    ("90", 90.0), ("90s", 90.0), ("30m", 1800.0), ("24h", 86400.0), ("7d", 604800.0),
    ("2w", 1209600.0), (" 1.5H ", 5400.0), ("0", 0.0)])
def test_a_duration_is_a_number_and_a_unit(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "d", "7x", "-1d", "nan", "inf", "1e999"])
def test_a_duration_that_is_not_one_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_duration(text)


def test_the_prune_runs_at_a_tenth_of_the_keep_between_a_second_and_ten_minutes() -> None:
    assert prune_every_s(5.0) == 1.0
    assert prune_every_s(300.0) == 30.0
    assert prune_every_s(30 * 86400.0) == 600.0


def test_a_keep_of_zero_keeps_everything() -> None:
    assert prune_before(1000.0, 0.0) is None
    assert prune_before(1000.0, 100.0) == 900.0
