"""A node whose lease on a turn has lapsed (its database out for longer than the lease)
sends nothing of the turn until a renewal confirms the lease: no model request and no
tool call, idempotent or not, since another node may run the turn by then and would
make the same call again. The runner in fake time; the lease a gate the test opens."""

from __future__ import annotations

import pytest
from tests.unit.test_runner import Harness, answer, calls

from turnkeeper.policy.outcome import StopCode
from turnkeeper.store.fleet import StaleLease

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_each_model_request_and_tool_call_waits_for_the_lease() -> None:
    h = Harness([calls("echo", '{"text": "hi"}'), answer()])
    waits: list[tuple[float, tuple[int, int], tuple[int, int]]] = []

    def sent() -> tuple[int, int]:
        return len(h.provider.requests), len(h.of_type("tool.result"))

    async def confirm_lease() -> None:  # the next renewal confirms it, 5 s on
        before = sent()
        await h.clock.sleep(5.0)
        waits.append((h.clock.monotonic(), before, sent()))

    h.control.confirm_lease = confirm_lease
    result = await h.run()
    assert result is not None and result.stopped_because.code is StopCode.COMPLETED
    # The first model request, the echo call, then the second model request: each waited
    # for the renewal, and nothing went out while it did.
    assert [(before, after) for _, before, after in waits] == [
        ((0, 0), (0, 0)), ((1, 0), (1, 0)), ((1, 1), (1, 1))]
    assert len(h.provider.requests) == 2


async def test_a_turn_another_node_took_makes_no_call() -> None:
    h = Harness([answer()])

    async def confirm_lease() -> None:
        raise StaleLease("turn t1: node n0 lost its claim; the call is not sent")

    h.control.confirm_lease = confirm_lease
    with pytest.raises(BaseExceptionGroup) as caught:  # out of the harness's task group
        await h.run()
    assert caught.group_contains(StaleLease)
    assert h.provider.requests == []
