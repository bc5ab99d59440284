"""What every control route shares: the app's keys, JSON errors, strict bodies read
within a time limit, query numbers in range, and the per-client caps.

Every error is JSON: `{"error": "...", "field": "..."}` where a field is to blame. A
handler raises (`BadRequest` for its input, the supervisor's `Refused` errors for the
rest) and one middleware (`refusals`) answers: no handler maps an error itself. Input
is strict: a number is a JSON number, finite, never a string or a boolean (a
`"deadline": Infinity` once queued a turn that never ran); a body is read within
`daemon.body_read_timeout` or the connection is closed (a client trickling a body would
hold a descriptor for ever).
"""

from __future__ import annotations

import contextlib
import json
import resource
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import anyio
import structlog
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from pydantic import ValidationError

from turnkeeper import jsonwire
from turnkeeper.config import DaemonConfig
from turnkeeper.control.bodies import Body
from turnkeeper.errors import Refused
from turnkeeper.policy.admission import ControlLimits, default_max_connections
from turnkeeper.supervisor import (
    Supervisor,
)

log = structlog.get_logger("turnkeeper.control")

B = TypeVar("B", bound=Body)

SUPERVISOR: web.AppKey[Supervisor] = web.AppKey("supervisor", Supervisor)
# Event followers open per peer uid (-1: a peer without credentials), for the cap.
FOLLOWERS: web.AppKey[dict[int, int]] = web.AppKey("followers", dict)
PEER_UID = "turnkeeper.peer_uid"  # request key: the uid the access check saw


def json_response(data: Any, *, status: int = 200,
                  headers: dict[str, str] | None = None) -> web.Response:
    """`data` as a JSON answer, encoded as the daemon encodes its events (`jsonwire`)."""
    return web.json_response(data, status=status, headers=headers,
                             dumps=jsonwire.dumps_str)


def _encode_in_pieces(data: dict[str, Any]) -> bytes:
    """`data` as JSON, each item of its lists encoded on its own: one encoder call holds
    the GIL until it returns, so a 10 MB answer encoded in one call would stop the event
    loop's thread as surely as encoding it there."""
    parts = []
    for key, value in data.items():
        encoded = (b"[" + b",".join(jsonwire.dumps(item) for item in value) + b"]"
                   if isinstance(value, list) else jsonwire.dumps(value))
        parts.append(jsonwire.dumps(key) + b":" + encoded)
    return b"{" + b",".join(parts) + b"}"


async def large_json_response(data: dict[str, Any], *, status: int = 200) -> web.Response:
    """A JSON answer encoded in a worker thread, in pieces: 10,000 turns (10 MB) encoded
    on the event loop held every running turn up for a tenth of a second or more."""
    body = await anyio.to_thread.run_sync(_encode_in_pieces, data)
    return web.Response(body=body, status=status, content_type="application/json")


def error(status: int, message: str, *, field: str | None = None,
          headers: dict[str, str] | None = None, index: int | None = None) -> web.Response:
    """`index`: the item of a batch at fault."""
    body: dict[str, Any] = {"error": message}
    if field is not None:
        body["field"] = field
    if index is not None:
        body["index"] = index
    return json_response(body, status=status, headers=headers)


class BadRequest(Refused):
    """A request's body or query at fault (400; 408 a body not sent in time, 413 one too
    large). `close`: the connection is closed once answered."""

    def __init__(self, message: str, *, field: str | None = None, status: int = 400,
                 index: int | None = None, close: bool = False) -> None:
        super().__init__(message, status=status, field=field, index=index)
        self.close = close


@web.middleware
async def refusals(request: web.Request,
                   handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                   ) -> web.StreamResponse:
    """Every `Refused` a handler raises, answered the one way: its status, `error`,
    `field` and `index`, and `Retry-After` when it says when to ask again."""
    try:
        return await handler(request)
    except Refused as exc:
        headers = (None if exc.retry_after_s is None
                   else {"Retry-After": f"{exc.retry_after_s:g}"})
        response = error(exc.status, str(exc), field=exc.field, headers=headers,
                         index=exc.index)
        if isinstance(exc, BadRequest) and exc.close:
            response.force_close()  # answered, then closed: not waited for again
        return response


async def _read(request: web.Request) -> bytes:
    """The body, read within `daemon.body_read_timeout`. A client too slow, or gone, has
    its connection closed; leaving mid-body is one log line, not a traceback."""
    sup = request.app[SUPERVISOR]
    raw: bytes | None = None
    try:
        if request.content.is_eof():  # all of it came with the headers: nothing to wait on
            raw = await request.read()
        else:
            with sup.clock.move_on_after(sup.config.daemon.body_read_timeout):
                raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise
    except (ConnectionError, web.HTTPException, HttpProcessingError) as exc:
        # Gone mid-body, or a malformed body framing: one line, no traceback.
        log.info("control.client_left", path=request.path, error=type(exc).__name__)
        raise BadRequest("the body could not be read", field="(body)") from None
    if raw is None:
        log.info("control.body_timeout", path=request.path)
        raise BadRequest("the body was not sent in time", field="(body)", status=408,
                         close=True)
    return raw


async def read_json(request: web.Request) -> Any:
    """The body parsed as JSON (`{}` when empty); raises `BadRequest` (400, 408)."""
    raw = await _read(request)
    if not raw:
        return {}
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"body is not valid JSON: {exc}", field="(body)") from None
    except RecursionError:
        raise BadRequest("body is nested too deeply", field="(body)") from None


def validate(model: type[B], data: Any, *, prefix: str = "",
             index: int | None = None) -> B:
    """`data` as a `model`; raises `BadRequest` naming the first field at fault (after
    `prefix`, e.g. `[3].` for the item at `index` 3 of a batch)."""
    where = prefix.rstrip(".") or "(body)"
    if not isinstance(data, dict):
        raise BadRequest(f"{where}: must be a JSON object" if prefix
                         else "body must be a JSON object", field=where, index=index)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        # A field named "" (`{"": 1}`) is named `""`: an empty `field` would name nothing.
        field = prefix + ".".join(str(p) or '""' for p in first["loc"]) if first["loc"] \
            else where
        msg = "unknown field" if first["type"] == "extra_forbidden" else first["msg"]
        raise BadRequest(f"{field}: {msg}", field=field, index=index) from None
    except RecursionError:
        raise BadRequest(f"{where}: nested too deeply", field=where, index=index) from None


async def read_body(request: web.Request, model: type[B]) -> B:
    """The body as a `model`; raises `BadRequest`."""
    return validate(model, await read_json(request))


_limits_cache: tuple[DaemonConfig, ControlLimits] | None = None


def control_limits(daemon: DaemonConfig) -> ControlLimits:
    """The control plane's limits from the `[daemon]` section; `max_connections = 0`
    means a share of this process's descriptor limit."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    max_connections = daemon.max_connections or default_max_connections(
        None if soft == resource.RLIM_INFINITY else soft)
    return ControlLimits(max_connections=max_connections,
                         max_followers_per_client=daemon.max_followers_per_client,
                         max_message_bytes=daemon.max_message_bytes)


def limits_of(request: web.Request) -> ControlLimits:
    """The limits of the config in force, worked out once per config (not per request:
    the descriptor limit is a system call)."""
    global _limits_cache
    daemon = request.app[SUPERVISOR].config.daemon
    cached = _limits_cache
    if cached is None or cached[0] is not daemon:
        cached = _limits_cache = (daemon, control_limits(daemon))
    return cached[1]


def check_size(request: web.Request, field: str, text: str, *,
               index: int | None = None) -> None:
    """Raises `BadRequest` (413) naming `field` when `text` is over
    `daemon.max_message_bytes` (UTF-8)."""
    limits = limits_of(request)
    # A str of n characters is at most 4n bytes in UTF-8: most never need encoding.
    if not limits.message_too_large(4 * len(text)):
        return
    limit = request.app[SUPERVISOR].config.daemon.max_message_bytes
    size = len(text.encode("utf-8", "surrogatepass"))
    if limits.message_too_large(size):
        raise BadRequest(f"{field} is {size} bytes, more than the {limit} allowed "
                         f"(daemon.max_message_bytes)", field=field, status=413, index=index)


@contextlib.contextmanager
def follower(request: web.Request) -> Iterator[bool]:
    """Counts an event follower against its peer's cap; yields False when over it."""
    uid = request.get(PEER_UID, -1)
    followers = request.app[FOLLOWERS]
    if not limits_of(request).admits_follower(followers.get(uid, 0)):
        yield False
        return
    followers[uid] = followers.get(uid, 0) + 1
    try:
        yield True
    finally:
        followers[uid] -= 1
        if not followers[uid]:
            del followers[uid]


def too_many_followers(request: web.Request) -> Refused:
    limit = request.app[SUPERVISOR].config.daemon.max_followers_per_client
    return Refused(f"more than {limit} event streams open for this client "
                   f"(daemon.max_followers_per_client)", status=429, retry_after_s=1)


def query_float(request: web.Request, name: str, default: float | None,
                *, lo: float, hi: float) -> float | None:
    """The query parameter `name` as a number in [lo, hi]; raises `BadRequest`."""
    raw = request.query.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise BadRequest(f"{name} must be a number", field=name) from None
    if not lo <= value <= hi:
        raise BadRequest(f"{name} must be between {lo:g} and {hi:g}", field=name)
    return value


