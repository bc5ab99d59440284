"""The turn runner driven in fake time: a scripted in-process provider, the builtin echo
tool, an in-memory store, no sockets and no real sleeps. Every wait (a recovery cycle,
a Retry-After, a clarify question) passes by advancing a `FakeClock`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import anyio
import pytest

from turnkeeper.clock import FakeClock
from turnkeeper.config import PolicyVersion, build_config
from turnkeeper.events import Event, EventBus
from turnkeeper.messages import ToolCall
from turnkeeper.policy.classify import CallFailure
from turnkeeper.policy.outcome import StopCode, TurnResult
from turnkeeper.providers.base import DeltaSink, ModelReply, ModelRequest, ProviderError, Usage
from turnkeeper.runtime import Runtime, Shared
from turnkeeper.store.memory import MemoryStore
from turnkeeper.turn.record import TurnRecord
from turnkeeper.turn.runner import TurnControl, TurnRunner

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# -- test doubles --------------------------------------------------------------------------

Script = ModelReply | CallFailure


def answer(text: str = "done") -> ModelReply:
    return ModelReply(text=text, tool_calls=(), usage=Usage(10, 5), finish_reason="stop")


def calls(name: str, arguments: str) -> ModelReply:
    return ModelReply(text=None, tool_calls=(ToolCall(id="c1", name=name,
                                                      arguments=arguments),),
                      usage=Usage(10, 5), finish_reason="tool_calls")


SERVER_DOWN = CallFailure(status=503, message="unavailable")
OVERFLOW = CallFailure(status=400, message="context too long", context_overflow=True)


class ListProvider:
    """Answers each call with the next entry of its script: a reply, or a failure raised
    as the provider error an edge would raise."""

    def __init__(self, script: Sequence[Script]) -> None:
        self.script = list(script)
        self.requests: list[ModelRequest] = []
        self.on_request: Callable[[], None] | None = None

    @property
    def name(self) -> str:
        return "main"

    async def complete(self, request: ModelRequest, on_delta: DeltaSink | None = None
                       ) -> ModelReply:
        self.requests.append(request)
        if self.on_request is not None:
            self.on_request()
        step = self.script.pop(0)
        if isinstance(step, CallFailure):
            raise ProviderError(step)
        return step

    async def aclose(self) -> None:
        return None


class Harness:
    def __init__(self, script: Sequence[Script], *,
                 history: Sequence[dict[str, Any]] = (), **config: Any) -> None:
        data: dict[str, Any] = {"providers": [{"name": "main", "kind": "scripted"}]}
        data.update(config)
        policy = PolicyVersion(version=1, config=build_config(data), source_path=None,
                        content_hash="")
        self.runtime = Runtime.build(policy)
        self.provider = ListProvider(script)
        self.runtime.providers["main"] = self.provider
        self.shared = Shared()
        self.shared.apply(policy.config)
        self.clock = FakeClock()
        self.events: list[Event] = []
        self.bus = EventBus(clock=self.clock, persist=self.events.append)
        self.store = MemoryStore()
        now = self.clock.time()
        self.record = TurnRecord(id="t1", session="s1", message="do it", created_at=now,
                                 updated_at=now, policy_version=1)
        self.control = TurnControl()
        self.runner = TurnRunner(self.record, self.control, runtime=self.runtime,
                                 shared=self.shared, store=self.store, bus=self.bus,
                                 clock=self.clock, checkpoint={}, history=list(history),
                                 rand=lambda a, b: b)

    def of_type(self, type: str) -> list[dict[str, Any]]:
        return [e.data for e in self.events if e.type == type]

    async def run(self, on_blocked: Callable[[Harness], None] | None = None
                  ) -> TurnResult | None:
        """Run the turn, letting fake time jump to each next timer whenever every task
        is blocked; `on_blocked` looks in (once per jump) before time moves on."""
        results: list[TurnResult | None] = []

        async def go() -> None:
            result = await self.runner.run()
            held = self.runner.ctx.result_checkpoint
            if held is not None:  # an answer's checkpoint, saved with the result
                await self.store.save_turn(self.record.to_json(), held[0], messages=held[1],
                                           trail=held[2])
            results.append(result)

        await self.store.open()
        await self.store.insert_turn(self.record.to_json(), {})

        async with anyio.create_task_group() as tg:
            tg.start_soon(go)
            while not results:
                await anyio.wait_all_tasks_blocked()
                if results:
                    break
                if on_blocked is not None:
                    on_blocked(self)
                    await anyio.wait_all_tasks_blocked()
                    if results:
                        break
                if not await self.clock.settle():
                    await anyio.wait_all_tasks_blocked()
                    if not results:
                        raise AssertionError("the turn is blocked with no timer pending")
        return results[0]


# -- provider waits --------------------------------------------------------------------------


async def test_a_15_s_recovery_wait_passes_in_fake_time_and_counts_a_recovery_cycle() -> None:
    h = Harness([SERVER_DOWN, answer()],
                agent={"api_max_retries": 0, "recovery_schedule": [15.0],
                       "recovery_jitter": 0.0})
    cycles: list[int] = []
    h.provider.on_request = lambda: cycles.append(h.record.counters.recovery_cycles)
    result = await h.run()
    assert result is not None
    assert result.stopped_because.code is StopCode.COMPLETED
    # The attempt after the wait is in cycle 1 (a success then starts the count over).
    assert cycles == [0, 1]
    assert h.clock.monotonic() == pytest.approx(15.0)
    assert h.of_type("turn.recovering")[0]["wait"] == 15.0
    # A recovery wait is parked time, not active time.
    assert h.record.usage.seconds == pytest.approx(0.0)


async def test_retry_after_is_honoured_in_fake_time() -> None:
    throttled = CallFailure(status=429, message="slow down", retry_after_s=7.0)
    h = Harness([throttled, answer()], retry={"base_delay": 0.5, "max_delay": 1.0})
    result = await h.run()
    assert result is not None and result.stopped_because.code is StopCode.COMPLETED
    scheduled = h.of_type("model.retry_scheduled")
    assert [s["delay"] for s in scheduled] == [7.0]
    assert scheduled[0]["retry_after"] == 7.0
    assert h.clock.monotonic() == pytest.approx(7.0)
    assert len(h.provider.requests) == 2


async def test_a_steer_cuts_a_recovery_wait_short_without_charging_a_cycle() -> None:
    h = Harness([SERVER_DOWN, answer("read it")],
                agent={"api_max_retries": 0, "recovery_schedule": [600.0],
                       "recovery_jitter": 0.0})

    def steer(h: Harness) -> None:
        if h.record.state == "recovering" and not h.record.inbox:
            h.record.inbox.append({"kind": "steer", "text": "try again now",
                                   "redirect": False, "at": h.clock.time()})
            h.control.message_arrived(redirect=False)

    result = await h.run(on_blocked=steer)
    assert result is not None and result.answer == "read it"
    assert h.clock.monotonic() == pytest.approx(0.0)
    assert h.record.counters.recovery_cycles == 0
    assert h.provider.requests[-1].messages[-1].content == "try again now"


async def test_a_model_failure_across_a_stall_feeds_no_breaker_and_no_retry_budget() -> None:
    # A budget that admits no retry: only an excused failure's retry gets through.
    h = Harness([SERVER_DOWN, answer()],
                retry_budget={"ratio": 0.0, "min_concurrency": 0},
                circuit_breaker={"failure_threshold": 1})
    h.shared.stalls.tick(h.clock.monotonic(), tick_s=0.1)  # the watch last woke now
    paused: list[bool] = []

    def pause_once() -> None:
        if not paused:  # the process stops for 5 s while the first request is out
            paused.append(True)
            h.clock.advance(5.0)

    h.provider.on_request = pause_once
    result = await h.run()
    assert result is not None and result.stopped_because.code is StopCode.COMPLETED
    breaker = h.shared.breakers["provider:main"]
    assert breaker.consecutive_failures == 0 and breaker.open_for(h.clock.monotonic()) is None
    assert len(h.provider.requests) == 2 and len(h.of_type("model.retry_scheduled")) == 1
    assert h.shared.retry_budgets["main"].retries_in_flight == 0


# -- restarts --------------------------------------------------------------------------------


async def test_restart_beyond_max_restarts_stops_the_turn_with_restarts_exhausted() -> None:
    # Eight earlier turns: room for several compactions, so only the limit can stop it.
    earlier = [{"message": f"q{i}", "result": {"answer": f"a{i}"}} for i in range(8)]
    h = Harness([OVERFLOW] * 5, history=earlier, agent={"max_restarts": 1})
    result = await h.run()
    assert result is not None
    stop = result.stopped_because
    assert stop.code is StopCode.RESTARTS_EXHAUSTED
    assert (stop.value, stop.limit) == (2, 1)
    assert h.record.counters.restarts == 2
    assert len(h.provider.requests) == 2


async def test_an_overflow_with_nothing_left_to_compact_stops_at_once() -> None:
    h = Harness([OVERFLOW], agent={"max_restarts": 3})
    result = await h.run()
    assert result is not None
    assert result.stopped_because.code is StopCode.CONTEXT_EXHAUSTED
    assert result.stopped_because.counter == "context_tokens"
    assert "nothing more can be compacted" in result.stopped_because.message


# -- builtins --------------------------------------------------------------------------------


async def test_a_clarify_without_answer_times_out_in_fake_time() -> None:
    h = Harness([calls("clarify", '{"question": "which file?"}')], clarify={"timeout": 90})
    result = await h.run()
    assert result is not None
    stop = result.stopped_because
    assert stop.code is StopCode.CLARIFY_TIMEOUT
    assert stop.limit == 90
    assert h.clock.monotonic() == pytest.approx(90.0)
    assert h.of_type("turn.waiting")[0]["question"] == "which file?"
    assert h.record.question is None


async def test_a_clarify_answer_resumes_the_turn() -> None:
    h = Harness([calls("clarify", '{"question": "which file?"}'), answer("ok")],
                clarify={"timeout": 90})

    def reply(h: Harness) -> None:
        if h.record.state == "waiting" and not h.record.inbox:
            h.record.inbox.append({"kind": "answer", "text": "a.txt", "redirect": False,
                                   "at": h.clock.time()})
            h.control.message_arrived(redirect=False)

    result = await h.run(on_blocked=reply)
    assert result is not None and result.answer == "ok"
    assert h.clock.monotonic() == pytest.approx(0.0)


async def test_report_blocked_ends_the_turn_blocked_with_what_was_tried() -> None:
    h = Harness([calls("report_blocked",
                       '{"reason": "no access", "tried": ["login"], "found": ["403"]}')])
    result = await h.run()
    assert result is not None
    assert result.stopped_because.code is StopCode.BLOCKED
    assert result.extra["blocked"] == {"reason": "no access", "tried": ["login"],
                                       "found": ["403"]}
    assert "no access" in result.open_issues


@pytest.mark.parametrize("arguments", [
    '{"reason": "cannot reach", "tried": ["',          # cut where the output cap fell
    '{"reason": "cannot reach", "tried": "ping"}',      # a string where a list belongs
    '{"tried": ["ping"]}',                              # no reason
    '["cannot reach"]',                                 # not an object
])
async def test_a_malformed_report_blocked_is_told_back_and_the_corrected_call_ends_blocked(
        arguments: str) -> None:
    h = Harness([calls("report_blocked", arguments),
                 calls("report_blocked", '{"reason": "cannot reach", "tried": ["ping"], '
                                         '"found": ["no route"]}')])
    result = await h.run()
    assert result is not None and result.stopped_because.code is StopCode.BLOCKED
    assert result.extra["blocked"] == {"reason": "cannot reach", "tried": ["ping"],
                                       "found": ["no route"]}
    [told] = [m.content for m in h.provider.requests[1].messages if m.role == "tool"]
    assert told is not None and told.startswith("ERROR (deterministic): ")
    assert "report_blocked" in told
    [failed] = h.of_type("tool.result")
    assert (failed["tool"], failed["ok"], failed["class"]) == (
        "report_blocked", False, "deterministic")


async def test_a_malformed_built_in_call_repeated_stops_on_the_failure_loop() -> None:
    h = Harness([calls("clarify", '{"question": 42}')] * 3)
    result = await h.run()
    assert result is not None
    stop = result.stopped_because
    assert (stop.code, stop.value, stop.limit) == (StopCode.FAILURE_DETERMINISTIC, 2, 2)
    assert h.of_type("turn.waiting") == []


async def test_an_update_plan_the_plan_cannot_take_is_a_deterministic_failure() -> None:
    h = Harness([calls("update_plan", '{"items": [{"text": " ", "done": true}]}'),
                 answer()])
    result = await h.run()
    assert result is not None and result.stopped_because.code is StopCode.COMPLETED
    [failed] = h.of_type("tool.result")
    assert failed["class"] == "deterministic" and "plan unchanged" in failed["error"]


# -- tools -----------------------------------------------------------------------------------


async def test_the_echo_tool_runs_and_its_call_is_journalled() -> None:
    h = Harness([calls("echo", '{"text": "hi"}'), answer()])
    result = await h.run()
    assert result is not None and result.stopped_because.code is StopCode.COMPLETED
    assert [r["ok"] for r in h.of_type("tool.result")] == [True]
    (call,) = h.of_type("tool.call")
    entry = await h.store.journal_get(call["key"])
    assert entry is not None
    assert entry["tool"] == "echo" and entry["outcome"] is not None
    assert h.record.counters.steps == 2


@pytest.mark.parametrize("ids", [("a", "b", "c"), ("a", "a", "b")])
async def test_a_steps_calls_are_keyed_by_their_place_in_the_reply(ids: tuple[str, ...]
                                                                   ) -> None:
    # Ids the reply repeats too: a call's key is its index.
    reply = ModelReply(text=None, tool_calls=tuple(
        ToolCall(id=i, name="echo", arguments=f'{{"text": "{n}"}}')
        for n, i in enumerate(ids)), usage=Usage(10, 5), finish_reason="tool_calls")
    h = Harness([reply, answer()])
    result = await h.run()
    assert result is not None and result.stopped_because.code is StopCode.COMPLETED
    assert [c["key"] for c in h.of_type("tool.call")] == ["t1.1.0", "t1.1.1", "t1.1.2"]
    assert sorted(h.store._journal) == ["t1.1.0", "t1.1.1", "t1.1.2"]


# -- budgets as ceilings, the wall clock ---------------------------------------------------


async def test_a_recovery_wait_longer_than_the_wall_clock_ends_it_with_wall_seconds() -> None:
    h = Harness([SERVER_DOWN, answer()],
                agent={"api_max_retries": 0, "recovery_schedule": [60.0],
                       "recovery_jitter": 0.0},
                budget={"max_wall_seconds": 20.0})
    result = await h.run()
    assert result is not None
    stop = result.stopped_because
    assert (stop.code, stop.counter, stop.limit) == (StopCode.BUDGET_WALL_SECONDS,
                                                     "wall_seconds", 20.0)
    assert stop.value == pytest.approx(20.0)
    # Cut at the limit, not at the end of the 60 s wait; asked once.
    assert h.clock.monotonic() == pytest.approx(20.0)
    assert len(h.provider.requests) == 1


async def test_a_retry_after_beyond_the_wall_clock_stops_with_it_not_with_the_providers(
        ) -> None:
    throttled = CallFailure(status=429, message="slow down", retry_after_s=100.0)
    h = Harness([throttled, answer()], agent={"auto_recovery_cycles": 0},
                budget={"max_wall_seconds": 10.0})
    result = await h.run()
    assert result is not None
    assert result.stopped_because.code is StopCode.BUDGET_WALL_SECONDS
    assert result.stopped_because.last_error == {"main": "HTTP 429: slow down"}
    assert h.clock.monotonic() == pytest.approx(10.0)


async def test_a_call_that_cannot_fit_the_tokens_left_is_not_made_and_one_that_fits_is_cut(
        ) -> None:
    def step(usage: Usage) -> ModelReply:
        return ModelReply(text=None, tool_calls=(ToolCall(id="c1", name="echo",
                                                          arguments='{"text":"x"}'),),
                          usage=usage, finish_reason="tool_calls")

    h = Harness([step(Usage(1000, 4000)), step(Usage(500, 1000)), answer()],
                budget={"max_tokens": 7000})
    result = await h.run()
    assert result is not None
    stop = result.stopped_because
    # 5,000 spent, then 1,500: the 500 left cannot hold the third request's input and a
    # 64-token answer, so it is not made, and the stop's value is what was spent.
    assert (stop.code, stop.value, stop.limit) == (StopCode.BUDGET_TOKENS, 6500, 7000)
    assert "does not fit in the 500 left" in stop.message
    caps = [r.max_output_tokens for r in h.provider.requests]
    # The provider's own cap, then the 2,000 left less the second request's input.
    assert caps[0] == 4096 and 1 <= caps[1] < 2000, caps
    assert len(h.provider.requests) == 2
    assert h.record.counters.steps == 2
