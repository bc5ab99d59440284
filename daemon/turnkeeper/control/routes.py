"""The control API: HTTP/1.1 + JSON over the Unix socket.

Handlers validate, call the supervisor, and shape answers; they hold no state and map
no error to a status: what they or the supervisor refuse is raised (`errors.Refused`) and
answered by one middleware. What every route shares (errors, strict bodies, the app's
keys) is in `http.py`, the event streams in `event_routes.py`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from aiohttp import web

from turnkeeper.control import approval_routes, event_routes, log_routes, openapi
from turnkeeper.control.bodies import (
    CancelBody,
    IntakeBody,
    MessageBody,
    PruneBody,
    SubmitBody,
)
from turnkeeper.control.http import (
    FOLLOWERS,
    PEER_UID,
    SUPERVISOR,
    BadRequest,
    check_size,
    control_limits,
    error,
    json_response,
    large_json_response,
    query_float,
    read_body,
    read_json,
    refusals,
    validate,
)
from turnkeeper.durations import parse_duration
from turnkeeper.errors import Refused
from turnkeeper.policy.idempotency import key_problem
from turnkeeper.policy.turn_state import TurnState
from turnkeeper.store.base import StoreError
from turnkeeper.supervisor import IdempotencyConflict, Supervisor
from turnkeeper.supervisor.intake import SubmitRequest
from turnkeeper.supervisor.keyed import Existing
from turnkeeper.tracecontext import traceparent_problem

KEY_HEADER = "Idempotency-Key"

MAX_WAIT_S = 3600.0
TEN_YEARS_S = 10 * 365 * 86400  # how far back `since` may reach
STATE_NAMES = tuple(s.value for s in TurnState)

__all__ = ["PEER_UID", "SUPERVISOR", "add_routes", "control_limits", "error", "refusals"]


def status_of(sup: Supervisor) -> dict[str, Any]:
    """`GET /v1/status`'s answer (also the control lane's: `control/lane.py`)."""
    out = sup.status()
    out["overload"] = sup.intake.overload.snapshot()
    return out


async def status(request: web.Request) -> web.Response:
    return json_response(status_of(request.app[SUPERVISOR]))


async def health(request: web.Request) -> web.Response:
    """200 when ready; 503 when degraded, naming every reason."""
    out = request.app[SUPERVISOR].queries.health()
    return json_response(out, status=200 if out["status"] == "ok" else 503)


async def openapi_document(request: web.Request) -> web.Response:
    """This API described as OpenAPI 3.1 (the same text as docs/openapi.json)."""
    return web.Response(text=openapi.text(), content_type="application/json")


async def intake(request: web.Request) -> web.Response:
    """Pause or resume the start of queued turns (submits are queued either way)."""
    body = await read_body(request, IntakeBody)
    sup = request.app[SUPERVISOR]
    changed = sup.scheduling.set_paused(not body.open)
    return json_response({"open": body.open, "changed": changed,
                          "queued": len(sup.queue)})


async def prune(request: web.Request) -> web.Response:
    """Delete the finished turns older than a duration, now (the background retention
    does the same at `store.keep_finished`)."""
    body = await read_body(request, PruneBody)
    pruned = await request.app[SUPERVISOR].prune(
        older_than_s=parse_duration(body.older_than), dead_letters=body.dead_letters)
    return json_response({"pruned": pruned, "older_than": body.older_than,
                          "dead_letters": body.dead_letters})


# The most submits one `POST /v1/turns` may carry as a JSON list.
MAX_BATCH = 1000
# The body's fields `_submit_request` passes on as they are (pydantic builds
# `model_fields` again at each read: 0.8 us).
_SUBMIT_FIELDS = tuple(name for name in SubmitBody.model_fields
                       if name not in ("budget", "deadline"))


def _submit_request(request: web.Request, body: SubmitBody, *, prefix: str = "",
                    index: int | None = None) -> SubmitRequest:
    """What the intake takes from a validated body; raises `BadRequest` (400, 413)
    naming the field."""
    check_size(request, f"{prefix}message", body.message, index=index)
    deadline = body.deadline_epoch()
    if deadline is not None and deadline <= request.app[SUPERVISOR].clock.time():
        raise BadRequest(f"{prefix}deadline: is in the past", field=f"{prefix}deadline",
                         index=index)
    budget = body.budget.model_dump(exclude_none=True) if body.budget else {}
    # Every other field of the body as it is: a field added to the body and not to the
    # request is a TypeError here, at once, never a field dropped without a word.
    rest = {name: getattr(body, name) for name in _SUBMIT_FIELDS}
    return SubmitRequest(**rest, budget=budget, deadline=deadline)


def _header_key(request: web.Request) -> str | None:
    """The `Idempotency-Key` header; raises `BadRequest` naming it."""
    key = request.headers.get(KEY_HEADER)
    if key is None:
        return None
    problem = key_problem(key)
    if problem is not None:
        raise BadRequest(f"idempotency_key: the {KEY_HEADER} header: {problem}",
                         field="idempotency_key")
    return key


def _header_trace(request: web.Request) -> str | None:
    """The `traceparent` header (W3C trace context); raises `BadRequest` naming it."""
    trace = request.headers.get("traceparent")
    if trace is None:
        return None
    problem = traceparent_problem(trace)
    if problem is not None:
        raise BadRequest(f"traceparent: the traceparent header {problem}",
                         field="traceparent")
    return trace


def _with_key(req: SubmitRequest, header: str | None, *, prefix: str = "",
              index: int | None = None, trace: str | None = None) -> SubmitRequest:
    """The request with the header's key (a batch item's: the header's key, `/`, its
    index) unless the body names its own; a body naming another one than a single
    submit's header is a 400. The `traceparent` header's context goes to a submit whose
    body names none."""
    if trace is not None and req.traceparent is None:
        req = dataclasses.replace(req, traceparent=trace)
    if header is None:
        return req
    if index is not None:
        if req.idempotency_key is not None:
            return req
        return dataclasses.replace(req, idempotency_key=f"{header}/{index}")
    if req.idempotency_key not in (None, header):
        raise BadRequest(f"idempotency_key: the body's {req.idempotency_key!r} is not the "
                         f"{KEY_HEADER} header's {header!r}", field=f"{prefix}idempotency_key")
    return dataclasses.replace(req, idempotency_key=header)


def _not_queued(exc: StoreError) -> Refused:
    """A submit or a replay whose write failed (a full disk, a write withdrawn): not
    taken, and the daemon cannot keep it (507)."""
    return Refused(f"no turn was queued: {exc}", status=507)


async def submit(request: web.Request) -> web.Response:
    """One submit (a JSON object) or a batch (a JSON list of them)."""
    data = await read_json(request)
    header = _header_key(request)
    trace = _header_trace(request)
    if isinstance(data, list):
        return await submit_batch(request, data, header, trace)
    req = _with_key(_submit_request(request, validate(SubmitBody, data)), header,
                    trace=trace)
    try:
        turn, created = await request.app[SUPERVISOR].keyed.submit(req)
    except StoreError as exc:
        raise _not_queued(exc) from None
    # 200: the key made this turn before (a retry); 202: made now.
    return json_response({"turn": turn}, status=202 if created else 200)


async def submit_batch(request: web.Request, items: list[Any], header: str | None,
                       trace: str | None = None) -> web.Response:
    """Every item is checked before any is taken: one bad item is a 400 (or 413) naming
    its index and field, and nothing is queued. A batch the queue cannot hold whole is
    refused whole (503). Otherwise 202 with `{"results": [...]}` in the order sent: each
    `{"status": 202, "turn": {...}}`, `{"status": 200, "turn": {...}}` for an item whose
    Idempotency-Key made its turn before, or `{"status": 507, "error": ...}` for an item
    whose write failed (the others are taken); 507 for the request when none was, 200
    when every item's key had made its turn before."""
    if not items:
        raise BadRequest("a batch needs at least one submit", field="(body)")
    if len(items) > MAX_BATCH:
        raise BadRequest(f"a batch holds at most {MAX_BATCH} submits, not {len(items)}",
                         field="(body)")
    reqs: list[SubmitRequest] = []
    for i, item in enumerate(items):
        prefix = f"[{i}]."
        body = validate(SubmitBody, item, prefix=prefix, index=i)
        req = _submit_request(request, body, prefix=prefix, index=i)
        reqs.append(_with_key(req, header, prefix=prefix, index=i, trace=trace))
    results = await request.app[SUPERVISOR].keyed.submit_batch(reqs)
    failed = [r for r in results if isinstance(r, Exception)]
    if len(failed) == len(results):  # nothing was taken: the request failed
        return error(_write_failed_status(failed[0]), f"no turn was queued: {failed[0]}")
    out: list[dict[str, Any]] = []
    for result in results:
        if isinstance(result, Existing):  # its key made it before
            out.append({"status": 200, "turn": result.turn})
        elif isinstance(result, IdempotencyConflict):
            out.append({"status": 422, "error": str(result), "field": result.field})
        elif isinstance(result, Exception):
            out.append({"status": _write_failed_status(result), "error": str(result)})
        else:
            out.append({"status": 202, "turn": result})
    again = all(isinstance(r, Existing) for r in results)
    return json_response({"results": out}, status=200 if again else 202)


def _write_failed_status(exc: Exception) -> int:
    """507 when the store could not be written (the daemon cannot keep the turn), 500
    for anything else."""
    return 507 if isinstance(exc, StoreError) else 500


async def list_turns(request: web.Request) -> web.Response:
    limit = int(query_float(request, "limit", 100, lo=1, hi=10_000) or 100)
    since = query_float(request, "since", None, lo=0, hi=TEN_YEARS_S)
    before = query_float(request, "before", None, lo=1, hi=2**53)
    state = request.query.get("state") or None
    if state is not None and state not in STATE_NAMES:
        raise BadRequest(f"state must be one of {', '.join(STATE_NAMES)}", field="state")
    turns = await request.app[SUPERVISOR].list_turns(
        state=state, session=request.query.get("session") or None,
        limit=limit, since_s=since, before_seq=None if before is None else int(before))
    # The cursor of the next page: the oldest `seq` of this one, while pages are full.
    after_page = turns[-1]["seq"] if len(turns) == limit else None
    return await large_json_response({"turns": turns, "next": after_page})


async def get_turn(request: web.Request) -> web.Response:
    sup = request.app[SUPERVISOR]
    wait = query_float(request, "wait", None, lo=0, hi=MAX_WAIT_S)
    turn_id = request.match_info["id"]
    turn = await (sup.wait_turn(turn_id, wait) if wait else sup.get_turn(turn_id))
    return json_response({"turn": turn})


async def post_message(request: web.Request) -> web.Response:
    body = await read_body(request, MessageBody)
    check_size(request, "text", body.text)
    out = await request.app[SUPERVISOR].post_message(
        request.match_info["id"], kind=body.kind, text=body.text, redirect=body.redirect)
    return json_response(out, status=202)


async def cancel(request: web.Request) -> web.Response:
    body = await read_body(request, CancelBody)
    out = await request.app[SUPERVISOR].cancel(request.match_info["id"], now=body.now)
    return json_response(out, status=202)


async def fleet(request: web.Request) -> web.Response:
    sup = request.app[SUPERVISOR]
    if sup.fleet is None:
        raise Refused("not a fleet: this daemon keeps its turns in its own SQLite file "
                      "([store] url is empty)", status=409)
    try:
        await sup.fleet.read_nodes()
    except StoreError as exc:
        raise Refused(str(exc), status=503) from None
    return json_response(sup.fleet.status())


async def reload(request: web.Request) -> web.Response:
    outcome = await request.app[SUPERVISOR].reload("api")
    if outcome.stopping:  # not the config's fault: 503, as for a submit while stopping
        return json_response(outcome.to_json(), status=503)
    return json_response(outcome.to_json(), status=200 if outcome.ok else 422)


async def dead_letters(request: web.Request) -> web.Response:
    return json_response({"dead_letters": await request.app[SUPERVISOR].store.dead_letters()})


async def replay(request: web.Request) -> web.Response:
    try:
        record = await request.app[SUPERVISOR].replay(request.match_info["id"])
    except StoreError as exc:
        raise _not_queued(exc) from None
    return json_response({"turn": record.to_json()}, status=202)


async def limits_report(request: web.Request) -> web.Response:
    since = query_float(request, "since", None, lo=0, hi=TEN_YEARS_S)
    factor = query_float(request, "factor", 2.5, lo=0.01, hi=1000) or 2.5
    report = await request.app[SUPERVISOR].limits_report(
        profile=request.query.get("profile") or None, since_s=since, factor=factor)
    return json_response(report)


def add_routes(app: web.Application) -> None:
    app[FOLLOWERS] = {}
    app.router.add_get("/v1/status", status)
    app.router.add_get("/v1/health", health)
    app.router.add_get("/v1/openapi.json", openapi_document)
    app.router.add_post("/v1/intake", intake)
    app.router.add_post("/v1/prune", prune)
    app.router.add_post("/v1/turns", submit)
    app.router.add_get("/v1/turns", list_turns)
    app.router.add_get("/v1/turns/{id}", get_turn)
    app.router.add_get("/v1/turns/{id}/events", event_routes.turn_events)
    app.router.add_post("/v1/turns/{id}/messages", post_message)
    app.router.add_post("/v1/turns/{id}/cancel", cancel)
    approval_routes.add_routes(app)
    app.router.add_get("/v1/events", event_routes.all_events)
    app.router.add_get("/v1/logs", log_routes.recent_logs)
    app.router.add_post("/v1/reload", reload)
    app.router.add_get("/v1/fleet", fleet)
    app.router.add_get("/v1/dead-letters", dead_letters)
    app.router.add_get("/v1/limits/report", limits_report)
    app.router.add_post("/v1/dead-letters/{id}/replay", replay)

