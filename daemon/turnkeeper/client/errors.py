"""What a call of `turnkeeper.client` raises: one tree, so an application catches what it
can act on (`Overloaded`: wait `retry_after` seconds; `InvalidRequest`: fix `field`)."""

from __future__ import annotations

from turnkeeper.errors import TurnkeeperError

TYPE_CHECKING = False  # not `typing.TYPE_CHECKING`: importing typing costs start-up time
if TYPE_CHECKING:
    from typing import Any


class ClientError(TurnkeeperError):
    """The base of every error the client raises."""


class Unreachable(ClientError):
    """Nothing answers on the socket (no daemon, or it is restarting), or the connection
    broke before an answer came."""


class WaitTimedOut(ClientError, TimeoutError):
    """`wait` ran out of time before the turn ended."""


class APIError(ClientError):
    """The daemon answered with an error: its HTTP `status`, its sentence (`message`),
    the request's `field` at fault when it names one, and the whole JSON `body`."""

    def __init__(self, status: int, message: str, *, field: str | None = None,
                 body: Any = None) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status, self.message, self.field, self.body = status, message, field, body


class InvalidRequest(APIError):
    """400, 413 or 422: the request itself is wrong; `field` names the part."""


class TurnNotFound(APIError):
    """404: no such turn (or dead letter)."""


class Conflict(APIError):
    """409: the turn cannot take this now (it has finished, asked no question, is not a
    dead letter)."""


class Retryable(APIError):
    """An answer that asks to be sent again later: after `retry_after` seconds."""

    def __init__(self, status: int, message: str, *, retry_after: float,
                 field: str | None = None, body: Any = None) -> None:
        super().__init__(status, message, field=field, body=body)
        self.retry_after = retry_after


class Overloaded(Retryable):
    """503: the queue is full, the daemon is starting, stopping or short of CPU; 429:
    too many streams or messages waiting."""


class StoreUnavailable(Retryable):
    """507: the daemon could not keep the submit (its state store cannot be written);
    nothing was queued."""


def retry_after_of(headers: dict[str, str], default: float = 1.0) -> float:
    try:
        return max(0.0, float(headers.get("retry-after", default)))
    except ValueError:
        return default


def error_for(status: int, body: Any, headers: dict[str, str]) -> APIError:
    """The error for an answer that is not a 2xx."""
    message = body.get("error") if isinstance(body, dict) else None
    text = str(message if message is not None else body)
    field = body.get("field") if isinstance(body, dict) else None
    field = field if isinstance(field, str) else None
    if status in (503, 429):
        return Overloaded(status, text, retry_after=retry_after_of(headers), field=field,
                          body=body)
    if status == 507:
        return StoreUnavailable(status, text, retry_after=retry_after_of(headers),
                                field=field, body=body)
    if status == 404:
        return TurnNotFound(status, text, field=field, body=body)
    if status == 409:
        return Conflict(status, text, field=field, body=body)
    if status in (400, 413, 422):
        return InvalidRequest(status, text, field=field, body=body)
    return APIError(status, text, field=field, body=body)
