"""The total bound on one model call: the pure rule, then the runner carrying it out in
fake time against a provider whose call never ends (a stream that keeps trickling)."""

from __future__ import annotations

import anyio
import pytest
from tests.unit.test_runner import Harness, ListProvider, answer

from turnkeeper.policy.call_bound import CallBound, idle_failure
from turnkeeper.policy.classify import FailureClass, classify
from turnkeeper.policy.outcome import StopCode
from turnkeeper.providers.base import DeltaSink, ModelReply, ModelRequest
from turnkeeper.turn.runner import TurnRunner

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# -- the rule ------------------------------------------------------------------------------


def test_the_turns_time_left_bounds_a_call_when_it_is_the_lesser() -> None:
    bound = CallBound.of(turn_left_s=10.0, max_call_s=600.0)
    assert (bound.seconds, bound.by_turn) == (10.0, True)


def test_max_call_seconds_bounds_a_call_when_the_turn_has_more_time() -> None:
    bound = CallBound.of(turn_left_s=1000.0, max_call_s=600.0)
    assert (bound.seconds, bound.by_turn) == (600.0, False)


def test_equal_limits_are_the_turns_and_no_time_left_is_no_time() -> None:
    assert CallBound.of(turn_left_s=5.0, max_call_s=5.0).by_turn
    assert CallBound.of(turn_left_s=-3.0, max_call_s=5.0).seconds == 0.0


def test_a_cut_by_max_call_seconds_is_a_retryable_failure_naming_the_limit() -> None:
    failure = CallBound.of(turn_left_s=1000.0, max_call_s=30.0).failure()
    assert classify(failure) is FailureClass.RETRYABLE
    assert "max_call_seconds = 30 s" in failure.describe()


def test_a_cut_at_the_turns_time_that_the_budget_does_not_see_blames_no_provider() -> None:
    failure = CallBound.of(turn_left_s=3.0, max_call_s=600.0).failure()
    assert failure.local and classify(failure) is FailureClass.RETRYABLE


def test_a_stream_of_keepalives_only_is_a_retryable_failure_naming_idle_timeout() -> None:
    failure = idle_failure(60.0)
    assert classify(failure) is FailureClass.RETRYABLE
    assert "idle_timeout = 60 s" in failure.describe()


# -- the runner ----------------------------------------------------------------------------


class EndlessFirst(ListProvider):
    """The first `endless` calls never end (a stream that keeps sending a token now and
    then, as far as the runner can tell); the rest follow the script."""

    def __init__(self, *script: ModelReply, endless: int = 1) -> None:
        super().__init__(script)
        self.endless = endless

    async def complete(self, request: ModelRequest, on_delta: DeltaSink | None = None
                       ) -> ModelReply:
        if self.endless:
            self.endless -= 1
            self.requests.append(request)
            await anyio.sleep_forever()
        return await super().complete(request, on_delta)


def with_provider(h: Harness, provider: ListProvider) -> Harness:
    h.runtime.providers["main"] = provider
    h.provider = provider
    return h


async def test_a_call_that_never_ends_is_cut_when_the_active_time_runs_out() -> None:
    h = with_provider(Harness([], budget={"max_seconds": 10.0}), EndlessFirst())
    result = await h.run()
    assert result is not None
    stop = result.stopped_because
    assert stop.code is StopCode.BUDGET_SECONDS and stop.limit == 10.0
    assert h.record.usage.seconds == pytest.approx(10.0)
    # The provider did nothing wrong: its breaker saw no failure, no attempt failed.
    assert h.shared.breakers["provider:main"].consecutive_failures == 0
    assert h.of_type("model.attempt_failed") == []


async def test_a_call_that_never_ends_is_cut_at_the_deadline() -> None:
    h = Harness([])
    h.record.deadline = h.clock.time() + 7.0
    h = with_provider(rebuilt(h), EndlessFirst())
    result = await h.run()
    assert result is not None
    assert result.stopped_because.code is StopCode.DEADLINE
    assert h.clock.monotonic() == pytest.approx(7.0)


async def test_a_call_past_max_call_seconds_is_cut_and_retried_as_retryable() -> None:
    h = with_provider(Harness([], providers=[{"name": "main", "kind": "scripted",
                                              "max_call_seconds": 30.0}]),
                      EndlessFirst(answer("second try")))
    result = await h.run()
    assert result is not None and result.answer == "second try"
    failed = h.of_type("model.attempt_failed")
    assert len(failed) == 1 and failed[0]["class"] == "retryable"
    assert "max_call_seconds = 30 s" in failed[0]["error"]
    assert [r["attempt"] for r in h.of_type("model.request")] == [1, 2]
    assert h.clock.monotonic() >= 30.0


def rebuilt(h: Harness) -> Harness:
    """The same harness with its runner built again from the record (a deadline set)."""
    h.runner = TurnRunner(h.record, h.control, runtime=h.runtime, shared=h.shared,
                          store=h.store, bus=h.bus, clock=h.clock, checkpoint={}, history=[],
                          rand=lambda a, b: b)
    return h
