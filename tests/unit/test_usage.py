"""What a model call costs: the estimate before it, the checked usage after."""

from __future__ import annotations

import math

import pytest

from turnkeeper.policy.usage import (
    MAX_TOKENS_PER_CALL,
    PER_ITEM_TOKENS,
    REQUEST_TOKENS,
    Metered,
    Prices,
    estimate_tokens,
    item_tokens,
    metered,
    text_tokens,
    wire_count,
)

PRICES = Prices(3.0, 15.0)


@pytest.mark.parametrize("text", ["", "a", "abcd", "abcde", "x" * 4001,
                                  '{"query":"why","n":3}'])
def test_an_estimate_is_never_under_characters_over_four(text: str) -> None:
    assert text_tokens(text) >= len(text) / 4
    assert text_tokens(text) == math.ceil(len(text) / 4)


def test_text_outside_ascii_counts_more_than_a_quarter_token_a_character() -> None:
    assert text_tokens("é") == 1  # 2 bytes: (6 - 2) / 4
    assert text_tokens("日本語") == 6  # 3 bytes each: 1.75 a character, rounded up
    assert text_tokens("🙂") == 3  # 4 bytes: 2.5
    assert text_tokens("café au lait") >= len("café au lait") / 4


def test_a_request_counts_every_text_and_the_framing_of_each_item() -> None:
    system, user, call = "be brief", "x" * 400, ("search", '{"q":"abc"}')
    estimate = estimate_tokens([[system], [user], call])
    assert estimate == (REQUEST_TOKENS + 3 * PER_ITEM_TOKENS + text_tokens(system) + 100
                        + text_tokens("search") + text_tokens('{"q":"abc"}'))
    assert estimate >= sum(len(t) for t in (system, user, *call)) / 4
    assert item_tokens([]) == PER_ITEM_TOKENS


def test_the_worst_input_price_is_the_dearest_of_input_and_cache_rates() -> None:
    assert Prices(3.0, 15.0).worst_input_per_mtok == 3.0
    # A cache read is cheaper: the plain input price is the worst case.
    assert Prices(3.0, 15.0, cache_read_per_mtok=0.3).worst_input_per_mtok == 3.0
    # An Anthropic cache write is dearer: that is.
    assert Prices(3.0, 15.0, cache_write_per_mtok=3.75).worst_input_per_mtok == 3.75
    assert Prices(3.0, 15.0, cache_write_per_mtok=3.75).worst_cost_usd(1_000_000, 100_000) \
        == pytest.approx(3.75 + 1.5)


def test_a_real_usage_is_counted_and_priced() -> None:
    assert metered(1000, 500, prices=PRICES) == Metered(1000, 500, 0, 0, 0.0105)
    cached = metered(10_050, 200, 9000, 1000,
                     prices=Prices(3.0, 15.0, cache_read_per_mtok=0.3,
                                   cache_write_per_mtok=3.75))
    assert isinstance(cached, Metered) and cached.total_tokens == 10_250
    # An integral float (some servers write 12.0) is a whole number.
    assert metered(12.0, 3, prices=PRICES) == Metered(12, 3, 0, 0, metered(
        12, 3, prices=PRICES).cost_usd)  # type: ignore[union-attr]


@pytest.mark.parametrize(("usage", "says"), [
    ((-1_000_005, 20), "usage input_tokens -1000005 is negative"),
    ((100, -3), "usage output_tokens -3 is negative"),
    ((100.5, 3), "usage input_tokens 100.5 is not a whole number"),
    ((1e308, 3), "usage input_tokens 1e+308 is over 10,000,000 tokens for one call"),
    ((math.inf, 3), "usage input_tokens inf is not a whole number"),
    ((math.nan, 3), "usage input_tokens is not a number"),
    ((MAX_TOKENS_PER_CALL, 1), "usage of 10,000,001 tokens is over 10,000,000 tokens"),
    ((100, 3, 80, 30), "usage cache_read_tokens 80 + cache_write_tokens 30 is more than "
                       "input_tokens 100"),
    ((100, 3, -5, 0), "usage cache_read_tokens -5 is negative"),
])
def test_an_impossible_usage_is_refused_whole(usage: tuple[float, ...], says: str) -> None:
    refused = metered(*usage, prices=PRICES)
    assert isinstance(refused, str) and refused.startswith(says)


def test_a_price_that_makes_no_finite_cost_is_refused() -> None:
    refused = metered(10, 10, prices=Prices(math.inf, 1.0))
    assert isinstance(refused, str) and refused.startswith("usage priced at ")


def test_the_wire_figure_goes_on_as_given_and_anything_else_is_not_a_number() -> None:
    assert wire_count(None) == 0
    assert wire_count(12) == 12 and isinstance(wire_count(12), int)
    assert wire_count(-4.5) == -4.5
    for junk in ("12", True, {"n": 1}, [1]):
        assert math.isnan(wire_count(junk))


def test_a_lone_surrogate_is_sized_as_the_three_bytes_it_is_written_with() -> None:
    # JSON may carry one ("\ud800"); sizing it must not fail the turn's pre-flight.
    assert text_tokens("\ud800") == text_tokens("\u4e00") == 2
