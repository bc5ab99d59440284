"""The control API: HTTP/1.1 + JSON over the Unix socket.

Handlers validate, call the supervisor, and shape answers; they hold no state. What
every route shares (errors, strict bodies, the app's keys) is in `http.py`, the event
streams in `event_routes.py`.
"""

from __future__ import annotations

from aiohttp import web

from turnkeeper.control import event_routes, log_routes
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
    query_float,
    read_body,
    too_large,
)
from turnkeeper.policy.retention import parse_duration
from turnkeeper.policy.turn_state import TurnState
from turnkeeper.supervisor import (
    InboxFull,
    IntakeRefused,
    NotWaiting,
    TurnFinished,
    UnknownModel,
    UnknownProfile,
    UnknownTurn,
)

MAX_WAIT_S = 3600.0
TEN_YEARS_S = 10 * 365 * 86400  # how far back `since` may reach
STATE_NAMES = tuple(s.value for s in TurnState)

__all__ = ["PEER_UID", "SUPERVISOR", "add_routes", "control_limits", "error"]


async def status(request: web.Request) -> web.Response:
    return web.json_response(request.app[SUPERVISOR].status())


async def health(request: web.Request) -> web.Response:
    """200 when ready; 503 when degraded, naming every reason."""
    out = request.app[SUPERVISOR].queries.health()
    return web.json_response(out, status=200 if out["status"] == "ok" else 503)


async def intake(request: web.Request) -> web.Response:
    """Pause or resume the start of queued turns (submits are queued either way)."""
    body = await read_body(request, IntakeBody)
    if isinstance(body, web.Response):
        return body
    assert isinstance(body, IntakeBody)
    sup = request.app[SUPERVISOR]
    changed = sup.scheduling.set_paused(not body.open)
    return web.json_response({"open": body.open, "changed": changed,
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
    return web.json_response({"pruned": pruned, "older_than": body.older_than,
                              "dead_letters": body.dead_letters})


async def submit(request: web.Request) -> web.Response:
    body = await read_body(request, SubmitBody)
    if isinstance(body, web.Response):
        return body
    assert isinstance(body, SubmitBody)
    sup = request.app[SUPERVISOR]
    oversized = too_large(request, "message", body.message)
    if oversized is not None:
        return oversized
    deadline = body.deadline_epoch()
    if deadline is not None and deadline <= sup.clock.time():
        return error(400, "deadline: is in the past", field="deadline")
    budget = body.budget.model_dump(exclude_none=True) if body.budget else {}
    try:
        record = await sup.submit(message=body.message, session=body.session, budget=budget,
                                  deadline=deadline, profile=body.profile,
                                  model=body.model)
    except UnknownProfile as exc:
        return error(400, str(exc), field="profile")
    except UnknownModel as exc:
        return error(400, str(exc), field="model")
    except IntakeRefused as exc:
        return error(exc.status, str(exc), headers={"Retry-After": str(exc.retry_after_s)})
    return web.json_response({"turn": record.to_json()}, status=202)


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
    return web.json_response({"turns": turns, "next": after_page})


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
    return web.json_response({"turn": turn})


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
    return web.json_response(out, status=202)


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
        return error(exc.status, str(exc), headers={"Retry-After": str(exc.retry_after_s)})
    return web.json_response({"turn": record.to_json()}, status=202)


async def limits_report(request: web.Request) -> web.Response:
    since = query_float(request, "since", None, lo=0, hi=TEN_YEARS_S)
    if isinstance(since, web.Response):
        return since
    factor = query_float(request, "factor", 2.5, lo=0.01, hi=1000)
    if isinstance(factor, web.Response):
        return factor
    assert factor is not None
    report = await request.app[SUPERVISOR].limits_report(
        profile=request.query.get("profile") or None, since_s=since, factor=factor)
    return web.json_response(report)


def add_routes(app: web.Application) -> None:
    app[FOLLOWERS] = {}
    app.router.add_get("/v1/status", status)
    app.router.add_get("/v1/health", health)
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
    app.router.add_get("/v1/dead-letters", dead_letters)
    app.router.add_get("/v1/limits/report", limits_report)
    app.router.add_post("/v1/dead-letters/{id}/replay", replay)

