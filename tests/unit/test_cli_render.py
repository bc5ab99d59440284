"""What the CLI prints for people: units, times and no word said twice."""

from __future__ import annotations

import time

import pytest

from turnkeeper.cli.base import UsageError
from turnkeeper.cli.render import event_line, fmt_measure, result_lines, status_lines
from turnkeeper.cli.turns import parse_deadline

NOW = 1_800_000_000.0  # early 2027


def test_a_seconds_stop_shows_milliseconds_not_a_raw_float() -> None:
    line = result_lines({"status": "partial", "stopped_because": {
        "code": "budget.seconds", "counter": "seconds", "value": 0.002497868000040762,
        "limit": 0.0001, "message": "time budget spent"}})[0]
    assert "0.002497868" not in line
    assert "seconds = 2.5 ms of limit 0.1 ms" in line


def test_a_deadline_stop_shows_times_not_epoch_seconds() -> None:
    assert fmt_measure("deadline", 1796059278.73) == time.strftime(
        "%Y-%m-%d %H:%M:%S", time.localtime(1796059278.73))


def test_a_completed_result_does_not_say_completed_twice() -> None:
    line = result_lines({"status": "completed", "stopped_because": {
        "code": "completed", "counter": None, "value": None, "limit": None,
        "message": "completed"}})[0]
    assert "completed: completed" not in line
    assert line.split() == ["result", "completed"]


def test_an_event_s_instants_are_times_for_people() -> None:
    line = event_line({"seq": 1, "ts": 1796059000.0, "turn": "t_1", "type": "clarify.asked",
                       "question": "which?", "timeout_at": 1796059278.73})
    assert line is not None
    assert "1796059278" not in line
    assert "timeout_at=" + time.strftime("%Y-%m-%d %H:%M:%S",
                                         time.localtime(1796059278.73)) in line


@pytest.mark.parametrize(("text", "expected"), [
    ("30m", 1800.0), ("2h", 7200.0), ("1d", 86400.0), ("90s", 90.0)])
def test_a_deadline_may_be_a_span_from_now(text: str, expected: float) -> None:
    assert parse_deadline(text, NOW) == NOW + expected


def test_a_deadline_may_be_an_iso_time_or_epoch_seconds() -> None:
    assert parse_deadline("2030-01-01T00:00:00Z", NOW) == 1893456000.0
    assert parse_deadline("1893456000", NOW) == 1893456000.0


@pytest.mark.parametrize("text", ["2020-01-01T00:00:00Z", "999", "0s", "soon", ""])
def test_a_past_or_unreadable_deadline_is_a_usage_error(text: str) -> None:
    with pytest.raises(UsageError, match="--deadline"):
        parse_deadline(text, NOW)


def test_health_names_every_reason_to_be_degraded() -> None:
    from turnkeeper.supervisor.queries import health_problems

    ok = {"state": "ready", "paused": False, "breakers": {"a": "closed"},
          "mcp_servers": {"m": {"state": "up"}}, "last_reload_error": None}
    assert health_problems(ok) == []
    bad = {**ok, "paused": True, "breakers": {"a": "open"},
           "mcp_servers": {"m": {"state": "restarting"}},
           "last_reload_error": "invalid configuration (x):\n  a.b: c\n  d: e"}
    problems = health_problems(bad)
    assert len(problems) == 4
    assert problems[0].startswith("paused") and "breaker a open" in problems
    assert "mcp server m restarting" in problems
    # The whole reason, on one line: not the head alone, which stops at its colon.
    assert problems[-1] == "last reload failed: invalid configuration (x): a.b: c, d: e"


def _status(**extra: object) -> dict[str, object]:
    base: dict[str, object] = {
        "state": "ready", "version": "0.1.0", "uptime_s": 5.0, "policy_version": 1,
        "config_path": None, "turns": {"queued": 0}, "breakers": {},
        "store": {"writable": True, "failing_for_s": 0.0, "last_error": None,
                  "fatal_after_s": 300.0},
        "overload": {"state": "accepting", "lag_s": 0.001, "refused": 0}}
    base.update(extra)
    return base


def test_status_says_nothing_of_a_healthy_store_or_intake() -> None:
    lines = status_lines(_status())
    assert not any(line.startswith(("store", "intake", "retry-after")) for line in lines)


def test_status_lists_the_retry_after_windows_open() -> None:
    lines = status_lines(_status(retry_after={"primary": 27.34, "tool:search": 5.0}))
    assert "retry-after  primary 27.3 s  tool:search 5.0 s" in lines


def test_status_names_an_unwritable_store_and_an_overloaded_intake() -> None:
    lines = status_lines(_status(
        store={"writable": False, "failing_for_s": 75.0, "fatal_after_s": 300.0,
               "last_error": "OperationalError: database or disk is full"},
        overload={"state": "shedding", "lag_s": 0.8, "refused": 12}))
    assert ("store        UNWRITABLE for 1 min 15 s: OperationalError: database or disk is "
            "full; writes wait (exit 74 after 5 min 00 s), submits get 507") in lines
    assert ("intake       OVERLOADED: the event loop lags 0.8 s; new submits get 503 "
            "(12 so far)") in lines


def test_status_shows_each_webhooks_backlog() -> None:
    lines = status_lines(_status(webhooks={
        "app": {"pending": 3, "oldest_pending_age_s": 75.0, "in_flight": 1,
                "delivered": 10, "failed": 2, "last_error": "HTTP 410", "configured": True},
        "gone": {"pending": 1, "oldest_pending_age_s": None, "in_flight": 0,
                 "delivered": 0, "failed": 0, "last_error": None, "configured": False}}))
    assert ("webhook      app 3 pending (oldest 1 min 15 s), 1 on the wire, 10 delivered, "
            "2 FAILED; last error: HTTP 410") in lines
    assert ("webhook      gone 1 pending, 0 on the wire, 0 delivered, 0 failed (no longer "
            "configured)") in lines


def test_show_names_each_call_held_for_approval_and_how_to_decide_it() -> None:
    from turnkeeper.cli.render import summary

    turn = {"id": "t_1", "session": "s", "state": "waiting", "policy_version": 1,
            "created_at": 0.0, "updated_at": 0.0,
            "counters": {"steps": 1, "provider_attempts": 1, "fallback_hops": 0,
                         "restarts": 0, "recovery_cycles": 0},
            "usage": {"total_tokens": 0, "input_tokens": 0, "output_tokens": 0,
                      "seconds": 0.0, "cost_usd": 0.0},
            "pending_approvals": [{"tool": "pay", "call_id": "call_0",
                                   "arguments": {"amount": 5}}]}
    assert ('approval  pay call_0 {"amount": 5}  (turnkeeper approve t_1 call_0, or deny)'
            in summary(turn).splitlines())
