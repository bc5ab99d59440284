"""Webhooks: which events go to which webhook, how a delivery is signed, and what each
answer of the receiver means (delivered, try again later, give up).

A delivery is signed as the Standard Webhooks specification says, so a receiver can
check it with any of that specification's libraries: the secret is `whsec_` followed by
base64 (the prefix is optional here), the signed content is `{id}.{timestamp}.{body}`,
and the `webhook-signature` header is `v1,` and the base64 of its HMAC-SHA256.

What an answer means:

- a 2xx: delivered; never sent again;
- 408, 429, a 5xx, no answer at all (refused, reset, timed out): tried again after a
  jittered, growing wait (full jitter: `uniform(0, min(MAX_DELAY_S, BASE_DELAY_S *
  2**n))` before retry n), a `Retry-After` being a floor on it (up to
  MAX_RETRY_AFTER_S), until the webhook's `max_attempts`;
- anything else (a 3xx, which is never followed, 410 Gone and every other 4xx): the
  receiver said the delivery is wrong or unwanted, and sending it again would get the
  same answer: given up at once.

A delivery given up stays in the outbox as failed (status shows it, an event
`webhook.failed` reports it); the outbox of a webhook holds at most its `max_pending`
deliveries waiting, and past that the oldest ones are given up (`over_cap`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from turnkeeper.policy.backoff import Backoff, Rand

SECRET_PREFIX = "whsec_"
SIGNATURE_VERSION = "v1"
# The retry curve of every webhook: a receiver back within seconds is sent to again
# within seconds; one down for long is asked every 10 minutes at most.
BASE_DELAY_S = 2.0
MAX_DELAY_S = 600.0
# A Retry-After longer than this is taken as this: the receiver is still asked again.
MAX_RETRY_AFTER_S = 3600.0
# Answers that say "later", not "no".
RETRY_STATUSES = frozenset({408, 429})

_BACKOFF = Backoff(base_delay_s=BASE_DELAY_S, max_delay_s=MAX_DELAY_S, jitter="full")


def decode_secret(text: str) -> bytes:
    """The key of a Standard Webhooks secret: `whsec_` (optional) then base64. Raises
    ValueError when it is not base64 or decodes to nothing."""
    raw = text.strip()
    if raw.startswith(SECRET_PREFIX):
        raw = raw[len(SECRET_PREFIX):]
    try:
        key = base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("not base64: a Standard Webhooks secret is whsec_ followed by the "
                         "base64 of the key") from None
    if not key:
        raise ValueError("the secret decodes to an empty key")
    return key


def message_id(seq: int) -> str:
    """The `webhook-id` of the delivery of event `seq`: the same on every attempt, so a
    receiver drops a delivery it already took."""
    return f"msg_{seq}"


def sign(key: bytes, msg_id: str, timestamp: int, body: bytes) -> str:
    """The `webhook-signature` header: `v1,` and the base64 HMAC-SHA256, under `key`, of
    `{msg_id}.{timestamp}.{body}`."""
    content = f"{msg_id}.{timestamp}.".encode() + body
    digest = hmac.new(key, content, hashlib.sha256).digest()
    return f"{SIGNATURE_VERSION},{base64.b64encode(digest).decode()}"


def headers(key: bytes, msg_id: str, timestamp: int, body: bytes) -> dict[str, str]:
    """The headers of one attempt: its id, the attempt's time and its signature."""
    return {"webhook-id": msg_id, "webhook-timestamp": str(timestamp),
            "webhook-signature": sign(key, msg_id, timestamp, body),
            "content-type": "application/json"}


def valid_pattern(pattern: str) -> bool:
    """An event type (`turn.finished`), or a prefix of one ending in `*` (`turn.*`,
    `*` for every type)."""
    body = pattern[:-1] if pattern.endswith("*") else pattern
    if "*" in body:
        return False
    if not body:
        return pattern == "*"
    parts = body.split(".")
    if pattern.endswith("*"):
        if parts[-1] != "":
            return False  # `turn*`: a wildcard stands for whole names only
        parts = parts[:-1]
    return bool(parts) and all(p and all(c.isalnum() or c == "_" for c in p) for p in parts)


def matches(patterns: Iterable[str], event_type: str) -> bool:
    """Whether one of `patterns` takes `event_type`."""
    for p in patterns:
        if p == event_type or (p.endswith("*") and event_type.startswith(p[:-1])):
            return True
    return False


def route(webhooks: Sequence[tuple[str, Sequence[str]]], event_type: str) -> tuple[str, ...]:
    """The webhooks (name, patterns) an event of `event_type` goes to, in their order."""
    return tuple(name for name, patterns in webhooks if matches(patterns, event_type))


@dataclass(frozen=True, slots=True)
class Delivered:
    """A 2xx: the delivery is done."""


@dataclass(frozen=True, slots=True)
class RetryIn:
    """Send it again in `delay_s`; `reason` says what the receiver answered."""

    delay_s: float
    reason: str


@dataclass(frozen=True, slots=True)
class GiveUp:
    """Never send it again: `reason` says why (kept with the delivery, failed)."""

    reason: str


Decision = Delivered | RetryIn | GiveUp


def answer_text(status: int | None, error: str | None) -> str:
    return f"HTTP {status}" if status is not None else (error or "no answer")


def decide(*, status: int | None, attempts: int, max_attempts: int,
           retry_after_s: float | None = None, error: str | None = None,
           rand: Rand) -> Decision:
    """What to do after attempt number `attempts` (from 1) of a delivery got `status`
    (None: no answer, `error` says what happened instead)."""
    if status is not None and 200 <= status < 300:
        return Delivered()
    said = answer_text(status, error)
    if status is not None and status not in RETRY_STATUSES and status < 500:
        return GiveUp(f"{said}: the receiver refused the delivery (only 408, 429, a 5xx "
                      "or no answer are tried again)")
    if attempts >= max_attempts:
        return GiveUp(f"{said} after {attempts} attempts (max_attempts {max_attempts})")
    delay = _BACKOFF.delay(attempt=attempts - 1, rand=rand)
    if retry_after_s is not None:
        delay = max(delay, min(retry_after_s, MAX_RETRY_AFTER_S))
    return RetryIn(delay, said)


def over_cap(pending: int, max_pending: int) -> int:
    """How many of a webhook's waiting deliveries to give up (the oldest) so that at
    most `max_pending` wait."""
    return max(0, pending - max_pending)


def lease_s(timeout_s: float) -> float:
    """How long a fleet node holds a delivery it took: its attempt's timeout and a
    margin; past that, another node may send it (a node killed while sending)."""
    return timeout_s + 30.0
