"""Cache reads and writes are input priced apart: a read costs the cache-read price, a
write the cache-write price, the rest of the input the input price."""

from __future__ import annotations

import pytest

from turnkeeper.policy.budget import cost_usd
from turnkeeper.providers.base import Usage


def test_cache_reads_and_writes_are_priced_at_their_own_prices() -> None:
    # Anthropic Sonnet prices: 3 in, 15 out, 0.30 cache read, 3.75 cache write.
    cost = cost_usd(1_000_000, 100_000, price_input_per_mtok=3.0, price_output_per_mtok=15.0,
                    cache_read_tokens=800_000, cache_write_tokens=150_000,
                    price_cache_read_per_mtok=0.3, price_cache_write_per_mtok=3.75)
    assert cost == pytest.approx((50_000 * 3.0 + 800_000 * 0.3 + 150_000 * 3.75
                                  + 100_000 * 15.0) / 1e6)


def test_cache_prices_left_unset_are_the_input_price() -> None:
    plain = cost_usd(10_000, 500, price_input_per_mtok=2.0, price_output_per_mtok=8.0)
    cached = cost_usd(10_000, 500, price_input_per_mtok=2.0, price_output_per_mtok=8.0,
                      cache_read_tokens=9_000, cache_write_tokens=500)
    assert cached == pytest.approx(plain)


def test_cache_counts_larger_than_the_input_are_clamped_to_it() -> None:
    cost = cost_usd(100, 0, price_input_per_mtok=1.0, price_output_per_mtok=0.0,
                    cache_read_tokens=150, price_cache_read_per_mtok=0.5)
    assert cost == pytest.approx(100 * 0.5 / 1e6)


def test_usage_cache_counts_default_to_zero_and_are_part_of_the_input() -> None:
    assert Usage(10, 5) == Usage(10, 5, cache_read_tokens=0, cache_write_tokens=0)
    assert Usage(10, 5, cache_read_tokens=8).total_tokens == 15
