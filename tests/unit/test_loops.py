"""Loop detection (`policy/loops.py`) and the failure loop (`policy/failure_loop.py`,
the `failure_streak` counter)."""

from __future__ import annotations

import hashlib
import json

import pytest

from turnkeeper.config import FailureLoopConfig, LoopDetectionConfig
from turnkeeper.policy.classify import FailureClass
from turnkeeper.policy.failure_loop import FailureLoop
from turnkeeper.policy.loops import (
    Action,
    LoopDetector,
    LoopWarning,
    action_key,
    canonical_json,
    observation_key,
    state_key,
)
from turnkeeper.policy.outcome import Stop, StopCode

R = FailureClass.RETRYABLE
D = FailureClass.DETERMINISTIC
U = FailureClass.UNKNOWN


def search(query: str = "turnkeeper") -> Action:
    return Action.of("search", {"q": query, "limit": 10})


# --- keys -------------------------------------------------------------------------------


def test_canonical_json_sorts_keys_and_drops_whitespace() -> None:
    assert canonical_json({"b": 2, "a": 1}) == '{"a":1,"b":2}'
    assert canonical_json({"a": 1, "b": 2}) == canonical_json({"b": 2, "a": 1})
    assert canonical_json({"x": "café", "n": [1, {"z": 0, "y": None}]}) == \
        '{"n":[1,{"y":null,"z":0}],"x":"café"}'


def test_canonical_json_is_exactly_sorted_compact_json_dumps() -> None:
    values: list[object] = [
        {"q": "x", "limit": 10}, {"nested": {"b": [1, 2.5, -0.0, 1e300], "a": True}},
        {"s": "tab\t quote\" backslash\\ nl\n emoji \U0001f600 ctl \x01"},
        [3, "two", None, False, {"k": []}], "top", 7, 1.1, None, {}, [],
        {"big": 10**30, "nan": float("nan"), "inf": float("-inf")},
    ]
    for v in values:
        assert canonical_json(v) == json.dumps(v, sort_keys=True, separators=(",", ":"),
                                               ensure_ascii=False), v
    with pytest.raises(TypeError, match="not JSON serializable"):
        canonical_json({"a": object()})


def test_action_key_is_sha256_of_tool_and_canonical_arguments() -> None:
    expected = hashlib.sha256(b'search\n{"a":1,"b":2}').hexdigest()
    assert action_key("search", {"b": 2, "a": 1}) == expected
    assert action_key("fetch", {"a": 1, "b": 2}) != expected


def test_state_key_ignores_the_order_of_observations() -> None:
    assert state_key(["x", "y"]) == state_key(["y", "x"])
    assert state_key(["x"]) != state_key(["x", "y"])
    assert observation_key("x") == hashlib.sha256(b"x").hexdigest()


# --- repeated actions -------------------------------------------------------------------


def test_three_identical_searches_stop_the_turn_at_the_third() -> None:
    det = LoopDetector()
    assert det.before_action(search()) is None
    det.after_action(search(), None)
    warning = det.before_action(search())
    assert isinstance(warning, LoopWarning)
    assert (warning.code, warning.count, warning.limit) == ("loop.repeated_action", 2, 3)
    assert warning.message == (
        "Loop note: this is the 2nd call to search with these same arguments in this turn. "
        "The 3rd identical call will stop the turn: try something different, answer with "
        "what you have, or call report_blocked.")
    det.after_action(search(), None)
    stop = det.before_action(search())
    assert stop == Stop(StopCode.LOOP_REPEATED_ACTION,
                        "search called with the same arguments 3 times (limit 3)",
                        value=3, limit=3)
    assert stop.counter == "repeats"


def test_key_order_cannot_hide_a_repeat() -> None:
    det = LoopDetector()
    for args in ({"q": "x", "limit": 10}, {"limit": 10, "q": "x"}):
        assert not isinstance(det.before_action(Action.of("search", args)), Stop)
        det.after_action(Action.of("search", args), None)
    stop = det.before_action(Action.of("search", {"limit": 10, "q": "x"}))
    assert isinstance(stop, Stop) and stop.value == 3


def test_different_arguments_are_different_actions() -> None:
    det = LoopDetector()
    for q in ("a", "b", "c", "d"):
        assert det.before_action(search(q)) is None
        det.after_action(search(q), None)


def test_every_repeat_between_warn_and_max_gets_a_note() -> None:
    det = LoopDetector(warn_repeats=2, max_repeats=4)
    results = []
    for _ in range(4):
        results.append(det.before_action(search()))
        det.after_action(search(), None)
    assert results[0] is None
    assert [r.count for r in results[1:3]] == [2, 3]  # type: ignore[union-attr]
    assert isinstance(results[3], Stop) and results[3].value == 4


def test_polling_tools_are_exempt_from_repeats_and_progress() -> None:
    det = LoopDetector()
    poll = Action.of("job_status", {"id": 7}, polling=True)
    for _ in range(20):
        assert det.before_action(poll) is None
        det.after_action(poll, None)
        assert det.after_step(["status: running"], polling_only=True) is None
    assert det.repeats(poll.key) == 0
    assert det.no_progress == 0


def test_polling_steps_neither_count_nor_reset_no_progress() -> None:
    det = LoopDetector(max_no_progress=3, max_state_revisits=100)
    assert det.after_step(["a"]) is None
    assert det.after_step(["a"]) is None
    assert det.no_progress == 1
    assert det.after_step(["brand new poll result"], polling_only=True) is None
    assert det.no_progress == 1
    assert det.after_step(["a"]) is None
    assert det.after_step(["a"]) == Stop(
        StopCode.LOOP_NO_PROGRESS, "3 steps in a row found nothing new (limit 3)",
        value=3, limit=3)


def test_repeat_after_retryable_failure_is_not_a_loop() -> None:
    det = LoopDetector()
    for _ in range(6):
        assert det.before_action(search()) is None
        det.after_action(search(), R)
    assert det.repeats(search().key) == 1
    # the retry succeeds; the next identical call is a real repeat again
    assert det.before_action(search()) is None
    det.after_action(search(), None)
    assert isinstance(det.before_action(search()), LoopWarning)


def test_repeat_after_unknown_failure_is_not_a_loop() -> None:
    det = LoopDetector()
    for _ in range(4):
        assert det.before_action(search()) is None
        det.after_action(search(), U)


def test_repeat_after_deterministic_failure_counts() -> None:
    det = LoopDetector()
    assert det.before_action(search()) is None
    det.after_action(search(), D)
    assert isinstance(det.before_action(search()), LoopWarning)


# --- state cycles -----------------------------------------------------------------------


def step(det: LoopDetector, action: Action, observation: str) -> Stop | None:
    """One step of one successful call, as the turn runs it."""
    warning = det.before_action(action)
    assert not isinstance(warning, Stop), warning
    det.after_action(action, None)
    return det.after_step([observation])


def go(page: str) -> Action:
    return Action.of("navigate", {"to": page})


def test_a_b_a_is_a_cycle_with_one_revisit_allowed() -> None:
    det = LoopDetector(max_state_revisits=1)
    assert step(det, go("A"), "page A") is None
    assert step(det, go("B"), "page B") is None
    stop = step(det, go("A"), "page A")
    assert stop == Stop(StopCode.LOOP_STATE_CYCLE,
                        "the same state came back 1 time, by actions taken before "
                        "(limit 1)", value=1, limit=1)
    assert stop.counter == "state_revisits"


def test_a_cycle_of_actions_and_states_stops_at_the_third_a_by_default() -> None:
    # The first A is where the turn started (its own action); then B and A alternate,
    # each reached by the action that reached it before.
    det = LoopDetector()
    assert step(det, Action.of("open", {"app": "mail"}), "A") is None
    assert [step(det, go(p), p) for p in ("B", "A", "B")] == [None] * 3
    assert step(det, go("A"), "A") == Stop(
        StopCode.LOOP_STATE_CYCLE, "the same state came back 2 times, by actions taken "
        "before (limit 2)", value=2, limit=2)


def test_new_searches_that_all_answer_nothing_are_no_progress_not_a_cycle() -> None:
    # Every query is new; the tool answers the same empty list each time: the state comes
    # back at every step, but the agent is not going round in circles.
    det = LoopDetector()
    results = [step(det, search(f"query {n}"), '{"results": []}') for n in range(1, 7)]
    assert results[:5] == [None] * 5
    assert results[5] == Stop(StopCode.LOOP_NO_PROGRESS,
                              "5 steps in a row found nothing new (limit 5)",
                              value=5, limit=5)


def test_a_revisit_by_a_new_action_counts_as_no_progress_whatever_the_limits() -> None:
    det = LoopDetector(max_state_revisits=1, max_no_progress=3)
    assert step(det, search("a"), "nothing") is None
    assert step(det, search("b"), "nothing") is None  # revisit 1 = limit, but a new search
    assert det.no_progress == 1
    assert step(det, search("c"), "nothing") is None
    # A search made before, back at the same state: now the actions cycle too.
    stop = step(det, search("a"), "nothing")
    assert isinstance(stop, Stop) and stop.code is StopCode.LOOP_STATE_CYCLE
    assert stop.value == 3


def test_a_new_action_that_failed_does_not_make_the_step_new() -> None:
    det = LoopDetector(max_state_revisits=1)
    assert step(det, go("A"), "A") is None
    assert step(det, go("B"), "B") is None
    det.before_action(search("never tried"))
    det.after_action(search("never tried"), D)  # failed: it reached no state
    stop = step(det, go("A"), "A")
    assert isinstance(stop, Stop) and stop.code is StopCode.LOOP_STATE_CYCLE


def test_a_step_cut_by_a_suspend_keeps_its_new_action_across_the_checkpoint() -> None:
    det = LoopDetector(max_state_revisits=1)
    assert step(det, go("A"), "A") is None
    det.before_action(go("C"))  # new, then the turn is suspended before the step ends
    det.after_action(go("C"), None)
    back = LoopDetector.restore(json.loads(json.dumps(det.snapshot())), det.lines,
                                max_state_revisits=1)
    assert back.snapshot()["fresh"] == det.snapshot()["fresh"]
    # The step goes on after the resume and comes back to A: reached by a new action.
    assert back.after_step(["A"]) is None
    assert back.no_progress == 1 and "fresh" not in back.snapshot()


def test_a_declared_state_wins_over_the_observations() -> None:
    det = LoopDetector(max_state_revisits=1)
    assert det.after_step(["listing at 10:00"], state="inbox") is None
    stop = det.after_step(["listing at 10:01"], state="inbox")
    assert isinstance(stop, Stop) and stop.code is StopCode.LOOP_STATE_CYCLE


def test_steps_without_observations_are_not_recorded() -> None:
    det = LoopDetector(max_state_revisits=1, max_no_progress=1)
    assert det.after_step(["A"]) is None
    for _ in range(5):
        assert det.after_step([]) is None
    assert det.no_progress == 0


# --- progress ---------------------------------------------------------------------------


def test_no_new_observation_for_max_no_progress_steps_stops() -> None:
    det = LoopDetector(max_no_progress=5, max_state_revisits=100)
    assert det.after_step(["x", "y"]) is None
    # every step repeats something already seen, in new combinations (new states)
    for obs in (["x"], ["y"], ["y", "x", "x"], ["x", "x"]):
        assert det.after_step(obs) is None
    assert det.after_step(["y", "y"]) == Stop(
        StopCode.LOOP_NO_PROGRESS, "5 steps in a row found nothing new (limit 5)",
        value=5, limit=5)
    assert Stop(StopCode.LOOP_NO_PROGRESS, "").counter == "no_progress"


def test_a_new_observation_resets_the_no_progress_streak() -> None:
    det = LoopDetector(max_no_progress=2, max_state_revisits=100)
    assert det.after_step(["x"]) is None
    assert det.after_step(["x"]) is None
    assert det.after_step(["x", "new"]) is None
    assert det.no_progress == 0
    assert det.after_step(["x"]) is None
    assert isinstance(det.after_step(["new"]), Stop)


def test_slow_but_real_progress_is_not_stopped() -> None:
    det = LoopDetector()
    for page in range(200):
        action = Action.of("fetch", {"page": page})
        assert det.before_action(action) is None
        det.after_action(action, None)
        assert det.after_step(["header", f"row {page}"]) is None
    assert det.no_progress == 0


def test_state_cycle_is_reported_before_no_progress() -> None:
    det = LoopDetector(max_state_revisits=1, max_no_progress=1)
    assert det.after_step(["A"]) is None
    stop = det.after_step(["A"])
    assert isinstance(stop, Stop) and stop.code is StopCode.LOOP_STATE_CYCLE


def test_loop_detector_comes_from_config() -> None:
    det = LoopDetector.from_config(LoopDetectionConfig(warn_repeats=3, max_repeats=7,
                                                       max_state_revisits=4,
                                                       max_no_progress=9))
    assert repr(det) == (
        "LoopDetector(warn_repeats=3, max_repeats=7, max_state_revisits=4, "
        "max_no_progress=9, actions=0, states=0, observations=0, no_progress=0)")


def test_loop_detector_rejects_a_zero_limit() -> None:
    with pytest.raises(ValueError, match="max_repeats must be at least 1, got 0"):
        LoopDetector(max_repeats=0)


def test_loop_detector_snapshot_restore_continues_exactly() -> None:
    kwargs = {"warn_repeats": 2, "max_repeats": 3, "max_state_revisits": 2,
              "max_no_progress": 3}
    det = LoopDetector(**kwargs)
    det.before_action(search())
    det.after_action(search(), None)
    det.before_action(search("flaky"))
    det.after_action(search("flaky"), R)
    for s in ("A", "B", "A"):
        det.after_step([s])
    assert det.after_step(["B"]) is None
    data = json.loads(json.dumps(det.snapshot()))
    back = LoopDetector.restore(data, json.loads(json.dumps(det.lines)), **kwargs)
    assert back.snapshot() == det.snapshot() and back.lines == det.lines
    # the retry after a retryable failure is still a retry
    assert back.before_action(search("flaky")) is None
    # the second search is the second repeat
    assert isinstance(back.before_action(search()), LoopWarning)
    # the no-progress streak (2) carries over: one more step without news stops...
    # ...but A comes back a second time first, so the cycle names it
    assert back.after_step(["A"]) == Stop(
        StopCode.LOOP_STATE_CYCLE, "the same state came back 2 times, by actions taken "
        "before (limit 2)", value=2, limit=2)
    assert back.no_progress == 3


# --- failure loop -----------------------------------------------------------------------


def test_two_identical_deterministic_failures_stop() -> None:
    loop = FailureLoop()
    assert loop.record_failure("search", {"q": "x"}, D) is None
    stop = loop.record_failure("search", {"q": "x"}, D)
    assert stop == Stop(StopCode.FAILURE_DETERMINISTIC,
                        "search failed 2 times in a row with the same arguments "
                        "(deterministic failure, limit 2)", value=2, limit=2)
    assert stop.counter == "failure_streak"


def test_unknown_failures_stop_at_three() -> None:
    loop = FailureLoop()
    assert [loop.record_failure("t", {}, U) for _ in range(2)] == [None, None]
    stop = loop.record_failure("t", {}, U)
    assert stop is not None and (stop.code, stop.value, stop.limit) == (
        StopCode.FAILURE_UNKNOWN, 3, 3)


def test_retryable_failures_stop_at_five() -> None:
    loop = FailureLoop()
    assert [loop.record_failure("t", {"a": 1}, R) for _ in range(4)] == [None] * 4
    assert loop.streak == 4
    stop = loop.record_failure("t", {"a": 1}, R)
    assert stop is not None and (stop.code, stop.value, stop.limit) == (
        StopCode.FAILURE_RETRYABLE, 5, 5)


def test_different_failure_resets_streak() -> None:
    loop = FailureLoop()
    assert loop.record_failure("search", {"q": "x"}, D) is None
    assert loop.record_failure("search", {"q": "y"}, D) is None
    assert loop.streak == 1
    assert loop.streak_of("search", {"q": "x"}, D) == 0
    assert loop.record_failure("search", {"q": "x"}, D) is None
    # same call, another class: another signature
    assert loop.record_failure("search", {"q": "x"}, R) is None
    assert loop.streak == 1


def test_key_order_cannot_hide_a_repeated_failure() -> None:
    loop = FailureLoop()
    assert loop.record_failure("t", {"a": 1, "b": 2}, D) is None
    assert isinstance(loop.record_failure("t", {"b": 2, "a": 1}, D), Stop)


def test_success_of_the_same_call_resets_its_streak() -> None:
    loop = FailureLoop()
    loop.record_failure("t", {"a": 1}, R)
    loop.record_failure("t", {"a": 1}, R)
    loop.record_success("t", {"b": 1})  # another call's success changes nothing
    assert loop.streak == 2
    loop.record_success("t", {"a": 1})
    assert loop.streak == 0
    assert loop.current_signature is None
    assert loop.record_failure("t", {"a": 1}, R) is None
    assert loop.streak == 1


def test_signature_is_action_key_and_class() -> None:
    assert FailureLoop.signature("t", {"b": 2, "a": 1}, D) == \
        f"{action_key('t', {'a': 1, 'b': 2})}:deterministic"


def test_failure_loop_comes_from_config() -> None:
    loop = FailureLoop.from_config(FailureLoopConfig(deterministic=1, unknown=2, retryable=3))
    assert repr(loop) == ("FailureLoop(deterministic=1, unknown=2, retryable=3, "
                          "signature=None, streak=0)")
    assert isinstance(loop.record_failure("t", {}, D), Stop)


def test_failure_loop_snapshot_restore_continues_exactly() -> None:
    loop = FailureLoop(retryable=5)
    for _ in range(4):
        loop.record_failure("t", {"a": [1, 2]}, R)
    data = json.loads(json.dumps(loop.snapshot()))
    back = FailureLoop.restore(data, deterministic=2, unknown=3, retryable=5)
    assert back.streak == 4
    assert back.record_failure("t", {"a": [1, 2]}, R) == Stop(
        StopCode.FAILURE_RETRYABLE,
        "t failed 5 times in a row with the same arguments (retryable failure, limit 5)",
        value=5, limit=5)


def test_retries_are_governed_by_the_failure_loop_not_max_repeats() -> None:
    det, loop = LoopDetector(), FailureLoop()
    results: list[object] = []
    for _ in range(5):
        results.append(det.before_action(search()))
        det.after_action(search(), R)
        results.append(loop.record_failure("search", {"q": "turnkeeper", "limit": 10}, R))
    assert results[:-1] == [None] * 9
    assert isinstance(results[-1], Stop) and results[-1].code is StopCode.FAILURE_RETRYABLE


def test_policy_modules_import_no_io() -> None:
    import ast
    from pathlib import Path

    import turnkeeper.policy.budget as budget
    import turnkeeper.policy.loops as loops

    banned = {"anyio", "aiohttp", "sqlite3", "time", "random", "logging", "asyncio"}
    for module in (budget, loops):
        assert module.__file__ is not None
        tree = ast.parse(Path(module.__file__).read_text())
        names = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module.split(".")[0])
        assert not names & banned, (module.__name__, names & banned)


def test_what_grows_with_the_turn_is_appended_as_lines_and_the_snapshot_stays_small(
        ) -> None:
    """Every key the detector counts is one line, appended once and never rewritten;
    the snapshot holds only the failing calls' outcomes and the streak."""
    det = LoopDetector(max_no_progress=1000, max_state_revisits=1000)
    for n in range(100):
        det.before_action(search(f"q{n}"))
        det.after_action(search(f"q{n}"), None)
        det.after_step([f"result {n}", "the same footer"])
    # each step: the call, the state, its new observations (the footer only once)
    assert len(det.lines) == 100 * 3 + 1
    first = list(det.lines[:30])
    det.before_action(search("q0"))
    assert det.lines[:30] == first and det.lines[-1].startswith("r")
    assert det.snapshot() == {"last_outcome": {}, "no_progress": 0}


def test_a_snapshot_from_before_the_lines_restores_the_same_detector() -> None:
    """A checkpoint written before the trail held the counts themselves: the restored
    detector judges the next calls and steps alike, and holds its counts as lines."""
    det = LoopDetector(max_no_progress=3)
    det.before_action(search())
    det.after_action(search(), None)
    for s in ("A", "B", "A"):
        det.after_step([s])
    lines = det.lines
    older = {"repeats": {line[1:]: 1 for line in lines if line[0] == "r"},
             "state_visits": _visits(lines),
             "seen": sorted(line[1:] for line in lines if line[0] == "o"),
             "last_outcome": {}, "no_progress": 1}
    back = LoopDetector.restore(older, max_no_progress=3)
    assert sorted(back.lines) == sorted(det.lines)
    assert back.before_action(search()) == det.before_action(search())
    assert back.after_step(["A"]) == det.after_step(["A"])


def _visits(lines: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in lines:
        if line[0] == "v":
            out[line[1:]] = out.get(line[1:], 0) + 1
    return out


def test_a_line_that_is_not_the_detectors_is_refused() -> None:
    with pytest.raises(ValueError, match="not a loop detector line"):
        LoopDetector.restore({}, ["x0123456789abcdef"])
