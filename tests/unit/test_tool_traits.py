"""What MCP tool annotations and failures mean to the daemon (policy/tool_traits.py)."""

from __future__ import annotations

import pytest

from turnkeeper.config import ConfigError, build_config
from turnkeeper.policy.backoff import Backoff
from turnkeeper.policy.classify import CallFailure, FailureClass, classify
from turnkeeper.policy.tool_traits import (
    CALL_TIMED_OUT,
    CONNECTION_CLOSED,
    INTERNAL_ERROR,
    INVALID_PARAMS,
    INVALID_REQUEST,
    METHOD_NOT_FOUND,
    REQUEST_TIMEOUT,
    SERVER_DOWN,
    RestartSchedule,
    exposed_names,
    rpc_error_names,
    selected,
    tool_error_names,
    tool_traits,
)


def hints(read_only: bool | None = None, destructive: bool | None = None,
          idempotent: bool | None = None, *, override_idempotent: bool | None = None,
          override_destructive: bool | None = None) -> tuple[bool, bool]:
    """(idempotent, destructive) from a server's annotations and the operator's
    overrides."""
    t = tool_traits(read_only_hint=read_only, destructive_hint=destructive,
                    idempotent_hint=idempotent, override_idempotent=override_idempotent,
                    override_destructive=override_destructive)
    return t.idempotent, t.destructive


def test_read_only_hint_makes_a_tool_idempotent_and_not_destructive() -> None:
    assert hints(read_only=True) == (True, False)
    # destructiveHint means nothing on a read-only tool (MCP spec)
    assert hints(read_only=True, destructive=True) == (True, False)


def test_idempotent_hint_makes_a_tool_idempotent() -> None:
    assert hints(idempotent=True, destructive=False) == (True, False)
    # destructiveHint left out defaults to true in MCP: shown, but idempotent still wins
    assert hints(idempotent=True) == (True, True)


def test_a_stated_destructive_hint_is_never_retried_even_if_idempotent() -> None:
    assert hints(destructive=True) == (False, True)
    assert hints(destructive=True, idempotent=True) == (False, True)


def test_a_tool_without_annotations_is_not_idempotent() -> None:
    t = tool_traits(read_only_hint=None, destructive_hint=None, idempotent_hint=None)
    assert (t.idempotent, t.destructive) == (False, True)
    assert t.because == "no hint: not idempotent"
    assert hints(read_only=False, destructive=False, idempotent=False) == (False, False)


def test_because_names_the_hints_given_when_none_decided() -> None:
    t = tool_traits(read_only_hint=False, destructive_hint=False, idempotent_hint=False)
    assert t.because == ("readOnlyHint=false, destructiveHint=false, idempotentHint=false: "
                         "not idempotent")
    t = tool_traits(read_only_hint=None, destructive_hint=False, idempotent_hint=None)
    assert t.because == "destructiveHint=false: not idempotent"
    both = tool_traits(read_only_hint=None, destructive_hint=True, idempotent_hint=True)
    assert (both.idempotent, both.because) == (False, "destructiveHint (over idempotentHint)")


def test_only_a_tool_that_requires_tasks_is_left_out() -> None:
    from turnkeeper.policy.tool_traits import offered_without_tasks

    assert not offered_without_tasks("required")
    assert all(offered_without_tasks(v) for v in ("optional", "forbidden", None))


def test_overrides_win_over_annotations() -> None:
    assert hints(read_only=True, override_idempotent=False) == (False, False)
    assert hints(read_only=True, override_destructive=True) == (False, True)
    assert hints(destructive=True, override_idempotent=True) == (True, True)
    assert hints(idempotent=True, override_destructive=True) == (False, True)
    assert hints(destructive=True, override_destructive=False) == (False, False)
    t = tool_traits(read_only_hint=None, destructive_hint=None, idempotent_hint=None,
                    override_idempotent=True)
    assert t.idempotent and t.because == "override idempotent"


def test_config_rejects_an_override_both_idempotent_and_destructive() -> None:
    with pytest.raises(ConfigError, match="contradict"):
        build_config({"tools": [{"name": "srv", "kind": "mcp", "command": "srv",
                                 "overrides": {"x": {"idempotent": True,
                                                     "destructive": True}}}]})


def test_include_then_exclude_with_shell_patterns() -> None:
    assert selected("read_file", include=(), exclude=())
    assert selected("read_file", include=("read_*",), exclude=())
    assert not selected("write_file", include=("read_*",), exclude=())
    assert not selected("read_secret", include=("read_*",), exclude=("*secret*",))
    assert not selected("anything", include=(), exclude=("*",))


def test_exposed_names_are_prefixed_and_accepted_by_every_provider() -> None:
    names = exposed_names("fs", ["read_file", "list.dir", "a/b c", "x" * 80, "read_file"])
    assert names["read_file"] == "fs__read_file"
    assert names["list.dir"] == "fs__list_dir"
    assert names["a/b c"] == "fs__a_b_c"
    long = names["x" * 80]
    assert len(long) == 64 and long.startswith("fs__xxx")
    for name in names.values():
        assert all(c.isalnum() or c in "_-" for c in name) and len(name) <= 64


def test_exposed_names_never_collide_after_cleaning() -> None:
    names = exposed_names("s", ["a.b", "a_b", "a-b"])
    assert len(set(names.values())) == 3
    assert names["a.b"] == "s__a_b"
    assert names["a_b"].startswith("s__a_b_") and len(names["a_b"]) == 15


def cls(names: tuple[str, ...]) -> FailureClass:
    return classify(CallFailure(exception=names))


def test_a_down_server_a_closed_connection_and_a_timeout_are_retryable() -> None:
    assert cls(SERVER_DOWN) is FailureClass.RETRYABLE
    assert cls(CALL_TIMED_OUT) is FailureClass.RETRYABLE
    names, suspect = rpc_error_names(CONNECTION_CLOSED, "Connection closed")
    assert cls(names) is FailureClass.RETRYABLE and suspect
    names, suspect = rpc_error_names(REQUEST_TIMEOUT, "Request 'tools/call' timed out")
    assert cls(names) is FailureClass.RETRYABLE and not suspect


def test_a_lost_http_session_is_a_dead_connection_not_a_wrong_request() -> None:
    names, suspect = rpc_error_names(INVALID_REQUEST, "Session terminated")
    assert cls(names) is FailureClass.RETRYABLE and suspect


def test_wrong_requests_are_deterministic_and_server_bugs_unknown() -> None:
    for code in (INVALID_PARAMS, METHOD_NOT_FOUND, INVALID_REQUEST):
        names, suspect = rpc_error_names(code, "Unknown tool: x")
        assert cls(names) is FailureClass.DETERMINISTIC and not suspect
    assert cls(rpc_error_names(INTERNAL_ERROR, "boom")[0]) is FailureClass.UNKNOWN
    assert cls(rpc_error_names(-31999, "vendor")[0]) is FailureClass.UNKNOWN


@pytest.mark.parametrize("text", [
    "Error executing tool fetch: Connection refused",
    "upstream timed out after 30s", "Service temporarily unavailable, try again later",
    "Failed to fetch https://x: status code 503", "HTTP 429 Too Many Requests",
    "rate limit exceeded", "getaddrinfo EAI_AGAIN example.org"])
def test_an_is_error_result_that_reads_transient_is_retryable(text: str) -> None:
    assert cls(tool_error_names(text)) is FailureClass.RETRYABLE


@pytest.mark.parametrize("text", [
    "Error executing tool read_file: ENOENT: no such file or directory",
    "Access denied - path outside allowed directories", "invalid city name", ""])
def test_an_is_error_result_is_otherwise_deterministic(text: str) -> None:
    assert cls(tool_error_names(text)) is FailureClass.DETERMINISTIC


def upper(a: float, b: float) -> float:
    return b


def test_restart_waits_grow_over_failed_connections() -> None:
    s = RestartSchedule(Backoff(base_delay_s=0.5, max_delay_s=8.0, jitter="full"),
                        stable_after_s=8.0)
    waits = [s.connection_ended(lived_s=None, rand=upper) for _ in range(6)]
    assert waits == [0.5, 1.0, 2.0, 4.0, 8.0, 8.0]
    assert s.restarts == 6


def test_a_connection_that_stayed_up_starts_the_curve_over() -> None:
    s = RestartSchedule(Backoff(base_delay_s=0.5, max_delay_s=8.0, jitter="full"),
                        stable_after_s=8.0)
    for _ in range(4):
        s.connection_ended(lived_s=0.1, rand=upper)  # crashes right after starting
    assert s.connection_ended(lived_s=2.0, rand=upper) == 8.0
    assert s.connection_ended(lived_s=60.0, rand=upper) == 0.5
    assert s.restarts == 6 and "streak=1" in repr(s)


def test_decorrelated_restart_waits_never_go_below_the_base() -> None:
    s = RestartSchedule(Backoff(base_delay_s=0.5, max_delay_s=0.5, jitter="decorrelated"),
                        stable_after_s=1.0)
    assert [s.connection_ended(lived_s=None, rand=lambda a, b: a)
            for _ in range(3)] == [0.5, 0.5, 0.5]
