"""The control API: HTTP/1.1 + JSON over the Unix socket.

Handlers validate, call the supervisor, and shape answers; they hold no state. Every
error is JSON: `{"error": "...", "field": "..."}` where a field is to blame.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from datetime import datetime
from typing import Annotated, Any, Literal

import anyio
from aiohttp import web
from anyio.streams.memory import MemoryObjectReceiveStream
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from turnkeeper.events import TERMINAL_EVENT, Event
from turnkeeper.supervisor import (
    IntakeRefused,
    NotWaiting,
    Supervisor,
    TurnFinished,
    UnknownProfile,
    UnknownTurn,
)

SUPERVISOR: web.AppKey[Supervisor] = web.AppKey("supervisor", Supervisor)
MAX_WAIT_S = 3600.0
MAX_BATCH_EVENTS = 500  # events per write of an NDJSON stream


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class BudgetOverride(_Body):
    max_tokens: Annotated[int, Field(gt=0)] | None = None
    max_seconds: Annotated[float, Field(gt=0)] | None = None
    max_steps: Annotated[int, Field(gt=0)] | None = None
    max_cost_usd: Annotated[float, Field(ge=0)] | None = None


class SubmitBody(_Body):
    message: Annotated[str, Field(min_length=1, max_length=512 * 1024)]
    session: Annotated[str, Field(min_length=1, max_length=200,
                                  pattern=r"^[A-Za-z0-9_.:\-]+$")] | None = None
    budget: BudgetOverride | None = None
    deadline: float | datetime | None = None
    profile: Annotated[str, Field(min_length=1, max_length=64)] | None = None

    @field_validator("deadline")
    @classmethod
    def _epoch(cls, v: float | datetime | None) -> float | datetime | None:
        if isinstance(v, datetime) and v.tzinfo is None:
            raise ValueError("needs a time zone (e.g. 2026-12-01T10:00:00Z)")
        return v

    def deadline_epoch(self) -> float | None:
        if isinstance(self.deadline, datetime):
            return self.deadline.timestamp()
        return self.deadline


class MessageBody(_Body):
    kind: Literal["steer", "answer"]
    text: Annotated[str, Field(min_length=1, max_length=512 * 1024)]
    redirect: bool = False


def error(status: int, message: str, *, field: str | None = None,
          headers: dict[str, str] | None = None) -> web.Response:
    body: dict[str, Any] = {"error": message}
    if field is not None:
        body["field"] = field
    return web.json_response(body, status=status, headers=headers)


async def _body(request: web.Request, model: type[_Body]) -> _Body | web.Response:
    raw = await request.read()
    if not raw:
        data: Any = {}
    else:
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return error(400, f"body is not valid JSON: {exc}", field="(body)")
    if not isinstance(data, dict):
        return error(400, "body must be a JSON object", field="(body)")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "(body)"
        msg = "unknown field" if first["type"] == "extra_forbidden" else first["msg"]
        return error(400, f"{field}: {msg}", field=field)


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
    budget = body.budget.model_dump(exclude_none=True) if body.budget else {}
    try:
        record = await sup.submit(message=body.message, session=body.session, budget=budget,
                                  deadline=body.deadline_epoch(), profile=body.profile)
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
    turns = await request.app[SUPERVISOR].list_turns(
        state=request.query.get("state") or None, session=request.query.get("session") or None,
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

    async def stream() -> AsyncIterator[list[dict[str, Any]]]:
        with sup.bus.subscribe(turn=turn_id) as live:
            last = 0
            # Events are committed by the store's writer after they are published: one
            # published just before we subscribed may not be readable yet, and would be in
            # neither the history nor the live stream. The writer commits in order, so once
            # this flush is durable every such event is too.
            await sup.store.flush()
            stored = await sup.store.events(turn=turn_id)
            for i, ev in enumerate(stored):
                if ev["type"] == TERMINAL_EVENT:
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

    return await _ndjson(request, stream())


async def post_message(request: web.Request) -> web.Response:
    body = await _body(request, MessageBody)
    if isinstance(body, web.Response):
        return body
    assert isinstance(body, MessageBody)
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
    turn_id = request.match_info["id"]
    try:
        out = await request.app[SUPERVISOR].cancel(turn_id)
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

