"""The webhook rules: the signature, the event patterns, and what each answer means."""

from __future__ import annotations

import base64
import hashlib
import hmac

import pytest

from turnkeeper.policy import webhooks as wh

# The test vector published with the Standard Webhooks specification (and used by its
# libraries' own tests).
VECTOR_SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
VECTOR_ID = "msg_p5jXN8AQM9LWM0D4loKWxJek"
VECTOR_TS = 1614265330
VECTOR_BODY = b'{"test": 2432232314}'
VECTOR_SIGNATURE = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="


def top(a: float, b: float) -> float:
    return b


def bottom(a: float, b: float) -> float:
    return a


def test_signature_matches_the_standard_webhooks_vector() -> None:
    key = wh.decode_secret(VECTOR_SECRET)
    assert wh.sign(key, VECTOR_ID, VECTOR_TS, VECTOR_BODY) == VECTOR_SIGNATURE


def test_secret_is_accepted_without_its_prefix() -> None:
    assert wh.decode_secret(VECTOR_SECRET[len("whsec_"):]) == wh.decode_secret(VECTOR_SECRET)


@pytest.mark.parametrize("secret", ["whsec_not base64!", "whsec_", "", "abc"])
def test_secret_that_is_not_base64_of_a_key_is_refused(secret: str) -> None:
    with pytest.raises(ValueError):
        wh.decode_secret(secret)


def test_headers_carry_id_timestamp_and_signature_of_that_timestamp() -> None:
    key = b"k" * 32
    got = wh.headers(key, "msg_7", 1700000000, b"{}")
    assert got["webhook-id"] == "msg_7"
    assert got["webhook-timestamp"] == "1700000000"
    expected = base64.b64encode(hmac.new(key, b"msg_7.1700000000.{}", hashlib.sha256)
                                .digest()).decode()
    assert got["webhook-signature"] == f"v1,{expected}"


def test_message_id_is_stable_per_event() -> None:
    assert wh.message_id(42) == wh.message_id(42) == "msg_42"


@pytest.mark.parametrize("pattern", ["turn.finished", "turn.*", "*", "webhook.failed",
                                     "tool.outcome_unknown"])
def test_valid_patterns(pattern: str) -> None:
    assert wh.valid_pattern(pattern)


@pytest.mark.parametrize("pattern", ["", "turn*", "*.finished", "turn..x", "turn.fin*",
                                     "Turn finished", "turn.", "**"])
def test_invalid_patterns(pattern: str) -> None:
    assert not wh.valid_pattern(pattern)


def test_route_takes_exact_names_and_trailing_wildcards() -> None:
    hooks = [("a", ["turn.finished"]), ("b", ["turn.*"]), ("c", ["*"]), ("d", ["tool.*"])]
    assert wh.route(hooks, "turn.finished") == ("a", "b", "c")
    assert wh.route(hooks, "turn.queued") == ("b", "c")
    assert wh.route(hooks, "tool.result") == ("c", "d")
    assert wh.route(hooks, "turnover") == ("c",)


def test_2xx_is_delivered() -> None:
    for status in (200, 201, 204, 299):
        assert wh.decide(status=status, attempts=1, max_attempts=3,
                         rand=top) == wh.Delivered()


@pytest.mark.parametrize("status", [500, 502, 503, 504, 408, 429, None])
def test_later_answers_are_retried_with_growing_jittered_delay(status: int | None) -> None:
    first = wh.decide(status=status, attempts=1, max_attempts=5, rand=top)
    third = wh.decide(status=status, attempts=3, max_attempts=5, rand=top)
    assert isinstance(first, wh.RetryIn) and isinstance(third, wh.RetryIn)
    assert first.delay_s == wh.BASE_DELAY_S
    assert third.delay_s == wh.BASE_DELAY_S * 4
    low = wh.decide(status=status, attempts=3, max_attempts=5, rand=bottom)
    assert low == wh.RetryIn(0.0, low.reason if isinstance(low, wh.RetryIn) else "")


def test_delay_is_capped() -> None:
    got = wh.decide(status=503, attempts=40, max_attempts=50, rand=top)
    assert got == wh.RetryIn(wh.MAX_DELAY_S, "HTTP 503")


@pytest.mark.parametrize("status", [400, 401, 403, 404, 410, 413, 422, 301, 302])
def test_refusals_and_redirects_give_up_at_once(status: int) -> None:
    got = wh.decide(status=status, attempts=1, max_attempts=10, rand=top)
    assert isinstance(got, wh.GiveUp) and f"HTTP {status}" in got.reason


def test_last_attempt_gives_up() -> None:
    got = wh.decide(status=500, attempts=3, max_attempts=3, rand=top)
    assert isinstance(got, wh.GiveUp) and "3 attempts" in got.reason
    got = wh.decide(status=None, error="ConnectionRefusedError", attempts=1,
                    max_attempts=1, rand=top)
    assert isinstance(got, wh.GiveUp) and "ConnectionRefusedError" in got.reason


def test_retry_after_is_a_floor_up_to_its_cap() -> None:
    got = wh.decide(status=429, attempts=1, max_attempts=3, retry_after_s=120.0, rand=top)
    assert got == wh.RetryIn(120.0, "HTTP 429")
    got = wh.decide(status=429, attempts=1, max_attempts=3, retry_after_s=0.5, rand=top)
    assert got == wh.RetryIn(wh.BASE_DELAY_S, "HTTP 429")
    got = wh.decide(status=503, attempts=1, max_attempts=3, retry_after_s=1e9, rand=top)
    assert got == wh.RetryIn(wh.MAX_RETRY_AFTER_S, "HTTP 503")


def test_over_cap_gives_up_the_excess() -> None:
    assert wh.over_cap(10, 10) == 0
    assert wh.over_cap(3, 10) == 0
    assert wh.over_cap(13, 10) == 3


def test_lease_outlasts_the_attempt() -> None:
    assert wh.lease_s(10.0) > 10.0
