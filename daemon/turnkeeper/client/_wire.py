"""What the blocking and the async client share: the requests they send, how they read
an answer into a result or an error, and when a submit or a stream tries again. Both
clients only move bytes; nothing here does I/O."""

from __future__ import annotations

import json
import os
from urllib.parse import quote, urlencode

from turnkeeper.client.errors import Retryable, Unreachable, error_for

TYPE_CHECKING = False  # not `typing.TYPE_CHECKING`: importing typing costs start-up time
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

# A submit that meets a 503, a 507 or no daemon is sent again (with the same key) for this
# long by default; a stream that drops is reopened for this long.
SUBMIT_RETRY_FOR_S = 30.0
RECONNECT_FOR_S = 60.0
# Backoff between attempts when the daemon gives no Retry-After (no daemon answered).
FIRST_DELAY_S = 0.1
MAX_DELAY_S = 5.0
# `wait` long-polls in pieces of at most this long (the daemon caps one at an hour).
WAIT_PIECE_S = 30.0
TERMINAL_EVENT = "turn.finished"


def new_idempotency_key() -> str:
    """A key no other submit has: 128 random bits."""
    return "tkc-" + os.urandom(16).hex()


def submit_body(message: str, *, session: str | None, budget: dict[str, Any] | None,
                profile: str | None, model: str | None, deadline: float | str | None,
                idempotency_key: str, traceparent: str | None = None,
                agent: str | None = None,
                output_schema: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"message": message, "idempotency_key": idempotency_key}
    for name, value in (("session", session), ("budget", budget), ("profile", profile),
                        ("model", model), ("deadline", deadline),
                        ("traceparent", traceparent), ("agent", agent),
                        ("output_schema", output_schema)):
        if value is not None:
            body[name] = value
    return body


def turn_path(turn_id: str, tail: str = "") -> str:
    return f"/v1/turns/{quote(turn_id, safe='')}{tail}"


def approval_body(call_id: str, decision: str, *, reason: str = "",
                  arguments: dict[str, Any] | None = None) -> dict[str, Any]:
    """`POST /v1/turns/{id}/approvals`'s body."""
    body: dict[str, Any] = {"call_id": call_id, "decision": decision}
    if reason:
        body["reason"] = reason
    if arguments is not None:
        body["arguments"] = arguments
    return body


def events_path(turn_id: str | None, *, after: int | None, types: str | None) -> str:
    """The stream to (re)open: a turn's (all of its events, then live; the client drops
    those it has seen by `seq`) or every event after `after`."""
    if turn_id is not None:
        return turn_path(turn_id, "/events")
    query = {k: v for k, v in (("after", after), ("type", types)) if v is not None}
    return "/v1/events" + ("?" + urlencode(query) if query else "")


def type_filter(spec: str | None) -> Callable[[str], bool]:
    """As the daemon reads `type=`: each an exact event type, or a prefix ending in a dot
    (`turn.,tool.call`); None or empty: every type."""
    parts = [t for t in (spec or "").split(",") if t]
    exact = {t for t in parts if not t.endswith(".")}
    prefixes = tuple(t for t in parts if t.endswith("."))
    if not parts:
        return lambda _type: True
    return lambda t: t in exact or t.startswith(prefixes)


def encode(body: Any) -> bytes:
    return b"" if body is None else json.dumps(body).encode()


def decode(raw: bytes) -> Any:
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return {"error": raw.decode(errors="replace")}


def request_head(method: str, target: str, body: bytes | None,
                 headers: dict[str, str] | None = None) -> bytes:
    head = (f"{method} {target} HTTP/1.1\r\nHost: turnkeeper\r\nConnection: close\r\n"
            "Accept: application/json\r\n")
    for name, value in (headers or {}).items():
        head += f"{name}: {value}\r\n"
    if body is not None:
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    elif method not in ("GET", "HEAD"):
        head += "Content-Length: 0\r\n"
    return (head + "\r\n").encode("latin-1")


def checked(status: int, headers: dict[str, str], data: Any) -> Any:
    """The answer's JSON when it is a 2xx, else the error it is."""
    if 200 <= status < 300:
        return data
    raise error_for(status, data, headers)


def retry_delay(error: BaseException, attempt: int, left_s: float) -> float | None:
    """How long to wait before sending a submit again after `error` (its `attempt`th
    failure), or None to give up: only a 503, a 507 or no daemon are tried again, after
    the daemon's Retry-After or a backoff when it gave none, and never past the time
    left."""
    if isinstance(error, Retryable):
        delay = max(error.retry_after, FIRST_DELAY_S)
    elif isinstance(error, Unreachable):
        delay = reconnect_delay(attempt)
    else:
        return None
    return delay if delay < left_s else None


def reconnect_delay(attempt: int) -> float:
    """0.1 s, doubling, at most 5 s."""
    return min(MAX_DELAY_S, FIRST_DELAY_S * float(2 ** min(attempt, 10)))


class Reconnects:
    """When a dropped event stream is opened again: a growing delay from the drop, and
    `Unreachable` once it has stayed down `within_s` (an event read resets both)."""

    def __init__(self, socket: object, within_s: float) -> None:
        self._socket = socket
        self._within_s = within_s
        self._dropped_at: float | None = None
        self._attempt = 0

    def connected(self) -> None:
        self._dropped_at, self._attempt = None, 0

    def delay(self, now: float) -> float:
        """How long to wait before the next try; raises when the time is up."""
        if self._dropped_at is None:
            self._dropped_at = now
        if now - self._dropped_at >= self._within_s:
            raise Unreachable(f"control socket {self._socket}: the event stream could "
                              f"not be opened again within {self._within_s} s")
        delay = reconnect_delay(self._attempt)
        self._attempt += 1
        return delay


# How many of the latest seqs a followed stream remembers to give none twice: live
# events do not always come in the order of their numbers (a turn's `turn.queued` and
# `turn.finished` go out once they are stored), and a reopened stream sends some again.
SEEN_WINDOW = 20_000
DROPPED = "stream.dropped"  # the line a stream the daemon dropped ends with


class StreamState:
    """What a followed stream has seen: the seqs (the latest `SEEN_WINDOW`), the highest,
    where to reopen it (after the highest, or where the daemon said when it dropped the
    stream for falling behind), and whether it ended as a turn's stream ends (with its
    `turn.finished`), so a drop is told from an end."""

    def __init__(self, turn_id: str | None, after: int | None) -> None:
        self.turn_id = turn_id
        self.last_seq = after or 0
        self.started = after is not None
        self.last_type = ""
        self.resume_after: int | None = None
        self._seen: set[int] = set()
        self._order: list[int] = []
        self._floor = after or 0  # every seq up to it counts as seen

    def path(self, types: str | None) -> str:
        after = self.last_seq if self.resume_after is None else self.resume_after
        return events_path(self.turn_id, after=after if self.started else None,
                           types=types)

    def take(self, raw: dict[str, Any]) -> bool:
        """Whether the event is new (a reopened stream sends a turn's events again). The
        line a dropped stream ends with is no event: it says where to reopen."""
        if raw.get("type") == DROPPED:
            after = raw.get("after")
            if isinstance(after, int):
                self.resume_after, self.started = after, True
            return False
        seq = raw.get("seq")
        if isinstance(seq, int):
            if seq <= self._floor or seq in self._seen:
                return False
            self._remember(seq)
            self.last_seq, self.started = max(seq, self.last_seq), True
        self.last_type = str(raw.get("type", ""))
        return True

    def _remember(self, seq: int) -> None:
        self._seen.add(seq)
        self._order.append(seq)
        if len(self._order) > 2 * SEEN_WINDOW:
            old = self._order[:SEEN_WINDOW]
            self._floor = max(self._floor, *old)
            self._seen.difference_update(old)
            del self._order[:SEEN_WINDOW]

    @property
    def ended(self) -> bool:
        """A turn's stream closes after its `turn.finished`; any other close is a drop
        (the daemon stopped, the connection broke) and the stream is opened again."""
        return self.turn_id is not None and self.last_type == TERMINAL_EVENT
