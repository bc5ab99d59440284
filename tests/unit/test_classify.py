"""Failure classification: every failed call is classified before it counts."""

from __future__ import annotations

import email.utils
import errno
import json
import os

import pytest

from turnkeeper.policy.classify import (
    CallFailure,
    FailureClass,
    Redactor,
    classify,
    exception_names,
    is_context_overflow,
    parse_retry_after,
    retry_after_from_body,
    retry_after_of,
)

R = FailureClass.RETRYABLE
D = FailureClass.DETERMINISTIC
U = FailureClass.UNKNOWN
NOW = 1_700_000_000.0  # a fixed "wall clock" for HTTP dates




def classify_exception(exc: BaseException) -> FailureClass:
    """What a provider adapter does with an exception from its transport."""
    return classify(CallFailure(exception=exception_names(exc), message=str(exc)))


@pytest.mark.parametrize("status", [408, 409, 425, 429, 500, 502, 503, 504, 529])
def test_spec_retryable_statuses_are_retryable(status: int) -> None:
    assert classify(CallFailure(status=status)) is R


@pytest.mark.parametrize("status", [400, 401, 403, 404, 405, 413, 422])
def test_spec_deterministic_statuses_are_never_retried(status: int) -> None:
    assert classify(CallFailure(status=status)) is D


@pytest.mark.parametrize(("status", "expected"), [(599, R), (505, R), (418, D), (451, D)])
def test_other_5xx_are_retryable_and_other_4xx_deterministic(status: int,
                                                             expected: FailureClass) -> None:
    assert classify(CallFailure(status=status)) is expected


def test_501_not_implemented_is_deterministic_for_a_model_and_a_tool() -> None:
    assert classify(CallFailure(status=501)) is D
    assert classify(CallFailure(status=501, error_type="server_error",
                                message="Not Implemented")) is D


@pytest.mark.parametrize("code", [errno.EHOSTUNREACH, errno.ENETUNREACH])
def test_an_unreachable_host_or_network_is_retryable_bare_or_wrapped(code: int) -> None:
    bare = OSError(code, os.strerror(code))
    assert classify_exception(bare) is R
    assert classify_exception(OSError(code, "")) is R  # by its errno, whatever it says

    class LibraryConnectError(Exception):  # another library's wrapper (httpx, the MCP SDK)
        pass

    try:
        try:
            raise bare
        except OSError as exc:
            raise LibraryConnectError("connect failed") from exc
    except LibraryConnectError as wrapped:
        assert classify_exception(wrapped) is R

    class WithOsError(Exception):  # aiohttp keeps the OSError of a connect in os_error
        def __init__(self) -> None:
            super().__init__("cannot connect")
            self.os_error = OSError(code, "")

    assert "NetworkUnreachable" in exception_names(WithOsError())
    assert classify_exception(WithOsError()) is R
    assert classify_exception(OSError(errno.EPROTO, "")) is U


@pytest.mark.parametrize("message", [
    "[Errno 113] No route to host", "[Errno 101] Network is unreachable",
    "connect EHOSTUNREACH 10.0.0.7:443", "Service Temporarily Unavailable",
    "The server is temporarily unavailable, try again later"])
def test_a_statusless_failure_that_says_unreachable_or_temporarily_unavailable_is_retryable(
        message: str) -> None:
    assert classify(CallFailure(message=message)) is R
    assert classify(CallFailure(message=message, exception=("StreamError",))) is R


def test_words_of_the_message_never_beat_the_status_or_a_known_exception() -> None:
    assert classify(CallFailure(status=400, message="temporarily unavailable")) is D
    assert classify(CallFailure(exception=("MalformedArguments",),
                                message="temporarily unavailable")) is D


def test_the_status_wins_over_the_transport_exception() -> None:
    assert classify(CallFailure(status=401, exception=("TimeoutError",))) is D
    assert classify(CallFailure(status=503, exception=("ValueError",))) is R


@pytest.mark.parametrize(("error_type", "expected"), [
    ("invalid_request_error", D), ("authentication_error", D), ("permission_error", D),
    ("not_found_error", D), ("invalid_api_key", D), ("overloaded_error", R),
    ("api_error", R), ("rate_limit_error", R), ("server_error", R), ("something_new", U),
])
def test_an_error_event_inside_a_stream_is_classified_by_its_type(
        error_type: str, expected: FailureClass) -> None:
    assert classify(CallFailure(error_type=error_type, exception=("StreamError",))) is expected


def test_the_status_wins_over_the_error_type() -> None:
    assert classify(CallFailure(status=400, error_type="overloaded_error")) is D
    assert classify(CallFailure(status=503, error_type="invalid_request_error")) is R


@pytest.mark.parametrize(("exc", "expected"), [
    (TimeoutError("read timed out"), R),
    (ConnectionError("boom"), R),
    (ConnectionResetError(104, "reset by peer"), R),
    (ConnectionRefusedError(111, "refused"), R),
    (ConnectionAbortedError(103, "aborted"), R),
    (BrokenPipeError(32, "broken pipe"), R),
    (ValueError("bad json"), D),
    (FileNotFoundError(2, "no such file"), D),
    (PermissionError(13, "denied"), D),
    (KeyError("x"), D),
    (RuntimeError("???"), U),
    (Exception("???"), U),
])
def test_seed_exceptions(exc: BaseException, expected: FailureClass) -> None:
    assert classify_exception(exc) is expected


def test_subclasses_are_classified_by_their_nearest_known_base() -> None:
    class ProxyTimeout(TimeoutError):
        pass

    class BadArgs(ValueError):
        pass

    assert classify_exception(ProxyTimeout()) is R
    assert classify_exception(BadArgs()) is D


def test_exception_names_lists_the_class_then_its_bases() -> None:
    assert exception_names(ConnectionResetError()) == (
        "ConnectionResetError", "ConnectionError", "OSError", "Exception")


@pytest.mark.parametrize("name", ["IncompleteStream", "CorruptStream",
                                  "ServerDisconnectedError", "ClientConnectorError"])
def test_broken_streams_and_connections_reported_by_name_are_retryable(name: str) -> None:
    assert classify(CallFailure(exception=(name,))) is R


@pytest.mark.parametrize("name", ["MalformedArguments", "UnknownTool", "SchemaViolation"])
def test_bad_tool_calls_are_deterministic(name: str) -> None:
    assert classify(CallFailure(exception=(name,))) is D


def test_a_failure_with_no_status_and_no_known_shape_is_unknown() -> None:
    assert classify(CallFailure()) is U
    assert classify(CallFailure(message="something odd", exception=("WeirdError",))) is U


def test_a_non_error_status_falls_back_to_the_exception() -> None:
    assert classify(CallFailure(status=200, exception=("IncompleteStream",))) is R
    assert classify(CallFailure(status=302)) is U


# -- Retry-After ---------------------------------------------------------------------

@pytest.mark.parametrize(("value", "expected"), [
    ("30", 30.0), (" 2.5 ", 2.5), ("0", 0.0), ("-4", 0.0),
    ("", None), ("   ", None), (None, None), ("soon", None), ("nan", None), ("inf", None),
])
def test_retry_after_as_seconds(value: str | None, expected: float | None) -> None:
    assert parse_retry_after(value, now_epoch=NOW) == expected


def test_retry_after_as_an_http_date() -> None:
    date = email.utils.formatdate(NOW + 90, usegmt=True)
    assert parse_retry_after(date, now_epoch=NOW) == pytest.approx(90.0)


def test_retry_after_as_an_http_date_in_the_past_is_zero() -> None:
    date = email.utils.formatdate(NOW - 90, usegmt=True)
    assert parse_retry_after(date, now_epoch=NOW) == 0.0


def test_retry_after_header_name_is_case_insensitive() -> None:
    assert retry_after_of({"retry-after": "12"}, None, now_epoch=NOW) == 12.0
    assert retry_after_of({"Retry-After": "12"}, None, now_epoch=NOW) == 12.0


def test_retry_after_header_wins_over_the_body() -> None:
    assert retry_after_of({"Retry-After": "12"}, {"retry_after": 99}, now_epoch=NOW) == 12.0


def test_retry_after_from_the_body_when_the_header_is_absent_or_unreadable() -> None:
    assert retry_after_of({}, {"retry_after": 7}, now_epoch=NOW) == 7.0
    assert retry_after_of({"Retry-After": "soon"}, {"retry_after": 7},
                          now_epoch=NOW) == 7.0


@pytest.mark.parametrize(("body", "expected"), [
    ({"retry_after": 3}, 3.0),
    ({"retry_after": 1.5}, 1.5),
    ({"retry_after": "4"}, 4.0),
    ({"error": {"retry_after": 6}}, 6.0),
    ({"error": {"message": "slow down", "retry_after": "8"}}, 8.0),
    ({"retry_after": -3}, 0.0),
    ({"retry_after": True}, None),
    ({"error": "rate limited"}, None),
    ({}, None),
    ("retry_after: 5", None),
    (None, None),
])
def test_retry_after_in_the_body(body: object, expected: float | None) -> None:
    assert retry_after_from_body(body, now_epoch=NOW) == expected


_RETRY_INFO = "type.googleapis.com/google.rpc.RetryInfo"


@pytest.mark.parametrize(("body", "expected"), [
    ({"error": {"code": 429, "status": "RESOURCE_EXHAUSTED", "details": [
        {"@type": "type.googleapis.com/google.rpc.QuotaFailure", "violations": []},
        {"@type": _RETRY_INFO, "retryDelay": "39s"}]}}, 39.0),
    ({"error": {"details": [{"@type": _RETRY_INFO, "retryDelay": "0.4s"}]}}, 0.4),
    ([{"error": {"details": [{"@type": _RETRY_INFO, "retryDelay": "2s"}]}}], 2.0),
    ({"error": {"retry_after": 5, "details": [{"@type": _RETRY_INFO,
                                                "retryDelay": "9s"}]}}, 5.0),
    ({"error": {"details": [{"@type": _RETRY_INFO, "retryDelay": "soon"}]}}, None),
    ({"error": {"details": [{"@type": "type.googleapis.com/google.rpc.Help"}]}}, None),
    ({"error": {"details": "39s"}}, None),
])
def test_a_google_retry_info_delay_in_the_body_is_a_retry_after(
        body: object, expected: float | None) -> None:
    assert retry_after_from_body(body, now_epoch=NOW) == expected


@pytest.mark.parametrize(("error_type", "expected"), [
    ("RESOURCE_EXHAUSTED", FailureClass.RETRYABLE), ("UNAVAILABLE", FailureClass.RETRYABLE),
    ("INTERNAL", FailureClass.RETRYABLE), ("INVALID_ARGUMENT", FailureClass.DETERMINISTIC),
    ("PERMISSION_DENIED", FailureClass.DETERMINISTIC)])
def test_google_status_words_in_a_stream_error_are_classified(
        error_type: str, expected: FailureClass) -> None:
    assert classify(CallFailure(error_type=error_type, exception=("StreamError",))) \
        is expected


def test_retry_after_in_the_body_as_an_http_date() -> None:
    body = {"error": {"retry_after": email.utils.formatdate(NOW + 20, usegmt=True)}}
    assert retry_after_from_body(body, now_epoch=NOW) == pytest.approx(20.0)


# -- context overflow ----------------------------------------------------------------

@pytest.mark.parametrize(("status", "body"), [
    (400, '{"error": {"code": "context_length_exceeded", "message": "..."}}'),
    (400, "This model's maximum context length is 128000 tokens"),
    (400, "prompt is too long: 210000 tokens > 200000 maximum"),
    (413, "Request too large for the context window"),
    (400, "The input token count (1200000) exceeds the maximum number of tokens allowed "
          "(1048576)."),  # Gemini
])
def test_a_context_overflow_is_detected(status: int, body: str) -> None:
    assert is_context_overflow(status, body)


@pytest.mark.parametrize(("status", "body"), [
    (400, "invalid value for temperature"),
    (413, "Request Entity Too Large"),
    (429, "context length"),  # a rate limit is not an overflow, whatever it says
    (None, "maximum context length"),
    (500, "context_length_exceeded"),
])
def test_other_errors_are_not_context_overflows(status: int | None, body: str) -> None:
    assert not is_context_overflow(status, body)


def test_describe_names_status_type_exception_and_message() -> None:
    failure = CallFailure(status=429, error_type="rate_limit_error",
                          exception=("ClientResponseError",), message="slow down")
    assert failure.describe() == "HTTP 429: rate_limit_error: ClientResponseError: slow down"
    assert CallFailure().describe() == "unknown failure"


# -- secrets ---------------------------------------------------------------------------

def test_a_redactor_replaces_every_value_it_holds_longest_first() -> None:
    redactor = Redactor(["tok_live_abcdef", "tok_live_abcdef_and_more", None, ""])
    assert redactor.held("a tok_live_abcdef_and_more b tok_live_abcdef") == \
        "a [redacted] b [redacted]"
    assert redactor.held("nothing here") == "nothing here"


def test_a_redactor_finds_a_value_as_a_json_body_escapes_it() -> None:
    secret = 'k3y"with/quote\\and-backslash'
    body = json.dumps({"echo": secret})
    assert secret not in body  # escaped on the wire
    assert Redactor([secret]).held(body) == '{"echo": "[redacted]"}'


def test_a_redactor_skips_values_shorter_than_its_minimum() -> None:
    redactor = Redactor(["x", "dummy", "a-real-token-123"], min_chars=8)
    assert redactor.held("x dummy a-real-token-123") == "x dummy [redacted]"
    assert not Redactor(["x"], min_chars=8)
    assert Redactor(["abcdefgh"], min_chars=8)


def test_redact_also_removes_what_looks_like_a_credential() -> None:
    redactor = Redactor(["held-secret-1"])
    assert redactor.redact("held-secret-1 Authorization: Bearer other") == \
        "[redacted] Authorization: Bearer [redacted]"
    assert "held" not in repr(redactor)
