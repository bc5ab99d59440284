"""The approval routes: the tool calls turns hold for a person, and the person's
decisions. `GET /v1/approvals` lists every pending call (every node's, on a shared
store); `POST /v1/turns/{id}/approvals` approves or denies one, on any node.

Errors (raised by the supervisor, answered by the one middleware): an unknown turn is
404; a call the turn does not hold (unknown, or decided already) is 409 naming
`call_id`, a finished turn 409; a bad `decision` is 400 naming `decision`; edited
`arguments` the tool's input schema refuses are 400 naming `arguments`.
"""

from __future__ import annotations

from aiohttp import web

from turnkeeper.control.bodies import ApprovalBody
from turnkeeper.control.http import SUPERVISOR, check_size, json_response, read_body


async def list_approvals(request: web.Request) -> web.Response:
    pending = await request.app[SUPERVISOR].approvals.pending()
    return json_response({"approvals": pending})


async def decide(request: web.Request) -> web.Response:
    body = await read_body(request, ApprovalBody)
    check_size(request, "reason", body.reason)
    out = await request.app[SUPERVISOR].approvals.decide(
        request.match_info["id"], call_id=body.call_id, decision=body.decision,
        reason=body.reason, arguments=body.arguments)
    return json_response(out, status=202)


def add_routes(app: web.Application) -> None:
    app.router.add_get("/v1/approvals", list_approvals)
    app.router.add_post("/v1/turns/{id}/approvals", decide)
