"""The control API: HTTP/1.1 + JSON over the Unix socket.

Handlers validate, call the supervisor, and shape answers; they hold no state. Every
error is JSON: `{"error": "...", "field": "..."}` where a field is to blame.

Input is strict: a number is a JSON number, finite, never a string or a boolean (a
`"deadline": Infinity` once queued a turn that never ran); a body is read within
`daemon.body_read_timeout` or the connection is closed (a client trickling a body would
hold a descriptor for ever).
"""

from __future__ import annotations

import contextlib
import json
import resource
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import structlog
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from anyio.streams.memory import MemoryObjectReceiveStream
from pydantic import ValidationError

from turnkeeper.config import DaemonConfig
from turnkeeper.control.bodies import Body, CancelBody, MessageBody, SubmitBody
from turnkeeper.event_types import TurnReplayed
from turnkeeper.events import TERMINAL_EVENT, Event
from turnkeeper.policy.admission import ControlLimits, default_max_connections
from turnkeeper.policy.turn_state import TurnState
from turnkeeper.supervisor import (
    IntakeRefused,
    NotWaiting,
    Supervisor,
    TurnFinished,
    UnknownProfile,
    UnknownTurn,
)

log = structlog.get_logger("turnkeeper.control")

SUPERVISOR: web.AppKey[Supervisor] = web.AppKey("supervisor", Supervisor)
# Event followers open per peer uid (-1: a peer without credentials), for the cap.
FOLLOWERS: web.AppKey[dict[int, int]] = web.AppKey("followers", dict)
PEER_UID = "turnkeeper.peer_uid"  # request key: the uid the access check saw
MAX_WAIT_S = 3600.0
MAX_BATCH_EVENTS = 500  # events per write of an NDJSON stream
STATE_NAMES = tuple(s.value for s in TurnState)


def error(status: int, message: str, *, field: str | None = None,
          headers: dict[str, str] | None = None) -> web.Response:
    body: dict[str, Any] = {"error": message}
    if field is not None:
        body["field"] = field
    return web.json_response(body, status=status, headers=headers)


async def _read(request: web.Request) -> bytes | web.Response:
    """The body, read within `daemon.body_read_timeout`. A client too slow, or gone, has
    its connection closed; leaving mid-body is one log line, not a traceback."""
    sup = request.app[SUPERVISOR]
    raw: bytes | None = None
    try:
        with sup.clock.move_on_after(sup.config.daemon.body_read_timeout):
            raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise
    except (ConnectionError, web.HTTPException, HttpProcessingError) as exc:
        # Gone mid-body, or a malformed body framing: one line, no traceback.
        log.info("control.client_left", path=request.path, error=type(exc).__name__)
        return error(400, "the body could not be read", field="(body)")
    if raw is None:
        log.info("control.body_timeout", path=request.path)
        late = error(408, "the body was not sent in time", field="(body)")
        late.force_close()  # answered, then the connection is closed: not waited for again
        return late
    return raw


async def _body(request: web.Request, model: type[Body]) -> Body | web.Response:
    raw = await _read(request)
    if isinstance(raw, web.Response):
        return raw
    if not raw:
        data: Any = {}
    else:
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return error(400, f"body is not valid JSON: {exc}", field="(body)")
        except RecursionError:
            return error(400, "body is nested too deeply", field="(body)")
    if not isinstance(data, dict):
        return error(400, "body must be a JSON object", field="(body)")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "(body)"
        msg = "unknown field" if first["type"] == "extra_forbidden" else first["msg"]
        return error(400, f"{field}: {msg}", field=field)
    except RecursionError:
        return error(400, "body is nested too deeply", field="(body)")


def control_limits(daemon: DaemonConfig) -> ControlLimits:
    """The control plane's limits from the `[daemon]` section; `max_connections = 0`
    means a share of this process's descriptor limit."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    max_connections = daemon.max_connections or default_max_connections(
        None if soft == resource.RLIM_INFINITY else soft)
    return ControlLimits(max_connections=max_connections,
                         max_followers_per_client=daemon.max_followers_per_client,
                         max_message_bytes=daemon.max_message_bytes)


def _limits(request: web.Request) -> ControlLimits:
    return control_limits(request.app[SUPERVISOR].config.daemon)


def _too_large(request: web.Request, field: str, text: str) -> web.Response | None:
    """413 naming `field` when `text` is over `daemon.max_message_bytes` (UTF-8)."""
    limit = request.app[SUPERVISOR].config.daemon.max_message_bytes
    size = len(text.encode("utf-8", "surrogatepass"))
    if _limits(request).message_too_large(size):
        return error(413, f"{field} is {size} bytes, more than the {limit} allowed "
                          f"(daemon.max_message_bytes)", field=field)
    return None


@contextlib.contextmanager
def _follower(request: web.Request) -> Iterator[bool]:
    """Counts an event follower against its peer's cap; yields False when over it."""
    uid = request.get(PEER_UID, -1)
    followers = request.app[FOLLOWERS]
    if not _limits(request).admits_follower(followers.get(uid, 0)):
        yield False
        return
    followers[uid] = followers.get(uid, 0) + 1
    try:
        yield True
    finally:
        followers[uid] -= 1
        if not followers[uid]:
            del followers[uid]


def _too_many_followers(request: web.Request) -> web.Response:
    limit = request.app[SUPERVISOR].config.daemon.max_followers_per_client
    return error(429, f"more than {limit} event streams open for this client "
                      f"(daemon.max_followers_per_client)", headers={"Retry-After": "1"})


def _query_float(request: web.Request, name: str, default: float | None,
                 *, lo: float, hi: float) -> float | web.Response | None:
    raw = request.query.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        return error(400, f"{name} must be a number", field=name)
    if not lo <= value <= hi:
        return error(400, f"{name} must be between {lo:g} and {hi:g}", field=name)
    return value


async def status(request: web.Request) -> web.Response:
    return web.json_response(request.app[SUPERVISOR].status())


async def submit(request: web.Request) -> web.Response:
    body = await _body(request, SubmitBody)
    if isinstance(body, web.Response):
        return body
    assert isinstance(body, SubmitBody)
    sup = request.app[SUPERVISOR]
    too_large = _too_large(request, "message", body.message)
    if too_large is not None:
        return too_large
    deadline = body.deadline_epoch()
    if deadline is not None and deadline <= sup.clock.time():
        return error(400, "deadline: is in the past", field="deadline")
    budget = body.budget.model_dump(exclude_none=True) if body.budget else {}
    try:
        record = await sup.submit(message=body.message, session=body.session, budget=budget,
                                  deadline=deadline, profile=body.profile)
    except UnknownProfile as exc:
        return error(400, str(exc), field="profile")
    except IntakeRefused as exc:
        return error(503, str(exc), headers={"Retry-After": str(exc.retry_after_s)})
    return web.json_response({"turn": record.to_json()}, status=202)


async def list_turns(request: web.Request) -> web.Response:
    limit = _query_float(request, "limit", 100, lo=1, hi=10_000)
    if isinstance(limit, web.Response):
        return limit
    assert limit is not None
    state = request.query.get("state") or None
    if state is not None and state not in STATE_NAMES:
        return error(400, f"state must be one of {', '.join(STATE_NAMES)}", field="state")
    turns = await request.app[SUPERVISOR].list_turns(
        state=state, session=request.query.get("session") or None,
        limit=int(limit))
    return web.json_response({"turns": turns})


async def get_turn(request: web.Request) -> web.Response:
    sup = request.app[SUPERVISOR]
    wait = _query_float(request, "wait", None, lo=0, hi=MAX_WAIT_S)
    if isinstance(wait, web.Response):
        return wait
    turn_id = request.match_info["id"]
    try:
        if wait:
            turn = await sup.wait_turn(turn_id, wait)
        else:
            turn = await sup.get_turn(turn_id)
    except UnknownTurn:
        return error(404, f"no turn {turn_id}")
    return web.json_response({"turn": turn})


async def _ndjson(request: web.Request, batches: AsyncIterator[list[dict[str, Any]]]
                  ) -> web.StreamResponse:
    """One write (one chunk, one send) per batch of events: a follower of /v1/events under
    load got one send per event, ~10% of the daemon's CPU in bench_concurrency."""
    resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson",
                                       "Cache-Control": "no-store"})
    await resp.prepare(request)
    try:
        async for batch in batches:
            await resp.write(b"".join(json.dumps(ev, separators=(",", ":")).encode() + b"\n"
                                      for ev in batch))
    except (ConnectionResetError, ConnectionError):
        return resp
    await resp.write_eof()
    return resp


def _ready(live: MemoryObjectReceiveStream[Event], first: Event) -> list[Event]:
    """`first` and the events already waiting behind it (up to a bound)."""
    batch = [first]
    while len(batch) < MAX_BATCH_EVENTS:
        try:
            batch.append(live.receive_nowait())
        except (anyio.WouldBlock, anyio.EndOfStream):
            break
    return batch


async def turn_events(request: web.Request) -> web.StreamResponse:
    sup = request.app[SUPERVISOR]
    turn_id = request.match_info["id"]
    try:
        await sup.get_turn(turn_id)
    except UnknownTurn:
        return error(404, f"no turn {turn_id}")
    with _follower(request) as admitted:
        if not admitted:
            return _too_many_followers(request)
        return await _turn_events(request, sup, turn_id)


async def _turn_events(request: web.Request, sup: Supervisor, turn_id: str
                       ) -> web.StreamResponse:

    async def stream() -> AsyncIterator[list[dict[str, Any]]]:
        with sup.bus.subscribe(turn=turn_id) as live:
            last = 0
            # Events are committed by the store's writer after they are published: one
            # published just before we subscribed may not be readable yet, and would be in
            # neither the history nor the live stream. The writer commits in order, so once
            # this flush is durable every such event is too.
            await sup.store.flush()
            stored = await sup.store.events(turn=turn_id)
            # A replayed dead letter finished once already: only a finish after its last
            # replay ends the stream.
            replayed_at = max((i for i, ev in enumerate(stored)
                               if ev["type"] == TurnReplayed.TYPE), default=-1)
            for i, ev in enumerate(stored):
                if ev["type"] == TERMINAL_EVENT and i > replayed_at:
                    yield stored[:i + 1]
                    return
            if stored:
                last = stored[-1]["seq"]
                yield stored
            if turn_id not in sup.live:
                return  # finished before we subscribed, and its events are all above
            async for first in live:
                batch: list[dict[str, Any]] = []
                for event in _ready(live, first):
                    if event.seq <= last:
                        continue
                    batch.append(event.to_json())
                    if event.type == TERMINAL_EVENT:
                        yield batch
                        return
                if batch:
                    yield batch

    return await _ndjson(request, stream())


async def all_events(request: web.Request) -> web.StreamResponse:
    sup = request.app[SUPERVISOR]

    async def stream() -> AsyncIterator[list[dict[str, Any]]]:
        with sup.bus.subscribe() as live:
            async for first in live:
                yield [event.to_json() for event in _ready(live, first)]

    with _follower(request) as admitted:
        if not admitted:
            return _too_many_followers(request)
        return await _ndjson(request, stream())


async def post_message(request: web.Request) -> web.Response:
    body = await _body(request, MessageBody)
    if isinstance(body, web.Response):
        return body
    assert isinstance(body, MessageBody)
    too_large = _too_large(request, "text", body.text)
    if too_large is not None:
        return too_large
    turn_id = request.match_info["id"]
    try:
        out = await request.app[SUPERVISOR].post_message(
            turn_id, kind=body.kind, text=body.text, redirect=body.redirect)
    except UnknownTurn:
        return error(404, f"no turn {turn_id}")
    except TurnFinished:
        return error(409, f"turn {turn_id} has finished")
    except NotWaiting as exc:
        return error(409, str(exc))
    return web.json_response(out, status=202)


async def cancel(request: web.Request) -> web.Response:
    body = await _body(request, CancelBody)
    if isinstance(body, web.Response):
        return body
    assert isinstance(body, CancelBody)
    turn_id = request.match_info["id"]
    try:
        out = await request.app[SUPERVISOR].cancel(turn_id, now=body.now)
    except UnknownTurn:
        return error(404, f"no turn {turn_id}")
    return web.json_response(out, status=202)


async def reload(request: web.Request) -> web.Response:
    outcome = await request.app[SUPERVISOR].reload("api")
    if outcome.stopping:  # not the config's fault: 503, as for a submit while stopping
        return web.json_response(outcome.to_json(), status=503)
    return web.json_response(outcome.to_json(), status=200 if outcome.ok else 422)


async def dead_letters(request: web.Request) -> web.Response:
    return web.json_response({"dead_letters": await request.app[SUPERVISOR].store.dead_letters()})


async def replay(request: web.Request) -> web.Response:
    turn_id = request.match_info["id"]
    try:
        record = await request.app[SUPERVISOR].replay(turn_id)
    except UnknownTurn:
        return error(404, f"no dead letter {turn_id}")
    except TurnFinished as exc:
        return error(409, str(exc))
    except IntakeRefused as exc:
        return error(503, str(exc), headers={"Retry-After": str(exc.retry_after_s)})
    return web.json_response({"turn": record.to_json()}, status=202)


async def limits_report(request: web.Request) -> web.Response:
    since = _query_float(request, "since", None, lo=0, hi=10 * 365 * 86400)
    if isinstance(since, web.Response):
        return since
    factor = _query_float(request, "factor", 2.5, lo=0.01, hi=1000)
    if isinstance(factor, web.Response):
        return factor
    assert factor is not None
    report = await request.app[SUPERVISOR].limits_report(
        profile=request.query.get("profile") or None, since_s=since, factor=factor)
    return web.json_response(report)


def add_routes(app: web.Application) -> None:
    app[FOLLOWERS] = {}
    app.router.add_get("/v1/status", status)
    app.router.add_post("/v1/turns", submit)
    app.router.add_get("/v1/turns", list_turns)
    app.router.add_get("/v1/turns/{id}", get_turn)
    app.router.add_get("/v1/turns/{id}/events", turn_events)
    app.router.add_post("/v1/turns/{id}/messages", post_message)
    app.router.add_post("/v1/turns/{id}/cancel", cancel)
    app.router.add_get("/v1/events", all_events)
    app.router.add_post("/v1/reload", reload)
    app.router.add_get("/v1/dead-letters", dead_letters)
    app.router.add_get("/v1/limits/report", limits_report)
    app.router.add_post("/v1/dead-letters/{id}/replay", replay)

