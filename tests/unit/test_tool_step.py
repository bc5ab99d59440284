"""The tool step's side-effect rules in fake time: an unknown outcome is said and never
repeated, the ledger is checkpointed, a plain cancel waits for an effect in flight and
`cancel --now` records it unknown. The tool is a stand-in for an http tool whose answer
the test decides (no sockets)."""

from __future__ import annotations

from typing import Any

import pytest
from tests.unit.test_runner import Harness, answer, calls

from turnkeeper.config import PolicyVersion, build_config
from turnkeeper.policy.classify import CallFailure
from turnkeeper.policy.effects import EffectLedger, effect_key
from turnkeeper.policy.outcome import StopCode, TurnResult
from turnkeeper.runtime import Runtime
from turnkeeper.tools.outcome import ToolOutcome
from turnkeeper.turn.record import TurnRecord
from turnkeeper.turn.runner import TurnControl, TurnRunner
from turnkeeper.turn.trail import read as read_trail

pytestmark = pytest.mark.anyio

ARGS = '{"title": "printer on fire"}'
KEY = effect_key("t1", "ticket", {"title": "printer on fire"}, 1)
LATE = ToolOutcome(content="", unknown=True,
                   failure=CallFailure(exception=("TimeoutError",), message="no answer"))


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def journal_kind(h: Harness) -> str:
    entry = await h.store.journal_get(KEY)
    assert entry is not None and entry["outcome"] is not None
    return str(entry["outcome"]["kind"])


def harness(script: list[Any], outcome: ToolOutcome | None = None, *,
            wait_s: float = 0.0, idempotent: bool = False) -> tuple[Harness, list[str]]:
    """A turn whose tool `ticket` is not idempotent (unless said); each call is recorded
    by its key, takes `wait_s` of fake time and ends with `outcome` (ok by default)."""
    h = Harness(script, tools=[{"name": "ticket", "kind": "echo",
                                "idempotent": idempotent}])
    sent: list[str] = []

    async def call(name: str, args: dict[str, Any], *, idempotency_key: str,
                   timeout_s: float, traceparent: str | None = None) -> ToolOutcome:
        sent.append(idempotency_key)
        if wait_s:
            await h.clock.sleep(wait_s)
        return outcome or ToolOutcome(content='{"ticket": 1}')

    h.runtime.toolbox.call = call  # type: ignore[method-assign]
    return h, sent


async def test_an_unknown_outcome_is_an_open_issue_and_a_repeat_is_refused() -> None:
    h, sent = harness([calls("ticket", ARGS)] * 3 + [answer()], LATE)
    result = await h.run()
    assert result is not None
    assert sent == [KEY]
    assert result.open_issues[0] == f"outcome unknown: ticket {ARGS} (Idempotency-Key {KEY})"
    results = h.of_type("tool.result")
    assert results[0]["ok"] is None and results[0]["outcome"] == "unknown"
    assert all(r["class"] == "deterministic" for r in results[1:])
    assert [e["key"] for e in h.of_type("tool.outcome_unknown")] == [KEY]
    assert (await journal_kind(h)) == "unknown"
    assert result.stopped_because.code is not StopCode.FAILURE_RETRYABLE


async def test_the_effect_ledger_is_saved_in_the_checkpoint() -> None:
    """Its outcome is a line of the turn's trail: the ledger restored from the stored
    checkpoint holds the action open, as the live one did."""
    h, _ = harness([calls("ticket", ARGS), answer()], LATE)
    await h.run()
    checkpoint = await h.store.get_checkpoint("t1")
    assert checkpoint is not None
    (_, _, effect_lines), _, _ = read_trail(checkpoint["trail"])
    ledger = EffectLedger.restore(checkpoint["effects"], effect_lines)
    assert ledger.unknown_count() == 1 and len(effect_lines) == 1


async def test_a_plain_cancel_waits_for_the_effect_in_flight() -> None:
    h, sent = harness([calls("ticket", ARGS), answer()], wait_s=5.0)

    def cancel(h: Harness) -> None:
        if h.control.effect_in_flight and not h.control.cancel_requested:
            h.control.cancel()

    result = await h.run(on_blocked=cancel)
    assert result is not None and result.stopped_because.code is StopCode.CANCELLED
    assert sent == [KEY]
    assert (await journal_kind(h)) == "ok"
    assert not [i for i in result.open_issues if i.startswith("outcome unknown")]
    assert h.clock.monotonic() == pytest.approx(5.0)


async def test_cancel_now_cuts_the_effect_and_records_it_unknown() -> None:
    h, sent = harness([calls("ticket", ARGS), answer()], wait_s=5.0)

    def cancel(h: Harness) -> None:
        if h.control.effect_in_flight and not h.control.cancel_requested:
            h.control.cancel(now=True)

    result = await h.run(on_blocked=cancel)
    assert result is not None and result.stopped_because.code is StopCode.CANCELLED
    assert sent == [KEY]
    assert (await journal_kind(h)) == "unknown"
    assert f"outcome unknown: ticket {ARGS} (Idempotency-Key {KEY})" in result.open_issues
    assert h.clock.monotonic() == pytest.approx(0.0)


async def test_a_reloads_suspend_lets_a_tool_call_on_the_wire_finish_then_suspends() -> None:
    h, sent = harness([calls("ticket", ARGS), answer()], wait_s=5.0, idempotent=True)

    def reload_done_waiting(h: Harness) -> None:
        if sent and not h.control.suspend_requested:
            h.control.suspend(between_effects=True)

    assert await h.run(on_blocked=reload_done_waiting) is None  # suspended
    assert sent == ["t1.1.0"]
    assert h.clock.monotonic() == pytest.approx(5.0)  # the call ran its course
    entry = await h.store.journal_get("t1.1.0")
    assert entry is not None and entry["outcome"]["kind"] == "ok"
    assert h.record.state == "suspended"


async def test_a_reloads_suspend_ends_a_tool_retry_wait_and_the_call_goes_again_on_resume(
        ) -> None:
    down = ToolOutcome(content="", failure=CallFailure(status=503, message="down"))
    h, sent = harness([calls("ticket", ARGS), answer()], down, idempotent=True)

    def reload_done_waiting(h: Harness) -> None:
        if sent and not h.control.suspend_requested:
            h.control.suspend(between_effects=True)

    assert await h.run(on_blocked=reload_done_waiting) is None
    assert sent == ["t1.1.0"]  # no more attempts while the reload waits
    assert h.clock.monotonic() == pytest.approx(0.0)
    entry = await h.store.journal_get("t1.1.0")
    assert entry is not None and entry["outcome"] is None  # sent again on resume


def cut_after_tools(h: Harness) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Run the turn, keeping what the store held as its second model call began: the
    record and the checkpoint a crash or a stop during that call would leave (the one
    before the step's tools)."""
    before_tools: list[tuple[dict[str, Any], dict[str, Any]]] = []

    def at_request() -> None:
        if len(h.provider.requests) == 2:
            row = h.store._turns["t1"]
            before_tools.append((dict(row.record), row.read_checkpoint()))

    h.provider.on_request = at_request
    return before_tools


async def resume(h: Harness, record: dict[str, Any], checkpoint: dict[str, Any], *,
                 runtime: Runtime | None = None) -> TurnResult:
    """The turn resumed from `checkpoint` on the same store, as after a restart."""
    h.provider.script = [answer()]
    runner = TurnRunner(TurnRecord.from_json(record), TurnControl(),
                        runtime=runtime or h.runtime, shared=h.shared, store=h.store,
                        bus=h.bus, clock=h.clock, checkpoint=checkpoint, history=[],
                        rand=lambda a, b: b)
    result = await runner.run()
    assert result is not None
    return result


async def test_a_resumed_call_the_journal_answers_is_reported_though_the_time_ran_out(
        ) -> None:
    """A turn stopped during the model call after its tools resumes from the checkpoint
    before them, and the tools run again from the journal. A call whose outcome the
    journal holds is reported from it even when the turn's deadline passed meanwhile: the
    time budget keeps requests from being sent, and none is."""
    h, sent = harness([calls("ticket", ARGS), answer()])
    kept = cut_after_tools(h)
    await h.run()
    record, checkpoint = kept[0]
    assert len(checkpoint["conversation"]["messages"]) == 2  # the message, the reply
    h.clock.advance(60)
    result = await resume(h, {**record, "deadline": h.clock.time() - 1}, checkpoint)
    assert result.stopped_because.counter == "deadline", result
    assert sent == [KEY]
    assert f"step 1: ticket {ARGS} -> ok" in result.partial, result.partial
    assert len(h.provider.requests) == 2  # the boundary stopped it: no request sent


async def test_a_resumed_call_whose_tool_is_gone_is_reported_from_the_journal() -> None:
    """Resumed under a policy without the tool (or before an MCP server is back), a call
    made before the cut is reported with its journalled outcome, not as a call to a tool
    that does not exist; nothing is sent."""
    h, sent = harness([calls("ticket", ARGS), answer()])
    kept = cut_after_tools(h)
    await h.run()
    record, checkpoint = kept[0]
    policy = PolicyVersion(version=2, source_path=None, content_hash="", config=build_config(
        {"providers": [{"name": "main", "kind": "scripted"}]}))
    runtime = Runtime.build(policy)
    runtime.providers["main"] = h.provider
    assert runtime.toolbox.get("ticket") is None
    result = await resume(h, record, checkpoint, runtime=runtime)
    assert result.stopped_because.code is StopCode.COMPLETED, result
    assert sent == [KEY]
    assert f"step 1: ticket {ARGS} -> ok" in result.partial, result.partial
    last = h.provider.requests[-1].messages
    assert [m.content for m in last if m.role == "tool"] == ['{"ticket": 1}']


def flipped(h: Harness, *, idempotent: bool) -> tuple[Runtime, list[str]]:
    """A new policy's runtime in which `ticket` is (not) idempotent; its calls are
    recorded by their keys, and answer ok."""
    policy = PolicyVersion(version=2, source_path=None, content_hash="", config=build_config(
        {"providers": [{"name": "main", "kind": "scripted"}],
         "tools": [{"name": "ticket", "kind": "echo", "idempotent": idempotent}]}))
    runtime = Runtime.build(policy)
    runtime.providers["main"] = h.provider
    sent: list[str] = []

    async def call(name: str, args: dict[str, Any], *, idempotency_key: str,
                   timeout_s: float, traceparent: str | None = None) -> ToolOutcome:
        sent.append(idempotency_key)
        return ToolOutcome(content='{"ticket": 2}')

    runtime.toolbox.call = call  # type: ignore[method-assign]
    return runtime, sent


async def cut_and_flip(*, sent_idempotent: bool, answered: bool
                       ) -> tuple[TurnResult, list[str], str, Harness]:
    """A `ticket` call made with the tool (not) idempotent, the turn cut during the next
    model call (`answered`: with the call's outcome journalled; else as if the daemon
    died before it came back), then resumed under a policy that flips the flag. Returns
    the result, the keys the new policy's tool was sent, and the key the call went with."""
    h, _ = harness([calls("ticket", ARGS), answer()], idempotent=sent_idempotent)
    kept = cut_after_tools(h)
    await h.run()
    record, checkpoint = kept[0]
    key = "t1.1.0" if sent_idempotent else KEY
    entry = await h.store.journal_get(key)
    assert entry is not None and entry["outcome"] is not None
    if not answered:
        h.store._journal[key]["outcome"] = None
    runtime, sent = flipped(h, idempotent=not sent_idempotent)
    result = await resume(h, record, checkpoint, runtime=runtime)
    return result, sent, key, h


@pytest.mark.parametrize("sent_idempotent", [True, False])
async def test_a_resumed_call_whose_flag_a_new_policy_flipped_is_reported_from_the_journal(
        sent_idempotent: bool) -> None:
    """The journal holds a call under its place (idempotent) or the effect ledger's key
    (not): a new policy that flips the tool's flag between the cut and the resume does
    not hide it. The call is reported with its stored outcome and not sent again."""
    result, sent, _, h = await cut_and_flip(sent_idempotent=sent_idempotent, answered=True)
    assert result.stopped_because.code is StopCode.COMPLETED, result
    assert sent == []
    assert f"step 1: ticket {ARGS} -> ok" in result.partial, result.partial
    last = h.provider.requests[-1].messages
    assert [m.content for m in last if m.role == "tool"] == ['{"ticket": 1}']


@pytest.mark.parametrize("sent_idempotent", [True, False])
async def test_a_call_in_flight_at_the_cut_is_sent_again_only_if_both_flags_say_idempotent(
        sent_idempotent: bool) -> None:
    """A call sent with no answer before the cut may go again (with its key) only when
    it was sent as idempotent and its tool still is. Sent as an effect, or resumed under
    a policy that now says it is one, it is an unknown outcome: an open issue, never
    repeated."""
    result, sent, key, _ = await cut_and_flip(sent_idempotent=sent_idempotent,
                                              answered=False)
    assert sent == []
    assert f"outcome unknown: ticket {ARGS} (Idempotency-Key {key})" in result.open_issues
    assert f"step 1: ticket {ARGS} -> outcome unknown" in result.partial, result.partial
