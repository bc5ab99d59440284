"""A turn is charged prompt-cache reads and writes at the provider's cache prices."""

from __future__ import annotations

import pytest
from tests.unit.test_runner import Harness

from turnkeeper.policy.outcome import StopCode
from turnkeeper.providers.base import ModelReply, Usage

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_a_turn_charges_cache_reads_and_writes_at_their_own_prices() -> None:
    reply = ModelReply(text="done", tool_calls=(), finish_reason="stop",
                       usage=Usage(input_tokens=1_000_000, output_tokens=0,
                                   cache_read_tokens=600_000, cache_write_tokens=100_000))
    h = Harness([reply], providers=[{
        "name": "main", "kind": "scripted", "price_input_per_mtok": 3.0,
        "price_output_per_mtok": 15.0, "price_cache_read_per_mtok": 0.3,
        "price_cache_write_per_mtok": 3.75}])
    result = await h.run()
    assert result is not None and result.stopped_because.code is StopCode.COMPLETED
    # 300,000 plain input at $3, 600,000 cache reads at $0.30, 100,000 writes at $3.75
    assert h.record.usage.cost_usd == pytest.approx(0.9 + 0.18 + 0.375)
