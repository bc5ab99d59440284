"""Every failed call, model or tool, is classified here before anything counts it.

The input is one value, `CallFailure`, built at the edge by the provider or tool adapter
from what it saw (status, headers, body, transport exception). Nothing else decides
whether a failure is retryable.
"""

from __future__ import annotations

import email.utils
import errno
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class FailureClass(StrEnum):
    RETRYABLE = "retryable"
    DETERMINISTIC = "deterministic"
    UNKNOWN = "unknown"


RETRYABLE_STATUSES = frozenset({408, 409, 425, 429, 500, 502, 503, 504, 529})
# 501 Not Implemented: the server does not do this at all; asking again will not change it.
DETERMINISTIC_STATUSES = frozenset({400, 401, 403, 404, 405, 413, 422, 501})

# Transport exception type names (the class name and its bases, as the adapter reports
# them) that mean the peer did not answer or the connection broke: worth another attempt.
RETRYABLE_EXCEPTIONS = frozenset({
    "TimeoutError", "ConnectionError", "ConnectionResetError", "ConnectionRefusedError",
    "ConnectionAbortedError", "BrokenPipeError", "ServerDisconnectedError",
    "ClientConnectionError", "ClientConnectorError", "ClientOSError", "ClientPayloadError",
    "ServerTimeoutError", "SocketTimeoutError", "ConnectionTimeoutError",
    "IncompleteStream", "CorruptStream", "StalledStream",
    # The route to the peer is down (EHOSTUNREACH, ENETUNREACH): `exception_names` adds
    # this name to an exception that carries, or wraps, one of those errors.
    "NetworkUnreachable",
    # A model call cut by its provider's max_call_seconds, or a stream of keepalives only
    # cut by its idle_timeout (see `call_bound`).
    "CallTimeout", "IdleStream",
})
# Exceptions that say the request itself is wrong: sending it again cannot help.
DETERMINISTIC_EXCEPTIONS = frozenset({
    "ValueError", "TypeError", "KeyError", "FileNotFoundError", "PermissionError",
    "JSONDecodeError", "UnicodeDecodeError", "InvalidURL", "MalformedArguments",
    "UnknownTool", "SchemaViolation",
    # A repeat of a side effect whose outcome is unknown, refused before sending it.
    "OutcomeUnknown",
    # An answer the daemon will not take: a redirect it may not follow (a provider never
    # follows one; an http tool only with follow_redirects), a host outside an http tool's
    # allowed_hosts, a body over its max_response_bytes.
    "RedirectNotFollowed", "HostNotAllowed", "ResponseTooLarge",
})

# The error types (`error.type`, else `error.code`) OpenAI and Anthropic send, for failures
# that carry no HTTP status: an error event inside a started (HTTP 200) stream. With a
# status, the status decides; without one, the type is the server's own word.
RETRYABLE_ERROR_TYPES = frozenset({
    "overloaded_error", "api_error", "rate_limit_error", "rate_limit_exceeded",
    "server_error", "timeout_error", "service_unavailable", "internal_error",
    # Google's status words (Gemini), lowercased
    "resource_exhausted", "unavailable", "internal", "deadline_exceeded",
})
DETERMINISTIC_ERROR_TYPES = frozenset({
    "invalid_request_error", "authentication_error", "permission_error", "not_found_error",
    "request_too_large", "invalid_api_key", "model_not_found", "billing_error",
    "invalid_argument", "permission_denied", "unauthenticated", "not_found",
    "failed_precondition",
})

# What a failure with no status says when a route or a service is down for now, in the
# words the C library, aiohttp and gateways use ("[Errno 113] No route to host", "Service
# Temporarily Unavailable"): worth another attempt, not an unknown.
_RETRYABLE_MESSAGES = re.compile(
    r"no route to host|network is unreachable|host is unreachable|"
    r"\b(?:EHOSTUNREACH|ENETUNREACH)\b|temporarily unavailable",
    re.IGNORECASE,
)

_OVERFLOW_PATTERNS = re.compile(
    r"context_length_exceeded|context length|context window|prompt is too long|"
    r"maximum context|too many tokens|request too large|reduce the length|"
    r"exceeds the maximum number of tokens",
    re.IGNORECASE,
)


# Secrets a server or an exception may echo back: header values of Authorization and
# x-api-key / api-key, and `key=`-style query values (Gemini-style `?key=`, `api_key=`,
# `access_token=`). The provider also removes its own key value before this.
_SECRET_PATTERNS = (
    re.compile(r"(?i)\b(authorization|x-api-key|api-key)(['\"]?\s*[:=]\s*['\"]?)"
               r"(?:(bearer|basic)\s+)?[^\s'\",;}]+"),
    re.compile(r"(?i)([?&](?:key|api_key|apikey|access_token|token)=)[^&\s'\"#]+"),
)


REDACTED = "[redacted]"


def redact_secrets(text: str) -> str:
    """`text` with credential-looking values replaced by [redacted]."""
    text = _SECRET_PATTERNS[0].sub(
        lambda m: f"{m[1]}{m[2]}{m[3] + ' ' if m[3] else ''}{REDACTED}", text)
    return _SECRET_PATTERNS[1].sub(lambda m: f"{m[1]}{REDACTED}", text)


class Redactor:
    """The secret values the daemon holds (API keys, header values and the like), each
    replaced by [redacted] wherever it appears in a text: as it is, and as it reads
    inside a JSON string (a server that echoes it in a JSON body escapes it).

    One per peer for its error messages (a provider's own key and headers), one for
    every tool's results with every secret of the policy. Values shorter than
    `min_chars` are left out: a placeholder key such as "x" or "none" would blank out
    every x of a result, and is nothing to hide."""

    __slots__ = ("_values",)

    def __init__(self, values: Iterable[str | None], *, min_chars: int = 1) -> None:
        forms: set[str] = set()
        for value in values:
            if value and len(value) >= max(1, min_chars):
                forms.add(value)
                forms.add(json.dumps(value)[1:-1])
        # Longest first, so a secret that contains another is replaced whole.
        self._values = tuple(sorted(forms, key=len, reverse=True))

    def __bool__(self) -> bool:
        return bool(self._values)

    def __repr__(self) -> str:
        return f"Redactor(<{len(self._values)} values>)"

    def held(self, text: str) -> str:
        """`text` with every value held replaced."""
        for value in self._values:
            if value in text:
                text = text.replace(value, REDACTED)
        return text

    def redact(self, text: str) -> str:
        """`text` with every value held and anything that looks like a credential
        (`redact_secrets`) replaced: for what a server or an exception says."""
        return redact_secrets(self.held(text))


@dataclass(frozen=True, slots=True)
class CallFailure:
    """What the edge saw of one failed call. `exception` holds the transport exception's
    type names, most specific first (e.g. ("ConnectionResetError", "ConnectionError"))."""

    status: int | None = None
    error_type: str | None = None
    exception: tuple[str, ...] = ()
    message: str = ""
    retry_after_s: float | None = None
    context_overflow: bool = False
    # The daemon's own resources failed (out of file descriptors or memory), not the peer:
    # retried like any transport fault, but never counted against the peer's breaker, so
    # a daemon short of descriptors does not declare its providers down.
    local: bool = False

    def describe(self) -> str:
        """The one-line cause told to people and to the model: `HTTP 429: rate_limit_error:
        <the server's message>`, or `ClientConnectorError: Cannot connect to host ...`.
        The one place a failure is rendered, so the one place secrets are removed."""
        parts = []
        if self.status is not None:
            parts.append(f"HTTP {self.status}")
        if self.error_type:
            parts.append(self.error_type)
        if self.exception:
            parts.append(self.exception[0])
        if self.message:
            parts.append(redact_secrets(" ".join(self.message.split()))[:300])
        return ": ".join(parts) or "unknown failure"

    def to_json(self) -> dict[str, Any]:
        return {"status": self.status, "error_type": self.error_type,
                "exception": list(self.exception), "message": self.message,
                "retry_after_s": self.retry_after_s, "context_overflow": self.context_overflow,
                "local": self.local}


def redirect_refused(who: str, status: int, target: str | None, why: str) -> CallFailure:
    """A 3xx answer that is not followed: deterministic (the same request gets the same
    answer), naming where it pointed. Following it would send the request (its body, its
    credentials) to wherever the answer says, and take that host's answer as this one's."""
    where = f"redirect to {target}" if target else "redirect with no Location"
    return CallFailure(status=status, exception=("RedirectNotFollowed",),
                       message=f"{who}: HTTP {status} {where} not followed ({why})")


def exception_names(exc: BaseException) -> tuple[str, ...]:
    """The exception's class name and those of its bases up to BaseException, then
    "NetworkUnreachable" when it is, or wraps, an unreachable host or network (which a
    bare OSError, or another library's wrapper of one, would not say by its name)."""
    names = tuple(k.__name__ for k in type(exc).__mro__ if k not in (object, BaseException))
    return (*names, "NetworkUnreachable") if _wraps_errno(exc, UNREACHABLE_ERRNOS) else names


# Errors that say this process ran out of something, whoever it was talking to.
LOCAL_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
# Errors that say no route leads to the peer: a network fault, worth another attempt.
UNREACHABLE_ERRNOS = frozenset({errno.EHOSTUNREACH, errno.ENETUNREACH})


def local_exhaustion(exc: BaseException) -> bool:
    """True when `exc` (or what it wraps) is this process running out of descriptors,
    buffers or memory."""
    return _wraps_errno(exc, LOCAL_ERRNOS)


def _wraps_errno(exc: BaseException, errnos: frozenset[int]) -> bool:
    """True when `exc`, or what it wraps, is an OSError with one of `errnos`: aiohttp
    keeps the OSError of a failed connect in `os_error` and chains it as the cause."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in errnos:
            return True
        todo += [e.__cause__, e.__context__, getattr(e, "os_error", None)]
    return False


def classify(failure: CallFailure) -> FailureClass:
    """Status first (it is the server's own word), then the error type of a failure that
    has no status (an error event inside a stream), then the transport exception, then
    words of the message that say a route or a service is down for now, then unknown. A
    context overflow never reaches here as a failure: it is a rebuild."""
    if failure.status is not None:
        if failure.status in RETRYABLE_STATUSES:
            return FailureClass.RETRYABLE
        if failure.status in DETERMINISTIC_STATUSES:
            return FailureClass.DETERMINISTIC
        if 500 <= failure.status < 600:
            return FailureClass.RETRYABLE
        if 400 <= failure.status < 500:
            return FailureClass.DETERMINISTIC
    if failure.error_type:
        error_type = failure.error_type.lower()
        if error_type in RETRYABLE_ERROR_TYPES:
            return FailureClass.RETRYABLE
        if error_type in DETERMINISTIC_ERROR_TYPES:
            return FailureClass.DETERMINISTIC
    for name in failure.exception:
        if name in RETRYABLE_EXCEPTIONS:
            return FailureClass.RETRYABLE
        if name in DETERMINISTIC_EXCEPTIONS:
            return FailureClass.DETERMINISTIC
    if failure.message and _RETRYABLE_MESSAGES.search(failure.message):
        return FailureClass.RETRYABLE
    return FailureClass.UNKNOWN


def parse_retry_after(value: str | None, *, now_epoch: float) -> float | None:
    """Retry-After as delta-seconds or an HTTP date; None when absent or unreadable.
    Negative and past values clamp to 0."""
    if value is None:
        return None
    text = value.strip()
    if not text:
        return None
    try:
        seconds = float(text)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(text)
        except (TypeError, ValueError, IndexError):
            return None
        if when is None:
            return None
        seconds = when.timestamp() - now_epoch
    if seconds != seconds or seconds == float("inf"):  # NaN or inf
        return None
    return max(0.0, seconds)


def retry_after_from_body(body: object, *, now_epoch: float) -> float | None:
    """`retry_after` at the top of a JSON body or under `error`, else the `retryDelay` of
    a Google `RetryInfo` in `error.details` ("39s", a protobuf Duration). A body that is
    a one-element list (how Gemini's stream answers an error) is read by its element."""
    if isinstance(body, list) and len(body) == 1:
        body = body[0]
    if not isinstance(body, Mapping):
        return None
    candidates: list[object] = [body.get("retry_after")]
    err = body.get("error")
    if isinstance(err, Mapping):
        candidates.append(err.get("retry_after"))
        candidates.append(_retry_info_delay(err.get("details")))
    for c in candidates:
        if isinstance(c, bool):
            continue
        if isinstance(c, int | float):
            return max(0.0, float(c))
        if isinstance(c, str):
            parsed = parse_retry_after(c, now_epoch=now_epoch)
            if parsed is not None:
                return parsed
    return None


def retry_after_of(headers: Mapping[str, str], body: object, *,
                   now_epoch: float) -> float | None:
    """The header wins; the body is the fallback. Header names are case-insensitive."""
    for k, v in headers.items():
        if k.lower() == "retry-after":
            parsed = parse_retry_after(v, now_epoch=now_epoch)
            if parsed is not None:
                return parsed
    return retry_after_from_body(body, now_epoch=now_epoch)


def _retry_info_delay(details: object) -> str | None:
    """The seconds of the first `google.rpc.RetryInfo` among `details`, as text."""
    if not isinstance(details, list):
        return None
    for d in details:
        if isinstance(d, Mapping) and str(d.get("@type", "")).endswith("google.rpc.RetryInfo"):
            delay = d.get("retryDelay")
            if isinstance(delay, str) and delay.endswith("s"):
                return delay[:-1]
    return None


def is_context_overflow(status: int | None, body_text: str) -> bool:
    """A 400/413 whose body says the prompt does not fit the model's context."""
    return status in (400, 413) and bool(_OVERFLOW_PATTERNS.search(body_text))
