"""The control API: HTTP/1.1 + JSON over the Unix socket.

Handlers validate, call the supervisor, and shape answers; they hold no state. What
every route shares (errors, strict bodies, the app's keys) is in `http.py`, the event
streams in `event_routes.py`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from aiohttp import web

from turnkeeper.control import event_routes, log_routes, openapi
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
    control_limits,
    error,
    json_response,
    large_json_response,
    query_float,
    read_body,
    read_json,
    too_large,
    validate,
)
from turnkeeper.durations import parse_duration
from turnkeeper.policy.idempotency import key_problem
from turnkeeper.policy.turn_state import TurnState
from turnkeeper.store.base import StoreError
from turnkeeper.supervisor import (
    IdempotencyConflict,
    InboxFull,
    IntakeRefused,
    NotWaiting,
    TurnFinished,
    UnknownModel,
    UnknownProfile,
    UnknownTurn,
    UnpricedCostLimit,
)
from turnkeeper.supervisor.intake import BatchItemInvalid, SubmitRequest
from turnkeeper.supervisor.keyed import Existing
from turnkeeper.tracecontext import traceparent_problem

KEY_HEADER = "Idempotency-Key"

MAX_WAIT_S = 3600.0
TEN_YEARS_S = 10 * 365 * 86400  # how far back `since` may reach
STATE_NAMES = tuple(s.value for s in TurnState)

__all__ = ["PEER_UID", "SUPERVISOR", "add_routes", "control_limits", "error"]


async def status(request: web.Request) -> web.Response:
    sup = request.app[SUPERVISOR]
    out = sup.status()
    out["overload"] = sup.intake.overload.snapshot()
    return json_response(out)


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
    if isinstance(body, web.Response):
        return body
    assert isinstance(body, IntakeBody)
    sup = request.app[SUPERVISOR]
    changed = sup.scheduling.set_paused(not body.open)
    return json_response({"open": body.open, "changed": changed,
                          "queued": len(sup.queue)})


async def prune(request: web.Request) -> web.Response:
    """Delete the finished turns older than a duration, now (the background retention
    does the same at `store.keep_finished`)."""
    body = await read_body(request, PruneBody)
    if isinstance(body, web.Response):
        return body
    assert isinstance(body, PruneBody)
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
                    index: int | None = None) -> SubmitRequest | web.Response:
    """What the intake takes from a validated body, or the 400 / 413 naming the field."""
    oversized = too_large(request, "message", body.message)
    if oversized is not None:
        if index is None:
            return oversized
        limit = request.app[SUPERVISOR].config.daemon.max_message_bytes
        return error(413, f"{prefix}message: more than the {limit} bytes allowed "
                          "(daemon.max_message_bytes)", field=f"{prefix}message", index=index)
    deadline = body.deadline_epoch()
    if deadline is not None and deadline <= request.app[SUPERVISOR].clock.time():
        return error(400, f"{prefix}deadline: is in the past", field=f"{prefix}deadline",
                     index=index)
    budget = body.budget.model_dump(exclude_none=True) if body.budget else {}
    # Every other field of the body as it is: a field added to the body and not to the
    # request is a TypeError here, at once, never a field dropped without a word.
    rest = {name: getattr(body, name) for name in _SUBMIT_FIELDS}
    return SubmitRequest(**rest, budget=budget, deadline=deadline)


def _header_key(request: web.Request) -> str | web.Response | None:
    """The `Idempotency-Key` header, or the 400 naming it."""
    key = request.headers.get(KEY_HEADER)
    if key is None:
        return None
    problem = key_problem(key)
    if problem is not None:
        return error(400, f"idempotency_key: the {KEY_HEADER} header: {problem}",
                     field="idempotency_key")
    return key


def _header_trace(request: web.Request) -> str | web.Response | None:
    """The `traceparent` header (W3C trace context), or the 400 naming it."""
    trace = request.headers.get("traceparent")
    if trace is None:
        return None
    problem = traceparent_problem(trace)
    if problem is not None:
        return error(400, f"traceparent: the traceparent header {problem}",
                     field="traceparent")
    return trace


def _with_key(req: SubmitRequest, header: str | None, *, prefix: str = "",
              index: int | None = None, trace: str | None = None
              ) -> SubmitRequest | web.Response:
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
        return error(400, f"idempotency_key: the body's {req.idempotency_key!r} is not the "
                     f"{KEY_HEADER} header's {header!r}", field=f"{prefix}idempotency_key")
    return dataclasses.replace(req, idempotency_key=header)


def _refused(exc: IntakeRefused) -> web.Response:
    return error(exc.status, str(exc), headers={"Retry-After": str(exc.retry_after_s)})


async def submit(request: web.Request) -> web.Response:
    """One submit (a JSON object) or a batch (a JSON list of them)."""
    data = await read_json(request)
    if isinstance(data, web.Response):
        return data
    header = _header_key(request)
    if isinstance(header, web.Response):
        return header
    trace = _header_trace(request)
    if isinstance(trace, web.Response):
        return trace
    if isinstance(data, list):
        return await submit_batch(request, data, header, trace)
    body = validate(SubmitBody, data)
    if isinstance(body, web.Response):
        return body
    assert isinstance(body, SubmitBody)
    req = _submit_request(request, body)
    if isinstance(req, web.Response):
        return req
    req = _with_key(req, header, trace=trace)
    if isinstance(req, web.Response):
        return req
    try:
        turn, created = await request.app[SUPERVISOR].keyed.submit(req)
    except IdempotencyConflict as exc:
        return error(422, str(exc), field=exc.field)
    except UnknownProfile as exc:
        return error(400, str(exc), field="profile")
    except UnknownModel as exc:
        return error(400, str(exc), field="model")
    except UnpricedCostLimit as exc:
        return error(400, str(exc), field="budget.max_cost_usd")
    except IntakeRefused as exc:
        return _refused(exc)
    except StoreError as exc:  # not kept (a full disk, a write withdrawn): not taken
        return error(507, f"no turn was queued: {exc}")
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
        return error(400, "a batch needs at least one submit", field="(body)")
    if len(items) > MAX_BATCH:
        return error(400, f"a batch holds at most {MAX_BATCH} submits, not {len(items)}",
                     field="(body)")
    reqs: list[SubmitRequest] = []
    for i, item in enumerate(items):
        prefix = f"[{i}]."
        body = validate(SubmitBody, item, prefix=prefix, index=i)
        if isinstance(body, web.Response):
            return body
        assert isinstance(body, SubmitBody)
        req = _submit_request(request, body, prefix=prefix, index=i)
        if isinstance(req, web.Response):
            return req
        req = _with_key(req, header, prefix=prefix, index=i, trace=trace)
        if isinstance(req, web.Response):
            return req
        reqs.append(req)
    try:
        results = await request.app[SUPERVISOR].keyed.submit_batch(reqs)
    except BatchItemInvalid as exc:
        return error(exc.status, str(exc), field=exc.field, index=exc.index)
    except IntakeRefused as exc:
        return _refused(exc)
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
    limit = query_float(request, "limit", 100, lo=1, hi=10_000)
    if isinstance(limit, web.Response):
        return limit
    assert limit is not None
    since = query_float(request, "since", None, lo=0, hi=TEN_YEARS_S)
    if isinstance(since, web.Response):
        return since
    before = query_float(request, "before", None, lo=1, hi=2**53)
    if isinstance(before, web.Response):
        return before
    state = request.query.get("state") or None
    if state is not None and state not in STATE_NAMES:
        return error(400, f"state must be one of {', '.join(STATE_NAMES)}", field="state")
    turns = await request.app[SUPERVISOR].list_turns(
        state=state, session=request.query.get("session") or None,
        limit=int(limit), since_s=since, before_seq=None if before is None else int(before))
    # The cursor of the next page: the oldest `seq` of this one, while pages are full.
    after_page = turns[-1]["seq"] if len(turns) == int(limit) else None
    return await large_json_response({"turns": turns, "next": after_page})


async def get_turn(request: web.Request) -> web.Response:
    sup = request.app[SUPERVISOR]
    wait = query_float(request, "wait", None, lo=0, hi=MAX_WAIT_S)
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
    return json_response({"turn": turn})


async def post_message(request: web.Request) -> web.Response:
    body = await read_body(request, MessageBody)
    if isinstance(body, web.Response):
        return body
    assert isinstance(body, MessageBody)
    oversized = too_large(request, "text", body.text)
    if oversized is not None:
        return oversized
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
    except InboxFull as exc:
        return error(429, str(exc), field="max_pending_messages")
    return json_response(out, status=202)


async def cancel(request: web.Request) -> web.Response:
    body = await read_body(request, CancelBody)
    if isinstance(body, web.Response):
        return body
    assert isinstance(body, CancelBody)
    turn_id = request.match_info["id"]
    try:
        out = await request.app[SUPERVISOR].cancel(turn_id, now=body.now)
    except UnknownTurn:
        return error(404, f"no turn {turn_id}")
    return json_response(out, status=202)


async def fleet(request: web.Request) -> web.Response:
    sup = request.app[SUPERVISOR]
    if sup.fleet is None:
        return error(409, "not a fleet: this daemon keeps its turns in its own SQLite file "
                          "([store] url is empty)")
    try:
        await sup.fleet.read_nodes()
    except StoreError as exc:
        return error(503, str(exc))
    return json_response(sup.fleet.status())


async def reload(request: web.Request) -> web.Response:
    outcome = await request.app[SUPERVISOR].reload("api")
    if outcome.stopping:  # not the config's fault: 503, as for a submit while stopping
        return json_response(outcome.to_json(), status=503)
    return json_response(outcome.to_json(), status=200 if outcome.ok else 422)


async def dead_letters(request: web.Request) -> web.Response:
    return json_response({"dead_letters": await request.app[SUPERVISOR].store.dead_letters()})


async def replay(request: web.Request) -> web.Response:
    turn_id = request.match_info["id"]
    try:
        record = await request.app[SUPERVISOR].replay(turn_id)
    except UnknownTurn:
        return error(404, f"no dead letter {turn_id}")
    except TurnFinished as exc:
        return error(409, str(exc))
    except IntakeRefused as exc:
        return _refused(exc)
    except StoreError as exc:  # not kept (a full disk, a write withdrawn): not taken
        return error(507, f"no turn was queued: {exc}")
    return json_response({"turn": record.to_json()}, status=202)


async def limits_report(request: web.Request) -> web.Response:
    since = query_float(request, "since", None, lo=0, hi=TEN_YEARS_S)
    if isinstance(since, web.Response):
        return since
    factor = query_float(request, "factor", 2.5, lo=0.01, hi=1000)
    if isinstance(factor, web.Response):
        return factor
    assert factor is not None
    try:
        report = await request.app[SUPERVISOR].limits_report(
            profile=request.query.get("profile") or None, since_s=since, factor=factor)
    except UnknownProfile as exc:
        return error(400, str(exc), field="profile")
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
    app.router.add_get("/v1/events", event_routes.all_events)
    app.router.add_get("/v1/logs", log_routes.recent_logs)
    app.router.add_post("/v1/reload", reload)
    app.router.add_get("/v1/fleet", fleet)
    app.router.add_get("/v1/dead-letters", dead_letters)
    app.router.add_get("/v1/limits/report", limits_report)
    app.router.add_post("/v1/dead-letters/{id}/replay", replay)

